"""Every config key: its type, default, one-line doc, whether a first run needs it (core)
and its own check, one field each.  ``defaults.base()`` is ``Config()`` as an
ml_collections config; ``config.declare.view`` gives a loaded config as these classes.

Checks that span keys (a key valid only with another) live in ``config/values.py`` and
``config/checks.py``; the long forms of these docs in ``docs/``.
"""

from __future__ import annotations

import dataclasses
from importlib import metadata

from distflow_jax.config import response
from distflow_jax.config.declare import Section, key, section
from distflow_jax.config.validators import (Dataset, Flag, Float32, Folder, Increasing, InRange,
                                            LearningRate, OffOrAbove, Option, Positive, Whole)

frozen = dataclasses.dataclass(frozen=True)
P, P0 = Positive(), Positive(allow_zero=True)


def compile_cache_dir() -> str:
  """The default ``trainer.compile_cache_dir``: one folder per user and jax version (read
  from the installed package's metadata: importing this module does not import jax)."""
  try:
    version = metadata.version("jax")
  except metadata.PackageNotFoundError:
    version = "unknown"
  return f"~/.cache/distflow-jax/jax-{version}"


@frozen
class Cluster(Section):
  num_processes: int = key(0, "JAX processes (hosts); 0 = the running jax's process count")
  devices_per_process: int = key(
      0, "devices per process; 0 = the running jax's; on a CPU-only machine > 0 simulates "
      "that many devices in one process")


@frozen
class Warmstart(Section):
  steps: int = key(300, "supervised warm-start steps of the built-in model (cached in run_dir)",
                   check=P0)
  lr: float = key(1e-3, "the warm start's learning rate", check=LearningRate())
  batch_size: int = key(64, "the warm start's rows per step", check=P)
  examples: int = key(8000, "the warm start's demonstrations", check=P)
  plain_answer_prob: float = key(
      0.0, "share of demonstrations ending 'The answer is N.' instead of '#### N'",
      check=InRange(0, 1))


@frozen
class Lora(Section):
  enabled: bool = key(False, "train rank-`rank` adapters on the actor, base frozen "
                      "(docs/lora.md)", core=True)
  rank: int = key(8, "the adapters' rank", core=True)
  alpha: float = key(16.0, "the update's scale is alpha / rank")
  dropout: float = key(0.0, "PEFT's lora_dropout on the adapters' input, in the actor's train "
                       "step only; in [0, 1)")
  init: str = key("gaussian", "gaussian (A ~ N(0, 1/rank^2)) | kaiming (PEFT's default); B "
                  "starts at zero")
  path: str = key("", "a PEFT adapter folder to start from; '' = fresh adapters")
  base_check: bool = key(True, "refuse an adapter whose base_model_name_or_path names another "
                         "model than model.path")
  critic: str = key("", "'' refuses LoRA with a critic | full (the critic trains its whole "
                    "weights)")
  targets: tuple = key(("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                        "down_proj"),
                       "fnmatch patterns of the projections that get adapters (HF module name "
                       "or short name)")


@frozen
class Model(Section):
  path: str = key("", "a local Hugging Face folder (config.json + safetensors); '' = the "
                  "built-in model.preset", core=True)
  preset: str = key("tiny", "the built-in architecture when path is '': tiny | micro",
                    core=True)
  dtype: str = key("float32", "the parameters' (and computation's) dtype", core=True,
                   check=Option("dtype"))
  max_seq_len: int = key(256, "the longest row: prompt + response", core=True, check=P)
  warmstart: Warmstart = section(Warmstart, "supervised warm start of the built-in model "
                                 "(when path is '')")
  share_prompt_prefix: bool = key(True, "log-prob passes and the actor step run each group's "
                                  "prompt once for its rollout.n samples")
  train_vision: bool = key(False, "vision-language runs: train the vision tower too (not built "
                           "yet: refused)")
  scan_layers: bool = key(True, "parameters stacked on a layer axis, layers under lax.scan "
                          "(compile time flat in depth)", check=Flag())
  remat: str = key("none", "recompute each layer in the backward pass: none | full | "
                   "dots_saveable", check=Option("remat"))
  attention_impl: str = key("auto", "multi-token attention: auto | xla | cudnn | einsum | "
                            "blockwise", check=Option("attention_impl"))
  attention_block: int = key(512, "blockwise attention's query and key block, in tokens",
                             check=Whole(what=" (tokens: blockwise attention's block)"))
  master_weights: bool = key(True, "with a 16-bit dtype, trained roles keep float32 master "
                             "parameters and moments", check=Flag())
  pack_sequences: bool = key(False, "padding-free passes: real tokens packed into rows with "
                             "segment ids (docs/long_context.md)", check=Flag())
  pack_len: int = key(0, "packed row length; 0 = the padded row's length", check=P0)
  lora: Lora = section(Lora, "LoRA adapters on the actor (models/lora.py)", core=True)


@frozen
class Data(Section):
  train: str = key("builtin:arithmetic", "training prompts: a JSONL/Parquet path or "
                   "builtin:<task>", core=True, check=Dataset())
  eval: str = key("builtin:arithmetic", "held-out prompts ('' = no evaluation)", core=True,
                  check=Dataset())
  prompt_key: str = key("prompt", "the rows' prompt field", core=True)
  answer_key: str = key("answer", "the rows' ground-truth field", core=True)
  chat_template: bool = key(False, "wrap prompts in the tokenizer's chat template", core=True)
  max_prompt_len: int = key(64, "the longest prompt, in tokens (longer rows are bad rows)",
                            core=True, check=P)
  prompts_per_step: int = key(8, "prompts per step, global over all processes", core=True,
                              check=P)
  shuffle_seed: int = key(0, "the loader's shuffle seed")
  on_bad_row: str = key("skip", "what a bad data row does: skip (counted and reported) | "
                        "error", check=Option("on_bad_row"))
  image_key: str = key("", "vision-language rows: the field holding a row's image(s); '' = "
                       "text-only")
  image_root: str = key("", "the folder image paths resolve inside",
                        check=Folder("the data file's folder"))
  max_image_pixels: int = key(40_000_000, "images over this many pixels are bad rows", check=P)
  eval_size: int = key(128, "held-out prompts per evaluation", check=P)
  redistribute: str = key("distributed", "how re-partitions move data: distributed (one "
                          "all-to-all) | centralized (gather to process 0)",
                          check=Option("redistribute"))


@frozen
class Rollout(Section):
  n: int = key(4, "samples per prompt (the group size)", core=True, check=P)
  max_new_tokens: int = key(32, "the longest response (a multi-turn episode's turn)", core=True,
                            check=P)
  temperature: float = key(1.0, "sampling temperature", core=True,
                           check=InRange(0, note=" (0 = greedy)"))
  top_p: float = key(1.0, "nucleus sampling's mass", check=InRange(0, 1, lo_open=True))
  top_k: int = key(0, "sample among the k likeliest tokens; 0 = off", check=P0)
  max_concurrent_decodes: int = key(16, "decode slots of one engine", check=P)
  decode_chunk: int = key(16, "tokens per compiled decode call (the host refills slots between "
                          "calls)", check=P)
  prefill_buckets: tuple = key((32, 64), "prompt widths prefill compiles for",
                               check=Increasing())
  tensor_parallel: int = key(1, "devices per rollout replica, inside one host", check=P)
  backend: str = key("engine", "engine (KV cache, continuous batching) | reference (no cache: "
                     "the tests' oracle) | jetstream", check=Option("backend"))
  lora_sync: str = key("merged", "a LoRA actor into the engine: merged (sync merged weights) | "
                       "adapters (base once, then adapters)", check=Option("lora_sync"))
  fuse_projections: str = key("none", "the engine's fused projections: none | gate_up | all",
                              check=Option("fuse_projections"))
  cpu_compute: str = key("float32", "what a 16-bit model computes in on CPU devices: float32 | "
                         "model", check=Option("cpu_compute"))
  env: str = key("", "multi-turn episodes: a registered environment or module:Class; '' = "
                 "single-turn", core=True)
  max_episode_tokens: int = key(0, "an episode's response (generated + observation tokens) at "
                                "most; 0 = max_new_tokens")
  tool_parser: str = key("tag", "tool calls: tag (<tool>name(args)</tool>) | hermes "
                         "(<tool_call>{json}</tool_call>)")
  max_turns: int = key(4, "turns per episode")
  env_timeout_s: float = key(30.0, "seconds per environment reset / step call")
  on_env_error: str = key("end", "end (the episode, counted in env/errors) | stop (the run)")

  @property
  def response_width(self) -> int:
    """Tokens after the prompt in a training row (config/response.py)."""
    return response.response_width(self)


@frozen
class Optimizer(Section):
  name: str = key("adamw", "the optimizer", check=Option("optimizer"))
  lr: float = key(1e-5, "the peak learning rate", core=True)
  weight_decay: float = key(0.0, "decoupled weight decay", check=InRange(0))
  b1: float = key(0.9, "adam's first-moment decay", check=InRange(0, 1, hi_open=True))
  b2: float = key(0.999, "adam's second-moment decay", check=InRange(0, 1, hi_open=True))
  eps: float = key(1e-8, "adam's epsilon", check=InRange(0, lo_open=True))
  schedule: str = key("constant", "the learning-rate schedule after warm-up",
                      check=Option("schedule"))
  warmup_steps: int = key(0, "linear warm-up steps", check=P0)
  grad_clip: float = key(1.0, "global-norm clip", check=InRange(0, note=" (0 = no clipping)"))


@frozen
class LossArgs(Section):
  sapo_tau_pos: float = key(1.0, "sapo's gate temperature for A > 0")
  sapo_tau_neg: float = key(1.05, "sapo's gate temperature for A <= 0")
  clip_cov_ratio: float = key(2e-4, "clip_cov's share of a micro-batch's tokens detached")
  clip_cov_lb: float = key(1.0, "clip_cov draws from tokens with lb < cov < ub")
  clip_cov_ub: float = key(5.0, "clip_cov draws from tokens with lb < cov < ub")
  kl_cov_ratio: float = key(2e-4, "kl_cov's share of tokens penalized")
  kl_cov_coef: float = key(1.0, "kl_cov's penalty coefficient")


@frozen
class KL(Section):
  coef: float = key(0.0, "the KL-to-reference coefficient; 0 = no KL", core=True,
                    check=InRange(0))
  estimator: str = key("k3", "the per-token KL estimator (k3: low-variance, >= 0)",
                       check=Option("kl_estimator"))
  in_reward: bool = key(False, "subtract the KL from the reward instead of adding a loss term")
  target: float = key(0.0, "adaptive KL's target", check=InRange(0, note=" (0 = a fixed "
                                                                        "coefficient)"))
  horizon: int = key(10000, "adaptive KL's horizon", check=P)
  k3_cap: float = key(10.0, "a token's k3 estimate at most this (verl's 10); 0 = no cap",
                      check=InRange(0))


@frozen
class OffPolicy(Section):
  correction: str = key("none", "the rollout log-probs' correction: none | tis | decoupled | "
                        "seq_tis | token_reject | seq_reject", check=Option("off_policy"))
  tis_cap: float = key(2.0, "C, the importance weight's cap", check=InRange(0, lo_open=True))
  reject_low: float = key(0.5, "token_reject / seq_reject keep ratios in [low, high]")
  reject_high: float = key(2.0, "token_reject / seq_reject keep ratios in [low, high]")


@frozen
class Actor(Section):
  optimizer: Optimizer = section(Optimizer, "the actor's optimizer", core=True)
  micro_batch_size: int = key(8, "rows per micro-batch of the train step", core=True, check=P)
  micro_batch_tokens: int = key(0, "> 0: micro-batches filled by real tokens (needs "
                                "model.pack_sequences); 0 = by micro_batch_size rows",
                                check=Whole(True, " (0 = micro-batches of "
                                                  "micro_batch_size rows)"))
  ppo_epochs: int = key(1, "passes over each step's batch", core=True, check=P)
  mini_batches: int = key(1, "optimizer steps per epoch", core=True, check=P)
  policy_loss: str = key("ppo", "a registered policy loss: ppo | gpg | cispo | gmpo | sapo | "
                         "clip_cov | kl_cov | a plugin's", core=True)
  loss_args: LossArgs = section(LossArgs, "the settings of the losses that have their own")
  clip_ratio_low: float = key(0.2, "PPO clip's lower epsilon", core=True, check=InRange(0))
  clip_ratio_high: float = key(0.2, "PPO clip's upper epsilon (> low = DAPO clip-higher)",
                               core=True, check=InRange(0))
  dual_clip: float = key(0.0, "the dual-clip constant c", check=OffOrAbove(1.0))
  ratio_level: str = key("token", "the importance ratio per token, or per sequence (GSPO)",
                         check=Option("ratio_level"))
  loss_agg: str = key("token-mean", "how token losses average into the step's loss", core=True,
                      check=Option("loss_agg"))
  entropy_coef: float = key(0.0, "the entropy bonus's coefficient", check=InRange())
  kl: KL = section(KL, "the KL to the reference model", core=True)
  recompute_old_logprobs: bool = key(False, "force the old-log-prob pass (skipped with one "
                                     "epoch over one mini-batch)")
  off_policy: OffPolicy = section(OffPolicy, "off-policy correction of the rollout's log-probs")


@frozen
class Critic(Section):
  optimizer: Optimizer = section(Optimizer, "the critic's optimizer")
  micro_batch_size: int = key(8, "rows per micro-batch of the critic's train step", check=P)
  micro_batch_tokens: int = key(0, "as actor.micro_batch_tokens, for the critic's train step",
                                check=Whole(True, " (0 = micro-batches of "
                                                  "micro_batch_size rows)"))
  ppo_epochs: int = key(1, "passes over each step's batch", check=P)
  value_clip: float = key(0.2, "the value loss's clip", check=InRange(0))
  warmup_steps: int = key(0, "steps at the start in which only the critic trains",
                          check=Positive(allow_zero=True,
                                         note=" (0 = the actor trains from the first step)"))


@frozen
class Reference(Section):
  """The reference model has no settings of its own (it is the actor's starting weights)."""


@frozen
class Reward(Section):
  weight: float = key(1.0, "the rule reward's weight in the sum of rewards", check=Float32())
  correct: float = key(1.0, "the reward of a correct answer", check=Float32())
  wrong: float = key(0.0, "the reward of a wrong answer", check=Float32())
  tolerance: float = key(1e-6, "numeric match's tolerance", check=InRange(0))
  match: str = key("numeric", "how reward.math compares answers (numeric: equal values; exact: "
                   "equal strings; math_verify: symbolic, needs math-verify)",
                   core=True, check=Option("match"))
  model_path: str = key("", "reward.model nodes: a local *ForSequenceClassification folder")


@frozen
class Algo(Section):
  gamma: float = key(1.0, "the discount", check=InRange(0, 1))
  lam: float = key(1.0, "GAE's lambda", check=InRange(0, 1))
  norm_by_std: bool = key(True, "divide group advantages by their std (False = Dr.GRPO)",
                          core=True)
  dynamic_sampling_tries: int = key(0, "DAPO dynamic sampling: rounds per step to replace "
                                    "all-equal groups", check=Positive(allow_zero=True,
                                                                       note=" (0 = off)"))
