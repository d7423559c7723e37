"""A rollout replica driven by several processes (tensor-parallel across hosts).

When a replica's mesh spans processes (dag/replicas.py), every one of them must issue the
same calls with the same inputs: each call is a cross-host collective step.  The driver
takes every decision on values replicated over the replica (rollout/driver.py), so what
remains is the prompts.  ``SpanningReplica`` wraps the backend of such a replica:

    out = SpanningReplica(backend, processes=(2, 3)).generate(params, my_prompts, n, ...)

1. one small gather among the calling group (``groups.allgather``: every process of the
   run, or of the rollout group on disjoint processes) of each process's prompt count
   and longest prompt, then one of the padded prompts and their request ids;
2. the replica's processes generate the union, in process order, with every request
   keeping its own id (so its key, and its samples, are those it would have had on a
   replica of its own host: request ids are global sample ids in the trainer);
3. each process keeps its own rows.

Processes of the group outside this replica take part in the gathers only.  Calls that
carry host-side extras (a vision-language model's image features) are refused: the
config check refuses those runs first (config/checks.py).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import jax
import numpy as np

from distflow_jax import groups
from distflow_jax.rollout import driver


def _key_bits(rng: jax.Array | None) -> np.ndarray:
  """``rng`` as 3 int32 (a flag, then its 2 words; all 0 for None: the engine's seed)."""
  if rng is None:
    return np.zeros(3, np.int32)
  raw = np.asarray(rng if rng.dtype == np.uint32 else jax.random.key_data(rng), np.uint32)
  return np.concatenate([[1], raw.reshape(-1)[:2].view(np.int32)]).astype(np.int32)


def pooled(mine: Sequence[Sequence[int]], ids: np.ndarray, n: int, processes: Sequence[int],
           rng: jax.Array | None = None) -> tuple[list[list[int]], np.ndarray, int]:
  """Every prompt and request id (``n`` a prompt) of ``processes``, in process order, and
  the offset of this process's first prompt among them (one gather of sizes, one of the
  data).  Every process of the group must draw with the same ``rng`` (else a replica's
  processes would sample tokens of their own and their decisions would part) and ask the
  same ``n``: refused on every one of them otherwise, so none waits for the others."""
  group = groups.current() or tuple(range(jax.process_count()))
  size = np.concatenate([[len(mine), max((len(p) for p in mine), default=0), n],
                         _key_bits(rng)]).astype(np.int32)
  sizes = groups.allgather(size)
  if (sizes[:, 3:] != sizes[0, 3:]).any():
    raise ValueError("generate: the processes of a rollout replica spanning hosts were "
                     "given different rng keys; they must draw with the same one")
  asks = sorted({int(k) for c, k in sizes[:, :3:2] if c})  # n of each process with prompts
  if len(asks) > 1:
    raise ValueError(f"generate: the processes of a rollout replica spanning hosts ask "
                     f"{' and '.join(map(str, asks))} samples per prompt; they must ask alike")
  rows, width, per = (int(sizes[:, i].max()) for i in range(3))
  data = np.zeros((rows, 1 + width + per), np.int32)  # length, tokens, request ids
  for i, p in enumerate(mine):
    data[i, 0], data[i, 1:1 + len(p)] = len(p), p
    data[i, 1 + width:1 + width + n] = ids[i * n:(i + 1) * n].view(np.int32)
  every = groups.allgather(data)
  prompts, out_ids, offset = [], [], 0
  for g, proc in enumerate(group):
    if proc not in processes:
      continue
    if proc == jax.process_index():
      offset = len(prompts)
    count, k = int(sizes[g, 0]), int(sizes[g, 2])
    for row in every[g, :count]:
      prompts.append(row[1:1 + row[0]].tolist())
      out_ids.append(row[1 + width:1 + width + k].view(np.uint32))
  flat = np.concatenate(out_ids) if out_ids else np.zeros((0,), np.uint32)
  return prompts, flat, offset


def own_rows(ro: driver.Rollout, offset: int, count: int, n: int) -> driver.Rollout:
  """The rows of prompts ``offset .. offset + count`` of a pooled rollout, re-indexed."""
  cut = slice(offset * n, (offset + count) * n)
  fields = {f.name: getattr(ro, f.name)[cut] for f in dataclasses.fields(ro)}
  fields["prompt_index_R"] = np.arange(count * n, dtype=np.int32) // n
  return driver.Rollout(**fields)


class SpanningReplica:
  """A backend whose replica several processes drive together (see module doc)."""

  def __init__(self, inner: Any, processes: Sequence[int]):
    self.inner, self.processes = inner, tuple(processes)
    self.name = inner.name

  def __getattr__(self, attr: str) -> Any:  # config, sync_bytes, load_params, engine, ...
    return getattr(self.inner, attr)

  def generate(self, params: Any, prompts: Sequence[Sequence[int]], n: int = 1, *,
               rng: jax.Array | None = None, request_ids: Sequence[int] | None = None,
               pad_id: int = 0, max_new_tokens: int | None = None, **extra) -> driver.Rollout:
    if extra:
      raise ValueError(f"generate: {sorted(extra)} cannot be pooled across the processes of "
                       f"a replica spanning hosts")
    mine = [list(map(int, p)) for p in prompts]
    ids = (np.arange(len(mine) * n, dtype=np.uint32) if request_ids is None
           else np.asarray(request_ids, np.uint32).reshape(-1))
    if ids.shape != (len(mine) * n,):
      raise ValueError(f"generate: {ids.size} request_ids for {len(mine) * n} requests "
                       f"({len(mine)} prompts x n={n})")
    every, every_ids, offset = pooled(mine, ids, n, self.processes, rng)
    ro = self.inner.generate(params, every, n, rng=rng, request_ids=every_ids,
                             pad_id=pad_id, max_new_tokens=max_new_tokens)
    return own_rows(ro, offset, len(mine), n)
