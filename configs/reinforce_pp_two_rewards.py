"""A workflow written in config alone: REINFORCE++ (group baseline) fed by two
reward nodes, a math verifier and a format reward, fanning into one advantage
node.  No package code was edited to make it.

  distflow-jax plan --config=configs/reinforce_pp_two_rewards.py
"""

from distflow_jax.config import defaults


def get_config(arg: str = "tiny"):
  del arg
  c = defaults.base()
  c.name = "reinforce-pp-two-rewards"
  c.run_dir = "runs/rpp_two_rewards"
  c.dag = [
      dict(id="generate", fn="generate"),
      dict(id="reward_math", fn="reward.math", deps=["generate"]),
      dict(id="reward_format", fn="reward.format", deps=["generate"],
           config=dict(weight=0.2)),
      dict(id="advantage", fn="advantage.reinforce_pp_baseline",
           deps=["reward_math", "reward_format"]),
      dict(id="ref_logprob", fn="ref_logprob", deps=["generate"]),
      dict(id="train_actor", fn="train.actor", deps=["advantage", "ref_logprob"]),
  ]
  c.actor.kl.coef = 0.001
  c.actor.micro_batch_size = 4
  # builtin:arithmetic (medium) worked answers + EOS run to 34 tokens: 40 fits them all.
  c.rollout.max_new_tokens = 40
  return c
