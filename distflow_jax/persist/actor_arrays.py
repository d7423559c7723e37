"""A checkpoint's actor arrays put into a model built from its config (export, eval, generate).

``fill(model, arrays, where, select)`` sets the leaves ``select`` picks (all of them for a
fully trained actor, the adapters of a LoRA one) from a checkpoint's host arrays
(``checkpoint.read_arrays``: ``{"actor.params.layers.attn.q_proj.kernel.value": array}``);
a missing, unexpected or misshapen array, and one holding NaN or inf, is a
``CheckpointError`` naming it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from distflow_jax.models.sharding import path_str
from distflow_jax.persist.checkpoint_contents import CheckpointError

PREFIX = "actor.params."
# One fused reduction per array: read once, no host copy (recompiled per shape and dtype).
_all_finite = jax.jit(lambda x: jnp.all(jnp.isfinite(x)))


def array_name(key: tuple) -> str:
  """The checkpoint's name of an actor leaf at state path ``key``."""
  return f"{PREFIX}{path_str(key)}.value".replace("/", ".")


def fill(model: nnx.Module, arrays: dict[str, Any], where: str, what: str,
         select: Callable[[Any], bool] = lambda var: True) -> nnx.Module:
  """``model`` (abstract or concrete) with the leaves ``select`` keeps set from ``arrays``
  (every ``actor.params.*`` array must be one of them); ``what`` names the model in errors."""
  graphdef, state = nnx.split(model)
  flat = list(nnx.to_flat_state(state))
  wanted = {array_name(k): k for k, v in flat if select(v)}
  saved = {k for k in arrays if k.startswith(PREFIX)}
  missing, extra = sorted(set(wanted) - saved), sorted(saved - set(wanted))
  if missing or extra:
    raise CheckpointError(f"{where}: the actor's arrays do not match its model config "
                          f"({what}): missing {missing[:5]}, unexpected {extra[:5]}")
  values = {}
  abstract = {k: v.get_value() for k, v in flat}
  for name, key in wanted.items():
    spec, x = abstract[key], arrays[name]
    if tuple(x.shape) != tuple(spec.shape):
      raise CheckpointError(f"{where}: {name} has shape {x.shape}, the model config "
                            f"expects {tuple(spec.shape)}")
    values[key] = jnp.asarray(x, spec.dtype)
    if not bool(_all_finite(values[key])):
      raise CheckpointError(
          f"{where}: the actor's {name} holds non-finite values (NaN or inf); the run "
          f"diverged before this step was saved: use an earlier step (export --step N, or "
          f"--model=RUN_DIR/checkpoints/<step>)")
  out = [(k, v.replace(values[k]) if k in values else v) for k, v in flat]
  return nnx.merge(graphdef, nnx.from_flat_state(out))
