"""DAPO's dynamic sampling: drop prompt groups whose rewards are all equal, refill.

A group whose n samples all get the same reward has zero advantage under
GRPO-style estimators and teaches nothing.  With ``algo.dynamic_sampling_tries
= T > 0`` the executor runs the sampling prefix of the chain (generate and the
reward nodes, all on the host that holds the groups) up to T times on fresh
prompts, keeping only groups with varied rewards, until every host has a full
batch.  The decision to try again is taken from a small all-gather of every
host's count, so all hosts make the same number of tries (their jitted calls
stay in step).  When the tries run out, the batch is filled with constant
groups (zero advantage) and the number filled is reported.

``sample_prefix`` is the executor's hook before the chain: it runs the
prefix this way when dynamic sampling is on, and does nothing otherwise.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from distflow_jax.dag.planner import Move, Plan, Step
from distflow_jax.dag.registry import FUNCTIONS
from distflow_jax.data import layout as dlayout
from distflow_jax.data.batch import Batch, to_global, to_local
from distflow_jax.state.context import RunContext
from distflow_jax.state.metrics import Metrics, gather_processes
from distflow_jax.data.fields import (IMAGE_SLOTS, PROMPT_MASK, PROMPT_TOKENS, REWARDS,
                                      ROPE_POSITIONS)


def prefix_length(plan: Plan) -> int:
  """Steps up to the last reward node, if they all stay on the rollout layout (else 0)."""
  last = -1
  for s in plan.steps:
    if s.move_in is Move.REPARTITION or not s.groups_intact:
      break
    if REWARDS in FUNCTIONS.spec(s.node.fn).produces:
      last = s.index
  return last + 1


RunSteps = Callable[[Sequence[Step], Batch, dlayout.Layout | None],
                   tuple[Batch, dlayout.Layout]]


def sample_prefix(ctx: RunContext, prompts: Batch, more_prompts: Callable[[], Batch] | None,
                  metrics: Metrics, run_steps: RunSteps
                  ) -> tuple[Batch, dlayout.Layout | None, int]:
  """The executor's hook before the chain: (batch, its layout, chain steps already run).

  With ``algo.dynamic_sampling_tries`` the chain's sampling prefix runs here (see
  ``sample``); otherwise nothing has run: (prompts, None, 0).
  """
  tries = ctx.cfg.algo.dynamic_sampling_tries
  k = prefix_length(ctx.plan) if tries else 0
  if not k:
    return prompts, None, 0
  if more_prompts is None:
    raise ValueError("dynamic sampling needs a source of more prompts")
  prefix = ctx.plan.steps[:k]
  batch, lay = sample(lambda p: run_steps(prefix, p, None), prompts, more_prompts,
                      n=ctx.cfg.rollout.n, max_tries=tries, metrics=metrics)
  return batch, lay, k


def _all_have(have: int, need: int) -> bool:
  return bool(gather_processes(np.array([have], np.int64)).min() >= need)


def _same_prompt_width(groups: list[dict[str, np.ndarray]]) -> None:
  """Tries may pad prompts to different bucket widths: left-pad all to the widest
  (masked out; the pad value is each row's own first column, padding or not)."""
  if PROMPT_TOKENS not in groups[0]:
    return
  width = max(g[PROMPT_TOKENS].shape[1] for g in groups)
  for g in groups:
    extra = width - g[PROMPT_TOKENS].shape[1]
    if extra:
      g[PROMPT_TOKENS] = np.concatenate(
          [np.repeat(g[PROMPT_TOKENS][:, :1], extra, axis=1), g[PROMPT_TOKENS]], axis=1)
      g[PROMPT_MASK] = np.concatenate(
          [np.zeros((len(g[PROMPT_MASK]), extra), bool), g[PROMPT_MASK]], axis=1)
      if IMAGE_SLOTS in g:  # images (train/image_inputs.py): no slot, position 0 there
        g[IMAGE_SLOTS] = np.pad(g[IMAGE_SLOTS], ((0, 0), (extra, 0)))
        g[ROPE_POSITIONS] = np.pad(g[ROPE_POSITIONS], ((0, 0), (0, 0), (extra, 0)))


def sample(run_prefix: Callable[[Batch], tuple[Batch, dlayout.Layout]], prompts: Batch,
           more_prompts: Callable[[], Batch], *, n: int, max_tries: int,
           metrics: Metrics) -> tuple[Batch, dlayout.Layout]:
  kept: list[dict[str, np.ndarray]] = []
  constant: list[dict[str, np.ndarray]] = []
  host: dict = {}
  need = generated = 0
  lay = None
  for attempt in range(max_tries):
    batch, lay = run_prefix(prompts if attempt == 0 else more_prompts())
    local = to_local(batch)
    host.update(local.host)
    rewards = np.asarray(local.data[REWARDS]).reshape(-1, n)
    varied = rewards.max(axis=1) > rewards.min(axis=1)
    need = need or len(varied)
    generated += len(varied)
    for g in range(len(varied)):
      rows = {k: np.asarray(v)[g * n:(g + 1) * n] for k, v in local.data.items()}
      (kept if varied[g] else constant).append(rows)
    if _all_have(len(kept), need):
      break
  metrics.add("dynamic_sampling/tries", attempt + 1)
  metrics.add("dynamic_sampling/varied_fraction", len(kept), generated)
  groups = (kept + constant)[:need]
  metrics.add("dynamic_sampling/filled_constant", max(need - len(kept), 0))
  _same_prompt_width(groups)
  data = {k: np.concatenate([g[k] for g in groups]) for k in groups[0]}
  return to_global(Batch(data, host), lay), lay
