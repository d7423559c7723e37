"""The programs a rollout engine compiles: their list, their grouping and their precompile.

An engine's compiles are bounded (rollout/engine/core.py): for each cache capacity an empty
state, a decode loop and a grow step to the next capacity; for each prompt shape
(rollout/engine/prefill_rows.py: a power-of-four row count up to the slots, a prefill bucket) a
prefill-and-insert at every capacity; with multi-turn episodes, for each appended-length
bucket an append at every capacity (rollout/engine/extend.py).  ``programs`` lists them as
``(name, jitted, abstract args)`` for parameters laid out as a given signature; ``precompile`` compiles
them ahead of time, counting a capacity or a prompt shape (a program's ``group``) as one
unit; ``sync_programs`` lists what a weight update runs.  ``plan --lower`` lowers the same
lists for a target device.
"""

from __future__ import annotations

import concurrent.futures
import os
from collections.abc import Callable, Iterable, Sequence
from typing import Any, NamedTuple

import jax
import numpy as np

from distflow_jax.models import lora, stacking
from distflow_jax.rollout import weight_sync

class Program(NamedTuple):
  """One compiled program: a name with its shape, the jitted function, its abstract
  arguments, and the unit ``precompile`` counts it in (a capacity or a prompt shape)."""
  name: str
  fn: Any
  args: tuple
  group: tuple = ()


def programs(params_sig: Any, *, slots: int, capacities: Sequence[int],
             shapes: Sequence[tuple[int, int]], state_shardings: Any, init: Any, decode: Any,
             grow: Any, prefill_insert: Any, append: Any = None) -> list[Program]:
  """Every program of an engine with ``slots`` slots, for parameters laid out as
  ``params_sig`` (``ShapeDtypeStruct``s with shardings): each cache capacity's empty state
  (``init``), decode loop (``decode``) and grow step (``grow``), for each prompt shape
  of ``shapes`` its prefill-and-insert (``prefill_insert``) at every capacity, and with
  multi-turn episodes each append program (``append``: the engine's ``extend.Extender``)."""
  sds = lambda x, sh: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh)  # noqa: E731
  states = {c: jax.tree.map(sds, jax.eval_shape(init, c), state_shardings)
            for c in capacities}
  ints, keys = np.zeros(slots, np.int32), np.zeros((slots, 2), np.uint32)
  out: list[Program] = []
  for i, c in enumerate(capacities):
    unit = ("capacity", c)
    out.append(Program(f"init[cap={c}]", init, (c,), unit))
    out.append(Program(f"decode[cap={c}]", decode, (params_sig, states[c]), unit))
    if i + 1 < len(capacities):
      out.append(Program(f"grow[{c}->{capacities[i + 1]}]", grow,
                         (states[c], capacities[i + 1]), unit))
  for p, t in shapes:
    for c in capacities:
      args = (params_sig, states[c], np.zeros((p, t), np.int32), np.ones((p,), np.int32),
              ints, ints, keys, ints)
      out.append(Program(f"prefill_insert[rows={p},len={t},cap={c}]", prefill_insert, args,
                         (p, t)))
  if append is not None:
    out += [Program(*p) for p in append.programs(params_sig, states)]
  return out


def compile_all(lowerables: Sequence[tuple[Any, tuple]]) -> None:
  """``fn.lower(*args).compile()`` of each ``(fn, args)``, in a thread pool: XLA compiles
  independent programs in parallel (each compile is mostly single-threaded), and a
  compile fills the jitted function's cache as a call would."""
  if len(lowerables) < 2:
    for fn, args in lowerables:
      fn.lower(*args).compile()
    return
  workers = min(len(lowerables), os.cpu_count() or 1)
  with concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="compile") as pool:
    for f in [pool.submit(lambda fa: fa[0].lower(*fa[1]).compile(), x) for x in lowerables]:
      f.result()


def precompile(programs: Iterable[Program], done: set[tuple]) -> set[tuple]:
  """Compiles (in parallel: ``compile_all``) each of ``programs`` whose ``group`` is not
  in ``done``; returns the groups it compiled."""
  todo = [p for p in programs if p.group not in done]
  compile_all([(p.fn, p.args) for p in todo])
  return {p.group for p in todo}


def sync_programs(train_params: Any, param_shardings: Any,
                  unstack: Callable[[], Any] | None = None,
                  process_of: Callable[[jax.Device], int] | None = None,
                  fuse: bool = False) -> list[Program]:
  """The programs a weight update runs for (abstract, sharded) ``train_params``: the split
  of stacked layers (``unstack()``: the engine's jitted split; None: a backend that takes
  stacked layers as they are), then the weight sync's steps into ``param_shardings``
  (``process_of``: a simulated topology's device -> process, as ``WeightSync`` takes it;
  ``fuse``: the split also fuses projections, models/fused.py, so it runs on any state)."""
  out = []
  if unstack is not None and (stacking.is_stacked(train_params)
                              or lora.has_adapters(train_params) or fuse):
    split = unstack()
    out.append(Program("unstack", split, (train_params,)))
    # The split's output layout is what sharding propagation picks: ask the compiler.
    placed = split.lower(train_params).compile().output_shardings
    train_params = jax.tree.map(
        lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
        jax.eval_shape(split, train_params), placed)
  sync = weight_sync.WeightSync(param_shardings, process_of)
  return out + [Program(f"sync/{n}", fn, args) for n, fn, args in sync.programs(train_params)]
