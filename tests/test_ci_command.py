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
  # The in-process pass: two workers, stealing, so the slow-first order
  # (tests/conftest.py) lets both finish together.
  assert '-n 2 --dist worksteal -m "not multiprocess"' in ci[0]


@pytest.mark.timeout(30)
def test_modules_with_a_slow_test_are_collected_first_and_kept_whole():
  import types

  import conftest

  class Item:
    def __init__(self, module, name, slow=False):
      self.module, self.name, self.slow = types.SimpleNamespace(__name__=module), name, slow

    def get_closest_marker(self, name):
      return object() if name == "slow" and self.slow else None

  items = [Item("test_a", "a1"), Item("test_b", "b1"), Item("test_b", "b2", slow=True),
           Item("test_c", "c1", slow=True), Item("test_a", "a2"), Item("test_b", "b3")]
  conftest.pytest_collection_modifyitems(None, items)
  assert [i.name for i in items] == ["b1", "b2", "c1", "b3", "a1", "a2"]
