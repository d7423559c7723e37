"""``plan --lower``: lower every program of a run for a target device; a table, or one line.

Each program of ``catalogue.programs`` is traced and lowered with
``lowering_platforms=(target,)`` inside ``target.lowering_for`` (so the attention
kernels are chosen for the target and jax's cuDNN checks run as on it).  A row per
program: its node, name, the attention kernels it got, the size of its StableHLO (ops,
``case`` conditionals, ``while`` loops) and how long lowering took.  A program that does
not lower is refused in one line naming it and the setting to change, before anything
compiles on a device.
"""

from __future__ import annotations

import collections
import dataclasses
import time
from collections.abc import Callable

import jax

from distflow_jax.config.errors import ConfigError
from distflow_jax.lowering.program import Catalogue, Program
from distflow_jax.models import attention_choice
from distflow_jax.models.target import Target, lowering_for


@dataclasses.dataclass(frozen=True)
class Row:
  node: str
  name: str
  attention: str      # e.g. "cudnn x48 (T=64..512)", "-" when none
  ops: int
  cases: int
  whiles: int
  seconds: float
  error: str = ""
  calls: tuple[tuple[str, int], ...] = ()   # (kernel, attention calls), as `attention` shows


  @property
  def ok(self) -> bool:
    return not self.error


def hlo_counts(text: str) -> tuple[int, int, int]:
  """``(ops, case, while)`` of a StableHLO module's text."""
  ops = sum(1 for line in text.splitlines() if " = " in line)
  return ops, text.count("stablehlo.case"), text.count("stablehlo.while")


def compiled_counts(text: str) -> tuple[int, int, int]:
  """``(conditionals, whiles, whiles without a known trip count)`` of a compiled (XLA HLO)
  module's text.  A ``while`` whose trip count XLA could not prove (its predicate reads
  data, not only a counter) and a ``conditional`` each copy a predicate to the host and
  wait for it on a GPU, once per iteration or call."""
  whiles = [line for line in text.splitlines() if " while(" in line]
  unknown = sum("known_trip_count" not in line for line in whiles)
  return text.count(" conditional("), len(whiles), unknown


def _calls(choices: list[attention_choice.Choice]) -> tuple[tuple[str, int], ...]:
  counts = collections.Counter(c.impl.value for c in choices)
  return tuple(counts.items())


def _attention(choices: list[attention_choice.Choice]) -> str:
  if not choices:
    return "-"
  parts = []
  for impl, count in _calls(choices):
    ts = sorted({c.padded[0] for c in choices if c.impl.value == impl})
    span = f"T={ts[0]}" if len(ts) == 1 else f"T={ts[0]}..{ts[-1]}"
    parts.append(f"{impl} x{count} ({span})")
  return ", ".join(parts)


def _first_line(e: BaseException) -> str:
  return (str(e).strip().splitlines() or [""])[0]


def _advice(error: str) -> str:
  if "model.attention_impl" in error:
    return ""
  if "sequence length" in error or "head dim" in error or "cuDNN" in error:
    return "; set model.attention_impl=auto (or xla / blockwise)"
  return ""


def lower_one(program: Program, target: Target) -> Row:
  with attention_choice.recording() as seen:
    t0 = time.perf_counter()
    try:
      text = program.trace().lower(lowering_platforms=(target.platform.value,)).as_text()
    except Exception as e:  # noqa: BLE001 - every refusal becomes the row's one line
      return Row(program.node, program.name, _attention(seen), 0, 0, 0,
                 time.perf_counter() - t0, f"{type(e).__name__}: {_first_line(e)}",
                 _calls(seen))
  return Row(program.node, program.name, _attention(seen), *hlo_counts(text),
             time.perf_counter() - t0, calls=_calls(seen))


def lower_all(build: Callable[[], Catalogue], target: Target, on_row=None
              ) -> tuple[Catalogue, list[Row]]:
  """``build()``'s programs (built for ``target``: shapes the engine derives by tracing
  depend on it) each lowered for ``target``, in run order; ``on_row(row)`` as each ends.
  A failure while building is refused in one line (ConfigError)."""
  rows = []
  with lowering_for(target):
    try:
      cat = build()
    except ConfigError as e:
      raise ConfigError(f"plan --lower={target.name}: {e}") from None
    except Exception as e:  # noqa: BLE001 - one line, naming the target
      first = _first_line(e)
      raise ConfigError(f"plan --lower={target.name}: the run's programs cannot be built for "
                        f"{target.name}: {type(e).__name__}: {first}{_advice(first)}") from None
    # Building traced some programs already (the engine's shapes come from eval_shape):
    # trace every one afresh, so each row records the attention kernels it chose.
    jax.clear_caches()
    for p in cat.programs:
      row = lower_one(p, target)
      rows.append(row)
      if on_row is not None:
        on_row(row)
  return cat, rows


def render_row(row: Row) -> str:
  status = "ok" if row.ok else f"FAILED: {row.error}"
  return (f"  {row.node:<14} {row.name:<40} {row.attention:<34} {row.ops:>6} {row.cases:>4} "
          f"{row.whiles:>5} {row.seconds:>6.1f}s  {status}")


HEADER = (f"  {'node':<14} {'program':<40} {'attention':<34} {'ops':>6} {'case':>4} "
          f"{'while':>5} {'lower':>7}  status")


def summary(rows: list[Row], target: Target, seconds: float) -> str:
  failed = [r for r in rows if not r.ok]
  kernels = collections.Counter()
  for r in rows:
    kernels.update(dict(r.calls))
  att = ", ".join(f"{k} {v}" for k, v in sorted(kernels.items())) or "none"
  return (f"lowered {len(rows) - len(failed)}/{len(rows)} programs for {target.name} "
          f"({target.platform.value}) in {seconds:.0f} s; attention calls: {att}; "
          f"conditionals: {sum(r.cases for r in rows)}; failed: {len(failed)}")


def check(rows: list[Row], target: Target) -> None:
  """Refuses (ConfigError, one line) the first program that did not lower."""
  failed = [r for r in rows if not r.ok]
  if failed:
    r = failed[0]
    more = f" (and {len(failed) - 1} more)" if len(failed) > 1 else ""
    raise ConfigError(f"plan --lower={target.name}: program {r.name} of node {r.node!r} "
                      f"cannot be built for {target.name}: {r.error}{_advice(r.error)}{more}")
