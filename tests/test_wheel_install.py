"""A non-editable install from the wheel trains with its shipped configs (issue 18).

The test venv has an editable install, which imports the package (and finds configs/)
from the source tree; this builds a wheel, installs it into a fresh venv without the
parent's site-packages, and runs the installed ``distflow-jax`` from outside the tree.
Dependencies come from the package index, pinned to the versions the test venv runs
(pip's cache makes every run after the first fast).
"""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import suite_flags

ROOT = Path(__file__).resolve().parents[1]

# What a wheel build reads; everything else (.git, the test venv, runs, caches, build/
# leftovers) stays behind.
_IGNORE = shutil.ignore_patterns(".git", ".venv", "venv", "build", "dist", "runs",
                                 "*.egg-info", "__pycache__", ".pytest_cache", ".hypothesis")

# One cheap GRPO step on the micro model; the rest of grpo:tiny as shipped.
CHEAP = [
    "--config.model.preset=micro",
    "--config.model.warmstart.steps=2",
    "--config.model.warmstart.batch_size=8",
    "--config.model.warmstart.examples=64",
    "--config.data.prompts_per_step=4",
    "--config.rollout.n=2",
    "--config.actor.micro_batch_size=8",
    # rollout.max_new_tokens as shipped: a smaller one would leave out every demonstration.
    "--config.rollout.max_concurrent_decodes=8",
    "--config.data.eval_size=8",
    "--config.trainer.eval_every=0",
    "--config.trainer.total_steps=1",
]


def _run(cmd, timeout, cwd, env=None):
  """subprocess.run with a hard deadline (run() SIGKILLs the child when it passes)."""
  r = subprocess.run([str(c) for c in cmd], cwd=cwd, env=env, capture_output=True,
                     text=True, timeout=timeout)
  assert r.returncode == 0, (f"{' '.join(map(str, cmd))} exited {r.returncode}\n"
                             f"stdout:\n{r.stdout[-4000:]}\nstderr:\n{r.stderr[-4000:]}")
  return r


def _clean_env():
  """The environment of a user's shell: no path into the source tree, one CPU device."""
  env = {k: v for k, v in os.environ.items()
         if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "PYTHONSTARTUP")}
  # conftest simulates 8 devices for this process; a user's machine has its own count.
  env = suite_flags(env)
  env["JAX_PLATFORMS"] = "cpu"
  return env


def _constraints(path: Path) -> Path:
  """The test venv's versions, so the wheel is tried against what the suite tested."""
  r = _run([sys.executable, "-m", "pip", "list", "--format=freeze", "--exclude-editable"],
           timeout=120, cwd=path.parent)
  pins = [l for l in r.stdout.splitlines()
          if "==" in l and not l.lower().startswith(("distflow-jax==", "distflow_jax=="))]
  path.write_text("\n".join(pins) + "\n")
  return path


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_wheel_installs_and_trains_outside_the_tree(tmp_path):
  # Build from a copy: an in-tree build leaves build/ behind, whose stale files (a module
  # since removed) would go into the next wheel, and two builds at once would collide.
  src = tmp_path / "src"
  shutil.copytree(ROOT, src, ignore=_IGNORE)
  wheels = tmp_path / "wheels"
  _run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
        "-w", wheels, src], timeout=300, cwd=tmp_path)
  (wheel,) = wheels.glob("distflow_jax-*.whl")
  shutil.rmtree(src)  # nothing of the source tree is left to import from

  venv = tmp_path / "venv"
  _run([sys.executable, "-m", "venv", venv], timeout=120, cwd=tmp_path)
  py, cli = venv / "bin" / "python", venv / "bin" / "distflow-jax"
  _run([py, "-m", "pip", "install", "-q", "--no-compile", "--disable-pip-version-check",
        "-c", _constraints(tmp_path / "constraints.txt"), wheel], timeout=600, cwd=tmp_path)

  work = tmp_path / "cwd"
  work.mkdir()
  env = _clean_env()
  r = _run([py, "-c", "import sysconfig, distflow_jax; from distflow_jax.config import "
            "loading; print(distflow_jax.__file__); print(sysconfig.get_paths()['purelib']);"
            " print(loading.configs_dir())"], timeout=120, cwd=work, env=env)
  module, purelib, configs = r.stdout.split()
  assert Path(module).resolve().is_relative_to(Path(purelib).resolve()), (module, purelib)
  assert Path(configs).resolve() == Path(purelib).resolve() / "distflow_jax" / "configs"

  # plan has no default config; name train's default, and the README's path form from a
  # cwd without configs/ (resolves to the shipped file).
  plan = _run([cli, "plan", "--config=grpo:tiny"], timeout=300, cwd=work, env=env)
  assert "config: grpo-tiny" in plan.stdout and "train_actor" in plan.stdout, plan.stdout
  plan = _run([cli, "plan", "--config=configs/ppo.py:tiny"], timeout=300, cwd=work, env=env)
  assert "config: ppo-tiny" in plan.stdout, plan.stdout

  # No --config: train's built-in default (grpo:tiny), the run issue 18 found broken.
  run_dir = tmp_path / "run"
  _run([cli, "train", f"--config.run_dir={run_dir}", *CHEAP], timeout=600, cwd=work, env=env)
  rows = [json.loads(l) for l in (run_dir / "metrics.jsonl").read_text().splitlines()
          if l.strip()]
  assert [r["step"] for r in rows if "step" in r] == [1], rows
