"""tests/conftest.py's ``llvm_level1`` marker: a bitwise claim that holds only in
LLVM-optimized code runs in a pytest of its own at level 1 when the suite compiles at level
0, and its failure there is the test's failure."""

import os
import shutil
import subprocess
import sys
import time

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.mark.llvm_level1
def test_a_marked_test_never_runs_at_level_0():
  levels = [f for f in os.environ.get("XLA_FLAGS", "").split()
            if f.startswith("--xla_backend_optimization_level=")]
  assert not levels or levels[-1] != "--xla_backend_optimization_level=0", levels


@pytest.mark.timeout(200)
def test_a_marked_failure_at_level_1_fails_the_test_and_a_pass_passes(tmp_path):
  for name in ("conftest.py", "cpu_profile.py"):
    shutil.copy(os.path.join(HERE, name), tmp_path / name)
  (tmp_path / "test_probe.py").write_text(
      "import os\n"
      "import pytest\n\n"
      "def _level():\n"
      "  return [f for f in os.environ['XLA_FLAGS'].split()\n"
      "          if f.startswith('--xla_backend_optimization_level=')][-1].split('=')[1]\n\n"
      "@pytest.mark.llvm_level1\n"
      "def test_marked_passes():\n"
      "  assert _level() == '1'\n\n"
      "@pytest.mark.llvm_level1\n"
      "def test_marked_fails():\n"
      "  assert _level() == 'never', 'LEVEL-' + _level()\n\n"
      "def test_unmarked_stays_at_0():\n"
      "  assert _level() == '0'\n\n"
      "@pytest.mark.llvm_level1\n"
      "@pytest.mark.timeout(15)\n"
      "def test_marked_hangs():\n"
      "  import time\n"
      "  time.sleep(600)\n")
  env = {k: v for k, v in os.environ.items()
         if not k.startswith(("PYTEST_", "DISTFLOW_TEST_CPU_LOG"))}
  env["XLA_FLAGS"] = "--xla_backend_optimization_level=0"
  t0 = time.monotonic()
  out = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q",
                        str(tmp_path)], cwd=tmp_path, env=env, capture_output=True, text=True,
                       timeout=180)
  text = out.stdout + out.stderr
  assert out.returncode == 1, text[-3000:]
  assert "2 failed, 2 passed" in text, text[-3000:]
  assert "at LLVM level 1, in a pytest of its own" in text and "LEVEL-1" in text, text[-3000:]
  # The hanging one: SIGKILLed at its deadline (its limit less 10 s), not after 600 s.
  assert "the level-1 run of test_probe.py::test_marked_hangs ran past 5 s" in text, text[-3000:]
  assert time.monotonic() - t0 < 120
