"""The memory plan's consumers: :class:`Item` (one buffer on some devices, resident or
living through node phases) and :class:`Estimate` (all of them, with each device's peak:
its resident items plus its largest phase, the worst device, and the biggest consumers of
a peak).  :mod:`distflow_jax.memory.report` fills an Estimate and
:mod:`distflow_jax.memory.render` prints it.
"""

from __future__ import annotations

import dataclasses

RESIDENT = "resident"


@dataclasses.dataclass(frozen=True)
class Item:
  """One consumer: ``where`` is a role (resident) or a node (transient, only while it runs)."""
  where: str
  what: str
  nbytes: float
  devices: tuple[int, ...]
  phase: str        # RESIDENT, or the node phase whose run it lives through
  source: str       # "compiled" or "analytic"
  advice: str
  also: tuple[str, ...] = ()   # further phases it lives through (the synced weights)

  @property
  def phases(self) -> tuple[str, ...]:
    return (self.phase,) + self.also


@dataclasses.dataclass
class Estimate:
  items: list[Item]
  traffic: list[str]
  notes: list[str]

  def per_device(self, d: int) -> tuple[float, str]:
    """``(peak bytes, node of the peak)`` of device ``d``: resident + its largest node."""
    mine = [i for i in self.items if d in i.devices]
    resident = sum(i.nbytes for i in mine if i.phase == RESIDENT)
    phases: dict[str, float] = {}
    for i in mine:
      for ph in i.phases:
        if ph != RESIDENT:
          phases[ph] = phases.get(ph, 0.0) + i.nbytes
    node = max(phases, key=phases.get) if phases else "-"
    return resident + phases.get(node, 0.0), node

  def worst(self, num_devices: int) -> tuple[int, float, str]:
    d = max(range(num_devices), key=lambda k: self.per_device(k)[0])
    return (d, *self.per_device(d))

  def biggest(self, d: int, node: str, k: int = 3) -> list[Item]:
    live = [i for i in self.items if d in i.devices and (i.phase == RESIDENT or
                                                          node in i.phases)]
    return sorted(live, key=lambda i: -i.nbytes)[:k]
