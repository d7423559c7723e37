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
from distflow_jax.models.lora_layer import LoRALinear

INIT = nnx.initializers.normal(0.02)


class RMSNorm(nnx.Module):
  def __init__(self, dim: int, eps: float, dtype: Any):
    self.scale = nnx.Param(jnp.ones((dim,), dtype))
    self.eps = eps

  def __call__(self, x: jax.Array) -> jax.Array:
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
    return self.scale[...] * y.astype(x.dtype)


def linear(cfg: ModelConfig, d_in: int, d_out: int, bias: bool, rngs: nnx.Rngs,
           name: str = "") -> nnx.Linear:
  """A projection in the model's dtype, initialised like every other weight here; with
  LoRA adapters (lora_layer.py) where ``cfg.lora`` targets ``name`` (``q_proj``, ...)."""
  kw = dict(use_bias=bias, dtype=cfg.jnp_dtype, param_dtype=cfg.jnp_dtype, kernel_init=INIT,
            rngs=rngs)
  if name and cfg.lora is not None and name in cfg.lora.targets_in_layer(0):
    return LoRALinear(d_in, d_out, spec=cfg.lora, name=name, **kw)
  return nnx.Linear(d_in, d_out, **kw)


class MLP(nnx.Module):
  def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
    d, f = cfg.hidden_size, cfg.intermediate_size
    self.fused = "gate_up_proj" in cfg.fused_projections
    if self.fused:  # the rollout engine's layout (fused.py)
      self.gate_up_proj = linear(cfg, d, 2 * f, False, rngs)
    else:
      self.gate_proj = linear(cfg, d, f, False, rngs, "gate_proj")
      self.up_proj = linear(cfg, d, f, False, rngs, "up_proj")
    self.down_proj = linear(cfg, f, d, False, rngs, "down_proj")

  def __call__(self, x):
    if self.fused:
      gate, up = jnp.split(self.gate_up_proj(x), 2, axis=-1)
    else:
      gate, up = self.gate_proj(x), self.up_proj(x)
    return self.down_proj(jax.nn.silu(gate) * up)
