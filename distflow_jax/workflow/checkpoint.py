"""Run checkpoints: model and optimizer states, data position, step and config.

Layout under ``<run_dir>/checkpoints`` (an orbax ``CheckpointManager`` root)::

    <step>/state    trained roles: {"actor": {params, opt_state}, "critic": {...}}
    <step>/loader   every process's train-loader state (gathered; JSON)
    <step>/meta     step, seed, process count, model config, the run's config (JSON)
    static/reference  the frozen reference model, written once
    static/tokenizer  the tokenizer, written once (for ``distflow-jax export``)

Saves are asynchronous: ``save`` returns once the arrays are copied off the
devices; the files are written in the background and committed atomically
(orbax writes ``<step>.orbax-checkpoint-tmp`` and renames it when every
process has finished), so a save killed half-way leaves the previous
checkpoint intact and the half-written one is ignored with a message.
Every process writes its own shards.

RNG: every random draw of a step is derived from (seed, step, node,
process), see ``RunContext.step_rng``, so (seed, step) is the whole RNG
state; a resumed run repeats the uninterrupted one exactly.

Restores go straight into the shardings of the current run (abstract
targets built from the live state), so a checkpoint written on one mesh or
process count restores on another: orbax reshards.  Supported: any mesh and
any process count for the model and optimizer states.  The data position is
exact when the process count is unchanged; with a different count the
loaders cannot continue mid-epoch (each process's shard of an epoch depends
on the count), so they start the epoch after the furthest saved one.  Refused with an error
that names what differs: another model shape, another set of trained roles,
another seed, a missing item.  On a real cluster the run directory must be
one shared filesystem (every process writes its shards into the same step).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from collections.abc import Callable
from typing import Any

import jax
import ml_collections
import numpy as np
import orbax.checkpoint as ocp

from distflow_jax.config.loading import ConfigError
from distflow_jax.dag.spec import Role
from distflow_jax.data.loader import PromptLoader
from distflow_jax.models.config import ModelConfig
from distflow_jax.workflow.roles import ModelState

FORMAT = 1
STATE, LOADER, META = "state", "loader", "meta"
ITEMS = (STATE, LOADER, META)
STATIC = "static"
_TMP = re.compile(r"^(\d+)\.orbax-checkpoint-tmp")


class CheckpointError(ConfigError):
  """A checkpoint that cannot be restored into this run (says what differs)."""


def checkpoint_dir(run_dir: str) -> str:
  return os.path.join(os.path.abspath(run_dir), "checkpoints")


# ---- what is saved ----------------------------------------------------------------------------

def trained_state(roles: dict[Role, ModelState]) -> dict[str, dict[str, Any]]:
  """The pytree saved every time: the actor's and critic's parameters (+ optimizer)."""
  out = {}
  for role in (Role.ACTOR, Role.CRITIC):
    if role in roles:
      s = roles[role]
      out[role.value.lower()] = ({"params": s.params, "opt_state": s.opt_state}
                                 if s.trainable else {"params": s.params})
  return out


def abstract(tree: Any) -> Any:
  """Shape, dtype and *current* sharding of every leaf: the restore target (reshards)."""
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
                      tree)


def _key_name(k: Any) -> str:
  for attr in ("key", "name", "idx"):
    if hasattr(k, attr):
      return str(getattr(k, attr))
  return str(k)


def flat_shapes(tree: Any) -> dict[str, tuple[tuple[int, ...], str]]:
  """``{"actor.params.embed.embedding.value": (shape, dtype)}`` of a pytree or orbax metadata."""
  leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
  return {".".join(_key_name(k) for k in path): (tuple(x.shape), str(np.dtype(x.dtype)))
          for path, x in leaves}


def compare_shapes(saved: dict, live: dict, where: str) -> None:
  """Raises naming every array whose presence, shape or dtype differs."""
  problems = []
  # Parameters first: an optimizer mismatch usually just echoes them.
  for name in sorted(set(saved) | set(live), key=lambda n: (".opt_state." in n, n)):
    if name not in live:
      problems.append(f"{name}: in the checkpoint but not in this run")
    elif name not in saved:
      problems.append(f"{name}: in this run but missing from the checkpoint")
    elif saved[name] != live[name]:
      (ss, sd), (ls, ld) = saved[name], live[name]
      problems.append(f"{name}: checkpoint has shape {ss} {sd}, this run has {ls} {ld}")
  if problems:
    more = f" (and {len(problems) - 8} more)" if len(problems) > 8 else ""
    raise CheckpointError(f"{where} does not match this run's models: "
                          + "; ".join(problems[:8]) + more)


def gather_json(obj: Any) -> list[Any]:
  """Every process's JSON-able ``obj``, in process order (a collective)."""
  if jax.process_count() == 1:
    return [obj]
  from jax.experimental import multihost_utils
  data = np.frombuffer(json.dumps(obj, sort_keys=True).encode(), np.uint8)
  sizes = np.asarray(multihost_utils.process_allgather(np.array([data.size], np.int32)))
  padded = np.zeros(int(sizes.max()), np.uint8)
  padded[:data.size] = data
  rows = np.asarray(multihost_utils.process_allgather(padded))
  return [json.loads(bytes(rows[i, :int(sizes[i, 0])])) for i in range(rows.shape[0])]


def restore_loader(loader: PromptLoader, states: list[dict], log: Callable[[str], None]) -> None:
  """This process's saved position; a fresh epoch if the process count changed."""
  if len(states) == loader.process_count:
    loader.set_state(states[loader.process_index])
    return
  epoch = max(int(s["epoch"]) for s in states) + 1
  log(f"checkpoint: the data position was saved by {len(states)} process(es) and this run "
      f"has {loader.process_count}; the loaders continue at the start of epoch {epoch}")
  loader.set_state({"epoch": epoch, "position": 0, "counts": {}, "seed": loader.seed,
                    "num_records": loader.num_records, "process_index": loader.process_index,
                    "process_count": loader.process_count})


# ---- the manager ------------------------------------------------------------------------------

class Checkpointer:
  """Saves every ``save_every`` steps and at the end, keeps the last ``keep``."""

  def __init__(self, directory: str, *, save_every: int, keep: int, async_save: bool = True,
               log: Callable[[str], None] = print):
    self.directory = os.path.abspath(directory)
    self.save_every = save_every
    self.log = log
    # Orbax deletes never-committed saves when the manager opens; say so first.
    for name in self.incomplete():
      log(f"checkpoint: ignoring the incomplete save {os.path.join(self.directory, name)} "
          f"(its run stopped before the save committed)")
    self._manager = ocp.CheckpointManager(
        self.directory,
        item_handlers={STATE: ocp.StandardCheckpointHandler(),
                       LOADER: ocp.JsonCheckpointHandler(), META: ocp.JsonCheckpointHandler()},
        options=ocp.CheckpointManagerOptions(
            max_to_keep=keep if keep > 0 else None, enable_async_checkpointing=async_save,
            create=True, cleanup_tmp_directories=True))

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

  def save(self, step: int, roles: dict[Role, ModelState], loader: PromptLoader,
           cfg: ml_collections.ConfigDict, model_cfg: ModelConfig, tokenizer: Any = None
           ) -> None:
    """Starts an asynchronous save of ``step`` (every process must call it)."""
    self._save_static(roles, tokenizer)
    loaders = gather_json(loader.get_state())
    meta = {"format": FORMAT, "step": step, "seed": cfg.seed,
            "process_count": jax.process_count(), "device_count": jax.device_count(),
            "roles": sorted(trained_state(roles)),
            "model_config": dataclasses.asdict(model_cfg),
            "config": json.loads(cfg.to_json_best_effort())}
    self._manager.save(step, args=ocp.args.Composite(**{
        STATE: ocp.args.StandardSave(trained_state(roles)),
        LOADER: ocp.args.JsonSave({"processes": loaders}),
        META: ocp.args.JsonSave(meta)}))

  def _save_static(self, roles: dict[Role, ModelState], tokenizer: Any) -> None:
    static = os.path.join(self.directory, STATIC)
    ref = os.path.join(static, "reference")
    if Role.REFERENCE in roles and not os.path.isdir(ref):
      ckptr = ocp.StandardCheckpointer()
      ckptr.save(ref, roles[Role.REFERENCE].params)
      ckptr.wait_until_finished()
      ckptr.close()
    tok = os.path.join(static, "tokenizer")
    if tokenizer is not None and jax.process_index() == 0 and not os.path.isdir(tok):
      tokenizer.save(tok + ".tmp")
      os.replace(tok + ".tmp", tok)

  def wait(self) -> None:
    """Blocks until the last save is committed."""
    self._manager.wait_until_finished()

  def close(self) -> None:
    self._manager.wait_until_finished()
    self._manager.close()

  # -- restoring --

  def read_meta(self, step: int) -> dict[str, Any]:
    path = os.path.join(self.directory, str(step))
    present = sorted(os.listdir(path)) if os.path.isdir(path) else []
    missing = [i for i in ITEMS if i not in present]
    if missing:
      raise CheckpointError(f"checkpoint {path} is missing item(s) {missing} (it has "
                            f"{[p for p in present if not p.startswith('_')]}); it was not "
                            f"written by this version or was damaged")
    meta = self._manager.restore(step, args=ocp.args.Composite(
        **{META: ocp.args.JsonRestore()}))[META]
    if meta.get("format") != FORMAT:
      raise CheckpointError(f"checkpoint {path} has format {meta.get('format')!r}; this "
                            f"version reads format {FORMAT}")
    return meta

  def restore(self, step: int, roles: dict[Role, ModelState], loader: PromptLoader,
              cfg: ml_collections.ConfigDict) -> dict[str, Any]:
    """Loads ``step`` into ``roles`` (resharded to their meshes) and ``loader``."""
    where = f"checkpoint {os.path.join(self.directory, str(step))}"
    meta = self.read_meta(step)
    if meta["seed"] != cfg.seed:
      raise CheckpointError(f"{where} was written with seed={meta['seed']} but this run has "
                            f"seed={cfg.seed}; a resumed run must keep its seed")
    live = trained_state(roles)
    if sorted(live) != meta["roles"]:
      raise CheckpointError(f"{where} holds roles {meta['roles']} but this run trains "
                            f"{sorted(live)}")
    saved = self._manager.item_metadata(step)[STATE]
    compare_shapes(flat_shapes(saved), flat_shapes(live), where)
    try:
      out = self._manager.restore(step, args=ocp.args.Composite(**{
          STATE: ocp.args.StandardRestore(abstract(live)), LOADER: ocp.args.JsonRestore()}))
    except (ValueError, FileNotFoundError, OSError) as e:
      raise CheckpointError(f"{where} cannot be read: {e}") from e
    for name, tree in out[STATE].items():
      s = roles[Role(name.upper())]
      s.params = tree["params"]
      if s.trainable:
        s.opt_state = tree["opt_state"]
    restore_loader(loader, out[LOADER]["processes"], self.log)
    self._restore_reference(roles)
    return meta

  def _restore_reference(self, roles: dict[Role, ModelState]) -> None:
    ref = os.path.join(self.directory, STATIC, "reference")
    if Role.REFERENCE not in roles:
      return
    if not os.path.isdir(ref):
      self.log("checkpoint: no saved reference model; using the one built from the model path")
      return
    live = roles[Role.REFERENCE].params
    ckptr = ocp.StandardCheckpointer()
    try:
      compare_shapes(flat_shapes(ckptr.metadata(ref).item_metadata), flat_shapes(live),
                     f"reference checkpoint {ref}")
      roles[Role.REFERENCE].params = ckptr.restore(ref, abstract(live))
    finally:
      ckptr.close()


def model_config_from_meta(meta: dict[str, Any]) -> ModelConfig:
  return ModelConfig(**meta["model_config"])



# ---- the run's entry point --------------------------------------------------------------------

def open_run(cfg: ml_collections.ConfigDict, roles: dict[Role, ModelState],
             train_loader: PromptLoader, *, resume: bool | None = None,
             log: Callable[[str], None] = print) -> tuple[Checkpointer, int]:
  """The run's checkpointer and the step to start from.

  ``resume=None`` continues from the latest complete checkpoint in the run
  directory if there is one; ``True`` requires one; ``False`` refuses to
  start over a run directory that holds checkpoints (they would collide).
  """
  t = cfg.trainer
  ck = Checkpointer(checkpoint_dir(cfg.run_dir), save_every=t.save_every, keep=t.keep,
                    async_save=t.async_save, log=log)
  latest = ck.latest_step()
  if latest is None:
    if resume:
      raise CheckpointError(f"--resume: there is no complete checkpoint in {ck.directory}")
    return ck, 0
  if resume is False:
    raise CheckpointError(f"{ck.directory} holds checkpoints of steps {ck.steps()}; continue "
                          f"them with --resume or choose another --config.run_dir")
  ck.restore(latest, roles, train_loader, cfg)
  log(f"checkpoint: resumed from {os.path.join(ck.directory, str(latest))} (step {latest})")
  if jax.process_index() == 0:
    trim_metrics(os.path.join(cfg.run_dir, "metrics.jsonl"), latest)
  return ck, latest


def trim_metrics(path: str, step: int) -> None:
  """Drops records of steps after ``step`` (written before a crash, about to be redone)."""
  if not os.path.isfile(path):
    return
  with open(path) as f:
    lines = f.readlines()
  keep = []
  for line in lines:
    try:
      if json.loads(line).get("step", 0) > step:
        continue
    except json.JSONDecodeError:
      continue  # a line cut short by the crash
    keep.append(line)
  if len(keep) != len(lines):
    with open(path + ".tmp", "w") as f:
      f.writelines(keep)
    os.replace(path + ".tmp", path)


# ---- reading without a live run (export, tests) -----------------------------------------------

def resolve(path: str) -> tuple[str, int | None]:
  """``(checkpoints root, step or None)`` from a run dir, a checkpoints dir or a step dir."""
  path = os.path.abspath(path)
  if os.path.isdir(os.path.join(path, "checkpoints")):
    return os.path.join(path, "checkpoints"), None
  base = os.path.basename(path)
  if base.isdigit() and os.path.isdir(os.path.join(path, META)):
    return os.path.dirname(path), int(base)
  return path, None


def read_arrays(directory: str, step: int | None = None
                ) -> tuple[int, dict[str, np.ndarray], dict[str, Any]]:
  """``(step, {"actor.params.embed.embedding.value": array}, meta)`` on the host, any topology."""
  directory = os.path.abspath(directory)
  mgr = ocp.CheckpointManager(directory, item_handlers={
      STATE: ocp.PyTreeCheckpointHandler(), META: ocp.JsonCheckpointHandler()})
  try:
    steps = sorted(mgr.all_steps())
    if not steps:
      raise CheckpointError(f"{directory} holds no complete checkpoint (expected "
                            f"<run_dir>/checkpoints or one of its numbered step directories)")
    if step is None:
      step = steps[-1]
    elif step not in steps:
      raise CheckpointError(f"{directory} has no checkpoint of step {step}; it has {steps}")
    md = mgr.item_metadata(step)[STATE]
    if md is None:
      raise CheckpointError(f"checkpoint {directory}/{step} has no {STATE!r} item")
    args = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), md)
    out = mgr.restore(step, args=ocp.args.Composite(**{
        STATE: ocp.args.PyTreeRestore(restore_args=args), META: ocp.args.JsonRestore()}))
  finally:
    mgr.close()
  leaves = jax.tree_util.tree_flatten_with_path(out[STATE])[0]
  arrays = {".".join(_key_name(k) for k in p): np.asarray(x) for p, x in leaves}
  return step, arrays, out[META]
