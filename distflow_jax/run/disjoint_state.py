"""What an asynchronous run on disjoint processes (run/disjoint.py) saves and resumes from.

A checkpoint after step s is written by the training processes alone (their group's
orbax save, ``groups.orbax_options``); the rollout processes hold no trained state.  It
holds, beside the trained roles, what the two groups had between them:

* the batches in flight: s + 1 .. s + K, generated (from versions <= s) but not trained
  yet.  The training processes wait for them (their transfers need nothing newer than
  version s) and save them as each one's rows of the first training node's layout, with
  the rollout processes' metadata for them (their metrics);
* every rollout process's prompt-loader position after the newest of those batches,
  which each rollout process publishes with a batch's metadata.

A resume restores them on the training processes (``TrainingLoader``), which then tell
the rollout processes where the run starts (``announce``: the step, how many batches
came from the checkpoint, each one's loader position) through the coordination
service; a rollout process waits for that word before it generates (``await_start``).
The rollout then makes batch s + K + 1 with version s + 1, as the uninterrupted run
does: a resumed run equals it, and loses no sample and trains none twice.

The two groups must keep their sizes across a resume (each training process saved its
own rows, each rollout process its own position); another split is refused in one line.
"""

from __future__ import annotations

import itertools
from typing import Any

import jax

from distflow_jax.config import async_checks
from distflow_jax.config.errors import ConfigError
from distflow_jax.data.batch import Batch, to_global
from distflow_jax.persist import in_flight
from distflow_jax.persist.checkpoint_contents import CheckpointError
from distflow_jax.run import transfer
from distflow_jax.state.metrics import Metrics

_STARTS = itertools.count()  # one start word per run, in the same order on every process
IN_FLIGHT, ROLLOUT_LOADERS = "in_flight", "rollout_loaders"


class TrainingLoader:
  """A training process's train loader: it draws no prompts (the rollout processes do);
  its saved state is the pipeline's (``TrainerSide.state``) and a restore keeps it in
  ``restored`` for the pipeline."""

  def __init__(self, split: async_checks.ProcessSplit, process: int):
    self.split = split
    self.process_index, self.process_count = split.training.index(process), len(split.training)
    self.counts: dict[str, int] = {}
    self.pipeline: Any = None
    self.restored: dict[str, Any] | None = None

  def __iter__(self) -> "TrainingLoader":
    return self

  def __next__(self) -> Batch:
    raise RuntimeError("a training process of a run on disjoint processes draws no prompts")

  def get_state(self) -> dict[str, Any]:
    if self.pipeline is None:
      raise RuntimeError("a training process saves its state only while its pipeline runs")
    return self.pipeline.state()

  def restore_states(self, states: list[dict[str, Any]]) -> None:
    """Every training process's saved state (in their order): keeps this one's."""
    if any(ROLLOUT_LOADERS not in s for s in states):
      raise CheckpointError(
          "this checkpoint was saved by a run whose processes each ran the rollout and the "
          "training; resume it with that placement, or start a new --config.run_dir")
    if len(states) != self.process_count:
      raise CheckpointError(
          f"this checkpoint's batches in flight were saved by {len(states)} training "
          f"process(es) and this run trains on {self.process_count}; resume with the "
          f"placement it was saved with")
    mine = states[self.process_index]
    held = len(mine[ROLLOUT_LOADERS])
    if held != len(self.split.rollout):
      raise CheckpointError(
          f"this checkpoint holds the prompt positions of {held} rollout process(es) and "
          f"this run has {len(self.split.rollout)}; resume with the placement it was saved "
          f"with (placement.rollout.devices)")
    self.restored = mine


def encode(index: int, version: int, rows: Batch, metas: list[dict]) -> dict[str, Any]:
  """One batch in flight as JSON: this process's rows and the rollout's metadata."""
  record = in_flight.encode(in_flight.Saved(index, version, rows, Metrics()))
  record["metas"] = metas
  return record


def decode(record: dict[str, Any], layout: Any) -> tuple[int, list[dict], dict]:
  """``(index, metas, arrays)``: a saved batch back on ``layout`` (the training side's)."""
  saved = in_flight.decode(record)
  return saved.index, record["metas"], to_global(saved.batch, layout).data


def restored_batches(restored: dict[str, Any] | None, start: int, k: int) -> list[dict]:
  """The checkpoint's batches in flight, checked against the run's start and K."""
  records = list((restored or {}).get(IN_FLIGHT, []))
  got = [int(r["index"]) for r in records]
  if got != list(range(start, start + len(got))):
    raise CheckpointError(f"the checkpoint's batches in flight are for steps {got}, "
                          f"expected consecutive steps from {start}")
  if len(records) > k:
    raise ConfigError(f"the checkpoint holds {len(records)} batches in flight, more than "
                      f"trainer.max_staleness={k} allows; resume with the value it was "
                      f"saved with")
  return records


# -- the start word, training processes -> rollout processes -------------------------------

def _key(n: int) -> str:
  return f"distflow/async/start/{n}"


def announce(split: async_checks.ProcessSplit, start: int, restored: int,
             loaders: list[dict] | None) -> None:
  """Every training process calls it once per run, before its first transfer (the first
  writes): the run starts at ``start`` with ``restored`` batches from the checkpoint and
  the rollout processes' ``loaders`` positions (None: as they are)."""
  n = next(_STARTS)
  if jax.process_index() == split.training[0]:
    transfer.put_json(_key(n), {"start": start, "restored": restored, "loaders": loaders})


def announce_failure(split: async_checks.ProcessSplit, message: str) -> None:
  """Instead of ``announce`` when the training processes cannot start (a refused
  checkpoint): the rollout processes stop with the reason instead of waiting."""
  n = next(_STARTS)
  if jax.process_index() == split.training[0]:
    transfer.put_json(_key(n), {"error": message})


def await_start(split: async_checks.ProcessSplit, loader: Any) -> tuple[int, int]:
  """A rollout process's side: waits for the training processes' word, puts its prompt
  loader where the checkpoint left it, returns ``(start, restored)``."""
  word = transfer.get_json(_key(next(_STARTS)))
  if "error" in word:
    raise ConfigError(f"the training processes did not start: {word['error']}")
  if word["loaders"] is not None:
    state = word["loaders"][split.rollout.index(jax.process_index())]
    prompts = getattr(loader, "loader", loader)  # the prompt loader under InFlightLoader
    try:
      prompts.set_state(state)
    except ValueError as e:
      raise CheckpointError(f"the checkpoint's prompt position does not fit this run's "
                            f"data: {e}") from None
  return int(word["start"]), int(word["restored"])


def prompt_state(loader: Any) -> dict[str, Any]:
  """A rollout process's prompt-loader position (published with each batch)."""
  return getattr(loader, "loader", loader).get_state()
