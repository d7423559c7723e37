"""The ``adapters`` route of a LoRA engine's weight sync (``rollout.lora_sync=adapters``).

A LoRA run never trains its base; only the adapters change, a few MB against the model's
GB.  So the engine keeps its own copy of the frozen base in its rollout layout, synced once
(on the first sync, with the weight sync's machinery: rollout/weight_sync.py), and every
sync moves only the adapters (``lora_a`` / ``lora_b``, one array per layer) into the
rollout layout and merges them there in one jitted program:

    W = base + a @ b * alpha / r      per target (lora.merged_kernel, as the merged route)

The merge donates the previous sync's merged kernels where the caller still holds them
(each new kernel is written into the old one's buffer), else writes into new buffers: old
and new merged weights never coexist, and between syncs the engine keeps no merged kernel
alive that the caller dropped.  The other leaves of the rollout weights are the base copy's
own arrays.  Cost: one extra base on the rollout devices where the layouts differ (the
base copy, kept for the run, beside the merged weights the merged route holds as well), in
each engine (the ``generate`` node's, and ``eval``'s greedy one).

Where a base parameter's rollout layout is its training layout (one device, loop layers),
the base is not copied at all: the rollout uses the training array's buffer itself, taken
anew at each sync (a train step donates its parameters: the array of one step is gone at
the next, and with it the rollout weights of the sync before, as a sync's always are).

The base must not change: each sync takes an exact digest of the training base (per leaf
the uint32 sum of its bits, wrapping: the same for any layout and reduction order) and
refuses, in one line, a base unlike the first sync's (``BaseChanged``).

Compiles happen on the first sync only (``compile_count``): the digest, the split of
stacked layers (base, adapters), the base's sync steps, the first merged kernels' buffers
and the merge.  ``programs`` lists them for ``plan --lower``.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from distflow_jax.models import lora, sharding as msharding, stacking
from distflow_jax.models.config import ModelConfig
from distflow_jax.models.sharding import path_str
from distflow_jax.models.transformer import Transformer
from distflow_jax.rollout.weight_sync import WeightSync

_UINT = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}


class BaseChanged(RuntimeError):
  """The actor's frozen base differs from the one the engine copied on its first sync."""


def _digest(leaves: list[jax.Array]) -> jax.Array:
  """Per leaf the wrapping uint32 sum of its bits: exact, so any layout gives the same."""
  return jnp.stack([jnp.sum(jax.lax.bitcast_convert_type(x, _UINT[x.dtype.itemsize])
                            .astype(jnp.uint32), dtype=jnp.uint32) for x in leaves])


def _digest_program(leaves: list[jax.Array]) -> Callable:
  """``_digest`` jitted to a replicated result on the leaves' mesh (where they share one)."""
  meshes = {x.sharding.mesh for x in leaves if isinstance(x.sharding, NamedSharding)}
  out = NamedSharding(next(iter(meshes)), P()) if len(meshes) == 1 else None
  return jax.jit(_digest, out_shardings=out)


def _merge(ws: list, a_s: list, b_s: list, previous: list, *, scale: float) -> list:
  del previous  # donated: each new kernel is written into the previous one's buffer
  return [lora.merged_kernel(w, a, b, scale) for w, a, b in zip(ws, a_s, b_s)]


def _flat(state: Any) -> dict[str, Any]:
  return {path_str(k): v.get_value() for k, v in nnx.to_flat_state(state)}


def _sub(state: nnx.State, paths: set[str]) -> nnx.State:
  return nnx.from_flat_state([(k, v) for k, v in nnx.to_flat_state(state)
                              if path_str(k) in paths])


class AdapterSync:
  """The ``adapters`` route (module doc) into an engine's ``param_shardings`` (its loop
  layout, no adapters) on ``mesh``; ``model_cfg`` carries the LoRA spec.  ``bytes_moved``:
  the bytes the last call resharded (the base too on the first call, unless aliased)."""

  def __init__(self, model_cfg: ModelConfig, param_shardings: nnx.State, mesh: Mesh,
               rules: msharding.Rules,
               process_of: Callable[[jax.Device], int] | None = None):
    loop = model_cfg.replace(scan_layers=False)
    abstract = nnx.split(nnx.eval_shape(lambda: Transformer(loop, rngs=nnx.Rngs(0))))[1]
    adapters = lora.split_trainable(abstract)[0]
    self._dst_state = param_shardings
    self._dst = _flat(param_shardings)
    self._ad_shardings = msharding.state_shardings(adapters, mesh, rules)
    self._ad_sig = {p: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh) for (p, x), sh in
                    zip(_flat(adapters).items(), _flat(self._ad_shardings).values())}
    self._process_of = process_of
    self._targets = sorted(p.rsplit("/", 1)[0] for p in _flat(adapters)
                           if p.endswith("/lora_a"))
    kernels = [_flat(abstract)[t + "/kernel"] for t in self._targets]
    outs = [self._dst[t + "/kernel"] for t in self._targets]
    self._kernel_sig = [jax.ShapeDtypeStruct(k.shape, k.dtype, sharding=s)
                        for k, s in zip(kernels, outs)]
    self._adapter_sync = WeightSync(self._ad_shardings, process_of)
    self._base_sync: WeightSync | None = None
    self._unstack = jax.jit(stacking.to_loop)
    self._digest: Any = None
    self._empty = jax.jit(lambda: [jnp.zeros(k.shape, k.dtype) for k in kernels],
                          out_shardings=outs)
    self._merge = jax.jit(functools.partial(_merge, scale=model_cfg.lora.scale),
                          donate_argnums=(3,), keep_unused=True, out_shardings=outs)
    self._base: dict[str, jax.Array] | None = None   # the engine's own base arrays
    self._aliased: set[str] = set()                  # taken from the training base
    self._fingerprint: np.ndarray | None = None
    self._merged: list[weakref.ref] = []             # the last merge's kernels
    self.bytes_moved = 0

  # ---- the sync ------------------------------------------------------------------------

  def __call__(self, train_params: nnx.State) -> nnx.State:
    adapters, base = lora.split_trainable(train_params)
    self._check_base(base)
    moved = self._sync_base(base) if self._base is None else 0
    synced = _flat(self._adapter_sync(self._loop(adapters)))
    self.bytes_moved = moved + self._adapter_sync.bytes_moved
    train = _flat(base) if self._aliased else {}
    rollout_base = {p: jax.device_put(train[p], self._dst[p]) if p in self._aliased
                    else self._base[p] for p in self._dst}  # (an equivalent layout: no copy)
    merged = self._merge([rollout_base[t + "/kernel"] for t in self._targets],
                         [synced[t + "/lora_a"] for t in self._targets],
                         [synced[t + "/lora_b"] for t in self._targets], self._previous())
    self._merged = [weakref.ref(x) for x in merged]
    values = {**rollout_base, **{t + "/kernel": m for t, m in zip(self._targets, merged)}}
    return nnx.from_flat_state([(k, v.replace(values[path_str(k)]))
                                for k, v in nnx.to_flat_state(self._dst_state)])

  def _previous(self) -> list[jax.Array]:
    """The buffers the merge writes into: the previous sync's merged kernels where the
    caller still holds them all (donated), else new ones (the old, if any, deleted)."""
    alive = [r() for r in self._merged]
    if alive and all(x is not None and not x.is_deleted() for x in alive):
      return alive
    for x in alive:
      if x is not None and not x.is_deleted():
        x.delete()
    return self._empty()

  def _loop(self, state: nnx.State) -> nnx.State:
    return self._unstack(state) if stacking.is_stacked(state) else state

  def _check_base(self, base: nnx.State) -> None:
    flat = list(nnx.to_flat_state(base))
    leaves = [v.get_value() for _, v in flat]
    if self._digest is None:
      self._digest = _digest_program(leaves)
    got = np.asarray(self._digest(leaves).addressable_data(0))
    if self._fingerprint is None:
      self._fingerprint = got
      return
    if got.shape != self._fingerprint.shape or (got != self._fingerprint).any():
      bad = (next(i for i in range(len(got)) if got[i] != self._fingerprint[i])
             if got.shape == self._fingerprint.shape else 0)
      raise BaseChanged(
          f"rollout.lora_sync=adapters: the actor's frozen base changed since the first "
          f"weight sync ({path_str(flat[bad][0])} differs), which a LoRA run never does; "
          f"the engine's base copy is stale: use rollout.lora_sync=merged, or a new engine")

  def _sync_base(self, base: nnx.State) -> int:
    """The first sync's base into the engine's own copy; returns the bytes it moved."""
    stacked = stacking.is_stacked(base)
    loop = self._loop(base)
    own, copy = {}, set()
    for p, x in _flat(loop).items():
      if x.sharding.is_equivalent_to(self._dst[p], x.ndim):
        # Already laid out as the rollout wants: the split's own copy, or (loop layers)
        # the training array itself, taken anew each sync.
        if stacked:
          own[p] = jax.device_put(x, self._dst[p])  # the rollout's sharding, no copy
        else:
          self._aliased.add(p)
      else:
        copy.add(p)
    moved = 0
    if copy:
      self._base_sync = WeightSync(_sub(self._dst_state, copy), self._process_of)
      own.update(_flat(self._base_sync(_sub(loop, copy))))
      moved = self._base_sync.bytes_moved
    self._base = own
    return moved

  # ---- for plan --lower and the tests ---------------------------------------------------

  def programs(self, train_params: Any) -> list[tuple[str, Any, tuple]]:
    """``(name, jitted, abstract args)`` of every program the sync of (abstract, sharded)
    ``train_params`` compiles, each once."""
    sds = lambda x, sh: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh)  # noqa: E731
    adapters, base = lora.split_trainable(train_params)
    leaves = jax.tree.leaves(base)
    out = [("lora_sync/digest", _digest_program(leaves), (leaves,))]

    def loop(state, name):
      if not stacking.is_stacked(state):
        return state
      out.append((f"lora_sync/unstack_{name}", self._unstack, (state,)))
      placed = self._unstack.lower(state).compile().output_shardings
      return jax.tree.map(sds, jax.eval_shape(self._unstack, state), placed)
    base, adapters = loop(base, "base"), loop(adapters, "adapters")
    flat = _flat(base)
    copy = {p for p, x in flat.items() if not x.sharding.is_equivalent_to(self._dst[p],
                                                                          len(x.shape))}
    if copy:
      sync = WeightSync(_sub(self._dst_state, copy), self._process_of)
      out += [(f"lora_sync/base/{n}", fn, args) for n, fn, args in sync.programs(_sub(base,
                                                                                     copy))]
    out += [(f"lora_sync/adapters/{n}", fn, args)
            for n, fn, args in WeightSync(self._ad_shardings, self._process_of)
            .programs(adapters)]
    ad = self._ad_sig
    out.append(("lora_sync/empty", self._empty, ()))
    out.append(("lora_sync/merge", self._merge, (
        self._kernel_sig, [ad[t + "/lora_a"] for t in self._targets],
        [ad[t + "/lora_b"] for t in self._targets], self._kernel_sig)))
    return out

  def compile_count(self) -> int:
    """Executables built so far (stays put from the second sync on)."""
    fns = [self._unstack, self._empty, self._merge] + ([self._digest] if self._digest else [])
    return (sum(f._cache_size() for f in fns) + self._adapter_sync.compile_count()
            + (self._base_sync.compile_count() if self._base_sync is not None else 0))
