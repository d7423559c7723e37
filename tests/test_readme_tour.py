"""README's "A five-minute tour", run as written: its bash block is read from README.md, each
line runs in a subprocess in a fresh folder, and what each command promises is checked.

Only what keeps it fast is added: ``--config.trainer.total_steps=N`` becomes 2, 3, ... in
order, every ``train`` gets a smaller model and batch (``FAST``), and paths under /tmp/ go
under the test's own folder.  A README change that no longer runs fails here.
"""

import json
import os
import re
import shlex
import shutil
import subprocess
import sys

import pytest

pytestmark = pytest.mark.multiprocess  # its `launch` line starts 2 jax.distributed processes

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SECTION = "## A five-minute tour"
# Appended to each `train` (the same on both, so the launched one may resume the first).
FAST = ["--config.model.preset=micro", "--config.model.warmstart.steps=0",
        "--config.data.eval_size=8", "--config.data.prompts_per_step=8", "--config.rollout.n=2",
        "--config.rollout.max_new_tokens=8", "--config.actor.micro_batch_size=4"]
COMMAND_TIMEOUT_S = 200


def tour_lines(readme: str = os.path.join(REPO, "README.md")) -> list[str]:
  """The tour's bash block, a command a line (backslash continuations joined)."""
  text = open(readme).read()
  assert SECTION in text, f"README.md has no {SECTION!r} section"
  section = text.split(SECTION, 1)[1].split("\n## ", 1)[0]
  block = re.search(r"```bash\n(.*?)```", section, re.S)
  assert block, f"README.md's {SECTION!r} has no bash block"
  lines = block.group(1).replace("\\\n", " ").splitlines()
  return [l.strip() for l in lines if l.strip()]


def adapt(tokens: list[str], tmp: str, steps: list[int]) -> list[str]:
  """Small step counts, FAST overrides after each `train`, /tmp/ paths under ``tmp``."""
  out = []
  for t in tokens:
    t = t.replace("/tmp/", tmp + "/")
    m = re.fullmatch(r"--config\.trainer\.total_steps=(\d+)", t)
    if m:
      steps.append(int(m.group(1)))
      t = f"--config.trainer.total_steps={len(steps) + 1}"
    out.append(t)
  if "train" in out:
    out += FAST  # train is the last command of a line (launch's too)
  return out


def child_env(bin_dir: str) -> dict[str, str]:
  """A user's shell: this machine's one CPU device (not the tests' 8), the venv's bin first."""
  env = dict(os.environ)
  flags = [f for f in env.get("XLA_FLAGS", "").split()
           if not f.startswith("--xla_force_host_platform_device_count")]
  env["XLA_FLAGS"] = " ".join(flags)
  env["JAX_PLATFORMS"] = "cpu"
  env["PATH"] = bin_dir + os.pathsep + env.get("PATH", "")
  env.pop("DISTFLOW_DEBUG", None)
  return env


def files(folder) -> list[str]:
  return sorted(os.listdir(folder)) if os.path.isdir(folder) else []


def test_tour_block_is_what_the_test_expects():
  """The commands the checks below are written for, in the README's order."""
  lines = tour_lines()
  names = [shlex.split(l, comments=True)[:2] for l in lines]
  assert [n[1] if n[0] == "distflow-jax" else n[0] for n in names] == [
      "plan", "train", "report", "export", "eval", "echo", "generate", "launch"]
  assert all("--config.trainer.total_steps=" in l for l in lines if " train " in l + " ")


@pytest.mark.timeout(600)
def test_readme_tour_runs_as_written(tmp_path):
  bin_dir = os.path.dirname(sys.executable)
  if shutil.which("distflow-jax", path=bin_dir) is None:
    pytest.skip(f"no distflow-jax script beside {sys.executable} (pip install -e . installs it)")
  env = child_env(bin_dir)
  tmp, steps, results = str(tmp_path), [], {}
  for line in tour_lines():
    tokens = shlex.split(line, comments=True)
    if tokens[0] != "distflow-jax":  # a plain shell line (the prompts file)
      argv, name = ["bash", "-c", line.replace("/tmp/", tmp + "/")], tokens[0]
    else:
      argv, name = adapt(tokens, tmp, steps), tokens[1]
    r = subprocess.run(argv, cwd=tmp, env=env, capture_output=True, text=True,
                       timeout=COMMAND_TIMEOUT_S)
    assert r.returncode == 0, (f"README tour line failed ({r.returncode}): {line}\n"
                               f"ran: {shlex.join(argv)}\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}")
    results[name] = r
  run = tmp_path / "runs" / "grpo_tiny"
  assert steps == sorted(steps), f"the tour's total_steps should grow: {steps}"

  assert "generate" in results["plan"].stdout  # the plan names the DAG's nodes
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
  assert metrics[-1]["step"] == len(steps) + 1 == 3
  assert "2 process(es)" in results["launch"].stdout + results["launch"].stderr
