"""The commands a run prints at its end (``next:``) work as pasted: in a shell whose PATH
lacks the venv they name the venv's script by its full path, and the eval command of a
launched run carries none of the launch-only flags that eval refuses (issue 36)."""

import json
import os
import shlex
import stat
import subprocess
import sys

import pytest

from distflow_jax import cli
from distflow_jax.observe import invocation, progress
from workflow_util import tiny_model_folder

BIN = os.path.dirname(sys.executable)


def _script(folder, name="distflow-jax"):
  folder.mkdir(parents=True, exist_ok=True)
  path = folder / name
  path.write_text("#!/bin/sh\n")
  path.chmod(path.stat().st_mode | stat.S_IXUSR)
  return str(path)


def _path_without(*folders: str) -> str:
  drop = {os.path.realpath(f) for f in folders}
  return os.pathsep.join(p for p in os.environ.get("PATH", "").split(os.pathsep)
                         if p and os.path.realpath(p) not in drop)


@pytest.mark.timeout(30)
def test_command_is_the_bare_name_only_where_path_finds_this_interpreters_script(
    tmp_path, monkeypatch):
  venv = tmp_path / "venv" / "bin"
  script = _script(venv)
  monkeypatch.setattr(sys, "executable", str(venv / "python"))
  monkeypatch.setenv("PATH", str(venv) + os.pathsep + "/usr/bin")
  assert invocation.command() == "distflow-jax"
  monkeypatch.setenv("PATH", "/usr/bin")  # a fresh shell: the venv is not activated
  assert invocation.command() == script
  other = _script(tmp_path / "other")  # another install first on PATH: not this one
  monkeypatch.setenv("PATH", os.pathsep.join([os.path.dirname(other), str(venv)]))
  assert invocation.command() == script
  spaced = tmp_path / "my venv" / "bin"
  _script(spaced)
  monkeypatch.setattr(sys, "executable", str(spaced / "python"))
  assert shlex.split(invocation.command()) == [str(spaced / "distflow-jax")]
  # No script installed beside the interpreter (a source checkout run with python -m).
  monkeypatch.setattr(sys, "executable", str(tmp_path / "bare" / "python"))
  assert invocation.command() == f"{tmp_path}/bare/python -m distflow_jax.cli"


def _next_lines(**kw) -> dict[str, str]:
  lines = progress.summary_lines("runs/x", checkpoint_dir="runs/x/checkpoints",
                                 last_checkpoint=2, steps=2, seconds=3.0, eval_data="e.jsonl",
                                 **kw)
  out = {}
  for line in lines[lines.index("next:") + 1:]:
    (name,) = [c for c in ("report", "eval", "export") if c in shlex.split(line)]
    out[name] = line.strip()
  return out


@pytest.mark.timeout(60)
@pytest.mark.parametrize("venv_on_path", [True, False])
def test_next_commands_run_as_printed(tmp_path, monkeypatch, venv_on_path):
  """The report hint, pasted into bash (with --help appended), runs, whether or not the
  shell's PATH has the interpreter's bin folder."""
  if not os.path.isfile(os.path.join(BIN, "distflow-jax")):
    pytest.skip(f"no distflow-jax script beside {sys.executable} (pip install -e . installs it)")
  path = _path_without(BIN)
  if venv_on_path:
    path = BIN + os.pathsep + path
  monkeypatch.setenv("PATH", path)
  hints = _next_lines()
  words = {name: shlex.split(line) for name, line in hints.items()}
  want = ["distflow-jax"] if venv_on_path else [os.path.join(BIN, "distflow-jax")]
  for name, w in words.items():
    assert w[:2] == want + [name], hints
  env = dict(os.environ, PATH=path)
  done = subprocess.run(["bash", "-c", hints["report"] + " --help"], env=env, cwd=tmp_path,
                        capture_output=True, text=True, timeout=50)
  assert done.returncode == 0 and "report" in done.stdout, done.stderr[-2000:]


LAUNCHED = ["--config=grpo:tiny", "--config.trainer.total_steps=3",
            "--config.rollout.max_new_tokens=8", "--config.data.max_prompt_len=32",
            "--config.cluster.num_processes=2", "--config.cluster.devices_per_process=2",
            "--config.placement.actor.mesh.fsdp=2", "--config.rollout.tensor_parallel=2"]


def test_eval_hint_of_a_launched_run_drops_layout_flags():
  args = progress.eval_config_args(LAUNCHED + ["--config.logging.wandb.enabled=False"])
  assert args == ["--config=grpo:tiny", "--config.rollout.max_new_tokens=8",
                  "--config.data.max_prompt_len=32"]


@pytest.mark.timeout(300)
def test_eval_hint_of_a_launched_run_runs_in_one_process(tmp_path, capsys):
  """The eval line printed after `launch -n 2 ... train --config.cluster.num_processes=2`,
  run as printed here (one process), with only --model and --data pointed at real files."""
  model = tiny_model_folder(tmp_path)
  data = tmp_path / "eval.jsonl"
  data.write_text("".join(json.dumps({"prompt": f"What is {i} + 1?", "answer": f"#### {i + 1}"})
                          + "\n" for i in range(3)))
  line = _next_lines(config_args=LAUNCHED)["eval"]
  words = shlex.split(line)
  argv = words[words.index("eval") + 1:]
  assert not any(a.startswith(("--config.cluster.", "--config.placement.")) for a in argv), line
  argv = [f"--model={model}" if a.startswith("--model=") else
          f"--data={data}" if a.startswith("--data=") else a for a in argv]
  rc = cli.main(["eval", *argv, "--limit=2"])
  out, err = capsys.readouterr()
  assert rc == 0, err[-2000:]
  assert "eval/accuracy:" in out


@pytest.mark.timeout(60)
def test_a_run_without_a_checkpoint_offers_no_eval_or_export():
  """eval --model=RUN and export --checkpoint RUN read the run's checkpoint: a run that
  wrote none (e.g. asynchronous RL on processes of its own) is not told to run them."""
  lines = progress.summary_lines("runs/x", checkpoint_dir="runs/x/checkpoints",
                                 last_checkpoint=None, steps=2, seconds=3.0, eval_data=None)
  after = lines[lines.index("next:") + 1:]
  assert any(" report " in l for l in after), lines
  assert not any("--model=" in l or "--checkpoint " in l for l in after), lines
  assert not any(l.startswith("checkpoint:") for l in lines), lines
