"""Masked statistics over ``[B, T]`` arrays with a mask (float or bool, 1 = real): padding
never enters a sum, and NaN or garbage at padded positions is dropped, not multiplied by 0.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

WHITEN_EPS = 1e-8


def real(x: jax.Array, mask: jax.Array) -> jax.Array:
  """x on real tokens (float32), 0 on padding: where(), not a product, so padding garbage
  (NaN log-probs, say) reaches neither a value nor a gradient (0 * NaN is NaN)."""
  return jnp.where(mask > 0, x.astype(jnp.float32), 0.0)


def masked_sum(x: jax.Array, mask: jax.Array) -> jax.Array:
  return jnp.sum(real(x, mask))


def masked_mean(x: jax.Array, mask: jax.Array) -> jax.Array:
  """sum(x * m) / max(sum(m), 1): an all-masked input gives 0, not NaN."""
  m = mask.astype(jnp.float32)
  return jnp.sum(real(x, m)) / jnp.maximum(jnp.sum(m), 1.0)


def masked_var(x: jax.Array, mask: jax.Array, unbiased: bool = True) -> jax.Array:
  """Variance of the masked entries; Bessel-corrected when ``unbiased``."""
  m = mask.astype(jnp.float32)
  n = jnp.sum(m)
  mean = masked_mean(x, m)
  sq = jnp.sum(jnp.square(real(x, m) - mean) * m)
  denom = n - 1.0 if unbiased else n
  return sq / jnp.maximum(denom, 1.0)


def masked_whiten(x: jax.Array, mask: jax.Array, shift_mean: bool = True) -> jax.Array:
  """(x - mean) / sqrt(var + 1e-8) over the masked entries; padding -> 0.

  With ``shift_mean=False`` the mean is added back (only the scale changes).
  """
  m = mask.astype(jnp.float32)
  x = real(x, m)
  mean = masked_mean(x, m)
  white = (x - mean) * jax.lax.rsqrt(masked_var(x, m) + WHITEN_EPS)
  if not shift_mean:
    white = white + mean
  return white * m
