"""Packaging that pyproject.toml alone cannot say: ship configs/ as ``distflow_jax.configs``.

Everything else (metadata, dependencies, package data) lives in pyproject.toml.  The
package list is here because ``[tool.setuptools.packages.find]`` only finds folders
under their own names, and the repository's top-level configs/ folder (the one source
of the configs, what ``--config=configs/grpo.py`` names in a checkout) must also go
into the wheel, under the package, for an installed ``distflow-jax`` to find them.
"""

from setuptools import find_namespace_packages, setup

# Namespace packages: distflow_jax/assets has no __init__.py.
setup(packages=find_namespace_packages(include=["distflow_jax*"]) + ["distflow_jax.configs"])
