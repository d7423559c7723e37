"""A mixture-of-experts model in the RL loop (``grpo:tiny_moe``): a GRPO step through the
engine and the trainer, every expert and the router receiving gradient, the trained
checkpoint exported as a Hugging Face Qwen3-MoE folder that transformers loads and agrees
with, LoRA on the attention (and the feed-forward refused in one line)."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from distflow_jax import cli
from distflow_jax.models.config import preset
from distflow_jax.models.transformer import Transformer, forward
from workflow_util import SMOKE

pytestmark = pytest.mark.timeout(600)
FLAGS = [f"--config.{o}" for o in SMOKE if not o.startswith("model.preset")] + [
    "--config.trainer.total_steps=2", "--config.data.prompts_per_step=8", "--config.rollout.n=2",
    "--config.actor.micro_batch_size=2"]


def _digits_config(tmp_path) -> str:
  """grpo:tiny_moe with a reward that varies within a prompt's samples for an untrained
  model (tests/plugin_length_reward.py), so the weights move."""
  path = tmp_path / "tiny_moe_digits.py"
  path.write_text(
      "from distflow_jax.config import loading\n\ndef get_config():\n"
      "  c = loading.load('grpo:tiny_moe')\n  c.plugins = ('plugin_length_reward',)\n"
      "  c.dag = [dict(d, fn='reward.digits') if d['fn'] == 'reward.math' else dict(d)\n"
      "           for d in c.dag]\n  return c\n")
  return str(path)


def test_every_expert_and_the_router_get_gradient():
  cfg = preset("tiny_moe", 64)
  model = Transformer(cfg, rngs=nnx.Rngs(0))
  graphdef, params = nnx.split(model)
  tok = jax.random.randint(jax.random.key(1), (4, 32), 0, 64)
  pos = jnp.broadcast_to(jnp.arange(32), (4, 32))

  def loss(p):
    logits, _ = forward(graphdef, p, tok, pos)
    return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits[:, :-1]),
                                         tok[:, 1:, None], -1))
  grads = jax.jit(jax.grad(loss))(params)
  for i in range(cfg.num_layers):
    mlp = grads["layers"][i]["mlp"]
    assert float(jnp.abs(mlp["gate"]["kernel"][...]).max()) > 0, i
    per_expert = jnp.abs(mlp["experts"]["down_proj"][...]).max(axis=(1, 2))
    assert (per_expert > 0).all(), (i, per_expert)  # 128 tokens x 2 reach all 8 experts


def test_grpo_on_a_moe_model_trains_and_exports_to_transformers(tmp_path):
  torch = pytest.importorskip("torch")
  transformers = pytest.importorskip("transformers")
  run = tmp_path / "run"
  assert cli.main(["train", f"--config={_digits_config(tmp_path)}", *FLAGS,
                   f"--config.run_dir={run}", "--config.trainer.total_steps=1"]) == 0
  rows = [json.loads(l) for l in open(run / "metrics.jsonl")]
  assert len(rows) == 1 and all(np.isfinite(r["actor/pg_loss"]) for r in rows), rows
  assert rows[-1]["actor/grad_norm"] > 0
  out = tmp_path / "hf"
  assert cli.main(["export", f"--checkpoint={run}", f"--out={out}"]) == 0
  config = json.loads((out / "config.json").read_text())
  assert config["architectures"] == ["Qwen3MoeForCausalLM"] and config["num_experts"] == 8
  hf = transformers.AutoModelForCausalLM.from_pretrained(str(out), attn_implementation="eager")
  from distflow_jax.models.hf_io import load_pretrained
  ours = load_pretrained(out, dtype="float32")
  tok = np.random.default_rng(0).integers(0, config["vocab_size"], (2, 10))
  logits, _ = jax.jit(forward)(*nnx.split(ours), jnp.asarray(tok),
                               jnp.broadcast_to(jnp.arange(10), (2, 10)))
  with torch.no_grad():
    ref = hf.eval()(input_ids=torch.tensor(tok)).logits.numpy()
  np.testing.assert_allclose(logits, ref, atol=1e-4, rtol=1e-4)


def test_lora_on_a_moe_model_adapts_the_attention(tmp_path, capsys):
  run = tmp_path / "run"
  lora = ["--config.model.lora.enabled=True", "--config.model.lora.rank=4"]
  assert cli.main(["train", "--config=grpo:tiny_moe", *FLAGS, *lora, f"--config.run_dir={run}",
                   "--config.model.lora.targets=('q_proj','v_proj')",
                   "--config.trainer.total_steps=1"]) == 0
  capsys.readouterr()
  assert cli.main(["train", "--config=grpo:tiny_moe", *FLAGS, *lora,
                   f"--config.run_dir={tmp_path / 'refused'}"]) == 2
  err = capsys.readouterr().err.strip()
  assert len(err.splitlines()) == 1 and "take no adapters yet" in err, err
