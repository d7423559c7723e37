"""``distflow-jax eval``: accuracy and pass@k of a local model on a dataset.

  distflow-jax eval --model=runs/grpo_tiny --data=runs/grpo_tiny/data/arithmetic_basic_eval.jsonl
  distflow-jax eval --config=configs/grpo.py:qwen0.5b --model=/models/Qwen2.5-0.5B-Instruct \\
      --data=/data/gsm8k_test.jsonl --k=8 --out=eval.json

  distflow-jax eval --model=runs/grpo_tiny --data=...            # the run's latest checkpoint
  distflow-jax eval --model=runs/grpo_tiny/checkpoints/40 --data=...

``--model`` is a local Hugging Face directory (the warm start writes one in
``run_dir/warmstart``), a run directory (its latest complete checkpoint's
actor) or one step of it, read as ``distflow-jax export`` reads it;
``--checkpoint`` is the same flag.  The config (default ``grpo:tiny``) says how
prompts are rendered (``data.prompt_key`` / ``data.answer_key``, dotted for nested
rows, ``data.chat_template``,
``data.max_prompt_len``) and decoded (``rollout.max_new_tokens``, slots, and
``rollout.temperature`` for pass@k); override it with ``--config.x=y`` as for
``train``; ``reward.match`` says how answers are compared.  ``--k=1`` (default) is
greedy accuracy (``eval/accuracy``); ``--k>1`` draws k samples per prompt and reports
the unbiased pass@k (``eval/pass@k``) and the accuracy of a single sample, averaged
over all k (``eval/mean_accuracy@k``).

Every row of the file is evaluated (rows the loader refuses are counted and
reported), in chunks of ``--batch_size`` prompts per process; each process
evaluates its own shard on its rollout replica.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Sequence

from absl import flags

from distflow_jax import distributed
from distflow_jax.commands import use_local_devices, with_default_config
from distflow_jax.config import loading
from distflow_jax.config.errors import ConfigError
from distflow_jax.observe import hints, progress
from distflow_jax.persist import destination
from distflow_jax.rewards import registry as reward_registry
from distflow_jax.run import model_source

DEFAULT_CONFIG = "grpo:tiny"


def run(argv: Sequence[str]) -> int:
  fv = flags.FlagValues()
  flags.DEFINE_string("model", None, "local Hugging Face model directory, a run directory "
                      "or RUN_DIR/checkpoints/<step>", flag_values=fv)
  flags.DEFINE_string("checkpoint", None, "the same as --model (a run directory or one of its "
                      "checkpoints)", flag_values=fv)
  flags.DEFINE_string("data", None, "JSONL/Parquet dataset (prompt + answer fields)",
                      flag_values=fv)
  flags.DEFINE_integer("k", 1, "1: greedy accuracy; >1: k samples per prompt, pass@k",
                       flag_values=fv)
  flags.DEFINE_integer("batch_size", 64, "prompts per chunk per process", flag_values=fv)
  flags.DEFINE_integer("limit", 0, "evaluate only the first N rows (0: all)", flag_values=fv)
  flags.DEFINE_string("reward", "math", "rule verifier (rewards registry name)",
                      flag_values=fv)
  flags.DEFINE_string("out", None, "also write the results as JSON here (checked first: an "
                      "existing file needs --overwrite; never a run's own files)",
                      flag_values=fv)
  flags.DEFINE_boolean("overwrite", False, "replace an existing --out file", flag_values=fv)
  argv = with_default_config(argv, DEFAULT_CONFIG)
  rest = loading.parse(fv, argv)
  if rest:
    raise ConfigError(f"eval takes no positional arguments, got {rest}")
  if fv.checkpoint and fv.model:
    raise ConfigError(f"give --model or --checkpoint, not both (--model={fv.model!r}, "
                      f"--checkpoint={fv.checkpoint!r})")
  flag, model = ("--checkpoint", fv.checkpoint) if fv.checkpoint else ("--model", fv.model)
  if not model or not fv.data:
    raise ConfigError("eval needs --model (HF_DIR, a run directory or RUN_DIR/checkpoints/"
                      "<step>) and --data=FILE.jsonl")
  if fv.out:  # before any model is read or any prompt decoded
    destination.check_file(fv.out, overwrite=fv.overwrite)
  if fv.k < 1 or fv.batch_size < 1 or fv.limit < 0:
    raise ConfigError(f"--k={fv.k} and --batch_size={fv.batch_size} must be >= 1, "
                      f"--limit={fv.limit} >= 0")
  source = model_source.kind(model, flag)
  cfg = loading.with_values(fv.config, {"model.path": model if source == "hf" else "",
                                         "data.eval": fv.data})
  # Before anything imports jax (hints and the rewards registry do).
  cfg = use_local_devices(cfg, argv)

  if fv.reward not in reward_registry.reward_names():
    raise ConfigError(f"--reward={fv.reward!r} is unknown; valid: "
                      f"{reward_registry.reward_names()}")
  if not os.path.exists(fv.data):
    raise ConfigError(f"--data={fv.data!r} does not exist")
  if source == "hf":
    hints.check_model_dir(model, flag)
  hints.check_dataset_fields(fv.data, cfg.data.prompt_key, cfg.data.answer_key, "--data")

  info = distributed.initialize()
  from distflow_jax.run import evaluate
  from distflow_jax.run.setup import prepare_run
  log = progress.Logger(info.process_index == 0)
  if source == "checkpoint":
    folder, step = model_source.checkpoint_as_hf(model, flag)
    log(f"{flag}={model}: the actor of step {step}")
    cfg = loading.with_values(cfg, {"model.path": folder})
  try:
    ctx = prepare_run(cfg, roles="actor", log=log).ctx
    cfg = ctx.cfg
    log(f"eval {model} on {fv.data} ({'greedy' if fv.k == 1 else f'pass@{fv.k}'}), "
        f"{info.process_count} process(es) x {info.local_device_count} device(s)")
    result = evaluate.evaluate_file(ctx, fv.data, k=fv.k, batch_size=fv.batch_size,
                                    limit=fv.limit, reward=fv.reward, log=log)
  except Exception as e:  # pylint: disable=broad-except
    hint = hints.oom_hint(e, cfg)
    if hint is None:
      raise
    print(f"distflow-jax eval: {hint}", file=sys.stderr)
    return 1
  result = {"model": model, "data": fv.data, "k": fv.k, "reward": fv.reward, **result}
  if info.process_index == 0:
    for key, v in result.items():
      print(f"{key}: {v:.4f}" if isinstance(v, float) else f"{key}: {v}")
    if fv.out:
      os.makedirs(os.path.dirname(os.path.abspath(fv.out)), exist_ok=True)
      with open(fv.out, "w") as f:
        json.dump(result, f, indent=2, sort_keys=True)
  return 0
