"""A cold run's first step with and without compiling its training programs during its
rollout (``trainer.compile_overlap``, run/compile_overlap.py), side by side.

    python tools/bench_first_step.py [--config grpo:tiny] [--rounds 3]
                                     [--override KEY=VALUE ...] [--timeout-s 900]

Each round runs `distflow-jax train` twice in fresh processes, `compile_overlap=False`
then `True` (the order turns round by round), each with a new run folder, two steps, no
persistent compile cache and no compile ahead (both sides compile every program of step 1
from nothing).  Per run it prints the first step's wall time (``time/step``), its
rollout and training node times, the backend compiles of step 1 (equal on both sides:
the same programs, each compiled once) and the second step's loss (equal: the same
results); then each side's median (min-max) and the ratio of the medians.  A figure from
a loaded machine is not a speed: the load average is printed with every row.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _bench_common as bc  # noqa: E402

# Every persistent compilation cache a run could read, jax's own included: cold runs.
COLD = ("DISTFLOW_JAX_COMPILE_CACHE", "JAX_COMPILATION_CACHE_DIR",
        "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES")


def _args(argv):
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--config", default="grpo:tiny")
  p.add_argument("--rounds", type=int, default=3)
  p.add_argument("--override", action="append", default=[],
                 help="extra --config.KEY=VALUE (repeatable)")
  p.add_argument("--timeout-s", type=int, default=900, help="SIGKILL deadline per run")
  return p.parse_args(argv)


def run_once(args, overlap: bool, workdir: str) -> dict:
  run_dir = tempfile.mkdtemp(dir=workdir)
  overrides = ["trainer.compile_cache_dir=", "trainer.compile_ahead=never",
               f"trainer.compile_overlap={overlap}", f"run_dir={run_dir}",
               "trainer.total_steps=2", "trainer.eval_every=0", "trainer.save_every=0",
               *args.override]
  cmd = [sys.executable, "-m", "distflow_jax.cli", "train", f"--config={args.config}",
         *[f"--config.{o}" for o in overrides]]
  done = bc.run_with_deadline(cmd, args.timeout_s,
                              env=bc.child_env(unset=COLD))
  if done.returncode != 0:
    raise SystemExit(f"run failed (exit {done.returncode}): {done.output.strip()[-2000:]}")
  rows = [r for r in bc.read_jsonl(os.path.join(run_dir, "metrics.jsonl"))
          if r.get("step", 0) >= 1]
  return {"first": rows[0], "second": rows[1]}


def main(argv=None) -> int:
  args = _args(argv)
  bc.flush_lines()
  print(f"# {bc.load_line()}")
  print(f"# {args.config} {' '.join(args.override)}: first step of a cold run, "
        f"compile_overlap off / on")
  print("round  overlap  step1_s  generate_s  other_nodes_s  compiles  overlap_programs  "
        "loss@2  load")
  workdir = tempfile.mkdtemp(prefix="bench_first_step_")
  results: dict[bool, list[dict]] = {False: [], True: []}

  def row(i, overlap, out):
    f = out["first"]
    gen = f.get("time/generate", float("nan"))
    other = sum(v for k, v in f.items() if k.startswith("time/") and k.count("/") == 1
                and k not in ("time/step", "time/generate", "time/compile"))
    print(f"{i:5d}  {str(overlap):7s}  {f['time/step']:7.2f}  {gen:10.2f}  "
          f"{other:13.2f}  {f.get('compile/count', float('nan')):8.0f}  "
          f"{f.get('compile/overlap_programs', 0):16.0f}  {out['second']['actor/loss']!r}  "
          f"{bc.load_average()}")
    results[overlap].append(out)

  for i in range(args.rounds):
    order = (False, True) if i % 2 == 0 else (True, False)
    for overlap in order:
      row(i, overlap, run_once(args, overlap, workdir))
  med = {o: statistics.median(r["first"]["time/step"] for r in rs) for o, rs in results.items()}
  for o, rs in results.items():
    print(f"# overlap={o}: step 1 {bc.spread([r['first']['time/step'] for r in rs])} s")
  print(f"# ratio on/off of the medians: {med[True] / med[False]:.2f}")
  same = {repr(r["second"]["actor/loss"]) for rs in results.values() for r in rs}
  print(f"# step 2's loss on every run: {'the same' if len(same) == 1 else sorted(same)}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
