"""README's test command is exactly the command .ci/run runs (README "The two commands")."""

import os
import re

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _read(*parts: str) -> str:
  with open(os.path.join(REPO, *parts), encoding="utf-8") as f:
    return f.read()


@pytest.mark.timeout(30)
def test_readme_test_command_is_the_ci_command():
  ci = [l for l in _read(".ci", "run").splitlines() if l.startswith("python3 -m venv")]
  assert len(ci) == 1, ci
  blocks = re.findall(r"```bash\n(.*?)\n```", _read("README.md"), re.S)
  readme = [b for b in blocks if "pytest" in b and b.startswith("python3 -m venv")]
  assert readme == ci
  # One pytest, every test in it: two workers, stealing, so the slow-first order
  # (tests/conftest.py) lets both finish together; no -m leaves a test out.
  assert ci[0].endswith("pytest -q -n 2 --dist worksteal"), ci[0]


@pytest.mark.timeout(30)
def test_modules_with_a_slow_or_multiprocess_test_are_collected_first_and_kept_whole():
  import types

  import conftest

  class Item:
    def __init__(self, module, name, mark=None):
      self.module, self.name, self.mark = types.SimpleNamespace(__name__=module), name, mark

    def get_closest_marker(self, name):
      return object() if name == self.mark else None

  items = [Item("test_a", "a1"), Item("test_b", "b1"), Item("test_b", "b2", "slow"),
           Item("test_c", "c1", "slow"), Item("test_a", "a2"), Item("test_d", "d1"),
           Item("test_b", "b3"), Item("test_e", "e1", "multiprocess"), Item("test_e", "e2")]
  conftest.pytest_collection_modifyitems(None, items)
  assert [i.name for i in items] == ["b1", "b2", "c1", "b3", "e1", "e2", "a1", "a2", "d1"]


@pytest.mark.timeout(30)
def test_the_avx2_variant_caps_every_process_it_starts():
  from distflow_jax import launcher

  import isa

  base = {"XLA_FLAGS": "--xla_cpu_max_isa=AVX512 --xla_dump_to=/tmp/x "
                       "--xla_backend_optimization_level=1", "PATH": "/bin"}
  for which, want in (("native", None), ("avx2", "--xla_cpu_max_isa=AVX2")):
    env = launcher.child_env(isa.isa_env(which, base), coordinator="127.0.0.1:1",
                             num_processes=2, process_id=1, devices_per_process=2)
    flags = env["XLA_FLAGS"].split()
    assert [f for f in flags if f.startswith("--xla_cpu_max_isa")] == ([want] if want else [])
    assert "--xla_dump_to=/tmp/x" in flags and "--xla_force_host_platform_device_count=2" in flags
    # both sides of a bitwise claim compile at XLA's default level, not the suite's level 1
    assert not [f for f in flags if f.startswith("--xla_backend_optimization_level")]


@pytest.mark.timeout(60)
def test_no_source_file_is_matched_by_gitignore():
  """A pattern such as ``models/`` (meant for the top-level model folder) also matches
  ``distflow_jax/models/``: a new module there is never committed and the clean clone CI
  runs fails to import it.  --no-index checks the patterns against tracked files too."""
  import shutil
  import subprocess
  if shutil.which("git") is None or not os.path.isdir(os.path.join(REPO, ".git")):
    pytest.skip("not a git checkout")
  files = []
  for top in ("distflow_jax", "configs", "launch", "tools", "tests"):
    for root, dirs, names in os.walk(os.path.join(REPO, top)):
      dirs[:] = [d for d in dirs if d != "__pycache__" and not d.startswith(".")]
      files += [os.path.relpath(os.path.join(root, n), REPO) for n in names
                if n.endswith((".py", ".json", ".md", ".jinja", ".txt"))]
  assert len(files) > 100
  proc = subprocess.run(["git", "check-ignore", "--no-index", "--stdin"], cwd=REPO,
                        input="\n".join(files), capture_output=True, text=True, timeout=30)
  assert proc.returncode in (0, 1), proc.stderr
  assert proc.stdout.split() == [], f"ignored by .gitignore: {proc.stdout.split()[:10]}"
