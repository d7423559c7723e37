"""Which response tokens are trained on: the loss mask.

A sequence batch's ``response_mask`` marks every real token after the prompt: the passes
attend to them, packing and token budgets count them.  A multi-turn episode's response
also holds the environment's observation tokens (rollout/episodes.py), which the model
did not generate: the batch then carries ``loss_mask`` ``[B, N]`` (True on generated
tokens only), and the losses, the KL, the advantages and the loss denominators read

    loss_mask(batch) = response_mask & loss_mask        (response_mask without one)

so observation tokens add nothing to a loss, a gradient, a count or an advantage, and a
padding slot (its ``response_mask`` turned off, train/micro_batches.py) stays out too.
"""

from __future__ import annotations

from collections.abc import Mapping

import jax
import jax.numpy as jnp

from distflow_jax.data.fields import LOSS_MASK, RESPONSE_MASK


def loss_mask(batch: Mapping[str, jax.Array]) -> jax.Array:
  """Float32 ``[B, N]``: 1 on the response tokens the losses read (see module doc)."""
  m = batch[RESPONSE_MASK].astype(jnp.float32)
  if LOSS_MASK in batch:
    m = m * batch[LOSS_MASK].astype(jnp.float32)
  return m
