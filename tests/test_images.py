"""Images through the data path (data/images.py, data/loader.py's image_key).

Parity: our numpy + Pillow processor against transformers' Qwen2-VL PIL image processor
(pixel_values and image_grid_thw), and the placeholder tokens against transformers'
Qwen2.5-VL processor.  Rows: JSONL and Parquet rows with images (paths, lists, base64,
bytes, datasets' {"bytes", "path"} structs); bad images are counted and skipped, or
refused in one line, per data.on_bad_row.
"""

from __future__ import annotations

import base64
import io
import json
import os

import numpy as np
import pytest

from distflow_jax.config.loading import ConfigError
from distflow_jax.data import images as im
from distflow_jax.data.loader import BadRowError, PromptLoader
from distflow_jax.models.tokenizer import Tokenizer

Image = pytest.importorskip("PIL.Image")


def _image(h: int, w: int, mode: str, seed: int = 0):
  rng = np.random.default_rng(seed)
  a = rng.integers(0, 256, (h, w, 4), dtype=np.uint8)
  if mode == "RGBA":
    return Image.fromarray(a, "RGBA")
  if mode == "LA":
    return Image.fromarray(a[..., :2], "LA")
  if mode == "L":
    return Image.fromarray(a[..., 0], "L")
  if mode == "P":  # a palette image with a transparent colour
    p = Image.fromarray(a[..., :3], "RGB").quantize(16)
    p.info["transparency"] = 3
    return p
  # Smooth content too, so resampling is not only noise.
  y, x = np.mgrid[0:h, 0:w]
  a[..., 0] = (x * 255 // max(w - 1, 1)).astype(np.uint8)
  return Image.fromarray(a[..., :3], "RGB")


CASES = [  # (height, width, mode, processor kwargs)
    (32, 48, "RGB", {}),
    (100, 37, "RGBA", {}),
    (64, 64, "L", {}),
    (57, 91, "LA", {}),
    (45, 60, "P", {}),
    (300, 500, "RGB", dict(max_pixels=28 * 28 * 16)),       # clipped to max_pixels
    (20, 24, "RGB", dict(min_pixels=28 * 28 * 9)),          # scaled up to min_pixels
    (5, 700, "RGB", {}),                                    # thin
    (640, 480, "RGB", dict(max_pixels=28 * 28 * 256)),
]


@pytest.fixture(scope="module")
def hf_pil_processor():
  # transformers 5's PIL ("slow") processor; 4.x's slow one dropped alpha instead of
  # compositing it onto white.
  pil = pytest.importorskip("transformers.models.qwen2_vl.image_processing_pil_qwen2_vl")
  return pil.Qwen2VLImageProcessorPil


@pytest.mark.hf
@pytest.mark.parametrize("h,w,mode,kw", CASES)
def test_processor_matches_transformers(h, w, mode, kw, hf_pil_processor):
  image = _image(h, w, mode)
  want = hf_pil_processor(**kw)(images=[image], return_tensors="np")
  pixel_values, grid = im.ImageProcessor(**kw).process([image])
  np.testing.assert_array_equal(grid, want["image_grid_thw"])
  assert pixel_values.dtype == np.float32 and pixel_values.shape == want["pixel_values"].shape
  # The same Pillow resize and the same float32 arithmetic: equal to the last bit.
  np.testing.assert_allclose(pixel_values, want["pixel_values"], rtol=0, atol=1e-6)
  assert im.ImageProcessor(**kw).grid(h, w) == tuple(want["image_grid_thw"][0])


@pytest.mark.hf
def test_several_images_and_preprocessor_config(tmp_path, hf_pil_processor):
  config = {"min_pixels": 3136, "max_pixels": 28 * 28 * 64, "patch_size": 14,
            "temporal_patch_size": 2, "merge_size": 2, "image_mean": [0.5, 0.5, 0.5],
            "image_std": [0.25, 0.5, 0.75], "resample": 3,
            "image_processor_type": "Qwen2VLImageProcessor"}
  (tmp_path / im.PREPROCESSOR_FILE).write_text(json.dumps(config))
  ours = im.ImageProcessor.from_dir(tmp_path)
  assert (ours.max_pixels, ours.image_std) == (28 * 28 * 64, (0.25, 0.5, 0.75))
  hf = hf_pil_processor(**{k: v for k, v in config.items() if k != "image_processor_type"})
  images = [_image(200, 90, "RGB", 1), _image(33, 33, "RGBA", 2), _image(400, 410, "L", 3)]
  want = hf(images=images, return_tensors="np")
  pixel_values, grid = ours.process(images)
  np.testing.assert_array_equal(grid, want["image_grid_thw"])
  np.testing.assert_allclose(pixel_values, want["pixel_values"], rtol=0, atol=1e-6)
  # transformers 5's "size" spelling; no file at all gives the defaults.
  (tmp_path / im.PREPROCESSOR_FILE).write_text(json.dumps(
      {"size": {"shortest_edge": 1000, "longest_edge": 5000}}))
  assert (im.ImageProcessor.from_dir(tmp_path).min_pixels,
          im.ImageProcessor.from_dir(tmp_path).max_pixels) == (1000, 5000)
  assert im.ImageProcessor.from_dir(tmp_path / "nowhere") == im.ImageProcessor()
  (tmp_path / im.PREPROCESSOR_FILE).write_text('{"patch_size": 0}')
  with pytest.raises(ConfigError, match="preprocessor_config.json.*patch_size=0"):
    im.ImageProcessor.from_dir(tmp_path)


def test_patch_order():
  """A patch's row is its merge window, then its place in the window; inside, the layout
  is [channel, time, row, column] with the frame repeated in time."""
  proc = im.ImageProcessor(do_resize=False, do_rescale=False, do_normalize=False)
  h, w = 56, 84  # 4 x 6 patches, 2 x 3 merge windows
  arr = np.random.default_rng(0).integers(0, 256, (h, w, 3), dtype=np.uint8)
  pv, grid = proc(arr)
  assert tuple(grid) == (1, 4, 6) and pv.shape == (24, 3 * 2 * 14 * 14)
  p = pv.reshape(2, 3, 2, 2, 3, 2, 14, 14)  # window row/col, in-window row/col, C, T, y, x
  for wr, wc, r, c in [(0, 0, 0, 0), (0, 1, 1, 0), (1, 2, 1, 1), (1, 0, 0, 1)]:
    y, x = (wr * 2 + r) * 14, (wc * 2 + c) * 14
    want = np.moveaxis(arr[y:y + 14, x:x + 14], -1, 0).astype(np.float32)
    for t in range(2):
      np.testing.assert_array_equal(p[wr, wc, r, c, :, t], want)


def test_smart_resize():
  assert im.smart_resize(28, 28) == (56, 56)  # up to min_pixels
  h, w = im.smart_resize(4000, 3000)
  assert h % 28 == w % 28 == 0 and h * w <= 28 * 28 * 1280
  with pytest.raises(im.ImageError, match="aspect ratio above 200"):
    im.smart_resize(1, 500)


# ---------------------------------------------------------------------------------------
# Placeholder tokens


def _vl_tokenizer(path=None) -> Tokenizer:
  """The built-in tokenizer plus Qwen2.5-VL's vision special tokens (saved to ``path``)."""
  import tokenizers
  base = Tokenizer.builtin()
  inner = tokenizers.Tokenizer.from_str(base.tok.to_str())
  inner.add_special_tokens([tokenizers.AddedToken(t, special=True, normalized=False)
                            for t in (im.VISION_START, im.VISION_END, im.IMAGE_PAD,
                                      "<|video_pad|>")])
  tok = Tokenizer(inner, base.config)
  if path is not None:
    tok.save(path)
  return tok


@pytest.mark.hf
def test_placeholders_match_qwen25_vl_processor(tmp_path, hf_pil_processor):
  from transformers import AutoTokenizer
  from transformers.models.qwen2_5_vl.processing_qwen2_5_vl import Qwen2_5_VLProcessor

  class Processor(Qwen2_5_VLProcessor):
    # Skips the class check of the (absent) video processor, which needs torchvision.
    def check_argument_for_proper_class(self, name, arg):
      return None

  tok = _vl_tokenizer(tmp_path)
  hf = Processor(image_processor=hf_pil_processor(), tokenizer=AutoTokenizer.from_pretrained(
      tmp_path))
  pad = tok.tok.token_to_id(im.IMAGE_PAD)
  images = [_image(90, 130, "RGB", 4), _image(300, 40, "RGBA", 5), _image(600, 600, "L", 6)]
  # Plain text with markers; chat messages through the template, blocks put first.
  for prompt, use_template in (("<image>What is 1 + 2?<image> and <image>", False),
                               ([{"role": "user", "content": "Add the numbers."}], True)):
    ours = im.encode_with_images(tok, prompt, images, use_chat_template=use_template)
    messages = ([{"role": "user", "content": prompt}] if isinstance(prompt, str)
                else [dict(m) for m in prompt])
    messages = im.place_images(messages, len(images))
    text = (tok.apply_chat_template(messages) if use_template
            else "\n".join(m["content"] for m in messages))
    assert text.count(im.IMAGE_BLOCK) == 3
    want = hf(text=[text], images=images, return_tensors="np")
    np.testing.assert_array_equal(ours.ids, want["input_ids"][0])
    np.testing.assert_array_equal(ours.image_grid_thw, want["image_grid_thw"])
    np.testing.assert_allclose(ours.pixel_values, want["pixel_values"], rtol=0, atol=1e-6)
    counts = [int(g.prod()) // 4 for g in want["image_grid_thw"]]
    assert (ours.ids == pad).sum() == sum(counts)
  # Each image's pads sit between its own start and end tokens.
  start = tok.tok.token_to_id(im.VISION_START)
  starts = np.flatnonzero(ours.ids == start)
  for s, n in zip(starts, counts):
    assert (ours.ids[s + 1:s + 1 + n] == pad).all() and ours.ids[s + 1 + n] != pad


def test_tokenizer_without_vision_tokens_is_one_line():
  with pytest.raises(ConfigError, match="no <\\|vision_start\\|>.*data.image_key") as e:
    im.encode_with_images(Tokenizer.builtin(), "hi", [_image(30, 30, "RGB")])
  assert "\n" not in str(e.value)


# ---------------------------------------------------------------------------------------
# Rows


def _png(image) -> bytes:
  buf = io.BytesIO()
  image.save(buf, format="PNG")
  return buf.getvalue()


PROC = im.ImageProcessor(max_pixels=28 * 28 * 16)


def _loader(path, tok, **kw):
  kw = {"batch_size": 1, "max_prompt_len": 512, "process_index": 0, "process_count": 1,
        "shuffle": False, "num_epochs": 1, "image_processor": PROC, **kw}
  return PromptLoader(str(path), tok, **kw)


def _check_example(batch, tok, images, prompt_len=None):
  (host,) = batch.host.values()
  want_pv, want_grid = PROC.process(images)
  np.testing.assert_array_equal(host["image_grid_thw"], want_grid)
  np.testing.assert_array_equal(host["pixel_values"], want_pv)
  n = int(batch.data["prompt_len"][0])
  ids = batch.data["prompt_ids"][0, :n]
  pads = int((ids == tok.tok.token_to_id(im.IMAGE_PAD)).sum())
  assert pads == sum(PROC.num_image_tokens(g) for g in want_grid)
  assert int((ids == tok.tok.token_to_id(im.VISION_START)).sum()) == len(images)
  return host


def test_jsonl_rows_with_images(tmp_path):
  tok = _vl_tokenizer()
  a, b, c = _image(40, 70, "RGB", 7), _image(90, 30, "RGBA", 8), _image(50, 50, "L", 9)
  (tmp_path / "imgs").mkdir()
  a.save(tmp_path / "imgs" / "a.png")
  b.save(tmp_path / "b.png")
  data_uri = "data:image/png;base64," + base64.b64encode(_png(c)).decode()
  rows = [
      {"prompt": "What is in the picture?", "answer": "1", "extra": {"image": "imgs/a.png"}},
      {"prompt": "Compare <image> with <image>.", "answer": "2",
       "extra": {"image": [str(tmp_path / "b.png"), "imgs/a.png"]}},
      {"prompt": [{"role": "system", "content": "Be brief."},
                  {"role": "user", "content": "Describe."}], "answer": "3",
       "extra": {"image": data_uri}},
      {"prompt": "Bare base64.", "answer": "4",
       "extra": {"image": base64.b64encode(_png(c)).decode()}},
      {"prompt": "No image here.", "answer": "5"},
  ]
  path = tmp_path / "data.jsonl"
  path.write_text("".join(json.dumps(r) + "\n" for r in rows))
  loader = _loader(path, tok, image_key="extra.image")
  batches = list(loader)
  # A row of an image dataset without an image is a bad row (a run's tower needs one).
  assert len(batches) == 4 and loader.counts["ok"] == 4 and loader.counts["bad_image"] == 1
  host = _check_example(batches[0], tok, [a])
  assert host["prompt"] == "What is in the picture?" and "pixel_values" in host
  _check_example(batches[1], tok, [b, a])
  _check_example(batches[2], tok, [c])
  _check_example(batches[3], tok, [c])
  # The image's block comes before the user's text, after the system message.
  text = batches[2].host[int(batches[2].data["sample_id"][0])]["prompt_text"]
  assert text.index("Be brief.") < text.index(im.IMAGE_BLOCK) < text.index("Describe.")
  # Placeholders count toward data.max_prompt_len.
  short = _loader(path, tok, image_key="extra.image", max_prompt_len=20, on_bad_row="error")
  with pytest.raises(BadRowError, match=r"data.jsonl:1: too_long: \d+ prompt tokens, "
                     r"6 of them image placeholders"):
    next(iter(short))
  # A text-only loader over the same file has no image fields.
  plain = next(iter(_loader(path, tok)))
  assert "pixel_values" not in next(iter(plain.host.values()))


def test_parquet_rows_with_images(tmp_path):
  import pyarrow as pa
  import pyarrow.parquet as pq
  tok = _vl_tokenizer()
  a, b = _image(60, 45, "RGB", 10), _image(28, 200, "P", 11)
  b.save(tmp_path / "b.png")
  table = pa.table({
      "prompt": ["one <image>", "two", "three"],
      "answer": ["1", "2", "3"],
      "image_bytes": [_png(a), None, _png(a)],
      "images": [[{"bytes": _png(a), "path": None}],
                 [{"bytes": None, "path": "b.png"}, {"bytes": _png(a), "path": "x.png"}],
                 []],
  })
  pq.write_table(table, tmp_path / "data.parquet")
  # Rows without an image (null, []) are bad rows of an image dataset: skipped, counted.
  loader = _loader(tmp_path / "data.parquet", tok, image_key="image_bytes")
  batches = list(loader)
  assert len(batches) == 2 and loader.counts["bad_image"] == 1
  _check_example(batches[0], tok, [a])
  _check_example(batches[1], tok, [a])
  loader = _loader(tmp_path / "data.parquet", tok, image_key="images")
  batches = list(loader)
  assert len(batches) == 2 and loader.counts["bad_image"] == 1
  _check_example(batches[0], tok, [a])
  _check_example(batches[1], tok, [b, a])


def _bad_rows(tmp_path):
  tok = _vl_tokenizer()
  good = _image(40, 40, "RGB", 12)
  good.save(tmp_path / "good.png")
  (tmp_path / "notes.png").write_text("this is not an image")
  _image(300, 300, "RGB", 13).save(tmp_path / "big.png")
  (tmp_path / "cut.png").write_bytes(_png(_image(64, 64, "RGB", 14))[:200])
  rows = [
      ("missing.png", "no file", "missing.png"),
      ("notes.png", "not a readable image", "notes.png"),
      ("big.png", "300x300 = 90000 pixels > data.max_image_pixels=50000", "big.png"),
      ("cut.png", "cannot be decoded", "cut.png"),
      (42, "must be a path, base64 text, bytes", "42"),
      (["good.png", "good.png"], "marks 1 image(s)", "<image>"),
  ]
  lines = [json.dumps({"prompt": "p", "answer": "0", "image": "good.png"})]
  for ref, _, _ in rows:
    prompt = "one <image> only" if isinstance(ref, list) else "p"
    lines.append(json.dumps({"prompt": prompt, "answer": "0", "image": ref}))
  lines.append(json.dumps({"prompt": "p", "answer": "0", "image": "good.png"}))
  path = tmp_path / "rows.jsonl"
  path.write_text("\n".join(lines) + "\n")
  return tok, path, rows


def test_bad_images_are_counted_and_skipped(tmp_path, caplog):
  tok, path, rows = _bad_rows(tmp_path)
  loader = _loader(path, tok, image_key="image", max_image_pixels=50_000, on_bad_row="skip")
  batches = list(loader)
  assert len(batches) == 2
  assert loader.counts["bad_image"] == len(rows) and loader.counts["ok"] == 2
  warned = [r.getMessage() for r in caplog.records if "bad_image" in r.getMessage()]
  assert len(warned) == 1 and "rows.jsonl:2" in warned[0] and "missing.png" in warned[0]


@pytest.mark.parametrize("index", range(6))
def test_bad_image_refused_in_one_line(tmp_path, index):
  tok, path, rows = _bad_rows(tmp_path)
  lines = path.read_text().splitlines()
  path.write_text(lines[index + 1] + "\n")  # the bad row alone
  _, what, name = rows[index]
  loader = _loader(path, tok, image_key="image", max_image_pixels=50_000, on_bad_row="error")
  with pytest.raises(BadRowError) as e:
    next(iter(loader))
  message = str(e.value)
  assert "\n" not in message and "Traceback" not in message
  assert f"{path}:1: bad_image" in message and what in message and name in message
  assert "data.on_bad_row" in message


def test_loader_needs_vision_tokens(tmp_path):
  path = tmp_path / "d.jsonl"
  path.write_text(json.dumps({"prompt": "p", "answer": "1", "image": "x.png"}) + "\n")
  with pytest.raises(ConfigError, match="no <\\|vision_start\\|>"):
    _loader(path, Tokenizer.builtin(), image_key="image")


def test_config_keys():
  from distflow_jax.config import defaults
  from distflow_jax.config.values import check_values
  cfg = defaults.base()
  assert cfg.data.image_key == "" and cfg.data.max_image_pixels > 0
  cfg.data.max_image_pixels = 0
  with pytest.raises(ConfigError, match="data.max_image_pixels=0"):
    check_values(cfg)


def test_image_key_in_a_run_needs_the_supported_combination():
  """Images train only with a Qwen2.5-VL model.path and the reference backend
  (config/vision_checks.py); otherwise the run would train on the text alone, so the
  config refuses it in one line."""
  from distflow_jax.config import defaults
  from distflow_jax.config.values import check_values
  cfg = defaults.base()
  cfg.data.image_key = "image"
  with pytest.raises(ConfigError, match="images need a Qwen2.5-VL checkpoint in model.path"):
    check_values(cfg)
  cfg.model.path = "/some/vl"
  with pytest.raises(ConfigError, match="set rollout.backend=reference"):
    check_values(cfg)
