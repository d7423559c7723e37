"""Asynchronous RL: the synchronous loop vs trainer.max_staleness=1 and 2, on the same devices.

    python tools/bench_async.py [--ks 0,1,2] [--repeats 3] [--steps 6] [--warmup 2]
                                [--prompts 8] [--n 4] [--new 32] [--devices 8]
                                [--processes 1|2] [--timeout 900] [--json FILE]

Every contender runs configs/grpo.py:tiny (the built-in 1.2 M-param model, not warm-started:
speed, not learning, is measured) on `--devices` simulated CPU devices split in two halves:
the rollout replicas on the first (placement.rollout.devices), the actor and the reference
on the second.  K = 0 is today's synchronous loop on that split (generate, score, then
train); K = 1, 2 overlap the rollout stage of batch j + 1 .. j + K (generate, the math
reward, GRPO's advantages, in a background thread) with the training of batch j
(run/async_rollout.py).  Prompts are padded to one width (one prefill bucket) so that no
timed step compiles.

Each contender is a child process (SIGKILL at `--timeout`) that runs `--warmup` +
`--steps` steps; the first `--warmup` (compiles) are left out.  Contenders alternate in
rotating order over `--repeats` rounds, so machine load hits all alike.  Reported per
contender, medians over every timed step of every round: the step's wall time
(time/step), its parts -- the rollout stage (sum of its nodes' times: in the background
for K > 0), the training part (the nodes after it, with the move onto the training
devices) and, for K > 0, how long the trainer waited for its batch (time/async_wait) --
and the step time over the synchronous one.  The load average is printed at the start and
the end: on a machine whose cores the simulated devices share, the two halves compete for
the same cores and overlap buys little; issue 33's target (K = 1 at <= 0.6 x the
synchronous step when rollout and training take about equal time) needs disjoint
hardware.

``--processes 2``: the same split over two processes (``distflow-jax launch``), one
holding the rollout's half, the other the training's (run/disjoint.py; K = 0 is the
synchronous loop through the same transfers), each pinned to a core of its own
(``taskset -c <process index>``), so that each group has hardware of its own.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _bench_common as bc  # noqa: E402


def overrides(args: argparse.Namespace, k: int, run_dir: str) -> list[str]:
  half = args.devices // 2
  rows = args.prompts * args.n
  procs = getattr(args, "processes", 1)
  return [
      f"run_dir={run_dir}", f"cluster.num_processes={procs}",
      f"cluster.devices_per_process={args.devices // procs}",
      "model.warmstart.steps=0", "trainer.eval_every=0", "trainer.log_samples=0",
      f"trainer.total_steps={args.warmup + args.steps}", f"trainer.max_staleness={k}",
      f"data.prompts_per_step={args.prompts}", f"rollout.n={args.n}",
      f"data.max_prompt_len={PROMPT}", f"rollout.prefill_buckets=({PROMPT},)",
      f"rollout.max_new_tokens={args.new}", f"actor.micro_batch_size={rows // half}",
      f"placement.rollout.devices=0:{half}", f"placement.actor.devices={half}:{args.devices}",
      f"placement.reference.devices={half}:{args.devices}",
  ] + ([f"model.max_seq_len={PROMPT + args.new}"] if PROMPT + args.new > TINY_SEQ else [])


PROMPT, TINY_SEQ = 32, 80  # the padded prompt width; grpo:tiny's model.max_seq_len


def child(args: argparse.Namespace) -> None:
  """One contender: its steps' times as one tagged JSON line (from the process that
  trains, with ``--processes 2``)."""
  if args.processes > 1:
    from distflow_jax import distributed
    distributed.initialize()
  from distflow_jax.config import async_checks, loading
  from distflow_jax.run import trainer
  with tempfile.TemporaryDirectory(prefix="bench-async-") as own:
    run_dir = args.run_dir or own  # the parent's, shared by the processes of one run
    cfg = loading.load("grpo:tiny", overrides(args, args.k, run_dir))
    ctx, loaders = trainer.setup(cfg, log=lambda m: None)
    n = async_checks.rollout_stage(ctx.plan)
    stage = [s.node.id for s in ctx.plan.steps[:n]]
    rest = [s.node.id for s in ctx.plan.steps[n:]]
    rows = []
    for m in trainer.train(ctx, loaders):
      rows.append({
          "step": int(m["step"]), "time": m["time/step"],
          "rollout": sum(m[f"time/{i}"] for i in stage),
          "train": sum(m[f"time/{i}"] + m.get(f"time/move_to/{i}", 0.0) for i in rest),
          "wait": m.get("time/async_wait", 0.0), "staleness": m.get("async/staleness", 0.0),
          "compiles": m.get("compile/count", 0.0)})
  if rows:  # a rollout process of a run on disjoint processes trains (and reports) none
    bc.emit({"k": args.k, "steps": rows})


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--ks", default="0,1,2", help="max_staleness values; 0 = synchronous")
  p.add_argument("--repeats", type=int, default=3)
  p.add_argument("--steps", type=int, default=6, help="timed steps per run")
  p.add_argument("--warmup", type=int, default=2, help="untimed first steps per run")
  p.add_argument("--prompts", type=int, default=8)
  p.add_argument("--n", type=int, default=4)
  p.add_argument("--new", type=int, default=32,
                 help="rollout.max_new_tokens (over 48: model.max_seq_len raised to 32 + it)")
  p.add_argument("--devices", type=int, default=8, help="simulated CPU devices (split in 2)")
  p.add_argument("--processes", type=int, default=1, choices=(1, 2),
                 help="2: the rollout half and the training half in processes of their own, "
                      "each pinned to its own core")
  p.add_argument("--timeout", type=float, default=900, help="SIGKILL deadline per run, s")
  p.add_argument("--json", default="", help="write the figures here")
  p.add_argument("--k", type=int, default=None, help=argparse.SUPPRESS)  # the child
  p.add_argument("--run_dir", default="", help=argparse.SUPPRESS)  # the child's
  args = p.parse_args()
  if args.k is not None:
    child(args)
    return
  bc.flush_lines()
  ks = [int(k) for k in args.ks.split(",")]
  print(f"start: {bc.load_line()}")
  where = ("" if args.processes == 1 else
           f" over 2 processes (one each, pinned to cores 0 and 1)")
  print(f"grpo:tiny, {args.prompts} prompts x {args.n}, <= 32 + {args.new} tokens, "
        f"{args.devices} simulated CPU devices: rollout on 0:{args.devices // 2}, training on "
        f"{args.devices // 2}:{args.devices}{where}; {args.steps} timed steps after "
        f"{args.warmup}, {args.repeats} rounds" + (
            f"; model.max_seq_len={PROMPT + args.new}" if PROMPT + args.new > TINY_SEQ else ""))
  steps: dict[int, list[dict]] = {k: [] for k in ks}
  base = [sys.executable, os.path.abspath(__file__)] + [
      f"--{a}={getattr(args, a)}" for a in ("steps", "warmup", "prompts", "n", "new",
                                            "devices", "processes")]
  env = bc.child_env(args.devices)
  if args.processes > 1:  # each process on its own core; the launcher SIGKILLs at timeout
    base = [sys.executable, "-m", "distflow_jax.cli", "launch", "-n", str(args.processes),
            "--devices-per-process", str(args.devices // args.processes),
            f"--timeout={args.timeout}", "--", "sh", "-c",
            'exec taskset -c "$DISTFLOW_PROCESS_ID" "$0" "$@"', *base]
    env = bc.child_env()

  def contender(k: int):
    def go():
      with tempfile.TemporaryDirectory(prefix="bench-async-") as run_dir:
        res = bc.run_with_deadline(base + [f"--k={k}", f"--run_dir={run_dir}"],
                                   args.timeout + 30, env=env, die_with_parent=True)
      lines = [l.split("] ", 1)[1] if l.startswith("[") and "] " in l else l
               for l in res.output.splitlines()]  # the launcher's "[i] " prefixes
      recs = bc.tagged(lines)
      if res.returncode or not recs:
        tail = res.output.strip().splitlines()[-3:]
        raise SystemExit(f"max_staleness={k}: run failed (exit {res.returncode}): {tail}")
      timed = [r for r in recs[0]["steps"] if r["step"] > args.warmup]
      steps[k].extend(timed)
      return timed
    return go

  def on_time(i, name, secs, timed):
    print(f"  round {i + 1} {name}: step {statistics.median(r['time'] for r in timed):.3f} s "
          f"(run {secs:.0f} s)")

  bc.alternate({f"K={k}": contender(k) for k in ks}, args.repeats, rotate=True,
               on_time=on_time)
  med = {k: {f: statistics.median(r[f] for r in steps[k])
             for f in ("time", "rollout", "train", "wait", "staleness")} for k in ks}
  table = bc.Table(bc.Col("max_staleness", 13, "<"), bc.Col("step s", 20),
                   bc.Col("rollout s", 10), bc.Col("train s", 9), bc.Col("wait s", 8),
                   bc.Col("staleness", 9), bc.Col("compiles", 8), bc.Col("x sync", 7),
                   rule=True)
  sync = med[ks[0]]["time"] if ks[0] == 0 else None
  for k in ks:
    m = med[k]
    table.row(f"{k}" + (" (sync)" if k == 0 else ""),
              bc.spread([r["time"] for r in steps[k]]), f"{m['rollout']:.3f}",
              f"{m['train']:.3f}", f"{m['wait']:.3f}", f"{m['staleness']:.2f}",
              f"{sum(r['compiles'] for r in steps[k]):.0f}",
              f"{m['time'] / sync:.2f}" if sync else "-")
  if sync:
    print(f"rollout / train in the synchronous step: {med[0]['rollout'] / med[0]['train']:.2f}")
  print(f"end: {bc.load_line()}")
  if args.json:
    bc.write_json(args.json, {"args": vars(args), "medians": {str(k): med[k] for k in ks},
                              "steps": {str(k): steps[k] for k in ks}}, indent=1)


if __name__ == "__main__":
  main()
