"""PPO in DistFlow's order:
generate -> reward -> old_logprob -> ref_logprob -> values -> advantage(gae)
         -> train_critic -> train_actor.

  distflow-jax plan  --config=configs/ppo.py:tiny
Variants: ``tiny`` (CPU), ``qwen0.5b`` (local weights and data paths required).
"""

from distflow_jax.config import defaults

DAG = [
    dict(id="generate", fn="generate"),
    dict(id="reward", fn="reward.math", deps=["generate"]),
    dict(id="old_logprob", fn="logprob", deps=["generate"]),
    dict(id="ref_logprob", fn="ref_logprob", deps=["generate"]),
    dict(id="values", fn="values", deps=["generate"]),
    dict(id="advantage", fn="advantage.gae", deps=["reward", "values"]),
    dict(id="train_critic", fn="train.critic", deps=["advantage", "values"]),
    dict(id="train_actor", fn="train.actor", deps=["advantage", "old_logprob", "ref_logprob"]),
]


def get_config(arg: str = "tiny"):
  c = defaults.base()
  c.name = f"ppo-{arg}"
  c.dag = DAG
  c.rollout.n = 1
  c.algo.gamma = 1.0
  c.algo.lam = 0.95
  c.actor.kl.coef = 0.001
  c.actor.kl.in_reward = True
  if arg == "tiny":
    c.run_dir = "runs/ppo_tiny"
    # builtin:arithmetic (medium) worked answers + EOS run to 34 tokens: 40 fits them all.
    c.rollout.max_new_tokens = 40
    c.data.prompts_per_step = 16
    c.actor.optimizer.lr = 1e-4
    c.critic.optimizer.lr = 1e-4
    c.actor.micro_batch_size = 2
    c.critic.micro_batch_size = 2
  elif arg == "qwen0.5b":
    c.run_dir = "runs/ppo_qwen0.5b"
    c.model.dtype = "bfloat16"
    c.model.max_seq_len = 1536
    c.data.train = ""
    c.data.eval = ""
    c.data.chat_template = True
    c.data.max_prompt_len = 512
    c.data.prompts_per_step = 256
    c.rollout.max_new_tokens = 1024
    c.rollout.prefill_buckets = (128, 256, 512)
    c.rollout.max_concurrent_decodes = 128
    c.actor.optimizer.lr = 1e-6
    c.critic.optimizer.lr = 1e-5
    c.actor.mini_batches = 4
    c.trainer.total_steps = 500
  else:
    raise ValueError(f"unknown variant {arg!r} of ppo.py; valid: tiny, qwen0.5b")
  return c
