"""The KV cache and the ways one forward call reads and writes keys/values.

`KVCache` is an explicit pytree (never module state): `k`/`v` are tuples of
one `[B, Hkv, S, Dh]` buffer per layer and `pos` is `[B, S]` (-1 = empty slot);
transformer.py's docstring shows the calls.  Each attention layer hands its new
keys/values to one "writer" of the call, which returns what the layer attends
over and keeps a layer counter:

* `CacheWriter`: writes them into a cache at per-row slots (prefill, decode);
* `KVRecorder`: records them as a new `KVCache` (`return_kv`, a shared prompt);
* `PrefixReader`: prepends a recorded prefix, row r reading prefix row r // n.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import struct

from distflow_jax.models.config import ModelConfig


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


class CacheWriter:
  """Scatters each layer's new k/v into the stacked cache in place (one row/slot per token)."""

  def __init__(self, cache: KVCache, cache_index_B: jax.Array, t: int):
    b = cache.batch
    self.k, self.v, self.layer = list(cache.k), list(cache.v), 0
    self.rows_Bx1 = jnp.arange(b)[:, None]
    self.slots_BxT = (jnp.asarray(cache_index_B, jnp.int32).reshape(b, 1)
                      + jnp.arange(t, dtype=jnp.int32))
    self._old_pos = cache.pos

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


def heads_major(x_BxTxKxDh: jax.Array) -> jax.Array:
  """[B, T, K, Dh] -> [B, K, T, Dh], the cache's layout."""
  return jnp.transpose(x_BxTxKxDh, (0, 2, 1, 3))


class KVRecorder:
  """Attends within the call's own tokens and records each layer's k/v (`return_kv`)."""

  def __init__(self):
    self.layer, self.ks, self.vs = 0, [], []

  def pos(self, own_pos_BxT: jax.Array) -> jax.Array:
    return own_pos_BxT

  def __call__(self, k_BxTxKxDh: jax.Array, v_BxTxKxDh: jax.Array):
    k_BxKxTxDh, v_BxKxTxDh = heads_major(k_BxTxKxDh), heads_major(v_BxTxKxDh)
    self.ks.append(k_BxKxTxDh)
    self.vs.append(v_BxKxTxDh)
    return k_BxKxTxDh, v_BxKxTxDh


class PrefixReader:
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
                         heads_major(k_BxTxKxDh)], axis=2)
    v = jnp.concatenate([self._rows(self.prefix.v[i]).astype(v_BxTxKxDh.dtype),
                         heads_major(v_BxTxKxDh)], axis=2)
    return k, v
