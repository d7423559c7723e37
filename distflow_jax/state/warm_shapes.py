"""Every prompt width a run can meet, compiled when the first width is: no compile mid-run.

Each step pads its prompts to the smallest prefill bucket that holds its longest prompt
(``nodes/rollout.prompt_width``), so the sequence passes, the train steps and the
re-partitions see a handful of batch shapes, ``[B, P]`` prompt columns for P in
``prompt_widths``.  Left alone, jit compiles each the first time a step meets it: a
stall of seconds in the middle of a run (5 recompiles in 10 steps on bench_e2e's
prompts).  Here every such function records the abstract arguments of its calls
(shapes, dtypes, shardings; ``Recorder.record``); at the end of a step, each signature
seen for the first time is compiled for every other width (``Recorder.compile_widths``):
``jit(f).lower(*abstract).compile()`` fills the same in-memory cache the later call
looks in, so that call runs at once, and with the persistent cache on
(``compile_cache.py``) the next run loads them all.  A re-partition is rehearsed on
zeros instead (``redistribute.rehearse``): besides its jitted exchange it runs small
per-device slices that compile per shape too.

What a width changes: the leaves named ``prompt_tokens`` / ``prompt_mask`` (``[B, P]``),
wherever they sit in the arguments.  A call with a packing plan (``"pack"``: its row
count and, at ``model.pack_len=0``, its row length follow the samples' lengths) is not
varied: those shapes cannot be known ahead.  Every process records the same calls in
the same order (the same plan and shapes), so collective programs compile in lockstep.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import enum
import os
from collections.abc import Callable, Sequence
from typing import Any

import jax
from distflow_jax.data.fields import PROMPT_MASK, PROMPT_TOKENS

class CompileAhead(enum.Enum):
  """``trainer.compile_ahead``: when a run compiles the shapes it has not met yet (every
  prompt width of each new signature, and the rollout engines' prefill shapes).  AUTO:
  with the persistent compile cache on (paid once, loaded by later runs); ALWAYS: also
  without it (no compile after step 1, at the price of widths a run may never meet);
  NEVER: each shape when first met."""
  AUTO = "auto"
  ALWAYS = "always"
  NEVER = "never"

  def on(self, cache_active: bool) -> bool:
    return self is CompileAhead.ALWAYS or (self is CompileAhead.AUTO and cache_active)


WIDTH_KEYS = (PROMPT_TOKENS, PROMPT_MASK)
_UNVARIED_KEYS = ("pack",)


def _key_names(path) -> list[str]:
  return [str(k.key) for k in path if isinstance(k, jax.tree_util.DictKey)]


def abstract(tree: Any) -> Any:
  """Arrays as ``ShapeDtypeStruct``s with their shardings; other leaves (static
  arguments such as a graphdef) as they are."""
  def one(x):
    if isinstance(x, jax.Array):
      return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
    return x
  return jax.tree.map(one, tree)


def prompt_width_of(args: Any) -> int | None:
  """The prompt width of a call's arguments; None when it has no prompt leaves or has a
  packing plan (its shapes are not a function of the width alone)."""
  width = None
  for path, x in jax.tree_util.tree_flatten_with_path(args)[0]:
    names = _key_names(path)
    if any(n in _UNVARIED_KEYS for n in names):
      return None
    if names and names[-1] in WIDTH_KEYS and getattr(x, "ndim", 0) >= 2:
      width = x.shape[1]
  return width


def with_width(args: Any, width: int) -> Any:
  """``args`` (abstract) with every prompt leaf ``[B, P, ...]`` made ``[B, width, ...]``."""
  def one(path, x):
    names = _key_names(path)
    if names and names[-1] in WIDTH_KEYS and isinstance(x, jax.ShapeDtypeStruct):
      return jax.ShapeDtypeStruct((x.shape[0], width) + x.shape[2:], x.dtype,
                                  sharding=x.sharding)
    return x
  return jax.tree_util.tree_map_with_path(one, args)


def _signature(key: Any, args: Any) -> Any:
  leaves, treedef = jax.tree.flatten(args)
  return (key, treedef, tuple((x.shape, str(x.dtype), x.sharding)
                              if isinstance(x, jax.ShapeDtypeStruct) else x for x in leaves))


@dataclasses.dataclass
class _Call:
  warm: Callable[..., Any]    # compiles for these abstract args
  args: Any                   # abstract, at `width`
  width: int
  compile_only: bool = False  # `warm` only compiles (runs nothing on the devices)


@dataclasses.dataclass
class Recorder:
  """The calls whose other prompt widths still have to compile (see the module doc)."""
  widths: tuple[int, ...] = ()
  _seen: set = dataclasses.field(default_factory=set)
  _pending: list[_Call] = dataclasses.field(default_factory=list)

  def record(self, key: Any, warm: Callable[..., Any], args: Sequence[Any],
             compile_only: bool = False) -> None:
    """Notes a call of the function ``key`` names with ``args``; a new signature with a
    prompt width queues ``warm(*abstract_args)`` (compiles what that call would) at each
    other width (``compile_only``: ``warm`` runs nothing on the devices)."""
    if len(self.widths) < 2:
      return
    width = prompt_width_of(args)
    if width is None:
      return
    abstract_args = abstract(tuple(args))
    for w in self.widths:  # every width of this signature counts as seen from now on
      sig = _signature(key, with_width(abstract_args, w))
      if sig in self._seen:
        continue
      self._seen.add(sig)
      if w != width:
        self._pending.append(_Call(warm, with_width(abstract_args, w), w, compile_only))

  def compile_widths(self) -> int:
    """Compiles every queued call at its width; returns how many.  Compile-only calls
    (``Recorded``'s: they run nothing, so no order across processes) go to a thread
    pool; the others (a re-partition's rehearsal runs collectives) run in record order,
    the same on every process."""
    pending, self._pending = self._pending, []
    pooled = [c for c in pending if c.compile_only]
    if pooled:
      workers = min(len(pooled), os.cpu_count() or 1)
      with concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="compile") as pool:
        for f in [pool.submit(call.warm, *call.args) for call in pooled]:
          f.result()
    for call in pending:
      if not call.compile_only:
        call.warm(*call.args)
    return len(pending)


class Recorded:
  """A jitted function (``jax.jit`` object or ``placement.PinnedStep``: anything with
  ``.lower``) whose calls go to ``recorder``; other attributes pass through."""

  def __init__(self, fn: Any, key: Any, recorder: Recorder):
    self._fn, self._key, self._recorder = fn, key, recorder

  def __call__(self, *args):
    self._recorder.record(self._key, self._compile, args, compile_only=True)
    return self._fn(*args)

  def _compile(self, *abstract_args) -> None:
    self._fn.lower(*abstract_args).compile()

  def __getattr__(self, name: str) -> Any:
    return getattr(self._fn, name)
