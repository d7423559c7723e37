"""Padding-free sequence passes: several samples packed into each row (``model.pack_sequences``).

A padded pass runs ``[B, P + N - 1]`` rows: every prompt left-padded to the batch's
prompt width, every response right-padded to ``rollout.max_new_tokens``.  A packed
pass runs ``[rows, pack_len]``: each sample's real tokens (its prompt and response,
less the last token, which predicts nothing) laid end to end, samples placed into rows
first-fit decreasing, with

* ``seg`` (int32): the sample's segment id within its row, 1, 2, ...; 0 = a padding slot;
* ``pos`` (int32): the token's position within its own sample (0 at its first prompt
  token), exactly what ``positions_from_mask`` gives the padded row;
* ``src`` (int32): the flat index of the token in ``prompt ++ response`` ``[B * (P + N)]``;
* ``out`` (int32 ``[B, N]``): the flat slot ``row * pack_len + i`` whose hidden state
  predicts response token t of sample b (0 where ``response_mask`` is off).

Attention in a packed row is block-diagonal and causal within a block (attention.py,
``segment_ids_BxT``), so each sample sees exactly the keys it sees in its padded row and
the two passes give the same numbers.  Outputs come back to the losses' ``[B, N]``
layout by gathering the hidden states at ``out`` (``unpack``) before the LM head or the
value head, so those heads cost what they cost on the padded path.

Why the plan is made on the host, in numpy: the number of packed rows depends on the
samples' lengths, and shapes under ``jax.jit`` must be static, so the host has to see the
lengths anyway to pick it; first-fit decreasing over a few thousand samples takes
milliseconds there.  The row count is rounded up to a few sizes per octave
(``bucket_rows``) so a run compiles a handful of variants.  The plan is a few int32
arrays, put on the device next to the batch; the gathers run inside the jitted pass.

Rows are planned per data shard: the samples of shard s (contiguous rows of the batch)
fill rows of shard s only, and every shard gets the same number of rows.

Token-budget micro-batches (``<role>.micro_batch_tokens``, train/token_budget.py) choose
each micro-batch's samples and rows themselves and lay them out with ``fill_rows``.

Shared prompts (``model.share_prompt_prefix``, ``group_size > 1``): a group's prompt is laid
once and its responses after it, each seeing the prompt and itself (packing_shared.py,
models/segments.py); the unit of first-fit decreasing is then the group.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils

from distflow_jax.data.fields import PROMPT_TOKENS, RESPONSE_TOKENS
from distflow_jax.train import packing_shared


@dataclasses.dataclass(frozen=True)
class PackStats:
  """Slot counts of one plan: ``useful`` real input tokens laid (a shared prompt once,
  packing_shared.py), ``packed`` slots of the packed rows, ``padded`` slots the padded
  pass runs (``B * (P + N - 1)``)."""
  useful: int
  packed: int
  padded: int

  @property
  def pad_fraction(self) -> float:
    return 1.0 - self.useful / max(self.packed, 1)

  @property
  def padded_pad_fraction(self) -> float:
    return 1.0 - self.useful / max(self.padded, 1)

  def __add__(self, other: "PackStats") -> "PackStats":
    return PackStats(self.useful + other.useful, self.packed + other.packed,
                     self.padded + other.padded)


def bucket_rows(n: int) -> int:
  """``n`` rounded up to a multiple of 2^(bit_length(n) - 3): 4 sizes per octave, at most
  25% extra rows, few compiled variants."""
  if n <= 4:
    return max(n, 1)
  step = 1 << (n.bit_length() - 3)
  return -(-n // step) * step


def _ffd(lengths: np.ndarray, pack_len: int) -> list[list[int]]:
  """First-fit decreasing: the indices of ``lengths`` (all > 0, <= pack_len) per bin."""
  order = np.argsort(-lengths, kind="stable")
  free = np.zeros(0, np.int64)
  bins: list[list[int]] = []
  for i in order:
    fits = np.flatnonzero(free >= lengths[i])
    if fits.size:
      j = fits[0]
    else:
      j = len(bins)
      bins.append([])
      free = np.append(free, pack_len)
    bins[j].append(int(i))
    free[j] -= lengths[i]
  return bins


def sample_layout(prompt_mask: np.ndarray, response_mask: np.ndarray):
  """Per sample: the columns of its real tokens in ``prompt ++ response`` and how many of
  them the pass feeds (up to the token before its last response token; 0: no response)."""
  full = np.concatenate([prompt_mask, response_mask], axis=1).astype(bool)
  p = prompt_mask.shape[1]
  cols = [np.flatnonzero(row) for row in full]
  lengths = np.zeros(len(cols), np.int64)
  for b, c in enumerate(cols):
    resp = np.flatnonzero(c >= p)
    if resp.size and resp[-1] > 0:
      lengths[b] = resp[-1]  # compact indices 0 .. k_last - 1 predict up to token k_last
  return cols, lengths


def check_fits(lengths: np.ndarray, pack_len: int) -> None:
  """Every sample's fed tokens fit one row of ``pack_len`` (a sample never spans rows)."""
  if (lengths > pack_len).any():
    raise ValueError(f"model.pack_len={pack_len} is shorter than a sample of "
                     f"{int(lengths.max())} tokens (prompt + response - 1); raise it or set "
                     f"model.pack_len=0 (the padded row's length)")


def _bins_per_shard(lengths: np.ndarray, pack_len: int, num_shards: int):
  b = len(lengths)
  per = b // num_shards
  check_fits(lengths, pack_len)
  out = []
  for s in range(num_shards):
    idx = np.arange(s * per, (s + 1) * per)
    keep = idx[lengths[idx] > 0]
    out.append([[int(keep[i]) for i in bin_] for bin_ in _ffd(lengths[keep], pack_len)])
  return out


def fill_rows(shard_bins, cols, lengths, n: int, p_plus_n: int, pack_len: int,
              rows_per_shard: int) -> dict[str, np.ndarray]:
  """The plan arrays of one micro-batch: ``shard_bins[s][j]`` lists the samples (indices
  into ``cols`` / ``lengths``, the micro-batch's rows) laid end to end in row j of shard s;
  shard s owns rows ``s * rows_per_shard ..`` of the result."""
  num_rows = rows_per_shard * len(shard_bins)
  src = np.zeros((num_rows, pack_len), np.int32)
  pos = np.zeros((num_rows, pack_len), np.int32)
  seg = np.zeros((num_rows, pack_len), np.int32)
  b = len(cols)
  p = p_plus_n - n
  out = np.zeros((b, n), np.int32)
  for s, bins in enumerate(shard_bins):
    for j, bin_ in enumerate(bins):
      row, at = s * rows_per_shard + j, 0
      for k, sample in enumerate(bin_):
        ln = int(lengths[sample])
        c = cols[sample]
        src[row, at:at + ln] = sample * p_plus_n + c[:ln]
        pos[row, at:at + ln] = np.arange(ln)
        seg[row, at:at + ln] = k + 1
        # Response token at compact index q (q >= 1) is predicted by the slot of q - 1.
        for q in np.flatnonzero((c >= p) & (np.arange(len(c)) >= 1)):
          if q <= ln:
            out[sample, c[q] - p] = row * pack_len + at + q - 1
        at += ln
  return {"src": src, "pos": pos, "seg": seg, "out": out}


def plan(prompt_mask: np.ndarray, response_mask: np.ndarray, pack_len: int = 0,
         num_shards: int = 1, group_size: int = 1) -> tuple[dict[str, np.ndarray], PackStats]:
  """The packing of one batch (see the module docstring): ``(plan, stats)``.

  ``pack_len=0`` packs into rows of the padded row's length ``P + N - 1``.  ``num_shards``
  must divide B: each contiguous block of B / num_shards rows packs into its own rows.
  ``group_size > 1``: shared prompts (packing_shared.py; the rows must be so grouped)."""
  parts, stats = plan_parts(prompt_mask, response_mask, pack_len, 1, 1, num_shards,
                            group_size)
  return {k: v[0] for k, v in parts.items()}, stats


def deal_rows_np(x: np.ndarray, m: int, block: int = 1) -> np.ndarray:
  """``micro_batches.deal_rows`` for one numpy array: ``[B, ...] -> [M, B / M, ...]``."""
  b = x.shape[0]
  if b % (m * block):
    block = 1
  x = x.reshape(b // (m * block), m, block, *x.shape[1:])
  return np.moveaxis(x, 1, 0).reshape(m, b // m, *x.shape[3:])


def shares_prompts(rows_per_shard: int, group_size: int) -> bool:
  """Whether a shard's rows pack as groups of ``group_size`` with one laid prompt each
  (packing_shared.py): sharing is on and no group straddles two shards."""
  return group_size > 1 and rows_per_shard % group_size == 0


def _unit_bins(lengths, prompt_len, pack_len, num_shards, group_size):
  """Per shard, the rows of shared-prompt units: ``(units, bins)``, bins naming units."""
  per = len(lengths) // num_shards
  check_fits(lengths, pack_len)
  units, bins = [], []
  for s in range(num_shards):
    rows = packing_shared.place_rows(range(s * per, (s + 1) * per), lengths, prompt_len,
                                     group_size, pack_len)
    bins.append([])
    for row in rows:
      bins[-1].append(list(range(len(units), len(units) + len(row))))
      units.extend(row)
  return units, bins


def plan_parts(prompt_mask: np.ndarray, response_mask: np.ndarray, pack_len: int,
               num_parts: int, block: int = 1, num_shards: int = 1, group_size: int = 1
               ) -> tuple[dict[str, np.ndarray], PackStats]:
  """One plan per micro-batch of ``micro_batches.deal_rows(batch, num_parts, block)``,
  stacked on a leading ``[num_parts]`` axis with one row count (indices relative to the
  micro-batch).  ``group_size > 1``: each group's prompt laid once (packing_shared.py)
  where the groups stay whole on their shards (``block`` must then be ``group_size``),
  else per sample."""
  prompt_mask, response_mask = np.asarray(prompt_mask), np.asarray(response_mask)
  pm = deal_rows_np(prompt_mask, num_parts, block)
  rm = deal_rows_np(response_mask, num_parts, block)
  rows_each = pm.shape[1]
  if rows_each % num_shards:
    num_shards = 1
  n = response_mask.shape[1]
  p_plus_n = prompt_mask.shape[1] + n
  pack_len = pack_len or p_plus_n - 1
  layouts = [sample_layout(pm[i], rm[i]) for i in range(num_parts)]
  whole_groups = num_parts == 1 or (block % group_size == 0
                                    and response_mask.shape[0] % (num_parts * block) == 0)
  shared = whole_groups and shares_prompts(rows_each // num_shards, group_size)
  if shared:
    prompt_lens = [packing_shared.prompt_lengths(cols, p_plus_n - n) for cols, _ in layouts]
    unit_bins = [_unit_bins(layouts[i][1], prompt_lens[i], pack_len, num_shards, group_size)
                 for i in range(num_parts)]
    bins = [b for _, b in unit_bins]
  else:
    bins = [_bins_per_shard(lengths, pack_len, num_shards) for _, lengths in layouts]
  rows_per_shard = bucket_rows(max(len(shard) for part in bins for shard in part))
  if shared:
    plans = [packing_shared.fill_rows(bins[i], unit_bins[i][0], *layouts[i], prompt_lens[i],
                                      n, p_plus_n, pack_len, rows_per_shard, rows_each)
             for i in range(num_parts)]
  else:
    plans = [fill_rows(bins[i], *layouts[i], n, p_plus_n, pack_len, rows_per_shard)
             for i in range(num_parts)]
  stacked = {k: np.stack([pl[k] for pl in plans]) for k in plans[0]}
  useful = int((stacked["seg"] > 0).sum())
  stats = PackStats(useful=useful, packed=int(stacked["seg"].size),
                    padded=prompt_mask.shape[0] * (p_plus_n - 1))
  return stacked, stats


def host_array(x) -> np.ndarray:
  """The whole of a (possibly multi-process) global array on this host."""
  if jax.process_count() == 1 or not isinstance(x, jax.Array):
    return np.asarray(jax.device_get(x))
  return np.asarray(multihost_utils.process_allgather(x, tiled=True))


# --- device side (inside the jitted passes) -----------------------------------------------

def packed_inputs(batch, pack) -> tuple[jax.Array, jax.Array, jax.Array]:
  """``(tokens, positions, segment_ids)`` of the packed rows, ``[rows, pack_len]``."""
  tokens = jnp.concatenate([batch[PROMPT_TOKENS], batch[RESPONSE_TOKENS]], axis=1)
  tokens = tokens.astype(jnp.int32).reshape(-1)[pack["src"]]
  seg = pack["seg"].astype(jnp.int32)
  return jnp.where(seg > 0, tokens, 0), pack["pos"].astype(jnp.int32), seg


def unpack(x_RxLx: jax.Array, out_BxN: jax.Array) -> jax.Array:
  """Per-slot values ``[rows, pack_len, ...]`` -> the response layout ``[B, N, ...]``."""
  flat = x_RxLx.reshape(-1, *x_RxLx.shape[2:])
  return flat[out_BxN]
