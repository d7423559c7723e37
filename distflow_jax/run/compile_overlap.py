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
error itself); the run's log says so in one line, so an overlap that stopped working is
seen, and ``compile/overlap_failed`` counts the programs it could not compile.  Off with
``trainer.compile_overlap=False``, and in the asynchronous pipelines (their rollout
already runs beside the training).
"""

from __future__ import annotations

import concurrent.futures
import os
import time
from typing import Any, Callable

import numpy as np

from distflow_jax.dag.planner import LayoutKind
from distflow_jax.nodes import rollout as rollout_node
from distflow_jax.state.context import RunContext

# (ctx, prompt width) -> programs with ``fn``, ``args`` and ``kwargs``
# (lowering.catalogue.late_programs: the passes and train steps, each jitted function built
# once per run through ``RunContext.jitted``, so the catalogue's object is the node's and
# the node finds the executable).  A re-partition's all-to-all and the advantage scans are
# left to their nodes: cheap, and their jitted functions are the data's, not memoised.
ProgramsAt = Callable[[RunContext, int], list[Any]]
Log = Callable[[str], None]


class Overlap:
  """Background compiles of the first step's training programs (see the module doc)."""

  def __init__(self, programs: list[Any], workers: int, log: Log | None = None):
    self.count, self.failed, self.seconds = len(programs), 0, 0.0
    self._log = log
    self._t0 = time.perf_counter()
    self._pool = concurrent.futures.ThreadPoolExecutor(max(1, workers),
                                                       thread_name_prefix="compile")
    self._futures = [self._pool.submit(self._compile, p) for p in programs]

  @staticmethod
  def _compile(program: Any) -> str | None:
    """None when compiled, else the error in one line."""
    try:
      program.fn.lower(*program.args, **program.kwargs).compile()
      return None
    except Exception as e:  # pylint: disable=broad-except  - the node compiles and reports it
      return _one_line(e)

  def wait(self) -> None:
    """Blocks until every background compile is done (the first training node's turn)."""
    if self._futures:
      errors = [e for e in (f.result() for f in self._futures) if e is not None]
      self.failed = len(errors)
      self._futures = []
      if errors and self._log is not None:
        self._log(f"compile overlap: {len(errors)} of {self.count} training programs did not "
                  f"compile in the background ({errors[0]}); their nodes compile them")
      self.seconds = time.perf_counter() - self._t0
      self._pool.shutdown(wait=True)

  def metrics(self) -> dict[str, float]:
    return {"compile/overlap_programs": float(self.count - self.failed),
            "compile/overlap_failed": float(self.failed), "compile/overlap_s": self.seconds}


def _one_line(e: BaseException) -> str:
  text = " ".join(str(e).split())
  return f"{type(e).__name__}: {text[:200]}" if text else type(e).__name__


def start(ctx: RunContext, prompts: Any, programs_at: ProgramsAt | None,
          log: Log | None = None) -> Overlap | None:
  """Starts the background compiles for a first step on ``prompts`` (None: off, no
  ``programs_at`` handed in, or a catalogue that failed, said in one line to ``log``)."""
  if programs_at is None or not ctx.cfg.trainer.compile_overlap:
    return None
  if not any(s.layout.kind is LayoutKind.ROLLOUT for s in ctx.plan.steps):
    return None
  cfg = ctx.cfg
  width = rollout_node.prompt_width(int(np.asarray(prompts.data["prompt_len"]).max(initial=0)),
                                    cfg.rollout.prefill_buckets, cfg.data.max_prompt_len)
  try:
    programs = programs_at(ctx, width)
  except Exception as e:  # pylint: disable=broad-except  - no overlap: the nodes compile
    if log is not None:
      log(f"compile overlap off for this run: the catalogue could not build the training "
          f"programs ({_one_line(e)}); the first step compiles them in its nodes")
    return None
  if not programs:
    return None
  # Half the host's cores: the rollout's own compiles and host work keep the rest.
  return Overlap(programs, min(len(programs), max(1, (os.cpu_count() or 2) // 2)), log)
