"""``distflow-jax sft``: a tiny task of its own learns, resumes bitwise, refuses bad input."""

import json
import os
import random

import numpy as np
import pytest

from distflow_jax import cli
from workflow_util import smoke_overrides

SHAPE = ["model.preset=micro", "data.max_prompt_len=40", "rollout.prefill_buckets=(40,)",
         "rollout.max_new_tokens=8", "rollout.max_concurrent_decodes=8"]


def add_rows(n: int, seed: int = 0) -> list[dict]:
  """'a+b=' -> '#### a+b' over digits: learnable in a few dozen steps, verifiable."""
  r = random.Random(seed)
  return [{"prompt": f"{a}+{b}=", "answer": f"#### {a + b}"}
          for a, b in ((r.randint(0, 9), r.randint(0, 9)) for _ in range(n))]


def write_jsonl(path, rows) -> str:
  with open(path, "w") as f:
    f.writelines(json.dumps(r) + "\n" for r in rows)
  return str(path)


def sft_args(tmp_path, data, *extra):
  return (["sft", f"--config.data.train={data}", f"--config.run_dir={tmp_path / 'run'}"]
          + [f"--config.{o}" for o in SHAPE] + list(extra))


def metrics(tmp_path) -> list[dict]:
  with open(tmp_path / "run" / "sft" / "metrics.jsonl") as f:
    return [json.loads(l) for l in f]


@pytest.mark.slow
def test_sft_lowers_heldout_loss_and_writes_a_model_train_accepts(tmp_path, capsys):
  data = write_jsonl(tmp_path / "add.jsonl", add_rows(300))
  out = tmp_path / "model"
  rc = cli.main(sft_args(tmp_path, data, "--config.sft.steps=30", "--config.sft.lr=3e-3",
                         "--config.sft.warmup_steps=3", "--config.sft.eval_every=15",
                         "--config.sft.eval_size=24", f"--config.sft.out={out}"))
  assert rc == 0, capsys.readouterr().err
  rows = metrics(tmp_path)
  evals = [r for r in rows if "eval/loss" in r]
  assert [r["step"] for r in evals] == [0, 15, 30]
  assert evals[-1]["eval/loss"] < 0.5 * evals[0]["eval/loss"]
  assert "eval/accuracy" in evals[-1]  # the answers carry '#### N': greedy accuracy too
  assert [r["step"] for r in rows if "loss" in r] == list(range(1, 31))
  for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
    assert (out / name).is_file(), name
  from distflow_jax.models import hf_io
  model = hf_io.load_pretrained(str(out))
  assert model.cfg.vocab_size > 0
  # The folder is a model path `train` accepts: one GRPO step from it.
  rc = cli.main(["train", "--debug"] + [f"--config.{o}" for o in smoke_overrides(
      tmp_path / "rl", f"model.path={out}", "trainer.total_steps=1")])
  assert rc == 0, capsys.readouterr().err


def test_chat_messages_train_on_every_assistant_turn(tmp_path, capsys):
  from distflow_jax.models.tokenizer import Tokenizer
  from distflow_jax.warmstart import sft_data
  conv = {"messages": [{"role": "system", "content": "Add."},
                       {"role": "user", "content": "1+2="}, {"role": "assistant", "content": "3"},
                       {"role": "user", "content": "and +4?"},
                       {"role": "assistant", "content": "7"}]}
  path = write_jsonl(tmp_path / "chat.jsonl", [conv] * 40)
  cfg_data = type("D", (), {"prompt_key": "prompt", "answer_key": "answer"})
  bad = sft_data.BadRows("error", print)
  pairs, rows = sft_data.read_pairs(path, cfg_data, bad)
  assert rows == 40 and len(pairs) == 80
  assert [m["role"] for m in pairs[0].prompt] == ["system", "user"]
  assert pairs[1].completion == "7" and pairs[1].prompt[-1]["content"] == "and +4?"
  from distflow_jax.config import loading
  cfg = loading.load("grpo:tiny", SHAPE + ["data.chat_template=True"])
  enc = sft_data.encode(pairs[:2], Tokenizer.builtin(), cfg, bad)
  tok = Tokenizer.builtin()
  first = enc.data["response_tokens"][0][enc.data["response_mask"][0]].tolist()
  assert first == tok.encode("3") + [tok.eos_id]  # only the assistant turn is a target
  prompt = enc.data["prompt_tokens"][1][enc.data["prompt_mask"][1]].tolist()
  assert prompt == tok.encode(tok.apply_chat_template(pairs[1].prompt))  # turns 1-3 + cue
  rc = cli.main(sft_args(tmp_path, path, "--config.data.chat_template=True",
                         "--config.sft.steps=4", "--config.sft.warmup_steps=1",
                         "--config.sft.batch_size=8", "--config.sft.eval_every=0",
                         "--config.sft.eval_size=8"))
  assert rc == 0, capsys.readouterr().err
  assert os.path.isfile(tmp_path / "run" / "sft" / "model" / "model.safetensors")
  # Continued from that Hugging Face folder, held out on another file.
  model, again = tmp_path / "run" / "sft" / "model", tmp_path / "again"
  rc = cli.main(sft_args(again, path, "--config.data.chat_template=True",
                         f"--config.model.path={model}", f"--eval_data={path}",
                         "--config.sft.steps=2", "--config.sft.warmup_steps=0",
                         "--config.sft.batch_size=8", "--config.sft.eval_every=1",
                         "--config.sft.eval_size=4"))
  assert rc == 0, capsys.readouterr().err
  assert [r["step"] for r in metrics(again) if "eval/loss" in r] == [0, 1, 2]


@pytest.mark.slow
def test_resumed_sft_continues_bitwise(tmp_path, monkeypatch, capsys):
  # Plain answers: no accuracy evaluation (its generation adds compile time, not coverage).
  data = write_jsonl(tmp_path / "add.jsonl", [dict(r, answer=r["answer"][5:])
                                              for r in add_rows(120)])
  common = ["--config.sft.steps=10", "--config.sft.warmup_steps=2", "--config.sft.lr=3e-3",
            "--config.sft.batch_size=8", "--config.sft.save_every=4", "--config.sft.eval_every=5",
            "--config.sft.eval_size=8", "--config.trainer.async_save=False"]
  whole, parts = tmp_path / "whole", tmp_path / "parts"
  whole.mkdir(), parts.mkdir()
  assert cli.main(sft_args(whole, data, *common)) == 0, capsys.readouterr().err
  from distflow_jax.persist import checkpoint
  save = checkpoint.Checkpointer.save

  def crash_after_step_4(self, step, *a, **kw):  # the process dies once step 4 is saved
    save(self, step, *a, **kw)
    if step == 4:
      self.wait()
      raise RuntimeError("killed")
  monkeypatch.setattr(checkpoint.Checkpointer, "save", crash_after_step_4)
  assert cli.main(sft_args(parts, data, *common)) == 1
  monkeypatch.undo()
  assert cli.main(sft_args(parts, data, *common, "--resume")) == 0, capsys.readouterr().err
  assert "resumed from" in capsys.readouterr().out
  weights = [(d / "run" / "sft" / "model" / "model.safetensors").read_bytes()
             for d in (whole, parts)]
  assert weights[0] == weights[1]
  assert metrics(whole) == metrics(parts)


def test_warm_start_is_the_sft_loop_unchanged(tmp_path):
  """The warm start's model is bit for bit what the loop it had before the SFT command
  made (that loop, kept here as the reference)."""
  import jax
  import optax
  from jax.sharding import NamedSharding, PartitionSpec as P

  from distflow_jax.config import loading
  from distflow_jax.dag.spec import Role
  from distflow_jax.tasks import registry as tasks
  from distflow_jax.train import placement, steps as steps_lib
  from distflow_jax.run import setup
  from distflow_jax.warmstart import text as warmstart
  cfg = loading.load("grpo:tiny", SHAPE + [f"run_dir={tmp_path}"])
  state = setup.prepare_run(cfg, roles="actor").ctx.roles[Role.ACTOR]
  task, level = tasks.parse(cfg.data.train)
  data = warmstart.encode_examples(task.demonstrations(level, 96, seed=0), state_tok(cfg),
                                   max_prompt_len=40, max_new_tokens=40, use_chat_template=False)
  fresh = lambda: jax.tree.map(lambda x: x.copy(), state.params)  # noqa: E731
  steps, bs, lr = 12, 16, 1e-3
  tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(
      optax.warmup_cosine_decay_schedule(0.0, lr, max(steps // 10, 1), steps), weight_decay=0.0))
  params, opt = fresh(), None
  opt = placement.init_opt_state(tx, params)
  step_fn = steps_lib.make_train_step(warmstart.sft_loss, state.graphdef, tx, 1, "token-mean")
  sharding = NamedSharding(state.mesh, P(tuple(a for a in ("data", "fsdp")
                                              if a in state.mesh.axis_names)))
  rng, n = np.random.default_rng(0), len(data["response_mask"])
  order, pos = rng.permutation(n), 0
  for _ in range(steps):
    if pos + bs > n:
      order, pos = rng.permutation(n), 0
    idx = np.sort(order[pos:pos + bs])
    pos += bs
    params, opt, _ = step_fn(params, opt, {k: jax.device_put(v[idx], sharding)
                                           for k, v in data.items()})
  state.params = fresh()
  warmstart.run(state, data, steps=steps, batch_size=bs, lr=lr, seed=0)
  for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(state.params)):
    assert np.array_equal(np.asarray(a), np.asarray(b))


def state_tok(cfg):
  from distflow_jax.state import roles
  return roles.load_tokenizer(cfg.model)


@pytest.mark.parametrize("case, extra, pattern", [
    ("no_answer", [], r"add\.jsonl:1: no 'answer' field"),
    ("empty", [], r"has no rows"),
    ("long_prompt", [], r"0 usable training example.*too_long.*prompt tokens > .*max_prompt_len"),
    ("long_answer", [], r"too_long.*completion tokens \(with EOS\) > rollout\.max_new_tokens 8"),
    ("bad_row_error", ["--config.data.on_bad_row=error"], r"add\.jsonl:3: no 'answer' field"),
    ("builtin", [], r"set --config\.data\.train=FILE"),
    ("missing_file", [], r"sft data .*nope\.jsonl.*does not exist"),
    ("warmup", ["--config.sft.warmup_steps=50", "--config.sft.steps=10"],
     r"sft\.warmup_steps=50 must be below sft\.steps=10"),
    ("batch", ["--config.sft.batch_size=500"], r"fewer than sft\.batch_size=500"),
])
def test_bad_input_is_one_line_exit_2(tmp_path, capsys, case, extra, pattern):
  import re
  rows = add_rows(40)
  if case == "no_answer":
    rows = [{"prompt": r["prompt"]} for r in rows]
  elif case == "empty":
    rows = []
  elif case == "long_prompt":
    rows = [{"prompt": "1+" * 40, "answer": "#### 1"}] * 40
  elif case == "long_answer":
    rows = [dict(r, answer="#### " + "9" * 20) for r in rows]
  elif case == "bad_row_error":
    rows[2] = {"prompt": "1+1="}
  data = write_jsonl(tmp_path / "add.jsonl", rows)
  data = {"builtin": "builtin:arithmetic", "missing_file": str(tmp_path / "nope.jsonl")
          }.get(case, data)
  rc = cli.main(sft_args(tmp_path, data, "--config.sft.steps=10", "--config.sft.warmup_steps=1",
                         "--config.sft.eval_size=4", *extra))
  err = capsys.readouterr().err.strip()
  assert rc == 2, err
  assert len(err.splitlines()) == 1 and re.search(pattern, err), err


@pytest.mark.timeout(60)
def test_warm_start_leaves_out_demonstrations_longer_than_max_new_tokens():
  """A demonstration longer than rollout.max_new_tokens is left out, never cut and given an
  EOS (that taught the model to stop mid-answer), and the run says so in one line with the
  length that fits them all."""
  from distflow_jax.models.tokenizer import Tokenizer
  from distflow_jax.warmstart import text as warmstart
  tok = Tokenizer.builtin()
  recs = [{"prompt": "q", "completion": "1 + 2 = 3\n#### 3"},
          {"prompt": "q", "completion": "12 + 14 = 26\n26 - 7 = 19\n#### 19"}]
  sizes = [len(tok.encode(r["completion"])) + 1 for r in recs]
  logs = []
  kept, outs = warmstart.fitting_demonstrations(recs, tok, sizes[1], logs.append)
  assert kept == recs and [len(o) for o in outs] == sizes and not logs
  kept, outs = warmstart.fitting_demonstrations(recs, tok, sizes[0], logs.append)
  assert kept == recs[:1] and outs == [tok.encode(recs[0]["completion"]) + [tok.eos_id]]
  assert len(logs) == 1 and "\n" not in logs[0], logs
  assert "1 of 2 warm-start demonstrations are longer than " \
         f"rollout.max_new_tokens={sizes[0]}" in logs[0]
  assert f"raise rollout.max_new_tokens to {sizes[1]}" in logs[0]
