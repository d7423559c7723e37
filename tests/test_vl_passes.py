"""Images through the sequence passes: `response_logprobs` on a batch carrying precomputed
vision features (train/image_inputs.py, state/vision.py) equals `VLModel`'s own full
forward over prompt (with an image) + response, per row and with shared prompts."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from distflow_jax.models.config import ModelConfig
from distflow_jax.models.vision import VisionConfig
from distflow_jax.models.vl import VLConfig, VLModel, vl_inputs
from distflow_jax.train import steps
from distflow_jax.state.vision import VisionEncoder, image_fields

IMG, VSTART, VEND, PAD = 120, 122, 123, 0
GRID = (1, 4, 4)          # 4 x 4 patches -> 2 x 2 merged groups = 4 image tokens
K = 3 * 2 * 2 * 2         # channels * temporal patch * patch * patch


def tiny_vl_config() -> VLConfig:
  text = ModelConfig(arch="qwen2", vocab_size=128, hidden_size=64, intermediate_size=96,
                     num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                     rope_theta=1000.0, rms_norm_eps=1e-5, qkv_bias=True,
                     tie_embeddings=False, mrope_section=(2, 3, 3))
  vision = VisionConfig(depth=2, hidden_size=32, intermediate_size=48, num_heads=4,
                        patch_size=2, temporal_patch_size=2, spatial_merge_size=2,
                        window_size=8, out_hidden_size=64)
  return VLConfig(text=text, vision=vision, image_token_id=IMG, video_token_id=121,
                  vision_start_token_id=VSTART, vision_end_token_id=VEND)


@pytest.fixture(scope="module")
def model():
  return VLModel(tiny_vl_config(), rngs=nnx.Rngs(3))


def prompt(rng, before, after):
  n_img = GRID[0] * GRID[1] * GRID[2] // 4
  return np.concatenate([rng.integers(1, 100, before), [VSTART], [IMG] * n_img, [VEND],
                         rng.integers(1, 100, after)]).astype(np.int32)


def vl_logprobs(model, prompt_ids, response_ids, pixels):
  """Our reference: VLModel's full forward on one unpadded row."""
  seq = np.concatenate([prompt_ids, response_ids])[None]
  inp = vl_inputs(model.cfg, seq, np.array([GRID]))
  logits, _ = model(jnp.asarray(seq), jnp.asarray(inp.positions_BxT), pixel_values=pixels,
                    layout=inp.layout, rope_positions_3xBxT=jnp.asarray(inp.rope_positions_3xBxT))
  logp = jax.nn.log_softmax(logits[0].astype(jnp.float32), axis=-1)
  p = len(prompt_ids)
  return np.asarray([logp[p - 1 + t, tok] for t, tok in enumerate(response_ids)])


def make_batch(model, prompts, responses, pixels):
  enc = VisionEncoder.from_tower(model.cfg, model.visual)
  p_max = max(map(len, prompts))
  n_max = max(map(len, responses))
  b = len(prompts)
  pt = np.full((b, p_max), PAD, np.int32)
  pm = np.zeros((b, p_max), bool)
  rt = np.full((b, n_max), PAD, np.int32)
  rm = np.zeros((b, n_max), bool)
  for i, (p, r) in enumerate(zip(prompts, responses)):
    pt[i, p_max - len(p):], pm[i, p_max - len(p):] = p, True
    rt[i, :len(r)], rm[i, :len(r)] = r, True
  feats = [enc.features(px, np.array([GRID])) for px in pixels]
  fields = image_fields(model.cfg, feats, pt, pm, [np.array([GRID])] * b, n_max)
  return {"prompt_tokens": pt, "prompt_mask": pm, "response_tokens": rt,
          "response_mask": rm, **fields}


def test_response_logprobs_match_vl_model(model):
  rng = np.random.default_rng(0)
  prompts = [prompt(rng, 3, 2), prompt(rng, 1, 5), prompt(rng, 6, 1)]
  responses = [rng.integers(1, 100, n).astype(np.int32) for n in (5, 2, 4)]
  pixels = [rng.normal(size=(16, K)).astype(np.float32) for _ in prompts]
  batch = make_batch(model, prompts, responses, pixels)
  graphdef, params = nnx.split(model.language)
  logp, _ = jax.jit(steps.response_logprobs, static_argnums=0)(graphdef, params, batch)
  for i, (p, r, px) in enumerate(zip(prompts, responses, pixels)):
    want = vl_logprobs(model, p, r, jnp.asarray(px))
    np.testing.assert_allclose(np.asarray(logp[i, :len(r)]), want, atol=1e-5, rtol=1e-5)
    assert np.all(np.asarray(logp[i, len(r):]) == 0)


@pytest.mark.slow
def test_shared_prompts_match_per_row(model):
  rng = np.random.default_rng(1)
  prompts = [prompt(rng, 2, 3)] * 2 + [prompt(rng, 4, 1)] * 2
  responses = [rng.integers(1, 100, n).astype(np.int32) for n in (3, 5, 4, 2)]
  px = [rng.normal(size=(16, K)).astype(np.float32) for _ in range(2)]
  pixels = [px[0], px[0], px[1], px[1]]
  batch = make_batch(model, prompts, responses, pixels)
  graphdef, params = nnx.split(model.language)
  plain, _ = steps.response_logprobs(graphdef, params, batch)
  shared, _ = steps.response_logprobs(graphdef, params, batch, group_size=2)
  np.testing.assert_allclose(np.asarray(shared), np.asarray(plain), atol=1e-5, rtol=1e-5)
  want = vl_logprobs(model, prompts[1], responses[1], jnp.asarray(pixels[1]))
  np.testing.assert_allclose(np.asarray(shared[1, :5]), want, atol=1e-5, rtol=1e-5)


def test_text_only_batch_unchanged(model):
  """Without image fields the passes are the text model's, as before."""
  rng = np.random.default_rng(2)
  graphdef, params = nnx.split(model.language)
  batch = {"prompt_tokens": rng.integers(1, 100, (2, 4)).astype(np.int32),
           "prompt_mask": np.ones((2, 4), bool),
           "response_tokens": rng.integers(1, 100, (2, 3)).astype(np.int32),
           "response_mask": np.ones((2, 3), bool)}
  logp, _ = steps.response_logprobs(graphdef, params, batch)
  seq = np.concatenate([batch["prompt_tokens"], batch["response_tokens"]], axis=1)
  logits, _ = model.language(jnp.asarray(seq), jnp.broadcast_to(jnp.arange(7), (2, 7)))
  want = jnp.take_along_axis(jax.nn.log_softmax(logits[:, 3:6], -1),
                             jnp.asarray(batch["response_tokens"])[..., None], -1)[..., 0]
  np.testing.assert_allclose(np.asarray(logp), np.asarray(want), atol=1e-5, rtol=1e-5)


def test_mixed_grids_refused(model):
  cfg = model.cfg
  with pytest.raises(ValueError, match="same grid"):
    image_fields(cfg, [np.zeros((4, 64))] * 2, np.zeros((2, 3), np.int32),
                 np.ones((2, 3), bool), [np.array([GRID]), np.array([(1, 4, 8)])], 2)
