"""Token-budget micro-batches (``<role>.micro_batch_tokens``): a train step's micro-batches
filled by real tokens instead of counted in rows.

Why: with ``model.pack_sequences`` a micro-batch of ``micro_batch_size`` rows packs into as
many packed rows as its samples' tokens need, and every micro-batch is padded to the row
count of the fullest one.  RL response lengths are long-tailed, so row-count micro-batches
carry very unequal token counts and the step's memory is set by the batch's worst luck.
Here a budget of ``T`` tokens bounds every micro-batch on every data shard, and every
micro-batch runs the same fixed rows, so memory is set by ``T``.

The rule, per data shard (shard s holds the contiguous rows ``s * B/D .. (s+1) * B/D - 1``
of the batch, as packing.py plans them), with a sample's length the tokens its pass feeds
(prompt + response - 1, packing.sample_layout):

* every micro-batch is ``R = ceil(T / pack_len)`` rows of ``pack_len`` slots per shard, so
  ``R * pack_len >= T`` and the step's activations are fixed by ``T``;
* samples, longest first (ties: lower index), go to the least-loaded micro-batch that has
  room: its real tokens plus the sample's stay ``<= T``, and one of its R rows has room for
  the whole sample (the first such row).  Within a micro-batch the rows are thus first-fit
  decreasing, as packing.py's; across micro-batches the loads are balanced greedily
  (longest processing time first);
* a sample longer than ``T`` (it is at most ``pack_len``: packing refuses longer ones) goes
  to an empty micro-batch and stays alone in it: one sample in R rows always fits, so
  nothing is refused and memory stays that of R rows;
* the number of micro-batches M is the same on every shard (the train step scans one
  ``[M, ...]`` stack over the whole mesh): the smallest count at which every shard's
  assignment succeeds, from ``max_s ceil(tokens_s / T)`` up, rounded up with
  ``packing.bucket_rows`` (4 sizes per octave) so a run compiles few step variants.
  Shards with fewer tokens get lighter micro-batches, possibly empty ones (all padding);
* samples without a response token join no micro-batch: they have no loss term.

Shared prompts (``group_size > 1``): the items placed whole are packing_shared.py's units (a
group's prompt laid once and its responses), their length the slots they take, so a group
stays in one micro-batch and one row (a group longer than ``pack_len`` is split into units).

A micro-batch names its samples by slots: ``idx [M, S]`` (rows of the batch) and
``valid [M, S]``, shard-major (slots ``s * S/D ..`` hold shard s's samples; padding slots
name the shard's first row and are not valid), ``S / D`` the most samples any micro-batch
holds on any shard, bucketed like M.  The train step gathers each micro-batch's rows by
``idx`` and turns padding slots' masks off (``micro_batches.gather_micro_batches``).  The
loss of each micro-batch is still its sum over the whole batch's denominator, so the update
equals the row micro-batches' and the padded step's.
"""

from __future__ import annotations

import numpy as np

from distflow_jax.train import packing, packing_shared

Assignment = list[list[list[int]]]  # [micro-batch][row] -> sample indices


def rows_per_micro_batch(budget: int, pack_len: int) -> int:
  """``R = ceil(budget / pack_len)``: the packed rows of one micro-batch on one shard."""
  return -(-budget // pack_len)


def _assign_shard(lengths_I: np.ndarray, budget: int, pack_len: int, num_micro: int
                  ) -> Assignment | None:
  """The rule of the module docstring for one shard's samples (all with length > 0), as
  positions in ``lengths_I``; None when some sample finds no micro-batch with room."""
  rows = rows_per_micro_batch(budget, pack_len)
  tokens_M = np.zeros(num_micro, np.int64)
  free_MxR = np.full((num_micro, rows), pack_len, np.int64)
  out: Assignment = [[[] for _ in range(rows)] for _ in range(num_micro)]
  for i in np.argsort(-lengths_I, kind="stable"):
    ln = int(lengths_I[i])
    room_M = (((tokens_M + ln <= budget) | (tokens_M == 0))
              & (free_MxR.max(axis=1) >= ln))
    if not room_M.any():
      return None
    candidates = np.flatnonzero(room_M)
    j = int(candidates[np.argmin(tokens_M[candidates])])  # least loaded, lowest index
    r = int(np.flatnonzero(free_MxR[j] >= ln)[0])
    out[j][r].append(int(i))
    tokens_M[j] += ln
    free_MxR[j, r] -= ln
  return out


def _fewest_micro_batches(lengths_I: np.ndarray, budget: int, pack_len: int) -> int:
  m = max(-(-int(lengths_I.sum()) // budget), 1)
  while _assign_shard(lengths_I, budget, pack_len, m) is None:
    m += 1  # ends by m = len(lengths_I): each sample then has an empty micro-batch
  return m


def assign(lengths_B: np.ndarray, budget: int, pack_len: int, num_shards: int = 1
           ) -> list[Assignment]:
  """Per shard, per micro-batch, per packed row: the batch rows (global indices) placed
  there; the same number of micro-batches on every shard (module docstring)."""
  lengths_B = np.asarray(lengths_B, np.int64)
  per = len(lengths_B) // num_shards
  return assign_items(lengths_B, np.arange(len(lengths_B)) // per, budget, pack_len,
                      num_shards)


def assign_items(lengths_I: np.ndarray, shard_I: np.ndarray, budget: int, pack_len: int,
                 num_shards: int) -> list[Assignment]:
  """`assign` over items each placed whole (samples, or packing_shared.py's units of a
  shared prompt and its responses), item i on shard ``shard_I[i]``."""
  if budget <= 0:
    raise ValueError(f"micro_batch_tokens={budget} must be > 0 for token-budget micro-batches")
  lengths_B = np.asarray(lengths_I, np.int64)
  packing.check_fits(lengths_B, pack_len)
  keep = [np.flatnonzero((np.asarray(shard_I) == s) & (lengths_B > 0))
          for s in range(num_shards)]
  m = packing.bucket_rows(max(_fewest_micro_batches(lengths_B[k], budget, pack_len)
                              for k in keep))
  while True:
    parts = [_assign_shard(lengths_B[k], budget, pack_len, m) for k in keep]
    if all(p is not None for p in parts):
      break
    m = packing.bucket_rows(m + 1)  # a larger count can fail where a smaller one fits
  return [[[[int(k[i]) for i in row] for row in micro] for micro in part]
          for k, part in zip(keep, parts)]


def tokens_per_micro_batch(lengths_B: np.ndarray, parts: list[Assignment]) -> np.ndarray:
  """``[D, M]``: the real tokens of each micro-batch on each shard."""
  return np.array([[sum(int(lengths_B[b]) for row in micro for b in row) for micro in part]
                   for part in parts], np.int64)


def _items(cols, lengths_B: np.ndarray, p: int, pack_len: int, num_shards: int,
           group_size: int):
  """What the budget places whole: ``(members, lengths_I, shard_I, prompt_len_B)``; samples
  (``prompt_len_B`` None), or with shared prompts packing_shared.py's units."""
  b = len(lengths_B)
  per = b // num_shards
  if not packing.shares_prompts(per, group_size):
    return [(i,) for i in range(b)], lengths_B, np.arange(b) // per, None
  packing.check_fits(lengths_B, pack_len)
  prompt_len_B = packing_shared.prompt_lengths(cols, p)
  members, sizes, shard_I = [], [], []
  for s in range(num_shards):
    units, sizes_U = packing_shared.group_units(range(s * per, (s + 1) * per), lengths_B,
                                                prompt_len_B, group_size, pack_len)
    members += units
    sizes += list(sizes_U)
    shard_I += [s] * len(units)
  return members, np.array(sizes, np.int64), np.array(shard_I, np.int64), prompt_len_B


def plan(prompt_mask: np.ndarray, response_mask: np.ndarray, budget: int, pack_len: int = 0,
         num_shards: int = 1, group_size: int = 1
         ) -> tuple[dict[str, np.ndarray], packing.PackStats, np.ndarray]:
  """The token-budget plan of one (mini-)batch: ``(plan, stats, tokens_DxM)``.

  ``plan`` holds ``idx`` / ``valid`` ``[M, S]`` (the slots, module docstring) and
  packing.py's ``src`` / ``pos`` / ``seg`` ``[M, D * R, pack_len]`` and ``out`` ``[M, S, N]``,
  relative to each micro-batch's gathered slots.  ``pack_len=0``: the padded row's length.
  ``num_shards`` must divide B (else one shard).  ``group_size > 1``: shared prompts, each
  group's prompt laid once (packing_shared.py) and a group's samples kept in one micro-batch
  (one unit), where groups do not straddle shards."""
  pm, rm = np.asarray(prompt_mask), np.asarray(response_mask)
  b, n = rm.shape
  if b % num_shards:
    num_shards = 1
  p_plus_n = pm.shape[1] + n
  pack_len = pack_len or p_plus_n - 1
  cols, lengths_B = packing.sample_layout(pm, rm)
  units, lengths_I, shard_I, prompt_len_B = _items(cols, lengths_B, p_plus_n - n, pack_len,
                                                   num_shards, group_size)
  parts = assign_items(lengths_I, shard_I, budget, pack_len, num_shards)
  num_micro = len(parts[0])
  rows = rows_per_micro_batch(budget, pack_len)
  members = [[[x for row in micro for u in row for x in units[u]] for micro in part]
             for part in parts]
  per_slot = packing.bucket_rows(max(len(ms) for part in members for ms in part))
  per = b // num_shards
  first_row_D = np.arange(num_shards, dtype=np.int32) * per  # padding slots' row
  idx_MxDxK = np.broadcast_to(first_row_D[None, :, None],
                              (num_micro, num_shards, per_slot)).copy()
  valid_MxDxK = np.zeros_like(idx_MxDxK, dtype=bool)
  for s, part in enumerate(members):
    for j, ms in enumerate(part):
      idx_MxDxK[j, s, :len(ms)] = ms
      valid_MxDxK[j, s, :len(ms)] = True
  idx_MxS = idx_MxDxK.reshape(num_micro, -1)
  valid_MxS = valid_MxDxK.reshape(num_micro, -1)
  plans = []
  empty = np.zeros(0, np.int64)
  for j in range(num_micro):
    slot = {int(x): k for k, (x, ok) in enumerate(zip(idx_MxS[j], valid_MxS[j])) if ok}
    cols_S = [cols[x] if ok else empty for x, ok in zip(idx_MxS[j], valid_MxS[j])]
    lengths_S = np.where(valid_MxS[j], lengths_B[idx_MxS[j]], 0)
    if prompt_len_B is None:
      shard_bins = [[[slot[units[u][0]] for u in row] for row in part[j] if row]
                    for part in parts]
      plans.append(packing.fill_rows(shard_bins, cols_S, lengths_S, n, p_plus_n, pack_len,
                                     rows))
      continue
    units_j = [tuple(slot[x] for x in units[u]) for part in parts for row in part[j]
               for u in row]
    shard_bins, at = [], 0
    for part in parts:  # units_j's order: shard, row, unit
      shard_bins.append([])
      for row in part[j]:
        if row:
          shard_bins[-1].append(list(range(at, at + len(row))))
        at += len(row)
    prompt_len_S = np.where(valid_MxS[j], prompt_len_B[idx_MxS[j]], 0)
    plans.append(packing_shared.fill_rows(shard_bins, units_j, cols_S, lengths_S,
                                          prompt_len_S, n, p_plus_n, pack_len, rows,
                                          len(cols_S)))
  stacked = {k: np.stack([pl[k] for pl in plans]) for k in plans[0]}
  stacked.update(idx=idx_MxS, valid=valid_MxS)
  stats = packing.PackStats(useful=int((stacked["seg"] > 0).sum()),
                            packed=int(stacked["seg"].size), padded=b * (p_plus_n - 1))
  return stacked, stats, tokens_per_micro_batch(lengths_I, parts)
