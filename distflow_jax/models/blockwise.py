"""Blockwise ("flash") attention: memory linear in the sequence length.

The masked path of attention.py holds a `[B, T, S]` visibility mask and `[B, H, T, S]`
float32 scores (and their gradients), so a 16K-token row needs gigabytes per layer.
Here queries run in blocks of `bq` and keys in blocks of `bk`: each (query block, key
block) pair computes its scores, its visibility (from the positions, never a T x S
array) and folds them into a running max / denominator / accumulator per query (online
softmax, float32).  The backward pass is written by hand (`jax.custom_vjp`): it keeps
only the output and each query's log-sum-exp from the forward pass and recomputes each
block's probabilities, so no pass holds more than one `[B, H, bq, bk]` block of scores.

Semantics are those of attention.py's einsum path:

* a query at position p sees a key at position k when 0 <= k <= p (key position -1 =
  padding or an empty cache slot) and, with `segment_ids_BxT` (packed rows, keys are the
  queries' own tokens), when segments.py's rule lets its segment see the key's (the same
  id, or the shared prompt of its group);
* a query that sees no key at all (a padding row) gets the uniform softmax over all S
  keys the einsum path gives with its finite mask value: the mean of the values (and
  its gradient, 1/S of the row's output gradient to every value).  Computing that mean
  once, instead of folding masked keys into the online softmax, is what lets a key
  block nobody in the query block sees be skipped (`lax.cond`) without changing it;
* grouped-query attention: the G = H / K query heads of a key head are one axis of the
  block, so K/V are never repeated.

T and S need not be multiples of the blocks: they are padded up inside (padded keys get
position -1, padded queries are dropped from the output).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from distflow_jax.models import segments

# Default block edge (queries and keys): one float32 score block of the tiny model's 4
# heads is 4 MiB per row at 512 x 512.
DEFAULT_BLOCK = 512


def blockwise_attention(q_BxTxHxDh: jax.Array, k_BxKxSxDh: jax.Array, v_BxKxSxDh: jax.Array,
                        positions_BxT: jax.Array, key_pos_BxS: jax.Array,
                        segment_ids_BxT: jax.Array | None = None,
                        block: int = DEFAULT_BLOCK) -> jax.Array:
  """Masked softmax attention, `[B, T, H, Dh]` in the values' dtype.

  `k`/`v` are heads-major `[B, K, S, Dh]` (the cache's layout), K dividing H.  With
  `segment_ids_BxT` the keys are the queries' own tokens (S == T) and carry the same ids.
  """
  b, t, h, dh = q_BxTxHxDh.shape
  hkv, s = k_BxKxSxDh.shape[1], k_BxKxSxDh.shape[2]
  if h % hkv:
    raise ValueError(f"blockwise_attention: {h} query heads are not a multiple of {hkv} "
                     f"key heads")
  if block <= 0:
    raise ValueError(f"blockwise_attention: block={block} must be > 0")
  g = h // hkv
  if segment_ids_BxT is None:
    seg_q_BxT = jnp.zeros((b, t), jnp.int32)
    seg_k_BxS = jnp.zeros((b, s), jnp.int32)
  else:
    if s != t:
      raise ValueError(f"blockwise_attention: segment ids need the keys to be the queries' "
                       f"own tokens, got T={t} queries and S={s} keys")
    seg_q_BxT = seg_k_BxS = segment_ids_BxT.astype(jnp.int32)
  bq, bk = min(block, t), min(block, s)
  nq, nk = -(-t // bq), -(-s // bk)
  tp, sp = nq * bq, nk * bk

  # Blocked layouts, block index leading (what lax.scan walks over).
  q_NxBxKxGxQxDh = jnp.transpose(
      _pad(q_BxTxHxDh.reshape(b, t, hkv, g, dh), 1, tp, 0).reshape(b, nq, bq, hkv, g, dh),
      (1, 0, 3, 4, 2, 5))
  pos_NxBxQ = _blocks(_pad(positions_BxT.astype(jnp.int32), 1, tp, -1), nq)
  segq_NxBxQ = _blocks(_pad(seg_q_BxT, 1, tp, 0), nq)

  def key_blocks(x_BxKxSxDh):
    return jnp.transpose(_pad(x_BxKxSxDh, 2, sp, 0).reshape(b, hkv, nk, bk, dh),
                         (2, 0, 1, 3, 4))
  k_MxBxKxCxDh, v_MxBxKxCxDh = key_blocks(k_BxKxSxDh), key_blocks(v_BxKxSxDh)
  kpos_MxBxC = _blocks(_pad(key_pos_BxS.astype(jnp.int32), 1, sp, -1), nk)
  segk_MxBxC = _blocks(_pad(seg_k_BxS, 1, sp, 0), nk)

  out_NxBxKxGxQxDh = _flash(s, q_NxBxKxGxQxDh, k_MxBxKxCxDh, v_MxBxKxCxDh, pos_NxBxQ,
                            kpos_MxBxC, segq_NxBxQ, segk_MxBxC)
  out_BxTxHxDh = jnp.transpose(out_NxBxKxGxQxDh, (1, 0, 4, 2, 3, 5)).reshape(b, tp, h, dh)
  return out_BxTxHxDh[:, :t]


def _pad(x: jax.Array, axis: int, size: int, value) -> jax.Array:
  """`x` padded with `value` at the end of `axis` up to `size`."""
  widths = [(0, 0)] * x.ndim
  widths[axis] = (0, size - x.shape[axis])
  return jnp.pad(x, widths, constant_values=value)


def _blocks(x_BxT: jax.Array, n: int) -> jax.Array:
  """`[B, n * c]` -> `[n, B, c]`."""
  b, t = x_BxT.shape
  return jnp.transpose(x_BxT.reshape(b, n, t // n), (1, 0, 2))


def _visible(pos_BxQ, segq_BxQ, kpos_BxC, segk_BxC) -> jax.Array:
  """`[B, bq, bk]`: which keys of one block each query of one block sees."""
  kp = kpos_BxC[:, None, :]
  return (kp >= 0) & (kp <= pos_BxQ[:, :, None]) & segments.visible(segq_BxQ, segk_BxC)


def _scores(q_BxKxGxQxDh, k_BxKxCxDh) -> jax.Array:
  """Float32 scaled scores `[B, K, G, bq, bk]`, as the einsum path scales them."""
  dh = q_BxKxGxQxDh.shape[-1]
  return jnp.einsum("bkgqd,bkcd->bkgqc", q_BxKxGxQxDh, k_BxKxCxDh,
                    preferred_element_type=jnp.float32) * (dh ** -0.5)


def _forward(s_real, q_N, k_M, v_M, pos_N, kpos_M, segq_N, segk_M):
  """Outputs `[N, B, K, G, bq, Dh]` (values' dtype), log-sum-exp `[N, B, K, G, bq]` and
  whether each query sees any key `[N, B, bq]`."""
  # Ties the positions and segment ids to the queries: under a differentiated scan over
  # layers, JAX hoists out of the loop whatever depends only on the loop's constants (the
  # positions), and through the nested block loops that would stack every block's
  # visibility, [N, M, B, bq, bk]: quadratic again.  Depending on q, nothing is hoisted.
  q_N, pos_N, kpos_M, segq_N, segk_M = jax.lax.optimization_barrier(
      (q_N, pos_N, kpos_M, segq_N, segk_M))
  # The uniform softmax of a query that sees nothing: the mean of the S real values.
  # (Padded key slots hold zeros.)
  mean_BxKxDh = jnp.sum(v_M.astype(jnp.float32), axis=(0, 3)) / s_real

  def query_block(_, xs):
    q, pos, segq = xs
    b, hkv, g, bq, dh = q.shape

    def key_block(carry, ys):
      k, v, kpos, segk = ys
      vis_BxQxC = _visible(pos, segq, kpos, segk)

      def fold(carry):
        m, l, acc = carry
        sc = jnp.where(vis_BxQxC[:, None, None], _scores(q, k), -jnp.inf)
        m_new = jnp.maximum(m, jnp.max(sc, axis=-1))
        m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
        p = jnp.exp(sc - m_safe[..., None])
        corr = jnp.exp(m - m_safe)
        pv = jnp.einsum("bkgqc,bkcd->bkgqd", p.astype(v.dtype), v,
                        preferred_element_type=jnp.float32)
        return m_new, l * corr + jnp.sum(p, axis=-1), acc * corr[..., None] + pv

      # A key block no query of this block sees (above the causal diagonal, another
      # segment, padding) adds nothing: skipped.
      return jax.lax.cond(jnp.any(vis_BxQxC), fold, lambda c: c, carry), None

    init = (jnp.full((b, hkv, g, bq), -jnp.inf, jnp.float32),
            jnp.zeros((b, hkv, g, bq), jnp.float32),
            jnp.zeros((b, hkv, g, bq, dh), jnp.float32))
    (m, l, acc), _ = jax.lax.scan(key_block, init, (k_M, v_M, kpos_M, segk_M))
    sees = l > 0  # visibility does not depend on the head
    l_safe = jnp.where(sees, l, 1.0)
    out = jnp.where(sees[..., None], acc / l_safe[..., None], mean_BxKxDh[:, :, None, None])
    lse = jnp.where(sees, m + jnp.log(l_safe), 0.0)
    return None, (out.astype(v_M.dtype), lse, sees[:, 0, 0])

  _, (out, lse, sees) = jax.lax.scan(query_block, None, (q_N, pos_N, segq_N))
  return out, lse, sees


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _flash(s_real, q_N, k_M, v_M, pos_N, kpos_M, segq_N, segk_M):
  return _forward(s_real, q_N, k_M, v_M, pos_N, kpos_M, segq_N, segk_M)[0]


def _flash_fwd(s_real, q_N, k_M, v_M, pos_N, kpos_M, segq_N, segk_M):
  out, lse, sees = _forward(s_real, q_N, k_M, v_M, pos_N, kpos_M, segq_N, segk_M)
  return out, (q_N, k_M, v_M, pos_N, kpos_M, segq_N, segk_M, out, lse, sees)


def _flash_bwd(s_real, res, dout_N):
  """Flash backward: per (query block, key block) the probabilities are recomputed from
  the saved log-sum-exp; dQ accumulates over key blocks, dK/dV over query blocks."""
  q_N, k_M, v_M, pos_N, kpos_M, segq_N, segk_M, out_N, lse_N, sees_N = res
  do_N = dout_N.astype(jnp.float32)
  # rowsum(dO * O) over the attended keys only; rows that see nothing take the mean path.
  delta_N = jnp.where(sees_N[:, :, None, None],
                      jnp.sum(do_N * out_N.astype(jnp.float32), axis=-1), 0.0)

  def query_block(carry, xs):
    dk_M, dv_M = carry
    q, do, lse, delta, pos, segq = xs
    qf = q.astype(jnp.float32)

    def key_block(dq, ys):
      k, v, kpos, segk, dk, dv = ys
      vis_BxQxC = _visible(pos, segq, kpos, segk)

      def grads(args):
        dq, dk, dv = args
        sc = jnp.where(vis_BxQxC[:, None, None], _scores(q, k), -jnp.inf)
        p = jnp.exp(sc - lse[..., None])
        scale = q.shape[-1] ** -0.5
        dv = dv + jnp.einsum("bkgqc,bkgqd->bkcd", p, do)
        dp = jnp.einsum("bkgqd,bkcd->bkgqc", do, v.astype(jnp.float32))
        ds = p * (dp - delta[..., None]) * scale
        dq = dq + jnp.einsum("bkgqc,bkcd->bkgqd", ds, k.astype(jnp.float32))
        dk = dk + jnp.einsum("bkgqc,bkgqd->bkcd", ds, qf)
        return dq, dk, dv

      dq, dk, dv = jax.lax.cond(jnp.any(vis_BxQxC), grads, lambda a: a, (dq, dk, dv))
      return dq, (dk, dv)

    dq, (dk_M, dv_M) = jax.lax.scan(key_block, jnp.zeros(q.shape, jnp.float32),
                                    (k_M, v_M, kpos_M, segk_M, dk_M, dv_M))
    return (dk_M, dv_M), dq

  zeros_M = jnp.zeros(k_M.shape, jnp.float32)
  (dk_M, dv_M), dq_N = jax.lax.scan(query_block, (zeros_M, zeros_M),
                                    (q_N, do_N, lse_N, delta_N, pos_N, segq_N))
  # Rows that see no key output the mean of the S real values: 1/S of their gradient to each.
  blind_N = ~sees_N[:, :, None, None, :, None]
  dmean_BxKxDh = jnp.sum(jnp.where(blind_N, do_N, 0.0), axis=(0, 3, 4)) / s_real
  real_MxC = (jnp.arange(k_M.shape[0] * k_M.shape[3]) < s_real).reshape(k_M.shape[0], -1)
  dv_M = dv_M + jnp.where(real_MxC[:, None, None, :, None],
                          dmean_BxKxDh[None, :, :, None, :], 0.0)
  return (dq_N.astype(q_N.dtype), dk_M.astype(k_M.dtype), dv_M.astype(v_M.dtype),
          None, None, None, None)


_flash.defvjp(_flash_fwd, _flash_bwd)
