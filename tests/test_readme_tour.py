"""README's tour, run as pasted into a fresh shell after the README's first command: the
first command's train and the tour's bash block are read from README.md, each line runs in
``bash -c`` in a fresh folder whose ``.venv`` stands for the one the install made, with a
PATH that lacks the venv's bin (a bare ``distflow-jax`` there is "command not found": only
the README's own ``source .venv/bin/activate`` finds it), and what each command promises is
checked.

Only what keeps it fast is added: the README's ``--config.trainer.total_steps=N`` (the
first command's implicit one first) become 1, 2, 3, ... in order, every ``train`` gets a
smaller model and batch (``FAST``), and paths under /tmp/ go under the test's own folder.
A README change that no longer runs as pasted fails here.
"""

import json
import os
import re
import shlex
import shutil
import subprocess
import sys

import pytest

from conftest import suite_flags
from distflow_jax.config import loading

pytestmark = pytest.mark.multiprocess  # its `launch` line starts 2 jax.distributed processes

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SECTION = "## A tour, after the first command"
FIRST = "## The two commands"
# Appended to each `train` (the same on both, so the launched one may resume the first).
FAST = ["--config.model.preset=micro", "--config.model.warmstart.steps=0",
        "--config.data.eval_size=8", "--config.data.prompts_per_step=8", "--config.rollout.n=2",
        "--config.rollout.max_new_tokens=8", "--config.actor.micro_batch_size=4"]
COMMAND_TIMEOUT_S = 200


def _blocks(section: str, readme: str = os.path.join(REPO, "README.md")) -> list[str]:
  """A section's bash blocks, a command a line (backslash continuations joined)."""
  text = open(readme).read()
  assert section in text, f"README.md has no {section!r} section"
  part = text.split(section, 1)[1].split("\n## ", 1)[0]
  blocks = re.findall(r"```bash\n(.*?)```", part, re.S)
  assert blocks, f"README.md's {section!r} has no bash block"
  lines = blocks[0].replace("\\\n", " ").splitlines()
  return [l.strip() for l in lines if l.strip()]


def tour_lines() -> list[str]:
  return _blocks(SECTION)


def first_command() -> list[str]:
  """The README's first command as the shell runs it, `&&` by `&&`."""
  (line,) = _blocks(FIRST)[:1]
  return [part.strip() for part in line.split("&&")]


def is_shell_state(line: str) -> bool:
  """A line whose effect later lines of the same shell keep (the venv's activation)."""
  return shlex.split(line, comments=True)[:1] in (["source"], ["."])


def adapt(tokens: list[str], tmp: str, steps: list[int]) -> list[str]:
  """Small step counts, FAST overrides after each `train`, /tmp/ paths under ``tmp``."""
  out = []
  for t in tokens:
    t = t.replace("/tmp/", tmp + "/")
    m = re.fullmatch(r"--config\.trainer\.total_steps=(\d+)", t)
    if m:
      steps.append(int(m.group(1)))
      t = f"--config.trainer.total_steps={len(steps)}"
    out.append(t)
  if "train" in out:
    out += FAST  # train is the last command of a line (launch's too)
  return out


def fresh_shell(tmp: str) -> dict[str, str]:
  """A user's new shell in ``tmp``: this machine's one CPU device (not the tests' 8), no
  venv on PATH, and ``tmp/.venv`` standing for the venv the README's install made (this
  interpreter's, which has the package)."""
  bin_dir = os.path.dirname(sys.executable)
  os.symlink(sys.prefix, os.path.join(tmp, ".venv"))
  env = suite_flags(os.environ)
  env["JAX_PLATFORMS"] = "cpu"
  env["PATH"] = os.pathsep.join(p for p in env.get("PATH", "").split(os.pathsep)
                                if p and os.path.realpath(p) != os.path.realpath(bin_dir))
  for key in ("DISTFLOW_DEBUG", "VIRTUAL_ENV"):
    env.pop(key, None)
  assert shutil.which("distflow-jax", path=env["PATH"]) is None, \
      "a distflow-jax outside the venv is on PATH: the fresh shell would find it"
  return env


def files(folder) -> list[str]:
  return sorted(os.listdir(folder)) if os.path.isdir(folder) else []


def test_tour_block_is_what_the_test_expects():
  """The commands the checks below are written for, in the README's order; the first
  command installs into .venv and activates it before it runs distflow-jax."""
  first = first_command()
  assert first[0] == "python3 -m venv .venv" and "pip install" in first[2], first
  assert is_shell_state(first[1]) and first[3] == "distflow-jax train", first
  lines = tour_lines()
  assert is_shell_state(lines[0]), lines[0]  # a new shell activates the venv again
  names = [shlex.split(l, comments=True)[:2] for l in lines[1:]]
  assert [n[1] if n[0] == "distflow-jax" else n[0] for n in names] == [
      "plan", "config", "train", "report", "export", "eval", "echo", "generate", "launch"]
  assert all("--config.trainer.total_steps=" in l for l in lines if " train " in l + " ")


@pytest.mark.timeout(600)
def test_readme_tour_runs_as_written(tmp_path):
  tmp, results, steps = str(tmp_path), {}, []
  env = fresh_shell(tmp)

  def run(state: str, cmd: str, line: str) -> subprocess.CompletedProcess:
    r = subprocess.run(["bash", "-c", state + cmd], cwd=tmp, env=env, capture_output=True,
                       text=True, timeout=COMMAND_TIMEOUT_S)
    assert r.returncode == 0, (f"README line failed ({r.returncode}): {line}\n"
                               f"ran: {cmd}\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}")
    return r

  # The first command, in its shell: the venv's creation and pip install are what
  # tmp/.venv stands for; its activation and train run as written.
  first = first_command()
  state = "".join(p + "\n" for p in first if is_shell_state(p))
  steps.append(loading.load("grpo:tiny").trainer.total_steps)  # train's default, implicit
  train = adapt(shlex.split(first[-1]), tmp, []) + [f"--config.trainer.total_steps={len(steps)}"]
  results["first"] = run(state, shlex.join(train), first[-1])
  # The tour, in a new shell.
  state = ""
  for line in tour_lines():
    if is_shell_state(line):  # this shell keeps it for the lines after
      state += line + "\n"
      continue
    tokens = shlex.split(line, comments=True)
    if tokens[0] != "distflow-jax":  # a plain shell line (the prompts file)
      cmd, name = line.replace("/tmp/", tmp + "/"), tokens[0]
    else:
      cmd, name = shlex.join(adapt(tokens, tmp, steps)), tokens[1]
    results[name] = run(state, cmd, line)
  assert steps == sorted(set(steps)), \
      f"each train line must train past the one before it (total_steps {steps})"

  run = tmp_path / "runs" / "grpo_tiny"
  # The tour's train resumed the first command's run and trained past it.
  said = results["train"].stdout + results["train"].stderr
  assert "resumed from" in said and "(step 1)" in said and "nothing to do" not in said, said

  assert "generate" in results["plan"].stdout  # the plan names the DAG's nodes
  # config --keys: every key with its type, default and doc, the first-run keys marked.
  assert "* rollout.n (int) = 4" in results["config"].stdout
  data = run / "data" / "arithmetic_basic_eval.jsonl"
  assert data.is_file() and sum(1 for _ in open(data)) == 8
  # report: the PNGs and report.md the README lists.
  report = files(run / "report")
  for name in ("reward.png", "accuracy.png", "response_length.png", "kl.png", "time.png",
               "report.md"):
    assert name in report, report
  # export: a Hugging Face folder.
  exported = files(tmp_path / "actor_hf")
  assert "config.json" in exported and "tokenizer.json" in exported, exported
  assert any(f.endswith(".safetensors") for f in exported), exported
  # eval: pass@4 on the run's eval file.
  assert "pass@4" in results["eval"].stdout + results["eval"].stderr
  # generate: a completion for the one prompt.
  out = [json.loads(l) for l in open(tmp_path / "out.jsonl")]
  assert len(out) >= 1 and all(o["prompt"] and "completion" in o for o in out)
  # launch: the run continued on 2 processes to the launch line's (shortened) total_steps.
  metrics = [json.loads(l) for l in open(run / "metrics.jsonl")]
  assert metrics[-1]["step"] == len(steps) == 3
  assert "2 process(es)" in results["launch"].stdout + results["launch"].stderr
