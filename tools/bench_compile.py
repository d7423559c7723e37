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
import os
import statistics
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _bench_common as bc  # noqa: E402


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
  # The config's compile cache folder below, not the suite's.
  env = bc.child_env(unset=["DISTFLOW_JAX_COMPILE_CACHE"])
  overrides = [f"trainer.compile_cache_dir={cache}", f"run_dir={run_dir}",
               f"trainer.total_steps={args.steps}", "trainer.eval_every=0",
               "trainer.save_every=0", *args.override]
  cmd = [sys.executable, "-m", "distflow_jax.cli", "train", f"--config={args.config}",
         *[f"--config.{o}" for o in overrides]]
  done = bc.run_with_deadline(cmd, args.timeout_s, env=env)
  if done.returncode != 0:
    raise SystemExit(f"run failed (exit {done.returncode}): {done.output.strip()[-2000:]}")
  rows = bc.read_jsonl(os.path.join(run_dir, "metrics.jsonl"))
  rows = [r for r in rows if r.get("step", 0) >= 1]
  rows[0]["_wall"] = done.wall_s
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
  print(f"# {bc.load_line()}; {args.config}, {args.steps} steps, cache {cache}", flush=True)
  table = bc.Table(bc.Col("run", 4, "<"), bc.Col("step 1 (s)", 11, "<", ".2f"),
                   bc.Col("warm step (s)", 14, "<", ".3f"), bc.Col("step1/warm", 11, "<", ".1f"),
                   bc.Col("compiles step 1", 16, "<"), bc.Col("cache loads step 1", 19, "<"),
                   bc.Col("compiles after", 15, "<"), bc.Col("widths", 7, "<"),
                   bc.Col("command (s)", 0, "<", ".1f"))
  for i in range(args.runs):
    s = summarize(run_once(args, cache, os.path.join(work, f"run{i}")))
    table.row(i + 1, s["step1_s"], s["warm_s"], s["ratio"], s["step1_compiles"],
              s["step1_cache_loads"], s["later_compiles"], ",".join(map(str, s["widths"])),
              s["wall_s"])
  print(f"# end: {bc.load_line()}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
