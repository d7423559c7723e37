"""LoRA (model.lora) through a real RL step: one GRPO and one PPO step of rank-8 adapters.

After the step the base weights are bitwise the ones before, the adapters moved, the
optimizer state covers the adapters only, and the run has no reference weights (the
reference pass runs the actor's base with the adapters off)."""

import math

import jax
import numpy as np
import pytest
from flax import nnx

from distflow_jax.config import loading
from distflow_jax.dag.spec import Role
from distflow_jax.models import lora
from workflow_util import smoke_overrides

ONE_DEVICE = [f"placement.{r}.devices=0:1" for r in ("actor", "reference", "critic", "reward")]
LORA = ["model.lora.enabled=True", "model.lora.rank=8", "model.lora.alpha=16.0"]


def _host(tree):
  return [np.asarray(x) for x in jax.tree.leaves(tree)]


def _one_step(config, tmp_path, *extra):
  from distflow_jax.run import trainer
  cfg = loading.load(config, smoke_overrides(
      tmp_path, "trainer.total_steps=1", "actor.micro_batch_size=4", "critic.micro_batch_size=4",
      "critic.warmup_steps=0", "data.prompts_per_step=4", "rollout.n=2",
      "actor.kl.coef=0.1", *ONE_DEVICE, *LORA, *extra))
  ctx, loaders = trainer.setup(cfg, log=lambda m: None)
  actor = ctx.roles[Role.ACTOR]
  adapters, base = lora.split_trainable(actor.params)
  before_base, before_adapters = _host(base), _host(adapters)
  assert len(before_adapters) > 0 and Role.REFERENCE not in ctx.roles
  (m,) = list(trainer.train(ctx, loaders))
  assert m["step"] == 1 and m["actor/skipped"] == 0.0
  assert math.isfinite(m["actor/loss"]), m
  adapters, base = lora.split_trainable(ctx.roles[Role.ACTOR].params)
  for old, new in zip(before_base, _host(base)):
    assert old.dtype == new.dtype and old.tobytes() == new.tobytes()
  # Every B moved (A's gradient is zero while B is: A moves from the second step on).
  names = [lora.path_str(k) for k, _ in nnx.to_flat_state(adapters)]
  moved = {n: not np.array_equal(o, x) for n, o, x in zip(names, before_adapters,
                                                         _host(adapters))}
  assert all(v for n, v in moved.items() if n.endswith("lora_b")), moved
  # The optimizer state: per-leaf moments over the adapters only (plus scalar counts).
  shapes = {tuple(x.shape) for x in jax.tree.leaves(adapters)}
  opt = [x for x in jax.tree.leaves(ctx.roles[Role.ACTOR].opt_state) if x.ndim > 0]
  assert opt and all(tuple(x.shape) in shapes for x in opt)
  assert sum(x.size for x in opt) == 2 * sum(x.size for x in jax.tree.leaves(adapters))
  return ctx, m


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_one_grpo_step_trains_only_the_adapters(tmp_path):
  ctx, m = _one_step("grpo:tiny", tmp_path)
  # the reference's KL is exactly 0 at step 1 only if the adapters were zero: B starts at 0
  assert m["actor/kl"] == pytest.approx(0.0, abs=1e-6)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_one_ppo_step_trains_the_adapters_and_the_whole_critic(tmp_path):
  ctx, m = _one_step("ppo:tiny", tmp_path, "model.lora.critic=full")
  assert math.isfinite(m["critic/loss"])
  critic = ctx.roles[Role.CRITIC]
  assert not lora.has_adapters(critic.params)  # fully trained, from the actor's base
