"""Built-in visual task: count coloured shapes in a small generated image.

For the vision-language work: a verifiable task that needs the image to be
answered and is cheap on a CPU.  Each row is one small RGB picture of 1-N flat,
non-overlapping shapes (squares, circles, triangles) in a few colours on white, and a
question about it::

  image:  data:image/png;base64,...   (56x56 at the basic level: 4 image tokens)
  prompt: How many red squares are in the image?
  answer: red square, red square
          #### 2

The answer lists the matching shapes in reading order (cell by cell, rows top to
bottom), then ``#### <count>``, the convention the ``math`` reward
(rewards/math_answer.py) verifies, as for arithmetic and letters.

Images are **base64 PNG data URIs in the row's ``image`` field**, not PNG files next to
the JSONL: ``generate_split`` stays a pure function of (level, split, count, seed) that
returns rows, so the built-in flow (run/trainer.dataset_paths writes
``task.generate_split(...)`` with ``write_jsonl`` into ``run_dir/data``) needs no output
folder and no second kind of file to write atomically, and a row file stays valid when
moved.  The images are tiny flat-colour PNGs (a few hundred bytes), so the JSONL grows by
well under a kilobyte a row; data/image_loading.load_image decodes the URIs.  PNG is lossless, so
the pixels read back are exactly the ones drawn (no anti-aliasing: one colour per shape).

Image sides are multiples of 28 (Qwen2-VL's patch 14 x merge 2) and at least 56x56 (the
processor's ``min_pixels``), so the processor does not resize them: each image is
``(side / 28) ** 2`` placeholder tokens.  Shapes sit in distinct cells of a grid with at
least one blank pixel on every side inside their cell, so no two touch.

Train and eval splits are disjoint as arithmetic's are: each scene (the placement list,
which fixes the pixels) goes to a split by a stable hash, so no image is in both splits;
seeds only choose which scenes of a split are drawn.  ``unique``: no image repeats within
the returned rows.

Pillow is needed to draw (the ``vision`` extra); it is imported when a row is drawn, so
the task registry imports without it.

    rows = make_examples(preset("basic"), "eval", 64, seed=0)
"""

from __future__ import annotations

import base64
import dataclasses
import enum
import io
import random

from distflow_jax.tasks import arithmetic

DATA_SOURCE = "shapes"
IMAGE_KEY = "image"  # the row field holding the image (a data URI)
SPLITS = arithmetic.SPLITS
FACTOR = 28  # Qwen2-VL's patch_size * merge_size: sides that need no resize
MIN_SIDE = 56  # the processor's default min_pixels is 56 * 56
BACKGROUND = (255, 255, 255)
# Saturated colours far apart, so a model (and a test's flood fill) tells them apart.
COLOURS: dict[str, tuple[int, int, int]] = {
    "red": (220, 30, 30), "green": (30, 160, 60), "blue": (40, 70, 220),
    "yellow": (235, 190, 20), "purple": (140, 50, 170),
}
KINDS = ("square", "circle", "triangle")


class Ask(enum.Enum):
  """What a question asks to count."""
  COLOUR_KIND = "colour_kind"  # "How many red squares ..."
  COLOUR = "colour"            # "How many red shapes ..."
  KIND = "kind"                # "How many squares ..."
  ANY = "any"                  # "How many shapes ...": every shape (warm-start demos)


LEVEL_ASKS = (Ask.COLOUR_KIND, Ask.COLOUR, Ask.KIND)  # the medium and hard questions


@dataclasses.dataclass(frozen=True)
class ShapesConfig:
  """Difficulty knobs: a ``size``-pixel square image cut into ``grid x grid`` cells, each
  holding at most one shape; ``min_shapes``-``max_shapes`` shapes of ``kinds`` in
  ``colours``; questions of the ``asks`` kinds; ``absent_prob``: the chance the question
  asks about something not in the picture (count 0); ``eval_fraction``: the share of
  scenes kept for the eval split."""
  size: int = 56
  grid: int = 3
  min_shapes: int = 1
  max_shapes: int = 3
  colours: tuple[str, ...] = ("red", "blue")
  kinds: tuple[str, ...] = ("square",)
  asks: tuple[Ask, ...] = (Ask.COLOUR_KIND,)
  absent_prob: float = 0.1
  eval_fraction: float = 0.2

  def __post_init__(self):
    if self.size < MIN_SIDE or self.size % FACTOR:
      raise ValueError(f"size={self.size}: a multiple of {FACTOR} and >= {MIN_SIDE} wanted "
                       f"(the Qwen2-VL processor then keeps the image as drawn)")
    if not 1 <= self.grid or self.cell < 8:
      raise ValueError(f"grid={self.grid} leaves {self.cell}-pixel cells in a {self.size}-"
                       f"pixel image; cells of at least 8 pixels wanted")
    if not 1 <= self.min_shapes <= self.max_shapes <= self.grid ** 2:
      raise ValueError(f"need 1 <= min_shapes ({self.min_shapes}) <= max_shapes "
                       f"({self.max_shapes}) <= grid**2 ({self.grid ** 2})")
    bad = [c for c in self.colours if c not in COLOURS]
    if bad or not self.colours or len(set(self.colours)) != len(self.colours):
      raise ValueError(f"colours {self.colours!r}: distinct names from {list(COLOURS)} wanted")
    bad = [k for k in self.kinds if k not in KINDS]
    if bad or not self.kinds or len(set(self.kinds)) != len(self.kinds):
      raise ValueError(f"kinds {self.kinds!r}: distinct names from {list(KINDS)} wanted")
    if not self.asks or not all(isinstance(a, Ask) for a in self.asks):
      raise ValueError(f"asks {self.asks!r}: one or more of {[a.name for a in Ask]} wanted")
    if not 0.0 <= self.absent_prob <= 1.0:
      raise ValueError(f"absent_prob must be in [0, 1], got {self.absent_prob}")
    if not 0.0 < self.eval_fraction < 1.0:
      raise ValueError(f"eval_fraction must be in (0, 1), got {self.eval_fraction}")

  @property
  def cell(self) -> int:
    return self.size // self.grid


PRESETS = {
    # 56x56 (4 image tokens), 1-3 squares in red or blue: "How many red squares?".
    "basic": ShapesConfig(),
    # 84x84 (9 image tokens), up to 5 shapes of three kinds in three colours; questions
    # by colour and kind, colour alone or kind alone.
    "medium": ShapesConfig(size=84, grid=4, max_shapes=5, colours=("red", "green", "blue"),
                           kinds=KINDS, asks=LEVEL_ASKS),
    # 112x112 (16 image tokens), 3-8 shapes in four colours.
    "hard": ShapesConfig(size=112, grid=5, min_shapes=3, max_shapes=8,
                         colours=("red", "green", "blue", "yellow"), kinds=KINDS,
                         asks=LEVEL_ASKS),
}


def preset(name: str) -> ShapesConfig:
  try:
    return PRESETS[name]
  except KeyError:
    raise ValueError(f"unknown shapes preset {name!r}; valid: {', '.join(PRESETS)}") from None


# ---------------------------------------------------------------------------------------
# Scenes


@dataclasses.dataclass(frozen=True, order=True)
class Shape:
  """One shape: its grid ``cell`` (row-major), and its ``side``-pixel bounding box at
  (``x0``, ``y0``).  Ordered by cell, i.e. in reading order."""
  cell: int
  kind: str
  colour: str
  x0: int
  y0: int
  side: int

  def name(self) -> str:
    return f"{self.colour} {self.kind}"

  def inside(self) -> tuple[int, int]:
    """(x, y) of a pixel surely painted: the box's centre, lowered for a triangle (whose
    apex is at the top) to two thirds of its height."""
    x = self.x0 + self.side // 2
    y = self.y0 + (2 * self.side) // 3 if self.kind == "triangle" else self.y0 + self.side // 2
    return x, y


@dataclasses.dataclass(frozen=True)
class Target:
  """What to count: shapes of ``colour`` and/or ``kind`` (None: any)."""
  colour: str | None
  kind: str | None

  def matches(self, shape: Shape) -> bool:
    return (self.colour in (None, shape.colour)) and (self.kind in (None, shape.kind))

  def noun(self) -> str:
    """'red squares', 'red shapes' or 'squares'."""
    return " ".join(w for w in (self.colour, f"{self.kind or 'shape'}s") if w)


def sample_scene(cfg: ShapesConfig, rng: random.Random) -> tuple[Shape, ...]:
  """Shapes in distinct cells, in reading order; each inside its cell with a blank pixel
  on every side, so shapes never touch."""
  cell = cfg.cell
  n = rng.randint(cfg.min_shapes, cfg.max_shapes)
  shapes = []
  for c in sorted(rng.sample(range(cfg.grid ** 2), n)):
    side = rng.randint(cell // 2 + 1, cell - 2)
    row, col = divmod(c, cfg.grid)
    shapes.append(Shape(cell=c, kind=rng.choice(cfg.kinds), colour=rng.choice(cfg.colours),
                        x0=col * cell + rng.randint(1, cell - side - 1),
                        y0=row * cell + rng.randint(1, cell - side - 1), side=side))
  return tuple(shapes)


def scene_key(size: int, shapes: tuple[Shape, ...]) -> str:
  """A canonical text for a scene: equal keys, equal pixels (the split's hash input)."""
  return f"{size}|" + ";".join(f"{s.kind},{s.colour},{s.x0},{s.y0},{s.side}" for s in shapes)


def sample_target(cfg: ShapesConfig, shapes: tuple[Shape, ...], rng: random.Random) -> Target:
  """A question's target: usually one of a shape's attributes (count >= 1); with
  ``absent_prob``, one no shape has when there is such (count 0)."""
  ask = rng.choice(cfg.asks)
  def target(colour: str, kind: str) -> Target:
    return Target(colour if ask in (Ask.COLOUR_KIND, Ask.COLOUR) else None,
                  kind if ask in (Ask.COLOUR_KIND, Ask.KIND) else None)
  candidates = list(dict.fromkeys(  # colour or kind alone repeats; keep order
      target(c, k) for c in cfg.colours for k in cfg.kinds))
  absent = [t for t in candidates if not any(t.matches(s) for s in shapes)]
  if absent and rng.random() < cfg.absent_prob:
    return rng.choice(absent)
  s = rng.choice(shapes)
  return target(s.colour, s.kind)


def question(target: Target) -> str:
  return f"How many {target.noun()} are in the image?"


def worked_answer(target: Target, shapes: tuple[Shape, ...]) -> str:
  """The matching shapes in reading order, then ``#### count``."""
  found = [s.name() for s in shapes if target.matches(s)]
  return f"{', '.join(found) if found else 'no ' + target.noun()}\n#### {len(found)}"


def draw(size: int, shapes: tuple[Shape, ...]):
  """The scene as a PIL RGB image, drawn without anti-aliasing (one colour per shape)."""
  from PIL import Image, ImageDraw  # pylint: disable=import-outside-toplevel
  image = Image.new("RGB", (size, size), BACKGROUND)
  pen = ImageDraw.Draw(image)
  for s in shapes:
    fill, x1, y1 = COLOURS[s.colour], s.x0 + s.side - 1, s.y0 + s.side - 1
    if s.kind == "square":
      pen.rectangle((s.x0, s.y0, x1, y1), fill=fill)
    elif s.kind == "circle":
      pen.ellipse((s.x0, s.y0, x1, y1), fill=fill)
    else:  # triangle: apex at the top centre, base along the bottom
      pen.polygon([(s.x0 + (s.side - 1) / 2, s.y0), (x1, y1), (s.x0, y1)], fill=fill)
  return image


def data_uri(image) -> str:
  """A PIL image as a ``data:image/png;base64,...`` URI (data/image_loading.load_image reads it)."""
  buf = io.BytesIO()
  image.save(buf, format="PNG")
  return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode("ascii")


def make_examples(config: ShapesConfig, split: str, num_examples: int, seed: int,
                  *, unique: bool = True) -> list[dict[str, str]]:
  """``num_examples`` deterministic rows of ``split`` for ``seed``: ``{"prompt",
  "answer", "image", "data_source"}``.  ``unique``: no image repeats.  Raises
  ValueError when the split's scene space is too small."""
  if split not in SPLITS:
    raise ValueError(f"unknown split {split!r}; valid: {', '.join(SPLITS)}")
  if num_examples < 0:
    raise ValueError(f"num_examples must be >= 0, got {num_examples}")
  rng = random.Random(f"shapes:{split}:{seed}")
  records, seen = [], set()
  max_tries = 200 * num_examples + 10_000
  for _ in range(max_tries):
    if len(records) == num_examples:
      break
    shapes = sample_scene(config, rng)
    target = sample_target(config, shapes, rng)  # drawn always: the stream stays aligned
    key = scene_key(config.size, shapes)
    if arithmetic.split_of(key, config.eval_fraction) != split or (unique and key in seen):
      continue
    seen.add(key)
    records.append({"prompt": question(target), "answer": worked_answer(target, shapes),
                    IMAGE_KEY: data_uri(draw(config.size, shapes)),
                    "data_source": DATA_SOURCE})
  if len(records) < num_examples:
    raise ValueError(f"found only {len(records)} of {num_examples} distinct {split} images "
                     f"in {max_tries} tries: the scene space of {config} is too small; "
                     f"widen the grid, colours or kinds, or pass unique=False")
  return records


# The count after ``####`` in a record's answer: the built-in tasks share one convention.
final_answer = arithmetic.final_answer


@dataclasses.dataclass(frozen=True)
class ShapesTask:
  """The task as tasks/registry.py names it: ``builtin:shapes[:<level>]``.  ``image_key``
  says its rows carry images (config/values.py refuses it for text runs)."""

  name: str = DATA_SOURCE
  levels: tuple[str, ...] = tuple(PRESETS)
  default_level: str = "basic"
  image_key: str = IMAGE_KEY

  def generate_split(self, level: str, split: str, count: int, *, seed: int,
                     unique: bool = True) -> list[dict[str, str]]:
    return make_examples(preset(level), split, count, seed=seed, unique=unique)

  def demonstrations(self, level: str, count: int, *, seed: int,
                     plain_answer_prob: float = 0.0) -> list[dict[str, str]]:
    # seed + 1 as the other tasks: the warm start sees other scenes than RL's train draw.
    # The image stays with each pair: a completion is only right about its picture.
    # The level's questions plus "How many shapes ...?" (Ask.ANY), whose worked answer
    # names every shape: a caption-like target that depends on the picture alone, where
    # "how many red squares" needs the picture and the question together, a weak signal
    # through a random tower.  configs/grpo_vl.py:tiny without them stayed at the
    # image-blind 42% held out (docs/algorithms.md, "Images in the RL loop").
    cfg = preset(level)
    demo_cfg = dataclasses.replace(cfg, asks=tuple(dict.fromkeys(cfg.asks + (Ask.ANY,))))
    records = make_examples(demo_cfg, "train", count, seed=seed + 1, unique=False)
    pairs = arithmetic.sft_examples(records, plain_answer_prob=plain_answer_prob, seed=seed)
    return [{**p, IMAGE_KEY: r[IMAGE_KEY]} for p, r in zip(pairs, records)]


TASK = ShapesTask()
