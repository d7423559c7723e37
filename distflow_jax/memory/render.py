"""Printing the memory plan and refusing a device too small for it.

:func:`render` prints an :class:`~distflow_jax.memory.consumers.Estimate`: every consumer,
the notes, the worst device's peak, the fit against what jax can use of the device (a
:class:`~distflow_jax.memory.budget.Budget`, or a byte count taken whole) with the
budget's reasoning, the three biggest consumers with what to change, and the traffic per
step.  :func:`check_fits` refuses, in one line, a device whose usable memory is below the
peak.
"""

from __future__ import annotations

from distflow_jax.config.errors import ConfigError
from distflow_jax.memory import analytic as an
from distflow_jax.memory.budget import Budget, as_budget
from distflow_jax.memory.consumers import RESIDENT, Estimate

def render(est: Estimate, num_devices: int, num_processes: int,
           device_memory: "Budget | int | None") -> str:
  """The table, the worst device's peak and its fit against what jax can use of the
  device (``budget``; a plain byte count is taken whole), its three biggest consumers."""
  lines = [f"memory per device ({est.notes[0]}):"]
  for i in est.items:
    span = f"[{i.devices[0]}..{i.devices[-1]}]" if len(i.devices) > 1 else f"[{i.devices[0]}]"
    when = "resident" if i.phase == RESIDENT else f"while {' / '.join(i.phases)} runs"
    lines.append(f"  {i.where:<14} {i.what:<46} {an.fmt(i.nbytes):>11}  on {span:<9} {when}")
  lines += [f"  note: {n}" for n in est.notes[1:]]
  d, peak, node = est.worst(num_devices)
  per = num_devices // num_processes
  lines.append(f"peak: {an.fmt(peak)} on device {d} (process {d // per}), while {node} runs")
  b = as_budget(device_memory)
  if b is not None:
    lines += b.lines()
    gap = b.usable - peak
    lines.append(f"fits {an.fmt(b.device_memory)} ({an.fmt(b.usable)} usable): "
                 + (f"yes, {an.fmt(gap)} to spare" if gap >= 0 else
                    f"NO, over by {an.fmt(-gap)}"))
  lines.append("biggest consumers:")
  for i in est.biggest(d, node):
    lines.append(f"  {an.fmt(i.nbytes):>11}  {i.where} {i.what}: to shrink, {i.advice}")
  lines.append("traffic per step:")
  lines += [f"  {t}" for t in est.traffic]
  return "\n".join(lines)


def check_fits(est: Estimate, num_devices: int, device_memory: "Budget | int", text: str
               ) -> None:
  """Refuses (ConfigError, one line) a device whose usable memory is below the plan's
  peak."""
  b = as_budget(device_memory)
  d, peak, node = est.worst(num_devices)
  if peak <= b.usable:
    return
  top = est.biggest(d, node, 1)[0]
  usable = ("" if b.platform == "any" else
            f" ({b.target.split(' ')[0]}: {an.fmt(b.usable)} usable)")
  raise ConfigError(f"--device_memory={text}{usable}: the plan needs {an.fmt(peak)} on device "
                    f"{d} while {node} runs, {an.fmt(peak - b.usable)} too much; the biggest "
                    f"consumer is {top.where} {top.what} ({an.fmt(top.nbytes)}): {top.advice}")
