"""Images through the `reference` rollout backend: greedy tokens and log-probs on prompts
with an image equal `VLModel`'s own greedy decoding (a full forward per token)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from distflow_jax.models.vl import VLModel, vl_inputs
from distflow_jax.rollout.engine.config import EngineConfig
from distflow_jax.rollout.reference import ReferenceSampler
from distflow_jax.rollout.engine.sampling import SamplingParams
from distflow_jax.state.vision import VisionEncoder, prompt_images

from test_vl_passes import GRID, K, prompt, tiny_vl_config


def vl_greedy(model, prompt_ids, pixels, n_new):
  seq = list(prompt_ids)
  toks, lps = [], []
  for _ in range(n_new):
    arr = np.asarray(seq, np.int32)[None]
    inp = vl_inputs(model.cfg, arr, np.array([GRID]))
    logits, _ = model(jnp.asarray(arr), jnp.asarray(inp.positions_BxT), pixel_values=pixels,
                      layout=inp.layout,
                      rope_positions_3xBxT=jnp.asarray(inp.rope_positions_3xBxT))
    logp = jax.nn.log_softmax(logits[0, -1].astype(jnp.float32))
    tok = int(jnp.argmax(logp))
    toks.append(tok)
    lps.append(float(logp[tok]))
    seq.append(tok)
  return toks, lps


@pytest.mark.slow
def test_reference_backend_greedy_matches_vl_model():
  model = VLModel(tiny_vl_config(), rngs=nnx.Rngs(5))
  rng = np.random.default_rng(0)
  prompts = [prompt(rng, 2, 3), prompt(rng, 5, 1)]
  pixels = [rng.normal(size=(16, K)).astype(np.float32) for _ in prompts]
  enc = VisionEncoder.from_tower(model.cfg, model.visual)
  grids = [np.array([GRID])] * len(prompts)
  images = prompt_images(model.cfg, [enc.features(px, g) for px, g in zip(pixels, grids)],
                         prompts, grids)
  n_new = 6
  sampler = ReferenceSampler(model.cfg.text, EngineConfig(
      max_new_tokens=n_new, sampling=SamplingParams(temperature=0.0)))
  params = sampler.load_params(model.language)
  out = sampler.generate(params, prompts, n=2, rng=jax.random.key(0), images=images)
  for r in range(4):
    q = r // 2
    want_toks, want_lps = vl_greedy(model, prompts[q], jnp.asarray(pixels[q]), n_new)
    np.testing.assert_array_equal(np.asarray(out.tokens_RxN[r]), want_toks)
    np.testing.assert_allclose(np.asarray(out.logprobs_RxN[r]), want_lps, atol=1e-5)
  # Without the images the same prompts decode differently (the features matter).
  text_only = sampler.generate(params, prompts, n=1, rng=jax.random.key(0))
  assert not np.array_equal(np.asarray(text_only.tokens_RxN), np.asarray(out.tokens_RxN[::2]))
