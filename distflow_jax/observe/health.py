"""Training health: signals that a run is collapsing, read from each step's metrics.

A policy that collapses rarely fails loudly: PPO with a fresh critic on a small batch can
drift to several nats of KL per token and one-token answers while every step "succeeds".
``HealthMonitor.update`` reads one step's reduced metrics (the same on every process, so
every process decides alike) and returns the signals that fire:

==================  =====================================================================
signal              fires when
==================  =====================================================================
KL_HIGH             KL to the reference per token (``actor/kl``, else ``kl_penalty``)
                    exceeds ``kl_max``
LENGTH_COLLAPSE     the mean response length stays below ``length_fraction`` of its mean
                    over the first ``baseline_steps`` steps for ``patience`` steps
REWARD_ZERO         the mean reward is exactly 0 for ``zero_reward_steps`` steps in a row
ENTROPY_COLLAPSE    the policy entropy per token (``actor/entropy``, else the sampled
                    tokens' mean negative log-prob ``rollout_nll``) stays below
                    ``min_entropy`` for ``patience`` steps
EVAL_FALL           the held-out accuracy (``eval/accuracy``) falls ``eval_drop`` or more
                    below its best so far, the start (step 0) included; it holds until an
                    evaluation is back within ``eval_drop`` of the best (the message gives
                    the held-out answers' length then and now: answers growing until
                    ``rollout.max_new_tokens`` cuts them is the usual way it falls)
CLIP_IDLE           the PPO clip fraction is exactly 0 for ``clip_idle_steps`` steps in a
                    row although clipping is configured (a warning, not a collapse: with
                    one epoch over one mini-batch the ratio is 1 and clipping never acts)
==================  =====================================================================

Each signal is reported once when it starts firing (``health/<signal>`` is 1.0 in the
metrics of every step it holds).  With ``trainer.stop_on_collapse`` the trainer stops on
a collapse signal with one line naming it and the last good checkpoint.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from collections.abc import Mapping


class Signal(enum.Enum):
  KL_HIGH = "kl_high"
  LENGTH_COLLAPSE = "length_collapse"
  REWARD_ZERO = "reward_zero"
  ENTROPY_COLLAPSE = "entropy_collapse"
  CLIP_IDLE = "clip_idle"
  EVAL_FALL = "eval_fall"

  @property
  def is_collapse(self) -> bool:
    return self is not Signal.CLIP_IDLE


@dataclasses.dataclass(frozen=True)
class HealthConfig:
  kl_max: float = 1.0             # nats per token; 0 disables
  length_fraction: float = 0.25   # of the baseline response length; 0 disables
  baseline_steps: int = 3
  patience: int = 3
  zero_reward_steps: int = 20     # 0 disables
  min_entropy: float = 0.02       # nats per token; 0 disables
  clip_idle_steps: int = 10       # 0 disables
  eval_drop: float = 0.05         # held-out accuracy below its best by this much; 0 disables

  @classmethod
  def from_config(cls, section: Mapping) -> "HealthConfig":
    return cls(**{f.name: type(f.default)(section[f.name]) for f in dataclasses.fields(cls)
                  if f.name in section})

  def __post_init__(self):
    for name in ("kl_max", "length_fraction", "min_entropy", "eval_drop"):
      value = getattr(self, name)
      if not (math.isfinite(value) and value >= 0):
        raise ValueError(f"trainer.health.{name}={value} must be a finite number >= 0")
    if self.length_fraction >= 1:
      raise ValueError(f"trainer.health.length_fraction={self.length_fraction} must be < 1")
    for name in ("baseline_steps", "patience"):
      if getattr(self, name) < 1:
        raise ValueError(f"trainer.health.{name}={getattr(self, name)} must be >= 1")
    for name in ("zero_reward_steps", "clip_idle_steps"):
      if getattr(self, name) < 0:
        raise ValueError(f"trainer.health.{name}={getattr(self, name)} must be >= 0 "
                         f"(0 disables the signal)")


@dataclasses.dataclass(frozen=True)
class Alarm:
  signal: Signal
  step: int
  message: str

  def line(self) -> str:
    kind = "collapse" if self.signal.is_collapse else "warning"
    return f"health {kind} at step {self.step}: {self.signal.value}: {self.message}"


class HealthMonitor:
  """Keeps the few running counters the signals need; ``update`` once per step."""

  def __init__(self, cfg: HealthConfig, clip_configured: bool = True):
    self.cfg = cfg
    self.clip_configured = clip_configured
    self._lengths: list[float] = []
    self._short = self._low_entropy = self._zero_reward = self._clip_idle = 0
    self._firing: set[Signal] = set()
    # The best held-out accuracy so far: (accuracy, step, answers' length then); and the
    # fall's message while the latest evaluation is below it by eval_drop or more.
    self._eval_best: tuple[float, int, float | None] | None = None
    self._eval_fall: str | None = None

  def update(self, step: int, m: Mapping[str, float]) -> list[Alarm]:
    """The alarms that START firing at this step; marks every firing signal in ``m``'s
    ``health/<signal>`` keys (``m`` must be a mutable mapping for that)."""
    now = dict(self._check(m))
    new = [Alarm(s, step, msg) for s, msg in now.items() if s not in self._firing]
    self._firing = set(now)
    if isinstance(m, dict):
      for s in Signal:
        m[f"health/{s.value}"] = float(s in now)
    return new

  def _check(self, m: Mapping[str, float]):
    cfg = self.cfg
    kl = m.get("actor/kl", m.get("kl_penalty"))
    if cfg.kl_max and kl is not None and kl > cfg.kl_max:
      yield Signal.KL_HIGH, (f"KL to the reference {kl:.3g} nats/token > trainer.health."
                             f"kl_max={cfg.kl_max:g} (raise the KL coefficient or lower the "
                             f"learning rate)")
    length = m.get("response_length")
    if cfg.length_fraction and length is not None:
      if len(self._lengths) < cfg.baseline_steps:
        self._lengths.append(length)
      base = sum(self._lengths) / len(self._lengths)
      short = len(self._lengths) >= cfg.baseline_steps and length < cfg.length_fraction * base
      self._short = self._short + 1 if short else 0
      if self._short >= cfg.patience:
        yield Signal.LENGTH_COLLAPSE, (f"mean response length {length:.1f} tokens, below "
                                       f"{cfg.length_fraction:g} x its start ({base:.1f}) for "
                                       f"{self._short} steps")
    reward = m.get("reward")
    if cfg.zero_reward_steps and reward is not None:
      self._zero_reward = self._zero_reward + 1 if reward == 0 else 0
      if self._zero_reward >= cfg.zero_reward_steps:
        yield Signal.REWARD_ZERO, (f"mean reward 0 for {self._zero_reward} steps (the "
                                   f"verifier never accepts an answer: check the task's "
                                   f"answer format and the prompts)")
    entropy = m.get("actor/entropy", m.get("rollout_nll"))
    if cfg.min_entropy and entropy is not None:
      self._low_entropy = self._low_entropy + 1 if entropy < cfg.min_entropy else 0
      if self._low_entropy >= cfg.patience:
        yield Signal.ENTROPY_COLLAPSE, (f"policy entropy {entropy:.3g} nats/token < "
                                        f"trainer.health.min_entropy={cfg.min_entropy:g} for "
                                        f"{self._low_entropy} steps")
    if cfg.eval_drop:
      self._note_eval(m)
      if self._eval_fall is not None:
        yield Signal.EVAL_FALL, self._eval_fall
    clip = m.get("actor/pg_clipfrac")
    if cfg.clip_idle_steps and self.clip_configured and clip is not None:
      self._clip_idle = self._clip_idle + 1 if clip == 0 else 0
      if self._clip_idle >= cfg.clip_idle_steps:
        yield Signal.CLIP_IDLE, (f"the clip fraction was 0 for {self._clip_idle} steps: "
                                 f"clipping never acts (with actor.ppo_epochs=1 and "
                                 f"actor.mini_batches=1 the ratio is exactly 1; use more "
                                 f"mini-batches or epochs for clip settings to matter)")

  def _note_eval(self, m: Mapping[str, float]) -> None:
    acc = m.get("eval/accuracy")
    if acc is None or not math.isfinite(acc):
      return
    step = int(m.get("step", 0))
    length = m.get("eval/response_length")
    if self._eval_best is None or acc > self._eval_best[0]:
      self._eval_best = (float(acc), step, None if length is None else float(length))
    best, best_step, best_len = self._eval_best
    if best - acc < self.cfg.eval_drop - 1e-12:
      self._eval_fall = None
      return
    lengths = ""
    if best_len is not None and length is not None:
      lengths = f"; held-out answers {best_len:.1f} -> {length:.1f} tokens"
    self._eval_fall = (f"held-out accuracy {acc:.3f} is {best - acc:.3f} below its best "
                       f"{best:.3f} (step {best_step}){lengths} (>= trainer.health.eval_drop="
                       f"{self.cfg.eval_drop:g}; keep the step-{best_step} weights, lower the "
                       f"learning rate or add a KL term)")

  def state_dict(self) -> dict:
    return {"lengths": list(self._lengths), "short": self._short,
            "low_entropy": self._low_entropy, "zero_reward": self._zero_reward,
            "clip_idle": self._clip_idle, "firing": sorted(s.value for s in self._firing),
            "eval_best": None if self._eval_best is None else list(self._eval_best),
            "eval_fall": self._eval_fall}

  def load_state_dict(self, state: Mapping) -> None:
    self._lengths = [float(x) for x in state.get("lengths", [])]
    self._short = int(state.get("short", 0))
    self._low_entropy = int(state.get("low_entropy", 0))
    self._zero_reward = int(state.get("zero_reward", 0))
    self._clip_idle = int(state.get("clip_idle", 0))
    self._firing = {Signal(v) for v in state.get("firing", [])}
    best = state.get("eval_best")
    self._eval_best = None if best is None else (
        float(best[0]), int(best[1]), None if best[2] is None else float(best[2]))
    self._eval_fall = state.get("eval_fall")


class CollapseError(RuntimeError):
  """The run stopped on a collapse signal (``trainer.stop_on_collapse``)."""
