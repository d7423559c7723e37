"""An environment's calls, each with a deadline and its result checked.

    guard = EnvGuard("calc", timeout_s=5.0, on_error=OnEnvError.END)
    obs = guard.reset(env, row, sample_id)              # None: the episode failed
    step = guard.step(env, action_text, sample_id)      # None: the episode failed
    step = guard.step(env, text, sample_id, truncated=True)  # a turn a limit cut

``truncated=True`` (a turn cut at ``rollout.max_new_tokens`` or the episode's width, with
no tool call and no stop) reaches an environment whose ``step`` takes a ``truncated``
keyword (``def step(self, action_text, truncated=False)``) as that keyword, so it can
score a cut answer as it means to; an environment whose ``step`` takes only the text gets
the text, as before (the episode is counted in ``env/truncated`` either way).

A call runs in a daemon worker thread and is waited for ``timeout_s`` seconds; one that
raises, overruns its deadline (the thread is abandoned: a daemon thread never keeps the
process alive), or returns a non-string observation, a reward that is not a finite real
number, or a ``done`` that is not a bool, is a failure.  ``on_error`` says what follows:
``end`` ends the episode where it is and counts it (``env/errors``; the first failure's
line is logged), ``stop`` raises ``EnvFailure``, one line naming the environment, the
sample and what went wrong (the command exits 2, as for a reward function).
"""

from __future__ import annotations

import enum
import functools
import inspect
import logging
import math
import numbers
import threading
from typing import Any, Callable, Mapping, NamedTuple

from distflow_jax.envs.base import Environment

log = logging.getLogger(__name__)


@functools.lru_cache(maxsize=None)
def takes_truncated(cls: type) -> bool:
  """Whether ``cls.step`` accepts a ``truncated`` keyword (or **kwargs)."""
  try:
    params = inspect.signature(cls.step).parameters.values()
  except (TypeError, ValueError, AttributeError):
    return False
  return any(p.name == "truncated" and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
             or p.kind is p.VAR_KEYWORD for p in params)


class OnEnvError(enum.Enum):
  """``rollout.on_env_error``'s values."""
  END = "end"    # end the failed episode and count it
  STOP = "stop"  # stop the run with one line


class EnvFailure(RuntimeError):
  """An environment raised, hung or returned something invalid (one line)."""


class Step(NamedTuple):
  observation: str
  reward: float
  done: bool


_REAL = numbers.Real  # bool, int, float and numpy scalars


def _deadline_call(fn: Callable[[], Any], timeout_s: float) -> tuple[str, Any]:
  """``("ok", value)``, ``("raised", exc)`` or ``("timeout", None)``."""
  box: list = []

  def work():
    try:
      box.append(("ok", fn()))
    except BaseException as e:  # pylint: disable=broad-except  - reported, not swallowed
      box.append(("raised", e))

  worker = threading.Thread(target=work, name="env-call", daemon=True)
  worker.start()
  worker.join(timeout_s if timeout_s > 0 else None)
  return box[0] if box else ("timeout", None)


class EnvGuard:
  """Guarded calls of one environment kind (see module doc); counts its failures."""

  def __init__(self, env_name: str, timeout_s: float, on_error: OnEnvError):
    self.env_name = env_name
    self.timeout_s = float(timeout_s)
    self.on_error = on_error
    self.errors = 0

  def _fail(self, what: str, sample_id: Any) -> None:
    line = f"environment {self.env_name!r} {what} on sample id {sample_id!r}"
    if self.on_error is OnEnvError.STOP:
      raise EnvFailure(line + " (rollout.on_env_error=stop; set it to 'end' to end such "
                       "episodes and go on)")
    if self.errors == 0:
      log.warning("%s; the episode ends there (rollout.on_env_error=end, counted in "
                  "env/errors)", line)
    self.errors += 1

  def _call(self, fn: Callable[[], Any], method: str, sample_id: Any) -> tuple[bool, Any]:
    status, value = _deadline_call(fn, self.timeout_s)
    if status == "raised":
      self._fail(f"{method} raised {type(value).__name__}: {value}", sample_id)
      return False, None
    if status == "timeout":
      self._fail(f"{method} did not return within rollout.env_timeout_s={self.timeout_s:g} s",
                 sample_id)
      return False, None
    return True, value

  def make(self, factory: Callable[[], Environment], sample_id: Any) -> Environment | None:
    ok, env = self._call(factory, "constructor", sample_id)
    return env if ok else None

  def reset(self, env: Environment, row: Mapping[str, Any], sample_id: Any) -> str | None:
    ok, obs = self._call(lambda: env.reset(row), "reset", sample_id)
    if not ok:
      return None
    if obs is None:
      return ""
    if not isinstance(obs, str):
      self._fail(f"reset returned a {type(obs).__name__} observation ({obs!r:.60}); it must "
                 f"return text (str)", sample_id)
      return None
    return obs

  def step(self, env: Environment, action_text: str, sample_id: Any,
           truncated: bool = False) -> Step | None:
    if truncated and takes_truncated(type(env)):
      call = lambda: env.step(action_text, truncated=True)  # noqa: E731
    else:
      call = lambda: env.step(action_text)  # noqa: E731
    ok, out = self._call(call, "step", sample_id)
    if not ok:
      return None
    if not isinstance(out, tuple) or len(out) != 3:
      self._fail(f"step returned {out!r:.60}; it must return (observation: str, reward: "
                 f"float, done: bool)", sample_id)
      return None
    obs, reward, done = out
    if not isinstance(obs, str):
      self._fail(f"step returned a {type(obs).__name__} observation ({obs!r:.60}); it must "
                 f"be text (str)", sample_id)
      return None
    if not isinstance(reward, _REAL) or not math.isfinite(float(reward)) \
        or abs(float(reward)) > 3.4e38:
      self._fail(f"step returned the reward {reward!r}; it must be a finite number",
                 sample_id)
      return None
    if not isinstance(done, bool):
      self._fail(f"step returned done={done!r}; it must be a bool", sample_id)
      return None
    return Step(obs, float(reward), done)
