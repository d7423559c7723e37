"""Compares the shipped RL algorithms (configs/algorithms.py) on the built-in tasks.

    python tools/compare_algorithms.py --steps 50 --out runs/compare_algorithms
    python tools/compare_algorithms.py --tasks letters --algorithms grpo,rloo --steps 20
    python tools/compare_algorithms.py --tasks arithmetic --algorithms grpo --seeds 0,1,2

Every (task, algorithm) pair is one ``distflow-jax train`` process with the same sample
budget: ``--steps`` steps of ``--samples-per-step`` trained samples (prompts x rollout.n:
16 x 8 for the group estimators, 128 x 1 for PPO).  The runs go one at a time, the tasks
alternating, each algorithm's runs next to each other.  The built-in model is warm-started
once per task (its own process) and that cache is copied into every run of the task, so
all algorithms start from the same weights and no run's time includes a warm start.
``--seeds 0,1,2`` runs every pair once per seed (``seed=S``: the warm start, the rows
drawn and every sample), each seed with its own warm start, and adds a row per pair with
the seeds' mean, standard deviation and range: a curve a user can check is a spread over
seeds, not one run's digits.

Held-out accuracy (``eval/accuracy``, every ``trainer.eval_every`` steps and at step 0) is
read from each run's metrics.jsonl.  Writes ``<out>/compare.md`` (start, best and final
accuracy, the final accuracy's standard error sqrt(p(1-p)/n_eval), samples trained and
generated, wall time, health alarms) and ``<out>/compare.png`` (accuracy against step,
trained samples on the top axis, a line per algorithm, a panel per task).  The load
average (``uptime``) at the start and the end goes into the table's header: times from a
loaded machine are not speeds.  Needs matplotlib for the plot.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import shutil
import sys
import time
from collections.abc import Sequence

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _bench_common as bc  # noqa: E402

ALGORITHMS = ("ppo", "grpo", "drgrpo", "rloo", "reinforce_pp_baseline", "dapo", "gspo", "gpg",
              "cispo", "gmpo", "sapo", "clip_cov", "kl_cov", "opo", "grpo_passk", "remax",
              "otb")
# Health read from the last steps' metrics: the policy's entropy, the share of tokens a
# clip (or Clip-Cov's cut) changed, the KL to the reference.
HEALTH = (("entropy", "actor/entropy"), ("clipfrac", "actor/pg_clipfrac"), ("KL", "actor/kl"))
HEALTH_STEPS = 10
TASKS = ("arithmetic", "letters")
DEFAULT_LEVEL = "basic"
# A child that only warm-starts: trainer.setup makes and caches the model, trains nothing.
_WARM_START = """import sys
from distflow_jax import distributed
from distflow_jax.config import loading
cfg = loading.load(sys.argv[1], sys.argv[2:])
distributed.simulate_cpu_devices(cfg.cluster.devices_per_process)
from distflow_jax.run import trainer
trainer.setup(cfg, log=print)
"""


@dataclasses.dataclass
class Run:
  task: str
  algorithm: str
  run_dir: str
  overrides: list[str]
  samples_per_step: int
  n_eval: int
  # Greedy responses a step beside the samples (ReMax's baseline: one per prompt).
  greedy_per_step: int = 0
  rc: int | None = None
  wall_s: float = 0.0
  curve: list[tuple[int, float]] = dataclasses.field(default_factory=list)
  steps_done: int = 0
  train_s: float = 0.0
  generated: int = 0
  alarms: list[str] = dataclasses.field(default_factory=list)
  health: dict[str, float] = dataclasses.field(default_factory=dict)
  note: str = ""
  seed: int = 0


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--steps", type=int, default=50, help="RL steps per run")
  p.add_argument("--tasks", default=",".join(TASKS),
                 help=f"built-in tasks, comma-separated, each <task>[:<level>] (level "
                      f"{DEFAULT_LEVEL} by default)")
  p.add_argument("--algorithms", default=",".join(ALGORITHMS),
                 help="variants of configs/algorithms.py, comma-separated")
  p.add_argument("--out", default="runs/compare_algorithms", help="output directory")
  p.add_argument("--samples-per-step", type=int, default=128,
                 help="trained samples per step, the same for every run")
  p.add_argument("--eval-every", type=int, default=0, help="0 = the config's (10)")
  p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                 help="a config override for every run, e.g. --set model.preset=micro")
  p.add_argument("--run-timeout", type=float, default=0, help="seconds per run; 0 = none")
  p.add_argument("--seeds", default="0", help="seeds, comma-separated: each pair runs once "
                 "per seed, with its own warm start (default 0)")
  args = p.parse_args(argv)
  try:
    args.seeds = [int(x) for x in args.seeds.split(",") if x.strip()]
  except ValueError:
    p.error(f"--seeds takes integers, comma-separated; got {args.seeds!r}")
  if not args.seeds or len(set(args.seeds)) != len(args.seeds):
    p.error("--seeds needs at least one seed, none twice")
  args.tasks = [t for t in args.tasks.split(",") if t]
  args.algorithms = [a for a in args.algorithms.split(",") if a]
  bad = [a for a in args.algorithms if a not in ALGORITHMS]
  if bad or not args.algorithms:
    p.error(f"unknown algorithms {bad}; valid: {','.join(ALGORITHMS)}")
  if args.steps < 1 or args.samples_per_step < 1:
    p.error("--steps and --samples-per-step must be >= 1")
  return args


def task_spec(task: str) -> str:
  """``letters`` -> ``builtin:letters:basic``; refuses unknown tasks and levels."""
  from distflow_jax.tasks import registry
  name, _, level = task.partition(":")
  spec = f"{registry.PREFIX}{name}:{level or DEFAULT_LEVEL}"
  registry.parse(spec)
  return spec


def plan_runs(args: argparse.Namespace) -> list[Run]:
  """The runs in the order they go: per algorithm, one run per task."""
  from distflow_jax.config import loading
  runs = []
  for algorithm, task, seed in ((a, t, s) for a in args.algorithms for t in args.tasks
                                for s in args.seeds):
      spec = task_spec(task)
      run_dir = os.path.join(args.out, task.replace(":", "_"), algorithm)
      if len(args.seeds) > 1:
        run_dir = os.path.join(run_dir, f"seed{seed}")
      common = [f"data.train={spec}", f"data.eval={spec}", f"trainer.total_steps={args.steps}",
                "trainer.save_every=0", "trainer.keep=1", *args.set, f"seed={seed}"]
      if args.eval_every:
        common.append(f"trainer.eval_every={args.eval_every}")
      cfg = loading.load(f"algorithms:{algorithm}", common)
      if args.samples_per_step % cfg.rollout.n:
        raise SystemExit(f"--samples-per-step={args.samples_per_step} is not a multiple of "
                         f"{algorithm}'s rollout.n={cfg.rollout.n}")
      extra = [f"data.prompts_per_step={args.samples_per_step // cfg.rollout.n}",
               f"run_dir={run_dir}"]
      note = ""
      if cfg.critic.warmup_steps > args.steps // 10:
        # The critic's warm-up is a tenth of the configured 50 steps; keep it a tenth.
        extra.append(f"critic.warmup_steps={args.steps // 10}")
        note = f"critic warm-up {args.steps // 10} steps"
      greedy = args.samples_per_step // cfg.rollout.n if any(
          d["fn"] == "generate.greedy" for d in cfg.dag) else 0
      if greedy:
        note = f"+{greedy} greedy baseline responses a step (in generated)"
      runs.append(Run(task, algorithm, run_dir, common + extra, args.samples_per_step,
                      cfg.data.eval_size, greedy, note=note, seed=seed))
  return runs


def _child(cmd: list[str], log_path: str, timeout: float) -> int:
  """The child's exit status (124 when SIGKILLed at ``timeout`` s; 0 = no deadline)."""
  os.makedirs(os.path.dirname(os.path.abspath(log_path)), exist_ok=True)
  done = bc.run_with_deadline(cmd, timeout or None, log_path=log_path)
  return 124 if done.timed_out else done.returncode


def warm_start(out: str, task: str, run: Run, timeout: float) -> str | None:
  """Warm-starts the built-in model for ``task`` once; returns its cache folder (None when
  the runs load model.path and need none, or when it failed: each run then warm-starts)."""
  if any(o.startswith("model.path=") and o != "model.path=" for o in run.overrides):
    return None
  wdir = os.path.join(out, task.replace(":", "_"), f"_warmstart_seed{run.seed}")
  overrides = [o for o in run.overrides if not o.startswith("run_dir=")] + [f"run_dir={wdir}"]
  cmd = [sys.executable, "-c", _WARM_START, f"algorithms:{run.algorithm}", *overrides]
  print(f"[compare] warm start for {task} ...", flush=True)
  rc = _child(cmd, wdir + ".log", timeout)
  cache = os.path.join(wdir, "warmstart")
  if rc != 0 or not os.path.isdir(cache):
    print(f"[compare] warm start for {task} failed (rc {rc}, see {wdir}.log); each run "
          f"warm-starts itself", flush=True)
    return None
  return cache


def execute(run: Run, cache: str | None, timeout: float) -> None:
  """Runs one training process (a fresh run dir) and reads its metrics."""
  shutil.rmtree(run.run_dir, ignore_errors=True)
  if cache is not None:  # the warm start's key file makes the run take it as its own
    shutil.copytree(cache, os.path.join(run.run_dir, "warmstart"))
  cmd = [sys.executable, "-m", "distflow_jax.cli", "train", f"--config=algorithms:{run.algorithm}",
         *[f"--config.{o}" for o in run.overrides]]
  t0 = time.perf_counter()
  run.rc = _child(cmd, run.run_dir + ".log", timeout)
  run.wall_s = time.perf_counter() - t0
  read_metrics(run)


def read_metrics(run: Run) -> None:
  rows = bc.read_jsonl(os.path.join(run.run_dir, "metrics.jsonl"))
  run.curve = [(int(r["step"]), float(r["eval/accuracy"])) for r in rows if "eval/accuracy" in r]
  steps = [r for r in rows if "time/step" in r]
  run.steps_done = len(steps)
  run.train_s = sum(float(r["time/step"]) for r in steps)
  # Dynamic sampling generates a whole batch per try; ReMax one greedy response per prompt
  # besides; the others generate what they train.
  run.generated = int(sum(r.get("dynamic_sampling/tries", 1.0) for r in steps)
                      * run.samples_per_step) + run.greedy_per_step * len(steps)
  fired = {k[len("health/"):] for r in rows for k, v in r.items()
           if k.startswith("health/") and v == 1.0}
  run.alarms = sorted(fired)
  last = steps[-HEALTH_STEPS:]
  for name, key in HEALTH:
    vals = [float(r[key]) for r in last if key in r]
    if vals:
      run.health[name] = sum(vals) / len(vals)


def _pct(x: float) -> str:
  return f"{100 * x:.1f}%"


def table(runs: list[Run], args: argparse.Namespace, load_start: str, load_end: str) -> str:
  lines = [
      "# RL algorithms on the built-in tasks (configs/algorithms.py)", "",
      f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; {args.steps} steps x "
      f"{args.samples_per_step} trained samples a step per run; overrides for every run: "
      f"{' '.join(args.set) or 'none'}.", "",
      f"Load average (1, 5, 15 min) at start: {load_start}; at end: {load_end}.", "",
      "Accuracy: held-out eval/accuracy; SE = sqrt(p(1-p)/n_eval) of the final accuracy. "
      "Generated samples count DAPO's dynamic-sampling retries. Train s = the sum of the "
      "steps' time/step (no setup, compile of the first step included). Entropy, clipfrac "
      "(the share of tokens a clip changed; Clip-Cov: the share cut) and KL (to the "
      f"reference): means over the last {HEALTH_STEPS} steps; - = the loss reports none.", ""]
  table = bc.Table(*[bc.Col(t) for t in (
      "task", "algorithm", "seed", "start", "best (step)", "final", "SE", "n_eval",
      "trained samples", "generated samples", "wall s", "train s", "health alarms",
      *(name for name, _ in HEALTH), "notes")],
      markdown=True, out=lines.append)
  for r in runs:
    if r.curve:
      start, final = r.curve[0][1], r.curve[-1][1]
      best_step, best = max(r.curve, key=lambda sa: (sa[1], -sa[0]))
      se = math.sqrt(final * (1 - final) / r.n_eval)
      acc = [_pct(start), f"{_pct(best)} ({best_step})", _pct(final), _pct(se)]
    else:
      acc = ["-"] * 4
    note = "; ".join(x for x in (r.note, f"failed: rc {r.rc}, see {r.run_dir}.log"
                                 if r.rc else "") if x)
    table.row(r.task, r.algorithm, r.seed, *acc, r.n_eval, r.steps_done * r.samples_per_step,
              r.generated, f"{r.wall_s:.0f}", f"{r.train_s:.0f}", ", ".join(r.alarms) or "-",
              *(f"{r.health[n]:.3g}" if n in r.health else "-" for n, _ in HEALTH),
              note or "-")
  if len(args.seeds) > 1:
    lines += ["", "Over the seeds (each curve point: the seeds' mean; std is the sample "
              "standard deviation of the final accuracy across seeds):", ""]
    summary = bc.Table(*[bc.Col(t) for t in ("task", "algorithm", "seeds", "start mean",
                                             "final mean", "final std", "final range",
                                             "mean curve")],
                       markdown=True, out=lines.append)
    for (task, algorithm), group in seed_groups(runs).items():
      s = seed_summary(group)
      if s is None:
        summary.row(task, algorithm, len(group), "-", "-", "-", "-", "not every seed finished")
        continue
      summary.row(task, algorithm, len(group), _pct(s["start"]), _pct(s["final"]),
                  _pct(s["std"]), f"{_pct(s['low'])}-{_pct(s['high'])}",
                  " ".join(f"{st}:{_pct(a)}" for st, a in s["curve"]))
  return "\n".join(lines) + "\n"


def seed_groups(runs: list[Run]) -> dict[tuple[str, str], list[Run]]:
  out: dict[tuple[str, str], list[Run]] = {}
  for r in runs:
    out.setdefault((r.task, r.algorithm), []).append(r)
  return out


def seed_summary(group: list[Run]) -> dict | None:
  """The seeds' mean curve (steps every seed evaluated), the final accuracy's mean, sample
  standard deviation and range; None unless every seed has a curve."""
  if not group or any(not r.curve for r in group):
    return None
  steps = sorted(set.intersection(*(set(s for s, _ in r.curve) for r in group)))
  curve = [(st, sum(dict(r.curve)[st] for r in group) / len(group)) for st in steps]
  finals = [r.curve[-1][1] for r in group]
  mean = sum(finals) / len(finals)
  std = (math.sqrt(sum((f - mean) ** 2 for f in finals) / (len(finals) - 1))
         if len(finals) > 1 else 0.0)
  return {"start": sum(r.curve[0][1] for r in group) / len(group), "final": mean, "std": std,
          "low": min(finals), "high": max(finals), "curve": curve}


def plot(runs: list[Run], tasks: list[str], samples_per_step: int, path: str) -> None:
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  from matplotlib.ticker import MaxNLocator
  fig, axes = plt.subplots(1, len(tasks), figsize=(5.5 * len(tasks), 4.2), squeeze=False)
  for ax, task in zip(axes[0], tasks):
    high = 0.0
    for r in (r for r in runs if r.task == task and r.curve):
      steps, acc = zip(*r.curve)
      label = r.algorithm if len({x.seed for x in runs}) == 1 else f"{r.algorithm} seed {r.seed}"
      ax.plot(steps, [100 * a for a in acc], marker="o", markersize=3, label=label)
      high = max(high, 100 * max(acc))
    ax.set_ylim(0, min(100, max(5, 1.15 * high)))
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_title(f"builtin:{task}")
    ax.set_xlabel("step")
    ax.set_ylabel("held-out accuracy (%)")
    ax.grid(alpha=0.3)
    top = ax.secondary_xaxis("top", functions=(lambda s: s * samples_per_step,
                                               lambda x: x / samples_per_step))
    top.set_xlabel("trained samples")
    ax.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def main(argv: Sequence[str] | None = None) -> int:
  args = parse_args(argv)
  runs = plan_runs(args)
  os.makedirs(args.out, exist_ok=True)
  load_start = bc.load_average()
  print(f"[compare] {len(runs)} runs; load average at start {load_start}", flush=True)
  caches = {}
  for run in runs:
    key = (run.task, run.seed)
    if key not in caches:
      caches[key] = warm_start(args.out, run.task, run, args.run_timeout)
    print(f"[compare] {run.task} / {run.algorithm} / seed {run.seed} ...", flush=True)
    execute(run, caches[key], args.run_timeout)
    final = _pct(run.curve[-1][1]) if run.curve else "-"
    print(f"[compare] {run.task} / {run.algorithm} / seed {run.seed}: rc {run.rc}, "
          f"{run.wall_s:.0f}s, final held-out accuracy {final}", flush=True)
  load_end = bc.load_average()
  md = os.path.join(args.out, "compare.md")
  with open(md, "w") as f:
    f.write(table(runs, args, load_start, load_end))
  png = os.path.join(args.out, "compare.png")
  plot(runs, args.tasks, args.samples_per_step, png)
  print(f"[compare] load average at end {load_end}; wrote {md} and {png}", flush=True)
  return 1 if any(r.rc for r in runs) else 0


if __name__ == "__main__":
  sys.exit(main())
