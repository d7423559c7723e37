"""Images in the sequence passes: precomputed vision features merged into the text model.

A batch with images carries three more sample-leading fields (made once per prompt by the
generate node, state/vision.py, and moved with their samples by every re-partition):

* ``image_embeds`` ``[B, I, D]``: the frozen vision tower's features of the sample's
  images, in reading order (I = image placeholder tokens per sample, the same for every
  sample of a batch);
* ``image_slots`` ``[B, P]`` bool: where the prompt's image placeholders sit;
* ``rope_positions`` ``[B, 3, P + N]`` int32: Qwen2-VL's multimodal RoPE positions of
  ``prompt ++ response`` (models/vl.py ``rope_index`` for the prompt; response token t at
  ``real prompt length + t + rope delta`` on all three rows).

The passes embed the tokens as usual, replace the placeholders' embeddings by the features
(``merge_row_features``) and run the text decoder with the multimodal positions, so the
numbers are those of ``VLModel`` on the same pixels (tests/test_vl_passes.py).  The
features are data, not parameters: no gradient reaches the (frozen) tower.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from distflow_jax.data.fields import IMAGES, IMAGE_EMBEDS, IMAGE_SLOTS, ROPE_POSITIONS



def has_images(batch: Mapping[str, Any]) -> bool:
  return IMAGE_EMBEDS in batch


def merge_row_features(embeds_BxTxD: jax.Array, slots_BxT: jax.Array,
                       feats_BxIxD: jax.Array) -> jax.Array:
  """Row b's k-th slot takes ``feats_BxIxD[b, k]``; other positions keep their embedding."""
  slots_BxT = slots_BxT.astype(bool)
  idx_BxT = jnp.clip(jnp.cumsum(slots_BxT, axis=1) - 1, 0, feats_BxIxD.shape[1] - 1)
  picked_BxTxD = jnp.take_along_axis(feats_BxIxD.astype(embeds_BxTxD.dtype),
                                     idx_BxT[..., None], axis=1)
  return jnp.where(slots_BxT[..., None], picked_BxTxD, embeds_BxTxD)


def sequence_kwargs(graphdef: nnx.GraphDef, params: nnx.State, batch: Mapping[str, Any],
                    tokens_BxT: jax.Array, start: int = 0) -> dict[str, jax.Array]:
  """`forward`'s multimodal keywords for ``tokens_BxT``, the columns ``start ..
  start + T`` of ``prompt ++ response``; ``{}`` for a text-only batch."""
  if not has_images(batch):
    return {}
  t = tokens_BxT.shape[1]
  b, p = batch[IMAGE_SLOTS].shape
  slots_BxS = jnp.concatenate(
      [batch[IMAGE_SLOTS].astype(bool),
       jnp.zeros((b, batch[ROPE_POSITIONS].shape[2] - p), bool)], axis=1)
  embeds = nnx.merge(graphdef, params).embed(tokens_BxT)
  merged = merge_row_features(embeds, slots_BxS[:, start:start + t], batch[IMAGE_EMBEDS])
  rope_3xBxT = jnp.moveaxis(batch[ROPE_POSITIONS][:, :, start:start + t], 1, 0)
  return {"inputs_embeds_BxTxD": merged, "rope_positions_3xBxT": rope_3xBxT}


def group_rows(batch: Mapping[str, Any], group_size: int) -> dict[str, jax.Array]:
  """The image fields of each group's first row (shared prompts: one prompt per group)."""
  return {k: batch[k][::group_size] for k in IMAGES if k in batch}
