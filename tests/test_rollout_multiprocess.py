"""Rollout across real processes: 2 hosts x 2 devices, one tensor-parallel replica per host."""

import sys

import pytest

from distflow_jax import launcher
from isa import isa_env, params as isa_params

pytestmark = [pytest.mark.multiprocess, pytest.mark.reduction_order]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("isa", isa_params())
def test_each_host_generates_its_own_prompts_2x2(isa):
  result = launcher.launch(2, 2, [sys.executable, "tests/mp/rollout_hosts.py"], timeout_s=280,
                           env=isa_env(isa), out=None)
  assert result.ok, result.describe() + "\n" + "\n".join(sum(result.outputs, []))
  assert "OK process 0/2 generated 3 prompts" in result.outputs[0]
  assert "OK process 1/2 generated 2 prompts" in result.outputs[1]
