"""The resolved config of a run: written to the run dir, compared on resume.

    state = preflight(cfg, resume=None, allow_change=False, log=log)  # before any weights
    if state.finished: ...                                            # nothing to do
    write_resolved(cfg, state)                                        # run_dir/config.json

``preflight`` reads the config saved in the newest checkpoint's meta (a JSON
file, no orbax needed) and compares it with this run's, key by key.  Keys
that change what the run computes (learning rates, rollout.n, the DAG, the
model, seeds, data paths, ...) are refused in one line naming them unless
``allow_change``; the keys in ``PASSING`` (step counts, cadences, retention,
run dir, health alarms, the device layout, which checkpoints reshard) pass and
are reported.  Resuming a run whose newest checkpoint is at or past
``trainer.total_steps`` is ``finished``: nothing to do.

``write_resolved`` keeps ``run_dir/config.json`` (the config running now) and
appends each start to ``run_dir/config_history.jsonl``: the whole config when
the run starts at step 0, what changed against the checkpoint on a resume.
The flattening and diff helpers also serve ``distflow-jax config --diff``.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
from collections.abc import Callable, Mapping
from typing import Any

import ml_collections

from distflow_jax.config.errors import ConfigError

CONFIG_FILE = "config.json"
HISTORY_FILE = "config_history.jsonl"
# Keys (and key prefixes) that do not change what a step computes: a resume may change them.
# The layout (cluster, placement) is here because checkpoints reshard to any mesh and
# process count (persist/checkpoint.py); trainer.deterministic is not.
PASSING = ("name", "run_dir", "trainer.total_steps", "trainer.eval_every", "trainer.save_every",
           "trainer.keep", "trainer.async_save", "trainer.health.", "trainer.stop_on_collapse",
           "trainer.log_samples", "trainer.compile_cache_dir", "trainer.compile_ahead",
           "trainer.compile_overlap",
           "cluster.", "placement.",
           "logging.",
           "sft.")  # sft.*: `distflow-jax sft` only
# Keys a resume can never change, not even with --allow_config_change: every random draw of
# a step derives from (seed, step), so a checkpoint continues only under its own seed
# (persist/checkpoint.py refuses it on restore; preflight says so before any work).
FIXED = ("seed",)
# Values compared whole, not key by key (a changed DAG is one change).
WHOLE = ("dag",)


def as_plain(cfg: Any) -> dict[str, Any]:
  """The config (a loaded ConfigDict or its typed view, ``config/declare.py``) as JSON values
  (tuples become lists), as checkpoints store it."""
  if isinstance(cfg, ml_collections.ConfigDict):
    return json.loads(cfg.to_json_best_effort())
  return json.loads(json.dumps(cfg.to_dict()))


def flatten(tree: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
  """``{"a": {"b": 1}}`` -> ``{"a.b": 1}``; lists (and the DAG) stay whole values."""
  out: dict[str, Any] = {}
  for k, v in tree.items():
    key = prefix + str(k)
    if isinstance(v, Mapping) and key not in WHOLE:
      out.update(flatten(v, key + "."))
    else:
      out[key] = v
  return out


def diff(old: Mapping[str, Any], new: Mapping[str, Any]) -> dict[str, tuple[Any, Any]]:
  """Flat keys whose values differ: ``{key: (old, new)}``; a missing side is ``MISSING``."""
  a, b = flatten(old), flatten(new)
  return {k: (a.get(k, MISSING), b.get(k, MISSING)) for k in sorted(set(a) | set(b))
          if a.get(k, MISSING) != b.get(k, MISSING)}


class _Missing:
  def __repr__(self) -> str:
    return "(absent)"


MISSING: Any = _Missing()


def passes(key: str) -> bool:
  """Whether a change of ``key`` leaves what the run computes as it was."""
  return any(key == p or (p.endswith(".") and key.startswith(p)) for p in PASSING)


def short(value: Any, limit: int = 40) -> str:
  text = repr(value)
  return text if len(text) <= limit else text[:limit - 3] + "..."


def describe(changes: Mapping[str, tuple[Any, Any]]) -> str:
  """``key old -> new, ...`` (the DAG as one word: its lists are long)."""
  parts = []
  for k, (a, b) in changes.items():
    parts.append(f"{k} (changed)" if k in WHOLE else f"{k} {short(a)} -> {short(b)}")
  return ", ".join(parts)


# ---- the checkpoints of a run dir, read without orbax --------------------------------------------

def committed_steps(run_dir: str) -> list[int]:
  """Steps whose save committed (orbax renames ``<step>.orbax-checkpoint-tmp`` to ``<step>``)."""
  directory = os.path.join(os.path.abspath(run_dir), "checkpoints")
  if not os.path.isdir(directory):
    return []
  return sorted(int(n) for n in os.listdir(directory)
                if n.isdigit() and os.path.isdir(os.path.join(directory, n)))


def saved_meta(run_dir: str, steps: list[int]) -> tuple[int | None, dict[str, Any]]:
  """The newest step whose meta reads, and that meta ({} where none reads)."""
  directory = os.path.join(os.path.abspath(run_dir), "checkpoints")
  for step in reversed(steps):
    try:
      with open(os.path.join(directory, str(step), "meta", "metadata")) as f:
        meta = json.load(f)
    except (OSError, ValueError):
      continue  # a damaged step: open_run sets it aside and falls back to the one before
    return step, meta if isinstance(meta, dict) else {}
  return None, {}


def saved_config(run_dir: str, steps: list[int]) -> tuple[int | None, dict[str, Any] | None]:
  """The newest step whose meta reads, and the config it holds (None: it records none)."""
  step, meta = saved_meta(run_dir, steps)
  return step, meta.get("config")


# The model fields that set its parameters' shapes and dtypes: a checkpoint restores only
# into the same (persist/checkpoint_contents.compare_shapes, after the warm start).
SHAPE_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                "num_kv_heads", "head_dim", "qkv_bias", "qk_norm", "tie_embeddings", "dtype",
                "fused_projections", "lora")


def check_model_shape(cfg: ml_collections.ConfigDict, state: "ResumeState",
                      live: Mapping[str, Any]) -> None:
  """Refuses a resume whose model (``live``: this run's model config as a dict) has other
  parameter shapes than the checkpoint's, in one line and before the warm start and the
  weights (the restore refused it only after them); fields either side lacks are not
  judged (another version's checkpoint)."""
  if state.latest is None:
    return
  step, meta = saved_meta(cfg.run_dir, committed_steps(cfg.run_dir))
  saved = meta.get("model_config")
  if not isinstance(saved, Mapping):
    return
  def plain(v):
    return json.loads(json.dumps(v, default=str))
  differ = {k: (saved[k], live[k]) for k in SHAPE_FIELDS
            if k in saved and k in live and plain(saved[k]) != plain(live[k])}
  if differ:
    what = ", ".join(f"{k} {plain(a)!r} -> {plain(b)!r}" for k, (a, b) in differ.items())
    raise ConfigError(
        f"resume of {cfg.run_dir}: this run's model has other parameter shapes than "
        f"checkpoint step {step}'s ({what}), which no resume can restore (--allow_config_change "
        f"included); set the model back, or start a new run with another --config.run_dir")


@dataclasses.dataclass
class ResumeState:
  """What ``preflight`` found: the newest checkpoint and how the config changed since."""
  latest: int | None = None
  finished: bool = False
  changes: dict[str, tuple[Any, Any]] = dataclasses.field(default_factory=dict)
  compared_step: int | None = None


def preflight(cfg: ml_collections.ConfigDict, *, resume: bool | None, allow_change: bool,
              log: Callable[[str], None],
              live_model: Callable[[], Mapping[str, Any] | None] | None = None) -> ResumeState:
  """Checks a resume against the run dir's newest checkpoint before anything is loaded.

  Raises ``ConfigError`` naming the keys that change what the run computes
  (unless ``allow_change``), a ``FIXED`` key that changed, or (given ``live_model``) a
  model whose parameter shapes differ from the checkpoint's, and refuses
  ``resume=True`` over a run dir without checkpoints and ``resume=False`` over
  one with them: each decided from the run dir alone, before any weights.
  """
  steps = committed_steps(cfg.run_dir)
  directory = os.path.join(os.path.abspath(cfg.run_dir), "checkpoints")
  if resume and not steps:
    raise ConfigError(f"--resume: there is no complete checkpoint in {directory}")
  if resume is False and steps:
    raise ConfigError(f"{directory} holds checkpoints of steps {steps}; continue them with "
                      f"--resume or choose another --config.run_dir")
  if not steps:
    return ResumeState()
  state = ResumeState(latest=steps[-1], finished=steps[-1] >= cfg.trainer.total_steps)
  step, saved = saved_config(cfg.run_dir, steps)
  state.compared_step = step
  if saved is None:
    log(f"resume: checkpoint step {step if step is not None else steps[-1]} records no config "
        f"(written by an older version): the config cannot be compared, going on")
    return state
  state.changes = diff(saved, as_plain(cfg))
  fixed = {k: v for k, v in state.changes.items() if k in FIXED and MISSING not in v}
  if fixed:
    raise ConfigError(
        f"resume of {cfg.run_dir}: {describe(fixed)} since checkpoint step {step}, but a "
        f"resumed run must keep its {', '.join(fixed)} (--allow_config_change does not cover "
        f"it); set it back, or start a new run with another --config.run_dir")
  # A key one side lacks (added or removed by another version) cannot be judged: reported.
  unknown = {k: v for k, v in state.changes.items() if MISSING in v}
  computing = {k: v for k, v in state.changes.items() if not passes(k) and k not in unknown}
  passing = {k: v for k, v in state.changes.items() if passes(k) and k not in unknown}
  if computing and not allow_change:
    raise ConfigError(
        f"resume of {cfg.run_dir}: the config differs from checkpoint step {step}'s in key(s) "
        f"that change what the run computes: {describe(computing)}; pass "
        f"--allow_config_change to resume with them anyway, or start a new run with another "
        f"--config.run_dir")
  if live_model is not None and any(k.startswith("model.") for k in computing):
    live = live_model()  # this run's model config as a dict (None: not known before weights)
    if live is not None:
      check_model_shape(cfg, state, live)
  if passing:
    log(f"resume: config changed since checkpoint step {step}: {describe(passing)}")
  if unknown:
    log(f"resume: key(s) only one of the checkpoint's config and this one has (another "
        f"version's): {describe(unknown)}")
  if computing:
    log(f"resume: --allow_config_change: continuing with changed key(s) that change what "
        f"the run computes: {describe(computing)}")
  return state


def finished_message(cfg: ml_collections.ConfigDict, state: ResumeState) -> str:
  return (f"nothing to do: the run in {cfg.run_dir} is finished (its latest checkpoint is step "
          f"{state.latest}, trainer.total_steps={cfg.trainer.total_steps}); to train further "
          f"pass --config.trainer.total_steps=N with N > {state.latest}")


def write_resolved(cfg: ml_collections.ConfigDict, state: ResumeState, writer: bool = True
                   ) -> str:
  """Writes ``run_dir/config.json`` and appends this start to ``config_history.jsonl``
  (process 0 only: ``writer``); returns the config file's path."""
  path = os.path.join(cfg.run_dir, CONFIG_FILE)
  if not writer:
    return path
  os.makedirs(cfg.run_dir, exist_ok=True)
  plain = as_plain(cfg)
  with open(path + ".tmp", "w") as f:
    json.dump(plain, f, indent=2, sort_keys=True)
    f.write("\n")
  os.replace(path + ".tmp", path)
  record: dict[str, Any] = {
      "time": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
      "start_step": state.latest or 0}
  if state.latest is None:
    record["config"] = plain
  else:
    record["changed"] = {k: {"from": None if a is MISSING else a, "to": None if b is MISSING
                             else b} for k, (a, b) in state.changes.items()}
  with open(os.path.join(cfg.run_dir, HISTORY_FILE), "a") as f:
    f.write(json.dumps(record, sort_keys=True) + "\n")
  return path
