"""Where a train step's state and activations live: the parameters' mesh and pinned steps.

``init_opt_state`` puts the optimizer state on the parameters' mesh; ``PinnedStep`` jits a
step with its outputs pinned to the inputs' shardings (so the next call does not compile
again) and, through ``rows_sharded_on``, its activations' rows split over that mesh.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import optax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from distflow_jax.models import lora, sharding


def params_mesh(params: Any):
  """The mesh of the first NamedSharding-placed leaf of ``params`` (None if none)."""
  return next((x.sharding.mesh for x in jax.tree.leaves(params)
               if isinstance(x.sharding, NamedSharding)), None)


def _on_mesh(x: jax.Array, mesh) -> NamedSharding:
  if isinstance(x.sharding, NamedSharding):
    return x.sharding
  return NamedSharding(mesh, P())


def init_opt_state(tx: optax.GradientTransformation, params: nnx.State) -> Any:
  """``tx.init`` of the trainable parameters (LoRA: the adapters only, models/lora.py) with
  every leaf on the parameters' mesh (scalars replicated), so the state's layout never
  changes between steps."""
  mesh = params_mesh(params)
  state = tx.init(lora.split_trainable(params)[0])
  if mesh is None:
    return state
  return jax.tree.map(lambda x: jax.device_put(x, _on_mesh(x, mesh)), state)


def rows_sharded_on(fn: Callable, mesh) -> Callable:
  """``fn`` traced with its activations' rows split over ``mesh``'s data and fsdp axes
  (``sharding.rows_sharded``): FSDP keeps each device's own rows only."""

  def traced(*args):
    with sharding.rows_sharded(mesh):
      return fn(*args)
  # Named after fn: compile logs and `plan --lower` show what the program is.
  traced.__name__ = getattr(fn, "__name__", traced.__name__)
  return traced


class PinnedStep:
  """Jits ``step`` on first use with outputs pinned to the inputs' shardings.

  Left to sharding propagation, the updated state can come back laid out
  differently from how it went in, and the next call would then compile again.
  """

  def __init__(self, step: Callable):
    self._step = step
    self._jitted = None
    self._made: dict[Any, Callable] = {}  # jitted_for's, by the state's layout

  def jitted_for(self, params, opt_state):
    """The jitted step for state laid out like ``params`` / ``opt_state`` (arrays or
    ``ShapeDtypeStruct``s with shardings: ``plan --memory`` lowers this same object).
    One jitted function per layout of the state: a program compiled ahead through it
    (``plan --lower``'s catalogue, run/compile_overlap.py) is the one the calls find."""
    leaves, tree = jax.tree.flatten((params, opt_state))
    key = (tree, tuple(getattr(x, "sharding", None) for x in leaves))
    if key not in self._made:
      mesh = params_mesh(params)
      if mesh is None:  # unsharded parameters: nothing to pin
        self._made[key] = jax.jit(self._step, donate_argnums=(0, 1))
      else:
        sh = lambda tree: jax.tree.map(lambda x: _on_mesh(x, mesh), tree)  # noqa: E731
        self._made[key] = jax.jit(rows_sharded_on(self._step, mesh), donate_argnums=(0, 1),
                                  out_shardings=(sh(params), sh(opt_state), None))
    return self._made[key]

  def _get(self, params, opt_state):
    if self._jitted is None:
      self._jitted = self.jitted_for(params, opt_state)
    return self._jitted

  def __call__(self, params, opt_state, batch, *rest):
    """``rest``: the step's further inputs, if it takes any (a train step's dropout key)."""
    return self._get(params, opt_state)(params, opt_state, batch, *rest)

  def lower(self, params, opt_state, batch, *rest):
    """The step lowered for these (possibly abstract) arguments, by the same jitted
    function the calls use: compiling it fills their cache (state/warm_shapes.py)."""
    return self._get(params, opt_state).lower(params, opt_state, batch, *rest)

  def _cache_size(self) -> int:
    return 0 if self._jitted is None else self._jitted._cache_size()
