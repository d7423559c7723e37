"""The first step's training programs compile while its rollout runs (``trainer.compile_overlap``).

A run's first step compiles every program of its chain, one after the other: the rollout's
(prefill, decode) and then, once the rollout has made its batch, the passes and train
steps.  The latter do not depend on the rollout's output, only on its shapes, which the
first batch's prompt width fixes.  So at the start of the first step ``start`` asks
``plan --lower``'s catalogue (``lowering.catalogue.late_programs``, handed in by the
``train`` command: the same builders the nodes call) for the sequence passes and train
steps after the rollout stage at that width, and compiles them
(``lower().compile()``) in background threads while the main thread runs the rollout;
the main thread waits for them (``wait``) before its first node off the rollout layout,
and jax's in-memory compilation cache hands each node its executable: every program is
compiled once, as without the overlap, and the results are the same bit for bit.

On an accelerator the rollout runs on the device while the host compiles, and the host
has cores to spare: the first step costs about max(rollout, training compiles) instead of
their sum.  On a CPU the two share the cores.  A program the catalogue cannot build, or
whose compile fails here, is left to the node (which compiles it as before and reports any
error itself).  Off with ``trainer.compile_overlap=False``, and in the asynchronous
pipelines (their rollout already runs beside the training).
"""

from __future__ import annotations

import concurrent.futures
import os
import time
from typing import Any, Callable

import numpy as np

from distflow_jax.dag.planner import LayoutKind
from distflow_jax.state.context import RunContext

# (ctx, prompt width) -> programs with ``fn``, ``args`` and ``kwargs``
# (lowering.catalogue.late_programs: the passes and train steps, each jitted function built
# once per run through ``RunContext.jitted``, so the catalogue's object is the node's and
# the node finds the executable).  A re-partition's all-to-all and the advantage scans are
# left to their nodes: cheap, and their jitted functions are the data's, not memoised.
ProgramsAt = Callable[[RunContext, int], list[Any]]


class Overlap:
  """Background compiles of the first step's training programs (see the module doc)."""

  def __init__(self, programs: list[Any], workers: int):
    self.count, self.failed, self.seconds = len(programs), 0, 0.0
    self._t0 = time.perf_counter()
    self._pool = concurrent.futures.ThreadPoolExecutor(max(1, workers),
                                                       thread_name_prefix="compile")
    self._futures = [self._pool.submit(self._compile, p) for p in programs]

  @staticmethod
  def _compile(program: Any) -> bool:
    try:
      program.fn.lower(*program.args, **program.kwargs).compile()
      return True
    except Exception:  # pylint: disable=broad-except  - the node compiles and reports it
      return False

  def wait(self) -> None:
    """Blocks until every background compile is done (the first training node's turn)."""
    if self._futures:
      self.failed = sum(not f.result() for f in self._futures)
      self._futures = []
      self.seconds = time.perf_counter() - self._t0
      self._pool.shutdown(wait=True)

  def metrics(self) -> dict[str, float]:
    return {"compile/overlap_programs": float(self.count - self.failed),
            "compile/overlap_s": self.seconds}


def start(ctx: RunContext, prompts: Any, programs_at: ProgramsAt | None) -> Overlap | None:
  """Starts the background compiles for a first step on ``prompts`` (None: off, or no
  ``programs_at`` handed in)."""
  if programs_at is None or not ctx.cfg.trainer.get("compile_overlap", True):
    return None
  if not any(s.layout.kind is LayoutKind.ROLLOUT for s in ctx.plan.steps):
    return None
  from distflow_jax.nodes import rollout as rollout_node
  cfg = ctx.cfg
  width = rollout_node.prompt_width(int(np.asarray(prompts.data["prompt_len"]).max(initial=0)),
                                    cfg.rollout.prefill_buckets, cfg.data.max_prompt_len)
  try:
    programs = programs_at(ctx, width)
  except Exception:  # pylint: disable=broad-except  - no overlap, the step compiles as before
    return None
  if not programs:
    return None
  # Half the host's cores: the rollout's own compiles and host work keep the rest.
  return Overlap(programs, min(len(programs), max(1, (os.cpu_count() or 2) // 2)))
