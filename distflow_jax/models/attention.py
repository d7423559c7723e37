"""Attention with RoPE: the general masked path and the one-query decode path.

A query at position p attends to every real key at position <= p; a key's
position -1 marks padding or an empty cache slot (see transformer.py).  Decode
(one token per row) reads the whole cache, masked, with no branch (`_attend_one`).
Multi-token calls take the kernel attention_choice.py picks for the target device, before tracing: the masked einsum,
`jax.nn.dot_product_attention` through XLA or cuDNN (a `[B, T, S]` mask; cuDNN's lengths
padded to a multiple of 64) or, for long rows, blockwise.py's flash-style attention,
whose memory is linear in T and S.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from distflow_jax.models import fused, segments, target as target_lib
from distflow_jax.models.attention_choice import Impl, choose, round_up
from distflow_jax.models.blockwise import blockwise_attention
from distflow_jax.models.config import ModelConfig
from distflow_jax.models.kv_cache import heads_major
from distflow_jax.models.layers import RMSNorm, linear

# Finite so that a query with no visible key (a padding row) gives a uniform
# softmax instead of NaNs that would poison gradients.
_MASK_VALUE = -1e30


def rope_inv_freq(dh: int, theta: float, llama3: tuple = ()) -> jax.Array:
  """RoPE frequencies ``[dh / 2]``; with ``llama3`` = (factor, low, high, original
  positions), Llama 3's scaling: long wavelengths slowed by ``factor``, short ones
  kept, the band between interpolated smoothly."""
  inv_freq = 1.0 / (theta ** (jnp.arange(0, dh, 2, dtype=jnp.float32) / dh))
  if not llama3:
    return inv_freq
  factor, low, high, orig = llama3
  wavelen = 2 * jnp.pi / inv_freq
  scaled = jnp.where(wavelen > orig / low, inv_freq / factor, inv_freq)
  smooth = (orig / wavelen - low) / (high - low)
  blended = (1 - smooth) * scaled / factor + smooth * scaled
  medium = (wavelen >= orig / high) & (wavelen <= orig / low)
  return jnp.where(medium, blended, scaled)


class RopeTable(NamedTuple):
  """cos and sin of every token's RoPE angles, ``[B, T, 1, Dh / 2]`` float32: computed once
  per forward (``rope_table``) and shared by every layer's queries and keys."""
  cos: jax.Array
  sin: jax.Array


def table_of(angles_BxTxF: jax.Array) -> RopeTable:
  return RopeTable(jnp.cos(angles_BxTxF)[:, :, None, :], jnp.sin(angles_BxTxF)[:, :, None, :])


def rope_table(cfg: ModelConfig, positions_BxT: jax.Array,
               rope_positions_3xBxT: jax.Array | None = None) -> RopeTable:
  """The RoPE table of a call's tokens.  With ``rope_positions_3xBxT`` (needs
  ``cfg.mrope_section``), Qwen2-VL's multimodal RoPE: frequency f of the head's dh / 2 is
  rotated by the position row (0 temporal, 1 height, 2 width) whose section holds f; where
  the three rows agree (text tokens) this is the 1-D table at that position."""
  dh = cfg.head_dim
  if rope_positions_3xBxT is None:
    inv_freq = rope_inv_freq(dh, cfg.rope_theta, cfg.rope_llama3)
    return table_of(positions_BxT.astype(jnp.float32)[..., None] * inv_freq)
  inv_freq = rope_inv_freq(dh, cfg.rope_theta)
  row_F = np.repeat(np.arange(len(cfg.mrope_section)), cfg.mrope_section)
  pos_BxTxF = jnp.moveaxis(rope_positions_3xBxT.astype(jnp.float32)[row_F], 0, -1)
  return table_of(pos_BxTxF * inv_freq)


def apply_rope(x_BxTxHxDh: jax.Array, table: RopeTable) -> jax.Array:
  """Rotates x by the table's angles (one per frequency, shared by the heads), HF's
  "rotate half" layout (first half / second half pairs)."""
  dh = x_BxTxHxDh.shape[-1]
  x = x_BxTxHxDh.astype(jnp.float32)
  x1, x2 = x[..., : dh // 2], x[..., dh // 2:]
  out = jnp.concatenate([x1 * table.cos - x2 * table.sin, x2 * table.cos + x1 * table.sin],
                        axis=-1)
  return out.astype(x_BxTxHxDh.dtype)


def rotate(x_BxTxHxDh: jax.Array, angles_BxTxF: jax.Array) -> jax.Array:
  """``apply_rope`` by angles (the vision tower's 2-D RoPE)."""
  return apply_rope(x_BxTxHxDh, table_of(angles_BxTxF))


def _attend_one(q_BxKxGxDh: jax.Array, k_BxKxSxDh: jax.Array, v_BxKxSxDh: jax.Array,
                key_pos_BxS: jax.Array, pos_B: jax.Array) -> jax.Array:
  """One query per row (decode): the general path's masked softmax attention without its
  T axis, over the whole cache.  No branch picks a shorter window: on a GPU a conditional
  copies its predicate to the host and blocks, once per layer and token, which costs more
  than reading the masked tail of the cache (rollout/engine/decode.py).  Masked keys weigh exactly
  0, so a row's numbers do not depend on how far the other rows have got."""
  dh = q_BxKxGxDh.shape[-1]
  scores_BxKxGxS = jnp.einsum("bkgd,bksd->bkgs", q_BxKxGxDh * (dh ** -0.5), k_BxKxSxDh,
                              preferred_element_type=jnp.float32)
  visible_BxS = (key_pos_BxS >= 0) & (key_pos_BxS <= pos_B[:, None])
  scores_BxKxGxS = jnp.where(visible_BxS[:, None, None], scores_BxKxGxS, _MASK_VALUE)
  probs = jax.nn.softmax(scores_BxKxGxS, axis=-1).astype(v_BxKxSxDh.dtype)
  return jnp.einsum("bkgs,bksd->bkgd", probs, v_BxKxSxDh)


class Attention(nnx.Module):
  def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
    self.cfg = cfg
    d, dh = cfg.hidden_size, cfg.head_dim
    if "qkv_proj" in cfg.fused_projections:  # the rollout engine's layout (fused.py)
      self.qkv_proj = linear(cfg, d, (cfg.num_heads + 2 * cfg.num_kv_heads) * dh,
                             cfg.qkv_bias, rngs)
    else:
      self.q_proj = linear(cfg, d, cfg.num_heads * dh, cfg.qkv_bias, rngs, "q_proj")
      self.k_proj = linear(cfg, d, cfg.num_kv_heads * dh, cfg.qkv_bias, rngs, "k_proj")
      self.v_proj = linear(cfg, d, cfg.num_kv_heads * dh, cfg.qkv_bias, rngs, "v_proj")
    self.o_proj = linear(cfg, cfg.num_heads * dh, d, False, rngs, "o_proj")
    if cfg.qk_norm:
      self.q_norm = RMSNorm(dh, cfg.rms_norm_eps, cfg.jnp_dtype)
      self.k_norm = RMSNorm(dh, cfg.rms_norm_eps, cfg.jnp_dtype)

  def __call__(self, x_BxTxD, positions_BxT, key_pos_BxS, writer, segment_ids_BxT=None,
               rope: RopeTable | None = None):
    """`writer` is None (attend within x) or one of kv_cache.py's writers for this layer's k/v.
    `segment_ids_BxT` (packed rows, writer None): a query sees only keys of its own segment
    and, in a shared-prompt row, its group's prompt (segments.py).
    `rope`: the call's RoPE table (`rope_table`, made once per forward by transformer.py;
    None: made here from `positions_BxT`); masking follows `positions_BxT`."""
    cfg = self.cfg
    b, t, _ = x_BxTxD.shape
    hkv, dh = cfg.num_kv_heads, cfg.head_dim
    g = cfg.num_heads // hkv
    if "qkv_proj" in cfg.fused_projections:
      q, k, v = fused.split(self.qkv_proj(x_BxTxD), (cfg.num_heads * dh, hkv * dh, hkv * dh))
    else:
      q, k, v = self.q_proj(x_BxTxD), self.k_proj(x_BxTxD), self.v_proj(x_BxTxD)
    q_BxTxHxDh = q.reshape(b, t, cfg.num_heads, dh)
    k_BxTxKxDh, v_BxTxKxDh = k.reshape(b, t, hkv, dh), v.reshape(b, t, hkv, dh)
    if cfg.qk_norm:
      q_BxTxHxDh = self.q_norm(q_BxTxHxDh)
      k_BxTxKxDh = self.k_norm(k_BxTxKxDh)
    rope = rope_table(cfg, positions_BxT) if rope is None else rope
    q_BxTxHxDh, k_BxTxKxDh = apply_rope(q_BxTxHxDh, rope), apply_rope(k_BxTxKxDh, rope)
    if writer is None:
      k_BxKxSxDh, v_BxKxSxDh = heads_major(k_BxTxKxDh), heads_major(v_BxTxKxDh)
    else:
      k_BxKxSxDh, v_BxKxSxDh = writer(k_BxTxKxDh, v_BxTxKxDh)
    if t == 1:  # decode
      out_BxKxGxDh = _attend_one(q_BxTxHxDh.reshape(b, hkv, g, dh), k_BxKxSxDh, v_BxKxSxDh,
                                 key_pos_BxS, positions_BxT[:, 0])
      return self.o_proj(out_BxKxGxDh.reshape(b, 1, cfg.num_heads * dh))
    choice = choose(cfg.attention_impl, q_BxTxHxDh.dtype, dh, t, k_BxKxSxDh.shape[2],
                    target_lib.current())
    if choice.impl is Impl.BLOCKWISE:  # never builds a [T, S] array
      out = blockwise_attention(q_BxTxHxDh, k_BxKxSxDh, v_BxKxSxDh, positions_BxT,
                                key_pos_BxS, segment_ids_BxT, cfg.attention_block)
      return self.o_proj(out.reshape(b, t, cfg.num_heads * dh))
    visible_BxTxS = ((key_pos_BxS[:, None, :] >= 0)
                     & (key_pos_BxS[:, None, :] <= positions_BxT[:, :, None]))
    if segment_ids_BxT is not None:  # block-diagonal (segments.py): every impl takes this mask
      visible_BxTxS = visible_BxTxS & segments.visible(segment_ids_BxT, segment_ids_BxT)
    if choice.impl is Impl.EINSUM:
      q_BxTxKxGxDh = q_BxTxHxDh.reshape(b, t, hkv, g, dh)
      scores = jnp.einsum("btkgd,bksd->bkgts", q_BxTxKxGxDh, k_BxKxSxDh,
                          preferred_element_type=jnp.float32) * (dh ** -0.5)
      scores = jnp.where(visible_BxTxS[:, None, None], scores, _MASK_VALUE)
      probs = jax.nn.softmax(scores, axis=-1).astype(v_BxKxSxDh.dtype)
      out = jnp.einsum("bkgts,bksd->btkgd", probs, v_BxKxSxDh)
    else:
      out = _dot_product_attention(q_BxTxHxDh, k_BxKxSxDh, v_BxKxSxDh, visible_BxTxS,
                                   choice.impl, choice.pad_to)
    return self.o_proj(out.reshape(b, t, cfg.num_heads * dh))


def _dot_product_attention(q_BxTxHxDh: jax.Array, k_BxKxSxDh: jax.Array,
                           v_BxKxSxDh: jax.Array, visible_BxTxS: jax.Array,
                           impl: Impl, pad_to: int = 1) -> jax.Array:
  """Masked attention through `jax.nn.dot_product_attention` (keys laid out [B, S, K, Dh]);
  a query row with no visible key gets a uniform softmax, as on the einsum path.  With
  `pad_to` > 1 (cuDNN), T and S are padded up to a multiple of it: padding keys are masked
  off for every query and padding queries' rows are sliced off, so the result (and its
  gradient) is that of the unpadded call."""
  t, s = q_BxTxHxDh.shape[1], k_BxKxSxDh.shape[2]
  k_BxSxKxDh, v_BxSxKxDh = (jnp.transpose(x, (0, 2, 1, 3)) for x in (k_BxKxSxDh, v_BxKxSxDh))
  k_BxSxKxDh, v_BxSxKxDh = k_BxSxKxDh.astype(q_BxTxHxDh.dtype), v_BxSxKxDh.astype(q_BxTxHxDh.dtype)
  tp, sp = round_up(t, pad_to), round_up(s, pad_to)
  if (tp, sp) != (t, s):
    q_BxTxHxDh = jnp.pad(q_BxTxHxDh, ((0, 0), (0, tp - t), (0, 0), (0, 0)))
    k_BxSxKxDh = jnp.pad(k_BxSxKxDh, ((0, 0), (0, sp - s), (0, 0), (0, 0)))
    v_BxSxKxDh = jnp.pad(v_BxSxKxDh, ((0, 0), (0, sp - s), (0, 0), (0, 0)))
    visible_BxTxS = jnp.pad(visible_BxTxS, ((0, 0), (0, tp - t), (0, sp - s)))
  out = jax.nn.dot_product_attention(q_BxTxHxDh, k_BxSxKxDh, v_BxSxKxDh,
                                     mask=visible_BxTxS[:, None], implementation=impl.value)
  return out[:, :t]
