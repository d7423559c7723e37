"""Qwen2.5-VL (`Qwen2_5_VLForConditionalGeneration`) in Flax NNX: vision tower + Qwen2 decoder.

    model = load_vl_pretrained("/ckpt/qwen2.5-vl", dtype="float32")
    inputs = vl_inputs(model.cfg, tokens_BxT, image_grid_thw, mask_BxT)   # host, numpy
    logits_BxTxV, _ = model(tokens_BxT, inputs.positions_BxT, mask_BxT,
                            pixel_values=pixel_values_NxK, layout=inputs.layout,
                            rope_positions_3xBxT=inputs.rope_positions_3xBxT)
    save_vl_pretrained("/out/vl", model)        # loads in transformers

Decoding with a KV cache (`transformer.init_cache(cfg.text, B, S)`): prefill the prompt
as above with `cache=..., cache_index_B=...`; a later text token of row b at token
position p (its masking position) takes RoPE position `p + inputs.rope_deltas_B[b]` on
all three rows (tests/test_vl_parity.py::test_greedy_with_kv_cache_matches).

Each run of `image_token_id` placeholders in the prompt is replaced, in order, by the
vision tower's features of the next image of `image_grid_thw` (t * h * w / m^2
placeholders per image, m = spatial_merge_size, as Hugging Face's processor writes
them).  The language model is the text `Transformer` (qwen2: q/k/v biases) run on those
embeddings with Qwen2-VL's multimodal RoPE: `vl_inputs` computes the `[3, B, T]`
(temporal, height, width) positions as HF's `get_rope_index` does for text + images
(text tokens count on from the last position, all three rows equal; an image's tokens sit
at (start + t, start + row, start + column); the text after an image continues at
start + max(rows, columns)), while masking follows the token order
(`positions_BxT`), so left/right padding work as in transformer.py.

Images only: video inputs (`video_token_id`, temporal position scaling by
`tokens_per_second`) are not implemented and are refused.  Any number of images per
sample works; each image must be one contiguous run of placeholders.

Checkpoints: `config.json` as transformers writes it (`text_config` / `vision_config`,
or the older flat layout with text keys at the top), tensors named as on the Hub
(`model.layers.*`, `model.embed_tokens.weight`, `visual.*`, `lm_head.weight`); the
`model.language_model.*` / `model.visual.*` names are read too.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from distflow_jax.models import hf_export, hf_files, hf_io
from distflow_jax.models.config import DTYPES, ModelConfig
from distflow_jax.models.errors import ModelFileError
from distflow_jax.models.kv_cache import positions_from_mask
from distflow_jax.models.sharding import Rules
from distflow_jax.models.transformer import Transformer
from distflow_jax.models.vision import VisionConfig, VisionLayout, VisionTower, vision_layout

HF_ARCH = "Qwen2_5_VLForConditionalGeneration"


@dataclasses.dataclass(frozen=True)
class VLConfig:
  """Qwen2.5-VL: the text decoder's `ModelConfig` (qwen2, with `mrope_section`), the
  vision tower's `VisionConfig` and the special token ids."""
  text: ModelConfig
  vision: VisionConfig
  image_token_id: int = 151655
  video_token_id: int = 151656
  vision_start_token_id: int = 151652
  vision_end_token_id: int = 151653

  def __post_init__(self):
    if not self.text.mrope_section:
      raise ValueError("VLConfig.text needs mrope_section (Qwen2-VL's multimodal RoPE)")
    if self.vision.out_hidden_size != self.text.hidden_size:
      raise ValueError(f"VLConfig: vision out_hidden_size={self.vision.out_hidden_size} must "
                       f"equal the text hidden_size={self.text.hidden_size}")
    if not 0 <= self.image_token_id < self.text.vocab_size:
      raise ValueError(f"VLConfig.image_token_id={self.image_token_id} is outside the "
                       f"vocabulary ({self.text.vocab_size})")

  @classmethod
  def from_hf_dict(cls, d: dict[str, Any], dtype: str | None = None) -> "VLConfig":
    """From a `Qwen2_5_VLForConditionalGeneration` config.json dictionary."""
    archs = d.get("architectures") or []
    if d.get("model_type") != "qwen2_5_vl" and HF_ARCH not in archs:
      raise ValueError(f"not a Qwen2.5-VL config: architectures={archs}, "
                       f"model_type={d.get('model_type')!r}")
    text = d.get("text_config") or d
    rope = (text.get("rope_parameters") or text.get("rope_scaling") or d.get("rope_scaling")
            or {})
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ("default", "mrope"):
      raise ValueError(f"qwen2_5_vl: RoPE scaling {rope_type!r} is not supported")
    if text.get("use_sliding_window"):
      raise ValueError("qwen2_5_vl: use_sliding_window=True is not supported")
    if text.get("hidden_act", "silu") != "silu":
      raise ValueError(f"qwen2_5_vl: hidden_act={text.get('hidden_act')!r} is not supported")
    hf_dtype = d.get("dtype") or d.get("torch_dtype") or text.get("dtype") or "float32"
    if dtype is None:
      dtype = hf_dtype if hf_dtype in DTYPES else "float32"
    heads, hidden = text["num_attention_heads"], text["hidden_size"]
    head_dim = hidden // heads
    section = tuple(rope.get("mrope_section") or (16, 24, 24))
    tie = bool(d.get("tie_word_embeddings") or text.get("tie_word_embeddings"))
    text_cfg = ModelConfig(
        arch="qwen2", vocab_size=text["vocab_size"], hidden_size=hidden,
        intermediate_size=text["intermediate_size"], num_layers=text["num_hidden_layers"],
        num_heads=heads, num_kv_heads=text.get("num_key_value_heads") or heads,
        head_dim=head_dim,
        rope_theta=float(rope.get("rope_theta", text.get("rope_theta", 1000000.0))),
        rms_norm_eps=float(text.get("rms_norm_eps", 1e-6)), qkv_bias=True,
        tie_embeddings=tie, max_position_embeddings=text.get("max_position_embeddings", 32768),
        dtype=dtype, mrope_section=section)
    if "vision_config" not in d:
      raise KeyError("vision_config")
    ids = {k: d[k] for k in ("image_token_id", "video_token_id", "vision_start_token_id",
                             "vision_end_token_id") if k in d}
    return cls(text=text_cfg, vision=VisionConfig.from_hf_dict(d["vision_config"], dtype),
               **ids)

  def to_hf_dict(self) -> dict[str, Any]:
    """The config.json dictionary (transformers' nested layout)."""
    t = self.text
    text = {
        "model_type": "qwen2_5_vl_text", "vocab_size": t.vocab_size,
        "hidden_size": t.hidden_size, "intermediate_size": t.intermediate_size,
        "num_hidden_layers": t.num_layers, "num_attention_heads": t.num_heads,
        "num_key_value_heads": t.num_kv_heads, "hidden_act": "silu",
        "max_position_embeddings": t.max_position_embeddings, "rms_norm_eps": t.rms_norm_eps,
        "rope_parameters": {"rope_type": "default", "rope_theta": t.rope_theta,
                            "mrope_section": list(t.mrope_section)},
        "use_sliding_window": False, "attention_dropout": 0.0,
        "tie_word_embeddings": t.tie_embeddings, "dtype": t.dtype,
    }
    return {
        "architectures": [HF_ARCH], "model_type": "qwen2_5_vl", "text_config": text,
        "vision_config": self.vision.to_hf_dict(), "tie_word_embeddings": t.tie_embeddings,
        "image_token_id": self.image_token_id, "video_token_id": self.video_token_id,
        "vision_start_token_id": self.vision_start_token_id,
        "vision_end_token_id": self.vision_end_token_id, "dtype": t.dtype,
    }


class VLInputs(NamedTuple):
  """Host-side inputs of one VL call (from `vl_inputs`)."""
  positions_BxT: np.ndarray          # token order, for masking (0.. over real tokens)
  rope_positions_3xBxT: np.ndarray   # multimodal RoPE positions (0 at padding)
  rope_deltas_B: np.ndarray          # max rope position + 1 - real length (for decoding on)
  layout: VisionLayout | None        # the vision tower's layout of image_grid_thw


def rope_index(cfg: VLConfig, tokens_BxT: Any, image_grid_thw: Any = None,
               mask_BxT: Any = None) -> tuple[np.ndarray, np.ndarray]:
  """`([3, B, T] rope positions, [B] deltas)`, as HF's `get_rope_index` for text + images.

  The images of `image_grid_thw` are taken in order, row by row; raises ValueError when
  the placeholder runs and the grids disagree."""
  tokens = np.asarray(tokens_BxT)
  b, t = tokens.shape
  mask = np.ones((b, t), bool) if mask_BxT is None else np.asarray(mask_BxT, bool)
  grids = [] if image_grid_thw is None else [
      tuple(int(v) for v in g) for g in np.asarray(image_grid_thw).reshape(-1, 3)]
  m = cfg.vision.spatial_merge_size
  out = np.zeros((3, b, t), np.int64)
  deltas = np.zeros((b,), np.int64)
  nxt = 0
  for row in range(b):
    ids = tokens[row][mask[row]]
    if (ids == cfg.video_token_id).any():
      raise ValueError("qwen2_5_vl: video inputs (video_token_id) are not supported yet")
    pos = np.zeros((3, len(ids)), np.int64)
    cur = i = 0
    while i < len(ids):
      if ids[i] != cfg.image_token_id:
        j = i
        while j < len(ids) and ids[j] != cfg.image_token_id:
          j += 1
        pos[:, i:j] = cur + np.arange(j - i)
        cur += j - i
        i = j
        continue
      if nxt >= len(grids):
        raise ValueError(f"row {row}: more image placeholder runs than the {len(grids)} "
                         f"image(s) of image_grid_thw")
      gt, gh, gw = grids[nxt]
      lh, lw = gh // m, gw // m
      n = gt * lh * lw
      run = ids[i:i + n] == cfg.image_token_id
      if len(run) < n or not run.all():
        have = int(np.argmin(run)) if not run.all() else len(run)
        raise ValueError(f"row {row}: image {nxt} (grid {grids[nxt]}) needs {n} consecutive "
                         f"image tokens, the prompt has {have} there")
      tt, hh, ww = np.meshgrid(np.arange(gt), np.arange(lh), np.arange(lw), indexing="ij")
      pos[:, i:i + n] = cur + np.stack([tt.reshape(-1), hh.reshape(-1), ww.reshape(-1)])
      cur += max(lh, lw)
      i += n
      nxt += 1
    out[:, row, mask[row]] = pos
    deltas[row] = (pos.max() + 1 if len(ids) else 0) - len(ids)
  if nxt != len(grids):
    raise ValueError(f"image_grid_thw has {len(grids)} image(s), the prompts have "
                     f"placeholders for {nxt}")
  return out.astype(np.int32), deltas


def vl_inputs(cfg: VLConfig, tokens_BxT: Any, image_grid_thw: Any = None,
              mask_BxT: Any = None) -> VLInputs:
  """Everything a VL call needs besides tokens, mask and pixels (host-side, numpy)."""
  tokens = np.asarray(tokens_BxT)
  mask = np.ones(tokens.shape, bool) if mask_BxT is None else np.asarray(mask_BxT, bool)
  rope_pos, deltas = rope_index(cfg, tokens, image_grid_thw, mask)
  positions = np.asarray(positions_from_mask(jnp.asarray(mask)))
  layout = None if image_grid_thw is None else vision_layout(cfg.vision, image_grid_thw)
  return VLInputs(positions, rope_pos, deltas, layout)


def merge_image_features(tokens_BxT: jax.Array, embeds_BxTxD: jax.Array,
                         features_MxD: jax.Array, image_token_id: int) -> jax.Array:
  """The placeholders' embeddings replaced by the image features, in reading order."""
  b, t, d = embeds_BxTxD.shape
  is_img = (tokens_BxT == image_token_id).reshape(-1)
  idx = jnp.clip(jnp.cumsum(is_img) - 1, 0, features_MxD.shape[0] - 1)
  merged = jnp.where(is_img[:, None], features_MxD.astype(embeds_BxTxD.dtype)[idx],
                     embeds_BxTxD.reshape(b * t, d))
  return merged.reshape(b, t, d)


class VLModel(nnx.Module):
  """Qwen2.5-VL: `visual` (vision.VisionTower) + `language` (transformer.Transformer)."""

  def __init__(self, cfg: VLConfig, *, rngs: nnx.Rngs):
    self.cfg = cfg
    self.visual = VisionTower(cfg.vision, rngs=rngs)
    self.language = Transformer(cfg.text, rngs=rngs)

  def embed(self, tokens_BxT: jax.Array, pixel_values_NxK: jax.Array | None = None,
            layout: VisionLayout | None = None) -> jax.Array:
    """Token embeddings with every image placeholder replaced by its vision feature."""
    embeds = self.language.embed(tokens_BxT)
    if pixel_values_NxK is None:
      return embeds
    if layout is None:
      raise ValueError("VLModel: pixel_values need the layout of their image_grid_thw "
                       "(vl_inputs(...).layout)")
    feats = self.visual(pixel_values_NxK, layout)
    return merge_image_features(tokens_BxT, embeds, feats, self.cfg.image_token_id)

  def __call__(self, tokens_BxT: jax.Array, positions_BxT: jax.Array,
               mask_BxT: jax.Array | None = None, *, pixel_values: jax.Array | None = None,
               layout: VisionLayout | None = None,
               rope_positions_3xBxT: jax.Array | None = None, **kwargs: Any):
    """`(logits or hidden, cache)` like `Transformer.__call__` (its keyword options pass
    through); without `rope_positions_3xBxT` every row uses `positions_BxT` (text only)."""
    if rope_positions_3xBxT is None:
      rope_positions_3xBxT = jnp.broadcast_to(positions_BxT, (3,) + positions_BxT.shape)
    embeds = self.embed(tokens_BxT, pixel_values, layout)
    return self.language(None, positions_BxT, mask_BxT, inputs_embeds_BxTxD=embeds,
                         rope_positions_3xBxT=rope_positions_3xBxT, **kwargs)


def vl_forward(graphdef: nnx.GraphDef, params: nnx.State, tokens_BxT: jax.Array,
               positions_BxT: jax.Array, mask_BxT: jax.Array | None = None, **kwargs: Any):
  """Pure forward over `nnx.split(vl_model)` (jit-safe; `layout` may be traced arrays)."""
  return nnx.merge(graphdef, params)(tokens_BxT, positions_BxT, mask_BxT, **kwargs)


# --------------------------------------------------------------------------
# Hugging Face checkpoints.

def vl_hf_name(path: str) -> tuple[str, bool]:
  """(HF tensor name, stored transposed?) of a `VLModel` parameter path."""
  if path.startswith("language/"):
    return hf_io.hf_name(path[len("language/"):])
  if not path.startswith("visual/"):
    raise ValueError(f"parameter {path!r} has no Hugging Face name")
  if path == "visual/patch_embed/proj":
    return "visual.patch_embed.proj.weight", False
  name = path.replace("merger/mlp/1/", "merger/mlp/2/")  # HF: Linear, GELU, Linear
  for ours, theirs in (("/kernel", ".weight"), ("/scale", ".weight"), ("/bias", ".bias")):
    name = name.replace(ours, theirs)
  return name.replace("/", "."), path.endswith("/kernel")


def _hub_name(name: str) -> str:
  """transformers' in-memory names (`model.language_model.*`, `model.visual.*`) -> the
  Hub checkpoint's (`model.*`, `visual.*`)."""
  if name.startswith("model.language_model."):
    return "model." + name[len("model.language_model."):]
  if name.startswith("model.visual."):
    return name[len("model."):]
  return name


def read_vl_config(path: str | os.PathLike, dtype: str | None = None) -> VLConfig:
  cfg_file, d = hf_files.hf_config_dict(path)
  try:
    return VLConfig.from_hf_dict(d, dtype)
  except KeyError as e:
    raise ModelFileError(f"{cfg_file}: missing required key {e.args[0]!r}") from None
  except (ValueError, TypeError, AttributeError) as e:
    raise ModelFileError(f"{cfg_file}: {e}") from None


def load_vl_pretrained(path: str | os.PathLike, mesh: Mesh | None = None,
                       rules: Rules | None = None, dtype: str | None = None,
                       cfg: VLConfig | None = None) -> VLModel:
  """Loads a Qwen2.5-VL safetensors checkpoint; a missing, misshapen or unexpected tensor
  is a one-line `ModelFileError` naming it and the file."""
  hf_files.weight_files(Path(path))
  cfg = cfg or read_vl_config(path, dtype)
  ignorable = ("lm_head.weight",) if cfg.text.tie_embeddings else ()
  return hf_io._load_module(  # pylint: disable=protected-access
      Path(path), lambda: VLModel(cfg, rngs=nnx.Rngs(0)), vl_hf_name, mesh, rules, ignorable,
      f"a qwen2_5_vl model with {cfg.text.num_layers} text layers and "
      f"{cfg.vision.depth} vision blocks", alias=_hub_name)


def save_vl_pretrained(path: str | os.PathLike, model: VLModel,
                       extra_config: dict[str, Any] | None = None) -> None:
  """Writes `config.json` + `model.safetensors` (Hub tensor names) for transformers'
  `Qwen2_5_VLForConditionalGeneration`.  Collective, like `hf_io.save_pretrained`."""
  state = hf_io.export_state_dict(model, vl_hf_name)
  if jax.process_index() != 0:
    return
  path = Path(path)
  path.mkdir(parents=True, exist_ok=True)
  hf_cfg = model.cfg.to_hf_dict()
  hf_cfg.update(extra_config or {})
  (path / "config.json").write_text(json.dumps(hf_cfg, indent=2, sort_keys=True) + "\n")
  hf_export.write_safetensors(path, state)
