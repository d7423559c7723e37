"""The one error a config mistake raises: ``ConfigError``, a one-line reason naming the key."""

from __future__ import annotations


class ConfigError(ValueError):
  """A config, config file or override that cannot be used; names the key."""
