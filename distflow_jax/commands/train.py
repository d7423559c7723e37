"""``distflow-jax train``: the RL run of a config, resumable.

  distflow-jax train [--config=configs/grpo.py:tiny] [--resume|--noresume]
      [--distributed=env|auto|none] [--allow_config_change] [--config.x=y ...]

Without ``--config`` it runs the built-in default (``grpo:tiny``).  A dead
peer or running out of memory ends the run with one line saying so (exit 1).
The resolved config goes to ``run_dir/config.json`` (each start appended to
``run_dir/config_history.jsonl``).  A resume compares the config with the
checkpoint's: keys that change what the run computes are refused unless
``--allow_config_change``; others (total_steps, eval_every, save_every, keep,
run_dir, health alarms, layout) pass and are reported.
A finished run (latest checkpoint at trainer.total_steps) has nothing to do
(exit 0).  Ctrl-C says which checkpoint is saved and exits 130.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import sys
import threading
import time
from collections.abc import Sequence

from absl import flags

from distflow_jax import groups
from distflow_jax.commands import define_run_flags, start_job, with_default_config
from distflow_jax.config import loading
from distflow_jax.observe import health, hints, progress, run_config, wandb_log

DEFAULT_CONFIG = "grpo:tiny"


def run(argv: Sequence[str]) -> int:
  try:
    return _run(argv)
  finally:
    while _restore_signals:
      _restore_signals.pop()()


def _run(argv: Sequence[str]) -> int:
  fv = flags.FlagValues()
  define_run_flags(fv, "checkpoint in the run dir")
  flags.DEFINE_boolean("allow_config_change", False, "resume even when the config changes "
                       "keys that change what the run computes (lr, rollout.n, the DAG, ...)",
                       flag_values=fv)
  rest = loading.parse(fv, with_default_config(argv, DEFAULT_CONFIG))
  if rest:
    raise loading.ConfigError(f"train takes no positional arguments, got {rest}")
  cfg = fv.config
  wandb_log.check(cfg)  # logging.wandb without the wandb package: one line, before any work
  info, log = start_job(fv, "config", cfg.run_dir, job="train")
  terminated = _on_sigterm_as_ctrl_c()
  from distflow_jax.persist import checkpoint
  from distflow_jax.run import trainer
  # Before any weights: a refused config change or a finished run costs no warm start.
  resumed = run_config.preflight(cfg, resume=fv.resume, allow_change=fv.allow_config_change,
                                 log=log, live_model=lambda: _model_fields(cfg))
  if resumed.finished:
    log(run_config.finished_message(cfg, resumed))
    return 0
  _model_fields(cfg)  # the model's own checks (LoRA's rank and targets, ...): no warm start yet
  run_config.write_resolved(cfg, resumed, writer=info.process_index == 0)
  ckpt, t0, wandb = None, time.perf_counter(), None
  try:
    # Before the warm start, so a W&B login that fails costs nothing (process 0 only).
    wandb = wandb_log.WandbWriter(cfg, info.process_index == 0,
                                  resuming=resumed.latest is not None and fv.resume is not False)
    ctx, loaders = trainer.setup(cfg, log)
    cfg = ctx.cfg  # the run's config: model.path resolved (the built-in VL model's folder)
    log.nodes = [s.node.id for s in ctx.plan.steps]  # the times line in run order
    from distflow_jax.run import disjoint
    split = disjoint.process_role(ctx)[0]
    if split is not None:
      # An asynchronous run on disjoint processes: the first training process shows the
      # steps (the rollout processes have none); the training processes checkpoint among
      # themselves and tell the rollout processes where the run starts (disjoint_state).
      log.enabled = info.process_index == split.training[0]
      ckpt, start = None, 0
      if info.process_index in split.training:
        from distflow_jax.run import disjoint_state
        try:
          with groups.within(split.training):
            ckpt, start = checkpoint.open_run(cfg, ctx.roles, loaders.train,
                                              resume=fv.resume, log=log, ctx=ctx)
        except Exception as e:  # pylint: disable=broad-except
          disjoint_state.announce_failure(split, str(e) or type(e).__name__)
          raise
    else:
      ckpt, start = checkpoint.open_run(cfg, ctx.roles, loaders.train, resume=fv.resume,
                                        log=log, ctx=ctx)
    t0 = time.perf_counter()
    from distflow_jax.lowering import catalogue
    for m in trainer.train(ctx, loaders, start, checkpointer=ckpt, log=log, wandb=wandb,
                           programs_at=catalogue.late_programs):
      log.step(m, cfg.trainer.total_steps)
    last = None
    if ckpt is not None:
      ckpt.wait()
      last = ckpt.latest_step()
      ckpt.close()
    log.summary(progress.summary_lines(
        cfg.run_dir, checkpoint_dir=checkpoint.checkpoint_dir(cfg.run_dir), last_checkpoint=last,
        steps=cfg.trainer.total_steps - start, seconds=time.perf_counter() - t0,
        eval_data=trainer.dataset_paths(cfg)[1], rate=log.rate(),
        config_args=with_default_config(argv, DEFAULT_CONFIG)))
  except KeyboardInterrupt:
    log.end_line()
    code = 143 if terminated else 130  # 128 + the signal, as the shell reports it
    if wandb is not None:
      wandb.close(exit_code=code)
    how = "terminated (SIGTERM)" if terminated else "interrupted (Ctrl-C)"
    print(f"distflow-jax train: {_interrupted(ckpt, cfg, how)}", file=sys.stderr)
    return code
  except Exception as e:  # pylint: disable=broad-except
    log.end_line()
    if wandb is not None:
      wandb.close(exit_code=1)
    from distflow_jax import peers
    if isinstance(e, health.CollapseError):
      print(f"distflow-jax train: {e}", file=sys.stderr)
      return 1
    if peers.looks_like_peer_failure(e):
      # A dead peer, not a bug here: say which one instead of a collective's traceback.
      print(f"distflow-jax train: {peers.describe(e)}", file=sys.stderr)
      return 1
    hint = hints.oom_hint(e, cfg)
    if hint is None:
      raise
    print(f"distflow-jax train: {hint}", file=sys.stderr)
    return 1
  return 0


def _model_fields(cfg) -> dict | None:
  """This run's model config as a dict, checked, before any weights (None: made later)."""
  from distflow_jax.state import roles
  model = roles.model_config_before_weights(cfg)
  return None if model is None else dataclasses.asdict(model)


def _on_sigterm_as_ctrl_c() -> list:
  """SIGTERM (a scheduler's preemption, ``kill``, ``docker stop``) stops the run as Ctrl-C
  does: the step in progress is abandoned, a save in flight finishes, the run lock is
  released and one line says which checkpoint is left (exit 143).  Returns a list that
  is non-empty once SIGTERM came (the handler raises KeyboardInterrupt in the main
  thread).  Not installed off the main thread (signal handlers cannot be)."""
  came: list = []
  if threading.current_thread() is not threading.main_thread():
    return came

  def handler(signum, frame):  # pylint: disable=unused-argument
    came.append(signum)  # a second one abandons a save in flight, as a second Ctrl-C does
    raise KeyboardInterrupt
  previous = signal.signal(signal.SIGTERM, handler)
  _restore_signals.append(lambda: signal.signal(signal.SIGTERM, previous))
  return came


_restore_signals: list = []  # run() puts the previous SIGTERM handler back when it returns


def _interrupted(ckpt, cfg, how: str = "interrupted (Ctrl-C)") -> str:
  """What Ctrl-C leaves: a save in flight is let finish (a second Ctrl-C abandons it; the
  half-written step is ignored by the next run)."""
  from distflow_jax.persist import checkpoint
  last = None
  if ckpt is not None:
    try:
      ckpt.wait()
      last = ckpt.latest_step()
    except BaseException:  # noqa: BLE001 - a second Ctrl-C, or the save failed
      last = None  # then say what is on disk
  directory = checkpoint.checkpoint_dir(cfg.run_dir)
  if last is None and os.path.isdir(directory):
    steps = run_config.committed_steps(cfg.run_dir)
    last = steps[-1] if steps else None
  return progress.interrupted_line(last, directory, how)
