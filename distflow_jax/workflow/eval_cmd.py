"""``distflow-jax eval``: accuracy and pass@k of a local model on a dataset.

  distflow-jax eval --model=runs/grpo_tiny/warmstart --data=runs/grpo_tiny/data/arithmetic_medium_eval.jsonl
  distflow-jax eval --config=configs/grpo.py:qwen0.5b --model=/models/Qwen2.5-0.5B-Instruct \\
      --data=/data/gsm8k_test.jsonl --k=8 --out=eval.json

``--model`` is a local Hugging Face directory (the warm start writes one in
``run_dir/warmstart``).  The config (default ``grpo:tiny``) says how prompts
are rendered (``data.prompt_key``, ``data.chat_template``,
``data.max_prompt_len``) and decoded (``rollout.max_new_tokens``, slots, and
``rollout.temperature`` for pass@k); override it with ``--config.x=y`` as for
``train``.  ``--k=1`` (default) is greedy accuracy; ``--k>1`` draws k samples
per prompt and reports the unbiased pass@k and the per-sample accuracy.

Every row of the file is evaluated (rows the loader refuses are counted and
reported), in chunks of ``--batch_size`` prompts per process; each process
evaluates its own shard on its rollout replica (see ``evaluate.evaluate``).
"""

from __future__ import annotations

import json
import math
import os
import sys
from collections.abc import Sequence
from typing import Any

import ml_collections
import numpy as np
from absl import flags

from distflow_jax.config import loading
from distflow_jax.config.loading import ConfigError

DEFAULT_CONFIG = "grpo:tiny"


class _Head:
  """The first ``n`` records of a source (``--limit``)."""

  def __init__(self, source: Any, n: int):
    self.source, self.n, self.path = source, min(n, len(source)), source.path

  def __len__(self) -> int:
    return self.n

  def __getitem__(self, index: int) -> Any:
    if not 0 <= index < self.n:
      raise IndexError(index)
    return self.source[index]


def build_context(cfg: ml_collections.ConfigDict, model_path: str):
  """A RunContext holding only the actor (no optimizer, no reference), on the actor's mesh."""
  import jax
  from flax import nnx

  from distflow_jax.config import checks
  from distflow_jax.dag import FUNCTIONS
  from distflow_jax.dag.spec import Role
  from distflow_jax.workflow import roles as roles_lib
  from distflow_jax.workflow.context import RunContext

  checks.check_runtime_topology(cfg, jax.process_count(), jax.local_device_count())
  topo = checks.topology(cfg)
  plan = checks.plan_from_config(cfg, topo, FUNCTIONS)
  roles_lib.check_topology(topo)
  tokenizer = roles_lib.load_tokenizer(cfg.model)
  model_cfg = roles_lib.model_config(cfg, tokenizer, model_path)
  mesh = roles_lib.jax_mesh(next(m for m in plan.meshes if m.role is Role.ACTOR))
  graphdef, params = nnx.split(roles_lib.build_actor(model_cfg, mesh, model_path, cfg.seed))
  actor = roles_lib.ModelState(Role.ACTOR, mesh, graphdef, params)
  return RunContext(cfg=cfg, plan=plan, topo=topo, process_index=jax.process_index(),
                    tokenizer=tokenizer, model_cfg=model_cfg, roles={Role.ACTOR: actor})


def _concat(batches: list) -> Any:
  from distflow_jax.data.batch import Batch
  data = {k: np.concatenate([np.asarray(b.data[k]) for b in batches]) for k in batches[0].data}
  host = {}
  for b in batches:
    host.update(b.host)
  return Batch(data, host)


def _global_sum(x: float) -> float:
  import jax
  if jax.process_count() == 1:
    return float(x)
  from jax.experimental import multihost_utils
  return float(np.asarray(multihost_utils.process_allgather(np.array([x], np.float64))).sum())


def load_shard(ctx, path: str, limit: int = 0) -> tuple[list, dict[str, int], int]:
  """This process's valid prompts as one-row batches, the loader's counts, and the row count."""
  from distflow_jax.data.loader import PromptLoader
  from distflow_jax.data.sources import open_source
  cfg = ctx.cfg
  source = open_source(path)
  if limit:
    source = _Head(source, limit)
  loader = PromptLoader(source, ctx.tokenizer, batch_size=1, max_prompt_len=cfg.data.max_prompt_len,
                        shuffle=False, num_epochs=1, pad_id=ctx.tokenizer.pad_id,
                        prompt_key=cfg.data.prompt_key, answer_key=cfg.data.answer_key,
                        use_chat_template=cfg.data.chat_template,
                        on_bad_row=cfg.data.on_bad_row)
  return list(loader), loader.counts, len(source)


def evaluate_file(ctx, path: str, *, k: int = 1, batch_size: int = 64, limit: int = 0,
                  reward: str = "math", log=print) -> dict[str, float | int]:
  """Metrics over every valid row of ``path``: means weighted by each chunk's prompt count."""
  import jax

  from distflow_jax.workflow import evaluate as eval_lib
  rows, counts, num_records = load_shard(ctx, path, limit)
  nproc = jax.process_count()
  # Same on every process (from the row count alone), so collectives stay in step.
  chunks = max(math.ceil(math.ceil(num_records / nproc) / batch_size), 1)
  if len(rows) < chunks:
    raise ConfigError(f"{path!r}: this process has {len(rows)} valid prompt(s) for {chunks} "
                      f"chunk(s) (loader counts {counts}); raise --batch_size or fix the rows")
  totals: dict[str, float] = {}
  done = 0.0
  for c, part in enumerate(np.array_split(np.arange(len(rows)), chunks)):
    m = eval_lib.evaluate(ctx, _concat([rows[i] for i in part]), k=k, reward=reward)
    n = _global_sum(len(part))
    for key, v in m.items():
      totals[key] = totals.get(key, 0.0) + v * n
    done += n
    acc = totals.get("eval/accuracy", float("nan")) / done
    log(f"eval chunk {c + 1}/{chunks}: {int(done)} prompts, accuracy so far {acc:.4f}")
  out = {key: v / done for key, v in totals.items()}
  out["prompts"] = int(done)
  out["skipped_rows"] = int(_global_sum(sum(v for key, v in counts.items() if key != "ok")))
  return out


def run(argv: Sequence[str]) -> int:
  fv = flags.FlagValues()
  flags.DEFINE_string("model", None, "local Hugging Face model directory", flag_values=fv)
  flags.DEFINE_string("checkpoint", None, "a training checkpoint (not yet: export it to a "
                      "Hugging Face directory first)", flag_values=fv)
  flags.DEFINE_string("data", None, "JSONL/Parquet dataset (prompt + answer fields)",
                      flag_values=fv)
  flags.DEFINE_integer("k", 1, "1: greedy accuracy; >1: k samples per prompt, pass@k",
                       flag_values=fv)
  flags.DEFINE_integer("batch_size", 64, "prompts per chunk per process", flag_values=fv)
  flags.DEFINE_integer("limit", 0, "evaluate only the first N rows (0: all)", flag_values=fv)
  flags.DEFINE_string("reward", "math", "rule verifier (rewards registry name)",
                      flag_values=fv)
  flags.DEFINE_string("out", None, "also write the results as JSON here", flag_values=fv)
  argv = list(argv)
  if not any(a == "--config" or a.startswith("--config=") for a in argv):
    argv.insert(0, f"--config={DEFAULT_CONFIG}")
  rest = loading.parse(fv, argv)
  if rest:
    raise ConfigError(f"eval takes no positional arguments, got {rest}")
  if fv.checkpoint:
    raise ConfigError("--checkpoint is not supported yet: convert it with `distflow-jax export "
                      "--checkpoint DIR --out HF_DIR`, then pass --model=HF_DIR")
  if not fv.model or not fv.data:
    raise ConfigError("eval needs --model=HF_DIR (a local Hugging Face directory) and "
                      "--data=FILE.jsonl")
  if fv.k < 1 or fv.batch_size < 1 or fv.limit < 0:
    raise ConfigError(f"--k={fv.k} and --batch_size={fv.batch_size} must be >= 1, "
                      f"--limit={fv.limit} >= 0")
  cfg = fv.config
  with cfg.unlocked():
    cfg.model.path = fv.model
    cfg.data.eval = fv.data
    if not any(a.startswith("--config.cluster.") for a in argv):
      # Evaluation needs no training topology: take the devices this machine has.
      cfg.cluster.num_processes = cfg.cluster.devices_per_process = 0
  from distflow_jax import distributed
  # Before anything imports jax (hints and the rewards registry do).
  distributed.simulate_cpu_devices(cfg.cluster.devices_per_process)

  from distflow_jax.rewards import registry as reward_registry
  if fv.reward not in reward_registry.reward_names():
    raise ConfigError(f"--reward={fv.reward!r} is unknown; valid: "
                      f"{reward_registry.reward_names()}")
  if not os.path.exists(fv.data):
    raise ConfigError(f"--data={fv.data!r} does not exist")
  from distflow_jax.workflow import hints
  hints.check_model_dir(fv.model, "--model")
  hints.check_dataset_fields(fv.data, cfg.data.prompt_key, cfg.data.answer_key, "--data")

  from distflow_jax import distributed
  info = distributed.initialize()
  from distflow_jax.workflow import progress
  log = progress.Logger(info.process_index == 0)
  try:
    ctx = build_context(cfg, fv.model)
    log(f"eval {fv.model} on {fv.data} ({'greedy' if fv.k == 1 else f'pass@{fv.k}'}), "
        f"{info.process_count} process(es) x {info.local_device_count} device(s)")
    result = evaluate_file(ctx, fv.data, k=fv.k, batch_size=fv.batch_size, limit=fv.limit,
                           reward=fv.reward, log=log)
  except Exception as e:  # pylint: disable=broad-except
    hint = hints.oom_hint(e, cfg)
    if hint is None:
      raise
    print(f"distflow-jax eval: {hint}", file=sys.stderr)
    return 1
  result = {"model": fv.model, "data": fv.data, "k": fv.k, "reward": fv.reward, **result}
  if info.process_index == 0:
    for key, v in result.items():
      print(f"{key}: {v:.4f}" if isinstance(v, float) else f"{key}: {v}")
    if fv.out:
      os.makedirs(os.path.dirname(os.path.abspath(fv.out)), exist_ok=True)
      with open(fv.out, "w") as f:
        json.dump(result, f, indent=2, sort_keys=True)
  return 0
