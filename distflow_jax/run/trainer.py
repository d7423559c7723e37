"""The RL run: set up from the config, warm-start if needed, then step the plan.

    ctx, loaders = setup(cfg)
    for metrics in train(ctx, loaders): ...

``setup`` is ``setup.prepare_run`` with every role, the warm start and the
datasets (files, or built-in tasks written to the run dir); ``train`` steps
the plan.  Every process runs the same code; only process 0 writes files.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Callable, Iterator

import jax
import ml_collections
import numpy as np

from distflow_jax import groups
from distflow_jax.config.errors import ConfigError
from distflow_jax.config.run_sections import Config
from distflow_jax.dag import FUNCTIONS
from distflow_jax.data.loader import UNK_PROMPTS, PromptLoader
from distflow_jax.nodes import rollout as rollout_nodes
from distflow_jax.observe import (health as health_lib, hints, samples as samples_lib, tensorboard,
                                  wandb_log)
from distflow_jax.observe.heartbeat import heartbeat, interval as heartbeat_interval
from distflow_jax.observe.progress import phase
from distflow_jax.persist import checkpoint, deferred_signals
from distflow_jax.run import (async_rollout, compile_cache, compile_overlap, disjoint,
                              disjoint_state, evaluate as eval_lib, executor)
from distflow_jax.run.setup import prepare_run
from distflow_jax.state import warm_shapes
from distflow_jax.state.context import RunContext
from distflow_jax.state.metrics import JsonlWriter, Writers, gather_processes
from distflow_jax.tasks import registry as tasks, split_cache

# Rows written for a built-in task's train split: its questions may repeat (small question
# spaces), the loader cycles through them.
BUILTIN_TRAIN_ROWS = 20000


@dataclasses.dataclass
class Loaders:
  train: PromptLoader
  eval: PromptLoader | None


def dataset_paths(cfg: ml_collections.ConfigDict) -> tuple[str, str | None]:
  """Local JSONL/Parquet paths for train and eval (None: no evaluation set); built-in
  tasks (``builtin:<task>[:<level>]``, tasks/registry.py) are written to run_dir."""
  out = []
  for split, spec, count in (("train", cfg.data.train, BUILTIN_TRAIN_ROWS),
                             ("eval", cfg.data.eval, cfg.data.eval_size)):
    if not spec and split == "eval":
      out.append(None)
      continue
    if not spec:
      raise ConfigError(f"data.{split} is empty: give a local JSONL/Parquet path, e.g. "
                        f"--config.data.{split}=/path/to/gsm8k_{split}.jsonl")
    if tasks.is_builtin(spec):
      try:
        task, level = tasks.parse(spec)
      except tasks.UnknownTaskError as e:
        raise ConfigError(f"data.{split}={spec!r}: {e}") from None
      path = os.path.join(cfg.run_dir, "data", f"{task.name}_{level}_{split}.jsonl")
      if not os.path.exists(path):
        # Every process writes identical bytes atomically; no coordination needed.
        # Train questions may repeat (small question spaces); eval questions never do.
        split_cache.write_split(task, level, split, count, seed=cfg.seed,
                                unique=split == "eval", path=path)
      out.append(path)
    else:
      if not os.path.exists(spec):
        raise ConfigError(f"data.{split}={spec!r} does not exist")
      out.append(spec)
  return out[0], out[1]


def _check_datasets(cfg: ml_collections.ConfigDict, log: Callable[[str], None]
                    ) -> tuple[str, str | None]:
  train_path, eval_path = dataset_paths(cfg)
  hints.check_dataset_fields(train_path, cfg.data.prompt_key, cfg.data.answer_key, "data.train")
  if eval_path is None and cfg.trainer.eval_every:
    log("data.eval is empty: no held-out evaluation in this run")
  if cfg.trainer.eval_every and eval_path is not None:
    hints.check_dataset_fields(eval_path, cfg.data.prompt_key, cfg.data.answer_key, "data.eval")
  return train_path, eval_path


def setup(cfg: ml_collections.ConfigDict, log: Callable[[str], None] = print
          ) -> tuple[RunContext, Loaders]:
  """The run's context (every role the plan places, the warm-started built-in model when
  model.path is empty) and its prompt loaders; datasets are checked before any weights."""
  run = prepare_run(cfg, roles="all", warm_start=True,
                    check_inputs=lambda: _check_datasets(cfg, log), log=log)
  ctx, (train_path, eval_path) = run.ctx, run.inputs
  cfg = ctx.cfg  # the typed view: model.path resolved (the built-in VL model's folder)
  tokenizer = ctx.tokenizer
  nproc, rank = jax.process_count(), jax.process_index()
  split, _ = disjoint.process_role(ctx)
  if split is not None:  # the rollout processes load the prompts (the others never draw)
    nproc, rank = len(split.rollout), (split.rollout.index(rank) if rank in split.rollout
                                        else 0)
  common = dict(tokenizer=tokenizer, max_prompt_len=cfg.data.max_prompt_len,
                pad_id=tokenizer.pad_id, use_chat_template=cfg.data.chat_template,
                prompt_key=cfg.data.prompt_key, answer_key=cfg.data.answer_key,
                on_bad_row=cfg.data.on_bad_row, image_key=cfg.image_key,
                image_root=cfg.data.image_root)
  train = PromptLoader(train_path, batch_size=cfg.data.prompts_per_step // nproc,
                       seed=cfg.data.shuffle_seed, process_index=rank, process_count=nproc,
                       **common)
  if train.short_epochs():  # a step draws more prompts than the file has rows: said
    log(f"data.train: {train.short_epochs()}")
  train = async_rollout.wrap_loader(cfg, train)  # its state holds the batches in flight
  if split is not None and jax.process_index() not in split.rollout:
    train = disjoint_state.TrainingLoader(split, jax.process_index())  # draws no prompts
  ev = None
  if cfg.trainer.eval_every and eval_path is not None:
    ev = PromptLoader(eval_path, batch_size=max(cfg.data.eval_size // nproc, 1), shuffle=False,
                      num_epochs=1, process_index=rank, process_count=nproc, **common)
  return ctx, Loaders(train, ev)


def health_monitor(cfg: Config) -> health_lib.HealthMonitor:
  """The run's health monitor; clipping counts as configured only when it can act (the
  ratio differs from 1: several epochs or mini-batches, or recomputed old log-probs)."""
  a = cfg.actor
  acts = a.ppo_epochs > 1 or a.mini_batches > 1 or a.recompute_old_logprobs
  return health_lib.HealthMonitor(health_lib.HealthConfig.from_config(cfg.trainer.health),
                                  clip_configured=bool(acts))


def train(ctx: RunContext, loaders: Loaders, start_step: int = 0, checkpointer: "checkpoint.Checkpointer | None" = None,
          log: Callable[[str], None] | None = None,
          wandb: wandb_log.WandbWriter | None = None,
          programs_at: compile_overlap.ProgramsAt | None = None
          ) -> Iterator[dict[str, float]]:
  """Yields each step's metrics (the same on every process); the run's config is the
  context's (``ctx.cfg``).

  With a ``checkpointer`` (see ``checkpoint.open_run``) it saves when due,
  asynchronously, and waits for the last save before returning.  Health alarms
  (``observe/health.py``) go to ``log`` when they start; with
  ``trainer.stop_on_collapse`` a collapse signal raises ``health.CollapseError`` naming
  the last checkpoint saved before it (the collapsed step is not saved).  Each evaluation
  logs ``trainer.log_samples`` held-out samples (``observe/samples.py``; process 0, its
  own rows).  With ``logging.wandb`` on, process 0 also logs both to Weights & Biases
  (``observe/wandb_log.py``): through ``wandb`` when given (started before the warm start,
  so a failed login costs nothing), else a writer started here; it is finished at the end.
  Each row carries the backend compiles since the previous row (``compile/count``,
  ``time/compile`` seconds; persistent-cache loads apart: ``compile/cache_hits``,
  ``compile/cache_load_s``), the most over processes: after the first step it is 0 unless
  something recompiled.  ``programs_at`` (``lowering.catalogue.late_programs``, handed in by
  the ``train`` command) lets the first step compile its training programs during its
  rollout (``trainer.compile_overlap``, run/compile_overlap.py); without it they compile
  when their nodes run.
  """
  cfg = ctx.cfg
  split, rollout_side = disjoint.process_role(ctx)
  if rollout_side:  # a rollout process of a run on disjoint processes: no rows to yield
    disjoint.run_rollout(ctx, loaders.train, async_rollout.max_staleness(cfg),
                         cfg.trainer.total_steps, split,
                         next(iter(loaders.eval)) if loaders.eval is not None else None,
                         cfg.trainer.log_samples if ctx.process_index == split.rollout[0]
                         else 0)
    return
  monitor = health_monitor(cfg)
  is_writer = ctx.process_index == (split.training[0] if split is not None else 0)
  board = tensorboard.TensorBoardWriter(os.path.join(cfg.run_dir, tensorboard.SUBDIR),
                                        is_writer)
  if wandb is None:
    wandb = wandb_log.WandbWriter(cfg, is_writer, resuming=start_step > 0)
  writer = Writers(JsonlWriter(os.path.join(cfg.run_dir, "metrics.jsonl"), is_writer), board,
                   wandb)
  sample_writer = samples_lib.SampleWriter(cfg.run_dir, board, cfg.trainer.log_samples,
                                           is_writer, wandb=wandb)
  try:
    with groups.within(split.training if split is not None else None):
      yield from StepLoop(ctx, loaders, start_step, checkpointer, log, monitor, writer,
                          sample_writer, programs_at).run()
  except GeneratorExit:  # the caller stopped early: not a failure
    wandb.close()
    raise
  except BaseException:
    wandb.close(exit_code=1)
    raise
  wandb.close()


class StepLoop:
  """The step loop of one run on this process: the held-out evaluation, the steps (each
  ``one_step`` then ``finish``), the compile tally and the checkpoint saves.  The run's
  parts are its attributes; every method reads them, none takes a long argument list."""

  def __init__(self, ctx: RunContext, loaders: Loaders,
               start_step: int, checkpointer: "checkpoint.Checkpointer | None",
               log: Callable[[str], None] | None, monitor: health_lib.HealthMonitor,
               writer: Writers, sample_writer: samples_lib.SampleWriter,
               programs_at: compile_overlap.ProgramsAt | None):
    self.cfg, self.ctx, self.loaders, self.start_step = ctx.cfg, ctx, loaders, start_step
    self.checkpointer, self.log, self.monitor = checkpointer, log, monitor
    self.writer, self.sample_writer, self.programs_at = writer, sample_writer, programs_at
    self.counter = compile_cache.CompileCounter()
    self.since = self.counter.snapshot()
    self.split, _ = disjoint.process_role(ctx)
    self.has_eval = loaders.eval is not None
    # On disjoint processes the rollout processes evaluate (disjoint.run_rollout): a
    # training process draws no held-out batch (no rows parsed, no images decoded for
    # nothing).
    self.eval_batch = (next(iter(loaders.eval)) if self.has_eval and self.split is None
                       else None)
    self.pipeline = None  # set by run(): the asynchronous rollout, or None (synchronous)
    self.after_step: Callable[[bool], None] = lambda first: None

  def compiles(self, first: bool = False) -> dict[str, float]:
    """The compiles since the previous row (checkpoint saves and the eval included); on
    the first step's row also ``compile/programs``, the programs (compiled or loaded,
    eager operations aside) built since the job started (``plan --programs``' count)."""
    tally = self.counter.since(self.since).metrics()
    if first:
      tally["compile/programs"] = float(self.counter.snapshot().programs)
    names = sorted(tally)
    most = gather_processes(np.array([tally[n] for n in names], np.float64)).max(0)
    self.since = self.counter.snapshot()  # after the gather: its own compile not counted
    return {n: float(v) for n, v in zip(names, most)}

  def evaluate(self, step: int) -> dict[str, float]:
    phase(self.log, "evaluation")
    if self.split is not None:  # the rollout processes evaluate version `step` (disjoint.py)
      out, kept = self.pipeline.evaluate(step)
    else:  # only process 0 keeps samples: the others skip decoding prompts never written
      kept = []
      out = eval_lib.evaluate(self.ctx, self.eval_batch, samples=kept,
                              num_samples=self.sample_writer.num_samples,
                              reward=self.cfg.trainer.eval_reward)
    self.sample_writer.write(step, kept)
    return out

  def run(self) -> Iterator[dict[str, float]]:
    cfg, ctx, loaders = self.cfg, self.ctx, self.loaders
    self.pipeline = (disjoint.TrainerSide(ctx, loaders.train, async_rollout.max_staleness(cfg),
                                          self.start_step, cfg.trainer.total_steps, self.split,
                                          has_eval=self.has_eval)
                     if self.split is not None
                     else async_rollout.start(cfg, ctx, loaders.train, self.start_step))
    self.after_step = compile_ahead(cfg, ctx, self.checkpointer)
    try:
      if self.has_eval and self.start_step == 0:
        with heartbeat(self.log, "evaluation at step 0 (compiling the rollout)",
                       heartbeat_interval(cfg), compiles=True):
          first = {"step": 0, **self.evaluate(0)}
        first.update(self.compiles())
        self.monitor.update(0, first)  # the start: the first best held-out accuracy
        self.writer.write(first)
        yield first
      for step in range(self.start_step, cfg.trainer.total_steps):
        metrics = self.one_step(step)
        self.finish(step, metrics)
        yield metrics
      if self.pipeline is not None:
        self.pipeline.end()
    finally:
      if self.pipeline is not None:
        self.pipeline.close()
    if self.checkpointer is not None:
      self.checkpointer.wait()

  def one_step(self, step: int) -> dict[str, float]:
    """Step ``step`` of the workflow (rollout to training), its metrics reduced over hosts."""
    ctx, first = self.ctx, step == self.start_step
    ctx.step = step
    if first:
      phase(self.log, "compile/first step")  # the first step compiles every node: the slow one
    with heartbeat(self.log if first else None, "compile and first step",
                   heartbeat_interval(self.cfg), compiles=True):
      if self.pipeline is not None:
        return self.pipeline.step(step)
      train = self.loaders.train
      prompts = next(train)
      overlap = compile_overlap.start(ctx, prompts, self.programs_at, self.log) if first else None
      metrics = executor.run_step(ctx, prompts, more_prompts=lambda: next(train),
                                  before_training=overlap and overlap.wait)
      if overlap is not None:
        overlap.wait()  # a chain that never left the rollout layout
        metrics.update(overlap.metrics())
    return metrics

  def finish(self, step: int, metrics: dict[str, float]) -> None:
    """After step ``step``: data counts, the evaluation when due, compiling ahead, the
    compile tally, health alarms, the metrics row and the checkpoint when due."""
    cfg, first, counts = self.cfg, step == self.start_step, self.loaders.train.counts
    metrics["step"] = step + 1
    metrics["data/bad_rows"] = float(getattr(self.pipeline, "bad_rows", None) or sum(
        v for k, v in counts.items() if k not in ("ok", UNK_PROMPTS)))  # the rollout's own
    metrics["data/unk_prompts"] = float(counts.get(UNK_PROMPTS, 0))
    if self.has_eval and ((step + 1) % cfg.trainer.eval_every == 0
                          or step + 1 == cfg.trainer.total_steps):
      metrics.update(self.evaluate(step + 1))
    t0 = time.perf_counter()
    if self.pipeline is not None and first:
      self.pipeline.wait_all()  # the first after_step compiles the rollout's shapes
    with heartbeat(self.log if first else None,
                   "compiling ahead (the shapes later steps may meet)", heartbeat_interval(cfg),
                   compiles=True):
      self.after_step(first)  # counted in this step, not when a shape first shows
    if first:  # outside time/step: the first step's whole cost is the sum
      metrics["compile/ahead_s"] = time.perf_counter() - t0
    metrics.update(self.compiles(first=first))
    alarms = self.monitor.update(step + 1, metrics)
    self.writer.write(metrics)
    for alarm in alarms:
      if self.log is not None:
        self.log(alarm.line())
    collapse = next((a for a in alarms if a.signal.is_collapse), None)
    if collapse is not None and cfg.trainer.stop_on_collapse:
      raise health_lib.CollapseError(_collapse_message(collapse, self.checkpointer))
    ckpt = self.checkpointer
    if ckpt is not None and ckpt.due(step + 1, cfg.trainer.total_steps):
      phase(self.log, "checkpoint save")
      with deferred_signals.deferred():  # a Ctrl-C now lets this save start, then finish
        ckpt.save(step + 1, self.ctx.roles, self.loaders.train, cfg, self.ctx.model_cfg,
                  self.ctx.tokenizer)


def compile_ahead(cfg: Config, ctx: RunContext,
                  checkpointer: "checkpoint.Checkpointer | None" = None
                  ) -> Callable[[bool], None]:
  """The end-of-step hook ``after_step(first)`` that compiles the shapes later steps may
  meet (``trainer.compile_ahead``, warm_shapes.py): after the first step, every prompt
  count and width the rollout engines' prefill can take and a save's checksums; after
  each, the other prompt widths of each function signature first seen in it.  So no later step compiles when
  its prompts fall in a bucket an earlier step did not use, and with the persistent
  cache on a second run loads them all.  A no-op when compile_ahead is off."""
  choice = warm_shapes.CompileAhead(cfg.trainer.compile_ahead)
  if not choice.on(compile_cache.active()):
    return lambda first: None
  widths = set(rollout_nodes.prompt_widths(cfg.rollout.prefill_buckets, cfg.data.max_prompt_len))
  for s in ctx.plan.steps:  # a rollout node's own prefill_buckets override
    if FUNCTIONS.spec(s.node.fn).section == "rollout":
      rollout = ctx.section(s.node, "rollout")
      widths.update(rollout_nodes.prompt_widths(rollout.prefill_buckets,
                                                cfg.data.max_prompt_len))
  ctx.shapes.widths = tuple(sorted(widths))

  def after_step(first: bool) -> None:
    if first:
      ctx.replicas.precompile()
      if checkpointer is not None:
        checkpointer.compile_checksums(ctx.roles)
    ctx.shapes.compile_widths()
  return after_step


def _collapse_message(alarm: health_lib.Alarm, checkpointer) -> str:
  last = None
  if checkpointer is not None:
    checkpointer.wait()
    last = checkpointer.latest_step()
  where = (f"the last good checkpoint is step {last} in {checkpointer.directory}"
           if last is not None else "no checkpoint was saved before it")
  return (f"{alarm.line()}; stopped (trainer.stop_on_collapse); {where}; the collapsed "
          f"step was not saved")
