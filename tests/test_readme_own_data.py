"""docs/own_data.md "Your own task, end to end" runs as written (issue 17): its bash block(s), command
by command, each in a subprocess as a user types it, with small step counts appended
(sft, train and eval only get overrides; everything else runs verbatim), and the files
each step promises are there: the SFT folder, the RL checkpoints, the eval results, and an
exported folder that transformers loads and that answers as our model does."""

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import suite_flags

ROOT = Path(__file__).resolve().parent.parent
SECTION = "## Your own task, end to end"

# Appended to each command of the README (a later --config.x wins): seconds, not minutes.
SMALL = {
    "distflow-jax sft": ["--config.sft.steps=6", "--config.sft.warmup_steps=2",
                         "--config.sft.eval_every=3", "--config.sft.eval_size=16"],
    "distflow-jax train": ["--config.trainer.total_steps=2", "--config.trainer.eval_every=1",
                           "--config.data.eval_size=16", "--config.data.prompts_per_step=8",
                           "--config.actor.micro_batch_size=8"],
    "distflow-jax eval": ["--limit=16"],
}


def section_text() -> str:
  text = (ROOT / "docs" / "own_data.md").read_text()
  start = text.index(SECTION)
  end = text.find("\n## ", start + len(SECTION))
  return text[start:end if end >= 0 else len(text)]


def commands(section: str) -> list[str]:
  """The section's bash blocks as commands: continuation lines joined, heredocs whole."""
  out: list[str] = []
  for block in re.findall(r"```bash\n(.*?)```", section, re.S):
    lines = block.splitlines()
    i = 0
    while i < len(lines):
      line = lines[i]
      i += 1
      if not line.strip() or line.lstrip().startswith("#"):
        continue
      while line.endswith("\\"):
        line = line[:-1].rstrip() + " " + lines[i].strip()
        i += 1
      heredoc = re.search(r"<<\s*'?(\w+)'?", line)
      if heredoc:
        body = []
        while lines[i] != heredoc.group(1):
          body.append(lines[i])
          i += 1
        i += 1
        line = "\n".join([line] + body + [heredoc.group(1)])
      out.append(line)
  return out


def shrink(cmd: str) -> str:
  for prefix, extra in SMALL.items():
    if cmd.startswith(prefix + " "):
      return cmd + " " + " ".join(shlex.quote(e) for e in extra)
  return cmd


def user_env(folder: Path) -> dict:
  """A user's new shell in ``folder``: no venv on PATH (only the README's own
  ``source .venv/bin/activate`` finds distflow-jax and the venv's python3), ``folder/.venv``
  standing for the venv the README's install made (this interpreter's), one CPU device
  (not the 8 simulated devices conftest gives the test process)."""
  bin_dir = os.path.realpath(os.path.dirname(sys.executable))
  os.symlink(sys.prefix, folder / ".venv")
  env = dict(os.environ)
  env["PATH"] = os.pathsep.join(p for p in env.get("PATH", "").split(os.pathsep)
                                if p and os.path.realpath(p) != bin_dir)
  env.pop("VIRTUAL_ENV", None)
  assert shutil.which("distflow-jax", path=env["PATH"]) is None
  return suite_flags(env)


HF_INSTALL = "pip install -q -c constraints.txt -e '.[hf]'"


def is_install(cmd: str) -> bool:
  """The block's install of the hf extra: this suite's venv has it already, and the test's
  folder is not the repository, so it is checked (below), not run."""
  return cmd.split("#")[0].strip() == HF_INSTALL


def test_the_block_installs_the_hf_extra_before_it_imports_transformers():
  import tomllib
  cmds = commands(section_text())
  install = next(i for i, c in enumerate(cmds) if is_install(c))
  uses = next(i for i, c in enumerate(cmds) if "from transformers import" in c)
  assert install < uses
  extra = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
      "optional-dependencies"]["hf"]
  assert any(d.startswith("transformers") for d in extra), extra


def is_shell_state(cmd: str) -> bool:
  """A line whose effect later lines of the same shell keep (the venv's activation)."""
  return shlex.split(cmd, comments=True)[:1] in (["source"], ["."])


def test_the_section_shows_the_whole_path_in_order():
  cmds = commands(section_text())
  assert is_shell_state(cmds[0]), cmds[0]  # a new shell activates the install's venv
  cmds = cmds[1:]
  firsts = [c.split()[:2] for c in cmds]
  order = [firsts.index(["distflow-jax", name]) for name in ("sft", "train", "eval", "export")]
  assert order == sorted(order), firsts
  assert cmds[0].startswith("mkdir -p digits && python3 - <<'EOF'")  # the user's own data
  assert "2026-11-26" in section_text()


@pytest.mark.slow
@pytest.mark.hf
@pytest.mark.timeout(900)
def test_readme_own_task_commands_run_end_to_end(tmp_path):
  pytest.importorskip("transformers")
  env, state = user_env(tmp_path), ""
  for cmd in commands(section_text()):
    if is_shell_state(cmd):  # this shell keeps it for the commands after
      state += cmd + "\n"
      continue
    if is_install(cmd):
      continue
    cmd = shrink(cmd)
    done = subprocess.run(["bash", "-c", "set -eo pipefail\n" + state + cmd], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"{cmd}\nexit {done.returncode}\n{done.stdout[-3000:]}\n" \
                                 f"{done.stderr[-3000:]}"
    if cmd.startswith("distflow-jax eval ") and "--k=8" in cmd:
      assert "eval/pass@8" in done.stdout, done.stdout
  run = tmp_path / "runs" / "digits"
  data = tmp_path / "digits"
  # The user's data: disjoint prompt sets, answers in the verifier's '#### N' form.
  prompts = {n: {json.loads(l)["prompt"] for l in open(data / f"{n}.jsonl")}
             for n in ("sft", "train", "eval")}
  assert [len(prompts[n]) for n in ("eval", "sft", "train")] == [256, 2000, 6744]
  assert not (prompts["eval"] & prompts["sft"]) and not (prompts["eval"] & prompts["train"])
  # sft: the Hugging Face folder train starts from, its metrics with held-out figures.
  for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
    assert (run / "sft" / "model" / name).is_file(), name
  sft_rows = [json.loads(l) for l in open(run / "sft" / "metrics.jsonl")]
  assert [r["step"] for r in sft_rows if "eval/accuracy" in r] == [0, 3, 6]
  # train: the checkpoint of its last step and held-out accuracy at the start and each step.
  assert (run / "checkpoints" / "2").is_dir()
  rl_rows = [json.loads(l) for l in open(run / "metrics.jsonl")]
  assert [r["step"] for r in rl_rows if "eval/accuracy" in r] == [0, 1, 2]
  # eval: greedy and pass@8 results as JSON.
  greedy = json.loads((run / "eval_greedy.json").read_text())
  pass8 = json.loads((run / "eval_pass8.json").read_text())
  assert greedy["k"] == 1 and 0.0 <= greedy["eval/accuracy"] <= 1.0
  assert pass8["k"] == 8 and 0.0 <= pass8["eval/pass@8"] <= 1.0
  # export: transformers loads the folder (the README's own check compared the answers).
  import transformers
  model = transformers.AutoModelForCausalLM.from_pretrained(str(run / "hf"))
  tok = transformers.AutoTokenizer.from_pretrained(str(run / "hf"))
  assert model.config.vocab_size >= len(tok)
  ours = [json.loads(l) for l in open(run / "five.jsonl")]
  assert len(ours) == 5 and all(r["completion"] for r in ours)
