"""Sharding as data: (regex over parameter path, PartitionSpec) rules.

A parameter's path is its NNX state path joined by "/", e.g.
`layers/0/attn/q_proj/kernel` (`layers/attn/q_proj/kernel` with layers stacked
by `scan_layers`: its rule applies to the dims after the layer axis, which stays
whole).  The first rule whose regex fully matches the path gives its
`PartitionSpec` (a LoRA adapter, `.../lora_a` / `.../lora_b`, follows its
kernel's: see `rule_for`); mesh axes named in a spec but absent from the mesh are
dropped, so one rule set serves any mesh made of `data` / `fsdp` / `tensor`
axes.  A dimension that its axes do not divide raises ValueError naming the
parameter.

    rules = fsdp_tp_rules()
    mesh = make_mesh({"fsdp": 2, "tensor": 4})
    model = create_sharded(lambda: Transformer(cfg, rngs=nnx.Rngs(0)), mesh, rules)

`create_sharded` builds the state abstractly (`nnx.eval_shape`), derives the
shardings and runs the initialiser under `jax.jit(out_shardings=...)`, so no
parameter is ever fully materialised on one device.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
import re
from typing import Callable, Mapping, Sequence

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from distflow_jax.models.stacking import stacked_path

Rules = tuple[tuple[str, P], ...]
MESH_AXES = ("data", "fsdp", "tensor")


def no_sharding() -> Rules:
  """Everything replicated."""
  return ((".*", P()),)


def fsdp_tp_rules() -> Rules:
  """Kernels split over `fsdp` on their model dim and `tensor` on heads / hidden / vocab."""
  return (
      (r"(.*/)?embed/embedding", P("tensor", "fsdp")),         # [V, D]
      (r"(.*/)?lm_head/kernel", P("fsdp", "tensor")),          # [D, V]
      (r".*attn/(q|k|v|qkv)_proj/kernel", P("fsdp", "tensor")),    # [D, H*Dh]
      (r".*attn/(q|k|v|qkv)_proj/bias", P("tensor")),
      (r".*attn/o_proj/kernel", P("tensor", "fsdp")),          # [H*Dh, D]
      (r".*mlp/(gate|up|gate_up)_proj/kernel", P("fsdp", "tensor")),   # [D, F]
      (r".*mlp/down_proj/kernel", P("tensor", "fsdp")),        # [F, D]
      (r".*mlp/gate/kernel", P("fsdp", None)),                 # [D, E] a MoE router
      (r".*mlp/experts/(gate|up)_proj", P(None, "fsdp", "tensor")),   # [E, D, I]
      (r".*mlp/experts/down_proj", P(None, "tensor", "fsdp")),        # [E, I, D]
      (r"(.*/)?value_head/kernel", P("fsdp", None)),           # [D, 1]
      (r".*", P()),                                            # norms, value bias
  )


def make_mesh(axes: Mapping[str, int], devices: Sequence[jax.Device] | None = None) -> Mesh:
  """A mesh with Auto axis types (explicit axes break embedding gathers in jax 0.10)."""
  for name in axes:
    if name not in MESH_AXES:
      raise ValueError(f"mesh axis {name!r} is unknown; valid: {MESH_AXES}")
  devices = list(jax.devices() if devices is None else devices)
  n = math.prod(axes.values())
  if n != len(devices):
    raise ValueError(f"mesh {dict(axes)} needs {n} devices, got {len(devices)}")
  return Mesh(np.asarray(devices).reshape(tuple(axes.values())), tuple(axes),
              axis_types=(jax.sharding.AxisType.Auto,) * len(axes))


def path_str(path: Sequence) -> str:
  return "/".join(str(getattr(k, "key", k)) for k in path)


# A LoRA adapter leaf (models/lora_layer.py) beside its projection's `kernel`.
_ADAPTER = re.compile(r"^(?P<owner>(?:.*/)?)lora_(?P<which>[ab])$")


def rule_for(path: str, rules: Rules) -> tuple[str, P]:
  """(pattern, spec) of the first rule whose regex fully matches ``path``.

  A LoRA adapter follows its kernel's rule ([d_in, d_out] -> spec (i, o)): ``lora_a``
  [d_in, r] gets (i, None), ``lora_b`` [r, d_out] gets (None, o), the rank unsplit, so
  ``a @ b`` comes out laid out like the kernel and the adapters shard like their base."""
  m = _ADAPTER.match(path)
  if m:
    pattern, spec = rule_for(m["owner"] + "kernel", rules)
    i, o = (tuple(spec) + (None, None))[:2]
    return pattern, (P(i, None) if m["which"] == "a" else P(None, o))
  for pattern, spec in rules:
    if re.fullmatch(pattern, path):
      return pattern, spec
  raise ValueError(f"no sharding rule matches parameter {path!r}; add a catch-all ('.*', P())")


def spec_for(path: str, shape: Sequence[int], rules: Rules, mesh: Mesh) -> P:
  """The PartitionSpec of one parameter, restricted to the mesh's axes and checked."""
  pattern, spec = rule_for(path, rules)
  if stacked_path(path):  # scan_layers: the leading layer axis is never split
    spec = P(None, *spec)
  if len(spec) > len(shape):
    raise ValueError(f"rule {pattern!r} gives {spec} to {path!r} of rank {len(shape)}")
  dims = []
  for dim, entry in zip(shape, tuple(spec) + (None,) * (len(shape) - len(spec))):
    names = () if entry is None else (entry if isinstance(entry, tuple) else (entry,))
    names = tuple(a for a in names if a in mesh.shape)
    size = math.prod(mesh.shape[a] for a in names)
    if dim % size:
      raise ValueError(f"parameter {path!r} dim {dim} is not divisible by mesh axes {names} "
                       f"(size {size}) from rule {pattern!r} {spec}; mesh {dict(mesh.shape)}")
    dims.append(None if not names else names[0] if len(names) == 1 else names)
  return P(*dims)


def state_shardings(state: nnx.State, mesh: Mesh, rules: Rules) -> nnx.State:
  """The NamedSharding of every variable of an (abstract or concrete) NNX state."""
  flat = []
  for path, var in nnx.to_flat_state(state):
    value = var.get_value()
    flat.append((path, var.replace(
        NamedSharding(mesh, spec_for(path_str(path), value.shape, rules, mesh)))))
  return nnx.from_flat_state(flat)


def init_program(ctor: Callable[[], nnx.Module], mesh: Mesh, rules: Rules):
  """``(graphdef, jitted initialiser)``: the initialiser takes no argument and returns
  `ctor`'s state laid out in its shardings (``plan --lower`` lowers it too)."""
  abstract = nnx.eval_shape(ctor)
  graphdef, abstract_state = nnx.split(abstract)
  shardings = state_shardings(abstract_state, mesh, rules)

  def init_params():
    return nnx.state(ctor())
  return graphdef, jax.jit(init_params, out_shardings=shardings)


def create_sharded(ctor: Callable[[], nnx.Module], mesh: Mesh, rules: Rules) -> nnx.Module:
  """Runs `ctor` (a module constructor) directly into its shardings."""
  graphdef, init = init_program(ctor, mesh, rules)
  return nnx.merge(graphdef, init())


def shard_state(state: nnx.State, mesh: Mesh, rules: Rules) -> nnx.State:
  """Moves an existing state into the rules' shardings."""
  return jax.device_put(state, state_shardings(state, mesh, rules))


# Activations: rows split over the batch axes while a step is traced (see below).
BATCH_AXES = ("data", "fsdp")
_ROWS: contextvars.ContextVar[NamedSharding | None] = contextvars.ContextVar(
    "distflow_row_sharding", default=None)


@contextlib.contextmanager
def rows_sharded(mesh: Mesh | None):
  """While tracing under it, ``constrain_rows`` splits activations' rows over ``mesh``'s
  ``data`` and ``fsdp`` axes (the whole of FSDP: each device keeps only its own rows'
  activations and gathers the weights a layer needs).  Left to sharding propagation, XLA
  may instead gather the rows and split the matmuls over the fsdp-sharded model dim,
  keeping every row's activations on every device (8x the memory on 8 devices)."""
  axes = () if mesh is None else tuple(a for a in BATCH_AXES if mesh.shape.get(a, 1) > 1)
  token = _ROWS.set(NamedSharding(mesh, P(axes)) if axes else None)
  try:
    yield
  finally:
    _ROWS.reset(token)


def row_sharding() -> NamedSharding | None:
  """The rows' sharding of the enclosing ``rows_sharded`` (None outside one, or on a mesh
  whose batch axes are all 1)."""
  return _ROWS.get()


def shard_count(sh: NamedSharding) -> int:
  """How many pieces ``sh`` splits axis 0 into."""
  axes = sh.spec[0] if isinstance(sh.spec[0], tuple) else (sh.spec[0],)
  return math.prod(sh.mesh.shape[a] for a in axes)


def constrain_rows(x: jax.Array) -> jax.Array:
  """``x`` ([rows, ...]) constrained to rows split over the batch axes of the enclosing
  ``rows_sharded``; unchanged outside one, or when the rows do not divide evenly."""
  sh = _ROWS.get()
  if sh is None or x.ndim == 0:
    return x
  if x.shape[0] % shard_count(sh):
    return x
  return jax.lax.with_sharding_constraint(x, sh)
