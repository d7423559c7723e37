"""Deterministic mode (``trainer.deterministic=True``): bitwise-equal results on any layout.

In the default mode XLA reduces gradients over data-parallel devices in whatever order
the partitioner picks (a reduce-scatter over 8 devices adds in another order than one
over 4), so 1 x 8 and 2 x 2 devices give weights that differ in their last bits after
one step.  Here every reduction over samples has one fixed global shape:

* A *unit* is ``unit_rows`` consecutive rows of the batch (the config's per-device
  micro-batch).  Each device computes the loss and gradient of its units one at a time,
  so the per-unit computation has the same shape on every layout.
* Unit results are summed in one canonical binary tree over the global unit index:
  on a device as nested pairwise scans over its (power-of-two many) units, then across
  devices by recursive doubling with ``ppermute`` (left + right, any device count), and
  the total is broadcast back down the same tree.  Each addition has the same operands
  in the same order on every layout, so the sum is bitwise the same.
* The global gradient norm and clipping are computed on the summed, replicated
  gradient inside the same ``shard_map``; the optimizer's own update is elementwise.
* Sequence passes (log-probs, values, reward scores) run unit by unit too.
* LoRA adapter dropout draws unit ``u``'s masks from the step's key folded with ``u``'s
  global index, so the masks too are the same on every layout.

Cost: parameters are gathered whole on every device for the step (no FSDP memory
saving inside it), per-unit passes run smaller matmuls, and the tree reduction moves
the gradient ``2 * ceil(log2(devices))`` times instead of a ring all-reduce's ~2.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from distflow_jax.algos import losses
from distflow_jax.models import lora, lora_layer, sharding
from distflow_jax.train import placement, steps as steps_lib
from distflow_jax.train.loss_mask import loss_mask

Batch = Mapping[str, jax.Array]
AXIS = "data"  # the samples' axis of a layout mesh of its own (a role mesh: data, fsdp)


class LayoutError(ValueError):
  """The batch does not split into the canonical units on this layout."""


def units_per_device(num_rows: int, devices: int, unit_rows: int) -> int:
  """Units on each device; a power of two, so a device's units are one subtree."""
  if unit_rows <= 0 or num_rows % (devices * unit_rows):
    raise LayoutError(f"trainer.deterministic: {num_rows} rows do not split into units of "
                      f"{unit_rows} rows (the per-device micro-batch) on {devices} "
                      f"data-parallel devices")
  k = num_rows // (devices * unit_rows)
  if k & (k - 1):
    raise LayoutError(f"trainer.deterministic: each of the {devices} devices holds {k} units "
                      f"of {unit_rows} rows; the canonical reduction tree needs a power of "
                      f"two (change the micro-batch size or the batch size)")
  return k


def _tree_sum(f: Callable, units, k: int):
  """``f(unit)`` summed over the leading axis of ``units`` (length k, a power of two) as a
  balanced binary tree, left + right, with one scan per level."""
  if k == 1:
    return f(jax.tree.map(lambda x: x[0], units))
  half = k // 2
  pairs = jax.tree.map(lambda x: x.reshape(2, half, *x.shape[1:]), units)

  def body(acc, xs):
    i, part = xs
    s = jax.lax.optimization_barrier(_tree_sum(f, part, half))
    # The left half is taken as it is (not 0 + left), the right added to it.
    return jax.tree.map(lambda a, v: jnp.where(i == 0, v, a + v), acc, s), None

  shapes = jax.eval_shape(lambda u: _tree_sum(f, u, half),
                          jax.tree.map(lambda x: x[0], pairs))
  init = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)
  acc, _ = jax.lax.scan(body, init, (jnp.arange(2), pairs))
  return acc


def _tree_allreduce(x, d: int, axis: str | tuple[str, ...] = AXIS):
  """The sum over the `axis` devices in the left-complete binary tree over device index,
  then the same bits on every device."""
  if d == 1:
    return x
  idx = jax.lax.axis_index(axis)
  s = 1
  while s < d:
    perm = [(i + s, i) for i in range(0, d, 2 * s) if i + s < d]
    recv = jax.lax.ppermute(x, axis, perm)
    take = (idx % (2 * s) == 0) & (idx + s < d)
    x = jax.tree.map(lambda a, r: jnp.where(take, a + r, a), x, recv)
    s *= 2
  s //= 2
  while s >= 1:  # broadcast back down the same tree: exact copies
    perm = [(i, i + s) for i in range(0, d, 2 * s) if i + s < d]
    recv = jax.lax.ppermute(x, axis, perm)
    take = idx % (2 * s) == s
    x = jax.tree.map(lambda a, r: jnp.where(take, r, a), x, recv)
    s //= 2
  return x


def _unconstrained(fn: Callable) -> Callable:
  """``fn`` (a shard_map body: its mesh axes are manual) traced with no row constraint:
  the enclosing ``sharding.rows_sharded`` names the same mesh's axes, which a constraint
  under shard_map may not use."""
  def body(*args):
    with sharding.rows_sharded(None):
      return fn(*args)
  return body


def _units(tree, k: int, unit_rows: int):
  return jax.tree.map(lambda x: x.reshape(k, unit_rows, *x.shape[1:]), tree)


def make_train_step(loss_fn: Callable[[nnx.GraphDef, nnx.State, Batch], losses.LossOutput],
                    graphdef: nnx.GraphDef, tx: optax.GradientTransformation, mesh: Mesh,
                    unit_rows: int, agg_mode: str, grad_clip: float,
                    group_size: int = 1, axes: tuple[str, ...] = (AXIS,)) -> Callable:
  """``steps.make_train_step``'s contract, reduced in the canonical order (module doc).

  ``tx`` must not clip (clipping by ``grad_clip`` happens here, on the replicated
  gradient); ``mesh`` is the batch's layout mesh, ``axes`` its samples' axes."""
  d = math.prod(mesh.shape[a] for a in axes)

  def step(params, opt_state, batch, rng=None):
    params, frozen = lora.split_trainable(params)  # LoRA: the adapters only (steps.py)
    b = jax.tree.leaves(batch)[0].shape[0]
    k = units_per_device(b, d, unit_rows)
    denom = losses.loss_denominator(loss_mask(batch), agg_mode)

    @_unconstrained
    def local(params, frozen, batch, denom, rng):
      def unit(xs):
        mb, u = xs

        def objective(p):
          out = loss_fn(graphdef, lora.merge_trainable(p, frozen), mb)
          return out.total / jnp.maximum(denom, 1.0), out
        with lora_layer.adapter_dropout(steps_lib.micro_key(rng, u)):
          (_, out), grads = jax.value_and_grad(objective, has_aux=True)(params)
        return jax.lax.optimization_barrier((grads, out))

      # Adapter dropout: unit u's key from its global index, the same unit on every layout.
      first = jax.lax.axis_index(axes) * k if d > 1 else 0
      index = None if rng is None else first + jnp.arange(k)
      units = (_units(batch, k, unit_rows), index)
      grads, out = _tree_allreduce(_tree_sum(unit, units, k), d, axes)
      norm = optax.global_norm(grads)
      if grad_clip and grad_clip > 0:
        scale = jnp.where(norm > grad_clip, grad_clip / norm, 1.0)
        grads = jax.tree.map(lambda g: (g * scale).astype(g.dtype), grads)
      return grads, out, norm

    grads, out, grad_norm = jax.shard_map(
        local, mesh=mesh, in_specs=(P(), P(), P(axes), P(), P()), out_specs=P(),
        check_vma=False)(params, frozen, dict(batch), denom, rng)
    params, opt_state, stats = steps_lib.apply_update(tx, params, opt_state, batch, grads, out,
                                                      grad_norm, group_size)
    return lora.merge_trainable(params, frozen), opt_state, stats

  return placement.PinnedStep(step)


def per_unit(fn: Callable[..., jax.Array], mesh: Mesh, unit_rows: int,
             axes: tuple[str, ...] = (AXIS,)) -> Callable:
  """``fn(graphdef, params, batch) -> [B, ...]`` run unit by unit on each device (one
  shape on every layout), with the parameters whole on every device; jitted.  ``axes``:
  the samples' axes of ``mesh``."""
  d = math.prod(mesh.shape[a] for a in axes)
  out_sharding = NamedSharding(mesh, P(axes))

  def run(graphdef, params, batch):
    b = jax.tree.leaves(batch)[0].shape[0]
    if b % (d * unit_rows):
      raise LayoutError(f"trainer.deterministic: {b} rows do not split into units of "
                        f"{unit_rows} rows on {d} data-parallel devices")
    k = b // (d * unit_rows)

    @_unconstrained
    def local(params, batch):
      out = jax.lax.map(lambda u: fn(graphdef, params, u), _units(batch, k, unit_rows))
      return out.reshape(k * unit_rows, *out.shape[2:])

    return jax.shard_map(local, mesh=mesh, in_specs=(P(), P(axes)), out_specs=P(axes),
                         check_vma=False)(params, dict(batch))

  return jax.jit(run, static_argnums=0, out_shardings=out_sharding)
