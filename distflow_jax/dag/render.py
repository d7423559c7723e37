"""The plan as deterministic text (``distflow-jax plan``), for all processes or one.

Layout names and the ``Move`` members' values are only written here; the
text is what tests and users compare, so it stays stable.
"""

from __future__ import annotations

from collections.abc import Sequence

from distflow_jax.dag import replicas
from distflow_jax.dag.planner import LayoutKind, Plan
from distflow_jax.dag.spec import Role


def render(plan: Plan, process: int | None = None) -> str:
  """Deterministic text form of the plan, for all processes or one."""
  t = plan.topology
  lines = [f"topology: {t.num_processes} process(es) x {t.devices_per_process} device(s) "
           f"= {t.num_devices} devices"]
  for m in plan.meshes:
    shape = " x ".join(f"{a}={s}" for a, s in m.axes)
    lines.append(f"mesh {m.role.value.lower():<9} devices {_span(m.devices)}  {shape}  "
                 f"(dp={m.dp_size})")
  roll = next((s.layout for s in plan.steps if s.layout.kind is LayoutKind.ROLLOUT), None)
  actor = next((m.devices for m in plan.meshes if m.role is Role.ACTOR), None)
  where = ("actor" if roll is None or roll.devices == actor
           else f"placement.rollout (devices {_span(roll.devices)})")
  tp = plan.rollout_tensor_parallel
  groups = replicas.replica_groups(roll.devices, tp, t.process_of) if roll is not None else ()
  if replicas.spans_hosts(groups):
    lines.append(f"rollout: one replica per {len(groups[0])} processes ({tp} {where} devices, "
                 f"tensor-parallel across hosts): " + ", ".join(
                     "processes " + "+".join(map(str, g)) for g in groups))
  else:
    lines.append(f"rollout: one replica per {tp} local {where} device(s), inside each host")
  lines.append("chain:")
  w_node = max(len(s.node.describe()) for s in plan.steps)
  w_deps = max(len(",".join(s.node.deps) or "-") for s in plan.steps)
  w_lay = max(len(s.layout.name) for s in plan.steps)
  for s in plan.steps:
    deps = ",".join(s.node.deps) or "-"
    lines.append(f"  {s.index}. {s.node.describe():<{w_node}}  deps={deps:<{w_deps}}  "
                 f"layout={s.layout.name:<{w_lay}}  in={s.move_in.value}"
                 + ("" if s.groups_intact else "  groups=split"))
  reparts = plan.repartitions()
  lines.append(f"re-partitions per step: {len(reparts)}"
               + "".join(f"\n  {a} -> {b} (all-to-all)" for a, b in reparts))
  lines.append("edges:")
  for e in plan.edges:
    lines.append(f"  {e.src} -> {e.dst}: {e.kind.value}")
  procs = range(t.num_processes) if process is None else [process]
  for p in procs:
    lines.append(f"process {p} (devices {_span(t.devices_of(p))}):")
    for s, devs in plan.portion(p):
      lines.append(f"  {s.index}. {s.node.id:<16} on {_span(devs)}")
  return "\n".join(lines)


def _span(devs: Sequence[int]) -> str:
  devs = list(devs)
  if devs and devs == list(range(devs[0], devs[-1] + 1)):
    return f"[{devs[0]}..{devs[-1]}]" if len(devs) > 1 else f"[{devs[0]}]"
  return str(devs)
