"""Parity with `transformers` (torch CPU, float32) on tiny random Llama / Qwen2 / Qwen3 models.

Needs the optional `hf` extra; skipped cleanly without it.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

torch = pytest.importorskip("torch", reason="HF parity needs torch (pip install '.[hf]')")
transformers = pytest.importorskip("transformers",
                                   reason="HF parity needs transformers (pip install '.[hf]')")

from distflow_jax.models.config import ModelConfig  # noqa: E402
from distflow_jax.models.hf_io import export_state_dict, load_pretrained, save_pretrained  # noqa: E402
from distflow_jax.models.transformer import (Transformer, forward, init_cache,  # noqa: E402
                                             positions_from_mask)

pytestmark = [pytest.mark.hf, pytest.mark.timeout(300)]
ARCHS = ["llama", "qwen2", "qwen3"]
VOCAB = 96
FWD = jax.jit(forward)


def hf_model(arch, seed=0):
  common = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, head_dim=8, rope_theta=1000.0,
                rms_norm_eps=1e-5, max_position_embeddings=128)
  cls = {"llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
         "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
         "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM)}[arch]
  config = cls[0](tie_word_embeddings=arch == "qwen2", **common)
  config._attn_implementation = "eager"  # pylint: disable=protected-access
  torch.manual_seed(seed)
  return randomized(cls[1](config).eval())


def randomized(model):
  """``model`` with norm weights around 1 and everything else large enough that logits
  differ clearly."""
  with torch.no_grad():
    for name, p in model.named_parameters():
      p.copy_(1.0 + 0.2 * torch.randn_like(p) if "norm" in name else 0.2 * torch.randn_like(p))
  return model


def hf_logits(model, tokens, mask=None, positions=None):
  with torch.no_grad():
    out = model(input_ids=torch.tensor(np.asarray(tokens)),
                attention_mask=None if mask is None else torch.tensor(np.asarray(mask, np.int64)),
                position_ids=None if positions is None else torch.tensor(np.asarray(positions)))
  return out.logits.numpy()


@pytest.fixture(scope="module", params=ARCHS)
def pair(request, tmp_path_factory):
  path = tmp_path_factory.mktemp(request.param)
  hf = hf_model(request.param)
  hf.save_pretrained(str(path), safe_serialization=True)
  ours = load_pretrained(path, dtype="float32")
  assert ours.cfg.arch == request.param and ours.cfg.rope_theta == 1000.0
  return hf, ours


def test_logits_match_transformers(pair):
  hf, ours = pair
  assert_logits_match(hf, ours)


def assert_logits_match(hf, ours, vocab=VOCAB):
  """Our logits against ``hf``'s on random tokens, plain and left-padded, to 1e-4."""
  tok = np.random.default_rng(0).integers(0, vocab, (2, 12))
  g, p = nnx.split(ours)
  logits, _ = FWD(g, p, jnp.asarray(tok), jnp.broadcast_to(jnp.arange(12), (2, 12)))
  np.testing.assert_allclose(logits, hf_logits(hf, tok), atol=1e-4, rtol=1e-4)
  # Left padding: explicit masks and positions on both sides.
  mask = np.ones((2, 12), bool)
  mask[1, :4] = False
  pos = np.asarray(positions_from_mask(jnp.asarray(mask)))
  logits, _ = FWD(g, p, jnp.asarray(tok), jnp.asarray(pos), jnp.asarray(mask))
  ref = hf_logits(hf, tok, mask, pos)
  np.testing.assert_allclose(np.asarray(logits)[mask], ref[mask], atol=1e-4, rtol=1e-4)


def greedy(ours, prompt, n_new):
  g, p = nnx.split(ours)
  b, t = prompt.shape
  logits, cache = FWD(g, p, jnp.asarray(prompt), jnp.broadcast_to(jnp.arange(t), (b, t)), None,
                      init_cache(ours.cfg, b, t + n_new), jnp.zeros(b, jnp.int32))
  nxt = jnp.argmax(logits[:, -1], -1)
  out = [nxt]
  for i in range(n_new - 1):
    idx = jnp.full((b,), t + i, jnp.int32)
    logits, cache = FWD(g, p, nxt[:, None], idx[:, None], None, cache, idx)
    nxt = jnp.argmax(logits[:, 0], -1)
    out.append(nxt)
  return np.stack([np.asarray(x) for x in out], 1)


def test_greedy_continuations_match(pair):
  hf, ours = pair
  prompt = np.random.default_rng(1).integers(0, VOCAB, (2, 5))
  with torch.no_grad():
    ref = hf.generate(torch.tensor(prompt), attention_mask=torch.ones(2, 5, dtype=torch.long),
                      do_sample=False, max_new_tokens=10, min_new_tokens=10, pad_token_id=0,
                      eos_token_id=None).numpy()[:, 5:]
  np.testing.assert_array_equal(greedy(ours, prompt, 10), ref)


@pytest.mark.parametrize("arch", ARCHS)
def test_export_loads_in_transformers_exactly(tmp_path, arch):
  cfg = ModelConfig(
      arch=arch, vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_layers=2,
      num_heads=4, num_kv_heads=2, head_dim=8, rope_theta=500.0, qkv_bias=arch == "qwen2",
      qk_norm=arch == "qwen3", tie_embeddings=arch != "llama")
  model = Transformer(cfg, rngs=nnx.Rngs(3))
  for path, var in nnx.to_flat_state(nnx.state(model)):
    if path[-1] in ("scale", "bias"):
      var.set_value(var.get_value() + 0.1 * jax.random.normal(jax.random.key(len(path)),
                                                                var.get_value().shape))
  save_pretrained(tmp_path, model)
  hf, info = transformers.AutoModelForCausalLM.from_pretrained(
      str(tmp_path), output_loading_info=True, attn_implementation="eager")
  assert not info["missing_keys"] and not info["unexpected_keys"], info
  ours = export_state_dict(model)
  theirs = {k: v.numpy() for k, v in hf.state_dict().items()}
  if cfg.tie_embeddings:
    assert hf.lm_head.weight.data_ptr() == hf.model.embed_tokens.weight.data_ptr()
    theirs.pop("lm_head.weight")
  assert theirs.keys() == ours.keys()
  for k, v in ours.items():
    np.testing.assert_array_equal(theirs[k], v, err_msg=k)
  tok = np.random.default_rng(2).integers(0, VOCAB, (2, 9))
  g, p = nnx.split(model)
  logits, _ = FWD(g, p, jnp.asarray(tok), jnp.broadcast_to(jnp.arange(9), (2, 9)))
  np.testing.assert_allclose(logits, hf_logits(hf.eval(), tok), atol=1e-4, rtol=1e-4)


def test_llama3_rope_scaling_matches_transformers(tmp_path):
  # original_max_position_embeddings far below the test length, so all three
  # frequency bands (kept, interpolated, slowed) are exercised.
  config = transformers.LlamaConfig(
      vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
      num_attention_heads=4, num_key_value_heads=2, head_dim=8, rope_theta=500000.0,
      max_position_embeddings=256, tie_word_embeddings=True,
      rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                    "high_freq_factor": 4.0, "original_max_position_embeddings": 16})
  config._attn_implementation = "eager"  # pylint: disable=protected-access
  torch.manual_seed(1)
  hf = transformers.LlamaForCausalLM(config).eval()
  with torch.no_grad():
    for name, p in hf.named_parameters():
      p.copy_(1.0 + 0.2 * torch.randn_like(p) if "norm" in name else 0.2 * torch.randn_like(p))
  hf.save_pretrained(str(tmp_path), safe_serialization=True)
  ours = load_pretrained(tmp_path, dtype="float32")
  assert ours.cfg.rope_llama3 == (8.0, 1.0, 4.0, 16)
  tok = np.random.default_rng(0).integers(0, VOCAB, (1, 64))
  g, p = nnx.split(ours)
  logits, _ = FWD(g, p, jnp.asarray(tok), jnp.arange(64)[None])
  np.testing.assert_allclose(logits, hf_logits(hf, tok), atol=1e-4, rtol=1e-4)
  assert ModelConfig.from_hf_dict(ours.cfg.to_hf_dict()) == ours.cfg
