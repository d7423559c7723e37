"""The frozen vision tower of a vision-language run, and the image fields of a batch.

Where features are computed: once per prompt, by the generate node on the host that
sampled it (`VisionEncoder.features`), before its `rollout.n` samples are made; the
samples then carry them as ordinary `[B, ...]` batch fields (train/image_inputs.py), so
every re-partition moves a sample's features with it.  Recomputing them where a sample
lands would run the tower again in the log-prob, reference and every train pass.

The tower is frozen in this slice (`model.train_vision=True` is refused): its features
are data to the text decoder, the actor and reference roles hold only the decoder.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from distflow_jax.config import vision_checks
from distflow_jax.config.errors import ConfigError
from distflow_jax.data.fields import IMAGE_EMBEDS, IMAGE_SLOTS, ROPE_POSITIONS
from distflow_jax.models.config import ModelConfig
from distflow_jax.models.vision import VisionTower, vision_layout
from distflow_jax.models.vl import HF_ARCH, VLConfig, load_vl_pretrained, read_vl_config, rope_index
from distflow_jax.rollout.images import PromptImages

SAME_GRID = ("images: every image of a run must have the same grid in this version "
             "(sample {a} has {ga}, sample {b} has {gb}); use one image size (e.g. one "
             "level of builtin:shapes)")


def _tower_forward(graphdef: nnx.GraphDef, params: nnx.State, pixels_NxK, layout):
  return nnx.merge(graphdef, params)(pixels_NxK, layout)


@dataclasses.dataclass
class VisionEncoder:
  """The frozen tower (split: graphdef + params) and the VL special tokens."""
  cfg: VLConfig
  graphdef: nnx.GraphDef
  params: nnx.State

  @classmethod
  def from_tower(cls, cfg: VLConfig, tower: VisionTower) -> "VisionEncoder":
    graphdef, params = nnx.split(tower)
    return cls(cfg, graphdef, params)

  def __post_init__(self):
    self._fwd = jax.jit(_tower_forward, static_argnums=0)

  def features(self, pixel_values_NxK: Any, grid_thw_Gx3: Any) -> np.ndarray:
    """`[M, D]` float32 features of one prompt's images (M = its placeholder count)."""
    layout = vision_layout(self.cfg.vision, np.asarray(grid_thw_Gx3).reshape(-1, 3))
    out = self._fwd(self.graphdef, self.params, np.asarray(pixel_values_NxK, np.float32),
                    layout)
    return np.asarray(out, np.float32)


def rope_fields(cfg: VLConfig, prompt_tokens_BxP: np.ndarray, prompt_mask_BxP: np.ndarray,
                grids: Sequence[Any], n_new: int) -> np.ndarray:
  """`[B, 3, P + N]` int32 multimodal positions of `prompt ++ response` (left-padded
  prompts; `grids[b]`: row b's `[G, 3]` image grids): the prompt's from `rope_index`,
  response token t at `real prompt length + t + rope delta` on all three rows."""
  mask = np.asarray(prompt_mask_BxP, bool)
  all_grids = np.concatenate([np.asarray(g).reshape(-1, 3) for g in grids], axis=0)
  pos_3xBxP, deltas_B = rope_index(cfg, prompt_tokens_BxP, all_grids, mask)
  resp_BxN = mask.sum(axis=1)[:, None] + np.arange(n_new)[None] + deltas_B[:, None]
  resp_3xBxN = np.broadcast_to(resp_BxN, (3,) + resp_BxN.shape)
  return np.moveaxis(np.concatenate([pos_3xBxP, resp_3xBxN], axis=2), 0, 1).astype(np.int32)


def image_fields(cfg: VLConfig, feats: Sequence[np.ndarray], prompt_tokens_BxP: np.ndarray,
                 prompt_mask_BxP: np.ndarray, grids: Sequence[Any], n_new: int
                 ) -> dict[str, np.ndarray]:
  """The batch's `image_embeds` `[B, I, D]`, `image_slots` `[B, P]`, `rope_positions`
  `[B, 3, P + N]` (train/image_inputs.py) from each row's features and grids."""
  for b, g in enumerate(grids):
    if np.asarray(g).reshape(-1, 3).tolist() != np.asarray(grids[0]).reshape(-1, 3).tolist():
      raise ValueError(SAME_GRID.format(a=0, ga=np.asarray(grids[0]).tolist(), b=b,
                                        gb=np.asarray(g).tolist()))
  tokens = np.asarray(prompt_tokens_BxP)
  slots = (tokens == cfg.image_token_id) & np.asarray(prompt_mask_BxP, bool)
  return {IMAGE_EMBEDS: np.stack([np.asarray(f, np.float32) for f in feats]),
          IMAGE_SLOTS: slots,
          ROPE_POSITIONS: rope_fields(cfg, tokens, prompt_mask_BxP, grids, n_new)}


def prompt_images(cfg: VLConfig, feats: Sequence[np.ndarray], prompts: Sequence[np.ndarray],
                  grids: Sequence[Any]) -> PromptImages:
  """The rollout backend's view of unpadded prompts with their features and grids."""
  slots, rope, deltas = [], [], []
  for p, g in zip(prompts, grids):
    pos_3x1xL, delta_1 = rope_index(cfg, np.asarray(p)[None], np.asarray(g).reshape(-1, 3))
    slots.append(np.asarray(p) == cfg.image_token_id)
    rope.append(pos_3x1xL[:, 0])
    deltas.append(int(delta_1[0]))
  return PromptImages(np.stack([np.asarray(f, np.float32) for f in feats]), slots, rope,
                      np.asarray(deltas, np.int64))


def is_vl_checkpoint(path: str) -> bool:
  """Whether `path`'s config.json is a Qwen2.5-VL one (architectures / model_type)."""
  cfg_file = os.path.join(path or "", "config.json")
  if not path or not os.path.isfile(cfg_file):
    return False
  try:
    with open(cfg_file, encoding="utf-8") as f:
      d = json.load(f)
  except (OSError, ValueError):  # unreadable: the model loader names the problem in one line
    return False
  if not isinstance(d, dict):
    return False
  archs = d.get("architectures")
  return (isinstance(archs, list) and HF_ARCH in archs) or d.get("model_type") == "qwen2_5_vl"


def load_language(path: str, text_cfg: ModelConfig, mesh: Mesh | None = None,
                  rules: Any = None) -> nnx.Module:
  """The text decoder of a Qwen2.5-VL checkpoint (the actor), placed on `mesh`; `text_cfg`
  is its config with the run's levers (roles.model_config).  The tower is loaded apart
  (`load_encoder`), process-local, since each host runs it on its own prompts' pixels; this
  slice reads the checkpoint twice for that."""
  cfg = dataclasses.replace(read_vl_config(path, text_cfg.dtype), text=text_cfg)
  return load_vl_pretrained(path, mesh=mesh, rules=rules, cfg=cfg).language


def load_encoder(path: str, dtype: str | None = None) -> VisionEncoder:
  """The frozen tower of a Qwen2.5-VL checkpoint, on this process's default device."""
  model = load_vl_pretrained(path, dtype=dtype)
  return VisionEncoder.from_tower(model.cfg, model.visual)


def batch_images(enc: VisionEncoder, hosts: Sequence[Any], prompts: Sequence[np.ndarray]
                 ) -> tuple[list[np.ndarray], list[np.ndarray]]:
  """`(features, grids)` of each prompt from its host fields (the loader's `pixel_values` /
  `image_grid_thw`), the tower run once per prompt."""
  feats, grids = [], []
  for q, host in enumerate(hosts):
    if not host or "pixel_values" not in host:
      raise ValueError(f"prompt {q} has no image (host field 'pixel_values'): a "
                       f"vision-language run needs data.image_key set and every row to "
                       f"hold an image")
    feats.append(enc.features(host["pixel_values"], host["image_grid_thw"]))
    grids.append(np.asarray(host["image_grid_thw"]).reshape(-1, 3))
  return feats, grids


def run_encoder(cfg: Any, model_path: str) -> VisionEncoder | None:
  """The run's frozen tower: loaded when its data has images (config/vision_checks.py),
  None for a text-only run; images with a text-only model are refused (ConfigError)."""
  key = vision_checks.run_image_key(cfg)
  if not key:
    return None
  if not is_vl_checkpoint(model_path):
    raise ConfigError(f"the run's rows carry images (field {key!r}) but model.path="
                      f"{model_path!r} is not a Qwen2.5-VL checkpoint (config.json "
                      f"architectures); point model.path at one")
  return load_encoder(model_path, cfg.model.dtype)
