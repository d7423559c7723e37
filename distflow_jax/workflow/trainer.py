"""The RL run: set up from the config, warm-start if needed, then step the plan.

    ctx, loaders = setup(cfg)
    for metrics in train(cfg, ctx, loaders): ...

Every process runs the same code; only process 0 writes files.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Callable, Iterator

import jax
import ml_collections

from distflow_jax.config import checks
from distflow_jax.config.loading import ConfigError
from distflow_jax.dag import FUNCTIONS
from distflow_jax.dag.spec import Role
from distflow_jax.data.loader import PromptLoader
from distflow_jax.models import hf_io
from distflow_jax.tasks import arithmetic
from distflow_jax.workflow import checkpoint
from distflow_jax.workflow import evaluate as eval_lib
from distflow_jax.workflow import executor, hints, nodes, roles as roles_lib, warmstart
from distflow_jax.workflow.context import RunContext
from distflow_jax.workflow import tensorboard
from distflow_jax.workflow.metrics import JsonlWriter, Writers

BUILTIN = "builtin:"


@dataclasses.dataclass
class Loaders:
  train: PromptLoader
  eval: PromptLoader | None


def dataset_paths(cfg: ml_collections.ConfigDict) -> tuple[str, str | None]:
  """Local JSONL/Parquet paths for train and eval (None: no evaluation set); built-in
  tasks are written to run_dir."""
  out = []
  for split, spec, count in (("train", cfg.data.train, 20000), ("eval", cfg.data.eval,
                                                                 cfg.data.eval_size)):
    if not spec and split == "eval":
      out.append(None)
      continue
    if not spec:
      raise ConfigError(f"data.{split} is empty: give a local JSONL/Parquet path, e.g. "
                        f"--config.data.{split}=/path/to/gsm8k_{split}.jsonl")
    if spec.startswith(BUILTIN):
      name, _, level = spec[len(BUILTIN):].partition(":")
      if name != "arithmetic":
        raise ConfigError(f"data.{split}={spec!r}: unknown built-in task {name!r}; valid: "
                          f"['arithmetic'] (optionally builtin:arithmetic:easy|medium|hard)")
      task = arithmetic.preset(level or "medium")
      path = os.path.join(cfg.run_dir, "data", f"arithmetic_{level or 'medium'}_{split}.jsonl")
      if not os.path.exists(path):
        # Every process writes identical bytes atomically; no coordination needed.
        # Train questions may repeat (small question spaces); eval questions never do.
        arithmetic.write_jsonl(arithmetic.generate(task, split, count, seed=cfg.seed,
                                                   unique=split == "eval"), path)
      out.append(path)
    else:
      if not os.path.exists(spec):
        raise ConfigError(f"data.{split}={spec!r} does not exist")
      out.append(spec)
  return out[0], out[1]


def _warmstart_dir(cfg) -> str:
  return os.path.join(cfg.run_dir, "warmstart")


def ensure_model(cfg, plan, tokenizer, log: Callable[[str], None]) -> str:
  """The model directory to load: model.path, or the cached/new warm-started built-in model."""
  if cfg.model.path:
    return cfg.model.path
  if not cfg.data.train.startswith(BUILTIN):
    raise ConfigError(f"model.path is empty, so the built-in {cfg.model.preset!r} model would "
                      f"be used, but it is warm-started on the built-in arithmetic task only, "
                      f"not on data.train={cfg.data.train!r}; set --config.model.path to a "
                      f"local Hugging Face model directory")
  wdir = _warmstart_dir(cfg)
  if os.path.isfile(os.path.join(wdir, "config.json")):
    log(f"warm start: using the cached model in {wdir}")
    return wdir
  model_cfg = roles_lib.model_config(cfg, tokenizer, "")
  actor_mesh = roles_lib.jax_mesh(next(m for m in plan.meshes if m.role is Role.ACTOR))
  model = roles_lib.build_actor(model_cfg, actor_mesh, "", cfg.seed)
  from flax import nnx
  graphdef, params = nnx.split(model)
  state = roles_lib.ModelState(Role.ACTOR, actor_mesh, graphdef, params)
  ws = cfg.model.warmstart
  if ws.steps > 0:
    task = cfg.data.train[len(BUILTIN):].partition(":")[2] or "medium"
    records = arithmetic.sft_examples(
        arithmetic.generate(arithmetic.preset(task), "train", ws.examples, seed=cfg.seed + 1,
                            unique=False),
        plain_answer_prob=ws.plain_answer_prob, seed=cfg.seed)
    data = warmstart.encode_examples(records, tokenizer, max_prompt_len=cfg.data.max_prompt_len,
                                     max_new_tokens=cfg.rollout.max_new_tokens,
                                     use_chat_template=cfg.data.chat_template)
    t0 = time.perf_counter()
    loss = warmstart.run(state, data, steps=ws.steps, batch_size=ws.batch_size, lr=ws.lr,
                         seed=cfg.seed,
                         on_step=lambda i, l: log(f"warm start {i + 1}/{ws.steps} loss {l:.3f}"))
    log(f"warm start: {ws.steps} supervised steps in {time.perf_counter() - t0:.0f}s, "
        f"final loss {loss:.3f}")
  hf_io.save_pretrained(wdir, nnx.merge(graphdef, state.params), tokenizer)
  if jax.process_count() > 1:  # only process 0 writes; the others read it next
    from jax.experimental import multihost_utils
    multihost_utils.sync_global_devices("distflow_warmstart_written")
  return wdir


def setup(cfg: ml_collections.ConfigDict, log: Callable[[str], None] = print
          ) -> tuple[RunContext, Loaders]:
  checks.check_runtime_topology(cfg, jax.process_count(), jax.local_device_count())
  topo = checks.topology(cfg)
  plan = checks.plan_from_config(cfg, topo, FUNCTIONS)
  roles_lib.check_topology(topo)
  for s in plan.steps:
    procs = {topo.process_of(d) for d in s.layout.devices}
    if len(procs) != topo.num_processes:
      raise ConfigError(f"node {s.node.id!r} runs on devices of processes {sorted(procs)} "
                        f"only; executing a placement that leaves out whole hosts is not "
                        f"implemented yet (plan it with `distflow-jax plan`)")
  nodes.bind_builtins()
  if cfg.model.path:
    hints.check_model_dir(cfg.model.path)
  tokenizer = roles_lib.load_tokenizer(cfg.model)
  train_path, eval_path = dataset_paths(cfg)
  hints.check_dataset_fields(train_path, cfg.data.prompt_key, cfg.data.answer_key, "data.train")
  if eval_path is None and cfg.trainer.eval_every:
    log("data.eval is empty: no held-out evaluation in this run")
  if cfg.trainer.eval_every and eval_path is not None:
    hints.check_dataset_fields(eval_path, cfg.data.prompt_key, cfg.data.answer_key, "data.eval")
  model_path = ensure_model(cfg, plan, tokenizer, log)
  model_cfg = roles_lib.model_config(cfg, tokenizer, model_path)
  roles = roles_lib.build_roles(cfg, plan, model_cfg, model_path, tokenizer)
  ctx = RunContext(cfg=cfg, plan=plan, topo=topo, process_index=jax.process_index(),
                   tokenizer=tokenizer, model_cfg=model_cfg, roles=roles)
  nproc = jax.process_count()
  common = dict(tokenizer=tokenizer, max_prompt_len=cfg.data.max_prompt_len,
                pad_id=tokenizer.pad_id, use_chat_template=cfg.data.chat_template,
                prompt_key=cfg.data.prompt_key, answer_key=cfg.data.answer_key,
                on_bad_row=cfg.data.on_bad_row)
  train = PromptLoader(train_path, batch_size=cfg.data.prompts_per_step // nproc,
                       seed=cfg.data.shuffle_seed, **common)
  ev = None
  if cfg.trainer.eval_every and eval_path is not None:
    ev = PromptLoader(eval_path, batch_size=max(cfg.data.eval_size // nproc, 1), shuffle=False,
                      num_epochs=1, **common)
  return ctx, Loaders(train, ev)


def train(cfg: ml_collections.ConfigDict, ctx: RunContext, loaders: Loaders,
          start_step: int = 0, checkpointer: "checkpoint.Checkpointer | None" = None
          ) -> Iterator[dict[str, float]]:
  """Yields each step's metrics (the same on every process).

  With a ``checkpointer`` (see ``checkpoint.open_run``) it saves when due,
  asynchronously, and waits for the last save before returning.
  """
  is_writer = ctx.process_index == 0
  writer = Writers(JsonlWriter(os.path.join(cfg.run_dir, "metrics.jsonl"), is_writer),
                   tensorboard.TensorBoardWriter(os.path.join(cfg.run_dir, tensorboard.SUBDIR),
                                                 is_writer))
  eval_batch = next(iter(loaders.eval)) if loaders.eval is not None else None

  if eval_batch is not None and start_step == 0:
    first = {"step": 0, **eval_lib.evaluate(ctx, eval_batch)}
    writer.write(first)
    yield first
  for step in range(start_step, cfg.trainer.total_steps):
    ctx.step = step
    prompts = next(loaders.train)
    metrics = executor.run_step(ctx, prompts, more_prompts=lambda: next(loaders.train))
    metrics["step"] = step + 1
    metrics["data/bad_rows"] = float(sum(v for k, v in loaders.train.counts.items() if k != "ok"))
    if eval_batch is not None and ((step + 1) % cfg.trainer.eval_every == 0
                                   or step + 1 == cfg.trainer.total_steps):
      metrics.update(eval_lib.evaluate(ctx, eval_batch))
    writer.write(metrics)
    if checkpointer is not None and checkpointer.due(step + 1, cfg.trainer.total_steps):
      checkpointer.save(step + 1, ctx.roles, loaders.train, cfg, ctx.model_cfg, ctx.tokenizer)
    yield metrics
  if checkpointer is not None:
    checkpointer.wait()
