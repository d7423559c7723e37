"""A LoRA run's adapters in the ecosystem's files (issue 34): `export --lora=adapter|merged` of a
trained LoRA run, `eval` / `generate` from a LoRA run, `model.lora.path` from a PEFT folder, and
(marked `hf`) parity with `peft` + `transformers` both ways at 1e-4 in float32.

The runs are `sft` with LoRA on a tiny random Qwen2 folder (the SFT loss moves the adapters at
every step, so `lora_b` is non-zero after a few) through the real command line."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from distflow_jax import cli

pytestmark = pytest.mark.timeout(600)
RANK, ALPHA = 4, 8.0
LORA = ["--config.model.lora.enabled=True", f"--config.model.lora.rank={RANK}",
        f"--config.model.lora.alpha={ALPHA}"]


def rows(n: int = 24) -> list[dict]:
  return [{"prompt": f"{a}+{b}=", "answer": f"#### {a + b}"}
          for a, b in ((i % 7, (3 * i) % 5) for i in range(n))]


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
  """A tiny random float32 Qwen2 folder written by `transformers`, with the built-in
  tokenizer (whose ids fit its vocabulary)."""
  torch = pytest.importorskip("torch", reason="needs the hf extra")
  transformers = pytest.importorskip("transformers", reason="needs the hf extra")
  from distflow_jax.models.tokenizer import Tokenizer
  config = transformers.Qwen2Config(vocab_size=128, hidden_size=32, intermediate_size=64,
                                    num_hidden_layers=2, num_attention_heads=4,
                                    num_key_value_heads=2, rope_theta=1000.0,
                                    max_position_embeddings=256, tie_word_embeddings=True)
  torch.manual_seed(0)
  model = transformers.Qwen2ForCausalLM(config).eval()
  with torch.no_grad():
    for name, p in model.named_parameters():
      p.copy_(1.0 + 0.2 * torch.randn_like(p) if "norm" in name else 0.2 * torch.randn_like(p))
  path = tmp_path_factory.mktemp("qwen2") / "base"
  model.save_pretrained(str(path), safe_serialization=True)
  Tokenizer.builtin().save(str(path))
  return path


def sft_lora(tmp_path, base, *extra) -> str:
  """Three LoRA SFT steps from ``base``; returns the run dir."""
  data = tmp_path / "sft.jsonl"
  data.write_text("".join(json.dumps(r) + "\n" for r in rows()))
  run_dir = tmp_path / "run"
  code = cli.main(["sft", f"--config.data.train={data}", f"--config.run_dir={run_dir}",
                   f"--config.model.path={base}", "--config.model.dtype=float32", *LORA,
                   "--config.sft.steps=3", "--config.sft.lr=3e-2", "--config.sft.warmup_steps=0",
                   "--config.sft.batch_size=8", "--config.sft.eval_every=0",
                   "--config.sft.eval_size=4", "--config.trainer.async_save=False",
                   "--config.data.max_prompt_len=16", "--config.rollout.max_new_tokens=8",
                   *extra])
  assert code == 0
  return str(run_dir / "sft")


@pytest.fixture(scope="module")
def lora_run(qwen, tmp_path_factory):
  return sft_lora(tmp_path_factory.mktemp("lora_run"), qwen)


def our_logits(model, tokens):
  import jax.numpy as jnp
  positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
  return np.asarray(model(jnp.asarray(tokens, jnp.int32), positions)[0], np.float32)


def hf_logits(model, tokens):
  import torch
  with torch.no_grad():
    return model(input_ids=torch.tensor(tokens)).logits.numpy()


def hf_model(path):
  import torch
  import transformers
  return transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32,
                                                           attn_implementation="eager").eval()


def run_actor(run_dir):
  """Our actor of the run's latest checkpoint: base + adapters, not merged."""
  from distflow_jax.persist import checkpoint, lora_actor
  root, step = checkpoint.resolve(run_dir)
  step, arrays, meta = checkpoint.read_arrays(root, step)
  return lora_actor.load(arrays, meta, f"checkpoint {root}/{step}", root)


TOKENS = np.random.default_rng(1).integers(0, 104, (2, 12))


@pytest.mark.hf
def test_exported_adapter_through_peft_and_merged_folder_match_our_logits(lora_run, qwen,
                                                                          tmp_path, capsys):
  import peft
  from distflow_jax.models import lora
  actor = run_actor(lora_run)
  assert actor.base_path == str(qwen)
  b = [v[1] for v in lora.adapter_arrays(actor.model).values()]
  assert max(np.abs(x).max() for x in b) > 1e-3  # trained: the adapters do something
  ours = our_logits(actor.model, TOKENS)
  assert cli.main(["export", f"--checkpoint={lora_run}", f"--out={tmp_path}/adapter",
                   "--lora=adapter"]) == 0, capsys.readouterr().err
  files = sorted(os.listdir(tmp_path / "adapter"))
  assert files == ["adapter_config.json", "adapter_model.safetensors"], files
  cfg = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
  assert (cfg["r"], cfg["lora_alpha"], cfg["base_model_name_or_path"]) == (RANK, ALPHA,
                                                                           str(qwen))
  plain = hf_logits(hf_model(qwen), TOKENS)
  through_peft = hf_logits(peft.PeftModel.from_pretrained(hf_model(qwen),
                                                          str(tmp_path / "adapter")), TOKENS)
  np.testing.assert_allclose(through_peft, ours, atol=1e-4, rtol=1e-4)
  assert np.abs(through_peft - plain).max() > 1e-3
  # Merged is the default for a LoRA run: a plain folder transformers loads.
  assert cli.main(["export", f"--checkpoint={lora_run}", f"--out={tmp_path}/merged"]) == 0
  assert {"config.json", "model.safetensors", "tokenizer.json"} <= set(
      os.listdir(tmp_path / "merged"))
  np.testing.assert_allclose(hf_logits(hf_model(tmp_path / "merged"), TOKENS), ours,
                             atol=1e-4, rtol=1e-4)
  # sft's own output folder (sft.out) is the merged model too.
  np.testing.assert_allclose(hf_logits(hf_model(os.path.join(lora_run, "model")), TOKENS), ours,
                             atol=1e-4, rtol=1e-4)


@pytest.mark.hf
def test_a_peft_adapter_as_model_lora_path_gives_peft_logits(qwen, tmp_path):
  import peft
  import torch
  from distflow_jax.config import loading
  from distflow_jax.dag.spec import Role
  from distflow_jax.run.setup import prepare_run
  from flax import nnx
  config = peft.LoraConfig(r=RANK, lora_alpha=ALPHA, lora_dropout=0.0, task_type="CAUSAL_LM",
                           target_modules=["q_proj", "k_proj", "v_proj", "o_proj",
                                           "gate_proj", "up_proj", "down_proj"])
  made = peft.get_peft_model(hf_model(qwen), config)
  torch.manual_seed(3)
  with torch.no_grad():
    for name, p in made.named_parameters():
      if "lora_" in name:
        p.copy_(0.3 * torch.randn_like(p))  # lora_B non-zero: the adapter does something
  made.save_pretrained(str(tmp_path / "adapter"))
  theirs = hf_logits(peft.PeftModel.from_pretrained(hf_model(qwen), str(tmp_path / "adapter")),
                     TOKENS)
  cfg = loading.load("grpo:tiny", [f"run_dir={tmp_path}/run", f"model.path={qwen}",
                                   "model.dtype=float32", "model.lora.enabled=True",
                                   f"model.lora.rank={RANK}", f"model.lora.alpha={ALPHA}",
                                   f"model.lora.path={tmp_path / 'adapter'}"])
  state = prepare_run(cfg, roles="actor", log=lambda m: None).ctx.roles[Role.ACTOR]
  ours = our_logits(nnx.merge(state.graphdef, state.params), TOKENS)
  np.testing.assert_allclose(ours, theirs, atol=1e-4, rtol=1e-4)
  assert np.abs(theirs - hf_logits(hf_model(qwen), TOKENS)).max() > 1e-2


# ---- a GRPO LoRA run on the built-in model: its base is the run's warm start ------------------

# Every role on the first simulated device: these runs test the files, not a layout, and one
# device compiles fastest.
ONE_DEVICE = [f"--config.placement.{r}.devices=0:1" for r in ("actor", "reference", "critic",
                                                             "reward")]


def test_grpo_lora_run_exports_on_its_warm_start_and_eval_generate_read_it(tmp_path, capsys):
  from workflow_util import SMOKE
  run_dir = tmp_path / "run"
  code = cli.main(["train", "--config=grpo:tiny_lora", f"--config.run_dir={run_dir}",
                   *[f"--config.{o}" for o in SMOKE if not o.startswith("trainer.total_steps")],
                   "--config.trainer.total_steps=1", *ONE_DEVICE])
  assert code == 0, capsys.readouterr().err
  assert cli.main(["export", f"--checkpoint={run_dir}", f"--out={tmp_path}/adapter",
                   "--lora=adapter"]) == 0, capsys.readouterr().err
  cfg = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
  assert cfg["base_model_name_or_path"] == str(run_dir / "warmstart")
  assert (cfg["r"], cfg["lora_alpha"]) == (8, 16.0)
  assert sorted(cfg["target_modules"]) == sorted(["q_proj", "k_proj", "v_proj", "o_proj",
                                                  "gate_proj", "up_proj", "down_proj"])
  assert cli.main(["export", f"--checkpoint={run_dir}", f"--out={tmp_path}/merged"]) == 0
  assert "exported the actor of step 1" in capsys.readouterr().out
  prompts = tmp_path / "p.jsonl"
  prompts.write_text(json.dumps({"prompt": "What is 2+3?"}) + "\n"
                     + json.dumps({"prompt": "What is 4+4?"}) + "\n")
  outs = []
  for i, model in enumerate((tmp_path / "merged", run_dir)):
    out = tmp_path / f"gen{i}.jsonl"
    assert cli.main(["generate", f"--model={model}", f"--prompts={prompts}", f"--out={out}",
                     "--n=1", "--max_new_tokens=6", "--config.rollout.temperature=0",
                     "--config.data.chat_template=True"]) == 0, capsys.readouterr().err
    outs.append([json.loads(l)["tokens"] for l in open(out)])
  assert outs[0] == outs[1] and len(outs[0]) == 2
  data = run_dir / "data"
  eval_file = next(str(data / f) for f in os.listdir(data) if f.endswith("_eval.jsonl"))
  assert cli.main(["eval", f"--model={run_dir}", f"--data={eval_file}", "--limit=4"]) == 0, \
      capsys.readouterr().err


def test_train_starts_from_model_lora_path_and_exports_it_back(tmp_path, capsys):
  from safetensors.numpy import load_file
  from test_bad_inputs_lora import adapter
  from workflow_util import tiny_model_folder
  start = adapter(tmp_path / "start")  # every lora_a / lora_b entry 0.01; fresh b would be 0
  run_dir = tmp_path / "run"
  code = cli.main(["train", f"--config.run_dir={run_dir}",
                   f"--config.model.path={tiny_model_folder(tmp_path)}",
                   "--config.model.lora.enabled=True", f"--config.model.lora.path={start}",
                   "--config.trainer.total_steps=1", "--config.data.eval=",
                   "--config.data.prompts_per_step=8", "--config.rollout.n=2",
                   "--config.actor.micro_batch_size=1", "--config.trainer.eval_every=0",
                   # the smallest run the claim allows: short rows, one prefill bucket
                   "--config.data.max_prompt_len=40", "--config.rollout.prefill_buckets=(40,)",
                   "--config.rollout.max_new_tokens=8",
                   *ONE_DEVICE])
  assert code == 0, capsys.readouterr().err
  assert cli.main(["export", f"--checkpoint={run_dir}", f"--out={tmp_path}/out",
                   "--lora=adapter"]) == 0, capsys.readouterr().err
  before = load_file(str(start / "adapter_model.safetensors"))
  after = load_file(str(tmp_path / "out" / "adapter_model.safetensors"))
  assert sorted(before) == sorted(after) and len(after) == 14
  for k, v in after.items():  # one optimizer step from the start, not from a fresh adapter
    np.testing.assert_allclose(v, before[k], atol=5e-3, err_msg=k)


def _weights(folder: str) -> dict[str, np.ndarray]:
  from safetensors.numpy import load_file
  return load_file(os.path.join(folder, "model", "model.safetensors"))


@pytest.mark.hf
@pytest.mark.timeout(600)
def test_sft_draws_adapter_dropout_reproducibly(lora_run, qwen, tmp_path):
  """`sft` with model.lora.dropout > 0 drops adapter inputs (its merged weights differ from
  the dropout-free run's) and draws the same masks for the same seed (two runs agree
  bitwise): before, sft ignored the key and trained as with dropout 0."""
  for name in ("a", "b"):
    (tmp_path / name).mkdir()
  runs = [_weights(sft_lora(tmp_path / name, qwen, "--config.model.lora.dropout=0.3"))
          for name in ("a", "b")]
  plain = _weights(lora_run)
  assert runs[0].keys() == plain.keys()
  for name in plain:
    np.testing.assert_array_equal(runs[0][name], runs[1][name])
  assert any(not np.array_equal(runs[0][n], plain[n]) for n in plain)
