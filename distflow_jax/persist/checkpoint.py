"""Run checkpoints: model and optimizer states, data position, step and config.

Layout under ``<run_dir>/checkpoints`` (an orbax ``CheckpointManager`` root)::

    <step>/state    trained roles: {"actor": {params, opt_state}, "critic": {...}}
    <step>/loader   every process's train-loader state (gathered; JSON)
    <step>/meta     step, seed, process count, model config, the run's config, the
                    algorithm state (``algo_state``: the adaptive KL coefficient) (JSON)
    static/reference  the frozen reference model, written once
    static/tokenizer  the tokenizer, written once (for ``distflow-jax export``)

Saves are asynchronous: ``save`` returns once the arrays are copied off the devices; the
files are written in the background and committed atomically (orbax writes
``<step>.orbax-checkpoint-tmp`` and renames it when every process has finished), so a save
killed half-way leaves the previous checkpoint intact and the half-written one is ignored
with a message.  Every process writes its own shards.  The processes that save are the
group the checkpointer was made in (``groups.within``; an asynchronous run's training
processes on disjoint processes, which must include process 0), else every process.

Integrity: a save stores a checksum of every array in its ``meta``
(``checksums``) and, once committed, the size of every file
(``checkpoint_files``).  A restore checks both and names the damaged file or
array; ``open_run`` then sets the step aside (``<step>.damaged``) and falls
back to the one before, or under ``--resume`` refuses.  The processes agree on
the verdict, but a read error inside orbax on only some of them still stalls
the others in orbax's own barrier until its timeout.

RNG: every random draw of a step is derived from (seed, step, node, process), see
``RunContext.step_rng``, so (seed, step) is the whole RNG state; a resumed run repeats the
uninterrupted one exactly.  State an algorithm carries from step to step
(``RunContext.algo_state``) is saved in ``meta`` when ``open_run`` is given the run's
context; a checkpoint without it (an older version's) restores the config's defaults, or
is refused when the run adapts its KL coefficient (it would silently restart).  What is
checked against the run, part by part, is in ``checkpoint_contents``.

Restores go straight into the shardings of the current run (abstract targets built from
the live state), so a checkpoint written on one mesh or process count restores on
another: orbax reshards.  Supported: any mesh and any process count for the model and
optimizer states.  The data position is exact when the process count is unchanged; with
a different count the loaders cannot continue mid-epoch (each process's shard of an epoch
depends on the count), so they start the epoch after the furthest saved one.  Refused
with an error that names what differs: another model shape, another set of trained
roles, another seed, a missing item.  On a cluster the run directory must be one shared
filesystem.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import re
from collections.abc import Callable
from typing import Any, Protocol

import jax
import ml_collections
import orbax.checkpoint as ocp

from distflow_jax import groups
from distflow_jax.dag.spec import Role
from distflow_jax.data.loader import PromptLoader
from distflow_jax.models.config import ModelConfig
from distflow_jax.observe import run_config
from distflow_jax.persist import checksums, orbax_quiet
from distflow_jax.persist import checkpoint_files as files
from distflow_jax.state.algo_state import AlgoState
from distflow_jax.state.metrics import trim_metrics  # noqa: F401 (re-exported)
from distflow_jax.persist.checkpoint_contents import (  # noqa: F401 (re-exported)
    FORMAT, ITEMS, LOADER, META, STATE, STATIC, CheckpointDamaged, CheckpointError, abstract,
    base_fingerprint, check_base, check_group, compare_shapes, flat_shapes, put_restored,
    restore_algo_state, restore_loader, savable, save_sums, trained_state)
from distflow_jax.persist.checkpoint_files import read_arrays, resolve  # noqa: F401 (export's)
from distflow_jax.persist.checksums import agree, gather_json
from distflow_jax.state.roles import ModelState

_TMP = re.compile(r"^(\d+)\.orbax-checkpoint-tmp")


def _in_group(method: Callable) -> Callable:
  """Runs a ``Checkpointer`` method among its process group (its collectives, its files)."""
  @functools.wraps(method)
  def run(self, *args, **kwargs):
    with groups.within(self.group):
      return method(self, *args, **kwargs)
  return run


class HasAlgoState(Protocol):
  """Where the run keeps its algorithm state (a ``RunContext``)."""
  algo_state: AlgoState


def checkpoint_dir(run_dir: str) -> str:
  return os.path.join(os.path.abspath(run_dir), "checkpoints")


# ---- the manager ------------------------------------------------------------------------------

class Checkpointer:
  """Saves every ``save_every`` steps and at the end, keeps the last ``keep``."""

  def __init__(self, directory: str, *, save_every: int, keep: int, async_save: bool = True,
               log: Callable[[str], None] = print, ctx: HasAlgoState | None = None):
    self.directory = os.path.abspath(directory)
    self.save_every = save_every
    self.log = log
    self.ctx = ctx  # saves its algo_state; restores set it (None: saved without one)
    # The processes that save and restore (the calling thread's group: the training
    # processes of an asynchronous run on disjoint processes; None: every process).
    self.group = groups.current()
    check_group(self.group)
    self._leader = self.group[0] if self.group else 0  # writes the group's shared files
    self._pending: int | None = None  # a save whose file record is not written yet
    orbax_quiet.install()  # a failed save is raised once, in wait(), not logged per thread
    # Orbax deletes never-committed saves when the manager opens; say so first.
    for name in self.incomplete():
      log(f"checkpoint: ignoring the incomplete save {os.path.join(self.directory, name)} "
          f"(its run stopped before the save committed)")
    if self.group is not None:  # orbax creates the root only when every process saves
      os.makedirs(self.directory, exist_ok=True)
    group = groups.orbax_options()
    self._manager = ocp.CheckpointManager(
        self.directory,
        item_handlers={STATE: ocp.StandardCheckpointHandler(multiprocessing_options=group),
                       LOADER: ocp.JsonCheckpointHandler(multiprocessing_options=group),
                       META: ocp.JsonCheckpointHandler(multiprocessing_options=group)},
        options=ocp.CheckpointManagerOptions(
            max_to_keep=keep if keep > 0 else None, enable_async_checkpointing=async_save,
            create=self.group is None, cleanup_tmp_directories=True,
            multiprocessing_options=group))

  # -- discovery --

  def incomplete(self) -> list[str]:
    """Saves that never committed (their process was killed mid-save)."""
    if not os.path.isdir(self.directory):
      return []
    return sorted(n for n in os.listdir(self.directory) if _TMP.match(n))

  def steps(self) -> list[int]:
    self._manager.reload()
    return sorted(self._manager.all_steps())

  def latest_step(self) -> int | None:
    steps = self.steps()
    return steps[-1] if steps else None

  def due(self, step: int, total: int) -> bool:
    """After ``step`` completed steps: every ``save_every`` and at the last step."""
    return step == total or (self.save_every > 0 and step % self.save_every == 0)

  # -- saving --

  @_in_group
  def save(self, step: int, roles: dict[Role, ModelState], loader: PromptLoader,
           cfg: ml_collections.ConfigDict, model_cfg: ModelConfig, tokenizer: Any = None
           ) -> None:
    """Starts an asynchronous save of ``step`` (every process of the group must call it)."""
    self.wait()  # orbax would wait here anyway; the previous save's file record follows
    sums = save_sums(roles)  # one program per mesh: the state, reference and LoRA base
    self._save_static(roles, tokenizer, sums.reference)
    loaders = gather_json(loader.get_state())
    state = trained_state(roles)
    meta = {"format": FORMAT, "step": step, "seed": cfg.seed,
            "process_count": jax.process_count(), "device_count": jax.device_count(),
            "roles": sorted(state), "model_config": dataclasses.asdict(model_cfg),
            "config": run_config.as_plain(cfg),
            "checksums": sums.state, "lora_base": sums.lora_base}
    if self.ctx is not None:
      meta["algo_state"] = self.ctx.algo_state.to_dict()
    if self._manager.save(step, args=ocp.args.Composite(**{
        STATE: ocp.args.StandardSave(savable(state)),
        LOADER: ocp.args.JsonSave({"processes": loaders}),
        META: ocp.args.JsonSave(meta)})):
      self._pending = step

  def compile_checksums(self, roles: dict[Role, ModelState]) -> None:
    """Runs (and drops) a save's checksums (``save_sums``: one program per mesh) so they
    compile now, not mid-run (trainer.compile_ahead)."""
    save_sums(roles)

  def _save_static(self, roles: dict[Role, ModelState], tokenizer: Any,
                   ref_sums: dict[str, str] | None) -> None:
    ref = os.path.join(self.directory, STATIC, "reference")  # written once per run dir
    if Role.REFERENCE in roles and not os.path.isdir(ref):
      files.save_reference(ref, roles[Role.REFERENCE].params, ref_sums)
    tok = os.path.join(self.directory, STATIC, "tokenizer")
    if tokenizer is not None and groups.is_leader() and not os.path.isdir(tok):
      tokenizer.save(tok + ".tmp")
      os.replace(tok + ".tmp", tok)

  def wait(self) -> None:
    """Blocks until the last save is committed; then writes its file record."""
    self._manager.wait_until_finished()
    step, self._pending = self._pending, None
    path = os.path.join(self.directory, str(step))
    if step is not None and jax.process_index() == self._leader and os.path.isdir(path):
      files.write_record(path)

  def close(self) -> None:
    self.wait()
    self._manager.close()

  # -- restoring --

  @_in_group
  def read_meta(self, step: int) -> dict[str, Any]:
    """The step's meta, once its files pass ``checkpoint_files.file_problem``."""
    path = os.path.join(self.directory, str(step))
    present = sorted(os.listdir(path)) if os.path.isdir(path) else []
    missing = [i for i in ITEMS if i not in present]
    if missing:
      problem = (f"is missing item(s) {missing} (it has "
                 f"{[p for p in present if not p.startswith('_')]}); it was not written by "
                 f"this version or was damaged")
    else:
      damage = files.step_problem(path, ITEMS, STATE)
      problem = damage and f"is damaged: {damage}"
    problem = agree(problem)
    if problem:
      raise CheckpointDamaged(f"checkpoint {path} (step {step}) {problem}")
    meta = self._manager.restore(step, args=ocp.args.Composite(
        **{META: ocp.args.JsonRestore()}))[META]
    if meta.get("format") != FORMAT:
      raise CheckpointError(f"checkpoint {path} has format {meta.get('format')!r}; this "
                            f"version reads format {FORMAT}")
    return meta

  @_in_group
  def restore(self, step: int, roles: dict[Role, ModelState], loader: PromptLoader,
              cfg: ml_collections.ConfigDict) -> dict[str, Any]:
    """Loads ``step`` into ``roles`` (resharded to their meshes), ``loader`` and the
    checkpointer's ``ctx`` (its algorithm state).

    Raises ``CheckpointDamaged`` naming the file or array when the step's
    files changed after the save (nothing is loaded then).
    """
    where = f"checkpoint {os.path.join(self.directory, str(step))} (step {step})"
    meta = self.read_meta(step)
    if meta["seed"] != cfg.seed:
      raise CheckpointError(f"{where} was written with seed={meta['seed']} but this run has "
                            f"seed={cfg.seed}; a resumed run must keep its seed")
    algo = restore_algo_state(cfg, meta.get("algo_state"), where)
    if self.ctx is None and algo != AlgoState():
      raise ValueError("Checkpointer.restore: this run keeps algorithm state across steps; "
                       "give the checkpointer the run's context (open_run(..., ctx=ctx))")
    check_base(meta.get("lora_base"), roles, where)
    live = trained_state(roles)
    if sorted(live) != meta["roles"]:
      raise CheckpointError(f"{where} holds roles {meta['roles']} but this run trains "
                            f"{sorted(live)}")
    saved = self._manager.item_metadata(step)[STATE]
    compare_shapes(flat_shapes(saved), flat_shapes(live), where)
    out, problem = files.read_checked(lambda: self._manager.restore(
        step, args=ocp.args.Composite(**{STATE: ocp.args.StandardRestore(abstract(live)),
                                          LOADER: ocp.args.JsonRestore()})))
    problem = agree(problem) or checksums.check(where, meta.get("checksums"), out[STATE],
                                                self.log)
    if problem:
      raise CheckpointDamaged(f"{where} is damaged: {problem}")
    put_restored(roles, out[STATE])
    restore_loader(loader, out[LOADER]["processes"], self.log)
    if self.ctx is not None:
      self.ctx.algo_state = algo
    self._restore_reference(roles)
    return meta

  @_in_group
  def set_aside(self, step: int) -> str:
    """Renames a damaged step to ``<step>.damaged`` (kept for a look, out of orbax's way)."""
    path = os.path.join(self.directory, str(step))
    dest, n = path + ".damaged", 1
    while os.path.exists(dest):
      dest, n = f"{path}.damaged{n}", n + 1
    if jax.process_index() == self._leader:
      os.rename(path, dest)
    dest = gather_json(dest)[0]  # the leader's; every process waits for the rename
    self._manager.reload()
    return dest

  def _restore_reference(self, roles: dict[Role, ModelState]) -> None:
    ref = os.path.join(self.directory, STATIC, "reference")
    if Role.REFERENCE not in roles:
      return
    if not os.path.isdir(ref):
      self.log("checkpoint: no saved reference model; using the one built from the model path")
      return
    roles[Role.REFERENCE].params = files.restore_reference(ref, roles[Role.REFERENCE].params,
                                                           self.log)


def model_config_from_meta(meta: dict[str, Any]) -> ModelConfig:
  return ModelConfig(**meta["model_config"])


# ---- the run's entry point --------------------------------------------------------------------

def open_run(cfg: ml_collections.ConfigDict, roles: dict[Role, ModelState],
             train_loader: PromptLoader, *, resume: bool | None = None,
             log: Callable[[str], None] = print, ctx: HasAlgoState | None = None
             ) -> tuple[Checkpointer, int]:
  """The run's checkpointer and the step to start from.

  ``resume=None`` continues from the latest complete checkpoint in the run
  directory if there is one; ``True`` requires one; ``False`` refuses to
  start over a run directory that holds checkpoints (they would collide).
  A damaged checkpoint is set aside with a message and the one before it
  restored; under ``resume=True`` it is refused instead.  ``ctx`` (the run's
  ``RunContext``): its algorithm state is saved with every checkpoint and
  restored on resume.
  """
  t = cfg.trainer
  ck = Checkpointer(checkpoint_dir(cfg.run_dir), save_every=t.save_every, keep=t.keep,
                    async_save=t.async_save, log=log, ctx=ctx)
  latest = ck.latest_step()
  if latest is None:
    if resume:
      raise CheckpointError(f"--resume: there is no complete checkpoint in {ck.directory}")
    return ck, 0
  if resume is False:
    raise CheckpointError(f"{ck.directory} holds checkpoints of steps {ck.steps()}; continue "
                          f"them with --resume or choose another --config.run_dir")
  latest = restore_latest(ck, roles, train_loader, cfg, strict=bool(resume))
  log(f"checkpoint: resumed from {os.path.join(ck.directory, str(latest))} (step {latest})")
  if groups.is_leader():
    trim_metrics(os.path.join(cfg.run_dir, "metrics.jsonl"), latest)
  return ck, latest


def restore_latest(ck: Checkpointer, roles: dict[Role, ModelState], loader: PromptLoader,
                   cfg: ml_collections.ConfigDict, *, strict: bool) -> int:
  """Restores the newest undamaged step; ``strict``: a damaged newest step is refused."""
  steps = ck.steps()
  while True:
    step = steps.pop()
    try:
      ck.restore(step, roles, loader, cfg)
      return step
    except CheckpointDamaged as e:
      if strict:
        alt = f"; without --resume the run falls back to step {steps[-1]}" if steps else ""
        raise CheckpointError(f"--resume: {e}{alt}") from e
      if not steps:
        raise CheckpointError(f"{e}; there is no earlier checkpoint to fall back to (move it "
                              f"away to start the run over)") from e
      what = str(e).removeprefix("checkpoint ")
      ck.log(f"checkpoint: {what}; moved it to {ck.set_aside(step)}; falling back to step "
             f"{steps[-1]}")
