"""Shared by the workflow tests: small overrides that keep a full RL step fast."""

SMOKE = [
    "model.preset=micro",
    "model.warmstart.steps=0",
    "data.max_prompt_len=40",
    "rollout.prefill_buckets=(40,)",
    "rollout.max_new_tokens=8",
    "rollout.max_concurrent_decodes=8",
    "data.eval_size=8",
    "trainer.eval_every=0",
    "trainer.total_steps=3",
    "data.chat_template=True",
]


def smoke_overrides(run_dir, *extra):
  return SMOKE + [f"run_dir={run_dir}", *extra]


def use_tape(cfg, directory, mode):
  """Swap the generate node for tests/plugin_rollout_tape.py's recorder / replayer."""
  import os
  os.environ["DISTFLOW_TEST_TAPE"] = str(directory)
  os.environ["DISTFLOW_TEST_TAPE_MODE"] = mode
  cfg.plugins = tuple(cfg.plugins) + ("plugin_rollout_tape",)
  cfg.dag = [dict(d, fn="generate.tape") if d["fn"] == "generate" else dict(d) for d in cfg.dag]


def params_sum_squares(ctx) -> float:
  """The actor's parameters' sum of squares, in float64 (the same on every process)."""
  import jax
  import numpy as np
  from jax.experimental import multihost_utils

  from distflow_jax.dag.spec import Role
  return float(sum(np.sum(np.asarray(multihost_utils.process_allgather(x, tiled=True),
                                     np.float64) ** 2)
                   for x in jax.tree.leaves(ctx.roles[Role.ACTOR].params)))


def params_digest(ctx):
  """sha256 of the actor's parameters, gathered whole (the same on every process)."""
  import hashlib

  import jax
  import numpy as np
  from jax.experimental import multihost_utils

  from distflow_jax.dag.spec import Role
  h = hashlib.sha256()
  for x in jax.tree.leaves(ctx.roles[Role.ACTOR].params):
    h.update(np.asarray(multihost_utils.process_allgather(x, tiled=True)).tobytes())
  return h.hexdigest()


def tiny_model_folder(tmp_path) -> str:
  """A loadable one-layer llama Hugging Face folder with the built-in tokenizer, in
  ``tmp_path/model``: the model of the in-process ``cli.main(["train", ...])`` tests."""
  from flax import nnx

  from distflow_jax.models.config import ModelConfig
  from distflow_jax.models.hf_io import save_pretrained
  from distflow_jax.models.tokenizer import Tokenizer
  from distflow_jax.models.transformer import Transformer
  tok = Tokenizer.builtin()
  cfg = ModelConfig(arch="llama", vocab_size=tok.vocab_size, hidden_size=32,
                    intermediate_size=48, num_layers=1, num_heads=4, num_kv_heads=2, head_dim=8)
  folder = str(tmp_path / "model")
  save_pretrained(folder, Transformer(cfg, rngs=nnx.Rngs(0)), tokenizer=tok)
  return folder


def summary_values(logdir):
  """(tag, step, Summary.Value proto) of every TensorBoard event file in ``logdir``, read
  from the TFRecord framing directly (no TensorFlow needed)."""
  import glob
  import os
  import struct

  from tensorboardX.proto import event_pb2
  out = []
  for path in glob.glob(os.path.join(logdir, "events.out.tfevents.*")):
    data = open(path, "rb").read()
    pos = 0
    while pos < len(data):
      (n,) = struct.unpack("<Q", data[pos:pos + 8])
      ev = event_pb2.Event.FromString(data[pos + 12:pos + 12 + n])
      pos += 12 + n + 4
      out.extend((v.tag, ev.step, v) for v in ev.summary.value)
  return out


def tiny_train_argv(tmp_path, run_dir, *extra):
  """``distflow-jax train`` argv for the tiny_model_folder model: 8 prompts x 2, 8 new
  tokens, micro-batches of 1, no periodic saves; ``extra`` flags last (they win)."""
  return ["train", "--config=grpo:tiny", f"--config.run_dir={run_dir}",
          f"--config.model.path={tmp_path / 'model'}", "--config.data.prompts_per_step=8",
          "--config.rollout.n=2", "--config.rollout.max_new_tokens=8",
          "--config.actor.micro_batch_size=1", "--config.trainer.save_every=0",
          "--config.trainer.async_save=False", *extra]


def cli_in_process(capsys, *args) -> tuple[int, str, str]:
  """The real command line (``cli.main``) in this process: exit code, stdout, stderr (what
  was printed before the call is dropped)."""
  from distflow_jax import cli
  capsys.readouterr()
  code = cli.main([str(a) for a in args])
  out, err = capsys.readouterr()
  return code, out, err
