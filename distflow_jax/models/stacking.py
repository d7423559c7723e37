"""Layers stacked on a leading layer axis (`ModelConfig.scan_layers`), and back.

With `scan_layers=True` the transformer's `layers` is one `Block` whose every
parameter has a leading `[L]` axis, run under `lax.scan`: XLA compiles one
layer body whatever the depth.  Parameter paths lose the layer index:

    loop:  layers/3/attn/q_proj/kernel   [D, H*Dh]
    scan:  layers/attn/q_proj/kernel     [L, D, H*Dh]

Here: building the stacked module, slicing one layer out of it (the cached
decode path runs layer by layer, writing each layer's KV buffer in place),
the path helpers hf_io, hf_export and sharding use (`stacked_path`, `layer_path`), and
`to_scan` / `to_loop`, converting a whole parameter state between layouts.
"""

from __future__ import annotations

import re
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
from flax import nnx

# A stacked layer parameter: "layers/" not followed by a layer index (maybe under a
# "backbone/" of a critic or reward model).
_STACKED = re.compile(r"^(?P<head>(?:.*/)?layers/)(?P<rest>(?!\d+(?:/|$)).+)$")
_INDEXED = re.compile(r"^(?P<head>(?:.*/)?layers/)(?P<i>\d+)/(?P<rest>.+)$")


def stack_modules(modules: Sequence[nnx.Module]) -> nnx.Module:
  """One module of the same kind whose parameters are the inputs' stacked on axis 0."""
  graphdef, first = nnx.split(modules[0])
  states = [first] + [nnx.split(m)[1] for m in modules[1:]]
  return nnx.merge(graphdef, jax.tree.map(lambda *xs: jnp.stack(xs), *states))


def split_stacked(stacked: nnx.Module) -> tuple[nnx.GraphDef, nnx.State]:
  """(graphdef of one layer, its state with a leading layer axis), for `lax.scan`."""
  return nnx.split(stacked)


def layer_of(stacked: nnx.Module, i: int) -> nnx.Module:
  """Layer `i` of a stacked module, as a module of its own (a slice of every parameter)."""
  graphdef, state = nnx.split(stacked)
  return nnx.merge(graphdef, jax.tree.map(lambda x: x[i], state))


def stacked_path(path: str) -> tuple[str, str] | None:
  """`("…layers/", "attn/q_proj/kernel")` for a stacked parameter's path, else None."""
  m = _STACKED.match(path)
  return (m["head"], m["rest"]) if m else None


def layer_path(path: str, i: int) -> str:
  """The loop layout's path of layer `i`'s slice of stacked parameter `path`."""
  head, rest = stacked_path(path)
  return f"{head}{i}/{rest}"


def is_stacked(state: nnx.State) -> bool:
  """Whether a parameter state holds stacked layers (the scan layout); False for anything
  that is not a state (the caller's own checks then name what is wrong with it)."""
  if not isinstance(state, nnx.State):
    return False
  return any(stacked_path("/".join(str(getattr(k, "key", k)) for k in key))
             for key, _ in nnx.to_flat_state(state))


def _convert(state: nnx.State, key_of: Callable[[str], tuple[str, int] | None],
             merge: Callable[[list[Any]], Any]) -> nnx.State:
  flat, groups = [], {}
  for key, var in nnx.to_flat_state(state):
    path = "/".join(str(getattr(k, "key", k)) for k in key)
    where = key_of(path)
    if where is None:
      flat.append((key, var))
    else:
      groups.setdefault(where[0], []).append((where[1], var))
  for path, items in groups.items():
    flat.extend(merge(path, items))
  return nnx.from_flat_state(flat)


def _parts(path: str) -> tuple:
  return tuple(int(p) if p.isdigit() else p for p in path.split("/"))


def to_scan(state: nnx.State) -> nnx.State:
  """A loop-layout parameter state (`layers/i/...`) in the scan layout (`layers/...`, [L, ...])."""
  def key_of(path):
    m = _INDEXED.match(path)
    return (m["head"] + m["rest"], int(m["i"])) if m else None

  def merge(path, items):
    items = sorted(items, key=lambda t: t[0])
    if [i for i, _ in items] != list(range(len(items))):
      raise ValueError(f"to_scan: layers of {path!r} are not 0..{len(items) - 1}")
    var = items[0][1]
    return [(_parts(path), var.replace(jnp.stack([v.get_value() for _, v in items])))]
  return _convert(state, key_of, merge)


def to_loop(state: nnx.State) -> nnx.State:
  """A scan-layout parameter state in the loop layout (one entry per layer)."""
  def key_of(path):
    return (path, 0) if stacked_path(path) else None

  def merge(path, items):
    var = items[0][1]
    value = var.get_value()
    return [(_parts(layer_path(path, i)), var.replace(value[i])) for i in range(value.shape[0])]
  return _convert(state, key_of, merge)
