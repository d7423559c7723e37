"""A corpus of bad data, model and reward inputs (issue 36), through the real command line
(``cli.main``), in the style of test_bad_inputs_corpus.py: each case is something that was
silently wrong (a good-looking run on bad input) or a raw traceback, and must now end in
ONE line on stderr naming the culprit, exit code 2, no traceback.
"""

from __future__ import annotations

import json

import pytest
from distflow_jax import cli
from test_bad_inputs_corpus import assert_one_line, config_file, run
from workflow_util import tiny_model_folder


def _train(capsys, tmp_path, *extra: str, config: str = "grpo:tiny") -> tuple[int, str]:
  """One tiny GRPO step of the tiny model folder; ``extra`` flags last."""
  return run(capsys, "train", f"--config={config}", f"--config.run_dir={tmp_path}/run",
             f"--config.model.path={tiny_model_folder(tmp_path)}", "--config.data.eval=",
             "--config.data.prompts_per_step=8", "--config.rollout.n=2",
             "--config.rollout.max_new_tokens=8", "--config.actor.micro_batch_size=1",
             "--config.trainer.eval_every=0", "--config.trainer.total_steps=1",
             "--config.trainer.save_every=0", *extra)


# --- rewards: a score must be a real number, finite as the float32 the batch keeps --------

@pytest.mark.timeout(300)
@pytest.mark.parametrize("node, needle", [
    ("reward.huge", "reward function 'huge_reward' returned 1e+300"),
    ("reward.text", "reward function 'text_reward' returned '1.0' (str)"),
])
def test_plugin_reward_that_is_not_a_finite_float32_is_refused(tmp_path, capsys, node, needle):
  config = config_file(tmp_path, f"""
      c.plugins = ("plugin_bad_reward",)
      c.dag[1]["fn"] = "{node}"
      """)
  code, err = _train(capsys, tmp_path, "--config.data.train=builtin:arithmetic",
                     config=config)
  assert code == 2, err
  assert_one_line(err, "distflow-jax train: error:", needle, "sample id")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("key", ["reward.weight", "reward.correct"])
def test_plan_refuses_a_reward_setting_beyond_float32(capsys, key):
  code, err = run(capsys, "plan", "--config=grpo:tiny", f"--config.{key}=1e39")
  assert code == 2, err
  assert_one_line(err, "distflow-jax plan: error:", f"{key}=1e+39", "float32")


# --- empty answers: nothing to score against is a bad row, like a missing answer ----------

def _rows(path, rows) -> str:
  path.write_text("".join(json.dumps(r) + "\n" for r in rows))
  return str(path)


def _arith(n: int, answer=lambda i: f"#### {i + 1}") -> list[dict]:
  return [{"prompt": f"What is {i} + 1?", "answer": answer(i)} for i in range(n)]


@pytest.mark.timeout(300)
def test_train_refuses_a_file_whose_answers_are_all_empty(tmp_path, capsys):
  data = _rows(tmp_path / "empty.jsonl", _arith(16, lambda i: "" if i % 2 else "  "))
  code, err = _train(capsys, tmp_path, f"--config.data.train={data}")
  assert code == 2, err
  assert_one_line(err, "distflow-jax train: error:", data, "empty_answer", "'answer'")


@pytest.mark.timeout(300)
def test_eval_names_the_row_with_an_empty_answer(tmp_path, capsys):
  data = _rows(tmp_path / "eval.jsonl", _arith(6) + [{"prompt": "What is 9 + 1?",
                                                      "answer": ""}] + _arith(2))
  code, err = run(capsys, "eval", f"--model={tiny_model_folder(tmp_path)}", f"--data={data}",
                  "--config.data.on_bad_row=error")
  assert code == 2, err
  assert_one_line(err, "distflow-jax eval: error:", f"{data}:7: empty_answer", "'answer'")


@pytest.mark.timeout(300)
def test_train_counts_empty_answers_as_bad_rows(tmp_path, capsys):
  data = _rows(tmp_path / "mixed.jsonl", _arith(8) + _arith(8, lambda i: ""))
  code, err = _train(capsys, tmp_path, f"--config.data.train={data}",
                     "--config.data.shuffle_seed=0")
  assert code == 0, err
  with open(tmp_path / "run" / "metrics.jsonl") as f:
    step = [json.loads(l) for l in f][-1]
  assert step["data/bad_rows"] > 0, step


SFT_SHAPE = ["--config.model.preset=micro", "--config.sft.steps=2", "--config.sft.batch_size=8",
             "--config.sft.warmup_steps=1", "--config.sft.eval_every=0", "--config.sft.eval_size=0"]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("rows, needle", [
    (_arith(8, lambda i: " "), "'answer' is empty"),
    ([{"messages": [{"role": "user", "content": "1+1="},
                    {"role": "assistant", "content": ""}]}] * 8, "every assistant turn is empty"),
])
def test_sft_refuses_data_whose_targets_are_all_empty(tmp_path, capsys, rows, needle):
  data = _rows(tmp_path / "sft.jsonl", rows)
  code, err = run(capsys, "sft", f"--config.data.train={data}",
                  f"--config.run_dir={tmp_path}/run", *SFT_SHAPE)
  assert code == 2, err
  assert_one_line(err, "distflow-jax sft: error:", data, "0 usable", needle)


# --- data files that cannot be read at all: one line naming the file -----------------------

def _parquet(path, rows) -> bytes:
  import pyarrow as pa
  import pyarrow.parquet as pq
  pq.write_table(pa.Table.from_pylist(rows), str(path), compression="snappy")
  return path.read_bytes()


def _corrupt(raw: bytes) -> bytes:
  """A Parquet file whose compressed pages are scrambled: the footer still reads."""
  out = bytearray(raw)
  for i in range(100, min(400, len(out) - 200)):
    out[i] ^= 0x5A
  return bytes(out)


UNREADABLE = {  # name -> (file name, bytes from a good Parquet file's bytes, what the line says)
    "garbage_parquet": ("d.parquet", lambda good: b"\x00garbage\xff" * 300, "not a readable Parquet"),
    "truncated_parquet": ("d.parquet", lambda good: good[:len(good) // 2], "not a readable Parquet"),
    "empty_parquet": ("d.parquet", lambda good: b"", "not a readable Parquet"),
    "corrupt_snappy_parquet": ("d.parquet", _corrupt, "not a readable Parquet"),
    "empty_jsonl": ("d.jsonl", lambda good: b"", "has no rows"),
    "blank_jsonl": ("d.jsonl", lambda good: b"\n  \n\n", "has no rows"),
    "csv": ("d.csv", lambda good: b"prompt,answer\nhi,1\n", "unknown suffix '.csv'"),
}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", sorted(UNREADABLE))
def test_eval_refuses_an_unreadable_data_file(tmp_path, capsys, case):
  name, damage, needle = UNREADABLE[case]
  good = _parquet(tmp_path / "good.parquet", [
      {"prompt": f"What is {i} + 1? " * 8, "answer": f"#### {i + 1}"} for i in range(64)])
  data = tmp_path / name
  data.write_bytes(damage(good))
  code, err = run(capsys, "eval", f"--model={tiny_model_folder(tmp_path)}", f"--data={data}")
  assert code == 2, err
  assert_one_line(err, "distflow-jax eval: error:", str(data), needle)


@pytest.mark.timeout(300)
def test_train_refuses_a_corrupt_parquet_file(tmp_path, capsys):
  data = tmp_path / "train.parquet"
  data.write_bytes(_corrupt(_parquet(data, _arith(64))))
  code, err = _train(capsys, tmp_path, f"--config.data.train={data}")
  assert code == 2, err
  assert_one_line(err, "distflow-jax train: error:", str(data), "not a readable Parquet")


@pytest.mark.timeout(300)
def test_sft_refuses_a_truncated_parquet_file(tmp_path, capsys):
  data = tmp_path / "sft.parquet"
  data.write_bytes(_parquet(data, _arith(64))[:300])
  code, err = run(capsys, "sft", f"--config.data.train={data}",
                  f"--config.run_dir={tmp_path}/run", *SFT_SHAPE)
  assert code == 2, err
  assert_one_line(err, "distflow-jax sft: error:", str(data), "not a readable Parquet")


# --- image rows: an empty image list, and paths out of the image root ---------------------

VL_EVAL = ["--config.data.image_key=image", "--config.rollout.backend=reference",
           "--config.data.max_prompt_len=96", "--config.rollout.prefill_buckets=(96,)",
           "--config.rollout.max_new_tokens=4", "--config.model.max_seq_len=128"]


@pytest.fixture(scope="module")
def vl_setup(tmp_path_factory):
  """A tiny Qwen2.5-VL folder and a data folder of shapes rows whose images are PNG files
  beside the data file (img<i>.png), plus one PNG outside it (outside.png)."""
  import base64
  from distflow_jax.tasks import registry as tasks
  from test_vl_rl import tiny_vl_checkpoint
  root = tmp_path_factory.mktemp("vl")
  ckpt = tiny_vl_checkpoint(root / "model")
  rows = tasks.get("shapes").generate_split("basic", "eval", 4, seed=0)
  (root / "data").mkdir()
  png = [base64.b64decode(r["image"].split(",", 1)[1]) for r in rows]
  for i, data in enumerate(png):
    (root / "data" / f"img{i}.png").write_bytes(data)
  (root / "outside.png").write_bytes(png[0])
  return str(ckpt), root, [dict(r, image=f"img{i}.png") for i, r in enumerate(rows)]


def _vl_eval(capsys, vl_setup, third_image, *extra):
  """eval of the 4 shapes rows with the third row's image replaced by ``third_image``."""
  ckpt, root, rows = vl_setup
  rows = rows[:2] + [dict(rows[2], image=third_image)] + rows[3:]
  data = _rows(root / "data" / "eval.jsonl", rows)
  code = cli.main(["eval", f"--model={ckpt}", f"--data={data}", *VL_EVAL, *extra])
  out = capsys.readouterr()
  return data, code, out.err, out.out


@pytest.mark.timeout(300)
@pytest.mark.parametrize("image, needle", [
    ([], "holds no image"),
    ("../outside.png", "outside the image root"),
    ("../../../../../../../etc/passwd", "outside the image root"),
    ("ABSOLUTE_OUTSIDE", "outside the image root"),
])
def test_eval_names_an_image_row_that_is_empty_or_out_of_its_folder(
    capsys, vl_setup, image, needle):
  if image == "ABSOLUTE_OUTSIDE":
    image = str(vl_setup[1] / "outside.png")
  data, code, err, _ = _vl_eval(capsys, vl_setup, image, "--config.data.on_bad_row=error")
  assert code == 2, err
  assert_one_line(err, "distflow-jax eval: error:", f"{data}:3: bad_image", "'image'", needle)


@pytest.mark.timeout(300)
def test_eval_skips_and_counts_an_empty_image_list(capsys, vl_setup):
  _, code, err, out = _vl_eval(capsys, vl_setup, [])
  assert code == 0, err
  assert "prompts: 3" in out and "skipped_rows: 1" in out, out


@pytest.mark.timeout(300)
def test_absolute_image_paths_inside_the_root_are_read(capsys, vl_setup):
  """An absolute path under the data file's folder is read; one under data.image_root too,
  relative paths then being read from that root."""
  _, code, err, _ = _vl_eval(capsys, vl_setup, str(vl_setup[1] / "data" / "img2.png"),
                             "--config.data.on_bad_row=error")
  assert code == 0, err
  _, code, err, out = _vl_eval(capsys, vl_setup, "data/img2.png",
                               "--config.data.on_bad_row=skip",
                               f"--config.data.image_root={vl_setup[1]}")
  assert code == 0, err
  assert "prompts: 1" in out and "skipped_rows: 3" in out, out  # img<i>.png are not at the root


# --- a DAG that trains only the critic: nothing would change the policy ------------------

@pytest.mark.timeout(120)
def test_plan_refuses_a_dag_that_trains_only_the_critic(tmp_path, capsys):
  config = config_file(tmp_path, """
      c.dag = [dict(id="generate", fn="generate"),
               dict(id="reward", fn="reward.math", deps=["generate"]),
               dict(id="values", fn="values", deps=["generate"]),
               dict(id="advantage", fn="advantage.gae", deps=["reward", "values"]),
               dict(id="train_critic", fn="train.critic", deps=["advantage", "values"])]
      c.critic.micro_batch_size = 4
      """)
  code, err = run(capsys, "plan", f"--config={config}")
  assert code == 2, err
  assert_one_line(err, "distflow-jax plan: error:", "'train_critic'", "no node trains the actor",
                  "train.actor")


# --- token budgets: between the longest sample and what a micro-batch could ever hold -----

@pytest.mark.timeout(120)
@pytest.mark.parametrize("key, value, needle", [
    ("actor.micro_batch_tokens", "1000000000000", "more than one micro-batch could ever hold"),
    ("actor.micro_batch_tokens", "1", "below the longest sample"),
    ("critic.micro_batch_tokens", "1000000000000", "more than one micro-batch could ever hold"),
    ("critic.micro_batch_tokens", "8", "below the longest sample"),
])
def test_plan_bounds_the_token_budget(capsys, key, value, needle):
  code, err = run(capsys, "plan", "--config=ppo:tiny", "--config.model.pack_sequences=True",
                  f"--config.{key}={value}")
  assert code == 2, err
  assert_one_line(err, "distflow-jax plan: error:", f"{key}=", needle)


def test_out_of_memory_advice_names_the_token_budget():
  from distflow_jax.config import loading
  from distflow_jax.observe import hints
  cfg = loading.load("ppo:tiny", ["model.pack_sequences=True", "actor.micro_batch_tokens=96",
                                  "critic.micro_batch_tokens=128"])
  hint = hints.oom_hint(MemoryError("RESOURCE_EXHAUSTED: Out of memory"), cfg)
  assert "--config.actor.micro_batch_tokens=96" in hint, hint
  assert "--config.critic.micro_batch_tokens=128" in hint, hint
  assert "micro_batch_size" not in hint, hint  # unused with a token budget
  plain = hints.oom_hint(MemoryError(), loading.load("grpo:tiny"))
  assert "--config.actor.micro_batch_size=" in plain and "critic" not in plain, plain


# --- weights that are not finite: refused when loaded, naming where ----------------------

def _poisoned_folder(tmp_path, value: float) -> tuple[str, str]:
  """The tiny model folder with one value of one tensor set to ``value``; (folder, tensor)."""
  import numpy as np
  from safetensors.numpy import load_file, save_file
  folder = tiny_model_folder(tmp_path)
  weights = f"{folder}/model.safetensors"
  tensors = load_file(weights)
  name = sorted(k for k in tensors if k.endswith("mlp.down_proj.weight"))[0]
  tensors[name] = tensors[name].copy()
  tensors[name].reshape(-1)[7] = np.asarray(value, tensors[name].dtype)
  save_file(tensors, weights, metadata={"format": "pt"})
  return folder, name


@pytest.mark.timeout(300)
@pytest.mark.parametrize("command, value", [("eval", float("nan")), ("generate", float("inf"))])
def test_a_model_folder_with_non_finite_weights_is_refused(tmp_path, capsys, command, value):
  folder, tensor = _poisoned_folder(tmp_path, value)
  data = _rows(tmp_path / "d.jsonl", _arith(4))
  args = ([f"--data={data}"] if command == "eval" else
          [f"--prompts={data}", f"--out={tmp_path}/out.jsonl"])
  code, err = run(capsys, command, f"--model={folder}", *args)
  assert code == 2, err
  assert_one_line(err, f"distflow-jax {command}: error:", f"{folder}/model.safetensors",
                  repr(tensor), "non-finite")


@pytest.mark.timeout(300)
def test_a_checkpoint_with_non_finite_weights_is_refused_by_export_and_eval(
    tmp_path, capsys, monkeypatch):
  """A diverged run's saved actor (simulated: one array of the restored step set to NaN)."""
  import numpy as np
  from distflow_jax.persist import checkpoint
  code, err = _train(capsys, tmp_path, "--config.data.train=builtin:arithmetic",
                     "--config.trainer.save_every=1", "--config.trainer.async_save=False")
  assert code == 0, err
  read = checkpoint.read_arrays

  def poisoned(*a, **k):
    step, arrays, meta = read(*a, **k)
    name = sorted(n for n in arrays if n.startswith("actor.params.") and "mlp" in n)[0]
    arrays[name] = np.full(np.shape(arrays[name]), np.nan, np.asarray(arrays[name]).dtype)
    return step, arrays, meta
  monkeypatch.setattr(checkpoint, "read_arrays", poisoned)
  run_dir = f"{tmp_path}/run"
  code, err = run(capsys, "export", "--checkpoint", run_dir, "--out", f"{tmp_path}/hf")
  assert code == 2, err
  assert_one_line(err, "distflow-jax export: error:", f"checkpoint {run_dir}", "actor.params.",
                  "non-finite")
  data = _rows(tmp_path / "d.jsonl", _arith(4))
  code, err = run(capsys, "eval", f"--model={run_dir}", f"--data={data}")
  assert code == 2, err
  assert_one_line(err, "distflow-jax eval: error:", f"checkpoint {run_dir}", "non-finite")
