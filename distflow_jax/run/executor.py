"""The per-host DAG executor: walks the plan's chain for one RL step.

Every process runs this same loop over the same plan.  Between two nodes the
batch either stays where it is (fast path: the layouts hold the same rows on
the same devices, nothing is copied) or is re-partitioned with one
all-to-all to the next node's layout, length-balanced by prompt + response
tokens.  Host-side nodes work on their own rows; nothing waits on a central
process.  Per-node wall time is recorded (the slowest host's).

A node returns what it made (``nodes.common.NodeOut``: the batch, its metrics, the new
train state of a role it trained); this loop is the one place that applies it: the
step's metrics are a local ``Metrics`` that ``run_step`` returns reduced, and a trained
role's parameters and optimizer state are put in its ``ModelState`` here.

Algorithm variants hook in at two named points instead of branching here:
``dynamic_sampling.sample_prefix`` before the chain (DAPO's filter) and
``algo_state.after_step`` after it (the adaptive KL coefficient).
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from distflow_jax.dag.planner import LayoutKind, Move
from distflow_jax.dag.registry import FUNCTIONS
from distflow_jax.data import redistribute as rd
from distflow_jax.data.batch import Batch, redistribute_batch
from distflow_jax.state import algo_state
from distflow_jax.nodes.common import NodeOut, node_out
from distflow_jax.run import dynamic_sampling
from distflow_jax.state.context import RunContext, shared_prompt_group
from distflow_jax.state.metrics import Metrics
from distflow_jax.data.fields import PROMPT_MASK, RESPONSE_MASK


def _lengths(masks: dict) -> jax.Array:
  return (masks[PROMPT_MASK].sum(axis=1, dtype=jnp.int32)
          + masks[RESPONSE_MASK].sum(axis=1, dtype=jnp.int32))


def lengths_fn(ctx: RunContext):
  """The jitted prompt + response token count per sample, built once through ``ctx`` so
  that its other prompt widths compile ahead too (``plan --lower`` lowers it as well)."""
  return ctx.jitted("token_lengths", lambda: jax.jit(_lengths))


def _token_lengths(ctx: RunContext, batch: Batch) -> np.ndarray:
  """Prompt + response tokens per sample, replicated on every process (one small gather)."""
  fn = lengths_fn(ctx)
  return rd.replicate_lengths(fn({k: batch.data[k] for k in (PROMPT_MASK, RESPONSE_MASK)}))


def move_group(ctx: RunContext, to_rollout: bool, rows: int, lay) -> int:
  """Runs of consecutive samples a re-partition into ``lay`` keeps together: whole prompt
  groups into a rollout layout, else where the sequence passes can share their prompt."""
  if to_rollout:
    return ctx.cfg.rollout.n
  return shared_prompt_group(ctx.cfg, rows, lay.num_shards)


def _block(batch: Batch) -> None:
  # Wait for the node's work, so timings are honest and CPU collectives never pile up.
  jax.block_until_ready([v for v in batch.data.values() if isinstance(v, jax.Array)])


def _recorder(ctx: RunContext, dst, mode: str):
  """Notes a re-partition's shapes in ``ctx.shapes``: at the end of the step it is
  rehearsed on zeros at the other prompt widths (warm_shapes.py)."""
  def on_plan(tree, plan):
    key = ("move", mode, dst, plan.senders, plan.rows_per_sender, plan.send_idx_NxNC.shape,
           plan.recv_idx_NxM.shape)
    ctx.shapes.record(key, functools.partial(rd.rehearse, plan=plan, dst=dst, mode=mode),
                      (tree,))
  return on_plan


def apply(ctx: RunContext, out: NodeOut, metrics: Metrics) -> Batch:
  """Applies a node's output: its metrics into the step's ``metrics``, each trained role's
  new parameters and optimizer state into ``ctx.roles``; returns its batch."""
  metrics.merge(out.metrics)
  for role, new in out.states.items():
    state = ctx.roles[role]
    state.params, state.opt_state = new.params, new.opt_state
  return out.batch


def run_steps(ctx: RunContext, steps, batch: Batch, current, metrics: Metrics,
              before_training: Callable[[], None] | None = None):
  """Runs ``steps`` of the chain, recording into ``metrics``; returns the batch and its
  layout.  ``before_training`` runs once, before the first step off the rollout layout
  (run/compile_overlap.py)."""
  for step in steps:
    node = step.node
    lay = ctx.layout(step.layout)
    to_rollout = step.layout.kind is LayoutKind.ROLLOUT
    if before_training is not None and not to_rollout:
      before_training()
      before_training = None
    t0 = time.perf_counter()
    if current is not None and step.move_in is Move.REPARTITION:
      lengths = _token_lengths(ctx, batch)
      group = move_group(ctx, to_rollout, batch.num_samples, lay)
      try:
        batch, _ = redistribute_batch(batch, lengths, current, lay,
                                      mode=ctx.cfg.data.redistribute, group_size=group,
                                      on_plan=_recorder(ctx, lay, ctx.cfg.data.redistribute))
      except ValueError:
        if group == 1 or to_rollout:
          raise
        # The source layout splits groups over devices: move rows singly (the passes then
        # see ungrouped rows and run each row's prompt).  Every process decides alike.
        batch, _ = redistribute_batch(batch, lengths, current, lay,
                                      mode=ctx.cfg.data.redistribute,
                                      on_plan=_recorder(ctx, lay, ctx.cfg.data.redistribute))
      _block(batch)
      metrics.add_time(f"time/move_to/{node.id}", time.perf_counter() - t0)
      t0 = time.perf_counter()
    elif current is not None and step.move_in is Move.FAST:
      batch, _ = redistribute_batch(batch, np.zeros(0, np.int32), current, lay)
    batch = apply(ctx, node_out(node, FUNCTIONS.impl(node.fn)(ctx, node, lay, batch)), metrics)
    _block(batch)
    metrics.add_time(f"time/{node.id}", time.perf_counter() - t0)
    current = lay
  return batch, current


def run_step(ctx: RunContext, prompts: Batch,
             more_prompts: Callable[[], Batch] | None = None,
             before_training: Callable[[], None] | None = None) -> dict[str, float]:
  """One step of the workflow on this process; returns metrics reduced over hosts.

  ``more_prompts`` feeds DAPO's dynamic sampling (``algo.dynamic_sampling_tries``);
  ``before_training`` as ``run_steps``'.
  """
  metrics = Metrics()
  start = time.perf_counter()
  batch, current, done = dynamic_sampling.sample_prefix(
      ctx, prompts, more_prompts, metrics,
      lambda part, b, lay: run_steps(ctx, part, b, lay, metrics))
  return run_rest(ctx, batch, current, done, start, metrics, before_training)


def run_rest(ctx: RunContext, batch: Batch, current, done: int, start: float,
             metrics: Metrics, before_training: Callable[[], None] | None = None
             ) -> dict[str, float]:
  """The chain's steps from ``done`` on (``batch`` laid out as ``current``), then the
  step's metrics (``metrics`` and the rest of the step's, reduced over hosts; ``time/step``
  since ``start``)."""
  steps = ctx.plan.steps
  batch, _ = run_steps(ctx, steps[done:], batch, current, metrics, before_training)
  tokens = float(_token_lengths(ctx, batch).sum())
  metrics.set_max("time/step", time.perf_counter() - start)
  out = metrics.reduce()
  out["tokens"] = tokens
  out["tokens_per_s"] = tokens / max(out["time/step"], 1e-9)
  for step in steps:  # DistFlow's throughput: prompt + response tokens per second
    out[f"tokens_per_s/{step.node.id}"] = tokens / max(out[f"time/{step.node.id}"], 1e-9)
  ctx.algo_state = algo_state.after_step(ctx.cfg, ctx.algo_state, out)
  if "reward" in out and "reward_sq" in out:
    out["reward_std"] = float(np.sqrt(max(out.pop("reward_sq") - out["reward"] ** 2, 0.0)))
  if "reward_min_neg" in out:
    out["reward_min"] = -out.pop("reward_min_neg")
  return out
