"""What a run checkpoint holds, and how each part is checked against this run.

The trained roles' arrays (``trained_state``, compared by name, shape and
dtype), every process's data position (``restore_loader``) and the
algorithm state (``restore_algo_state``: the adaptive KL coefficient, see
``algo_state``).  ``checkpoint`` saves and restores them (and re-exports
what is here); this module needs nothing from it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Callable, Mapping
from typing import Any

import jax
import ml_collections
import numpy as np

from distflow_jax.config.errors import ConfigError
from distflow_jax.dag.spec import Role
from distflow_jax.data.loader import PromptLoader
from distflow_jax.models import lora
from distflow_jax.state import algo_state
from distflow_jax.persist import checksums
from distflow_jax.state.roles import ModelState

# The checkpoint's layout: a step's items, the run's static folder, the format version.
FORMAT = 1
STATE, LOADER, META = "state", "loader", "meta"
ITEMS = (STATE, LOADER, META)
STATIC = "static"


class CheckpointError(ConfigError):
  """A checkpoint that cannot be restored into this run (says what differs)."""


class CheckpointDamaged(CheckpointError):
  """A checkpoint whose files changed after the save (names the file or array)."""

def trained_state(roles: dict[Role, ModelState]) -> dict[str, dict[str, Any]]:
  """The pytree saved every time: the actor's and critic's parameters (+ optimizer); of a
  LoRA actor only its adapters (the base comes from the model source: ``base_fingerprint``)."""
  out = {}
  for role in (Role.ACTOR, Role.CRITIC):
    if role in roles:
      s = roles[role]
      params = lora.split_trainable(s.params)[0]
      out[role.value.lower()] = ({"params": params, "opt_state": s.opt_state}
                                 if s.trainable else {"params": params})
  return out


def check_group(group: tuple[int, ...] | None) -> None:
  """Refuses to checkpoint from a process group without process 0 (orbax writes a
  checkpoint's shared files, and a one-process group's numpy arrays, from process 0)."""
  if group is not None and 0 not in group:
    raise CheckpointError(
        f"the processes that save this run's checkpoints ({list(group)}: the training "
        f"processes of an asynchronous run with the rollout on processes of its own) must "
        f"include process 0, where orbax writes a checkpoint's shared files; put the "
        f"training on process 0's devices and the rollout on the last processes' (e.g. "
        f"--config.placement.rollout.devices=1:2 --config.placement.actor.devices=0:1 on "
        f"2 processes x 1 device, every role like the actor)")


def savable(tree: Any) -> Any:
  """``tree`` as orbax saves it.  Orbax refuses a fully addressable ``jax.Array`` when
  several processes run (it takes it for a host-local pmap array), and a group of one
  process (the training process of an asynchronous run on disjoint processes) holds only
  such arrays: those go as numpy, the same values (a restore reads them into the live
  shardings either way)."""
  if jax.process_count() == 1:
    return tree
  return jax.tree.map(lambda x: np.asarray(x) if isinstance(x, jax.Array)
                      and x.is_fully_addressable else x, tree)


def put_restored(roles: dict[Role, ModelState], state: dict[str, dict[str, Any]]) -> None:
  """``trained_state``'s tree read back into ``roles`` (a LoRA actor keeps its live base)."""
  for name, tree in state.items():
    s = roles[Role(name.upper())]
    s.params = lora.merge_trainable(tree["params"], lora.split_trainable(s.params)[1])
    if s.trainable:
      s.opt_state = tree["opt_state"]


def save_trees(roles: dict[Role, ModelState]) -> dict[str, Any]:
  """What a save checksums, by section: the trained state, the reference model's parameters
  (every save, though only the first writes them: the same program each time, so nothing
  compiles after step 1) and a LoRA actor's frozen base (its fingerprint)."""
  trees = {STATE: trained_state(roles)}
  if Role.REFERENCE in roles:
    trees["reference"] = roles[Role.REFERENCE].params
  if Role.ACTOR in roles and lora.has_adapters(roles[Role.ACTOR].params):
    trees["lora_base"] = lora.split_trainable(roles[Role.ACTOR].params)[1]
  return trees


@dataclasses.dataclass(frozen=True)
class SaveSums:
  """A save's checksums: the trained state's, the reference's (None without one) and the
  LoRA base's fingerprint (None without adapters)."""
  state: dict[str, str]
  reference: dict[str, str] | None
  lora_base: str | None


def save_sums(roles: dict[Role, ModelState]) -> SaveSums:
  """``save_trees``' checksums in one program per mesh (a collective)."""
  s = checksums.sections(save_trees(roles))
  base = s.get("lora_base")
  return SaveSums(s[STATE], s.get("reference"), None if base is None else _fingerprint(base))


def _fingerprint(sums: dict[str, str]) -> str:
  return hashlib.sha256(json.dumps(sums, sort_keys=True).encode()).hexdigest()[:16]


def base_fingerprint(roles: dict[Role, ModelState]) -> str | None:
  """A digest of a LoRA actor's frozen base (None without adapters): stored with each save
  and compared on resume, as the checkpoint holds the adapters only (a collective)."""
  if Role.ACTOR not in roles:
    return None
  return adapters_base_fingerprint(roles[Role.ACTOR].params)


def adapters_base_fingerprint(params: Any) -> str | None:
  """``base_fingerprint`` of one actor state (None without adapters); export and eval
  compare it with a checkpoint's to find the base its adapters were trained on."""
  if not lora.has_adapters(params):
    return None
  return _fingerprint(checksums.checksums(lora.split_trainable(params)[1]))


def check_base(saved: str | None, roles: dict[Role, ModelState], where: str) -> None:
  """Refuses to put adapters on another base than the one they were trained on."""
  live = base_fingerprint(roles)
  if saved == live:
    return
  if saved and live:
    why = (f"was trained on another base model (base fingerprint {saved}, this run's "
           f"{live}): resume with the model.path / model.preset it was trained on")
  elif saved:
    why = ("holds LoRA adapters but this run has model.lora.enabled=False: resume with the "
           "model.lora settings it was trained with")
  else:
    why = ("holds a fully trained actor but this run trains LoRA adapters "
           "(model.lora.enabled=True): resume without LoRA, or start a new run_dir")
  raise CheckpointError(f"{where} {why}")

def abstract(tree: Any) -> Any:
  """Shape, dtype and *current* sharding of every leaf: the restore target (reshards)."""
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
                      tree)


def flat_shapes(tree: Any) -> dict[str, tuple[tuple[int, ...], str]]:
  """``{"actor.params.embed.embedding.value": (shape, dtype)}`` of a pytree or orbax metadata."""
  return {name: (tuple(x.shape), str(np.dtype(x.dtype)))
          for name, x in checksums.flatten(tree).items()}


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


def restore_loader(loader: PromptLoader, states: list[dict], log: Callable[[str], None]) -> None:
  """This process's saved position; a fresh epoch if the process count changed.  A loader
  with its own ``restore_states`` (an asynchronous run's training processes on disjoint
  processes) takes every process's states itself."""
  own = getattr(loader, "restore_states", None)
  if own is not None:
    own(states)
    return
  if any("rollout_loaders" in s for s in states):
    raise CheckpointError("this checkpoint was saved by an asynchronous run with the rollout "
                          "on processes of its own (its batches in flight are held there); "
                          "resume it with that placement (placement.rollout.devices)")
  if len(states) == loader.process_count:
    loader.set_state(states[loader.process_index])
    return
  epoch = max(int(s["epoch"]) for s in states) + 1
  log(f"checkpoint: the data position was saved by {len(states)} process(es) and this run "
      f"has {loader.process_count}; the loaders continue at the start of epoch {epoch}")
  loader.set_state({"epoch": epoch, "position": 0, "counts": {}, "seed": loader.seed,
                    "num_records": loader.num_records, "process_index": loader.process_index,
                    "process_count": loader.process_count})


def restore_algo_state(cfg: ml_collections.ConfigDict, saved: Mapping[str, Any] | None,
                       where: str) -> algo_state.AlgoState:
  """The saved algorithm state for this run.  A checkpoint without one (written before it
  was saved) restores the config's defaults when this run keeps no state across steps, and
  is refused when it does: its adapted KL coefficient would silently restart."""
  try:
    state = algo_state.restored(cfg, saved)
  except (TypeError, ValueError) as e:
    raise CheckpointError(f"{where}: {e}") from None
  if state is None:
    kl = cfg.actor.kl
    raise CheckpointError(
        f"{where} holds no algorithm state (it was written before it was saved) and this run "
        f"adapts the KL coefficient (actor.kl.target={kl.target}), which would restart at "
        f"actor.kl.coef={kl.coef}; start a new run_dir, or continue with a fixed coefficient "
        f"(--config.actor.kl.target=0 --config.actor.kl.coef=<the last kl_coef in "
        f"metrics.jsonl>)")
  return state
