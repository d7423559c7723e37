"""The re-partition plan: who sends which row where, as index arrays.

Every process builds the same :class:`RepartitionPlan` from the same lengths and layouts.
Senders are the devices of the source layout, each responsible for a
contiguous block of ``R`` input rows (a shard replicated over ``r`` devices is
split ``r`` ways locally, which costs no communication).  Receivers are the
same devices, each needing the ``M = B / D`` rows of its destination shard.
The all_to_all runs over a 1-D axis of the devices in sender order; sender
``i`` sends a block of ``C`` rows to every position ``k``.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from distflow_jax.data import assign
from distflow_jax.data.layout import Layout


@dataclasses.dataclass(frozen=True, eq=False)
class RepartitionPlan:
  num_rows: int                        # B
  senders: tuple[jax.Device, ...]      # flat device order; sender i holds rows [i*R, (i+1)*R)
  rows_per_sender: int                 # R
  rows_per_receiver: int               # M = B / D
  block: int                           # C, rows per all_to_all block
  dst_B: np.ndarray                    # destination shard of every input row
  dst_shard_N: np.ndarray              # destination shard of the device at position k
  perm_B: np.ndarray                   # output row j (global, dst order) = input row perm_B[j]
  send_idx_NxNC: np.ndarray            # sender-local row sent in slot (k, c); pad slots hold 0
  recv_idx_NxM: np.ndarray             # slot of the received [N*C] rows for each output row
  gather_idx_NxM: np.ndarray           # global input row of each output row, per position

  @property
  def num_devices(self) -> int:
    return len(self.senders)

  def traffic(self, row_bytes: int, centralized: bool) -> dict[int, tuple[int, int]]:
    """``process -> (bytes sent, bytes received)`` across process boundaries.

    Distributed: every all_to_all block between devices of different
    processes (``C`` rows, padding included).  Centralized: every sender's
    ``R`` rows to device 0's process and every position's ``M`` rows back.
    """
    procs = np.array([d.process_index for d in self.senders])
    out = {int(p): [0, 0] for p in np.unique(procs)}
    if centralized:
      hub = procs[0]
      for k in range(self.num_devices):
        if procs[k] != hub:
          p = int(procs[k])
          out[p][0] += self.rows_per_sender * row_bytes
          out[int(hub)][1] += self.rows_per_sender * row_bytes
          out[int(hub)][0] += self.rows_per_receiver * row_bytes
          out[p][1] += self.rows_per_receiver * row_bytes
    else:
      cross = procs[:, None] != procs[None, :]
      per_dev_sent = cross.sum(1) * self.block * row_bytes
      per_dev_recv = cross.sum(0) * self.block * row_bytes
      for k in range(self.num_devices):
        out[int(procs[k])][0] += int(per_dev_sent[k])
        out[int(procs[k])][1] += int(per_dev_recv[k])
    return {p: (s, r) for p, (s, r) in out.items()}


def _senders(src: Layout, num_rows: int) -> tuple[list[jax.Device], int]:
  rows = src.device_rows(num_rows)
  order = {d: i for i, d in enumerate(src.mesh.devices.flat)}
  by_start: dict[int, list[jax.Device]] = {}
  for d, (start, _) in rows.items():
    by_start.setdefault(start, []).append(d)
  shard_rows = num_rows // src.num_shards
  replicas = len(rows) // src.num_shards
  if shard_rows % replicas:
    raise ValueError(
        f"layout {src} holds {shard_rows} samples per shard on {replicas} "
        f"replica devices; the re-partition splits a shard over its replicas, "
        f"so use a batch size that is a multiple of {src.num_shards * replicas}")
  senders = []
  for start in sorted(by_start):
    senders.extend(sorted(by_start[start], key=order.__getitem__))
  return senders, shard_rows // replicas


def make_repartition_plan(lengths_B: np.ndarray, src: Layout, dst: Layout,
              group_size: int = 1) -> RepartitionPlan:
  """Computes the length-balanced plan moving a batch from ``src`` to ``dst``.

  ``group_size > 1`` keeps each run of that many consecutive samples (a GRPO
  group, as :func:`~distflow_jax.data.batch.expand_groups` lays them out) on
  one destination shard.
  """
  lengths_B = np.asarray(lengths_B)
  if lengths_B.ndim != 1 or lengths_B.size == 0:
    raise ValueError(f"lengths must be a non-empty 1-D array, got shape "
                     f"{lengths_B.shape}")
  num_rows = lengths_B.size
  if src.devices != dst.devices:
    raise ValueError(
        f"source layout {src} and destination layout {dst} span different "
        f"devices; a re-partition moves samples among one set of devices")
  senders, rows_per_sender = _senders(src, num_rows)
  num_dev = len(senders)
  num_dst = dst.num_shards
  rows_per_receiver = dst.check_rows(num_rows)
  sender_B = np.arange(num_rows) // rows_per_sender
  dst_B = assign.assign_destinations(lengths_B, sender_B, num_dev, num_dst,
                                     group_size=group_size)
  shard_of = dst.shard_of(num_rows)
  dst_shard_N = np.array([shard_of[d] for d in senders], dtype=np.int64)

  # Rank of each row among the rows of its (sender, destination) pair, in row
  # order: its slot inside the block that carries it.
  pair_B = sender_B * num_dst + dst_B
  order = np.lexsort((np.arange(num_rows), pair_B))
  first = np.searchsorted(pair_B[order], pair_B[order], side="left")
  rank_B = np.empty(num_rows, dtype=np.int64)
  rank_B[order] = np.arange(num_rows) - first
  block = int(rank_B.max()) + 1

  send = np.zeros((num_dev, num_dev * block), dtype=np.int32)
  local_B = np.arange(num_rows) - sender_B * rows_per_sender
  for k in range(num_dev):
    m = dst_B == dst_shard_N[k]
    send[sender_B[m], k * block + rank_B[m]] = local_B[m]
  rows_by_shard = [np.flatnonzero(dst_B == s) for s in range(num_dst)]
  perm_B = np.concatenate(rows_by_shard)
  recv = np.stack([sender_B[rows_by_shard[s]] * block + rank_B[rows_by_shard[s]]
                   for s in dst_shard_N]).astype(np.int32)
  gather = np.stack([rows_by_shard[s] for s in dst_shard_N]).astype(np.int32)
  return RepartitionPlan(num_rows=num_rows, senders=tuple(senders),
              rows_per_sender=rows_per_sender,
              rows_per_receiver=rows_per_receiver, block=block, dst_B=dst_B,
              dst_shard_N=dst_shard_N, perm_B=perm_B, send_idx_NxNC=send,
              recv_idx_NxM=recv, gather_idx_NxM=gather)
