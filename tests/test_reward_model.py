"""The learned reward model: HF `*ForSequenceClassification` (num_labels=1) in and out.

Parity against `transformers` needs the optional `hf` extra (skipped without it);
the round trip and the error cases do not.
"""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from distflow_jax.models.config import ModelConfig
from distflow_jax.models.heads import RewardModel, reward_scores
from distflow_jax.models.hf_io import load_reward_model, save_reward_model
from distflow_jax.models.transformer import positions_from_mask

pytestmark = pytest.mark.timeout(300)
VOCAB = 64
PAD = 0


def tiny_rm(arch="qwen2", seed=0):
  cfg = ModelConfig(arch=arch, vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                    num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8,
                    qkv_bias=arch == "qwen2", qk_norm=arch == "qwen3",
                    tie_embeddings=arch != "llama", rope_theta=1000.0, rms_norm_eps=1e-5,
                    max_position_embeddings=128, dtype="float32")
  rm = RewardModel(cfg, rngs=nnx.Rngs(seed))
  # Larger weights than the init so that scores differ clearly between sequences.
  state = nnx.state(rm, nnx.Param)
  keys = iter(jax.random.split(jax.random.key(seed + 1), 64))
  nnx.update(rm, jax.tree.map(lambda x: x + 0.2 * jax.random.normal(next(keys), x.shape), state))
  return rm


def batch(seed=0):
  """Rows left-padded (prompt) and right-padded (response): the RL batch's layout."""
  rng = np.random.default_rng(seed)
  tokens = rng.integers(1, VOCAB, size=(4, 12)).astype(np.int32)
  mask = np.ones((4, 12), bool)
  mask[0, :3] = False   # left padding
  mask[1, 9:] = False   # right padding
  mask[2, :2] = False
  mask[2, 10:] = False  # both
  tokens[~mask] = PAD
  return tokens, mask


def our_scores(rm, tokens, mask):
  g, p = nnx.split(rm)
  return np.asarray(jax.jit(reward_scores, static_argnums=0)(
      g, p, jnp.asarray(tokens), positions_from_mask(jnp.asarray(mask)), jnp.asarray(mask)))


def test_scores_read_the_last_real_token():
  rm = tiny_rm()
  tokens, mask = batch()
  scores = our_scores(rm, tokens, mask)
  assert scores.shape == (4,) and np.isfinite(scores).all()
  assert np.ptp(scores) > 1e-3
  # Changing a token after a row's last real one (padding) changes nothing; changing the
  # last real token does.
  t2 = tokens.copy()
  t2[1, 10] = 5
  np.testing.assert_allclose(our_scores(rm, t2, mask), scores, rtol=1e-6)
  t3 = tokens.copy()
  t3[1, 8] = (t3[1, 8] % (VOCAB - 1)) + 1
  assert abs(our_scores(rm, t3, mask)[1] - scores[1]) > 1e-6


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_save_load_round_trip(tmp_path, arch):
  rm = tiny_rm(arch)
  save_reward_model(tmp_path, rm)
  cfg = json.loads((tmp_path / "config.json").read_text())
  assert cfg["architectures"][0].endswith("ForSequenceClassification")
  assert cfg["num_labels"] == 1
  back = load_reward_model(tmp_path)
  tokens, mask = batch(1)
  np.testing.assert_allclose(our_scores(back, tokens, mask), our_scores(rm, tokens, mask),
                             rtol=1e-6)


def test_refuses_wrong_checkpoints(tmp_path):
  save_reward_model(tmp_path, tiny_rm())
  cfg_file = tmp_path / "config.json"
  cfg = json.loads(cfg_file.read_text())
  cfg_file.write_text(json.dumps(dict(cfg, num_labels=3)))
  with pytest.raises(ValueError, match="num_labels=1"):
    load_reward_model(tmp_path)
  cfg_file.write_text(json.dumps(dict(cfg, architectures=["Qwen2ForCausalLM"])))
  with pytest.raises(ValueError, match="ForSequenceClassification"):
    load_reward_model(tmp_path)
  cfg_file.write_text(json.dumps(dict(cfg, num_hidden_layers=3)))
  with pytest.raises(ValueError, match="missing tensor"):
    load_reward_model(tmp_path)
  cfg_file.write_text(json.dumps(cfg))
  from safetensors.numpy import load_file, save_file
  state = load_file(tmp_path / "model.safetensors")
  del state["score.weight"]
  save_file(state, str(tmp_path / "model.safetensors"))
  with pytest.raises(ValueError, match="score.weight"):
    load_reward_model(tmp_path)


@pytest.mark.hf
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_parity_with_transformers(tmp_path, arch):
  torch = pytest.importorskip("torch")
  transformers = pytest.importorskip("transformers")
  rm = tiny_rm(arch, seed=3)
  save_reward_model(tmp_path, rm)
  hf = transformers.AutoModelForSequenceClassification.from_pretrained(
      str(tmp_path), torch_dtype=torch.float32, attn_implementation="eager").eval()
  tokens, mask = batch(2)
  ours = our_scores(rm, tokens, mask)
  for i in range(len(tokens)):
    ids = torch.tensor(tokens[i][mask[i]][None].astype(np.int64))
    with torch.no_grad():
      theirs = hf(input_ids=ids).logits.numpy()[0, 0]
    np.testing.assert_allclose(ours[i], theirs, rtol=2e-4, atol=2e-4)
  # And a checkpoint trained and saved by transformers loads into ours.
  hf.save_pretrained(str(tmp_path / "hf"), safe_serialization=True)
  back = load_reward_model(tmp_path / "hf")
  np.testing.assert_allclose(our_scores(back, tokens, mask), ours, rtol=1e-5, atol=1e-5)
