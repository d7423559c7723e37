"""configs/algorithms.py: every algorithm variant plans, carries the settings its
estimator needs, and runs one small RL step (smoke overrides, one simulated device)."""

import math

import pytest

from distflow_jax.config import loading
from distflow_jax.config.checks import plan_from_config
from distflow_jax.dag import FUNCTIONS, Topology
from workflow_util import smoke_overrides

VARIANTS = ("ppo", "grpo", "drgrpo", "rloo", "reinforce_pp_baseline", "dapo", "gspo", "gpg",
            "cispo", "gmpo", "sapo", "clip_cov", "kl_cov", "opo", "grpo_passk", "remax",
            "otb")


def _load(variant, *overrides):
  return loading.load(f"algorithms:{variant}", list(overrides))


def test_the_variants_are_the_shipped_list():
  import importlib.util
  import os
  path = os.path.join(loading.configs_dir(), "algorithms.py")
  spec = importlib.util.spec_from_file_location("algorithms_config", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  assert module.VARIANTS == VARIANTS
  with pytest.raises(loading.ConfigError, match="valid: ppo, grpo"):
    _load("sac")


@pytest.mark.parametrize("variant", VARIANTS)
def test_every_variant_plans_at_the_same_sample_budget(variant):
  cfg = _load(variant)
  plan = plan_from_config(cfg, Topology(1, 1), FUNCTIONS)
  assert plan.steps
  assert cfg.data.prompts_per_step * cfg.rollout.n == 128
  assert cfg.trainer.total_steps == 50 and cfg.data.train == "builtin:arithmetic:basic"
  assert cfg.run_dir == f"runs/algo_{variant}"
  # The variants that rely on clipping train on more than one mini-batch, or the ratio is
  # exactly 1 and the clip never acts.
  if variant in ("ppo", "dapo", "gspo"):
    assert cfg.actor.mini_batches > 1


def test_settings_suit_each_estimator():
  c = {v: _load(v) for v in VARIANTS}
  fns = {v: next(d["fn"] for d in c[v].dag if d["fn"].startswith("advantage.")) for v in c}
  assert fns == {"ppo": "advantage.gae", "grpo": "advantage.grpo", "drgrpo": "advantage.grpo",
                 "rloo": "advantage.rloo", "reinforce_pp_baseline":
                 "advantage.reinforce_pp_baseline", "dapo": "advantage.grpo",
                 "gspo": "advantage.grpo", "gpg": "advantage.grpo",
                 "cispo": "advantage.grpo", "gmpo": "advantage.grpo",
                 "sapo": "advantage.grpo", "clip_cov": "advantage.grpo",
                 "kl_cov": "advantage.grpo", "opo": "advantage.opo",
                 "grpo_passk": "advantage.grpo_passk", "remax": "advantage.remax",
                 "otb": "advantage.otb"}
  assert {v: c[v].actor.policy_loss for v in c if c[v].actor.policy_loss != "ppo"} == {
      "gpg": "gpg", "cispo": "cispo", "gmpo": "gmpo", "sapo": "sapo", "clip_cov": "clip_cov",
      "kl_cov": "kl_cov"}
  # The losses whose ratio must leave 1 to act train on two mini-batches.
  assert all(c[v].actor.mini_batches == 2 for v in ("gmpo", "sapo", "clip_cov", "kl_cov"))
  assert c["opo"].actor.kl.coef == c["drgrpo"].actor.kl.coef  # reward-scale advantages
  gm = c["gmpo"]
  assert (gm.actor.clip_ratio_low, gm.actor.clip_ratio_high) == (0.4, 0.4)
  assert gm.actor.loss_agg == "seq-mean-token-mean" == c["sapo"].actor.loss_agg
  # Reward-scale advantages (no std division, no whitening) get a smaller KL coefficient.
  assert not c["drgrpo"].algo.norm_by_std
  assert c["drgrpo"].actor.kl.coef < c["rloo"].actor.kl.coef < c["grpo"].actor.kl.coef
  assert c["reinforce_pp_baseline"].actor.kl.coef == c["grpo"].actor.kl.coef  # whitened
  d = c["dapo"]
  assert (d.actor.clip_ratio_low, d.actor.clip_ratio_high) == (0.2, 0.28)
  assert d.algo.dynamic_sampling_tries == 2 and d.actor.loss_agg == "token-mean"
  g = c["gspo"]
  assert g.actor.ratio_level == "sequence" and g.actor.loss_agg == "seq-mean-token-mean"
  assert (g.actor.clip_ratio_low, g.actor.clip_ratio_high) == (3e-4, 4e-4)
  p = c["ppo"]
  assert p.rollout.n == 1 and p.data.prompts_per_step == 128
  assert 0 < p.critic.warmup_steps < p.trainer.total_steps
  assert p.trainer.health.kl_max > 0 and p.actor.kl.in_reward


@pytest.fixture(scope="module")
def shared_compiles(tmp_path_factory):
  """A persistent compilation cache for this module's runs: the variants share most of
  their programs (generation, log-probs), so each compiles only what it changes.  Under
  the suite's own cache (tests/conftest.py, inherited through JAX_COMPILATION_CACHE_DIR)
  that one serves, shared with every other test."""
  import os

  import jax
  if os.environ.get("JAX_COMPILATION_CACHE_DIR"):
    yield
    return
  keys = ("jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs",
          "jax_persistent_cache_min_entry_size_bytes")
  old = {k: getattr(jax.config, k) for k in keys}
  jax.config.update("jax_compilation_cache_dir", str(tmp_path_factory.mktemp("xla_cache")))
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
  jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
  yield
  for k, v in old.items():
    jax.config.update(k, v)
  from jax._src import compilation_cache  # the cache object outlives the setting
  compilation_cache.reset_cache()


def one_step_config(variant: str, tmp_path, *extra: str):
  """One step of ``algorithms:<variant>`` at smoke size, plus ``extra`` overrides.  Every
  role on the first of the 8 simulated devices (tests/conftest.py): one device compiles
  and runs fastest on a small CPU.  8 samples: two mini-batches of 4."""
  size = ["data.prompts_per_step=8"] if variant == "ppo" else ["data.prompts_per_step=4",
                                                               "rollout.n=2"]
  return loading.load(f"algorithms:{variant}", smoke_overrides(
      tmp_path, "trainer.total_steps=1", "actor.micro_batch_size=4",
      "critic.micro_batch_size=4", "critic.warmup_steps=0", *size, *extra,
      *[f"placement.{role}.devices=0:1" for role in ("actor", "reference", "critic",
                                                      "reward")]))


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.usefixtures("shared_compiles")
@pytest.mark.parametrize("variant", VARIANTS)
def test_one_step_of_each_variant(variant, tmp_path):
  from distflow_jax.run import trainer
  cfg = one_step_config(variant, tmp_path)
  ctx, loaders = trainer.setup(cfg, log=lambda m: None)
  (m,) = list(trainer.train(ctx, loaders))
  assert m["step"] == 1 and m["actor/skipped"] == 0.0
  for key in ("reward", "actor/loss", "actor/grad_norm"):
    assert math.isfinite(m[key]), (key, m)
  if variant in ("gpg", "sapo", "kl_cov"):  # no clip: no clip fraction to report
    assert "actor/pg_clipfrac" not in m
  else:
    assert math.isfinite(m["actor/pg_clipfrac"]), m
  if variant == "ppo":
    assert math.isfinite(m["critic/loss"])
