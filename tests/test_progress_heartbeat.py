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
