"""GRPO on images: the built-in visual task (builtin:shapes) with a Qwen2.5-VL model.

  distflow-jax plan  --config=configs/grpo_vl.py:tiny
  distflow-jax train --config=configs/grpo_vl.py:tiny
  distflow-jax train --config=configs/grpo_vl.py:qwen2.5-vl-3b \\
      --config.model.path=/path/to/Qwen2.5-VL-3B-Instruct
Variants: ``tiny`` (CPU: a tiny random Qwen2.5-VL made on first use and warm-started,
vision tower included, on shapes demonstrations, cached in run_dir/warmstart-vl;
warmstart/vl.py), ``qwen2.5-vl-3b`` (a local Qwen2.5-VL-3B-Instruct folder).
What images support in this version (config/vision_checks.py): the reference rollout
backend, no packing, a critic-free DAG, a frozen tower in RL, one image grid per batch.
"""

from distflow_jax.config import defaults

DAG = [
    dict(id="generate", fn="generate"),
    dict(id="reward", fn="reward.math", deps=["generate"]),
    dict(id="advantage", fn="advantage.grpo", deps=["reward"]),
    dict(id="old_logprob", fn="logprob", deps=["generate"]),
    dict(id="ref_logprob", fn="ref_logprob", deps=["generate"]),
    dict(id="train_actor", fn="train.actor", deps=["advantage", "old_logprob", "ref_logprob"]),
]


def _images(c) -> None:
  """What every variant shares: shapes rows, the reference backend, padded passes."""
  c.dag = DAG
  c.rollout.backend = "reference"
  c.model.pack_sequences = False
  c.data.train = c.data.eval = "builtin:shapes:basic"


def get_config(arg: str = "tiny"):
  c = defaults.base()
  c.name = f"grpo-vl-{arg}"
  _images(c)
  c.actor.kl.coef = 0.001
  if arg == "tiny":
    # ~1.5 M parameters (the tiny text preset + a 2-block, 64-wide tower): 56x56 images of
    # 1-3 red or blue squares, "How many red squares are in the image?" -> "#### N".
    c.run_dir = "runs/grpo_vl_tiny"
    c.model.path = "builtin:tiny-vl"  # made, warm-started and cached on first use
    # As grpo:tiny: the warm-start teacher ends 70% of its answers "The answer is N."
    # (scored 0) rather than "#### N", and RL finds the verifier's convention; 500 steps
    # (past the 200-400 where this model starts to read its image) teach it to count.
    c.model.warmstart.steps = 500
    c.model.warmstart.lr = 1e-3
    c.model.warmstart.batch_size = 32
    c.model.warmstart.examples = 8000
    c.model.warmstart.plain_answer_prob = 0.7
    c.data.chat_template = False
    c.data.max_prompt_len = 48
    c.data.eval_size = 128
    c.rollout.prefill_buckets = (48,)
    # "blue square, blue square, blue square\nThe answer is 3." + EOS is 55 tokens
    c.rollout.max_new_tokens = 56
    c.model.max_seq_len = 104
    c.data.prompts_per_step = 16
    c.rollout.n = 8
    c.actor.optimizer.lr = 1e-4
    # A strong KL-to-reference loss, as grpo:tiny: the answer convention may change, the
    # counting the warm start learned should not drift (at 0.05 held-out accuracy fell
    # from 85% to 64-71% over 40 steps without the plain-answer teacher).
    c.actor.kl.coef = 0.3
    c.actor.micro_batch_size = 16
    c.trainer.total_steps = 40
    c.trainer.eval_every = 10
  elif arg == "qwen2.5-vl-3b":
    c.run_dir = "runs/grpo_vl_qwen2.5-vl-3b"
    c.model.path = ""  # set --config.model.path=/path/to/Qwen2.5-VL-3B-Instruct
    c.model.dtype = "bfloat16"
    c.model.max_seq_len = 1024
    c.data.train = c.data.eval = "builtin:shapes:hard"
    c.data.chat_template = True
    c.data.max_prompt_len = 256
    c.data.prompts_per_step = 64
    c.rollout.n = 8
    c.rollout.max_new_tokens = 512
    c.rollout.prefill_buckets = (128, 256)
    c.actor.optimizer.lr = 1e-6
    c.actor.mini_batches = 4
    c.actor.micro_batch_size = 4
    c.trainer.total_steps = 200
  else:
    raise ValueError(f"unknown variant {arg!r} of grpo_vl.py; valid: tiny, qwen2.5-vl-3b")
  return c
