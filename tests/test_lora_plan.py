"""`plan` and `plan --memory` of a LoRA run: no reference parameters, adapter-sized
optimizer state and gradients, a fully sized critic."""

import re

import pytest

from distflow_jax import cli

TOPO = ["--num_processes=1", "--devices_per_process=8"]


def _memory(capsys, config, *extra):
  assert cli.main(["plan", f"--config={config}", "--memory", "--memory_source=analytic",
                   *TOPO, *extra]) == 0
  out = capsys.readouterr().out
  rows = {}
  for line in out.splitlines():
    m = re.match(r"^  (\S+)\s+(.+?)\s+([\d.]+) (MB|GB)\s+on ", line)
    if m:
      rows[(m[1], m[2])] = float(m[3]) * (1e3 if m[4] == "GB" else 1.0)
  return out, rows


@pytest.mark.timeout(120)
def test_lora_plan_has_no_reference_parameters(capsys):
  _, full = _memory(capsys, "grpo:tiny")
  out, lo = _memory(capsys, "grpo:tiny", "--config.model.lora.enabled=True")
  assert "reference parameters: none" in out
  assert full[("reference", "parameters")] > 0.1
  assert lo[("reference", "parameters (LoRA: actor base)")] == 0.0
  # Adam's two float32 moments and a float32 gradient accumulator + micro-batch gradient
  # of the adapters only (replicated): rank 8 on the 7 projections of 3 layers of d=192.
  adapters = 3 * 8 * (2 * (192 + 192) + 2 * (192 + 96) + 3 * (192 + 512))
  assert lo[("actor", "optimizer state")] == round(8 * adapters / 1e6, 1)
  assert lo[("train_actor", "gradients (accumulator + micro-batch)")] == round(
      8 * adapters / 1e6, 1)
  assert lo[("actor", "parameters")] == pytest.approx(full[("actor", "parameters")]
                                                      + 4 * adapters / 1e6, abs=0.1)


@pytest.mark.timeout(120)
def test_lora_ppo_plan_keeps_a_full_critic(capsys):
  _, full = _memory(capsys, "ppo:tiny")
  _, lo = _memory(capsys, "ppo:tiny", "--config.model.lora.enabled=True")
  key = ("critic", "parameters + optimizer state")
  assert lo[key] == full[key]
