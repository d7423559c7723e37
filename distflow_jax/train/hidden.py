"""The hidden states that predict a sequence batch's response tokens (plain, shared, packed).

A sequence batch is a dict of sample-leading arrays:

* ``prompt_tokens`` ``[B, P]`` left-padded, ``prompt_mask`` ``[B, P]``;
* ``response_tokens`` ``[B, N]`` right-padded, ``response_mask`` ``[B, N]``;
* per response token: ``old_logprobs``, ``ref_logprobs``, ``advantages``,
  ``returns``, ``values`` (``[B, N]`` float32), as a step needs them.

The model sees ``prompt ++ response`` with explicit positions, so left
padding of the prompt costs nothing in correctness.  Response token ``t`` is
predicted by the hidden state at index ``P - 1 + t``.

Shared prompts.  With ``group_size=n > 1`` the rows come in groups of n
consecutive rows (a GRPO group: n samples of one prompt), and each group's
prompt (that of its first row) is run once; its n responses attend to its
keys/values (``Transformer``'s ``prefix``).  That saves ``(n - 1) / n`` of the
prompt's compute, forward and backward, and gives the per-row pass's numbers
when the rows are so grouped.  Callers check that with ``prompts_grouped``
(on device, per batch): the train step refuses an ungrouped batch (no update,
``ungrouped = 1`` in its stats) and the workflow nodes raise.

Packed rows.  A batch holding ``pack`` (a plan of train/packing.py: ``model.pack_sequences``)
runs its passes padding-free: the samples' real tokens packed into ``[rows, pack_len]``
rows with per-token segment ids, the hidden states gathered back to ``[B, N]`` before
the heads.  With shared prompts the plan lays each group's prompt once and its responses
after it, each response seeing the prompt and itself (train/packing_shared.py): the
padded shared pass's numbers, padding-free.
"""

from __future__ import annotations

from collections.abc import Mapping

import jax
import jax.numpy as jnp
from flax import nnx

from distflow_jax.models.transformer import forward, positions_from_mask
from distflow_jax.train import image_inputs, packing
from distflow_jax.data.fields import PROMPT_MASK, PROMPT_TOKENS, RESPONSE_MASK, RESPONSE_TOKENS

Batch = Mapping[str, jax.Array]


def sequence_inputs(batch: Batch) -> tuple[jax.Array, jax.Array, jax.Array]:
  """``(tokens, mask, positions)`` of ``prompt ++ response``, ``[B, P + N]``."""
  tokens = jnp.concatenate([batch[PROMPT_TOKENS], batch[RESPONSE_TOKENS]], axis=1)
  mask = jnp.concatenate([batch[PROMPT_MASK], batch[RESPONSE_MASK]], axis=1).astype(bool)
  return tokens.astype(jnp.int32), mask, positions_from_mask(mask)


def _response_hidden_plain(graphdef: nnx.GraphDef, params: nnx.State, batch: Batch
                           ) -> jax.Array:
  tokens, mask, positions = sequence_inputs(batch)
  p = batch[PROMPT_TOKENS].shape[1]
  n = batch[RESPONSE_TOKENS].shape[1]
  hidden, _ = forward(graphdef, params, tokens[:, :-1], positions[:, :-1], mask[:, :-1],
                      return_hidden=True,
                      **image_inputs.sequence_kwargs(graphdef, params, batch, tokens[:, :-1]))
  return hidden[:, p - 1:p - 1 + n]


def _response_hidden_shared(graphdef: nnx.GraphDef, params: nnx.State, batch: Batch,
                            group_size: int) -> jax.Array:
  """`_response_hidden_plain` with each group's prompt (that of its first row) run once."""
  prompt_mask_GxP = batch[PROMPT_MASK][::group_size].astype(bool)
  prompt_GxP = batch[PROMPT_TOKENS][::group_size].astype(jnp.int32)
  resp_BxN = batch[RESPONSE_TOKENS].astype(jnp.int32)
  resp_mask_BxN = batch[RESPONSE_MASK].astype(bool)
  hidden_GxPxD, kv = forward(
      graphdef, params, prompt_GxP, positions_from_mask(prompt_mask_GxP), prompt_mask_GxP,
      return_hidden=True, return_kv=True, **image_inputs.sequence_kwargs(
          graphdef, params, image_inputs.group_rows(batch, group_size), prompt_GxP))
  first_BxD = jnp.repeat(hidden_GxPxD[:, -1], group_size, axis=0)  # predicts response token 0
  if resp_BxN.shape[1] == 1:
    return first_BxD[:, None]
  # Response token t sits at position (real prompt length) + t, as `sequence_inputs` gives.
  start_B = jnp.repeat(prompt_mask_GxP.sum(axis=1, dtype=jnp.int32), group_size)
  pos_BxN = start_B[:, None] + jnp.cumsum(resp_mask_BxN, axis=1, dtype=jnp.int32) - 1
  hidden_BxNxD, _ = forward(graphdef, params, resp_BxN[:, :-1], pos_BxN[:, :-1],
                            resp_mask_BxN[:, :-1], prefix=kv, prefix_repeat=group_size,
                            return_hidden=True, **image_inputs.sequence_kwargs(
                                graphdef, params, batch, resp_BxN[:, :-1],
                                start=prompt_GxP.shape[1]))
  return jnp.concatenate([first_BxD[:, None], hidden_BxNxD], axis=1)


UNGROUPED = ("{where}: the batch's rows are not in groups of consecutive rows with one prompt, "
             "which model.share_prompt_prefix=True needs (nothing was updated); keep each "
             "prompt's rollout.n samples together and in order, or set "
             "model.share_prompt_prefix=False")


def prompts_grouped(batch: Batch, group_size: int) -> jax.Array:
  """Scalar bool: each block of `group_size` consecutive rows has one prompt (tokens and mask)."""
  def same(x):
    x = x.reshape(-1, group_size, *x.shape[1:])
    return jnp.all(x == x[:, :1])
  return same(batch[PROMPT_TOKENS]) & same(batch[PROMPT_MASK])


def _response_hidden_packed(graphdef: nnx.GraphDef, params: nnx.State, batch: Batch
                            ) -> jax.Array:
  """`_response_hidden_plain` over packed rows (see "Packed rows")."""
  pack = batch["pack"]
  tokens, positions, seg = packing.packed_inputs(batch, pack)
  hidden, _ = forward(graphdef, params, tokens, positions, seg > 0, return_hidden=True,
                      segment_ids_BxT=seg)
  return packing.unpack(hidden, pack["out"])


PACK_IMAGES = ("model.pack_sequences=True does not take images yet; set "
               "model.pack_sequences=False for a vision-language run")


def response_hidden(graphdef: nnx.GraphDef, params: nnx.State, batch: Batch,
                    group_size: int = 1) -> jax.Array:
  """Hidden states predicting each response token, ``[B, N, D]`` (see "Shared prompts")."""
  if "pack" in batch:  # a shared-prompt plan lays each group's prompt once itself
    if image_inputs.has_images(batch):
      raise ValueError(PACK_IMAGES)
    return _response_hidden_packed(graphdef, params, batch)
  if group_size <= 1:
    return _response_hidden_plain(graphdef, params, batch)
  b = batch[PROMPT_TOKENS].shape[0]
  if b % group_size:
    raise ValueError(f"shared prompts: {b} rows are not whole groups of {group_size}")
  return _response_hidden_shared(graphdef, params, batch, group_size)
