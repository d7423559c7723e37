"""Fused projections for the rollout engine: each layer's q/k/v as one
``qkv_proj`` and gate/up as one ``gate_up_proj``, so a decode step runs one matmul for
the three and one for the two instead of five.

Only the engine's weights are fused (``ModelConfig.fused_projections`` names the fused
projections; the engine's loop model gets them from ``rollout.fuse_projections``): the training model keeps the separate
projections, whose names LoRA / PEFT adapters target and Hugging Face checkpoints use.
``fuse`` concatenates a state's kernels (and biases) along the output axis when the
weights enter the engine (its weight sync or ``load_params``); ``split`` cuts a fused
projection's output back into its parts.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

# fused name -> the projections it holds, in the order of its output columns.
PARTS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
_FUSED_OF = {part: name for name, parts in PARTS.items() for part in parts}


def fuse(state: nnx.State, names: tuple[str, ...]) -> nnx.State:
  """``state`` (one array per layer) with the projections of each fused name (``PARTS``'
  keys) fused; those already fused, or not named, are left as they are."""
  out, groups = [], {}
  for path, var in nnx.to_flat_state(state):
    name = _FUSED_OF.get(path[-2]) if len(path) >= 2 else None
    if name not in names:
      out.append((path, var))
      continue
    groups.setdefault(path[:-2] + (name, path[-1]), {})[path[-2]] = var
  for path, parts in groups.items():
    names = PARTS[path[-2]]
    if set(parts) != set(names):
      raise ValueError(f"fuse: {'/'.join(map(str, path[:-2]))} has {sorted(parts)}, "
                       f"needs all of {list(names)}")
    first = parts[names[0]]
    out.append((path, first.replace(jnp.concatenate([parts[n][...] for n in names], -1))))
  return nnx.from_flat_state(out)


def split(y: jax.Array, sizes: tuple[int, ...]) -> list[jax.Array]:
  """A fused projection's output ``[..., sum(sizes)]`` cut into its parts."""
  cuts, at = [], 0
  for s in sizes[:-1]:
    at += s
    cuts.append(at)
  return jnp.split(y, cuts, axis=-1)
