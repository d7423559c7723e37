"""Start-up check that every process runs the same resolved config.

Each process loads its config from its own command line, so one host started
with a different override (a learning rate, ``rollout.n``) would otherwise run
silently with it or abort later inside a collective.  ``check_same_config``
all-gathers a hash of the flattened config; if the hashes differ it gathers the
flattened configs and raises one ``ConfigError`` line naming the differing keys
and which processes hold which value.

Only ``trainer.compile_cache_dir`` (a folder on each host's own disk, see
``PER_PROCESS_KEYS``) may differ between processes.  No other key does: the process
index and count come from the runtime, not the config; ``run_dir`` is where
every process writes the built-in data sets and where the orbax checkpoints
(written by all processes together) live, so it must be the same path
everywhere; ``data.*`` and ``model.path`` must name the same files, since
every process shards the same records by index.  ``PER_PROCESS_KEYS`` is the
place to exempt one should that change.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import ml_collections

from distflow_jax.config.errors import ConfigError

# Flattened keys (or prefixes ending in '.') allowed to differ between processes.
# The compile cache is a folder of this host's (its own disk, its user's home).
PER_PROCESS_KEYS: tuple[str, ...] = ("trainer.compile_cache_dir",)

MAX_KEYS_NAMED = 6


def flatten(cfg: ml_collections.ConfigDict | Mapping) -> dict[str, Any]:
  """``{'actor.optimizer.lr': 1e-05, 'dag[0].id': 'generate', ...}`` with JSON-able leaves."""
  tree = cfg.to_dict() if isinstance(cfg, ml_collections.ConfigDict) else dict(cfg)
  out: dict[str, Any] = {}

  def walk(prefix: str, value: Any) -> None:
    if isinstance(value, (Mapping, ml_collections.ConfigDict)):
      for k in value:
        walk(f"{prefix}.{k}" if prefix else str(k), value[k])
    elif isinstance(value, (list, tuple)):
      if not value:
        out[prefix] = []
      for i, v in enumerate(value):
        walk(f"{prefix}[{i}]", v)
    elif value is None or isinstance(value, (bool, int, str)):
      out[prefix] = value
    elif isinstance(value, float):
      # JSON has no NaN/inf; repr keeps them (and every float) exact and comparable.
      out[prefix] = value if math.isfinite(value) else repr(value)
    else:
      out[prefix] = repr(value)

  walk("", tree)
  return out


def _kept(flat: Mapping[str, Any], exclude: Sequence[str]) -> dict[str, Any]:
  return {k: v for k, v in flat.items()
          if not any(k == e or (e.endswith(".") and k.startswith(e)) for e in exclude)}


def fingerprint(flat: Mapping[str, Any]) -> str:
  return hashlib.sha256(json.dumps(flat, sort_keys=True).encode()).hexdigest()


def describe_differences(flats: Sequence[Mapping[str, Any]]) -> str:
  """One line: the keys whose values differ, each with the processes holding each value."""
  missing = object()
  keys = sorted(set().union(*flats))
  parts = []
  for key in keys:
    vals = [f.get(key, missing) for f in flats]
    if all(v == vals[0] and type(v) is type(vals[0]) for v in vals):
      continue
    groups: dict[str, list[int]] = {}
    for p, v in enumerate(vals):
      groups.setdefault("(unset)" if v is missing else repr(v), []).append(p)
    parts.append(f"{key}: " + ", ".join(f"{v} on process{'es' if len(ps) > 1 else ''} "
                                        f"{_ranges(ps)}" for v, ps in groups.items()))
  more = f"; and {len(parts) - MAX_KEYS_NAMED} more key(s)" if len(parts) > MAX_KEYS_NAMED else ""
  return (f"the {len(flats)} processes were started with different configs: "
          + "; ".join(parts[:MAX_KEYS_NAMED]) + more
          + ". Start every process with the same config file and --config overrides")


def _ranges(ps: Sequence[int]) -> str:
  out, start = [], ps[0]
  for a, b in zip(ps, list(ps[1:]) + [None]):
    if b != a + 1:
      out.append(str(start) if start == a else f"{start}-{a}")
      start = b
  return ",".join(out)


def check_same_config(cfg: ml_collections.ConfigDict,
                      gather: Callable[[Any], list[Any]] | None = None,
                      exclude: Sequence[str] = PER_PROCESS_KEYS) -> None:
  """Raises ``ConfigError`` unless every process holds the same resolved config.

  A collective: every process must call it at the same point (after
  ``jax.distributed`` is initialized).  ``gather`` all-gathers a JSON-able
  value in process order (default ``persist.checkpoint.gather_json``).
  """
  if gather is None:
    from distflow_jax.persist.checkpoint import gather_json as gather
  flat = _kept(flatten(cfg), exclude)
  digests = gather(fingerprint(flat))
  if len(set(digests)) <= 1:
    return
  raise ConfigError(describe_differences(gather(flat)))
