"""A GRPO run on the built-in visual task (builtin:shapes) with a tiny random Qwen2.5-VL
checkpoint: images go through the loader, the frozen tower (once per prompt), the
reference rollout backend and every sequence pass (issue 20 item 3)."""

import math

import jax
import numpy as np
import pytest
from flax import nnx

from distflow_jax.config import loading
from distflow_jax.config.loading import ConfigError
from distflow_jax.dag.spec import Role
from distflow_jax.data import images as im
from distflow_jax.models.config import ModelConfig
from distflow_jax.models.vision import VisionConfig
from distflow_jax.models.vl import VLConfig, VLModel, save_vl_pretrained
from distflow_jax.run import trainer
from workflow_util import smoke_overrides


def tiny_vl_checkpoint(path, seed=0):
  """A random Qwen2.5-VL folder (config.json, model.safetensors, tokenizer.json): the
  built-in tokenizer plus the vision tokens; the tower takes the image processor's
  14-pixel patches."""
  from test_images import _vl_tokenizer
  tok = _vl_tokenizer(path)
  ids = {t: tok.tok.token_to_id(t) for t in (im.IMAGE_PAD, im.VISION_START, im.VISION_END,
                                             "<|video_pad|>")}
  text = ModelConfig(arch="qwen2", vocab_size=-(-tok.vocab_size // 8) * 8, hidden_size=32,
                     intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                     head_dim=8, rope_theta=1000.0, qkv_bias=True, tie_embeddings=True,
                     mrope_section=(2, 1, 1))
  vision = VisionConfig(depth=1, hidden_size=16, intermediate_size=32, num_heads=2,
                        patch_size=14, temporal_patch_size=2, spatial_merge_size=2,
                        window_size=112, out_hidden_size=32)
  cfg = VLConfig(text=text, vision=vision, image_token_id=ids[im.IMAGE_PAD],
                 video_token_id=ids["<|video_pad|>"], vision_start_token_id=ids[im.VISION_START],
                 vision_end_token_id=ids[im.VISION_END])
  save_vl_pretrained(path, VLModel(cfg, rngs=nnx.Rngs(seed)))
  return path


VL = ["rollout.backend=reference", "data.train=builtin:shapes", "data.eval=",
      "data.max_prompt_len=96", "rollout.prefill_buckets=(96,)", "rollout.max_new_tokens=6",
      "data.prompts_per_step=8", "rollout.n=2", "actor.micro_batch_size=1",
      "trainer.total_steps=2", "model.max_seq_len=128",
      # The micro model earns no reward on shapes and its reference is its policy, so
      # without an entropy term the step-1 gradient is rounding noise (exactly 0 with XLA's
      # legacy CPU emitters) and "the weights moved" would test nothing.
      "actor.entropy_coef=0.01"]


@pytest.mark.timeout(900)
@pytest.mark.parametrize("share,extra", [
    (True, ()), (False, ()), (False, ("trainer.deterministic=True",)),
    (True, ("algo.dynamic_sampling_tries=2",))])
@pytest.mark.slow
def test_grpo_on_shapes_with_a_tiny_vl_model(tmp_path, monkeypatch, share, extra):
  monkeypatch.setattr(trainer, "BUILTIN_TRAIN_ROWS", 32)
  ckpt = tiny_vl_checkpoint(tmp_path / "vl")
  cfg = loading.load("grpo:tiny", smoke_overrides(
      tmp_path / "run", "cluster.devices_per_process=8", f"model.path={ckpt}", *VL,
      f"model.share_prompt_prefix={share}", "data.eval=builtin:shapes", "trainer.eval_every=2",
      *extra))
  ctx, loaders = trainer.setup(cfg, log=lambda m: None)
  assert ctx.vision is not None
  before = jax.tree.map(np.asarray, ctx.roles[Role.ACTOR].params)
  rows = list(trainer.train(ctx, loaders))
  assert [m["step"] for m in rows] == [0, 1, 2]  # step 0: the evaluation before training
  metrics = rows[1:]
  for m in metrics:
    for key in ("reward", "actor/loss", "actor/grad_norm", "actor/kl", "actor/entropy",
                "response_length"):
      assert key in m and math.isfinite(m[key]), (key, m)
    assert m["actor/skipped"] == 0.0
  assert math.isfinite(metrics[-1]["eval/accuracy"])  # greedy on held-out images
  after = jax.tree.map(np.asarray, ctx.roles[Role.ACTOR].params)
  assert any(not np.array_equal(a, b) for a, b in zip(jax.tree.leaves(before),
                                                      jax.tree.leaves(after)))


@pytest.mark.parametrize("override,why", [
    ("rollout.backend=engine", "set rollout.backend=reference"),
    ("model.pack_sequences=True", "set model.pack_sequences=False"),
    ("model.train_vision=True", "not built yet"),
    ("model.path=", "Qwen2.5-VL checkpoint in model.path"),
    ("ppo", "critic's passes")])
def test_unsupported_combinations_are_refused_in_one_line(tmp_path, override, why):
  from distflow_jax.config.checks import plan_from_config
  from distflow_jax.dag import FUNCTIONS, Topology
  with pytest.raises(ConfigError) as e:
    plan_from_config(loading.load("ppo:tiny" if override == "ppo" else "grpo:tiny", [
        "model.path=/some/vl", *VL, "model.share_prompt_prefix=False",
        *([] if override == "ppo" else [override])]),
        Topology(1, 8), FUNCTIONS)
  assert "\n" not in str(e.value) and why in str(e.value), str(e.value)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_export_and_eval_of_a_vl_run_keep_the_tower(tmp_path, capsys):
  """`distflow-jax export` of a vision-language run writes the whole Qwen2.5-VL: the
  starting folder's (frozen) tower beside the trained decoder; `eval --model=RUN_DIR`
  then reads images.  With the starting folder gone, export refuses in one line."""
  import shutil
  from distflow_jax import cli
  from distflow_jax.models.vl import load_vl_pretrained
  from distflow_jax.state import vision
  ckpt = tiny_vl_checkpoint(tmp_path / "vl")
  run_dir, out = tmp_path / "run", tmp_path / "exported"
  flags = ["--config=grpo:tiny", f"--config.run_dir={run_dir}", f"--config.model.path={ckpt}",
           *(f"--config.{o}" for o in VL if not o.startswith("data.eval")),
           "--config.data.eval=", "--config.trainer.total_steps=1",
           "--config.trainer.save_every=1", "--config.trainer.async_save=False",
           "--config.model.warmstart.steps=0"]
  assert cli.main(["train", *flags]) == 0, capsys.readouterr().err[-2000:]
  capsys.readouterr()
  assert cli.main(["export", "--checkpoint", str(run_dir), "--out", str(out)]) == 0
  assert vision.is_vl_checkpoint(str(out))
  base, exported = load_vl_pretrained(ckpt), load_vl_pretrained(out)
  same = lambda a, b: all(np.array_equal(x, y) for x, y in zip(  # noqa: E731
      jax.tree.leaves(nnx.state(a)), jax.tree.leaves(nnx.state(b))))
  assert same(base.visual, exported.visual)          # the frozen tower, as it started
  assert not same(base.language, exported.language)  # the decoder RL trained
  data = tmp_path / "eval.jsonl"
  from distflow_jax.tasks import shapes
  from distflow_jax.tasks.arithmetic import write_jsonl
  write_jsonl(shapes.TASK.generate_split("basic", "eval", 4, seed=0), str(data))
  from distflow_jax.observe import progress
  eval_flags = progress.eval_config_args(flags)  # what the end-of-run hint repeats
  assert cli.main(["eval", *eval_flags, f"--model={run_dir}", f"--data={data}"]) == 0, \
      capsys.readouterr().err[-2000:]
  assert "eval/accuracy:" in capsys.readouterr().out
  shutil.rmtree(ckpt)
  assert cli.main(["export", "--checkpoint", str(run_dir), "--out", str(tmp_path / "x")]) == 2
  err = [l for l in capsys.readouterr().err.splitlines() if l.startswith("distflow-jax")]
  assert len(err) == 1 and "vision tower" in err[0] and str(ckpt) in err[0], err
