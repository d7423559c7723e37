"""Algorithm state that changes from step to step, and the hooks that change it.

Everything else a step depends on is a function of (config, seed, step) or
lives in the models, optimizers and loaders; what is left is small and
typed here.  ``RunContext.algo_state`` holds the current ``AlgoState``; the
executor calls ``after_step`` once per step, and the checkpoint saves the
state with every step (``to_dict``) and restores it (``restored``), so a
resumed run continues exactly where the uninterrupted one would be.

Today that is the adaptive KL-in-reward coefficient (Ziegler et al.:
``actor.kl.in_reward`` with ``actor.kl.target > 0``).  DAPO's dynamic
sampling keeps nothing across steps (its extra prompts come from the train
loader, whose position the checkpoint saves), so it adds nothing here.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from distflow_jax.algos import kl as kl_lib
from distflow_jax.config.run_sections import Config


@dataclasses.dataclass(frozen=True)
class AlgoState:
  # The KL-in-reward coefficient once it has adapted; None: actor.kl.coef (not adapted yet,
  # or a fixed coefficient).
  kl_coef: float | None = None

  def to_dict(self) -> dict[str, Any]:
    """A JSON-able dict (saved in the checkpoint's meta)."""
    return dataclasses.asdict(self)

  @classmethod
  def from_dict(cls, saved: Mapping[str, Any]) -> AlgoState:
    """The inverse of ``to_dict``; a key this version does not know is an error (a newer
    checkpoint), a missing one takes its default (an older one)."""
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(saved) - names)
    if unknown:
      raise ValueError(f"unknown algorithm state {unknown}; this version knows {sorted(names)}")
    return cls(**saved)


def adapts_kl(cfg: Config) -> bool:
  """The KL-in-reward coefficient adapts to a target KL (it is then state to keep)."""
  kl = cfg.actor.kl
  return bool(kl.in_reward and kl.target > 0)


def has_state(cfg: Config) -> bool:
  """Whether a run of this config carries state across steps (else ``AlgoState()`` is all)."""
  return adapts_kl(cfg)


def adapt_kl(cfg: Config, state: AlgoState,
             metrics: Mapping[str, float]) -> AlgoState:
  """The next step's KL coefficient from this step's observed KL; every host sees the same
  ``metrics`` (reduced over hosts), so every host computes the same value."""
  kl = cfg.actor.kl
  if not adapts_kl(cfg) or "kl_penalty" not in metrics:
    return state
  coef = state.kl_coef if state.kl_coef is not None else kl.coef
  samples = int(cfg.data.prompts_per_step * cfg.rollout.n)
  new = kl_lib.adaptive_kl_coef(coef, metrics["kl_penalty"], kl.target, kl.horizon, samples)
  return dataclasses.replace(state, kl_coef=float(new))


def after_step(cfg: Config, state: AlgoState,
               metrics: Mapping[str, float]) -> AlgoState:
  """The executor's hook after each step: the state the next step starts from."""
  return adapt_kl(cfg, state, metrics)


def restored(cfg: Config, saved: Mapping[str, Any] | None
             ) -> AlgoState | None:
  """The state to resume from, or None when it cannot be rebuilt: the checkpoint predates
  saved algorithm state (``saved`` is None) and this run has state that would silently
  restart from the config.  A value this run's config no longer adapts is dropped (a
  resumed run that turned adaptive KL off uses actor.kl.coef)."""
  if saved is None:
    return None if has_state(cfg) else AlgoState()
  state = AlgoState.from_dict(saved)
  if not adapts_kl(cfg):
    state = dataclasses.replace(state, kl_coef=None)
  return state
