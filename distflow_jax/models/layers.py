"""The transformer's small building blocks: RMSNorm, the gated MLP, linear layers.

Shared by attention.py and transformer.py; parameter names (``scale``,
``gate_proj``, ...) are the HF checkpoint's (see hf_names).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from distflow_jax.models.config import ModelConfig

INIT = nnx.initializers.normal(0.02)


class RMSNorm(nnx.Module):
  def __init__(self, dim: int, eps: float, dtype: Any):
    self.scale = nnx.Param(jnp.ones((dim,), dtype))
    self.eps = eps

  def __call__(self, x: jax.Array) -> jax.Array:
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
    return self.scale[...] * y.astype(x.dtype)


def linear(cfg: ModelConfig, d_in: int, d_out: int, bias: bool, rngs: nnx.Rngs) -> nnx.Linear:
  """A projection in the model's dtype, initialised like every other weight here."""
  return nnx.Linear(d_in, d_out, use_bias=bias, dtype=cfg.jnp_dtype, param_dtype=cfg.jnp_dtype,
                    kernel_init=INIT, rngs=rngs)


class MLP(nnx.Module):
  def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
    d, f = cfg.hidden_size, cfg.intermediate_size
    self.gate_proj = linear(cfg, d, f, False, rngs)
    self.up_proj = linear(cfg, d, f, False, rngs)
    self.down_proj = linear(cfg, f, d, False, rngs)

  def __call__(self, x):
    return self.down_proj(jax.nn.silu(self.gate_proj(x)) * self.up_proj(x))
