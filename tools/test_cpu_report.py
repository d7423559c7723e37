"""Sums a test run's CPU profile (tests/cpu_profile.py) by file and by test.

    DISTFLOW_TEST_CPU_LOG=/tmp/cpu.jsonl python -m pytest -q -n 2 ...
    python tools/test_cpu_report.py /tmp/cpu.jsonl [--cores 2] [--top 25]

CPU seconds are the test process's (every thread) plus those of the processes it started
and waited for; on a machine of --cores cores a run cannot take less than their sum over
--cores, whatever else runs beside it (wall seconds grow with the load, CPU seconds hardly).
"""

from __future__ import annotations

import argparse
import collections
import json
import sys


def load(path: str) -> list[dict]:
  with open(path, encoding="utf-8") as f:
    return [json.loads(line) for line in f if line.strip()]


def cpu(row: dict) -> float:
  return row["cpu_s"] + row["children_cpu_s"]


def report(rows: list[dict], cores: int, top: int) -> str:
  total = sum(cpu(r) for r in rows)
  compile_s = sum(r.get("compile_s", 0.0) for r in rows)
  out = [f"{len(rows)} tests: {total:.0f} CPU s (at least {total / cores / 60:.1f} min on "
         f"{cores} cores), {sum(r['wall_s'] for r in rows):.0f} wall s summed; in-process "
         f"XLA compiles {sum(r.get('compiles', 0) for r in rows):.0f} ({compile_s:.0f} wall s), "
         f"cache hits {sum(r.get('hits', 0) for r in rows):.0f}", "", "by file (CPU s, share):"]
  by_file: collections.Counter = collections.Counter()
  for r in rows:
    by_file[r["id"].split("::")[0]] += cpu(r)
  out += [f"  {s:8.1f}  {s / max(total, 1e-9):6.1%}  {f}" for f, s in by_file.most_common(top)]
  out += ["", "by test (CPU s, of which started processes; wall s):"]
  for r in sorted(rows, key=cpu, reverse=True)[:top]:
    out.append(f"  {cpu(r):8.1f}  {r['children_cpu_s']:8.1f}  {r['wall_s']:8.1f}  {r['id']}")
  return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("log")
  p.add_argument("--cores", type=int, default=2)
  p.add_argument("--top", type=int, default=25)
  a = p.parse_args(argv)
  try:
    rows = load(a.log)
  except (OSError, ValueError, KeyError) as e:
    print(f"test_cpu_report: cannot read {a.log}: {e}", file=sys.stderr)
    return 2
  if not rows:
    print(f"test_cpu_report: {a.log} holds no test", file=sys.stderr)
    return 2
  print(report(rows, a.cores, a.top))
  return 0


if __name__ == "__main__":
  sys.exit(main())
