"""GRPO in DistFlow's order: generate(n) -> reward -> advantage -> logprobs -> train.

  distflow-jax plan  --config=configs/grpo.py:tiny
  distflow-jax train --config=configs/grpo.py:tiny --config.actor.optimizer.lr=1e-5
Variants: ``tiny`` (CPU, built-in task and model), ``tiny_lora`` (the same training LoRA
adapters), ``tiny_moe`` (the same on a mixture-of-experts model, Qwen3-MoE), ``qwen0.5b`` (a local
Qwen2.5-0.5B-Instruct and GSM8K JSONL; set --config.model.path and
--config.data.train), ``llama1b`` (the same with a local Llama-3.2-1B-Instruct), ``smollm2``
(the real SmolLM2-135M-Instruct, converted from its package by ``distflow-jax convert``, on
two-step word problems; ``smollm2_lora`` trains LoRA adapters instead), ``calc``
(multi-turn episodes with the built-in calculator tool on ``builtin:calc``) and
``calc_notool`` (the same run without the tool: its baseline).
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


# Where the README's `distflow-jax convert` writes SmolLM2-135M-Instruct.
SMOLLM2_PATH = "models/SmolLM2-135M-Instruct"


def _smollm2(c) -> None:
  """SmolLM2-135M-Instruct (float32) on builtin:arithmetic:words in its chat format: the
  reward and the held-out accuracy read the final number leniently (it answers in prose),
  the strict (####) accuracy is logged beside it (eval/accuracy_strict)."""
  c.run_dir = "runs/grpo_smollm2"
  c.model.path = SMOLLM2_PATH
  c.data.train = c.data.eval = "builtin:arithmetic:words"
  c.data.chat_template = True
  c.data.max_prompt_len = 80  # its chat prompts of these rows are 63-70 tokens
  c.data.eval_size = 200
  c.rollout.prefill_buckets = (80,)
  c.rollout.max_new_tokens = 96
  c.rollout.temperature = 0.6
  c.rollout.max_concurrent_decodes = 64
  c.model.max_seq_len = 176
  c.data.prompts_per_step = 8
  c.rollout.n = 8
  c.dag = [dict(d, fn="reward.math_lenient") if d["fn"] == "reward.math" else dict(d)
           for d in DAG]
  # Each answer weighted alike in the loss (verl's seq-mean-token-mean): with 2-7 right
  # answers in 64, token-mean's push away from the long wrong answers dominated and held-out
  # accuracy fell in every try (docs/real_model.md); with this it rose from 11.5% to 28.0%
  # by step 48 (seed 0, 2026-12-04).
  c.actor.kl.coef = 0.05
  c.actor.optimizer.lr = 1e-5
  c.actor.loss_agg = "seq-mean-token-mean"
  c.actor.micro_batch_size = 16
  c.trainer.eval_reward = "math_lenient"
  c.trainer.total_steps = 48
  c.trainer.eval_every = 8
  c.trainer.save_every = 0


def _real_model_gsm8k(c) -> None:
  """What the real-model variants share: bf16, GSM8K JSONL from local paths, 8 samples."""
  c.model.dtype = "bfloat16"
  c.model.max_seq_len = 1536
  c.data.train = ""  # set --config.data.train=/path/to/gsm8k_train.jsonl
  c.data.eval = ""
  c.data.prompt_key = "question"  # GSM8K rows: {"question": ..., "answer": "... #### 72"}
  c.data.chat_template = True
  c.data.max_prompt_len = 512
  c.data.prompts_per_step = 64
  c.rollout.n = 8
  c.rollout.max_new_tokens = 1024
  c.rollout.prefill_buckets = (128, 256, 512)
  c.actor.optimizer.lr = 1e-6
  c.actor.mini_batches = 4
  c.trainer.total_steps = 500


def get_config(arg: str = "tiny"):
  c = defaults.base()
  c.name = f"grpo-{arg}"
  c.dag = DAG
  c.actor.kl.coef = 0.001
  if arg == "tiny":
    # The default run (`distflow-jax train`): chains of one-digit sums and differences,
    # a 1.2 M-param model warm-started on a teacher that ends 70% of its answers with
    # "The answer is N." rather than the verifier's "#### N", then GRPO.
    c.run_dir = "runs/grpo_tiny"
    c.data.train = c.data.eval = "builtin:arithmetic:basic"
    c.data.max_prompt_len = 32
    c.data.eval_size = 256
    c.rollout.prefill_buckets = (16, 24, 32)
    # Fits every demonstration: "9 + 9 = 18\n18 + 9 = 27\nThe answer is 27." + EOS is 41
    # tokens (tests/test_shipped_demonstrations.py); one that did not fit would be left out.
    c.rollout.max_new_tokens = 48
    c.model.max_seq_len = 80
    c.model.warmstart.steps = 200
    c.model.warmstart.plain_answer_prob = 0.7
    c.data.prompts_per_step = 16
    c.rollout.n = 8
    c.actor.optimizer.lr = 1e-4
    # A strong KL-to-reference loss: the answer convention may change, the arithmetic the
    # warm start learned may not drift (without it held-out accuracy peaks and then falls).
    c.actor.kl.coef = 0.3
    c.actor.micro_batch_size = 16
    c.trainer.total_steps = 50
    c.trainer.eval_every = 10
  elif arg in ("calc", "calc_notool"):
    # builtin:calc (3-digit x 2-digit products) with the calculator tool (rollout.env=calc,
    # episodes of up to 3 turns, the environment's reward), or without it: the same model,
    # warm start, rows and budget, single-turn GRPO on the math verifier (the baseline).
    c.run_dir = f"runs/grpo_{arg}"
    c.data.train = c.data.eval = "builtin:calc:basic"
    c.data.max_prompt_len = 24
    c.data.eval_size = 128
    # "<tool>calc(999 * 99)</tool> = 98901\n#### 98901" + EOS is 47 tokens; the round
    # backends' re-prefill needs a bucket of max_prompt_len + max_new_tokens - 1.
    c.rollout.max_new_tokens = 48
    c.rollout.prefill_buckets = (24, 72)
    c.model.max_seq_len = 72
    # Copying the operands into the call and the result into the answer takes ~400 steps
    # (200 left the copies garbled: no tool call gave a right answer).
    c.model.warmstart.steps = 400
    c.data.prompts_per_step = 16
    c.rollout.n = 8
    c.actor.optimizer.lr = 1e-4
    c.actor.kl.coef = 0.05
    c.actor.micro_batch_size = 16
    c.trainer.total_steps = 40
    c.trainer.eval_every = 2
    c.rollout.max_turns = 3  # call, answer (+ one retry); read only with rollout.env
    if arg == "calc":
      c.rollout.env = "calc"
      c.dag = [dict(d, fn="reward.env") if d["fn"] == "reward.math" else dict(d) for d in DAG]
  elif arg == "qwen0.5b":
    c.run_dir = "runs/grpo_qwen0.5b"
    c.model.path = ""  # set --config.model.path=/path/to/Qwen2.5-0.5B-Instruct
    _real_model_gsm8k(c)
    c.rollout.max_concurrent_decodes = 128
    c.actor.micro_batch_size = 4
  elif arg == "llama1b":
    # Llama 3.2 1B Instruct: 1.24 B parameters (tied embeddings, vocab 128256).
    c.run_dir = "runs/grpo_llama1b"
    c.model.path = ""  # set --config.model.path=/path/to/Llama-3.2-1B-Instruct
    _real_model_gsm8k(c)
    c.rollout.max_concurrent_decodes = 64
    c.actor.micro_batch_size = 2
  elif arg == "smollm2":
    _smollm2(c)
  elif arg == "smollm2_lora":
    _smollm2(c)
    c.run_dir = "runs/grpo_smollm2_lora"
    c.model.lora.enabled = True
    c.model.lora.rank = 16
    c.model.lora.alpha = 32.0
    c.actor.optimizer.lr = 2e-4
  elif arg == "tiny_env":
    # The default run with the environment's reward in place of the math verifier's, for
    # multi-turn episodes: --config=grpo:tiny_env --config.rollout.env=NAME (your
    # environment, from config.plugins or as module:Class).
    c = get_config("tiny")
    c.name = "grpo-tiny_env"
    c.run_dir = "runs/grpo_tiny_env"
    c.dag = [dict(d, fn="reward.env") if d["fn"] == "reward.math" else dict(d) for d in DAG]
  elif arg == "tiny_moe":
    # The default run on the tiny model's shape with experts (Qwen3-MoE, models/moe.py):
    # 8 experts of width 128 in every layer, each token routed to 2.
    c = get_config("tiny")
    c.name = "grpo-tiny_moe"
    c.run_dir = "runs/grpo_tiny_moe"
    c.model.preset = "tiny_moe"
  elif arg == "tiny_lora":
    # The default run training rank-8 LoRA adapters on every projection instead of the
    # whole model (models/lora.py); the reference is the base, adapters off.  The adapters
    # start at zero effect, so they take a larger learning rate than a full fine-tune.
    c = get_config("tiny")
    c.name = "grpo-tiny_lora"
    c.run_dir = "runs/grpo_tiny_lora"
    c.model.lora.enabled = True
    c.model.lora.rank = 8
    c.model.lora.alpha = 16.0
    c.actor.optimizer.lr = 1e-3
  else:
    raise ValueError(f"unknown variant {arg!r} of grpo.py; valid: tiny, tiny_lora, tiny_moe, "
                     f"tiny_env, qwen0.5b, llama1b, smollm2, smollm2_lora, calc, calc_notool")
  return c
