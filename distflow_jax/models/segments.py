"""Segment ids of packed rows: which keys a query of a packed row may see.

Packed rows (train/packing.py) carry one int32 segment id per token, 0 on padding.  Two
kinds share one rule:

* one sample per segment (``packing.plan``): ids 1, 2, ... below ``PROMPT_STRIDE``; a query
  sees the keys of its own segment;
* a shared prompt (``packing_shared.py``): a group's prompt, laid once, has the id
  ``g * PROMPT_STRIDE`` (g >= 1), and its k-th response (k >= 1) ``g * PROMPT_STRIDE + k``;
  a response's query sees its own response's keys and its group's prompt keys, a prompt's
  query sees the prompt's.

So: a query with id ``q`` sees a key with id ``k`` iff ``k == q`` or ``k`` is the prompt id
of ``q``'s group (``q - q % PROMPT_STRIDE``, when that is >= ``PROMPT_STRIDE``).  Why one
id and not a second array: the rule needs nothing but the ids the packed path already
threads through every attention implementation (einsum, XLA, blockwise, where it is
evaluated per block), so no signature changes and no extra memory.  Causality stays with
the positions (a key at a later position is never seen).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

# Responses per group stay below this; groups per row below 2^31 / PROMPT_STRIDE.
PROMPT_STRIDE = 1 << 16


def prompt_id(seg):
  """The shared-prompt id of a segment id's group (0 for one-sample segments)."""
  return seg - seg % PROMPT_STRIDE


def visible(seg_q_BxQ: jax.Array, seg_k_BxC: jax.Array) -> jax.Array:
  """``[B, Q, C]``: whether each query's segment may see each key's (module docstring)."""
  q = seg_q_BxQ[:, :, None]
  k = seg_k_BxC[:, None, :]
  return (k == q) | ((k == prompt_id(q)) & (k >= PROMPT_STRIDE))
