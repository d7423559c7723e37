"""LoRA with everything else: one RL step of every configs/algorithms.py variant with rank-4
adapters, each variant also carrying one of the other train-path features (sequence
packing, token-budget micro-batches, shared prompts packed or not, deterministic mode).

After the step the base weights are bitwise the ones before and every adapter ``B`` moved
(``A`` has no gradient while ``B`` is zero).  The runs share test_algorithm_configs.py's
compile cache fixture and one simulated device."""

import math

import jax
import numpy as np
import pytest
from flax import nnx

from distflow_jax.dag.spec import Role
from distflow_jax.models import lora
from test_algorithm_configs import (  # noqa: F401 (shared_compiles: a fixture)
    VARIANTS, one_step_config, shared_compiles)

# An untrained micro model earns no reward, so advantages may all be zero (and a fresh
# value head gives PPO zero values): the entropy bonus gives every variant a gradient.
LORA = ["model.lora.enabled=True", "model.lora.rank=4", "model.lora.alpha=8.0",
        "actor.optimizer.lr=1e-3", "actor.entropy_coef=0.01"]
PACKED = ["model.pack_sequences=True"]
BUDGET = [*PACKED, "actor.micro_batch_tokens=64", "critic.micro_batch_tokens=64"]
# variant -> what else it runs with (shared prompts are on by default for group variants)
WITH = {
    "ppo": [*BUDGET, "model.lora.critic=full"],
    "grpo": PACKED,                                     # shared prompts, packed
    "drgrpo": [],                                       # shared prompts, padded rows
    "rloo": [*BUDGET, "model.share_prompt_prefix=False"],
    "reinforce_pp_baseline": ["trainer.deterministic=True"],
    "dapo": [],                                         # dynamic sampling
    "gspo": ["trainer.deterministic=True", "model.share_prompt_prefix=False"],
    "gpg": [],                                          # the plain policy gradient
    "cispo": ["model.share_prompt_prefix=False"],       # clipped IS weights
    "gmpo": PACKED,                                     # a sequence's geometric mean
    "sapo": [],                                         # the soft gate
    "clip_cov": ["model.share_prompt_prefix=False"],    # tokens detached by covariance
    "kl_cov": PACKED,                                   # tokens penalized by covariance
    "opo": ["trainer.deterministic=True"],              # length-weighted baseline
    "grpo_passk": [],                                   # the best sample's lead
    "remax": ["trainer.deterministic=True"],            # the greedy baseline's replica
    "otb": PACKED,                                      # sum pi^2 from the packed pass
}


def _host(tree):
  return [np.asarray(x) for x in jax.tree.leaves(tree)]


def test_every_variant_has_a_feature_set():
  assert set(WITH) == set(VARIANTS)


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.usefixtures("shared_compiles")
@pytest.mark.parametrize("variant", VARIANTS)
def test_one_lora_step_of_each_variant(variant, tmp_path):
  from distflow_jax.run import trainer
  cfg = one_step_config(variant, tmp_path, *LORA, *WITH[variant])
  ctx, loaders = trainer.setup(cfg, log=lambda m: None)
  adapters, base = lora.split_trainable(ctx.roles[Role.ACTOR].params)
  before_base, before_adapters = _host(base), _host(adapters)
  assert before_adapters and Role.REFERENCE not in ctx.roles
  (m,) = list(trainer.train(ctx, loaders))
  assert m["step"] == 1 and m["actor/skipped"] == 0.0, m
  for key in ("reward", "actor/loss", "actor/grad_norm"):
    assert math.isfinite(m[key]), (key, m)
  adapters, base = lora.split_trainable(ctx.roles[Role.ACTOR].params)
  for old, new in zip(before_base, _host(base)):
    assert old.dtype == new.dtype and old.tobytes() == new.tobytes()
  names = [lora.path_str(k) for k, _ in nnx.to_flat_state(adapters)]
  moved = {n: not np.array_equal(o, x)
           for n, o, x in zip(names, before_adapters, _host(adapters))}
  assert all(v for n, v in moved.items() if n.endswith("lora_b")), (moved, m)
