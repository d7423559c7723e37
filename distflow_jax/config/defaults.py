"""The config every config file starts from: ``base()``, built from the declarations in
``config/sections.py`` and ``config/run_sections.py`` (each key's type, default, doc and
check).  Config files under configs/ start from ``base()`` and set what differs.  The
config is locked after loading, so only keys declared there exist.
"""

from __future__ import annotations

import dataclasses

import ml_collections

from distflow_jax.config import declare, sections
from distflow_jax.config.run_sections import Config


def optimizer(lr: float) -> ml_collections.ConfigDict:
  """A ``<role>.optimizer`` section with learning rate ``lr``."""
  return declare.to_configdict(dataclasses.replace(sections.Optimizer(), lr=lr))


def mesh(devices: str = "all", **axes: int) -> ml_collections.ConfigDict:
  """A ``placement.<role>`` section: ``devices`` and the mesh's axis sizes."""
  shape = {"data": 1, "fsdp": -1, "tensor": 1}
  shape.update(axes)
  return ml_collections.ConfigDict(dict(devices=devices, mesh=shape))


def base() -> ml_collections.ConfigDict:
  """Every key with its declared default."""
  return declare.to_configdict(Config())
