"""The built-in visual task (tasks/shapes.py): deterministic scenes, pictures that really
hold the stated count (read back from the pixels by a flood fill, not from the generator),
disjoint splits, rows through PromptLoader's image path, the math reward on its answers,
and the one-line refusal of ``builtin:shapes`` in a text run."""

from __future__ import annotations

import re
from collections import deque

import numpy as np
import pytest

from distflow_jax.config.loading import ConfigError
from distflow_jax.data import images as im
from distflow_jax.data.loader import PromptLoader
from distflow_jax.rewards.registry import score_batch
from distflow_jax.tasks import registry as tasks
from distflow_jax.tasks import shapes

pytest.importorskip("PIL.Image")

_QUESTION = re.compile(r"^How many (?:(\w+) )?(\w+?)s are in the image\?$")


def _pixels(row) -> np.ndarray:
  return np.asarray(im.load_image(row[shapes.IMAGE_KEY]).convert("RGB"))


def _components(a: np.ndarray) -> list[tuple[str, str, int, int]]:
  """(colour, kind, top, left) of every 4-connected single-colour region that is not
  background, the kind read from how much of its bounding box it fills."""
  names = {rgb: name for name, rgb in shapes.COLOURS.items()}
  h, w, _ = a.shape
  seen = np.zeros((h, w), bool)
  out = []
  for y in range(h):
    for x in range(w):
      rgb = tuple(int(v) for v in a[y, x])
      if seen[y, x] or rgb == shapes.BACKGROUND:
        continue
      assert rgb in names, f"pixel ({x}, {y}) is {rgb}: not a palette colour (anti-aliased?)"
      seen[y, x] = True
      todo, area, ys, xs = deque([(y, x)]), 0, [], []
      while todo:
        cy, cx = todo.popleft()
        area += 1
        ys.append(cy)
        xs.append(cx)
        for ny, nx in ((cy + 1, cx), (cy - 1, cx), (cy, cx + 1), (cy, cx - 1)):
          if 0 <= ny < h and 0 <= nx < w and not seen[ny, nx] and tuple(a[ny, nx]) == rgb:
            seen[ny, nx] = True
            todo.append((ny, nx))
      fill = area / ((max(ys) - min(ys) + 1) * (max(xs) - min(xs) + 1))
      kind = "square" if fill > 0.97 else "circle" if fill > 0.66 else "triangle"
      out.append((names[rgb], kind, min(ys), min(xs)))
  return out


@pytest.mark.parametrize("level", shapes.PRESETS)
def test_deterministic_per_seed_and_differs_across_seeds(level):
  task, _ = tasks.parse(f"builtin:shapes:{level}")
  a = task.generate_split(level, "train", 20, seed=3)
  assert a == task.generate_split(level, "train", 20, seed=3)
  assert a != task.generate_split(level, "train", 20, seed=4)
  assert {r["data_source"] for r in a} == {"shapes"}


@pytest.mark.parametrize("level", shapes.PRESETS)
def test_the_picture_holds_the_stated_count(level):
  cfg = shapes.preset(level)
  rows = shapes.make_examples(cfg, "eval", 60, seed=0)
  counts = []
  for row in rows:
    a = _pixels(row)
    assert a.shape == (cfg.size, cfg.size, 3)
    # In reading order: by the grid cell of each region's top-left corner.
    found = sorted(_components(a), key=lambda f: (f[2] // cfg.cell, f[3] // cfg.cell))
    assert cfg.min_shapes <= len(found) <= cfg.max_shapes  # no two shapes touch
    colour, kind = _QUESTION.match(row["prompt"]).groups()
    kind = None if kind == "shape" else kind
    want = [(c, k) for c, k, *_ in found if colour in (None, c) and kind in (None, k)]
    counts.append(shapes.final_answer(row))
    assert counts[-1] == len(want), (row["prompt"], row["answer"], found)
    # The worked answer names the matching shapes in reading order (the grid's cells).
    listed = row["answer"].split("\n")[0]
    if want:
      assert listed.split(", ") == [f"{c} {k}" for c, k in want]
  assert len(set(counts)) >= 2  # not one constant answer


def test_eval_images_are_not_train_images():
  cfg = shapes.preset("basic")
  train = shapes.make_examples(cfg, "train", 2000, seed=0, unique=False)
  held = shapes.make_examples(cfg, "eval", 300, seed=0, unique=True)
  train_pixels = {_pixels(r).tobytes() for r in train}
  held_pixels = [_pixels(r).tobytes() for r in held]
  assert len(set(held_pixels)) == len(held_pixels)  # unique: no image twice
  assert not train_pixels & set(held_pixels)
  # Any eval seed against any train seed: a split is fixed by the scene, seeds only draw.
  other = shapes.make_examples(cfg, "eval", 300, seed=7)
  assert not train_pixels & {_pixels(r).tobytes() for r in other}


def test_sizes_need_no_resize_and_bad_configs_name_the_culprit():
  for cfg in shapes.PRESETS.values():
    assert im.smart_resize(cfg.size, cfg.size) == (cfg.size, cfg.size)
  with pytest.raises(ValueError, match=r"^size=60: a multiple of 28") as e:
    shapes.ShapesConfig(size=60)
  assert "\n" not in str(e.value)
  with pytest.raises(ValueError, match=r"colours \('red', 'pink'\)"):
    shapes.ShapesConfig(colours=("red", "pink"))
  with pytest.raises(ValueError, match=r"max_shapes \(10\) <= grid\*\*2 \(9\)"):
    shapes.ShapesConfig(max_shapes=10)


@pytest.mark.parametrize("level, grid, tokens", [("basic", (1, 4, 4), 4),
                                                 ("medium", (1, 6, 6), 9)])
def test_rows_load_through_prompt_loader(tmp_path, monkeypatch, level, grid, tokens):
  from test_images import _vl_tokenizer
  import ml_collections
  from distflow_jax.run import trainer
  # The built-in flow: dataset_paths writes the task's rows into run_dir/data.
  monkeypatch.setattr(trainer, "BUILTIN_TRAIN_ROWS", 6)
  cfg = ml_collections.ConfigDict({"run_dir": str(tmp_path), "seed": 0, "data": {
      "train": f"builtin:shapes:{level}", "eval": f"builtin:shapes:{level}", "eval_size": 4}})
  train_path, eval_path = trainer.dataset_paths(cfg)
  assert train_path.startswith(str(tmp_path / "data")) and eval_path != train_path
  tok = _vl_tokenizer()
  loader = PromptLoader(train_path, tok, batch_size=1, max_prompt_len=128, process_index=0,
                        process_count=1, shuffle=False, num_epochs=1, image_key="image",
                        on_bad_row="error")
  batches = list(loader)
  assert len(batches) == 6 and loader.counts["ok"] == 6
  rows = tasks.read_jsonl(train_path)
  for batch, row in zip(batches, rows):
    (host,) = batch.host.values()
    assert host["pixel_values"].shape == (grid[1] * grid[2], 3 * 2 * 14 * 14)
    np.testing.assert_array_equal(host["image_grid_thw"], [grid])
    np.testing.assert_array_equal(host["pixel_values"],
                                  im.ImageProcessor().process([im.load_image(row["image"])])[0])
    ids = batch.data["prompt_ids"][0, :int(batch.data["prompt_len"][0])]
    assert int((ids == tok.tok.token_to_id(im.IMAGE_PAD)).sum()) == tokens
    assert int((ids == tok.tok.token_to_id(im.VISION_START)).sum()) == 1
    assert host["prompt"] == row["prompt"]


def test_math_reward_scores_the_answers():
  rows = shapes.make_examples(shapes.preset("medium"), "eval", 8, seed=1)
  truths = [r["answer"] for r in rows]
  right = [f"I count them.\n#### {shapes.final_answer(r)}" for r in rows]
  wrong = [f"#### {shapes.final_answer(r) + 1}" for r in rows]
  np.testing.assert_array_equal(score_batch("math", right, truths), np.ones(8))
  np.testing.assert_array_equal(score_batch("math", truths, truths), np.ones(8))
  np.testing.assert_array_equal(score_batch("math", wrong, truths), np.zeros(8))


def test_registry_resolves_and_demonstrations_keep_the_image():
  assert tasks.parse("builtin:shapes") == (shapes.TASK, "basic")
  assert tasks.parse("builtin:shapes:medium") == (shapes.TASK, "medium")
  assert tasks.image_key(shapes.TASK) == "image"
  assert tasks.image_key(tasks.get("arithmetic")) == tasks.image_key(tasks.get("letters")) == ""
  demos = shapes.TASK.demonstrations("basic", 5, seed=0)
  assert all(d["image"].startswith("data:image/png;base64,") for d in demos)
  assert all(d["completion"].endswith(f"#### {d['completion'].rsplit(' ', 1)[1]}")
             for d in demos)


@pytest.mark.parametrize("override,why", [
    ("data.train=builtin:shapes", "images need a Qwen2.5-VL checkpoint in model.path"),
    ("data.eval=builtin:shapes:medium", "is a vision task but data.train is text-only")])
def test_text_run_refuses_the_vision_task_in_one_line(override, why):
  from distflow_jax.config import loading
  from distflow_jax.config.checks import plan_from_config
  from distflow_jax.dag import FUNCTIONS, Topology
  with pytest.raises(ConfigError) as e:
    plan_from_config(loading.load("grpo:tiny", [override]), Topology(1, 8), FUNCTIONS)
  msg = str(e.value)
  assert "\n" not in msg
  key, _, spec = override.partition("=")
  assert msg.startswith(f"{key}={spec!r}"), msg
  assert why in msg, msg
  # A text task still passes the same check.
  plan_from_config(loading.load("grpo:tiny", ["data.train=builtin:letters"]), Topology(1, 8),
                   FUNCTIONS)


def test_demonstrations_add_whole_picture_questions_and_leave_the_splits_alone():
  """The warm start's demonstrations mix in "How many shapes ...?" (every shape named, an
  answer that depends on the picture alone); the RL splits keep the level's questions."""
  demos = shapes.TASK.demonstrations("basic", 200, seed=0)
  whole = [d for d in demos if d["prompt"] == "How many shapes are in the image?"]
  assert 60 <= len(whole) <= 140, len(whole)  # about half at the basic level
  for d in whole[:20]:
    named, _, count = d["completion"].rpartition("\n#### ")
    assert len(named.split(", ")) == int(count) >= 1
    assert all(n.split()[0] in ("red", "blue") for n in named.split(", "))
  rows = shapes.TASK.generate_split("basic", "train", 200, seed=0)
  assert not any(r["prompt"] == "How many shapes are in the image?" for r in rows)
  medium = shapes.TASK.generate_split("medium", "eval", 200, seed=0)
  assert not any(r["prompt"] == "How many shapes are in the image?" for r in medium)
