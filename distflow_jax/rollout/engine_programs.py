"""The programs a rollout engine compiles: their list, their grouping and their precompile.

An engine's compiles are bounded (rollout/engine.py): for each cache capacity an empty
state, a decode loop and a grow step to the next capacity; for each prompt shape
(rollout/prefill_rows.py: a power-of-two row count up to the slots, a prefill bucket) a
prefill and an insert at every capacity.  ``programs`` lists them as ``(name, jitted,
abstract args)`` for parameters laid out as a given signature; ``precompile`` compiles
them ahead of time, counting a capacity or a prompt shape (``program_group``) as one
unit; ``sync_programs`` lists what a weight update runs.  ``plan --lower`` lowers the same
lists for a target device.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import jax
import numpy as np

from distflow_jax.models import stacking
from distflow_jax.rollout import weight_sync

Program = tuple[str, Any, tuple]  # (name, jitted function, abstract arguments)


def programs(params_sig: Any, *, slots: int, capacities: Sequence[int],
             shapes: Sequence[tuple[int, int]], state_shardings: Any, prefill_shardings: Any,
             init: Any, decode: Any, grow: Any, prefill_insert: Any, insert: Any
             ) -> list[Program]:
  """Every program of an engine with ``slots`` slots, for parameters laid out as
  ``params_sig`` (``ShapeDtypeStruct``s with shardings): each cache capacity's empty state
  (``init``), decode loop (``decode``) and grow step (``grow``), and for each prompt shape
  of ``shapes`` its prefill (``prefill_insert``) and its ``insert`` at every capacity."""
  sds = lambda x, sh: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh)  # noqa: E731
  states = {c: jax.tree.map(sds, jax.eval_shape(init, c), state_shardings)
            for c in capacities}
  ints, keys = np.zeros(slots, np.int32), np.zeros((slots, 2), np.uint32)
  out: list[Program] = []
  for i, c in enumerate(capacities):
    out.append((f"init[cap={c}]", init, (c,)))
    out.append((f"decode[cap={c}]", decode, (params_sig, states[c], np.asarray(False))))
    if i + 1 < len(capacities):
      out.append((f"grow[{c}->{capacities[i + 1]}]", grow, (states[c], capacities[i + 1])))
  for p, t in shapes:
    args = (params_sig, np.zeros((p, t), np.int32), np.ones((p,), np.int32), ints, keys)
    prefix = jax.tree.map(sds, jax.eval_shape(prefill_insert, *args), prefill_shardings)
    out.append((f"prefill[rows={p},len={t}]", prefill_insert, args))
    cache, lens_q, tok = prefix[:3]
    for c in capacities:
      out.append((f"insert[rows={p},len={t},cap={c}]", insert,
                  (states[c], cache, ints, ints, tok, lens_q, keys, ints)))
  return out


def program_group(name: str) -> tuple:
  """What ``precompile`` counts as one unit: a capacity (init, decode, grow) or a prompt
  shape (prefill and its inserts)."""
  kind, _, rest = name.partition("[")
  fields = dict(f.split("=") for f in rest.rstrip("]").split(",") if "=" in f)
  if kind in ("prefill", "insert"):
    return (int(fields["rows"]), int(fields["len"]))
  if kind == "grow":
    return ("capacity", int(rest.split("->")[0]))
  return ("capacity", int(fields["cap"]))


def precompile(programs: Iterable[Program], done: set[tuple]) -> set[tuple]:
  """Compiles each of ``programs`` whose group (``program_group``) is not in ``done``;
  returns the groups it compiled."""
  compiled = set()
  for name, fn, args in programs:
    group = program_group(name)
    if group in done:
      continue
    fn.lower(*args).compile()
    compiled.add(group)
  return compiled


def sync_programs(train_params: Any, param_shardings: Any, unstack: Callable[[], Any],
                  process_of: Callable[[jax.Device], int] | None = None) -> list[Program]:
  """The programs an engine's weight update runs for (abstract, sharded) ``train_params``:
  the split of stacked layers (``unstack()``: the engine's jitted split), then the weight
  sync's steps into ``param_shardings`` (``process_of``: a simulated topology's device ->
  process, as ``WeightSync`` takes it)."""
  out = []
  if stacking.is_stacked(train_params):
    split = unstack()
    out.append(("unstack", split, (train_params,)))
    # The split's output layout is what sharding propagation picks: ask the compiler.
    placed = split.lower(train_params).compile().output_shardings
    train_params = jax.tree.map(
        lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
        jax.eval_shape(split, train_params), placed)
  sync = weight_sync.WeightSync(param_shardings, process_of)
  return out + [(f"sync/{n}", fn, args) for n, fn, args in sync.programs(train_params)]
