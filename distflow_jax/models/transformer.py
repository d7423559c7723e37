"""Decoder-only transformer (Llama / Qwen2 / Qwen3) in Flax NNX, with a KV cache.

Masking is done with explicit positions, never by token index, so left
padding, right padding and per-row lengths are all the same case:

* `positions_BxT` (int32) is the RoPE position of every token;
* `mask_BxT` (bool) says which tokens are real; a padding token is never
  attended to (its key position is stored as -1);
* a query at position p attends to every real key at position <= p.

Pure functional use (inside `jax.jit`, `lax.while_loop`, `lax.scan`):

    graphdef, params = nnx.split(model)
    logits_BxTxV, cache = forward(graphdef, params, tokens_BxT, positions_BxT, mask_BxT)

KV cache (an explicit pytree, never module state).  `KVCache.k`/`v` are
tuples of one `[B, Hkv, S, Dh]` buffer per layer: separate buffers, heads
before slots, so that a decode step writes and reads each in place (a stacked
array costs a copy of the layer's slice per step, slots before heads a
transposing copy) and `KVCache.pos` is `[B, S]` (-1 = empty slot).
A call with a cache writes the T new tokens of row b at slots
`cache_index_B[b] + t` (writes past S are dropped) and attends over all S
slots, so every row of a decode batch can sit at its own length:

    cache = init_cache(cfg, batch=B, max_len=S)
    # prefill a padded prompt of length T (true length n_B), right padded:
    mask = jnp.arange(T)[None] < n_B[:, None]
    logits, cache = forward(g, p, prompt_BxT, positions_from_mask(mask), mask,
                            cache, jnp.zeros((B,), jnp.int32))
    # decode one token per row; row b's next token sits at slot/position n_B[b]:
    logits, cache = forward(g, p, tok_Bx1, n_B[:, None], jnp.ones((B, 1), bool),
                            cache, n_B)

With left padding use the same calls: the pads get position -1 in the cache,
so the only rule is that the slot `cache_index_B` must be past the prompt's
last slot.  `cache_insert` copies one row of a (prefill) cache into a slot
of a (decode) cache, for continuous batching.

Shared prefixes (training and scoring passes of a GRPO group, whose n rows
share one prompt).  `return_kv=True` on a cache-less call also returns the
call's keys/values as a `KVCache` of `[G, Hkv, T, Dh]` per layer (pos = the key positions).
A later call with `prefix=that, prefix_repeat=n` runs `G * n` rows (row r
continues prefix row r // n): each row attends to its prefix and then to its
own tokens, so the prompt is computed once per group, and gradients flow
back into it from every row:

    h_G, kv = forward(g, p, prompt_GxP, pos_GxP, mask_GxP, return_kv=True,
                      return_hidden=True)
    h_R, _ = forward(g, p, resp_RxN, pos_RxN, mask_RxN, prefix=kv,
                     prefix_repeat=n, return_hidden=True)

`return_hidden=True` returns the final-normed hidden states `[B, T, D]`
instead of logits; pair it with `Transformer.unembed_matrix()` and
`heads.token_logprobs_and_entropy` so the `[B, T, V]` logits are never
materialised at once.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from flax import struct

from distflow_jax.models.config import ModelConfig

# Finite so that a query with no visible key (a padding row) gives a uniform
# softmax instead of NaNs that would poison gradients.
_MASK_VALUE = -1e30
_INIT = nnx.initializers.normal(0.02)


@struct.dataclass
class KVCache:
  """Keys/values, a tuple of one `[B, Hkv, S, Dh]` array per layer, and key positions
  `[B, S]` (-1 = empty)."""
  k: tuple[jax.Array, ...]
  v: tuple[jax.Array, ...]
  pos: jax.Array

  @property
  def max_len(self) -> int:
    return self.k[0].shape[2]

  @property
  def batch(self) -> int:
    return self.k[0].shape[0]


def init_cache(cfg: ModelConfig, batch: int, max_len: int, dtype: Any = None) -> KVCache:
  """An empty cache for `batch` rows of `max_len` slots."""
  shape = (batch, cfg.num_kv_heads, max_len, cfg.head_dim)
  dtype = dtype or cfg.jnp_dtype
  layers = range(cfg.num_layers)
  return KVCache(k=tuple(jnp.zeros(shape, dtype) for _ in layers),
                 v=tuple(jnp.zeros(shape, dtype) for _ in layers),
                 pos=jnp.full((batch, max_len), -1, jnp.int32))


def cache_insert(dst: KVCache, src: KVCache, src_row: jax.Array | int,
                 dst_row: jax.Array | int) -> KVCache:
  """Copies row `src_row` of `src` into row `dst_row` of `dst` (slots past src's length emptied).

  `src.max_len` must be <= `dst.max_len`.  Jittable with traced rows.
  """
  s_src, s_dst = src.max_len, dst.max_len
  if s_src > s_dst:
    raise ValueError(f"cache_insert: source has {s_src} slots, more than destination's {s_dst}")
  pad = ((0, 0), (0, s_dst - s_src), (0, 0))

  def put(d, s):
    return d.at[dst_row].set(jnp.pad(s[src_row], pad).astype(d.dtype))
  pos = jnp.pad(src.pos[src_row], pad[1], constant_values=-1)
  return KVCache(k=tuple(map(put, dst.k, src.k)), v=tuple(map(put, dst.v, src.v)),
                 pos=dst.pos.at[dst_row].set(pos))


def positions_from_mask(mask_BxT: jax.Array) -> jax.Array:
  """Positions 0, 1, ... over the real tokens of each row (pads get their neighbour's)."""
  return jnp.maximum(jnp.cumsum(mask_BxT.astype(jnp.int32), axis=-1) - 1, 0)


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


def rope(x_BxTxHxDh: jax.Array, positions_BxT: jax.Array, theta: float,
         llama3: tuple = ()) -> jax.Array:
  """Rotary embedding, HF "rotate half" layout (first half / second half pairs)."""
  dh = x_BxTxHxDh.shape[-1]
  inv_freq = rope_inv_freq(dh, theta, llama3)
  angles_BxTxF = positions_BxT.astype(jnp.float32)[..., None] * inv_freq
  cos = jnp.cos(angles_BxTxF)[:, :, None, :]
  sin = jnp.sin(angles_BxTxF)[:, :, None, :]
  x = x_BxTxHxDh.astype(jnp.float32)
  x1, x2 = x[..., : dh // 2], x[..., dh // 2:]
  out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  return out.astype(x_BxTxHxDh.dtype)


class _CacheWriter:
  """Scatters each layer's new k/v into the stacked cache in place (one row/slot per token)."""

  def __init__(self, cache: KVCache, cache_index_B: jax.Array, t: int, windowed: bool = True):
    b = cache.batch
    self.k, self.v, self.layer = list(cache.k), list(cache.v), 0
    self.rows_Bx1 = jnp.arange(b)[:, None]
    self.slots_BxT = (jnp.asarray(cache_index_B, jnp.int32).reshape(b, 1)
                      + jnp.arange(t, dtype=jnp.int32))
    self._old_pos = cache.pos
    # One past the furthest slot written: every key a query of this call can see lies before
    # it (slots past a row's own writes hold position -1 or nothing of this sequence).
    # Without windows (`windowed=False`) decode attention always reads the whole cache, so a
    # row's numbers never depend on how far the other rows have got.
    self.end = jnp.max(self.slots_BxT[:, -1]) + 1 if windowed else None

  def pos(self, own_pos_BxT: jax.Array) -> jax.Array:
    # Writes past the last slot are dropped rather than clamped onto it.
    return self._old_pos.at[self.rows_Bx1, self.slots_BxT].set(own_pos_BxT, mode="drop")

  def __call__(self, k_BxTxKxDh: jax.Array, v_BxTxKxDh: jax.Array):
    i = self.layer
    # Indices on B and S around a slice: the indexed view is [B, T, K, Dh], like the values.
    self.k[i] = self.k[i].at[self.rows_Bx1, :, self.slots_BxT].set(
        k_BxTxKxDh.astype(self.k[i].dtype), mode="drop")
    self.v[i] = self.v[i].at[self.rows_Bx1, :, self.slots_BxT].set(
        v_BxTxKxDh.astype(self.v[i].dtype), mode="drop")
    return self.k[i], self.v[i]


def _heads_major(x_BxTxKxDh: jax.Array) -> jax.Array:
  return jnp.transpose(x_BxTxKxDh, (0, 2, 1, 3))


class _KVRecorder:
  """Attends within the call's own tokens and records each layer's k/v (`return_kv`)."""

  def __init__(self):
    self.layer, self.ks, self.vs = 0, [], []

  def pos(self, own_pos_BxT: jax.Array) -> jax.Array:
    return own_pos_BxT

  def __call__(self, k_BxTxKxDh: jax.Array, v_BxTxKxDh: jax.Array):
    k_BxKxTxDh, v_BxKxTxDh = _heads_major(k_BxTxKxDh), _heads_major(v_BxTxKxDh)
    self.ks.append(k_BxKxTxDh)
    self.vs.append(v_BxKxTxDh)
    return k_BxKxTxDh, v_BxKxTxDh


class _PrefixReader:
  """Attends to a fixed prefix (row r reads prefix row r // repeat) and then the own tokens."""

  def __init__(self, prefix: KVCache, repeat: int, b: int):
    if prefix.batch * repeat != b:
      raise ValueError(f"Transformer: a prefix of {prefix.batch} rows repeated {repeat} times "
                       f"does not give the batch's {b} rows")
    self.prefix, self.repeat, self.layer = prefix, repeat, 0

  def _rows(self, x: jax.Array) -> jax.Array:
    return x if self.repeat == 1 else jnp.repeat(x, self.repeat, axis=0)

  def pos(self, own_pos_BxT: jax.Array) -> jax.Array:
    return jnp.concatenate([self._rows(self.prefix.pos), own_pos_BxT], axis=1)

  def __call__(self, k_BxTxKxDh: jax.Array, v_BxTxKxDh: jax.Array):
    i = self.layer
    k = jnp.concatenate([self._rows(self.prefix.k[i]).astype(k_BxTxKxDh.dtype),
                         _heads_major(k_BxTxKxDh)], axis=2)
    v = jnp.concatenate([self._rows(self.prefix.v[i]).astype(v_BxTxKxDh.dtype),
                         _heads_major(v_BxTxKxDh)], axis=2)
    return k, v


class RMSNorm(nnx.Module):
  def __init__(self, dim: int, eps: float, dtype: Any):
    self.scale = nnx.Param(jnp.ones((dim,), dtype))
    self.eps = eps

  def __call__(self, x: jax.Array) -> jax.Array:
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
    return self.scale[...] * y.astype(x.dtype)


def _linear(cfg: ModelConfig, d_in: int, d_out: int, bias: bool, rngs: nnx.Rngs) -> nnx.Linear:
  return nnx.Linear(d_in, d_out, use_bias=bias, dtype=cfg.jnp_dtype, param_dtype=cfg.jnp_dtype,
                    kernel_init=_INIT, rngs=rngs)


def decode_windows(s: int) -> tuple[int, ...]:
  """The key windows one-token attention over an S-slot cache picks from (the last is S):
  multiples of max(16, S / 8), so a layer holds at most 8 variants."""
  step = max(16, -(-s // 8))
  return tuple(range(step, s, step)) + (s,)


def _attend_one(q_BxKxGxDh: jax.Array, k_BxKxSxDh: jax.Array, v_BxKxSxDh: jax.Array,
                key_pos_BxS: jax.Array, pos_B: jax.Array, end: jax.Array | None = None
                ) -> jax.Array:
  """One query per row (decode): the general path's masked softmax attention without its
  T axis.  With `end` (no key at or past that slot is visible to any row), only the
  smallest of `decode_windows(S)` that holds `end` slots is read: early decode steps of a
  long cache touch a fraction of it."""
  s = k_BxKxSxDh.shape[2]
  windows = decode_windows(s) if end is not None else (s,)

  def attend(w):
    def within(q, k, v, key_pos, pos):
      dh = q.shape[-1]
      scores_BxKxGxW = jnp.einsum("bkgd,bkwd->bkgw", q * (dh ** -0.5), k[:, :, :w],
                                  preferred_element_type=jnp.float32)
      visible_BxW = (key_pos[:, :w] >= 0) & (key_pos[:, :w] <= pos[:, None])
      scores_BxKxGxW = jnp.where(visible_BxW[:, None, None], scores_BxKxGxW, _MASK_VALUE)
      probs = jax.nn.softmax(scores_BxKxGxW, axis=-1).astype(v.dtype)
      return jnp.einsum("bkgw,bkwd->bkgd", probs, v[:, :, :w])
    return within

  args = (q_BxKxGxDh, k_BxKxSxDh, v_BxKxSxDh, key_pos_BxS, pos_B)
  if len(windows) == 1:
    return attend(s)(*args)
  # The first window holding `end` slots; past the cache's end, switch clamps to the last.
  pick = jnp.searchsorted(jnp.asarray(windows, jnp.int32), end.astype(jnp.int32))
  return jax.lax.switch(pick, [attend(w) for w in windows], *args)


class Attention(nnx.Module):
  def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
    self.cfg = cfg
    d, dh = cfg.hidden_size, cfg.head_dim
    self.q_proj = _linear(cfg, d, cfg.num_heads * dh, cfg.qkv_bias, rngs)
    self.k_proj = _linear(cfg, d, cfg.num_kv_heads * dh, cfg.qkv_bias, rngs)
    self.v_proj = _linear(cfg, d, cfg.num_kv_heads * dh, cfg.qkv_bias, rngs)
    self.o_proj = _linear(cfg, cfg.num_heads * dh, d, False, rngs)
    if cfg.qk_norm:
      self.q_norm = RMSNorm(dh, cfg.rms_norm_eps, cfg.jnp_dtype)
      self.k_norm = RMSNorm(dh, cfg.rms_norm_eps, cfg.jnp_dtype)

  def __call__(self, x_BxTxD, positions_BxT, key_pos_BxS, writer):
    """`writer` is None (attend within x) or a `_CacheWriter` that stores this layer's k/v."""
    cfg = self.cfg
    b, t, _ = x_BxTxD.shape
    hkv, dh = cfg.num_kv_heads, cfg.head_dim
    g = cfg.num_heads // hkv
    q_BxTxHxDh = self.q_proj(x_BxTxD).reshape(b, t, cfg.num_heads, dh)
    k_BxTxKxDh = self.k_proj(x_BxTxD).reshape(b, t, hkv, dh)
    v_BxTxKxDh = self.v_proj(x_BxTxD).reshape(b, t, hkv, dh)
    if cfg.qk_norm:
      q_BxTxHxDh = self.q_norm(q_BxTxHxDh)
      k_BxTxKxDh = self.k_norm(k_BxTxKxDh)
    q_BxTxHxDh = rope(q_BxTxHxDh, positions_BxT, cfg.rope_theta, cfg.rope_llama3)
    k_BxTxKxDh = rope(k_BxTxKxDh, positions_BxT, cfg.rope_theta, cfg.rope_llama3)
    if writer is None:
      k_BxKxSxDh, v_BxKxSxDh = _heads_major(k_BxTxKxDh), _heads_major(v_BxTxKxDh)
    else:
      k_BxKxSxDh, v_BxKxSxDh = writer(k_BxTxKxDh, v_BxTxKxDh)
    if t == 1:  # decode
      end = writer.end if isinstance(writer, _CacheWriter) else None
      out_BxKxGxDh = _attend_one(q_BxTxHxDh.reshape(b, hkv, g, dh), k_BxKxSxDh, v_BxKxSxDh,
                                 key_pos_BxS, positions_BxT[:, 0], end)
      return self.o_proj(out_BxKxGxDh.reshape(b, 1, cfg.num_heads * dh))
    q_BxTxKxGxDh = q_BxTxHxDh.reshape(b, t, hkv, g, dh)
    scores = jnp.einsum("btkgd,bksd->bkgts", q_BxTxKxGxDh, k_BxKxSxDh,
                        preferred_element_type=jnp.float32) * (dh ** -0.5)
    visible_BxTxS = ((key_pos_BxS[:, None, :] >= 0)
                     & (key_pos_BxS[:, None, :] <= positions_BxT[:, :, None]))
    scores = jnp.where(visible_BxTxS[:, None, None], scores, _MASK_VALUE)
    probs = jax.nn.softmax(scores, axis=-1).astype(v_BxKxSxDh.dtype)
    out_BxTxKxGxDh = jnp.einsum("bkgts,bksd->btkgd", probs, v_BxKxSxDh)
    return self.o_proj(out_BxTxKxGxDh.reshape(b, t, cfg.num_heads * dh))


class MLP(nnx.Module):
  def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
    d, f = cfg.hidden_size, cfg.intermediate_size
    self.gate_proj = _linear(cfg, d, f, False, rngs)
    self.up_proj = _linear(cfg, d, f, False, rngs)
    self.down_proj = _linear(cfg, f, d, False, rngs)

  def __call__(self, x):
    return self.down_proj(jax.nn.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nnx.Module):
  def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
    self.input_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.jnp_dtype)
    self.attn = Attention(cfg, rngs)
    self.post_attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.jnp_dtype)
    self.mlp = MLP(cfg, rngs)

  def __call__(self, x, positions_BxT, key_pos_BxS, writer):
    x = x + self.attn(self.input_norm(x), positions_BxT, key_pos_BxS, writer)
    return x + self.mlp(self.post_attn_norm(x))


class Transformer(nnx.Module):
  """Llama / Qwen2 / Qwen3 decoder.  Parameter paths mirror HF names (see hf_io)."""

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    self.cfg = cfg
    self.embed = nnx.Embed(cfg.vocab_size, cfg.hidden_size, dtype=cfg.jnp_dtype,
                           param_dtype=cfg.jnp_dtype, embedding_init=_INIT, rngs=rngs)
    self.layers = nnx.List([Block(cfg, rngs) for _ in range(cfg.num_layers)])
    self.final_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.jnp_dtype)
    if not cfg.tie_embeddings:
      self.lm_head = _linear(cfg, cfg.hidden_size, cfg.vocab_size, False, rngs)

  def unembed_matrix(self) -> jax.Array:
    """The `[D, V]` output projection (the embedding's transpose when tied)."""
    if self.cfg.tie_embeddings:
      return self.embed.embedding[...].T
    return self.lm_head.kernel[...]

  def logits(self, hidden_BxTxD: jax.Array) -> jax.Array:
    return jnp.einsum("btd,dv->btv", hidden_BxTxD, self.unembed_matrix())

  def __call__(self, tokens_BxT: jax.Array, positions_BxT: jax.Array,
               mask_BxT: jax.Array | None = None, cache: KVCache | None = None,
               cache_index_B: jax.Array | None = None, *, return_hidden: bool = False,
               remat: bool = False, prefix: KVCache | None = None, prefix_repeat: int = 1,
               return_kv: bool = False, windowed: bool = True
               ) -> tuple[jax.Array, KVCache | None]:
    """Returns `(logits_BxTxV or hidden_BxTxD, new_cache)`; see the module docstring.

    `remat=True` rematerialises each block in the backward pass (less activation
    memory for training; ignored with a cache, a prefix or `return_kv`).
    `new_cache` is the updated cache, the recorded k/v (`return_kv`) or None.
    """
    b, t = tokens_BxT.shape
    positions_BxT = positions_BxT.astype(jnp.int32)
    if mask_BxT is None:
      mask_BxT = jnp.ones((b, t), bool)
    own_pos_BxT = jnp.where(mask_BxT, positions_BxT, -1)
    if sum(x is not None and x is not False for x in (cache, prefix, return_kv)) > 1:
      raise ValueError("Transformer: cache, prefix and return_kv exclude each other")
    writer = None
    if cache is not None:
      if cache_index_B is None:
        raise ValueError("Transformer: a cache needs cache_index_B (the slot of each row's first token)")
      writer = _CacheWriter(cache, cache_index_B, t, windowed)
    elif prefix is not None:
      writer = _PrefixReader(prefix, prefix_repeat, b)
    elif return_kv:
      writer = _KVRecorder()
    key_pos_BxS = own_pos_BxT if writer is None else writer.pos(own_pos_BxT)
    x = self.embed(tokens_BxT)
    if remat and writer is None:
      # Training: keep only each block's input for the backward pass.
      block = nnx.remat(lambda layer, x, pos, kpos: layer(x, pos, kpos, None))
      for layer in self.layers:
        x = block(layer, x, positions_BxT, key_pos_BxS)
    else:
      for layer in self.layers:
        x = layer(x, positions_BxT, key_pos_BxS, writer)
        if writer is not None:
          writer.layer += 1
    new_cache = None
    if isinstance(writer, _CacheWriter):
      new_cache = KVCache(k=tuple(writer.k), v=tuple(writer.v), pos=key_pos_BxS)
    elif isinstance(writer, _KVRecorder):
      new_cache = KVCache(k=tuple(writer.ks), v=tuple(writer.vs), pos=own_pos_BxT)
    hidden = self.final_norm(x)
    if return_hidden:
      return hidden, new_cache
    return self.logits(hidden), new_cache


def forward(graphdef: nnx.GraphDef, params: nnx.State, tokens_BxT: jax.Array,
            positions_BxT: jax.Array, mask_BxT: jax.Array | None = None,
            cache: KVCache | None = None, cache_index_B: jax.Array | None = None, *,
            return_hidden: bool = False, remat: bool = False, prefix: KVCache | None = None,
            prefix_repeat: int = 1, return_kv: bool = False, windowed: bool = True
            ) -> tuple[jax.Array, KVCache | None]:
  """Pure forward over `nnx.split(model)`: safe inside jit / while_loop / scan."""
  model = nnx.merge(graphdef, params)
  return model(tokens_BxT, positions_BxT, mask_BxT, cache, cache_index_B,
               return_hidden=return_hidden, remat=remat, prefix=prefix,
               prefix_repeat=prefix_repeat, return_kv=return_kv, windowed=windowed)
