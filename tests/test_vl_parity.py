"""Qwen2.5-VL parity with `transformers` (torch CPU, float32) on a tiny random model.

Vision tower (window attention on two blocks, full attention on one, windows that do
and do not divide the grid), the 3-D RoPE index, full-model logits on prompts with an
image (two rows, left padded, images of different grids; two images in one row), greedy
tokens through our KV cache against `generate`, and checkpoint round trips both ways.
Needs the optional `hf` extra; skipped cleanly without it.
"""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

torch = pytest.importorskip("torch", reason="VL parity needs torch (pip install '.[hf]')")
transformers = pytest.importorskip("transformers",
                                   reason="VL parity needs transformers (pip install '.[hf]')")
if not hasattr(transformers, "Qwen2_5_VLForConditionalGeneration"):
  pytest.skip("this transformers has no Qwen2.5-VL", allow_module_level=True)

from distflow_jax.models.errors import ModelFileError  # noqa: E402
from distflow_jax.models.transformer import Transformer, init_cache  # noqa: E402
from distflow_jax.models.vision import vision_layout  # noqa: E402
from distflow_jax.models.vl import (VLConfig, VLModel, load_vl_pretrained, rope_index,  # noqa: E402
                                    save_vl_pretrained, vl_forward, vl_inputs)

pytestmark = [pytest.mark.hf, pytest.mark.timeout(300)]

VOCAB = 128
IMG, VSTART, VEND = 120, 122, 123
PATCH, TP, MERGE, CH = 2, 2, 2, 3
# (t, h, w) in patches: 8 x 12 -> 4 x 6 merged groups, windows of 2 x 2 groups divide it;
# 6 x 10 -> 3 x 5 groups, the windows at the bottom and right edges are partial.
GRIDS = [(1, 8, 12), (1, 6, 10)]
FWD = jax.jit(vl_forward)


def hf_config(tie=False):
  cfg = transformers.Qwen2_5_VLConfig(
      text_config=dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96,
                       num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                       rope_parameters={"rope_type": "default", "rope_theta": 1000.0,
                                        "mrope_section": [2, 3, 3]},
                       max_position_embeddings=256, rms_norm_eps=1e-5,
                       bos_token_id=None, eos_token_id=None, tie_word_embeddings=tie),
      vision_config=dict(depth=3, hidden_size=32, intermediate_size=48, num_heads=4,
                         patch_size=PATCH, temporal_patch_size=TP, spatial_merge_size=MERGE,
                         window_size=8, out_hidden_size=64, fullatt_block_indexes=[1],
                         in_channels=CH),
      image_token_id=IMG, video_token_id=121, vision_start_token_id=VSTART,
      vision_end_token_id=VEND, tie_word_embeddings=tie)
  cfg._attn_implementation = "eager"  # pylint: disable=protected-access
  cfg.vision_config._attn_implementation = "eager"  # pylint: disable=protected-access
  cfg.text_config._attn_implementation = "eager"  # pylint: disable=protected-access
  return cfg


def hf_model(seed=0, tie=False):
  torch.manual_seed(seed)
  model = transformers.Qwen2_5_VLForConditionalGeneration(hf_config(tie)).eval()
  with torch.no_grad():
    for name, p in model.named_parameters():
      p.copy_(1.0 + 0.2 * torch.randn_like(p) if "norm" in name or "ln_q" in name
              else 0.2 * torch.randn_like(p))
  return model


def pixels(grids, seed=0):
  n = sum(t * h * w for t, h, w in grids)
  return np.random.default_rng(seed).normal(size=(n, CH * TP * PATCH * PATCH)).astype(np.float32)


def prompts(grids, pad=0):
  """One row per image: text, <vision_start>, placeholders, <vision_end>, text; left padded
  to a common length with token `pad` (mask False there)."""
  rng = np.random.default_rng(7)
  rows = []
  for i, (t, h, w) in enumerate(grids):
    n = t * h * w // MERGE ** 2
    rows.append([*rng.integers(0, 110, 3 + 2 * i), VSTART, *[IMG] * n, VEND,
                 *rng.integers(0, 110, 4)])
  t = max(len(r) for r in rows)
  tokens = np.full((len(rows), t), pad, np.int64)
  mask = np.zeros((len(rows), t), bool)
  for i, r in enumerate(rows):
    tokens[i, t - len(r):] = r
    mask[i, t - len(r):] = True
  return tokens, mask


def hf_logits(hf, tokens, mask, pix, grids):
  with torch.no_grad():
    out = hf(input_ids=torch.tensor(tokens), attention_mask=torch.tensor(mask.astype(np.int64)),
             pixel_values=torch.tensor(pix), image_grid_thw=torch.tensor(grids),
             mm_token_type_ids=torch.tensor((tokens == IMG).astype(np.int64)))
  return out.logits.numpy()


def our_logits(model, tokens, mask, pix, grids):
  inp = vl_inputs(model.cfg, tokens, grids, mask)
  g, p = nnx.split(model)
  logits, _ = FWD(g, p, jnp.asarray(tokens), jnp.asarray(inp.positions_BxT), jnp.asarray(mask),
                  pixel_values=jnp.asarray(pix), layout=inp.layout,
                  rope_positions_3xBxT=jnp.asarray(inp.rope_positions_3xBxT))
  return np.asarray(logits)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
  path = tmp_path_factory.mktemp("vl")
  hf = hf_model()
  hf.save_pretrained(str(path), safe_serialization=True)
  ours = load_vl_pretrained(path, dtype="float32")
  return hf, ours, path


def test_config_reads_transformers_config(pair):
  hf, ours, _ = pair
  cfg = ours.cfg
  assert cfg.text.mrope_section == (2, 3, 3) and cfg.text.rope_theta == 1000.0
  assert cfg.text.head_dim == 16 and cfg.text.qkv_bias and not cfg.text.tie_embeddings
  assert cfg.vision.fullatt_block_indexes == (1,) and cfg.vision.window_size == 8
  assert cfg.image_token_id == IMG
  assert VLConfig.from_hf_dict(cfg.to_hf_dict()) == cfg
  # The older flat layout (text keys at the top, rope_scaling type "mrope") reads the same.
  flat = {**cfg.to_hf_dict()["text_config"], **cfg.to_hf_dict()}
  flat.pop("text_config")
  flat["rope_scaling"] = {"type": "mrope", "mrope_section": [2, 3, 3]}
  flat["rope_theta"] = 1000.0
  flat.pop("rope_parameters")
  assert VLConfig.from_hf_dict(flat) == cfg


def test_vision_tower_matches_transformers(pair):
  hf, ours, _ = pair
  pix = pixels(GRIDS)
  with torch.no_grad():
    ref = hf.model.visual(torch.tensor(pix), grid_thw=torch.tensor(GRIDS)).pooler_output.numpy()
  out = jax.jit(lambda m, x, lay: m(x, lay))(ours.visual, jnp.asarray(pix),
                                             vision_layout(ours.cfg.vision, GRIDS))
  assert out.shape == (sum(t * h * w for t, h, w in GRIDS) // MERGE ** 2, 64)
  np.testing.assert_allclose(np.asarray(out), ref, atol=1e-4, rtol=1e-4)


def test_rope_index_matches_transformers(pair):
  hf, ours, _ = pair
  tokens, mask = prompts(GRIDS)
  pos, deltas = rope_index(ours.cfg, tokens, GRIDS, mask)
  ref, ref_deltas = hf.model.get_rope_index(
      torch.tensor(tokens), mm_token_type_ids=torch.tensor((tokens == IMG).astype(np.int64)),
      image_grid_thw=torch.tensor(GRIDS), attention_mask=torch.tensor(mask.astype(np.int64)))
  np.testing.assert_array_equal(pos[:, mask], ref.numpy()[:, mask])
  np.testing.assert_array_equal(deltas, ref_deltas.numpy()[:, 0])
  with pytest.raises(ValueError, match="placeholders for 1"):
    rope_index(ours.cfg, tokens[:1], GRIDS, mask[:1])


def test_logits_match_transformers(pair):
  hf, ours, _ = pair
  tokens, mask = prompts(GRIDS)
  pix = pixels(GRIDS)
  ref = hf_logits(hf, tokens, mask, pix, GRIDS)
  out = our_logits(ours, tokens, mask, pix, GRIDS)
  np.testing.assert_allclose(out[mask], ref[mask], atol=1e-4, rtol=1e-4)
  # One row, one image, no padding.
  t1, m1 = prompts(GRIDS[1:])
  np.testing.assert_allclose(our_logits(ours, t1, m1, pixels(GRIDS[1:]), GRIDS[1:]),
                             hf_logits(hf, t1, m1, pixels(GRIDS[1:]), GRIDS[1:]),
                             atol=1e-4, rtol=1e-4)


def test_two_images_in_one_row(pair):
  hf, ours, _ = pair
  (a, _), (b, _) = prompts(GRIDS[:1]), prompts(GRIDS[1:])
  tokens = np.concatenate([a, b], 1)
  mask = np.ones(tokens.shape, bool)
  pix = pixels(GRIDS, seed=2)
  np.testing.assert_allclose(our_logits(ours, tokens, mask, pix, GRIDS),
                             hf_logits(hf, tokens, mask, pix, GRIDS), atol=1e-4, rtol=1e-4)


def hf_greedy(hf, tokens, mask, pix, grids, n_new):
  with torch.no_grad():
    return hf.generate(input_ids=torch.tensor(tokens),
                       attention_mask=torch.tensor(mask.astype(np.int64)),
                       pixel_values=torch.tensor(pix), image_grid_thw=torch.tensor(grids),
                       mm_token_type_ids=torch.tensor((tokens == IMG).astype(np.int64)),
                       do_sample=False, max_new_tokens=n_new, min_new_tokens=n_new,
                       pad_token_id=0, eos_token_id=None).numpy()[:, tokens.shape[1]:]


def test_greedy_with_kv_cache_matches(pair):
  """Prefill with the image into a KV cache, then decode text tokens at RoPE position
  (slot + rope delta) on all three rows; two left-padded rows."""
  hf, ours, _ = pair
  tokens, mask = prompts(GRIDS)
  pix = pixels(GRIDS, seed=4)
  n_new = 5
  ref = hf_greedy(hf, tokens, mask, pix, GRIDS, n_new)
  b, t = tokens.shape
  inp = vl_inputs(ours.cfg, tokens, GRIDS, mask)
  g, p = nnx.split(ours)
  logits, cache = FWD(g, p, jnp.asarray(tokens), jnp.asarray(inp.positions_BxT),
                      jnp.asarray(mask), pixel_values=jnp.asarray(pix), layout=inp.layout,
                      rope_positions_3xBxT=jnp.asarray(inp.rope_positions_3xBxT),
                      cache=init_cache(ours.cfg.text, b, t + n_new),
                      cache_index_B=jnp.zeros(b, jnp.int32))
  nxt = np.asarray(logits[:, -1].argmax(-1))
  out = [nxt]
  n_real = mask.sum(1)
  for i in range(n_new - 1):
    pos = n_real + i                                   # token order, for masking
    rope = np.broadcast_to(pos + inp.rope_deltas_B, (3, b))[:, :, None]
    logits, cache = FWD(g, p, jnp.asarray(nxt[:, None]), jnp.asarray(pos[:, None]), None,
                        rope_positions_3xBxT=jnp.asarray(rope), cache=cache,
                        cache_index_B=jnp.full((b,), t + i, jnp.int32))
    nxt = np.asarray(logits[:, 0].argmax(-1))
    out.append(nxt)
  np.testing.assert_array_equal(np.stack(out, 1), ref)


@pytest.mark.parametrize("tie", [False, True])
def test_our_save_loads_in_transformers(tmp_path, tie):
  hf_src = hf_model(seed=3, tie=tie)
  hf_src.save_pretrained(str(tmp_path / "src"), safe_serialization=True)
  ours = load_vl_pretrained(tmp_path / "src", dtype="float32")
  assert ours.cfg.text.tie_embeddings == tie
  save_vl_pretrained(tmp_path / "ours", ours)
  hf, info = transformers.Qwen2_5_VLForConditionalGeneration.from_pretrained(
      str(tmp_path / "ours"), output_loading_info=True, attn_implementation="eager")
  assert not info["missing_keys"] and not info["unexpected_keys"], info
  assert hf.config.vision_config.fullatt_block_indexes == [1]
  tokens, mask = prompts(GRIDS)
  pix = pixels(GRIDS, seed=1)
  np.testing.assert_allclose(our_logits(ours, tokens, mask, pix, GRIDS)[mask],
                             hf_logits(hf.eval(), tokens, mask, pix, GRIDS)[mask],
                             atol=1e-4, rtol=1e-4)


def test_text_only_calls_unchanged(pair):
  """No image: the VL model is its text Transformer, and the mrope path with three equal
  position rows is the 1-D RoPE path."""
  _, ours, _ = pair
  tok = np.random.default_rng(3).integers(0, 110, (2, 9))
  pos = jnp.broadcast_to(jnp.arange(9), (2, 9))
  g, p = nnx.split(ours)
  vl, _ = FWD(g, p, jnp.asarray(tok), pos)
  plain_cfg = ours.cfg.text.replace(mrope_section=())
  plain = Transformer(plain_cfg, rngs=nnx.Rngs(0))
  nnx.update(plain, nnx.state(ours.language))
  text, _ = plain(jnp.asarray(tok), pos)
  np.testing.assert_allclose(np.asarray(vl), np.asarray(text), atol=1e-5, rtol=1e-5)


def test_load_errors_are_one_line(pair, tmp_path):
  _, ours, _ = pair
  save_vl_pretrained(tmp_path, ours)
  from safetensors.numpy import load_file, save_file  # pylint: disable=import-outside-toplevel
  state = load_file(str(tmp_path / "model.safetensors"))
  state.pop("visual.blocks.1.attn.qkv.weight")
  save_file(state, str(tmp_path / "model.safetensors"))
  with pytest.raises(ModelFileError, match="missing tensor 'visual.blocks.1.attn.qkv.weight'"
                     ) as e:
    load_vl_pretrained(tmp_path)
  assert "\n" not in str(e.value)
  d = json.loads((tmp_path / "config.json").read_text())
  d["vision_config"]["hidden_size"] = 48
  d["vision_config"]["num_heads"] = 4
  (tmp_path / "config.json").write_text(json.dumps(d))
  with pytest.raises(ModelFileError, match="shape mismatch for tensor 'visual.") as e:
    load_vl_pretrained(tmp_path)
  assert "\n" not in str(e.value)


def test_reads_transformers_in_memory_tensor_names(pair, tmp_path):
  """`model.language_model.*` / `model.visual.*` (transformers' module names) load too."""
  _, ours, _ = pair
  save_vl_pretrained(tmp_path, ours)
  from safetensors.numpy import load_file, save_file  # pylint: disable=import-outside-toplevel
  state = load_file(str(tmp_path / "model.safetensors"))
  renamed = {("model.language_model." + k[len("model."):] if k.startswith("model.") else
              "model." + k if k.startswith("visual.") else k): v for k, v in state.items()}
  assert "model.visual.merger.mlp.2.bias" in renamed
  save_file(renamed, str(tmp_path / "model.safetensors"))
  again = load_vl_pretrained(tmp_path)
  for (k, a), (_, b) in zip(nnx.to_flat_state(nnx.state(ours)),
                            nnx.to_flat_state(nnx.state(again))):
    np.testing.assert_array_equal(np.asarray(a.get_value()), np.asarray(b.get_value()),
                                  err_msg=str(k))
