"""Blockwise attention (models/blockwise.py, `model.attention_impl=blockwise`): the einsum
path's values and gradients on every masking case the model meets, and memory that grows
linearly with the sequence, not quadratically."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from distflow_jax.config import loading, values
from distflow_jax.models import attention
from distflow_jax.models.attention import Attention
from distflow_jax.models.config import ModelConfig
from distflow_jax.models.kv_cache import CacheWriter, KVCache, KVRecorder, PrefixReader, init_cache
from distflow_jax.models.transformer import Transformer, forward

pytestmark = pytest.mark.timeout(300)

TOL = 1e-5


def _cfg(impl: str, heads: int = 4, kv_heads: int = 2, block: int = 4, **kw) -> ModelConfig:
  return ModelConfig(arch="qwen2", vocab_size=37, hidden_size=24, intermediate_size=32,
                     num_layers=2, num_heads=heads, num_kv_heads=kv_heads, head_dim=6,
                     qkv_bias=True, attention_impl=impl, attention_block=block, **kw)


def _close(a, b, tol=TOL):
  la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
  assert len(la) == len(lb)
  for x, y in zip(la, lb):
    np.testing.assert_allclose(np.asarray(x), np.asarray(y), atol=tol, rtol=tol)


def _rows(kind: str, t: int = 13):
  """(mask_BxT, positions_BxT, segment_ids_BxT or None) of 3 rows."""
  idx = jnp.arange(t)[None]
  if kind == "left":  # row 2 is all padding: its queries see no key
    mask = idx >= jnp.array([0, 5, t])[:, None]
  elif kind == "right":
    mask = idx < jnp.array([t, 7, 1])[:, None]
  elif kind == "packed":  # segments 1, 2, 3 end to end, then padding slots (segment 0)
    seg = jnp.array([[1] * 4 + [2] * 5 + [3] * 2 + [0] * (t - 11),
                     [1] * t,
                     [1] * 2 + [2] * (t - 4) + [0] * 2])
    starts = jnp.where(jnp.arange(t)[None] == 0, True, seg != jnp.roll(seg, 1, axis=1))
    start_idx = jax.lax.cummax(jnp.where(starts, idx, 0), axis=1)
    return seg > 0, jnp.where(seg > 0, idx - start_idx, 0).astype(jnp.int32), seg
  else:
    raise ValueError(kind)
  pos = jnp.maximum(jnp.cumsum(mask, axis=1) - 1, 0).astype(jnp.int32)
  return mask, pos, None


def _attn_pair(cfg_kw):
  """The same Attention layer built for einsum and for blockwise (same parameters)."""
  graphdef, params = nnx.split(Attention(_cfg("einsum", **cfg_kw), nnx.Rngs(0)))
  graphdef_b, _ = nnx.split(Attention(_cfg("blockwise", **cfg_kw), nnx.Rngs(0)))
  return graphdef, graphdef_b, params


def _layer_loss(graphdef, params, x, pos, key_pos, seg, w, make_writer=lambda: None):
  out = nnx.merge(graphdef, params)(x, pos, key_pos, make_writer(), seg)
  return jnp.sum(out * w)


@jax.jit(static_argnums=0)
def _layer_out_and_grads(graphdef, params, x, pos, key_pos, seg, w):
  out = nnx.merge(graphdef, params)(x, pos, key_pos, None, seg)
  grads = jax.grad(_layer_loss, argnums=(1, 2))(graphdef, params, x, pos, key_pos, seg, w)
  return out, grads


@pytest.mark.parametrize("kind,heads,kv_heads,block", [
    ("left", 4, 2, 4), ("right", 4, 1, 5), ("packed", 4, 2, 4), ("packed", 2, 2, 13),
    ("left", 4, 2, 512)])
def test_layer_values_and_grads_equal_einsum(kind, heads, kv_heads, block):
  """T = 13 against blocks of 4, 5 (the last one padded), 13 and 512 (one block); GQA 4:2,
  4:1 and plain multi-head; left padding with an all-padding row, right padding, packed."""
  g_e, g_b, params = _attn_pair(dict(heads=heads, kv_heads=kv_heads, block=block))
  mask, pos, seg = _rows(kind)
  key_pos = jnp.where(mask, pos, -1)
  x = jax.random.normal(jax.random.key(1), (3, 13, 24))
  w = jax.random.normal(jax.random.key(2), (3, 13, 24))
  out_e, (gpe, gxe) = _layer_out_and_grads(g_e, params, x, pos, key_pos, seg, w)
  out_b, (gpb, gxb) = _layer_out_and_grads(g_b, params, x, pos, key_pos, seg, w)
  _close(out_b, out_e)
  _close((gpb, gxb), (gpe, gxe))
  assert float(jnp.abs(gxe).sum()) > 0 and float(jnp.abs(gpe["q_proj"]["kernel"][...]).sum()) > 0


def test_all_padding_row_gets_the_mean_of_the_values():
  """The einsum path's finite mask value gives a query seeing nothing a uniform softmax
  over all S keys; blockwise computes that mean instead of folding masked keys in."""
  from distflow_jax.models.blockwise import blockwise_attention
  k = jax.random.normal(jax.random.key(3), (1, 2, 11, 6))
  v = jax.random.normal(jax.random.key(4), (1, 2, 11, 6))
  q = jax.random.normal(jax.random.key(5), (1, 11, 4, 6))
  def attend(v):
    return blockwise_attention(q, k, v, jnp.zeros((1, 11), jnp.int32),
                               jnp.full((1, 11), -1, jnp.int32), block=4)
  out, vjp = jax.jit(lambda v: jax.vjp(attend, v))(v)
  mean_KxDh = v[0].mean(axis=1)
  _close(out[0], jnp.broadcast_to(jnp.repeat(mean_KxDh, 2, axis=0), (11, 4, 6)))
  (dv,) = vjp(jnp.ones_like(out))
  _close(dv, jnp.full_like(v, 11 * 2 / 11))  # 11 queries x 2 heads per key head, 1/S each


@pytest.mark.parametrize("writer_kind", ["cache", "prefix"])
def test_cache_writer_prefill_and_prefix_equal_einsum(writer_kind):
  """Keys that are not the call's own tokens: a 21-slot cache (slots past the prompt
  empty, -1) written at per-row offsets, and a recorded prefix read by every row."""
  g_e, g_b, params = _attn_pair(dict(block=4))
  mask, pos, _ = _rows("left")
  own_pos = jnp.where(mask, pos, -1)
  x = jax.random.normal(jax.random.key(1), (3, 13, 24))
  w = jax.random.normal(jax.random.key(2), (3, 13, 24))
  cfg = _cfg("einsum")
  if writer_kind == "cache":
    cache = init_cache(cfg, 3, 21)
    index = jnp.array([0, 3, 8])
    key_pos = CacheWriter(cache, index, 13).pos(own_pos)

    def make_writer():
      return CacheWriter(cache, index, 13)
  else:
    rec = KVRecorder()
    prefix_x = jax.random.normal(jax.random.key(6), (1, 7, 24))
    prefix_pos = jnp.arange(7)[None]
    nnx.merge(g_e, params)(prefix_x, prefix_pos, prefix_pos, rec)
    prefix = KVCache(k=(rec.ks[0],), v=(rec.vs[0],), pos=prefix_pos)
    pos, own_pos = pos + 7, jnp.where(mask, pos + 7, -1)
    key_pos = PrefixReader(prefix, 3, 3).pos(own_pos)

    def make_writer():
      return PrefixReader(prefix, 3, 3)
  assert key_pos.shape[1] > 13  # keys S != queries T
  @jax.jit(static_argnums=0)
  def run(graphdef, params):
    writer = make_writer()
    out = nnx.merge(graphdef, params)(x, pos, key_pos, writer)
    written = (writer.k, writer.v) if writer_kind == "cache" else ()
    grads = jax.grad(_layer_loss, argnums=(1, 2))(graphdef, params, x, pos, key_pos, None, w,
                                                 make_writer)
    return out, written, grads
  _close(run(g_b, params), run(g_e, params))


def _model_loss(graphdef, params, tokens, pos, mask, seg):
  logits, _ = forward(graphdef, params, tokens, pos, mask, segment_ids_BxT=seg)
  logp = jax.nn.log_softmax(logits)
  return jnp.sum(jnp.where(mask[..., None], logp, 0.0)[..., :5])


@pytest.mark.parametrize("scan,remat,kind", [(False, "none", "left"),
                                             (True, "full", "packed")])
def test_transformer_forward_and_grad_equal_einsum(scan, remat, kind):
  """A whole Transformer (loop or scanned layers, rematerialised) through the full model:
  logits and parameter gradients."""
  cfg = _cfg("einsum", block=4, scan_layers=scan, remat=remat)
  g_e, params = nnx.split(Transformer(cfg, rngs=nnx.Rngs(0)))
  g_b, _ = nnx.split(Transformer(cfg.replace(attention_impl="blockwise"), rngs=nnx.Rngs(0)))
  mask, pos, seg = _rows(kind)
  tokens = jax.random.randint(jax.random.key(7), (3, 13), 0, 37)

  @jax.jit(static_argnums=0)
  def run(graphdef, params):
    logits = forward(graphdef, params, tokens, pos, mask, segment_ids_BxT=seg)[0]
    return logits, jax.grad(_model_loss, argnums=1)(graphdef, params, tokens, pos, mask, seg)
  _close(run(g_b, params), run(g_e, params))


def test_blockwise_builds_no_t_by_s_array():
  """No value in the jaxpr of the layer's gradient (sub-jaxprs included) has two axes of
  the sequence's length: the visibility and the scores exist only block by block."""
  t = 97  # no other axis of the layer has this size
  g_b = _attn_pair(dict(block=16))[1]
  params = _attn_pair(dict(block=16))[2]
  x = jnp.ones((1, t, 24))
  pos = jnp.arange(t)[None]
  jaxpr = jax.make_jaxpr(jax.grad(_layer_loss, argnums=1))(g_b, params, x, pos, pos, None,
                                                             jnp.ones((1, t, 24)))

  def shapes(jx):
    for eqn in jx.eqns:
      for var in eqn.outvars:
        yield getattr(var.aval, "shape", ())
      for sub in jax.core.subjaxprs(eqn) if hasattr(jax.core, "subjaxprs") else ():
        yield from shapes(sub)
      for p in eqn.params.values():
        for j in (p if isinstance(p, (tuple, list)) else (p,)):
          inner = getattr(j, "jaxpr", j)
          if hasattr(inner, "eqns"):
            yield from shapes(inner)

  seen = list(shapes(jaxpr.jaxpr))
  assert any(t in s for s in seen)
  bad = [s for s in seen if sum(d >= t for d in s) >= 2]
  assert not bad, bad
  # ...while the einsum path does build them (the check can fail).
  g_e = _attn_pair(dict(block=16))[0]
  jaxpr_e = jax.make_jaxpr(jax.grad(_layer_loss, argnums=1))(g_e, params, x, pos, pos, None,
                                                               jnp.ones((1, t, 24)))
  assert [s for s in shapes(jaxpr_e.jaxpr) if sum(d >= t for d in s) >= 2]


def _temp_bytes(impl: str, t: int, scan: bool = True) -> int:
  """Compiled temp bytes of the gradient of a two-layer model's loss over one T-token row."""
  cfg = ModelConfig(arch="qwen2", vocab_size=64, hidden_size=32, intermediate_size=64,
                    num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8,
                    attention_impl=impl, attention_block=256, scan_layers=scan)
  graphdef, params = nnx.split(Transformer(cfg, rngs=nnx.Rngs(0)))
  tokens = jax.ShapeDtypeStruct((1, t), jnp.int32)
  mask = jax.ShapeDtypeStruct((1, t), jnp.bool_)

  def loss(params, tokens, mask):
    pos = jnp.cumsum(mask, axis=1) - 1
    hidden, _ = forward(graphdef, params, tokens, pos, mask, return_hidden=True)
    return jnp.sum(hidden ** 2)

  compiled = jax.jit(jax.grad(loss)).lower(params, tokens, mask).compile()
  return compiled.memory_analysis().temp_size_in_bytes


@pytest.mark.parametrize("scan", [True, False])
def test_memory_grows_linearly_with_length(scan):
  """Doubling T: blockwise's temp memory at most ~2.5x, the einsum path's ~4x (its
  [B, H, T, S] float32 scores and their gradient).  Scanned layers (the default config's)
  are where JAX's hoisting of loop-invariant work once stacked every block's visibility."""
  lengths = (1024, 2048, 4096)
  block = [_temp_bytes("blockwise", t, scan) for t in lengths]
  for small, big in zip(block, block[1:]):
    assert big <= 2.5 * small, block
  if scan:
    ein = [_temp_bytes("einsum", t) for t in lengths[:2]]
    assert ein[1] >= 3.5 * ein[0], ein
    assert block[1] * 4 < ein[1], (block, ein)  # at 2K blockwise is already far below


def test_auto_picks_blockwise_for_long_rows_off_cudnn():
  from distflow_jax.models import attention_choice as ac, target
  cpu = target.TARGETS["cpu"]
  pairs = ac.BLOCKWISE_AUTO_PAIRS
  assert ac.choose("auto", jnp.float32, 8, pairs, 1, cpu).impl is ac.Impl.BLOCKWISE
  assert ac.choose("auto", jnp.float32, 8, pairs - 1, 1, cpu).impl is ac.Impl.XLA
  assert ac.choose("blockwise", jnp.float32, 8, 2, 2, cpu).impl is ac.Impl.BLOCKWISE


def test_config_accepts_blockwise_and_refuses_bad_block_in_one_line():
  cfg = loading.load("grpo:tiny", ["model.attention_impl=blockwise", "model.attention_block=128"])
  values.check_values(cfg)
  for bad in ("0", "-4", "2.5"):  # 2.5 is refused as it loads, the others by the check
    with pytest.raises(loading.ConfigError) as e:
      values.check_values(loading.load("grpo:tiny", [f"model.attention_block={bad}"]))
    assert "\n" not in str(e.value) and "model.attention_block=" in str(e.value), e.value
  with pytest.raises(ValueError, match="attention_block"):
    ModelConfig(attention_block=0)
