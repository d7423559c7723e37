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
  _, lo = _memory(capsys, "ppo:tiny", "--config.model.lora.enabled=True",
                  "--config.model.lora.critic=full")
  key = ("critic", "parameters + optimizer state")
  assert lo[key] == full[key]


@pytest.mark.timeout(120)
def test_lora_rollout_holds_the_merged_base_only(capsys):
  """The engine's weights and the sync's per-layer copy are the merged base: no adapters."""
  out_full, full = _memory(capsys, "grpo:tiny")
  out_lo, lo = _memory(capsys, "grpo:tiny", "--config.model.lora.enabled=True")
  synced = lambda out: re.search(r"weight sync: the actor's (\S+ [MG]B)", out)[1]  # noqa: E731
  assert synced(out_lo) == synced(out_full)
  for key in (("generate", "rollout weights (synced copy)"),
              ("generate", "weight sync input: per-layer copy (scan_layers)")):
    assert lo[key] == full[key], key


@pytest.mark.timeout(300)
def test_compiled_lora_state_is_sharded_like_the_base(capsys):
  """Compiled on 8 devices (fsdp=8), the adapters' optimizer state is split like their
  kernels (one of a, b per target), below the analytic figure, which counts them whole."""
  _, an = _memory(capsys, "grpo:tiny", "--config.model.lora.enabled=True")
  assert cli.main(["plan", "--config=grpo:tiny", "--memory", *TOPO,
                   "--config.model.lora.enabled=True"]) == 0
  comp = {}
  for line in capsys.readouterr().out.splitlines():
    m = re.match(r"^  (\S+)\s+(.+?)\s+([\d.]+) (MB|GB)\s+on ", line)
    if m:
      comp[(m[1], m[2])] = float(m[3]) * (1e3 if m[4] == "GB" else 1.0)
  # per device: a of q/k/v/gate/up and b of o/down split 8 ways, the other side whole
  per_dev = 3 * 8 * (192 / 8 + 192 + 2 * (192 / 8 + 96) + 192 + 192 / 8
                     + 2 * (192 / 8 + 512) + 512 + 192 / 8)
  assert comp[("actor", "optimizer state")] == pytest.approx(8 * per_dev / 1e6, abs=0.05)
  assert comp[("actor", "optimizer state")] < an[("actor", "optimizer state")]


@pytest.mark.timeout(120)
def test_lora_sync_adapters_plan_keeps_a_base_copy_and_moves_the_adapters(capsys):
  """rollout.lora_sync=adapters: a resident base copy the size of the rollout weights on the
  rollout devices, and the traffic lines name the adapters' bytes a step (from the shapes:
  rank 8 on the 7 projections of 3 layers of d=192) and the base's once."""
  out_m, merged = _memory(capsys, "grpo:tiny", "--config.model.lora.enabled=True")
  out_a, adapters = _memory(capsys, "grpo:tiny", "--config.model.lora.enabled=True",
                            "--config.rollout.lora_sync=adapters")
  key = ("generate", "rollout base copy (rollout.lora_sync=adapters)")
  assert key not in merged
  assert adapters[key] == adapters[("generate", "rollout weights (synced copy)")] > 1.0
  moved = 4 * 3 * 8 * (2 * (192 + 192) + 2 * (192 + 96) + 3 * (192 + 512)) / 1e6
  full = re.search(r"the merged model's ([\d.]+) MB a step", out_m)[1]
  assert f"the adapters' {moved:.1f} MB a step" in out_m
  assert (f"the adapters' {moved:.1f} MB a step, merged on the rollout devices; the base's "
          f"{full} MB once") in out_a
