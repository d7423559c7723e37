"""Qwen2.5-VL's vision tower in Flax NNX: pixels -> one feature per merged patch group.

    vcfg = VisionConfig(...)                        # or VLConfig.from_hf_dict(...).vision
    tower = VisionTower(vcfg, rngs=nnx.Rngs(0))
    layout = vision_layout(vcfg, grid_thw)          # numpy, from the (static) image grids
    feats_MxO = tower(pixel_values_NxK, layout)     # M = N / spatial_merge_size**2

Inputs are what Hugging Face's Qwen2.5-VL image processor gives: `pixel_values`
`[N, C * Tp * P * P]`, the patches of every image one after another, each image's
patches in spatial-merge-block order (the m x m patches of one merged token
consecutive), and `image_grid_thw` `[n_images, 3]` (frames / Tp, rows and columns of
patches).

The maths, in order:

* patch embedding: the Conv3d over `Tp x P x P` with stride = kernel is a linear map of
  each flattened patch (weight kept in the checkpoint's `[E, C, Tp, P, P]` layout);
* window order: merged groups are permuted so each window of
  `window_size / spatial_merge_size / patch_size` merged groups per side is contiguous
  (`vision_layout(...).window_index`), and un-permuted after the merger;
* 2-D RoPE: a head's first dh / 4 frequencies are rotated by the patch's row, the next
  dh / 4 by its column (then repeated: "rotate half" over the whole head);
* blocks: RMSNorm -> attention (qkv with bias; within a window, or within a whole frame
  for blocks in `fullatt_block_indexes`) -> RMSNorm -> SwiGLU MLP with biases;
* merger: RMSNorm, the m*m patches of a group concatenated, Linear -> GELU -> Linear to
  `out_hidden_size` (the language model's width).

Attention is a dense masked softmax over all patches of the call (segment ids from the
window / frame boundaries): exact, O(N^2) memory; fine for a few images of moderate size.
Parameter names mirror the checkpoint's `visual.*` tensors (see vl.vl_hf_name).
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from distflow_jax.models.attention import rotate
from distflow_jax.models.layers import INIT, RMSNorm

_MASK_VALUE = -1e30
_VISION_EPS = 1e-6  # Qwen2.5-VL's vision RMSNorms (blocks and merger) use a fixed eps


@dataclasses.dataclass(frozen=True)
class VisionConfig:
  """Shape of Qwen2.5-VL's vision tower (HF `vision_config`)."""
  depth: int = 2
  hidden_size: int = 32
  intermediate_size: int = 64
  num_heads: int = 4
  in_channels: int = 3
  patch_size: int = 14
  temporal_patch_size: int = 2
  spatial_merge_size: int = 2
  window_size: int = 112
  out_hidden_size: int = 64
  fullatt_block_indexes: tuple[int, ...] = ()
  rope_theta: float = 10000.0
  tokens_per_second: int = 4
  dtype: str = "float32"

  def __post_init__(self):
    for name in ("depth", "hidden_size", "intermediate_size", "num_heads", "in_channels",
                 "patch_size", "temporal_patch_size", "spatial_merge_size", "window_size",
                 "out_hidden_size"):
      value = getattr(self, name)
      if not isinstance(value, int) or value <= 0:
        raise ValueError(f"VisionConfig.{name}={value!r} must be a positive int")
    if self.hidden_size % self.num_heads or (self.hidden_size // self.num_heads) % 4:
      raise ValueError(f"VisionConfig: hidden_size={self.hidden_size} / num_heads="
                       f"{self.num_heads} must be a head dim divisible by 4 (2-D RoPE)")
    if self.window_size // self.spatial_merge_size // self.patch_size < 1:
      raise ValueError(f"VisionConfig.window_size={self.window_size} is smaller than one "
                       f"merged patch group ({self.spatial_merge_size} x {self.patch_size} px)")
    bad = [i for i in self.fullatt_block_indexes if not 0 <= i < self.depth]
    if bad:
      raise ValueError(f"VisionConfig.fullatt_block_indexes {bad} are not blocks of a "
                       f"depth-{self.depth} tower")

  @property
  def head_dim(self) -> int:
    return self.hidden_size // self.num_heads

  @property
  def patch_dim(self) -> int:
    return self.in_channels * self.temporal_patch_size * self.patch_size ** 2

  @property
  def jnp_dtype(self) -> Any:
    return jnp.dtype(self.dtype)

  @classmethod
  def from_hf_dict(cls, d: dict[str, Any], dtype: str = "float32") -> "VisionConfig":
    act = d.get("hidden_act", "silu")
    if act != "silu":
      raise ValueError(f"qwen2_5_vl vision_config: hidden_act={act!r} is not supported "
                       f"(only 'silu')")
    rope = d.get("rope_parameters") or {}
    return cls(
        depth=d["depth"], hidden_size=d["hidden_size"],
        intermediate_size=d["intermediate_size"], num_heads=d["num_heads"],
        in_channels=d.get("in_channels", 3), patch_size=d.get("patch_size", 14),
        temporal_patch_size=d.get("temporal_patch_size", 2),
        spatial_merge_size=d.get("spatial_merge_size", 2),
        window_size=d.get("window_size", 112), out_hidden_size=d["out_hidden_size"],
        fullatt_block_indexes=tuple(d.get("fullatt_block_indexes", ())),
        rope_theta=float(rope.get("rope_theta", d.get("rope_theta", 10000.0))),
        tokens_per_second=d.get("tokens_per_second", 4), dtype=dtype)

  def to_hf_dict(self) -> dict[str, Any]:
    return {
        "model_type": "qwen2_5_vl", "depth": self.depth, "hidden_size": self.hidden_size,
        "hidden_act": "silu", "intermediate_size": self.intermediate_size,
        "num_heads": self.num_heads, "in_channels": self.in_channels,
        "patch_size": self.patch_size, "temporal_patch_size": self.temporal_patch_size,
        "spatial_merge_size": self.spatial_merge_size, "window_size": self.window_size,
        "out_hidden_size": self.out_hidden_size,
        "fullatt_block_indexes": list(self.fullatt_block_indexes),
        "tokens_per_second": self.tokens_per_second,
        "rope_theta": self.rope_theta,
    }


class VisionLayout(NamedTuple):
  """Everything the tower needs from the image grids, computed on the host (numpy).

  `window_index_M` is the window order of the merged groups (un-permuted by its argsort);
  `window_seg_N` / `frame_seg_N` are each patch's window / frame id in that order (window
  and full attention); `rows_N` / `cols_N` its row / column in its image, in that order."""
  window_index_M: np.ndarray
  window_seg_N: np.ndarray
  frame_seg_N: np.ndarray
  rows_N: np.ndarray
  cols_N: np.ndarray


def _grids(grid_thw: Any) -> list[tuple[int, int, int]]:
  arr = np.asarray(grid_thw, dtype=np.int64).reshape(-1, 3)
  return [tuple(int(v) for v in row) for row in arr]


def vision_layout(vcfg: VisionConfig, grid_thw: Any) -> VisionLayout:
  """The window permutation, attention segments and 2-D positions of the patches of
  `grid_thw` (`[n_images, 3]`: frames, rows, columns of patches)."""
  m = vcfg.spatial_merge_size
  unit = m * m
  win = vcfg.window_size // m // vcfg.patch_size  # merged groups per window side
  window_index, window_seg_M, rows, cols, frame_of_patch = [], [], [], [], []
  offset = n_windows = n_frames = 0
  for img, (t, h, w) in enumerate(_grids(grid_thw)):
    if min(t, h, w) <= 0 or h % m or w % m:
      raise ValueError(f"image {img}: grid (t, h, w)={(t, h, w)} must be positive with h, w "
                       f"multiples of spatial_merge_size={m}")
    lh, lw = h // m, w // m
    # Row / column of every patch, in the processor's block-major order, for every frame.
    r, c = (z.reshape(lh, m, lw, m).transpose(0, 2, 1, 3).reshape(-1)
            for z in np.meshgrid(np.arange(h), np.arange(w), indexing="ij"))
    rows.append(np.tile(r, t))
    cols.append(np.tile(c, t))
    frame_of_patch.append(n_frames + np.repeat(np.arange(t), h * w))
    n_frames += t
    # Windows of win x win merged groups, row-major over windows, per frame.
    group = np.arange(t * lh * lw).reshape(t, lh, lw)
    for f in range(t):
      for wr in range(0, lh, win):
        for wc in range(0, lw, win):
          ids = group[f, wr:wr + win, wc:wc + win].reshape(-1)
          window_index.append(ids + offset)
          window_seg_M.append(np.full(ids.shape, n_windows))
          n_windows += 1
    offset += t * lh * lw
  window_index_M = np.concatenate(window_index)
  rows_N, cols_N = np.concatenate(rows), np.concatenate(cols)
  frame_N = np.concatenate(frame_of_patch)
  # Patch p of merged group g sits at g * unit + p; permute whole groups.
  patch_perm = (window_index_M[:, None] * unit + np.arange(unit)).reshape(-1)
  return VisionLayout(
      window_index_M=window_index_M.astype(np.int32),
      window_seg_N=np.repeat(np.concatenate(window_seg_M), unit).astype(np.int32),
      frame_seg_N=frame_N[patch_perm].astype(np.int32),
      rows_N=rows_N[patch_perm].astype(np.int32), cols_N=cols_N[patch_perm].astype(np.int32))


def _linear(vcfg: VisionConfig, d_in: int, d_out: int, rngs: nnx.Rngs) -> nnx.Linear:
  return nnx.Linear(d_in, d_out, use_bias=True, dtype=vcfg.jnp_dtype,
                    param_dtype=vcfg.jnp_dtype, kernel_init=INIT, rngs=rngs)


class PatchEmbed(nnx.Module):
  def __init__(self, vcfg: VisionConfig, rngs: nnx.Rngs):
    self.vcfg = vcfg
    shape = (vcfg.hidden_size, vcfg.in_channels, vcfg.temporal_patch_size, vcfg.patch_size,
             vcfg.patch_size)
    self.proj = nnx.Param(INIT(rngs.params(), shape, vcfg.jnp_dtype))

  def __call__(self, pixels_NxK: jax.Array) -> jax.Array:
    w_ExK = self.proj[...].reshape(self.vcfg.hidden_size, -1)
    return jnp.einsum("nk,ek->ne", pixels_NxK.astype(w_ExK.dtype), w_ExK)


class VisionAttention(nnx.Module):
  def __init__(self, vcfg: VisionConfig, rngs: nnx.Rngs):
    self.vcfg = vcfg
    self.qkv = _linear(vcfg, vcfg.hidden_size, 3 * vcfg.hidden_size, rngs)
    self.proj = _linear(vcfg, vcfg.hidden_size, vcfg.hidden_size, rngs)

  def __call__(self, x_NxE, angles_NxF, seg_N):
    n = x_NxE.shape[0]
    h, dh = self.vcfg.num_heads, self.vcfg.head_dim
    q, k, v = jnp.moveaxis(self.qkv(x_NxE).reshape(n, 3, h, dh), 1, 0)
    # rotate() takes [B, T, H, Dh]: one row of N patches.
    q, k = (rotate(z[None], angles_NxF[None])[0] for z in (q, k))
    scores_HxNxN = jnp.einsum("nhd,mhd->hnm", q, k,
                              preferred_element_type=jnp.float32) * (dh ** -0.5)
    scores_HxNxN = jnp.where((seg_N[:, None] == seg_N[None, :])[None], scores_HxNxN,
                             _MASK_VALUE)
    probs = jax.nn.softmax(scores_HxNxN, axis=-1).astype(v.dtype)
    out = jnp.einsum("hnm,mhd->nhd", probs, v)
    return self.proj(out.reshape(n, h * dh))


class VisionMLP(nnx.Module):
  def __init__(self, vcfg: VisionConfig, rngs: nnx.Rngs):
    d, f = vcfg.hidden_size, vcfg.intermediate_size
    self.gate_proj = _linear(vcfg, d, f, rngs)
    self.up_proj = _linear(vcfg, d, f, rngs)
    self.down_proj = _linear(vcfg, f, d, rngs)

  def __call__(self, x):
    return self.down_proj(jax.nn.silu(self.gate_proj(x)) * self.up_proj(x))


class VisionBlock(nnx.Module):
  def __init__(self, vcfg: VisionConfig, rngs: nnx.Rngs):
    self.norm1 = RMSNorm(vcfg.hidden_size, _VISION_EPS, vcfg.jnp_dtype)
    self.attn = VisionAttention(vcfg, rngs)
    self.norm2 = RMSNorm(vcfg.hidden_size, _VISION_EPS, vcfg.jnp_dtype)
    self.mlp = VisionMLP(vcfg, rngs)

  def __call__(self, x_NxE, angles_NxF, seg_N):
    x_NxE = x_NxE + self.attn(self.norm1(x_NxE), angles_NxF, seg_N)
    return x_NxE + self.mlp(self.norm2(x_NxE))


class PatchMerger(nnx.Module):
  def __init__(self, vcfg: VisionConfig, rngs: nnx.Rngs):
    self.width = vcfg.hidden_size * vcfg.spatial_merge_size ** 2
    self.ln_q = RMSNorm(vcfg.hidden_size, _VISION_EPS, vcfg.jnp_dtype)
    self.mlp = nnx.List([_linear(vcfg, self.width, self.width, rngs),
                         _linear(vcfg, self.width, vcfg.out_hidden_size, rngs)])

  def __call__(self, x_NxE):
    x_MxW = self.ln_q(x_NxE).reshape(-1, self.width)
    return self.mlp[1](jax.nn.gelu(self.mlp[0](x_MxW), approximate=False))


class VisionTower(nnx.Module):
  """Qwen2.5-VL's vision transformer + patch merger: `[N, K]` pixels -> `[N / m^2, O]`."""

  def __init__(self, vcfg: VisionConfig, *, rngs: nnx.Rngs):
    self.vcfg = vcfg
    self.patch_embed = PatchEmbed(vcfg, rngs)
    self.blocks = nnx.List([VisionBlock(vcfg, rngs) for _ in range(vcfg.depth)])
    self.merger = PatchMerger(vcfg, rngs)

  def rope_angles(self, rows_N: jax.Array, cols_N: jax.Array) -> jax.Array:
    """`[N, dh / 2]`: dh / 4 frequencies times the row, then the same times the column."""
    quarter = self.vcfg.head_dim // 2
    inv_freq = 1.0 / (self.vcfg.rope_theta
                      ** (jnp.arange(0, quarter, 2, dtype=jnp.float32) / quarter))
    return jnp.concatenate([rows_N.astype(jnp.float32)[:, None] * inv_freq,
                            cols_N.astype(jnp.float32)[:, None] * inv_freq], axis=-1)

  def __call__(self, pixel_values_NxK: jax.Array, layout: VisionLayout) -> jax.Array:
    vcfg = self.vcfg
    unit = vcfg.spatial_merge_size ** 2
    n = pixel_values_NxK.shape[0]
    if pixel_values_NxK.shape[-1] != vcfg.patch_dim:
      raise ValueError(f"VisionTower: pixel_values have {pixel_values_NxK.shape[-1]} values "
                       f"per patch, the config needs C*T*P*P = {vcfg.patch_dim}")
    if n != len(layout.window_seg_N):
      raise ValueError(f"VisionTower: {n} patches in pixel_values, the image grids have "
                       f"{len(layout.window_seg_N)}")
    window_index_M = jnp.asarray(layout.window_index_M)
    x = self.patch_embed(pixel_values_NxK)
    x = x.reshape(n // unit, unit, -1)[window_index_M].reshape(n, -1)
    angles_NxF = self.rope_angles(jnp.asarray(layout.rows_N), jnp.asarray(layout.cols_N))
    window_seg, frame_seg = jnp.asarray(layout.window_seg_N), jnp.asarray(layout.frame_seg_N)
    full = set(vcfg.fullatt_block_indexes)
    for i, block in enumerate(self.blocks):
      x = block(x, angles_NxF, frame_seg if i in full else window_seg)
    merged_MxO = self.merger(x)
    return merged_MxO[jnp.argsort(window_index_M)]
