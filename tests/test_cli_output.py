"""What the command line prints: a closed stdout ends quietly, help texts read as text."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from distflow_jax import cli
from distflow_jax.commands import NAMES

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _pipeline(command: str, reader: str) -> subprocess.CompletedProcess:
  """``distflow-jax <command> | <reader>`` in bash, under a SIGKILL deadline; prints the
  distflow-jax process's exit code last."""
  cli_cmd = f"{sys.executable} -m distflow_jax.cli {command}"
  script = f"set -o pipefail; {cli_cmd} | {reader}; echo \"rc=${{PIPESTATUS[0]}}\""
  env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
  return subprocess.run(["timeout", "-s", "KILL", "110", "bash", "-c", script], cwd=REPO,
                        env=env, capture_output=True, text=True, timeout=120)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("command, first", [
    ("help train", "distflow-jax train"),
    ("train --help", "distflow-jax train"),
    ("config --config=grpo:tiny", "actor."),
    ("--help", "distflow-jax"),
])
def test_a_closed_stdout_ends_quietly(command, first):
  r = _pipeline(command, "head -1")
  out = r.stdout.splitlines()
  assert first in out[0], r.stdout
  assert "Traceback" not in r.stderr and "Broken pipe" not in r.stderr, r.stderr
  assert r.stderr.strip() == "", r.stderr
  assert out[-1] in ("rc=0", f"rc={cli.EXIT_BROKEN_PIPE}"), r.stdout


@pytest.mark.timeout(300)
def test_a_reader_gone_before_the_first_write_gives_141_and_no_message():
  # `true` exits at once: every write of the command meets a closed pipe.
  r = _pipeline("config --config=grpo:tiny", "true")
  assert r.stderr.strip() == "", r.stderr
  assert r.stdout.splitlines()[-1] == f"rc={cli.EXIT_BROKEN_PIPE}", r.stdout


# ---- help texts -----------------------------------------------------------------------------------

WIDTH = 100
SUBPACKAGES = sorted(n for n in os.listdir(os.path.join(REPO, "distflow_jax"))
                     if os.path.isdir(os.path.join(REPO, "distflow_jax", n))
                     and not n.startswith("_"))
# A path into the package's source: distflow_jax/..., or <subpackage>/... not inside a
# longer path (runs/x/data/... and /data/... are the user's).
SOURCE_PATH = re.compile(r"distflow_jax/|(?<![\w/.~-])(?:" + "|".join(SUBPACKAGES) + r")/\w")


def _help(capsys, *argv: str) -> str:
  code = cli.main(list(argv))
  out, err = capsys.readouterr()
  assert code == 0, err
  return out


def _problems(text: str) -> list[str]:
  found = []
  for n, line in enumerate(text.splitlines(), 1):
    if "``" in line:
      found.append(f"line {n}: double backticks: {line!r}")
    if SOURCE_PATH.search(line):
      found.append(f"line {n}: a source path: {line!r}")
    if len(line) > WIDTH:
      found.append(f"line {n}: {len(line)} columns: {line!r}")
  return found


@pytest.mark.timeout(120)
@pytest.mark.parametrize("argv", [[name, "--help"] for name in NAMES]
                         + [["help", name] for name in NAMES] + [["--help"]])
def test_help_is_clean_text(capsys, argv):
  text = _help(capsys, *argv)
  assert text.strip(), argv
  assert not _problems(text), "\n".join(_problems(text))


@pytest.mark.timeout(120)
def test_eval_help_example_names_what_the_default_run_writes(capsys, tmp_path):
  """The example's --data is the held-out file `distflow-jax train` (grpo:tiny) writes."""
  from distflow_jax.commands import train
  from distflow_jax.config import loading
  from distflow_jax.run import trainer
  default = loading.load(train.DEFAULT_CONFIG)
  cfg = loading.load(train.DEFAULT_CONFIG, [f"run_dir={tmp_path}"])
  _, eval_path = trainer.dataset_paths(cfg)  # writes the built-in task's files under tmp_path
  written = os.path.join(default.run_dir, os.path.relpath(eval_path, tmp_path))
  text = _help(capsys, "eval", "--help")
  examples = [l for l in text.splitlines() if l.strip().startswith("distflow-jax eval")]
  assert f"--data={written}" in examples[0], (written, examples[0])
  assert f"--model={default.run_dir}" in examples[0], examples[0]
