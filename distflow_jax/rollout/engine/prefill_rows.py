"""The engine's prefill: a call's requests laid out as fixed-shape rows, and its program.

``Engine.prefill_insert`` prefills several prompts and starts many slots from them in one
call, one program (``prefill_insert``: the prefill, the first tokens and their insert into
the decode cache).  To keep its compiles bounded, the prompts are padded to a prefill
bucket's width and their count to a power of four (at most the slots), and the requests to
one row per slot (``request_rows``); ``prefill_shapes`` lists every (prompt rows, width)
that can give.  With ``fixed_shapes`` every call has all the slots' rows and the largest
bucket.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from distflow_jax.rollout.engine import decode
from distflow_jax.rollout.engine.config import EngineConfig


def prompt_rows(n: int, slots: int) -> int:
  """The prefill's row count for ``n`` prompts: a power of four (1, 4, 16, ...), at most
  ``slots`` -- few sizes, so few prefill programs, for at most 4x padded rows."""
  return min(1 << 2 * -(-max(0, int(n) - 1).bit_length() // 2), slots)


def prefill_shapes(config: EngineConfig) -> list[tuple[int, int]]:
  """Every (prompt rows, prompt width) ``prefill_insert`` can compile for: rows a power of
  four up to max_concurrent_decodes (``prompt_rows``), widths the prefill buckets (fixed
  shapes: one)."""
  b, buckets = config.max_concurrent_decodes, config.prefill_buckets
  if config.fixed_shapes:
    return [(b, buckets[-1])]
  rows = sorted({prompt_rows(k, b) for k in range(1, b + 1)})
  return [(p, t) for t in buckets for p in rows]


def request_rows(config: EngineConfig, prompts: Sequence[Sequence[int]], src: Sequence[int],
                 slots: Sequence[int], keys_Qx2: jax.Array | np.ndarray,
                 limits: Sequence[int] | None = None) -> tuple[np.ndarray, ...]:
  """``prefill_insert``'s requests (request q on prompt ``src[q]`` in slot ``slots[q]``) as
  fixed-shape arrays ``(tokens [P, T], lengths [P], src [B], slots [B], keys [B, 2],
  limits [B])``: P a power of four (fixed shapes: B), T a bucket, B the slots; padding
  requests name slot B (none) and the limits are capped at ``max_new_tokens``."""
  b = config.max_concurrent_decodes
  q = len(slots)
  if not 0 < q <= b or len(src) != q or len(keys_Qx2) != q:
    raise ValueError(f"prefill_insert: need 1..{b} requests with as many src/keys, got "
                     f"{q} slots, {len(src)} src, {len(keys_Qx2)} keys")
  lengths = [len(p) for p in prompts]
  if not 0 < len(prompts) <= q or min(lengths) <= 0:
    raise ValueError(f"prefill_insert: need 1..{q} non-empty prompts (one per request at "
                     f"most), got {len(prompts)} with lengths {lengths}")
  if min(src) < 0 or max(src) >= len(prompts):
    raise ValueError(f"prefill_insert: src must index the {len(prompts)} prompts, got {src}")
  if len(set(int(x) for x in slots)) != q or min(slots) < 0 or max(slots) >= b:
    raise ValueError(f"prefill_insert: slots must be distinct, in [0, {b}), got {slots}")
  t = config.bucket_for(max(lengths))
  p = prompt_rows(len(prompts), b)
  rows = np.arange(len(prompts))
  if config.fixed_shapes:
    # All rows, the largest bucket, and request q's own prompt in row slots[q].
    if list(src) != list(range(q)):
      raise ValueError("prefill_insert: fixed shapes need one prompt per request (src = "
                       "0..q-1)")
    t, p, rows = config.prefill_buckets[-1], b, np.asarray(slots, np.int64)
  tokens = np.zeros((p, t), np.int32)
  lens = np.ones((p,), np.int32)
  for i, prompt in zip(rows, prompts):
    tokens[i, :len(prompt)] = prompt
    lens[i] = len(prompt)
  pad = b - q
  src_a = np.concatenate([rows[np.asarray(src, np.int64)].astype(np.int32),
                          np.zeros(pad, np.int32)])
  slots_a = np.concatenate([np.asarray(slots, np.int32), np.full(pad, b, np.int32)])
  keys = np.zeros((b, 2), np.uint32)
  keys[:q] = np.asarray(keys_Qx2, np.uint32)
  lim = np.full((b,), config.max_new_tokens, np.int32)
  if limits is not None:
    lim[:q] = np.minimum(np.asarray(limits, np.int32), config.max_new_tokens)
  return tokens, lens, src_a, slots_a, keys, lim


def prefill_insert(graphdef: Any, params: Any, state: decode.DecodeState, tokens_PxT: jax.Array,
                   lengths_P: jax.Array, src_B: jax.Array, slots_B: jax.Array,
                   keys_Bx2: jax.Array, limits_B: jax.Array, *, sp: Any,
                   stop_ids: Sequence[int]) -> tuple[decode.DecodeState, jax.Array, jax.Array,
                                                     jax.Array]:
  """``request_rows``' requests prefilled and started in ``state`` in one program
  (``decode.prefill_sample`` then ``decode.insert_rows``): the state and the requests'
  first tokens, logprobs and sampling logprobs."""
  cache, lens_q, tok, lp, slp = decode.prefill_sample(graphdef, params, tokens_PxT, lengths_P,
                                                      src_B, keys_Bx2, sp=sp)
  state = decode.insert_rows(state, cache, src_B, slots_B, tok, lens_q, keys_Bx2, limits_B,
                             stop_ids=stop_ids)
  return state, tok, lp, slp
