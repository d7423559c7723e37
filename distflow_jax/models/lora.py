"""LoRA adapters on a model's state: trainable split, switched off, attached, merged, read.

The adapted layer and the spec are lora_layer.py's.  Here, on an `nnx.State` (or a model):

* `split_trainable` / `merge_trainable`: the adapters (`nnx.LoRAParam` leaves) and the
  frozen rest; a state without adapters is all trainable.  The train steps differentiate
  and the optimizer state covers the trainable part only (train/steps.py, placement.py).
* `base_only`: the same state with every `lora_b` zero, so the model computes the base
  bitwise (the REFERENCE pass of a LoRA run: the actor's own weights, adapters off).
* `attach`: a base model plus fresh adapters (the base is the same as without LoRA).
* `merged_state`: the base with `W + a @ b * alpha / r` per target and no adapters (the
  rollout's weight sync, `export --lora=merged`).
* `adapter_arrays` / `set_adapter_arrays`: the adapters by HF module name
  (`model.layers.3.self_attn.q_proj` -> (a [d_in, r], b [r, d_out]) float32 numpy), for
  the PEFT files.
* `check`: `model.lora` against a model's shape (`LoraError`, one line naming the key).
"""

from __future__ import annotations

import zlib
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, SingleDeviceSharding

from distflow_jax.config.errors import ConfigError
from distflow_jax.models import stacking
from distflow_jax.models.config import ModelConfig
from distflow_jax.models.hf_names import hf_name
from distflow_jax.models.lora_layer import TARGETABLE, LoraSpec, a_init
from distflow_jax.models.sharding import Rules, no_sharding, path_str, spec_for
from distflow_jax.models.transformer import Transformer


class LoraError(ConfigError):
  """`model.lora` that does not fit the model, or adapter arrays that do not fit it."""


def _state(x: Any) -> nnx.State:
  return x if isinstance(x, nnx.State) else nnx.split(x)[1]


def has_adapters(state: Any) -> bool:
  return any(isinstance(v, nnx.LoRAParam) for _, v in nnx.to_flat_state(_state(state)))


def split_trainable(params: nnx.State) -> tuple[nnx.State, nnx.State]:
  """(what a train step updates, what stays frozen): the adapters and the rest when the
  state has adapters, else (everything, an empty state)."""
  if not has_adapters(params):
    return params, nnx.State({})
  return nnx.split_state(params, nnx.LoRAParam, ...)


def merge_trainable(trainable: nnx.State, frozen: nnx.State) -> nnx.State:
  return nnx.merge_state(trainable, frozen) if len(jax.tree.leaves(frozen)) else trainable


def base_only(params: nnx.State) -> nnx.State:
  """``params`` with the adapters switched off (every ``lora_b`` zero): the base model."""
  if not has_adapters(params):
    return params
  flat = [(k, v.replace(jnp.zeros_like(v.get_value())) if path_str(k).endswith("lora_b")
           else v) for k, v in nnx.to_flat_state(params)]
  return nnx.from_flat_state(flat)


def _targets(params: nnx.State) -> dict[str, dict[str, Any]]:
  """`{"layers/attn/q_proj": {"kernel": Variable, "lora_a": ..., "lora_b": ..., ...}}`."""
  groups: dict[str, dict[str, Any]] = {}
  flat = list(nnx.to_flat_state(params))
  owners = {path_str(k).rsplit("/", 1)[0] for k, v in flat if isinstance(v, nnx.LoRAParam)}
  for k, v in flat:
    owner, leaf = path_str(k).rsplit("/", 1) if "/" in path_str(k) else ("", path_str(k))
    if owner in owners:
      groups.setdefault(owner, {})[leaf] = (k, v)
  return groups


def merged_kernel(w: jax.Array, a: jax.Array, b: jax.Array, scale: float) -> jax.Array:
  """One target's ``W + a @ b * scale``, in float32, cast to W's dtype (every merge: the
  rollout's two sync routes, the export)."""
  delta = jnp.matmul(a, b) * jnp.float32(scale)
  return (w.astype(jnp.float32) + delta).astype(w.dtype)


def merged_state(params: nnx.State, scale: float) -> nnx.State:
  """The base state with each target's kernel ``W + a @ b * scale`` (computed in float32,
  cast to W's dtype) and no adapter leaves; jit-friendly (shapes fixed, no Python values
  read from arrays).  ``scale`` is the spec's alpha / rank."""
  out = []
  groups = _targets(params)
  merged_keys = set()
  for owner, leaves in groups.items():
    (kk, kernel), (_, a), (_, b) = leaves["kernel"], leaves["lora_a"], leaves["lora_b"]
    out.append((kk, kernel.replace(merged_kernel(kernel.get_value(), a.get_value(),
                                                 b.get_value(), scale))))
    merged_keys.add(kk)
  for k, v in nnx.to_flat_state(params):
    if k not in merged_keys and not isinstance(v, nnx.LoRAParam):
      out.append((k, v))
  return nnx.from_flat_state(out)


def merged_model(model: Transformer) -> Transformer:
  """A model with adapters as a plain one (no adapters): ``merged_state`` on a graph of
  the same config without LoRA (``export --lora=merged``, eval / generate from a run)."""
  if model.cfg.lora is None:
    return model
  base_cfg = model.cfg.replace(lora=None)
  graphdef = nnx.split(nnx.eval_shape(lambda: Transformer(base_cfg, rngs=nnx.Rngs(0))))[0]
  return nnx.merge(graphdef, merged_state(nnx.split(model)[1], model.cfg.lora.scale))


def adapter_init(cfg, mesh: Mesh | None = None, rules: Rules | None = None):
  """``(keys, init_adapters)``: the adapter leaves' flat-state keys of a model of ``cfg``
  (its ``lora`` set) and one jitted program making all of them from a seed's key, each
  ``lora_a`` drawn from the key folded with its path, each ``lora_b`` zero, placed per
  ``rules`` on ``mesh`` (None: the first local device): one compile whatever the targets."""
  spec = cfg.lora
  abstract = nnx.split(nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0))))[1]
  init = a_init(spec.init, spec.rank)
  rules = rules or no_sharding()
  adapters = [(key, path_str(key), var.get_value().shape)
              for key, var in nnx.to_flat_state(abstract) if isinstance(var, nnx.LoRAParam)]

  def init_adapters(key):
    return tuple(init(jax.random.fold_in(key, zlib.crc32(p.encode())), shape, jnp.float32)
                 if p.endswith("lora_a") else jnp.zeros(shape, jnp.float32)
                 for _, p, shape in adapters)
  where = tuple(SingleDeviceSharding(jax.local_devices()[0]) if mesh is None else
                NamedSharding(mesh, spec_for(p, shape, rules, mesh)) for _, p, shape in adapters)
  return [k for k, _, _ in adapters], jax.jit(init_adapters, out_shardings=where)


def attach(model: Transformer, spec: LoraSpec, seed: int, mesh: Mesh | None = None,
           rules: Rules | None = None) -> Transformer:
  """``model`` (a Transformer without adapters) with fresh adapters per ``spec``
  (``adapter_init``): its base leaves as they are (no copy)."""
  check(spec, model.cfg)
  cfg = model.cfg.replace(lora=spec)
  graphdef, abstract = nnx.split(nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0))))
  base = dict(nnx.to_flat_state(nnx.split(model)[1]))
  keys, init_adapters = adapter_init(cfg, mesh, rules)
  made = dict(zip(keys, init_adapters(jax.random.key(seed))))
  flat = [(key, var.replace(made[key]) if key in made else base[key])
          for key, var in nnx.to_flat_state(abstract)]
  return nnx.merge(graphdef, nnx.from_flat_state(flat))


# ---- the adapters by Hugging Face module name (the PEFT files' interface) -------------------

def _module_names(owner: str, layers: int | None) -> list[str]:
  """HF module names of one target path (``layers/attn/q_proj``: one per layer when stacked)."""
  paths = ([stacking.layer_path(owner + "/kernel", i) for i in range(layers)]
           if layers is not None else [owner + "/kernel"])
  return [hf_name(p)[0].removesuffix(".weight") for p in paths]


def _host(x: jax.Array) -> np.ndarray:
  if not x.is_fully_addressable:
    x = multihost_utils.process_allgather(x, tiled=True)
  return np.asarray(jax.device_get(x), np.float32)


def _layout(state: nnx.State) -> dict[str, tuple[str, int | None, tuple, tuple]]:
  """HF module name -> (owner path, layer index or None, a's shape, b's shape)."""
  out = {}
  for owner, leaves in _targets(state).items():
    a, b = leaves["lora_a"][1].get_value(), leaves["lora_b"][1].get_value()
    stacked = stacking.stacked_path(owner + "/kernel") is not None
    names = _module_names(owner, a.shape[0] if stacked else None)
    for i, name in enumerate(names):
      out[name] = (owner, i if stacked else None, tuple(a.shape[-2:]), tuple(b.shape[-2:]))
  return out


def adapter_shapes(model: Any) -> dict[str, tuple[int, int]]:
  """``{"model.layers.3.self_attn.q_proj": (d_in, d_out)}`` of every adapted module."""
  return {name: (a[0], b[1]) for name, (_, _, a, b) in _layout(_state(model)).items()}


def adapter_arrays(model: Any) -> dict[str, tuple[np.ndarray, np.ndarray]]:
  """``{"model.layers.3.self_attn.q_proj": (a [d_in, r], b [r, d_out])}``, float32 numpy,
  in our orientation (PEFT's ``lora_A.weight`` is ``a.T``, ``lora_B.weight`` ``b.T``)."""
  state = _state(model)
  groups = _targets(state)
  out = {}
  for name, (owner, i, _, _) in _layout(state).items():
    a, b = (groups[owner][leaf][1].get_value() for leaf in ("lora_a", "lora_b"))
    out[name] = (_host(a if i is None else a[i]), _host(b if i is None else b[i]))
  return out


def set_adapter_arrays(model: Any, arrays: dict[str, tuple[np.ndarray, np.ndarray]]) -> Any:
  """The inverse of ``adapter_arrays``: a model is updated in place (and returned), a
  state returned updated.  Refuses a missing or unknown key and a shape mismatch."""
  state = _state(model)
  layout = _layout(state)
  missing = sorted(set(layout) - set(arrays))
  unknown = sorted(set(arrays) - set(layout))
  if missing:
    raise LoraError(f"adapter for module {missing[0]!r} is missing ({len(missing)} of "
                    f"{len(layout)} missing)")
  if unknown:
    raise LoraError(f"adapter for module {unknown[0]!r} is unknown: this model's adapted "
                    f"modules are e.g. {sorted(layout)[:3]}")
  for name, (_, _, a_shape, b_shape) in layout.items():
    a, b = (np.asarray(x) for x in arrays[name])
    for what, got, want in (("a", a.shape, a_shape), ("b", b.shape, b_shape)):
      if tuple(got) != want:
        raise LoraError(f"adapter {name!r} {what}: shape {tuple(got)} does not match the "
                        f"model's {want}")
  flat = []
  groups = _targets(state)
  by_owner: dict[str, list[tuple[int | None, str]]] = {}
  for name, (owner, i, _, _) in layout.items():
    by_owner.setdefault(owner, []).append((i, name))
  for owner, items in by_owner.items():
    items.sort(key=lambda t: -1 if t[0] is None else t[0])
    for j, leaf in enumerate(("lora_a", "lora_b")):
      key, var = groups[owner][leaf]
      value = (np.stack([arrays[n][j] for _, n in items]) if items[0][0] is not None
               else np.asarray(arrays[items[0][1]][j]))
      old = var.get_value()
      flat.append((key, var.replace(jax.device_put(value.astype(old.dtype), old.sharding))))
  new = nnx.from_flat_state(flat)
  if isinstance(model, nnx.State):
    return nnx.merge_state(state, new)
  nnx.update(model, new)
  return model


# ---- model.lora against the model ------------------------------------------------------------

def _dims(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
  d, f, q, kv = (cfg.hidden_size, cfg.intermediate_size, cfg.num_heads * cfg.head_dim,
                 cfg.num_kv_heads * cfg.head_dim)
  return {"q_proj": (d, q), "k_proj": (d, kv), "v_proj": (d, kv), "o_proj": (q, d),
          "gate_proj": (d, f), "up_proj": (d, f), "down_proj": (f, d)}


def linear_modules(cfg: ModelConfig) -> list[str]:
  """Every projection an adapter could target, by HF module name, layer by layer."""
  return [f"model.layers.{i}.{m}" for i in range(cfg.num_layers) for m in TARGETABLE.values()]


def check(spec: LoraSpec, cfg: ModelConfig) -> None:
  """Raises ``LoraError`` (one line naming the key) where ``spec`` does not fit ``cfg``: its
  targets and rank against the model's layers.  The values alone (rank > 0, alpha, dropout,
  init) are the config's checks (config/lora_checks.py), run before any model is built."""
  if not spec.targets:
    raise LoraError(f"model.lora.targets is empty; name modules among {list(TARGETABLE)}")
  names = linear_modules(cfg)
  for pattern in spec.targets:
    if not any(LoraSpec(1, 1.0, (pattern,)).matches(n) for n in names):
      raise LoraError(f"model.lora.targets: pattern {pattern!r} matches no module of the "
                      f"model; targetable: {list(TARGETABLE)} (fnmatch over the short name or "
                      f"the full name, e.g. 'model.layers.0.self_attn.q_proj')")
  first = spec.targets_in_layer(0)
  ffn = [t for t in first if t.endswith(("gate_proj", "up_proj", "down_proj"))]
  if cfg.moe is not None and ffn:
    raise LoraError(f"model.lora.targets={list(spec.targets)} adapts {ffn}, and a MoE "
                    f"model's feed-forward is its experts, which take no adapters yet; "
                    f"target the attention only (q_proj, k_proj, v_proj, o_proj)")
  for i in range(1, cfg.num_layers):
    if spec.targets_in_layer(i) != first:
      raise LoraError(f"model.lora.targets={list(spec.targets)} adapts {list(first)} in layer "
                      f"0 but {list(spec.targets_in_layer(i))} in layer {i}; every layer must "
                      f"carry the same adapters (name modules by short name: q_proj, ...)")
  dims = _dims(cfg)
  for name in first:
    d_in, d_out = dims[name]
    if spec.rank > min(d_in, d_out):
      raise LoraError(f"model.lora.rank={spec.rank} is larger than {name}'s "
                      f"min(d_in, d_out) = min({d_in}, {d_out}); use a rank <= "
                      f"{min(d_in, d_out)} or leave {name} out of model.lora.targets")
