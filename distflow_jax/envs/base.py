"""The environment protocol and its registry.

An environment is a class, created once per episode (so it must be cheap to create),
that the rollout's episode loop drives on the host that generates the episode:

    env = env_factory("scripted")()        # or "my_pkg.envs:Calculator"
    observation = env.reset(row)           # row: the prompt's host-side fields
    observation, reward, done = env.step(action_text)

``row`` is the data row that stayed with the process that loaded the prompt (``prompt``,
``answer``, ``data_source``, ``record`` and the row's own other columns, data/rows.py).
``step`` may take a keyword ``truncated`` (``step(self, action_text, truncated=False)``):
it is True for a turn a limit cut (``rollout.max_new_tokens`` or the episode's width) with
no tool call and no stop; such an episode counts in ``env/truncated`` whatever ``step``
returns.  ``action_text`` is the model's text of one turn: up to
and including its first complete tool call (``parsers``), or the whole turn when it made
none (its last).  ``observation`` is text that the loop tokenizes and appends to the
episode (never trained on); ``reward`` a finite number, summed over the episode's turns;
``done`` ends the episode.  ``reset``'s observation is appended before the first turn
when it is not empty.

Built in: ``calc`` (envs/calc.py, a calculator tool).  Others are registered by name
(``register_env``, from a plugin module in ``config.plugins``, as
reward functions are) or named directly as ``module:Class`` (the module is imported).
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Protocol, runtime_checkable

from distflow_jax.config import user_modules
from distflow_jax.config.errors import ConfigError
from distflow_jax.envs import calc


@runtime_checkable
class Environment(Protocol):
  """One episode's environment (see module doc)."""

  def reset(self, row: Mapping[str, Any]) -> str:
    """The first observation ("" for none) of the episode that answers ``row``."""

  def step(self, action_text: str) -> tuple[str, float, bool]:
    """``(observation, reward, done)`` after the model's turn ``action_text``."""


EnvFactory = Callable[[], Environment]

_REGISTRY: dict[str, EnvFactory] = {}


def register_env(name: str, factory: EnvFactory, *, overwrite: bool = False) -> EnvFactory:
  """Registers ``factory`` (a class or a no-argument callable) as ``rollout.env=name``."""
  if not isinstance(name, str) or not name or ":" in name:
    raise ValueError(f"environment name must be a non-empty string without ':', got {name!r}")
  if name in _REGISTRY and not overwrite:
    raise ValueError(f"environment {name!r} is already registered; pass overwrite=True to "
                     "replace it")
  if not callable(factory):
    raise TypeError(f"environment {name!r} must be a class or callable, got "
                    f"{type(factory).__name__}")
  _REGISTRY[name] = factory
  return factory


def env_names() -> list[str]:
  return sorted(_REGISTRY)


def env_factory(name: str) -> EnvFactory:
  """The factory ``rollout.env`` names: a registered name or ``module:Class``.  One
  ConfigError line naming the setting and what is valid otherwise."""
  if not isinstance(name, str) or not name:
    raise ConfigError(f"rollout.env={name!r} must name an environment: a registered name "
                      f"({', '.join(env_names()) or 'none registered'}) or module:Class")
  if ":" not in name:
    if name not in _REGISTRY:
      raise ConfigError(f"rollout.env={name!r} is not a registered environment; registered: "
                        f"{', '.join(env_names()) or 'none'} (or name one as module:Class, "
                        f"or load its plugin with config.plugins)")
    return _REGISTRY[name]
  module, _, attr = name.partition(":")
  try:
    obj = user_modules.import_user_module(module)
  except Exception as e:  # pylint: disable=broad-except
    raise ConfigError(f"rollout.env={name!r}: cannot import {module!r}: "
                      f"{type(e).__name__}: {e}") from None
  factory = getattr(obj, attr, None)
  if factory is None or not callable(factory):
    raise ConfigError(f"rollout.env={name!r}: module {module!r} has no class or callable "
                      f"{attr!r}")
  return factory


def _register_builtins() -> None:
  """The built-in environments (a plugin may not reuse their names)."""
  register_env(calc.TOOL, calc.CalcEnv, overwrite=True)


_register_builtins()
