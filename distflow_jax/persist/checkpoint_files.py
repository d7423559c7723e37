"""A checkpoint's files on disk: their record, the checks before a restore, the
frozen reference model, reading without a live run (``distflow-jax export``).

The record, ``<step>/_FILES.json``: the size of every file of the step,
written by process 0 once the save has committed (temporary name, then
rename).  Before a restore a missing or resized file is named.  Without a
record (a run killed right after its last save committed, a checkpoint of an
older version) the structural checks still name a missing OCDBT manifest or
an orbax JSON metadata file that is cut short.  The frozen reference model
(``static/reference``) gets the same record, with its array checksums in it.

``checkpoint`` imports this module (and re-exports ``resolve`` and
``read_arrays``); the layout constants and errors both use live in ``checkpoint_contents``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from absl import logging as absl_logging

from distflow_jax import groups
from distflow_jax.persist import checkpoint_contents as ck, checksums

FILES = "_FILES.json"


def list_files(directory: str, record: str = FILES) -> dict[str, int]:
  out = {}
  for root, _, names in os.walk(directory):
    for name in names:
      path = os.path.join(root, name)
      rel = os.path.relpath(path, directory)
      if rel not in (record, record + ".tmp"):
        out[rel] = os.path.getsize(path)
  return out


def write_json(path: str, obj: Any) -> None:
  """Atomically: a temporary name, flushed to disk, then renamed."""
  with open(path + ".tmp", "w") as f:
    json.dump(obj, f, sort_keys=True)
    f.flush()
    os.fsync(f.fileno())
  os.replace(path + ".tmp", path)


def write_record(directory: str, **extra: Any) -> None:
  write_json(os.path.join(directory, FILES), {"files": list_files(directory), **extra})


def read_record(directory: str) -> tuple[dict[str, Any] | None, str | None]:
  """``(record or None, problem or None)``: no record is no problem."""
  path = os.path.join(directory, FILES)
  if not os.path.isfile(path):
    return None, None
  try:
    with open(path) as f:
      record = json.load(f)
    if not isinstance(record.get("files"), dict):
      raise ValueError("no files")
  except (ValueError, OSError, AttributeError):
    return None, f"its file record {FILES} is cut short or garbled"
  return record, None


def file_problem(directory: str, json_files: tuple[str, ...], manifests: tuple[str, ...]
                 ) -> str | None:
  """What is wrong with the files of a saved checkpoint, or None.

  ``json_files``: orbax metadata files that must parse; ``manifests``: an
  OCDBT manifest that must exist where its tree (``ocdbt.process_*``) does.
  """
  record, problem = read_record(directory)
  if problem:
    return problem
  for rel, size in sorted((record or {}).get("files", {}).items()):
    path = os.path.join(directory, rel)
    if not os.path.isfile(path):
      return f"{rel} is missing"
    now = os.path.getsize(path)
    if now != size:
      return f"{rel} has {now} bytes, {size} when saved (cut short or rewritten)"
  for rel in json_files:
    path = os.path.join(directory, rel)
    if not os.path.isfile(path):
      return f"{rel} is missing"
    try:
      with open(path) as f:
        json.load(f)
    except (ValueError, OSError):
      return f"{rel} is cut short or garbled (not valid JSON)"
  for rel in manifests:
    parent = os.path.dirname(os.path.join(directory, rel))
    ocdbt = os.path.isdir(parent) and any(n.startswith("ocdbt.process_")
                                          for n in os.listdir(parent))
    if ocdbt and not os.path.isfile(os.path.join(directory, rel)):
      return f"{rel} is missing"
  return None


def step_problem(directory: str, items: tuple[str, ...], arrays: str) -> str | None:
  """``file_problem`` of an orbax step of JSON items and one array item ``arrays``; with no
  ``items``, of a bare array checkpoint (``StandardCheckpointer``)."""
  if not items:
    return file_problem(directory, ("_METADATA",), ("manifest.ocdbt",))
  return file_problem(directory,
                      tuple(f"{i}/{'_METADATA' if i == arrays else 'metadata'}" for i in items),
                      (f"{arrays}/manifest.ocdbt",))


def read_checked(read: Callable[[], Any]) -> tuple[Any, str | None]:
  """``(read(), None)``, or ``(None, problem)`` when the stored data cannot be read."""
  try:
    return read(), None
  except Exception as e:  # pylint: disable=broad-except
    problem = read_error(e)
    if problem is None:
      raise
    return None, problem


def read_error(e: BaseException) -> str | None:
  """One line for an exception that says the stored data could not be read, else None.

  Orbax wraps tensorstore's ``ValueError`` (or an ``OSError``) in a bare
  ``Exception``; anything else (out of memory, a bug) is not a damaged file.
  """
  chain, seen = [], set()
  while e is not None and id(e) not in seen:
    seen.add(id(e))
    chain.append(e)
    e = e.__cause__ or e.__context__
  causes = [c for c in chain if isinstance(c, (ValueError, OSError))]
  if not causes:
    return None
  text = str(causes[-1]).split(" [tensorstore_spec=")[0].strip().splitlines()
  line = text[0] if text else type(causes[-1]).__name__
  return line if len(line) <= 300 else line[:297] + "..."


# ---- the frozen reference model (``static/reference``) ----------------------------------------

def save_reference(path: str, params: Any, sums: dict[str, str] | None = None) -> None:
  """Saves it (every process), then its record with its array checksums (``sums``, the
  save's own where it computed them: ``checkpoint_contents.save_sums``)."""
  sums = checksums.checksums(params) if sums is None else sums
  ckptr = ocp.StandardCheckpointer(multiprocessing_options=groups.orbax_options())
  ckptr.save(path, ck.savable(params))
  ckptr.wait_until_finished()
  ckptr.close()
  if groups.is_leader():
    write_record(path, checksums=sums)


def restore_reference(path: str, live: Any, log: Callable[[str], None]) -> Any:
  """The saved reference in ``live``'s shardings.  Damage is refused: every step relies on
  it, so there is no earlier checkpoint to fall back to."""
  where = f"the saved reference model {path}"
  problem = checksums.agree(step_problem(path, (), ck.STATE))
  params, ckptr = None, ocp.StandardCheckpointer(multiprocessing_options=groups.orbax_options())
  try:
    if problem is None:
      ck.compare_shapes(ck.flat_shapes(ckptr.metadata(path).item_metadata),
                        ck.flat_shapes(live), where)
      params, problem = read_checked(lambda: ckptr.restore(path, ck.abstract(live)))
      sums = (read_record(path)[0] or {}).get("checksums")
      problem = checksums.agree(problem) or checksums.check(where, sums, params, log)
  finally:
    ckptr.close()
  if problem:
    raise ck.CheckpointError(f"{where} is damaged: {problem}; restore it from a copy, or "
                             f"delete it to use the one built from the model path")
  return params


# ---- reading without a live run ----------------------------------------------------------------

def resolve(path: str) -> tuple[str, int | None]:
  """``(checkpoints root, step or None)`` from a run dir, a checkpoints dir or a step dir."""
  path = os.path.abspath(path)
  if os.path.isdir(os.path.join(path, "checkpoints")):
    return os.path.join(path, "checkpoints"), None
  base = os.path.basename(path)
  if base.isdigit() and os.path.isdir(os.path.join(path, ck.META)):
    return os.path.dirname(path), int(base)
  return path, None


def read_arrays(directory: str, step: int | None = None
                ) -> tuple[int, dict[str, np.ndarray], dict[str, Any]]:
  """``(step, {"actor.params.embed.embedding.value": array}, meta)`` on the host, any topology.

  The arrays are verified against the checksums saved with them.
  """
  verbosity = absl_logging.get_verbosity()
  # orbax warns that it skips the loader item (not wanted here): no warning for a reader.
  absl_logging.set_verbosity(absl_logging.ERROR)
  try:
    return _read_arrays(directory, step)
  finally:
    absl_logging.set_verbosity(verbosity)


def _read_arrays(directory: str, step: int | None
                 ) -> tuple[int, dict[str, np.ndarray], dict[str, Any]]:
  directory = os.path.abspath(directory)
  if not os.path.isdir(directory):  # orbax's manager would create it: a reader never does
    what = "is a file, not a folder" if os.path.exists(directory) else "does not exist"
    raise ck.CheckpointError(f"{directory} {what} (expected <run_dir>/checkpoints or "
                             f"one of its numbered step directories)")
  mgr = ocp.CheckpointManager(directory, item_handlers={
      ck.STATE: ocp.PyTreeCheckpointHandler(), ck.META: ocp.JsonCheckpointHandler()})
  try:
    steps = sorted(mgr.all_steps())
    if not steps:
      raise ck.CheckpointError(f"{directory} holds no complete checkpoint (expected "
                               f"<run_dir>/checkpoints or one of its numbered step directories)")
    if step is None:
      step = steps[-1]
    elif step not in steps:
      raise ck.CheckpointError(f"{directory} has no checkpoint of step {step}; it has {steps}")
    where = f"checkpoint {directory}/{step} (step {step})"
    problem = step_problem(os.path.join(directory, str(step)), (ck.STATE, ck.META), ck.STATE)
    if problem:
      raise ck.CheckpointDamaged(f"{where} is damaged: {problem}")
    md = mgr.item_metadata(step)[ck.STATE]
    if md is None:
      raise ck.CheckpointError(f"checkpoint {directory}/{step} has no {ck.STATE!r} item")
    args = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), md)
    out, problem = read_checked(lambda: mgr.restore(step, args=ocp.args.Composite(**{
        ck.STATE: ocp.args.PyTreeRestore(restore_args=args), ck.META: ocp.args.JsonRestore()})))
    if problem:
      raise ck.CheckpointDamaged(f"{where} is damaged: {problem}")
  finally:
    mgr.close()
  arrays = {n: np.asarray(x) for n, x in checksums.flatten(out[ck.STATE]).items()}
  problem = checksums.verify(out[ck.META].get("checksums"),
                             {n: checksums.host_figures(x) for n, x in arrays.items()})
  if problem:
    raise ck.CheckpointDamaged(f"{where} is damaged: {problem}")
  return step, arrays, out[ck.META]
