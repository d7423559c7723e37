"""LoRA's building blocks: the adapter spec (`model.lora`) and the adapted linear layer.

A targeted projection (`LoRALinear`, an `nnx.Linear`) keeps its frozen `kernel` / `bias`
at the paths the HF names map (hf_names) and adds two `nnx.LoRAParam`s, float32 whatever
the model's dtype:

    lora_a  [d_in, r]   random (init "gaussian": N(0, (1/r)^2), PEFT's "gaussian";
                        "kaiming": U(-1/sqrt(d_in), 1/sqrt(d_in)), PEFT's default)
    lora_b  [r, d_out]  zero

    y = x @ kernel (+ bias)  +  ((x @ lora_a) @ lora_b * alpha / r).astype(y.dtype)

With `lora_b` zero the added term is a sum of signed zeros, so a fresh adapter (or one
switched off: `lora.base_only`, B zeroed) gives the base output bitwise.  Targets are
`fnmatch` patterns over a projection's HF module name (`model.layers.3.self_attn.q_proj`)
or its short name (`q_proj`); every layer carries the same adapters (the layers share one
structure under `scan_layers`), checked by `lora.check`.

Adapter dropout (``model.lora.dropout = p > 0``, PEFT's ``lora_dropout``) drops the adapter's
input only, ``x -> mask * x / (1 - p)`` before ``lora_a``, and only where a train step traces
the loss inside ``adapter_dropout(key)`` (its micro-batch's key): rollout, the reference and
log-prob passes, eval and export never enter one, so they compute the same with any p.  Each
adapted projection draws its own mask from that key, its layer index (``dropout_layer``, set
by the transformer's layer loop or scan) and its short name.  The key travels as trace-time
context (like ``sharding.rows_sharded``) so the model's call signatures stay as they are.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import fnmatch
import math
import zlib

import jax
import jax.numpy as jnp
from flax import nnx

# The projections adapters can target: short name -> the HF module path inside a layer.
TARGETABLE = {"q_proj": "self_attn.q_proj", "k_proj": "self_attn.k_proj",
              "v_proj": "self_attn.v_proj", "o_proj": "self_attn.o_proj",
              "gate_proj": "mlp.gate_proj", "up_proj": "mlp.up_proj",
              "down_proj": "mlp.down_proj"}
INITS = ("gaussian", "kaiming")


@dataclasses.dataclass(frozen=True)
class LoraSpec:
  """`model.lora` as the model sees it (rank > 0: on).  `targets`: fnmatch patterns."""
  rank: int
  alpha: float
  targets: tuple[str, ...]
  dropout: float = 0.0
  init: str = "gaussian"

  def __post_init__(self):
    object.__setattr__(self, "targets", tuple(self.targets))

  @classmethod
  def from_config(cls, section) -> "LoraSpec | None":
    """The spec of a config's ``model.lora`` section (None when off)."""
    if not section.enabled:
      return None
    return cls(rank=section["rank"], alpha=float(section["alpha"]),
               targets=tuple(section["targets"]), dropout=float(section["dropout"]),
               init=section["init"])

  @property
  def scale(self) -> float:
    return float(self.alpha) / self.rank

  def matches(self, module_name: str) -> bool:
    """Whether an HF module name (`model.layers.3.self_attn.q_proj`) is targeted."""
    short = module_name.rsplit(".", 1)[-1]
    return any(fnmatch.fnmatchcase(module_name, p) or fnmatch.fnmatchcase(short, p)
               for p in self.targets)

  def targets_in_layer(self, layer: int) -> tuple[str, ...]:
    """The short names (`q_proj`, ...) targeted in layer `layer`."""
    return tuple(s for s, m in TARGETABLE.items()
                 if self.matches(f"model.layers.{layer}.{m}"))


def a_init(kind: str, rank: int):
  """The initialiser of `lora_a` ([d_in, r])."""
  if kind == "gaussian":
    return nnx.initializers.normal(1.0 / rank)
  if kind == "kaiming":  # torch kaiming_uniform_(a=sqrt(5)) on [r, d_in]: bound 1/sqrt(d_in)
    def init(key, shape, dtype=jnp.float32):
      bound = 1.0 / math.sqrt(shape[-2])  # [(L,) d_in, r]
      return jax.random.uniform(key, shape, dtype, -bound, bound)
    return init
  raise ValueError(f"model.lora.init={kind!r} is unknown; valid: {list(INITS)}")


# The dropout key of the micro-batch being traced (a typed PRNG key), None outside a train
# step's loss (then no adapter drops anything).
_KEY: contextvars.ContextVar[jax.Array | None] = contextvars.ContextVar("lora_dropout_key",
                                                                       default=None)


@contextlib.contextmanager
def adapter_dropout(key: jax.Array | None):
  """Adapters traced inside draw their dropout masks from ``key`` (None: no dropout)."""
  token = _KEY.set(key)
  try:
    yield
  finally:
    _KEY.reset(token)


def dropout_on() -> bool:
  """Whether the code being traced runs inside ``adapter_dropout`` with a key."""
  return _KEY.get() is not None


@contextlib.contextmanager
def dropout_layer(index):
  """Inside: the dropout key folded with the layer ``index`` (an int or a traced scalar: the
  layers' scan index), so every layer draws its own masks; nothing outside a dropout."""
  key = _KEY.get()
  if key is None:
    yield
    return
  with adapter_dropout(jax.random.fold_in(key, index)):
    yield


def _dropout(x: jax.Array, rate: float, name: str) -> jax.Array:
  key = _KEY.get()
  if key is None or rate <= 0:
    return x
  keep = jax.random.bernoulli(jax.random.fold_in(key, zlib.crc32(name.encode()) & 0x7FFFFFFF),
                              1.0 - rate, x.shape)
  return jnp.where(keep, x / jnp.asarray(1.0 - rate, x.dtype), jnp.zeros_like(x))


class LoRALinear(nnx.Linear):
  """An `nnx.Linear` plus a low-rank update (see the module docstring); ``name``: its short
  name (``q_proj``, ...), which keeps its dropout mask apart from its neighbours'."""

  def __init__(self, d_in: int, d_out: int, *, spec: LoraSpec, rngs: nnx.Rngs, name: str = "",
               **kwargs):
    super().__init__(d_in, d_out, rngs=rngs, **kwargs)
    self.lora_a = nnx.LoRAParam(a_init(spec.init, spec.rank)(rngs.params(), (d_in, spec.rank),
                                                              jnp.float32))
    self.lora_b = nnx.LoRAParam(jnp.zeros((spec.rank, d_out), jnp.float32))
    self.lora_scale = spec.scale
    self.lora_dropout = spec.dropout
    self.lora_name = name

  def __call__(self, x: jax.Array) -> jax.Array:
    y = super().__call__(x)
    a, b = self.lora_a[...], self.lora_b[...]
    xa = _dropout(x.astype(a.dtype), self.lora_dropout, self.lora_name)
    delta = (xa @ a) @ b * jnp.asarray(self.lora_scale, a.dtype)
    return y + delta.astype(y.dtype)
