"""Progress while nothing else prints (issue 36): the ETA from warm steps only, and the
heartbeat that names a long phase (compiling, the first eval chunk) every few seconds."""

from __future__ import annotations

import io

import pytest

from distflow_jax.observe import progress

pytestmark = pytest.mark.timeout(60)


class _Clock:
  def __init__(self):
    self.now = 1000.0

  def __call__(self) -> float:
    return self.now


def _steps(monkeypatch, seconds: list[float], total: int, compiles: dict[int, float] | None = None,
           first: int = 1) -> list[str]:
  clock = _Clock()
  monkeypatch.setattr(progress.time, "perf_counter", clock)
  out = io.StringIO()
  log = progress.Logger(True, out, tty=False)
  progress.phase(log, "compile/first step")
  for i, dt in enumerate(seconds):
    clock.now += dt
    step = first + i
    log.step({"step": step, "compile/count": (compiles or {}).get(step, 0.0)}, total)
  return [l for l in out.getvalue().splitlines() if l.startswith("step ")]


def test_eta_waits_for_a_warm_step_instead_of_scaling_the_compile(monkeypatch):
  # A 10-minute run: step 1 compiles for 286 s, then 2 s a step.
  lines = _steps(monkeypatch, [286.0, 2.0, 2.0], total=300, compiles={1: 40.0})
  assert "ETA after step 2" in lines[0] and "s/step" not in lines[0], lines[0]
  assert "2.00s/step" in lines[1] and "ETA 9:56" in lines[1], lines[1]
  assert "ETA 9:54" in lines[2], lines[2]


def test_a_mid_run_recompile_and_a_resumed_first_step_do_not_count(monkeypatch):
  # Resumed at step 41 (compiles again), warm 3 s steps, a recompile of 60 s at step 43.
  lines = _steps(monkeypatch, [200.0, 3.0, 60.0, 3.0], total=100, compiles={43: 2.0},
                 first=41)
  assert "ETA after step 42" in lines[0]
  assert "3.00s/step" in lines[2] and "3.00s/step" in lines[3], lines
  assert "ETA 2:48" in lines[3], lines[3]  # 56 steps x 3 s


# ---- the heartbeat ----------------------------------------------------------------------------------

def test_heartbeat_names_the_phase_while_it_runs_and_never_after():
  import threading
  import time

  from distflow_jax.observe import heartbeat
  lines, printing = [], threading.Event()

  def slow_log(line):  # a print that takes a while: stopping must wait for it
    printing.set()
    time.sleep(0.05)
    lines.append(line)
  with heartbeat.heartbeat(slow_log, "compile and first step", every_s=0.05) as beat:
    time.sleep(0.4)
    printing.wait(5)
  n = len(lines)
  assert n >= 2 and all(l.startswith("compile and first step: still running, ") and
                        l.endswith(" s") for l in lines), lines
  assert not beat._thread.is_alive()
  time.sleep(0.2)
  assert len(lines) == n  # nothing after the phase ended
  with heartbeat.heartbeat(lines.append, "off", every_s=0) as off:
    time.sleep(0.1)
  assert off is None and len(lines) == n


def test_heartbeat_interval_is_checked_as_a_config_value():
  from distflow_jax.config import loading, values
  from distflow_jax.observe import heartbeat
  cfg = loading.load("grpo:tiny")
  assert heartbeat.interval(cfg) == 15.0
  with cfg.unlocked():
    cfg.logging.heartbeat_s = -1.0
  with pytest.raises(loading.ConfigError, match="logging.heartbeat_s"):
    values.check_values(cfg)


@pytest.mark.timeout(300)
def test_train_eval_and_generate_print_heartbeats_during_their_first_compile(tmp_path, capsys):
  import json

  from distflow_jax import cli
  from workflow_util import tiny_model_folder
  model = tiny_model_folder(tmp_path)
  data = tmp_path / "d.jsonl"
  data.write_text("".join(json.dumps({"prompt": f"What is {i}+1?", "answer": str(i + 1)})
                          + "\n" for i in range(16)))
  code = cli.main(["train", f"--config.run_dir={tmp_path}/run", f"--config.model.path={model}",
                   f"--config.data.train={data}", "--config.data.eval=",
                   "--config.data.prompts_per_step=8", "--config.rollout.n=2",
                   "--config.actor.micro_batch_size=1", "--config.trainer.eval_every=0",
                   "--config.trainer.total_steps=1", "--config.logging.heartbeat_s=0.2"])
  out, err = capsys.readouterr()
  assert code == 0, err
  beats = [l for l in out.splitlines() if "compile and first step: still running" in l]
  assert beats, out
  assert out.index(beats[-1]) < out.index("step 1/1")  # within the phase, never after
  code = cli.main(["eval", f"--model={model}", f"--data={data}", "--limit=4",
                   "--config.logging.heartbeat_s=0.2"])
  out, err = capsys.readouterr()
  assert code == 0, err
  beats = [l for l in out.splitlines() if "eval: compiling the rollout, chunk 1/1: still "
           "running" in l]
  assert beats, out
  assert out.index(beats[-1]) < out.index("eval chunk 1/1")
  prompts = tmp_path / "p.jsonl"
  prompts.write_text(json.dumps({"prompt": "What is 2+3?"}) + "\n")
  code = cli.main(["generate", f"--model={model}", f"--prompts={prompts}",
                   f"--out={tmp_path}/out.jsonl", "--n=1", "--max_new_tokens=4",
                   "--config.logging.heartbeat_s=0.1"])
  out, err = capsys.readouterr()
  assert code == 0, err
  beats = [l for l in err.splitlines() if l.startswith(
      "generate: compiling the rollout and decoding 1 prompt(s): still running")]
  assert beats, err
  assert err.index(beats[-1]) < err.index("generate: 1 completions")


def test_heartbeat_prints_while_the_main_thread_holds_the_gil(tmp_path):
  """A compile can hold the GIL for minutes (a first step went 5.5 minutes silent): a log
  with a file descriptor gets its beats from a child process, which nothing here blocks.
  math.factorial is one C call that never releases the GIL; a thread printed nothing
  during it.  The log's own prefix, the compile note once past its threshold, none after."""
  import math
  import time

  from distflow_jax.observe import heartbeat
  # One C call of about 1.5 s on this machine, holding the GIL throughout: its size from a
  # short one (CPython's factorial grows about as n^1.6; a fixed n took 0.6 s on one machine
  # and 2 s on another).
  t0 = time.perf_counter()
  math.factorial(100_000)
  n = min(max(int(100_000 * (1.5 / max(time.perf_counter() - t0, 1e-3)) ** (1 / 1.6)),
              300_000), 1_500_000)
  path = tmp_path / "log.txt"
  with open(path, "w") as out:
    log = progress.Logger(True, out, tty=False)
    log("before")
    with heartbeat.heartbeat(log, "holding the GIL", every_s=0.1):
      t0 = time.perf_counter()
      math.factorial(n)
      held = time.perf_counter() - t0
    log("after")
    time.sleep(0.3)
  lines = path.read_text().splitlines()
  beats = [l for l in lines if "holding the GIL: still running" in l]
  assert held > 0.8 and len(beats) >= int(held / 0.1) - 3, (held, lines)
  assert lines[0].endswith("before") and lines[-1].endswith("after"), lines  # none after
  stamps = [float(l[1:l.index("s]")]) for l in beats]
  assert all(b - a < 0.5 for a, b in zip(stamps, stamps[1:])), stamps  # no gap of a C call


def test_a_long_compile_s_beat_explains_xla_s_slow_compile_line_once(monkeypatch, tmp_path):
  from distflow_jax.observe import heartbeat
  monkeypatch.setattr(heartbeat, "SLOW_COMPILE_AFTER_S", 0.25)
  for thread in (False, True):  # the child, and the thread of a plain callable
    path = tmp_path / f"log{thread}.txt"
    with open(path, "w") as out:
      log = progress.Logger(True, out, tty=False)
      with heartbeat.heartbeat(out.write if thread else log, "compile", every_s=0.1,
                               compiles=True):
        import time
        time.sleep(0.8)
    text = path.read_text()
    assert text.count("Very slow compile?") == 1 and "not an error" in text, text


@pytest.mark.timeout(300)
def test_a_cold_first_step_is_never_silent_for_long(tmp_path):
  """`train` in a process of its own, its stdout a file (as under nohup or CI): from the
  first line to step 1's, compile-ahead included, no gap between lines is over 3 heartbeat
  intervals (1 s here)."""
  import json
  import os
  import re
  import subprocess
  import sys

  from workflow_util import tiny_model_folder
  model = tiny_model_folder(tmp_path)
  data = tmp_path / "d.jsonl"
  data.write_text("".join(json.dumps({"prompt": f"What is {i}+1?", "answer": str(i + 1)})
                          + "\n" for i in range(16)))
  out = tmp_path / "out.txt"
  with open(out, "w") as f:
    proc = subprocess.run(
        [sys.executable, "-m", "distflow_jax.cli", "train", f"--config.run_dir={tmp_path}/run",
         f"--config.model.path={model}", f"--config.data.train={data}", "--config.data.eval=",
         "--config.data.prompts_per_step=8", "--config.rollout.n=2",
         "--config.actor.micro_batch_size=1", "--config.trainer.eval_every=0",
         "--config.trainer.total_steps=2", "--config.trainer.compile_ahead=always", "--config.logging.heartbeat_s=1"],
        stdout=f, stderr=subprocess.PIPE, text=True, timeout=240,
        env=dict(os.environ, JAX_PLATFORMS="cpu"))
  assert proc.returncode == 0, proc.stderr[-2000:]
  lines = out.read_text().splitlines()
  stamps = [float(m.group(1)) for m in map(re.compile(r"\[\s*([\d.]+)s\]").match, lines) if m]
  first_step = next(i for i, l in enumerate(lines) if l.startswith("step 1/2"))
  assert any("compile and first step: still running" in l for l in lines[:first_step]), lines
  gaps = [b - a for a, b in zip(stamps, stamps[1:])]
  assert stamps and max(gaps) <= 3.0, (max(gaps), lines)
