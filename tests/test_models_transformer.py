"""Transformer: numpy reference, jit/no-jit, causality, padding, KV-cache decode."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from distflow_jax.models.config import ModelConfig
from distflow_jax.models.transformer import (Transformer, cache_insert, forward,
                                             init_cache, positions_from_mask)

ARCHS = ["llama", "qwen2", "qwen3"]
# Eager NNX dispatches op by op (slow on a busy CPU): jit everything but one check.
FWD = jax.jit(forward)


def small_cfg(arch="qwen2", **kw):
  base = dict(arch=arch, vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=2,
              num_heads=4, num_kv_heads=2, head_dim=8, rope_theta=500.0, rms_norm_eps=1e-5,
              qkv_bias=arch == "qwen2", qk_norm=arch == "qwen3", tie_embeddings=arch != "llama")
  base.update(kw)
  return ModelConfig(**base)


def make(cfg, seed=0):
  model = Transformer(cfg, rngs=nnx.Rngs(seed))
  # Random (not ones/zeros) norms and biases so the reference checks really see them.
  rng = np.random.default_rng(seed)
  for path, var in nnx.to_flat_state(nnx.state(model)):
    if path[-1] in ("scale", "bias"):
      var.set_value(jnp.asarray(rng.normal(1.0 if path[-1] == "scale" else 0.0, 0.3,
                                           var.get_value().shape), jnp.float32))
  return model


def np_reference(model, tokens, positions):
  """Independent numpy forward (no padding) in float64."""
  cfg = model.cfg
  p = {"/".join(map(str, k)): np.asarray(v.get_value(), np.float64)
       for k, v in nnx.to_flat_state(nnx.state(model))}

  def norm(x, w):
    return w * x / np.sqrt((x * x).mean(-1, keepdims=True) + cfg.rms_norm_eps)

  def rot(x, pos):  # x [B,T,H,Dh]
    half = cfg.head_dim // 2
    freq = cfg.rope_theta ** (-np.arange(half) * 2.0 / cfg.head_dim)
    ang = pos[:, :, None, None] * freq
    x1, x2 = x[..., :half], x[..., half:]
    return np.concatenate([x1 * np.cos(ang) - x2 * np.sin(ang),
                           x2 * np.cos(ang) + x1 * np.sin(ang)], -1)

  b, t = tokens.shape
  x = p["embed/embedding"][tokens]
  for i in range(cfg.num_layers):
    pre = f"layers/{i}/"
    h = norm(x, p[pre + "input_norm/scale"])

    def proj(name, n):
      y = h @ p[pre + f"attn/{name}/kernel"]
      if cfg.qkv_bias:
        y = y + p[pre + f"attn/{name}/bias"]
      return y.reshape(b, t, n, cfg.head_dim)

    q, k, v = proj("q_proj", cfg.num_heads), proj("k_proj", cfg.num_kv_heads), proj(
        "v_proj", cfg.num_kv_heads)
    if cfg.qk_norm:
      q, k = norm(q, p[pre + "attn/q_norm/scale"]), norm(k, p[pre + "attn/k_norm/scale"])
    q, k = rot(q, positions), rot(k, positions)
    rep = cfg.num_heads // cfg.num_kv_heads
    k, v = np.repeat(k, rep, axis=2), np.repeat(v, rep, axis=2)
    s = np.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(cfg.head_dim)
    s = np.where(np.tril(np.ones((t, t), bool)), s, -np.inf)
    a = np.exp(s - s.max(-1, keepdims=True))
    a /= a.sum(-1, keepdims=True)
    o = np.einsum("bhqk,bkhd->bqhd", a, v).reshape(b, t, -1)
    x = x + o @ p[pre + "attn/o_proj/kernel"]
    h = norm(x, p[pre + "post_attn_norm/scale"])
    g = h @ p[pre + "mlp/gate_proj/kernel"]
    x = x + ((g / (1 + np.exp(-g))) * (h @ p[pre + "mlp/up_proj/kernel"])) @ p[
        pre + "mlp/down_proj/kernel"]
  x = norm(x, p["final_norm/scale"])
  w = p["embed/embedding"].T if cfg.tie_embeddings else p["lm_head/kernel"]
  return x @ w


def tokens_for(cfg, b, t, seed=1):
  return jax.random.randint(jax.random.key(seed), (b, t), 0, cfg.vocab_size)


def arange_pos(b, t):
  return jnp.broadcast_to(jnp.arange(t), (b, t))


@pytest.mark.parametrize("arch", ARCHS)
def test_matches_numpy_reference_with_and_without_jit(arch):
  cfg = small_cfg(arch)
  model = make(cfg)
  tok, pos = tokens_for(cfg, 2, 7), arange_pos(2, 7)
  ref = np_reference(model, np.asarray(tok), np.asarray(pos))
  g, p = nnx.split(model)
  jitted, cache = FWD(g, p, tok, pos)
  assert cache is None
  np.testing.assert_allclose(jitted, ref, atol=2e-5, rtol=1e-4)
  if arch == "qwen3":  # eager NNX is slow op by op; one arch (all features) suffices
    eager, _ = model(tok, pos)
    np.testing.assert_allclose(eager, ref, atol=2e-5, rtol=1e-4)


def test_config_validation_names_the_field():
  with pytest.raises(ValueError, match="arch='gpt2'.*llama"):
    ModelConfig(arch="gpt2")
  with pytest.raises(ValueError, match="num_kv_heads=3"):
    ModelConfig(num_heads=4, num_kv_heads=3)
  with pytest.raises(ValueError, match="dtype='int8'"):
    ModelConfig(dtype="int8")
  tiny = ModelConfig.tiny(128)
  assert 5e5 < tiny.num_params < 3e6
  model = Transformer(tiny, rngs=nnx.Rngs(0))
  assert sum(x.size for x in jax.tree.leaves(nnx.state(model))) == tiny.num_params


def test_causality_by_perturbation_and_gradient():
  cfg = small_cfg("qwen3")
  g, p = nnx.split(make(cfg))
  tok, pos = tokens_for(cfg, 2, 9), arange_pos(2, 9)
  f = FWD
  a, _ = f(g, p, tok, pos)
  b, _ = f(g, p, tok.at[:, 5].set((tok[:, 5] + 1) % cfg.vocab_size), pos)
  np.testing.assert_array_equal(a[:, :5], b[:, :5])
  assert np.abs(np.asarray(a[:, 5:] - b[:, 5:])).max() > 1e-4

  # d logits[t=3] / d embedding(x_s) is zero for s > 3, nonzero for s <= 3.
  model = nnx.merge(g, p)
  x_BxTxD = model.embed(tok)

  def out_at_3(x):
    m = nnx.merge(g, p)
    m.embed = _Fixed(x, m.embed.embedding)
    return m(tok, pos)[0][:, 3].sum()

  grad = jax.jit(jax.grad(out_at_3))(x_BxTxD)
  per_pos = np.abs(np.asarray(grad)).sum(axis=(0, 2))
  assert np.all(per_pos[4:] == 0) and np.all(per_pos[:4] > 0)


class _Fixed(nnx.Module):
  """Stands in for the embedding so the gradient can be taken per position."""

  def __init__(self, x, embedding):
    self.x, self.embedding = x, embedding

  def __call__(self, tokens):
    del tokens
    return self.x


@pytest.mark.parametrize("side", ["left", "right"])
def test_padding_does_not_change_real_tokens(side):
  cfg = small_cfg("qwen2")
  g, p = nnx.split(make(cfg))
  tok = tokens_for(cfg, 1, 5)
  alone, _ = FWD(g, p, tok, arange_pos(1, 5))
  pads = jnp.zeros((1, 3), jnp.int32)
  padded = jnp.concatenate([pads, tok] if side == "left" else [tok, pads], axis=1)
  mask = jnp.concatenate([pads == 1, tok >= 0] if side == "left" else [tok >= 0, pads == 1], 1)
  out, _ = FWD(g, p, padded, positions_from_mask(mask), mask)
  real = out[:, 3:] if side == "left" else out[:, :5]
  np.testing.assert_allclose(real, alone, atol=1e-5, rtol=1e-5)
  assert np.all(np.isfinite(np.asarray(out)))


@pytest.mark.parametrize("side", ["left", "right"])
def test_kv_cache_decode_equals_full_forward_per_row_lengths(side):
  cfg = small_cfg("qwen3")
  g, p = nnx.split(make(cfg))
  b, t_prompt, n_new, s = 3, 6, 5, 16
  lengths = np.array([6, 2, 4])
  seqs = np.asarray(tokens_for(cfg, b, t_prompt + n_new, seed=3))
  # Each row's full sequence: its prompt (true length) followed by n_new tokens.
  f = FWD
  prompt = np.zeros((b, t_prompt), np.int32)
  mask = np.zeros((b, t_prompt), bool)
  for r, n in enumerate(lengths):
    sl = slice(t_prompt - n, t_prompt) if side == "left" else slice(0, n)
    prompt[r, sl], mask[r, sl] = seqs[r, :n], True
  cache = init_cache(cfg, b, s)
  logits, cache = f(g, p, jnp.asarray(prompt), positions_from_mask(jnp.asarray(mask)),
                    jnp.asarray(mask), cache, jnp.zeros((b,), jnp.int32))
  last = t_prompt - 1 if side == "left" else lengths - 1
  step_logits = [np.asarray(logits)[np.arange(b), last]]
  index = np.full(b, t_prompt) if side == "left" else lengths.copy()
  for i in range(n_new):
    tok = np.array([seqs[r, lengths[r] + i] for r in range(b)])[:, None]
    pos = (lengths + i)[:, None]
    logits, cache = f(g, p, jnp.asarray(tok), jnp.asarray(pos), jnp.ones((b, 1), bool),
                      cache, jnp.asarray(index))
    step_logits.append(np.asarray(logits)[:, 0])
    index += 1
  # Reference: one full forward over each row's whole sequence (right padded; padding
  # invariance is tested above), so a single compile serves every row.
  full_mask = np.arange(t_prompt + n_new)[None] < (lengths + n_new)[:, None]
  full, _ = FWD(g, p, jnp.asarray(np.where(full_mask, seqs, 0)), arange_pos(b, t_prompt + n_new),
                jnp.asarray(full_mask))
  for r, n in enumerate(lengths):
    got = np.stack([sl[r] for sl in step_logits])
    np.testing.assert_allclose(got, np.asarray(full)[r, n - 1:n + n_new], atol=2e-5, rtol=1e-4)


def test_decode_reads_the_whole_cache_without_a_branch_and_equals_full_forward():
  """A 64-slot cache: one-token steps attend over the whole cache, masked; rows at
  different lengths, and every step's logits equal the no-cache forward over the whole
  sequence."""
  cfg = small_cfg("qwen2")
  g, p = nnx.split(make(cfg))
  b, s, n_new = 3, 64, 40
  lengths = np.array([14, 3, 9])
  seqs = np.asarray(tokens_for(cfg, b, lengths.max() + n_new, seed=5))
  t_prompt = int(lengths.max())
  prompt = np.where(np.arange(t_prompt)[None] < lengths[:, None], seqs[:, :t_prompt], 0)
  mask = np.arange(t_prompt)[None] < lengths[:, None]
  logits, cache = FWD(g, p, jnp.asarray(prompt), positions_from_mask(jnp.asarray(mask)),
                      jnp.asarray(mask), init_cache(cfg, b, s), jnp.zeros((b,), jnp.int32))
  index = lengths.copy()
  got = []
  for i in range(n_new):
    tok = seqs[np.arange(b), lengths + i][:, None]
    logits, cache = FWD(g, p, jnp.asarray(tok), jnp.asarray(index[:, None]),
                        jnp.ones((b, 1), bool), cache, jnp.asarray(index))
    got.append(np.asarray(logits)[:, 0])
    index += 1
  total = lengths.max() + n_new
  full_mask = np.arange(total)[None] < (lengths + n_new)[:, None]
  full, _ = FWD(g, p, jnp.asarray(np.where(full_mask, seqs, 0)), arange_pos(b, total),
                jnp.asarray(full_mask))
  for r, n in enumerate(lengths):
    np.testing.assert_allclose(np.stack([x[r] for x in got]), np.asarray(full)[r, n:n + n_new],
                               atol=2e-5, rtol=1e-4)
  # No per-layer branch on how much of the cache is written (a host round trip on a GPU).
  hlo = FWD.lower(g, p, jnp.asarray(tok), jnp.asarray(index[:, None]), jnp.ones((b, 1), bool),
                  cache, jnp.asarray(index)).as_text()
  assert "stablehlo.case" not in hlo, "decode attention branches"


def test_cache_insert_moves_a_row_and_writes_past_end_are_dropped():
  cfg = small_cfg("llama")
  g, p = nnx.split(make(cfg))
  tok = tokens_for(cfg, 2, 4)
  _, prefix = FWD(g, p, tok, arange_pos(2, 4), None, init_cache(cfg, 2, 4),
                      jnp.zeros(2, jnp.int32))
  dst = init_cache(cfg, 3, 8)
  dst = dst.replace(pos=dst.pos.at[2].set(7))  # stale entries from a finished request
  dst = jax.jit(cache_insert)(dst, prefix, 1, 2)
  np.testing.assert_array_equal(dst.pos[2], [0, 1, 2, 3, -1, -1, -1, -1])
  for dst_k, prefix_k in zip(dst.k, prefix.k):
    np.testing.assert_array_equal(dst_k[2, :, :4], prefix_k[1])
    assert np.all(np.asarray(dst_k[2, :, 4:]) == 0)
  # Decoding at slot 4 of row 2 equals the full forward of row 1's sequence + one token.
  nxt = jnp.array([[5], [6], [7]])
  out, _ = FWD(g, p, nxt, jnp.full((3, 1), 4), None, dst, jnp.array([0, 0, 4]))
  full, _ = FWD(g, p, jnp.concatenate([tok[1:2], nxt[2:]], 1), arange_pos(1, 5))
  np.testing.assert_allclose(out[2, 0], full[0, 4], atol=2e-5, rtol=1e-4)
  # A full cache drops the write instead of overwriting the last slot.
  small = init_cache(cfg, 1, 2)
  _, small = FWD(g, p, tok[:1, :3], arange_pos(1, 3), None, small, jnp.zeros(1, jnp.int32))
  np.testing.assert_array_equal(small.pos, [[0, 1]])


def test_cache_requires_index():
  cfg = small_cfg("llama")
  model = make(cfg)
  with pytest.raises(ValueError, match="cache_index_B"):
    model(tokens_for(cfg, 1, 2), arange_pos(1, 2), None, init_cache(cfg, 1, 4))


def test_bfloat16_model_tracks_float32():
  cfg = small_cfg("qwen2")
  model = make(cfg)
  half = Transformer(cfg.replace(dtype="bfloat16"), rngs=nnx.Rngs(0))
  nnx.update(half, jax.tree.map(lambda x: x.astype(jnp.bfloat16), nnx.state(model)))
  tok, pos = tokens_for(cfg, 2, 7), arange_pos(2, 7)
  g, p = nnx.split(half)
  assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(p))
  lo, _ = FWD(g, p, tok, pos)
  hi, _ = FWD(*nnx.split(model), tok, pos)
  assert lo.dtype == jnp.bfloat16
  err = np.abs(np.asarray(lo, np.float32) - np.asarray(hi)).max()
  assert err < 0.05 * np.abs(np.asarray(hi)).max(), err


def test_remat_gives_same_loss_and_gradients():
  cfg = small_cfg("qwen3")
  g, p = nnx.split(make(cfg))
  tok, pos = tokens_for(cfg, 2, 6), arange_pos(2, 6)

  def loss(p, remat):
    logits, _ = forward(g, p, tok, pos, remat=remat)
    return jnp.mean(jax.nn.log_softmax(logits)[..., 0])

  grads = jax.jit(jax.value_and_grad(loss), static_argnums=1)
  (l0, g0), (l1, g1) = grads(p, False), grads(p, True)
  assert "remat" in str(jax.make_jaxpr(lambda p: loss(p, True))(p))
  assert "remat" not in str(jax.make_jaxpr(lambda p: loss(p, False))(p))
  np.testing.assert_allclose(l0, l1, rtol=1e-6)
  for a, b in zip(jax.tree.leaves(g0), jax.tree.leaves(g1)):
    np.testing.assert_allclose(a, b, atol=1e-6, rtol=1e-5)


def test_decode_inside_fori_loop_matches_python_loop():
  """The pure forward + explicit cache work as a `lax` loop carry (no Python per token)."""
  cfg = small_cfg("qwen2")
  g, p = nnx.split(make(cfg))
  b, t, n_new = 2, 4, 6
  prompt = tokens_for(cfg, b, t, seed=5)
  lengths = jnp.array([4, 2])
  mask = jnp.arange(t)[None] < lengths[:, None]

  def prefill(p):
    logits, cache = forward(g, p, prompt, positions_from_mask(mask), mask,
                            init_cache(cfg, b, t + n_new), jnp.zeros(b, jnp.int32))
    return jnp.argmax(logits[jnp.arange(b), lengths - 1], -1), cache

  @jax.jit
  def looped(p):
    first, cache = prefill(p)

    def body(i, carry):
      tok_B, cache, out_BxN = carry
      index_B = lengths + i
      logits, cache = forward(g, p, tok_B[:, None], index_B[:, None], None, cache, index_B)
      nxt = jnp.argmax(logits[:, 0], -1)
      return nxt, cache, out_BxN.at[:, i + 1].set(nxt)

    out = jnp.zeros((b, n_new), jnp.int32).at[:, 0].set(first)
    return jax.lax.fori_loop(0, n_new - 1, body, (first, cache, out))[2]

  first, cache = jax.jit(prefill)(p)
  toks, tok = [first], first
  for i in range(n_new - 1):
    index = lengths + i
    logits, cache = FWD(g, p, tok[:, None], index[:, None], None, cache, index)
    tok = jnp.argmax(logits[:, 0], -1)
    toks.append(tok)
  np.testing.assert_array_equal(looped(p), np.stack(toks, 1))
