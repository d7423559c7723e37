"""Workflow rules the README promises: one producer per field, one trainer per role, a
critic that is read is also trained, and a KL coefficient has reference log-probs."""

import pytest

from distflow_jax.config import loading
from distflow_jax.config.checks import plan_from_config
from distflow_jax.dag import FUNCTIONS, DagError, Topology, build_dag

TOPO = Topology(1, 8)


def plan_cfg(cfg):
  return plan_from_config(cfg, TOPO, FUNCTIONS)


def load(name, *overrides):
  return loading.load(name, list(overrides))


def test_two_producers_of_one_field_in_separate_branches():
  # Neither trainer sees both log-prob nodes, but the batch would carry both: the later
  # 'old_logprobs' would silently replace the earlier.
  nodes = [
      dict(id="gen", fn="generate"),
      dict(id="rw", fn="reward.math", deps=["gen"]),
      dict(id="v", fn="values", deps=["gen"]),
      dict(id="gae", fn="advantage.gae", deps=["rw", "v"]),
      dict(id="lp", fn="logprob", deps=["gen"]),
      dict(id="lp2", fn="logprob", deps=["gen"]),
      dict(id="train", fn="train.actor", deps=["gae", "lp"]),
      dict(id="tc", fn="train.critic", deps=["gae", "v", "lp2"]),
  ]
  with pytest.raises(DagError, match=r"\['lp', 'lp2'\].*'old_logprobs'") as e:
    build_dag(nodes, FUNCTIONS)
  assert "\n" not in str(e.value)


def test_two_advantage_producers_in_separate_branches():
  nodes = [
      dict(id="gen", fn="generate"),
      dict(id="rw", fn="reward.math", deps=["gen"]),
      dict(id="adv", fn="advantage.grpo", deps=["rw"]),
      dict(id="train", fn="train.actor", deps=["adv"]),
      dict(id="v", fn="values", deps=["gen"]),
      dict(id="gae", fn="advantage.gae", deps=["rw", "v"]),
      dict(id="tc", fn="train.critic", deps=["gae", "v"]),
  ]
  with pytest.raises(DagError, match=r"\['adv', 'gae'\].*'advantages'"):
    build_dag(nodes, FUNCTIONS)


def test_summed_rewards_may_have_several_producers():
  build_dag([
      dict(id="gen", fn="generate"),
      dict(id="r1", fn="reward.math", deps=["gen"]),
      dict(id="r2", fn="reward.format", deps=["gen"]),
      dict(id="adv", fn="advantage.grpo", deps=["r1", "r2"]),
      dict(id="train", fn="train.actor", deps=["adv"]),
  ], FUNCTIONS)


def test_two_trainers_of_one_role():
  nodes = [
      dict(id="gen", fn="generate"),
      dict(id="rw", fn="reward.math", deps=["gen"]),
      dict(id="adv", fn="advantage.grpo", deps=["rw"]),
      dict(id="train", fn="train.actor", deps=["adv"]),
      dict(id="train2", fn="train.actor", deps=["adv"]),
  ]
  with pytest.raises(DagError, match=r"\['train', 'train2'\].*ACTOR") as e:
    build_dag(nodes, FUNCTIONS)
  assert "\n" not in str(e.value)


def test_critic_read_but_never_trained():
  nodes = [
      dict(id="gen", fn="generate"),
      dict(id="rw", fn="reward.math", deps=["gen"]),
      dict(id="values", fn="values", deps=["gen"]),
      dict(id="adv", fn="advantage.gae", deps=["rw", "values"]),
      dict(id="train", fn="train.actor", deps=["adv"]),
  ]
  with pytest.raises(DagError, match=r"'values'.*CRITIC.*train\.critic") as e:
    build_dag(nodes, FUNCTIONS)
  assert "\n" not in str(e.value)


def test_config_dag_rules_are_refused_by_plan():
  cfg = load("ppo:tiny")
  with cfg.unlocked():
    cfg.dag = [d for d in cfg.dag if d["id"] != "train_critic"]
  with pytest.raises(DagError, match=r"'values'.*never|'values'.*no node trains"):
    plan_cfg(cfg)


def _without_ref(cfg):
  with cfg.unlocked():
    cfg.dag = [dict(d, deps=[x for x in d.get("deps", []) if x != "ref_logprob"])
               for d in cfg.dag if d["id"] != "ref_logprob"]
  return cfg


def test_kl_loss_without_reference_is_refused_by_plan():
  cfg = _without_ref(load("grpo:tiny", "actor.kl.coef=0.1", "actor.kl.in_reward=False"))
  with pytest.raises(DagError, match=r"'train_actor'.*actor\.kl\.coef.*ref_logprob") as e:
    plan_cfg(cfg)
  assert "\n" not in str(e.value)
  plan_cfg(_without_ref(load("grpo:tiny", "actor.kl.coef=0.0")))  # no KL: fine


def test_kl_loss_coef_set_by_node_override():
  cfg = _without_ref(load("grpo:tiny", "actor.kl.coef=0.0", "actor.kl.in_reward=False"))
  with cfg.unlocked():
    cfg.dag[-1] = dict(cfg.dag[-1], config=dict(kl=dict(coef=0.2)))
  with pytest.raises(DagError, match=r"'train_actor'.*kl\.coef.*ref_logprob"):
    plan_cfg(cfg)


def test_kl_in_reward_without_reference_is_refused_by_plan():
  cfg = _without_ref(load("ppo:tiny"))
  assert cfg.actor.kl.in_reward and cfg.actor.kl.coef > 0
  with pytest.raises(DagError, match=r"'advantage'.*in_reward.*ref_logprob") as e:
    plan_cfg(cfg)
  assert "\n" not in str(e.value)
  with cfg.unlocked():
    cfg.actor.kl.coef = 0.0
  plan_cfg(cfg)


def test_kl_in_reward_is_not_read_by_group_advantages():
  # GRPO's advantage ignores the KL-in-reward term and the loss has no KL: no reference
  # is needed (the shipped GRPO config keeps one).
  plan_cfg(_without_ref(load("grpo:tiny", "actor.kl.coef=0.1", "actor.kl.in_reward=True")))


@pytest.mark.parametrize("name", ["grpo:tiny", "ppo:tiny", "reinforce_pp_two_rewards"])
def test_shipped_workflows_pass_the_rules(name):
  plan_cfg(load(name))
