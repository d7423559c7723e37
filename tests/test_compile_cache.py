"""The persistent compilation cache (trainer.compile_cache_dir) and compile-time metrics.

Two fresh `distflow-jax train` processes share a cache folder under tmp_path: the second
compiles nothing (every executable is a cache load) and its first step is much faster;
with the cache off a run compiles as before.  After step 1 no step compiles, also when a
later step's prompts take another prefill shape (the engine precompiles them all)."""

import json
import os
import subprocess
import sys

import pytest

from conftest import SHARED_CACHE_VARS, suite_flags, without_shared_cache
from workflow_util import smoke_overrides

from distflow_jax.run import compile_cache

TIMEOUT_S = 840


def _train(run_dir, cache: str, *extra: str) -> list[dict]:
  # Its own device count (1), and LLVM at level 1: the second run's step is timed against a
  # first that compiled, and at the suite's level 0 compiling is too cheap for the ratio.
  env = suite_flags(dict(os.environ, DISTFLOW_JAX_COMPILE_CACHE=cache), level=1)
  for key in SHARED_CACHE_VARS:  # the run's cache alone (tests/conftest.py's is jax's own)
    env.pop(key, None)
  keys = {e.split("=")[0] for e in extra}
  args = [f"--config.{o}" for o in smoke_overrides(run_dir, "trainer.save_every=0")
          if o.split("=")[0] not in keys] + [f"--config.{e}" for e in extra]
  cmd = ["timeout", "-s", "KILL", str(TIMEOUT_S - 60), sys.executable, "-m", "distflow_jax.cli",
         "train", *args]
  proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  with open(os.path.join(run_dir, "metrics.jsonl")) as f:
    return [json.loads(line) for line in f]


def _by_step(rows):
  return {int(r["step"]): r for r in rows}


@pytest.mark.slow
@pytest.mark.timeout(TIMEOUT_S * 3)
def test_second_run_loads_every_executable_and_no_step_after_the_first_compiles(tmp_path):
  cache = str(tmp_path / "cache")
  # Two buckets (the prompts are 14-18 tokens: either may be a prompt's prefill, and
  # the prompt columns a batch's width) and eval: later steps' prompts and the held-out
  # batch take other shapes.  Saves and evaluations at steps 2 and 3 (every 2 and at the
  # end): the first save checksums the trained state and the reference model, each its own
  # program, both compiled ahead; step 3 is a later step with a save and an evaluation.
  extra = ("trainer.total_steps=3", "trainer.eval_every=2", "rollout.prefill_buckets=(16,24)",
           "data.max_prompt_len=24", "data.chat_template=False", "trainer.save_every=2")
  first = _by_step(_train(str(tmp_path / "a"), cache, *extra))
  assert any(name.endswith("-cache") for name in os.listdir(cache))  # XLA:CPU entries written
  second = _by_step(_train(str(tmp_path / "b"), cache, *extra))
  # Cache off: step 1 of the smoke run alone says what is asserted of it (one bucket: what
  # is asserted, compiles and no loads, does not depend on the shapes).
  off = _by_step(_train(str(tmp_path / "c"), "", "trainer.total_steps=1"))

  assert first[1]["compile/count"] > 10 and first[1]["time/compile"] > 0
  assert second[0]["compile/count"] == 0 and second[0]["compile/cache_hits"] > 0
  assert second[1]["compile/count"] == 0, second[1]
  assert second[1]["compile/cache_hits"] >= first[1]["compile/count"] / 2
  assert second[1]["time/step"] < 0.5 * first[1]["time/step"], (first[1], second[1])
  # Cache off: compiles as before (no loads), the step-1 compiles of a plain run.
  assert off[1]["compile/count"] > 10 and off[1]["compile/cache_hits"] == 0
  for run in (first, second):
    later = {s: r["compile/count"] for s, r in run.items() if s >= 2}
    # nothing compiles after step 1
    assert sorted(later) == [2, 3] and not any(later.values()), later


def test_unwritable_folder_is_one_line_and_the_run_goes_on(tmp_path, monkeypatch):
  blocker = tmp_path / "file"
  blocker.write_text("")
  monkeypatch.setenv(compile_cache.ENV, str(blocker / "cache"))
  lines = []

  class Cfg:
    class trainer:  # noqa: N801 - a config's shape
      compile_cache_dir = "unused"

  assert compile_cache.enable(Cfg, lines.append) == ""
  assert len(lines) == 1 and lines[0].startswith("compile cache off: cannot write ")
  assert "\n" not in lines[0]


_AUTOTUNE_PROBE = """
import sys
from distflow_jax.run import compile_cache
class Cfg:
  class trainer:
    compile_cache_dir = sys.argv[1]
assert compile_cache.enable(Cfg) == sys.argv[1]
from jax._src import compiler
opts = compiler.get_compile_options(num_replicas=1, num_partitions=1).executable_build_options
print(opts.debug_options.xla_gpu_per_fusion_autotune_cache_dir)
"""


@pytest.mark.timeout(120)
def test_gpu_autotune_results_are_kept_beside_the_compile_cache(tmp_path):
  """With the run's cache on, every compile's options point XLA:GPU's per-fusion autotune
  cache into it: a second run on a GPU skips autotuning its kernels as it skips their
  compiles.  A JAX_PERSISTENT_CACHE_ENABLE_XLA_CACHES the user set ("" = jax's companion
  caches off) is respected.  (jax's default already names this cache; the test pins it.)"""
  env = without_shared_cache(os.environ)
  env.pop(compile_cache.ENV, None)
  for setting, want in ((None, str(tmp_path / "c" / "xla_gpu_per_fusion_autotune_cache_dir")),
                        ("", "")):
    env.pop("JAX_PERSISTENT_CACHE_ENABLE_XLA_CACHES", None)
    if setting is not None:
      env["JAX_PERSISTENT_CACHE_ENABLE_XLA_CACHES"] = setting
    out = subprocess.run([sys.executable, "-c", _AUTOTUNE_PROBE, str(tmp_path / "c")],
                         env=env, capture_output=True, text=True, timeout=50)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == want, (setting, out.stdout)


def test_folder_from_env_else_config_and_home_expanded(monkeypatch):
  class Cfg:
    class trainer:  # noqa: N801
      compile_cache_dir = "~/x"

  monkeypatch.delenv(compile_cache.ENV, raising=False)
  assert compile_cache.configured_dir(Cfg) == os.path.expanduser("~/x")
  monkeypatch.setenv(compile_cache.ENV, "")
  assert compile_cache.configured_dir(Cfg) == ""
  monkeypatch.setenv(compile_cache.ENV, "/tmp/elsewhere")
  assert compile_cache.configured_dir(Cfg) == "/tmp/elsewhere"


def test_default_is_per_user_and_per_jax_version():
  import jax

  from distflow_jax.config import loading
  cfg = loading.load("grpo:tiny")
  assert cfg.trainer.compile_cache_dir == f"~/.cache/distflow-jax/jax-{jax.__version__}"


def test_progress_line_shows_a_compile_after_the_first_step_within_80_columns():
  import io

  from distflow_jax.observe import progress
  out = io.StringIO()
  log = progress.Logger(True, out, tty=False)
  full = {"reward": 0.5, "accuracy": 0.5, "response_length": 20.0, "actor/kl": 0.01,
          "tokens_per_s": 1234.0, "health/kl_high": 1.0}
  log.step({"step": 1, "compile/count": 40.0, "time/compile": 30.0, **full}, 50)
  log.step({"step": 2, "compile/count": 1.0, "time/compile": 2.04, **full}, 50)
  log.step({"step": 3, "compile/count": 0.0, "time/compile": 0.0, **full}, 50)
  lines = out.getvalue().splitlines()
  assert "compiled" not in lines[0] and "compiled" not in lines[2]  # step 1 always compiles
  assert "compiled 2.0s" in lines[1] and "!kl_high" in lines[1]
  assert all(len(line) <= 80 for line in lines)
