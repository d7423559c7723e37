"""Compile stalls of a run, first and second time: step 1 against a warm step, compiles after it.

    python tools/bench_compile.py [--config grpo:tiny] [--steps 8] [--runs 2]
                                  [--override KEY=VALUE ...] [--workdir DIR]

Runs `distflow-jax train` `--runs` times in fresh processes, each with a new run folder,
sharing one new persistent compile cache folder (trainer.compile_cache_dir; the default
trainer.compile_ahead=auto then compiles every prompt width and prefill shape at the end
of step 1).  Prints per run: the wall time of step 1 (time/step plus the compile ahead
at its end: everything before step 2 starts), the median of steps 2.. (warm), their
ratio, the compiles and cache loads in step 1, and the compiles in steps 2.. (issue 21's
targets: step 1 of a second run within 1.5x a warm step; no compile after step 1).
Each process has a SIGKILL deadline.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time


def _args(argv):
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--config", default="grpo:tiny")
  p.add_argument("--steps", type=int, default=8, help="train steps per run")
  p.add_argument("--runs", type=int, default=2, help="runs sharing the cache")
  p.add_argument("--override", action="append", default=[],
                 help="extra --config.KEY=VALUE (repeatable)")
  p.add_argument("--workdir", default="", help="default: a fresh temporary directory")
  p.add_argument("--timeout-s", type=int, default=1800, help="SIGKILL deadline per run")
  return p.parse_args(argv)


def run_once(args, cache: str, run_dir: str) -> list[dict]:
  env = dict(os.environ)
  env.pop("DISTFLOW_JAX_COMPILE_CACHE", None)  # the config's folder below, not the suite's
  overrides = [f"trainer.compile_cache_dir={cache}", f"run_dir={run_dir}",
               f"trainer.total_steps={args.steps}", "trainer.eval_every=0",
               "trainer.save_every=0", *args.override]
  cmd = ["timeout", "-s", "KILL", str(args.timeout_s), sys.executable, "-m",
         "distflow_jax.cli", "train", f"--config={args.config}",
         *[f"--config.{o}" for o in overrides]]
  t0 = time.perf_counter()
  proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
  wall = time.perf_counter() - t0
  if proc.returncode != 0:
    raise SystemExit(f"run failed (exit {proc.returncode}): {proc.stderr.strip()[-2000:]}")
  with open(os.path.join(run_dir, "metrics.jsonl")) as f:
    rows = [json.loads(line) for line in f]
  rows = [r for r in rows if r.get("step", 0) >= 1]
  rows[0]["_wall"] = wall
  return rows


def summarize(rows: list[dict]) -> dict:
  first, rest = rows[0], rows[1:]
  warm = statistics.median(r["time/step"] for r in rest) if rest else float("nan")
  # time/step is the executor's; the compile ahead at the end of step 1 comes on top.
  step1 = first["time/step"] + first.get("compile/ahead_s", 0.0)
  return {"step1_s": step1, "warm_s": warm, "ratio": step1 / warm,
          "step1_compiles": int(first["compile/count"]),
          "step1_cache_loads": int(first.get("compile/cache_hits", 0)),
          "later_compiles": int(sum(r["compile/count"] for r in rest)),
          "widths": sorted({int(r.get("prompt_width", 0)) for r in rows}),
          "wall_s": first["_wall"]}


def main(argv=None) -> int:
  args = _args(argv)
  work = args.workdir or tempfile.mkdtemp(prefix="bench-compile-")
  cache = os.path.join(work, "cache")
  print(f"# {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; load "
        f"{os.getloadavg()[0]:.2f}; {args.config}, {args.steps} steps, cache {cache}")
  print("run  step 1 (s)  warm step (s)  step1/warm  compiles step 1  cache loads step 1  "
        "compiles after  widths  command (s)")
  for i in range(args.runs):
    s = summarize(run_once(args, cache, os.path.join(work, f"run{i}")))
    print(f"{i + 1:<4} {s['step1_s']:<11.2f} {s['warm_s']:<14.3f} {s['ratio']:<11.1f} "
          f"{s['step1_compiles']:<16} {s['step1_cache_loads']:<19} {s['later_compiles']:<15} "
          f"{','.join(map(str, s['widths'])):<7} {s['wall_s']:.1f}")
  print(f"# load at the end {os.getloadavg()[0]:.2f}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
