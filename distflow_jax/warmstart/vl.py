"""The built-in tiny vision-language model: made on first use, warm-started, cached.

``model.path = "builtin:tiny-vl"`` (configs/grpo_vl.py:tiny) asks for it.  A VL run needs
a Qwen2.5-VL folder in ``model.path`` (config/vision_checks.py), and on a CPU there is
none small enough, so ``ensure_model`` makes one: a small random Qwen2.5-VL (the tiny
text preset, a 2-block vision tower) and the built-in tokenizer plus the vision tokens,
then trains it supervised on ``data.train``'s built-in visual task (prompt with its
image -> worked answer) and writes it with ``save_vl_pretrained`` into
``run_dir/warmstart-vl``; ``prepare_run`` then points ``model.path`` there, so the rest
of the run loads it as any checkpoint.  The tower is TRAINED here, unlike in RL (where
it is frozen): it starts random, and random features would carry nothing about the
picture.  The cache is keyed as the text warm start's is (``settings`` + the VL sizes),
and rebuilt when they differ.

    path = ensure_model(cfg, log)      # run_dir/warmstart-vl, cached or made now
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
from flax import nnx
from jax.experimental import multihost_utils

from distflow_jax.config.errors import ConfigError
from distflow_jax.data import images as im
from distflow_jax.data.rows import parse_row
from distflow_jax.models.config import ModelConfig
from distflow_jax.models.tokenizer import Tokenizer
from distflow_jax.models.vision import VisionConfig, vision_layout
from distflow_jax.models.vl import VLConfig, VLModel, save_vl_pretrained, vl_inputs
from distflow_jax.tasks import registry as tasks
from distflow_jax.warmstart import sft, text as warmstart

BUILTIN = "builtin:tiny-vl"  # the model.path that asks for this model
VISION_TOKENS = (im.VISION_START, im.VISION_END, im.IMAGE_PAD, "<|video_pad|>")


def tokenizer() -> Tokenizer:
  """The built-in tokenizer plus Qwen2.5-VL's vision special tokens."""
  import tokenizers  # pylint: disable=import-outside-toplevel
  base = Tokenizer.builtin()
  inner = tokenizers.Tokenizer.from_str(base.tok.to_str())
  inner.add_special_tokens([tokenizers.AddedToken(t, special=True, normalized=False)
                            for t in VISION_TOKENS])
  return Tokenizer(inner, base.config)


def model_config(tok: Tokenizer, dtype: str = "float32") -> VLConfig:
  """The tiny text preset with multimodal RoPE, and a small tower (patch 14, merge 2)."""
  text = ModelConfig.tiny(vocab_size=-(-tok.vocab_size // 8) * 8).replace(
      mrope_section=(8, 8, 8), dtype=dtype)  # head_dim 48: 24 rotary pairs
  vision = VisionConfig(depth=2, hidden_size=64, intermediate_size=128, num_heads=4,
                        patch_size=14, temporal_patch_size=2, spatial_merge_size=2,
                        window_size=112, out_hidden_size=text.hidden_size, dtype=dtype)
  ids = {t: tok.tok.token_to_id(t) for t in VISION_TOKENS}
  return VLConfig(text=text, vision=vision, image_token_id=ids[im.IMAGE_PAD],
                  video_token_id=ids["<|video_pad|>"],
                  vision_start_token_id=ids[im.VISION_START],
                  vision_end_token_id=ids[im.VISION_END])


@dataclasses.dataclass(frozen=True)
class Demos:
  """Demonstrations as one padded sequence each: left-padded prompt ++ completion + EOS."""
  tokens_NxT: np.ndarray        # int32
  mask_NxT: np.ndarray          # bool, real tokens
  target_NxT: np.ndarray        # bool, the tokens the loss predicts (completion + EOS)
  rope_3xNxT: np.ndarray        # multimodal RoPE positions
  positions_NxT: np.ndarray
  pixels_NxPxK: np.ndarray      # each row's image patches (one image, the same grid)
  grid_thw_3: np.ndarray


def encode_demos(records: Sequence[dict], tok: Tokenizer, cfg: VLConfig, *, image_key: str,
                 max_prompt_len: int, max_new_tokens: int, use_chat_template: bool,
                 log: Callable[[str], None] = print) -> Demos:
  """Prompts (with their image placeholders) encoded as the RL loader encodes them; only the
  demonstrations that fit ``max_new_tokens`` (``warmstart.text.fitting_demonstrations``)."""
  records, outs = warmstart.fitting_demonstrations(records, tok, max_new_tokens, log)
  n, p, r = len(records), max_prompt_len, max_new_tokens
  tokens = np.full((n, p + r), tok.pad_id, np.int32)
  mask = np.zeros((n, p + r), bool)
  target = np.zeros((n, p + r), bool)
  pixels, grid = [], None
  for i, (rec, out) in enumerate(zip(records, outs)):
    ex = parse_row({"prompt": rec["prompt"], "answer": rec["completion"],
                    image_key: rec[image_key]}, i, tokenizer=tok, max_prompt_len=p,
                   use_chat_template=use_chat_template, image_key=image_key)
    if not hasattr(ex, "prompt_ids"):
      raise ValueError(f"VL warm-start example {i} cannot be encoded: {ex}")
    g = np.asarray(ex.host["image_grid_thw"]).reshape(-1, 3)
    if len(g) != 1 or (grid is not None and not np.array_equal(g[0], grid)):
      raise ValueError(f"VL warm-start example {i}: grid {g.tolist()}; the warm start takes "
                       f"one image per row, every image the same grid")
    grid = g[0]
    ids = np.asarray(ex.prompt_ids)
    tokens[i, p - len(ids):p] = ids
    tokens[i, p:p + len(out)] = out
    mask[i, p - len(ids):p + len(out)] = True
    target[i, p:p + len(out)] = True
    pixels.append(np.asarray(ex.host["pixel_values"], np.float32))
  grids = np.tile(grid, (n, 1))
  inputs = vl_inputs(cfg, tokens, grids, mask)
  return Demos(tokens, mask, target, np.asarray(inputs.rope_positions_3xBxT),
               np.asarray(inputs.positions_BxT), np.stack(pixels), grid)


def loss_fn(graphdef: nnx.GraphDef, params: nnx.State, batch: dict, layout) -> jax.Array:
  """Mean NLL of the completion tokens under the full VL forward (pixels in, tower too)."""
  b, _, k = batch["pixels_BxPxK"].shape
  logits, _ = nnx.merge(graphdef, params)(
      batch["tokens_BxT"], batch["positions_BxT"], batch["mask_BxT"],
      pixel_values=batch["pixels_BxPxK"].reshape(-1, k), layout=layout,
      rope_positions_3xBxT=batch["rope_3xBxT"])
  logp = jax.nn.log_softmax(logits[:, :-1].astype(jnp.float32))
  nll = -jnp.take_along_axis(logp, batch["tokens_BxT"][:, 1:, None], -1)[..., 0]
  m = batch["target_BxT"][:, 1:].astype(jnp.float32)
  return jnp.sum(nll * m) / jnp.maximum(jnp.sum(m), 1.0)


def make_step(graphdef: nnx.GraphDef, tx: optax.GradientTransformation):
  """One jitted AdamW step over every parameter, the vision tower's included."""
  @jax.jit
  def step(params, opt_state, batch, layout):
    loss, grads = jax.value_and_grad(lambda p: loss_fn(graphdef, p, batch, layout))(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss
  return step


def _batch(d: Demos, rows: np.ndarray) -> dict:
  return {"tokens_BxT": d.tokens_NxT[rows], "mask_BxT": d.mask_NxT[rows],
          "target_BxT": d.target_NxT[rows], "positions_BxT": d.positions_NxT[rows],
          "rope_3xBxT": d.rope_3xNxT[:, rows], "pixels_BxPxK": d.pixels_NxPxK[rows]}


def train(model: VLModel, demos: Demos, *, steps: int, batch_size: int, lr: float, seed: int,
          on_step: Callable[[int, float], None] | None = None) -> list[float]:
  """Trains ``model`` in place (AdamW, warm-up a tenth then cosine, clip 1, as sft.optimizer);
  returns every step's loss.  Batches follow sft.batch_order (seeded, the same each run)."""
  graphdef, params = nnx.split(model)
  tx = sft.optimizer(lr=lr, steps=steps, warmup_steps=max(steps // 10, 1))
  opt_state = tx.init(params)
  step = make_step(graphdef, tx)
  layout = vision_layout(model.cfg.vision, np.tile(demos.grid_thw_3, (batch_size, 1)))
  order = sft.batch_order(len(demos.tokens_NxT), batch_size, seed)
  losses = []
  for i in range(steps):
    params, opt_state, loss = step(params, opt_state, _batch(demos, next(order)), layout)
    losses.append(float(loss))
    if on_step is not None and (i % 10 == 0 or i == steps - 1):
      on_step(i + 1, losses[-1])
  nnx.update(model, params)
  return losses


def settings(cfg: ml_collections.ConfigDict, tok: Tokenizer) -> dict:
  """The cache key: the text warm start's settings plus this model's sizes."""
  key = warmstart.settings(cfg, tok)
  vl = model_config(tok, cfg.model.dtype)
  key.update(preset="tiny-vl", vl=json.loads(json.dumps(
      {"text": dataclasses.asdict(vl.text), "vision": dataclasses.asdict(vl.vision)},
      default=str)))
  return key


def ensure_model(cfg: ml_collections.ConfigDict, log: Callable[[str], None]) -> str:
  """``run_dir/warmstart-vl`` (cached, else made now): the warm-started tiny VL folder."""
  if not tasks.is_builtin(cfg.data.train):
    raise ConfigError(f"model.path={BUILTIN!r} is warm-started on a built-in visual task "
                      f"(data.train=builtin:shapes), not on data.train={cfg.data.train!r}")
  task, level = tasks.parse(cfg.data.train)
  image_key = tasks.image_key(task)
  if not image_key:
    raise ConfigError(f"model.path={BUILTIN!r} needs a visual task; data.train="
                      f"{cfg.data.train!r} has no images (use builtin:shapes)")
  tok = tokenizer()
  key = settings(cfg, tok)
  wdir = os.path.join(cfg.run_dir, "warmstart-vl")
  key_file = os.path.join(wdir, warmstart.KEY_FILE)
  try:
    with open(key_file) as f:
      if json.load(f) == key:
        log(f"VL warm start: using the cached model in {wdir}")
        return wdir
  except (OSError, ValueError):
    pass
  vl_cfg = model_config(tok, cfg.model.dtype)
  model = VLModel(vl_cfg, rngs=nnx.Rngs(cfg.seed))
  ws = cfg.model.warmstart
  if ws.steps > 0:
    records = task.demonstrations(level, ws.examples, seed=cfg.seed,
                                  plain_answer_prob=ws.plain_answer_prob)
    demos = encode_demos(records, tok, vl_cfg, image_key=image_key,
                         max_prompt_len=cfg.data.max_prompt_len,
                         max_new_tokens=cfg.rollout.max_new_tokens,
                         use_chat_template=cfg.data.chat_template, log=log)
    t0 = time.perf_counter()
    losses = train(model, demos, steps=ws.steps, batch_size=ws.batch_size, lr=ws.lr,
                   seed=cfg.seed, on_step=lambda i, l: log(
                       f"VL warm start {i}/{ws.steps} loss {l:.3f}"))
    log(f"VL warm start: {ws.steps} supervised steps (vision tower trained too) in "
        f"{time.perf_counter() - t0:.0f}s, final loss {losses[-1]:.3f}")
  save_vl_pretrained(wdir, model)
  if jax.process_index() == 0:
    tok.save(wdir)
    with open(key_file + ".tmp", "w") as f:  # the key last: a folder with it is complete
      json.dump(key, f, indent=2, sort_keys=True)
    os.replace(key_file + ".tmp", key_file)
  if jax.process_count() > 1:
    multihost_utils.sync_global_devices("distflow_vl_warmstart_written")
  return wdir
