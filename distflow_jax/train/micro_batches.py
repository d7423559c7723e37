"""A train step's micro-batches: rows dealt round robin, or a token-budget plan's slots.

Micro-batches.  Blocks of ``group_size`` consecutive rows (single rows when
it is 1) are dealt round robin: block ``j`` goes to micro-batch ``j % M``.
With the batch sharded over data-parallel devices in contiguous rows, every
micro-batch then takes rows from every device, so accumulation adds no
communication, and groups stay whole.  A batch holding ``pack`` (train/packing.py)
brings it with a leading micro-batch axis (one plan per micro-batch,
``packing.plan_parts``).

Token-budget micro-batches.  A plan that also holds ``idx`` / ``valid`` ``[M, S]``
(train/token_budget.py: ``<role>.micro_batch_tokens``) names each micro-batch's rows
itself instead of dealing rows round robin: the step gathers them
(``gather_micro_batches``), padding slots' masks off, and M comes from the plan.
"""

from __future__ import annotations

from collections.abc import Mapping

import jax
import jax.numpy as jnp
from distflow_jax.data.fields import PROMPT_MASK, RESPONSE_MASK

Batch = Mapping[str, jax.Array]


def deal_rows(batch: Batch, m: int, block: int = 1) -> Batch:
  """``[B, ...] -> [M, B/M, ...]``: blocks of `block` consecutive rows dealt round robin
  (block j to part j % M); single rows when B is not a multiple of M * block.  Splits a
  batch into micro-batches here and into mini-batches in the train node."""
  b = jax.tree.leaves(batch)[0].shape[0]
  if b % m:
    raise ValueError(f"batch of {b} rows does not split into {m} equal parts (micro- or "
                     f"mini-batches)")
  if b % (m * block):
    block = 1

  def split(x):
    x = x.reshape(b // (m * block), m, block, *x.shape[1:])
    return jnp.moveaxis(x, 1, 0).reshape(m, b // m, *x.shape[3:])
  return jax.tree.map(split, dict(batch))


SLOT_KEYS = ("idx", "valid")  # a token-budget plan's slots (train/token_budget.py)


def gather_micro_batches(batch: Batch, pack: Mapping[str, jax.Array]) -> Batch:
  """``[B, ...] -> [M, S, ...]``: the rows each micro-batch's slots name (``pack["idx"]``),
  with the prompt and response masks off on padding slots (``pack["valid"]``), so a
  padding slot adds nothing to a loss sum, a count or a gradient."""
  idx_MxS, valid_MxS = pack["idx"], pack["valid"].astype(bool)
  mbs = {k: v[idx_MxS] for k, v in batch.items()}
  for k in (PROMPT_MASK, RESPONSE_MASK):
    x = mbs[k]
    mbs[k] = jnp.where(valid_MxS[..., None], x, jnp.zeros_like(x))
  return mbs


def for_step(batch: Batch, pack: Mapping[str, jax.Array] | None,
             num_micro_batches: int | None, group_size: int) -> Batch:
  """The step's ``[M, ...]`` micro-batches (plan included): dealt rows, or a token-budget
  plan's slots (see "Token-budget micro-batches")."""
  if pack is not None and "idx" in pack:
    rows = {k: v for k, v in pack.items() if k not in SLOT_KEYS}
    return {**gather_micro_batches(batch, pack), "pack": rows}
  if num_micro_batches is None:
    raise ValueError("train step: num_micro_batches=None needs a token-budget plan "
                     "(pack with 'idx'; train/token_budget.py)")
  b = jax.tree.leaves(batch)[0].shape[0]
  if group_size > 1 and b % (num_micro_batches * group_size):
    raise ValueError(f"train step: {b} rows do not split into {num_micro_batches} "
                     f"micro-batches of whole groups of {group_size}")
  mbs = deal_rows(batch, num_micro_batches, group_size)
  if pack is not None:
    if jax.tree.leaves(pack)[0].shape[0] != num_micro_batches:
      raise ValueError(f"train step: the packing plan has {jax.tree.leaves(pack)[0].shape[0]} "
                       f"micro-batches, the step {num_micro_batches}")
    mbs = {**mbs, "pack": pack}
  return mbs
