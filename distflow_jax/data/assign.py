"""Length-balanced destination assignment for a re-partition.

Every process calls :func:`assign_destinations` with the same small array of
per-sample token counts and gets the same answer (pure numpy, ties broken by
index), so no process has to tell another where a sample goes.

The constraint set is shaped by the collective that executes the plan.  An
``all_to_all`` moves equal-sized blocks: sender ``i`` sends exactly ``C`` rows to
every destination.  A free longest-processing-time (LPT) assignment gives every
(sender, destination) pair a different count, and padding every block to the
largest one multiplies the bytes on the wire (more so as the mesh grows).  So
the assignment here is LPT *within* the all_to_all's shape:

* every destination shard receives ``B / D`` samples (equal counts);
* every sender sends ``ceil(R / D)`` samples at most to each destination shard,
  exactly ``R / D`` when ``D`` divides ``R`` (no padding at all);
* token loads are balanced greedily, longest first.

Algorithm: each sender's rows are sorted by length, longest first, and cut into
chunks of ``D`` rows.  Full chunks are taken in order of their longest row;
each chunk's rows, longest first, go to the destinations in order of current
load, least loaded first (one row per destination).  That keeps the spread
``max load - min load`` at most the largest within-chunk length range (proof:
pairing sorted-descending items with sorted-ascending loads never widens the
spread beyond ``max(previous spread, chunk range)``), hence
``max load <= mean load + max length <= 2 * optimum``.  When ``D`` does not
divide ``R``, the remaining ``r = R mod D`` smallest rows of each sender form a
partial chunk; each goes to the ``r`` destinations with the most remaining room
(ties: least loaded), which always finds room, and adds at most
``(N * r / D) * max partial length`` to the spread.
"""

from __future__ import annotations

import numpy as np


def _validate(lengths_B: np.ndarray, sender_B: np.ndarray, num_senders: int,
              num_dst: int) -> int:
  if lengths_B.ndim != 1:
    raise ValueError(f"lengths must be a 1-D array of per-sample token counts, "
                     f"got shape {lengths_B.shape}")
  if sender_B.shape != lengths_B.shape:
    raise ValueError(f"sender indices have shape {sender_B.shape} but lengths "
                     f"have shape {lengths_B.shape}; give one sender per sample")
  if num_senders < 1 or num_dst < 1:
    raise ValueError(f"num_senders ({num_senders}) and num_dst ({num_dst}) must "
                     f"be >= 1")
  if lengths_B.size and (lengths_B.min() < 0):
    raise ValueError(f"lengths must be >= 0, got min {lengths_B.min()}")
  if sender_B.size and (sender_B.min() < 0 or sender_B.max() >= num_senders):
    raise ValueError(f"sender indices must lie in [0, {num_senders}), got "
                     f"[{sender_B.min()}, {sender_B.max()}]")
  num_rows = lengths_B.size
  if num_rows % num_dst:
    raise ValueError(f"{num_rows} samples cannot be split equally over {num_dst} "
                     f"destination shards; use a batch size that is a multiple "
                     f"of {num_dst}")
  counts = np.bincount(sender_B, minlength=num_senders)
  if np.any(counts != counts[0]):
    raise ValueError(f"every sender must hold the same number of samples, got "
                     f"counts {counts.tolist()}")
  return int(counts[0])


def assign_destinations(lengths_B: np.ndarray, sender_B: np.ndarray,
                        num_senders: int, num_dst: int,
                        group_size: int = 1) -> np.ndarray:
  """Returns the destination shard (in ``[0, num_dst)``) of every sample.

  Args:
    lengths_B: token count of each sample (the balanced quantity).
    sender_B: which sender (device position) holds each sample; every sender
      holds the same number ``R`` of samples.
    num_senders: ``N``, the number of senders.
    num_dst: ``D``, the number of destination shards; must divide ``B``.
    group_size: ``g > 1`` keeps every run of ``g`` consecutive samples (a GRPO
      group) on one destination; they are balanced as one unit whose length
      is the group's total, with ``B / (g * D)`` groups per destination.
  """
  if group_size > 1:
    return _assign_groups(np.asarray(lengths_B), np.asarray(sender_B),
                          num_senders, num_dst, group_size)
  if group_size < 1:
    raise ValueError(f"group_size must be >= 1, got {group_size}")
  lengths_B = np.asarray(lengths_B, dtype=np.int64)
  sender_B = np.asarray(sender_B, dtype=np.int64)
  rows_per_sender = _validate(lengths_B, sender_B, num_senders, num_dst)
  num_rows = lengths_B.size
  dst_B = np.full(num_rows, -1, dtype=np.int64)
  if num_rows == 0:
    return dst_B
  full_chunks, rest = divmod(rows_per_sender, num_dst)
  # Per sender: its rows, longest first, ties by row index (stable => global).
  order = np.lexsort((np.arange(num_rows), -lengths_B, sender_B))
  rows_NxR = order.reshape(num_senders, rows_per_sender)
  chunks, partials = [], []
  for i in range(num_senders):
    for c in range(full_chunks):
      chunks.append(rows_NxR[i, c * num_dst:(c + 1) * num_dst])
    if rest:
      partials.append(rows_NxR[i, full_chunks * num_dst:])

  def by_longest(chunk_list):
    # Longest chunk first; ties by the chunk's first row index.
    keys = [(-lengths_B[ch[0]], int(ch[0])) for ch in chunk_list]
    return [chunk_list[k] for k in sorted(range(len(keys)), key=keys.__getitem__)]

  loads_D = np.zeros(num_dst, dtype=np.int64)
  dst_ids = np.arange(num_dst)
  for chunk in by_longest(chunks):
    least_loaded_first = np.lexsort((dst_ids, loads_D))
    dst_B[chunk] = least_loaded_first
    loads_D[least_loaded_first] += lengths_B[chunk]
  if partials:
    room_D = np.full(num_dst, num_rows // num_dst - num_senders * full_chunks,
                     dtype=np.int64)
    for chunk in by_longest(partials):
      # Most room first keeps a feasible completion (rooms differ by <= 1).
      picked = np.lexsort((dst_ids, loads_D, -room_D))[:rest]
      picked = picked[np.lexsort((picked, loads_D[picked]))]
      dst_B[chunk] = picked
      loads_D[picked] += lengths_B[chunk]
      room_D[picked] -= 1
  return dst_B


def _assign_groups(lengths_B: np.ndarray, sender_B: np.ndarray, num_senders: int,
                   num_dst: int, group_size: int) -> np.ndarray:
  if lengths_B.ndim != 1 or lengths_B.size % group_size:
    raise ValueError(f"{lengths_B.size} samples do not form whole groups of "
                     f"{group_size}; use a multiple of {group_size}")
  senders_UxG = np.asarray(sender_B).reshape(-1, group_size)
  split = np.flatnonzero(np.any(senders_UxG != senders_UxG[:, :1], axis=1))
  if split.size:
    raise ValueError(f"group {int(split[0])} (samples {int(split[0]) * group_size}.."
                     f"{(int(split[0]) + 1) * group_size - 1}) spans two senders; "
                     f"a group's samples must sit on one device")
  dst_U = assign_destinations(
      np.asarray(lengths_B).reshape(-1, group_size).sum(1), senders_UxG[:, 0],
      num_senders, num_dst)
  return np.repeat(dst_U, group_size)


def destination_loads(lengths_B: np.ndarray, dst_B: np.ndarray,
                      num_dst: int) -> np.ndarray:
  """Total tokens per destination shard."""
  return np.bincount(dst_B, weights=np.asarray(lengths_B, np.float64),
                     minlength=num_dst).astype(np.int64)


def pair_counts(sender_B: np.ndarray, dst_B: np.ndarray, num_senders: int,
                num_dst: int) -> np.ndarray:
  """``[N, D]`` number of samples each sender sends to each destination."""
  flat = np.asarray(sender_B) * num_dst + np.asarray(dst_B)
  return np.bincount(flat, minlength=num_senders * num_dst).reshape(
      num_senders, num_dst)
