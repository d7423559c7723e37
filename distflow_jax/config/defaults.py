"""The config schema: every key a user can set, with its default.

Config files under configs/ start from ``base()`` and set what differs.  The
config is locked after loading, so only keys defined here exist.
"""

from __future__ import annotations

from importlib import metadata

import ml_collections


def optimizer(lr: float) -> ml_collections.ConfigDict:
  return ml_collections.ConfigDict(dict(
      name="adamw",          # adamw | adam | sgd
      lr=lr,
      weight_decay=0.0,
      b1=0.9, b2=0.999, eps=1e-8,
      schedule="constant",   # constant | cosine | linear
      warmup_steps=0,
      grad_clip=1.0,         # global-norm clip; 0 disables
  ))


def compile_cache_dir() -> str:
  """The default ``trainer.compile_cache_dir``: one folder per user and jax version (read
  from the installed package's metadata: importing this module does not import jax)."""
  try:
    version = metadata.version("jax")
  except metadata.PackageNotFoundError:
    version = "unknown"
  return f"~/.cache/distflow-jax/jax-{version}"


def mesh(devices: str = "all", **axes: int) -> ml_collections.ConfigDict:
  shape = {"data": 1, "fsdp": -1, "tensor": 1}
  shape.update(axes)
  return ml_collections.ConfigDict(dict(devices=devices, mesh=shape))


def base() -> ml_collections.ConfigDict:
  c = ml_collections.ConfigDict()
  c.name = "run"
  c.seed = 0
  c.run_dir = "runs/default"
  # Modules to import before the DAG is validated; they may register node functions.
  c.plugins = ()
  # 0 = take from the running jax (process count, local device count).  On a CPU-only
  # machine, devices_per_process > 0 simulates that many devices in one process (for
  # trying layouts; it is slower than 1 on a small CPU).
  c.cluster = dict(num_processes=0, devices_per_process=0)

  c.model = dict(
      path="",               # local Hugging Face dir (config.json + safetensors); "" = built-in
      preset="tiny",         # built-in architecture when path is "": tiny | micro
      dtype="float32",
      max_seq_len=256,
      # Supervised warm start of the built-in model (when path is ""), cached in run_dir.
      # plain_answer_prob: the share of demonstrations ending "The answer is N." instead of
      # "#### N" (a teacher mixing conventions; the verifier wants "#### N").
      warmstart=dict(steps=300, lr=1e-3, batch_size=64, examples=8000, plain_answer_prob=0.0),
      # Log-prob passes and the actor step run each group's prompt once for its rollout.n
      # samples (checked on device per batch; rows not so grouped take the plain pass).
      share_prompt_prefix=True,
      # Vision-language runs (a Qwen2.5-VL model.path): train the vision tower too.  Not
      # built yet: the tower is frozen and its features computed once per prompt.
      train_vision=False,
      # Memory and compile levers (models/config.py).  scan_layers: parameters stacked on a
      # layer axis, layers run under lax.scan (compile time flat in depth).  remat: none |
      # full | dots_saveable, each layer recomputed in the backward pass.  attention_impl:
      # auto | xla | cudnn | einsum | blockwise (multi-token attention; auto = cuDNN on GPU
      # in 16 bits, else blockwise from 2048 x 2048 query x key pairs per row, else XLA).
      # blockwise (models/blockwise.py): flash-style blocks of attention_block queries and
      # keys, memory linear in the length (a 16K-token row trains on a CPU).
      # master_weights: with a 16-bit dtype, trained roles keep float32 master parameters
      # and optimizer moments in the optimizer state (train/optim.py).
      scan_layers=True,
      remat="none",
      attention_impl="auto",
      attention_block=512,
      master_weights=True,
      # Padding-free passes (train/packing.py): the log-prob, reference, value passes and
      # the train steps pack each sample's real tokens into rows of pack_len tokens with
      # segment ids instead of running [prompt bucket + max_new_tokens] padded rows
      # (metrics pad_fraction/<node>, and pad_fraction_padded/<node> for the padded
      # layout).  pack_len=0: the padded row's length.  With share_prompt_prefix a group's
      # prompt is laid once per row, its responses after it (train/packing_shared.py).
      pack_sequences=False,
      pack_len=0,
      # LoRA (models/lora_layer.py, lora.py): the actor trains rank-`rank` adapters on the
      # projections whose HF module name (model.layers.3.self_attn.q_proj) or short name
      # (q_proj) matches a `targets` fnmatch pattern, every layer alike; the base stays
      # frozen in model.dtype, the update is scaled by alpha / rank.  init: gaussian (A ~
      # N(0, (1/rank)^2)) | kaiming (PEFT's default); B starts at zero, so step 0 is the
      # base model.  The reference pass runs the actor's base (adapters off: no second
      # copy).  critic: a critic (PPO) has no adapters; "" refuses LoRA with a critic,
      # "full" trains the critic's whole weights from the base (they count in plan
      # --memory as a full fine-tune's do).  dropout: p in [0, 1), PEFT's
      # lora_dropout on the adapters' input, in the actor's train step only (masks from
      # seed, step, micro-batch).  path: a PEFT adapter folder to start from ("" = fresh);
      # base_check: refuse one whose base_model_name_or_path names another model than
      # model.path (the last path part, or the hub repository's name).
      lora=dict(enabled=False, rank=8, alpha=16.0, dropout=0.0, init="gaussian", path="",
                base_check=True, critic="",
                targets=("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                         "down_proj")),
  )
  c.data = dict(
      train="builtin:arithmetic",  # JSONL/Parquet path or builtin:<task>
      eval="builtin:arithmetic",
      prompt_key="prompt",
      answer_key="answer",
      chat_template=False,
      max_prompt_len=64,
      prompts_per_step=8,    # global, over all processes
      shuffle_seed=0,
      on_bad_row="skip",     # skip (counted and reported) | error
      # Vision-language rows (data/image_loading.py): the field holding a row's image(s): a path
      # (relative to the data file's folder), base64 / a data: URI, bytes, or a list of
      # them; "" = text-only.  Images over max_image_pixels (width x height, read from the
      # header) are bad rows, like missing files and non-images (data.on_bad_row).
      image_key="",
      # The folder image paths are read from, and must resolve inside ('..' out of it and
      # absolute paths elsewhere are bad rows); "" = the data file's own folder.
      image_root="",
      max_image_pixels=40_000_000,
      eval_size=128,
      # How re-partitions move data: distributed (one all-to-all) | centralized (the
      # single-controller baseline: gather to process 0, scatter back).
      redistribute="distributed",
  )
  c.rollout = dict(
      n=4,                   # samples per prompt (group size)
      max_new_tokens=32,
      temperature=1.0,
      top_p=1.0,
      top_k=0,               # 0 = off
      max_concurrent_decodes=16,
      # Tokens per compiled decode call: the host reads results, frees finished slots,
      # refills them and decides whether to go on between calls, never inside one
      # (rollout/decode.py).  Larger: fewer host round trips, more idle slot-steps.
      decode_chunk=16,
      prefill_buckets=(32, 64),
      tensor_parallel=1,     # devices per rollout replica, inside one host
      # Which generator serves rollouts (rollout/backend.py): engine (JetStream-API engine,
      # KV cache, continuous batching) | reference (a full forward per token, no cache:
      # slow, the tests' oracle) | jetstream (JetStream's orchestrator over the same
      # engine; needs google-jetstream).  An unknown name is refused, listing the valid ones.
      backend="engine",
      # A LoRA actor's weights into the engine (rollout/lora_sync.py): merged (merge
      # W + a @ b * alpha / r on the training mesh, sync every weight) | adapters (sync the
      # frozen base once into the engine's own copy, then only the adapters; merge on the
      # rollout devices).  Without LoRA both are the plain sync.
      lora_sync="merged",
      # The engine's weights with projections fused (models/fused.py): none | gate_up (one
      # matmul for gate/up; bitwise the unfused numbers on XLA:CPU) | all (q/k/v too; the
      # same tokens, log-probs within 2e-5 on XLA:CPU).  The trained model keeps them apart.
      fuse_projections="none",
      # What the engine computes a bfloat16 / float16 model in on CPU devices
      # (rollout/engine_config.CpuCompute): float32 (float32 copies of the weights and a
      # float32 cache: XLA's CPU backend converts 16-bit weights to float32 at every decode
      # call and the cache at every step otherwise) | model (the model's dtype).  Other
      # devices always compute in the model's.
      cpu_compute="float32",
      # Multi-turn episodes (rollout/episodes.py, envs/): "" = single-turn; else a registered
      # environment or module:Class.  Each turn ends at its first tool call (tool_parser:
      # tag <tool>name(args)</tool> | hermes <tool_call>{json}</tool_call>); each turn is
      # at most max_new_tokens tokens, the episode's response (generated + observation
      # tokens) at most max_episode_tokens (0: max_new_tokens), the training passes'
      # response width (config/response.py).
      env="",
      max_episode_tokens=0,
      tool_parser="tag",
      max_turns=4,
      env_timeout_s=30.0,    # per reset / step call
      on_env_error="end",    # end (the episode, counted in env/errors) | stop (the run)
  )
  c.actor = dict(
      optimizer=optimizer(1e-5),
      micro_batch_size=8,
      # Token-budget micro-batches (train/token_budget.py; needs model.pack_sequences=True):
      # > 0 fills the train step's micro-batches by real tokens instead of micro_batch_size
      # rows: per data shard, samples longest first to the least-loaded micro-batch with
      # room, at most this many tokens each (a longer sample alone in one), each packed into
      # ceil(micro_batch_tokens / pack_len) rows; the micro-batch count is the same on every
      # shard (bucketed).  0 = micro-batches of micro_batch_size rows.
      micro_batch_tokens=0,
      ppo_epochs=1,
      mini_batches=1,
      # The policy loss by name (algos/policy_losses.py; a plugin may register its own):
      # ppo (the clipped surrogate; clip-higher and dual clip below) | gpg (-A log pi) |
      # cispo (the clipped importance weight times -A log pi) | gmpo (the geometric mean of
      # the token ratios, clipped in log space) | sapo (a soft sigmoid gate instead of the
      # clip) | clip_cov / kl_cov (PPO with a few high-covariance tokens detached / the
      # unclipped surrogate with |log ratio| on them)
      policy_loss="ppo",
      # The settings of the losses that have their own (each checked by its loss):
      # sapo's gate temperatures for A > 0 and A <= 0; clip_cov's share of a micro-batch's
      # tokens detached, drawn from those with lb < cov < ub; kl_cov's share penalized and
      # the penalty's coefficient.
      loss_args=dict(sapo_tau_pos=1.0, sapo_tau_neg=1.05, clip_cov_ratio=2e-4,
                     clip_cov_lb=1.0, clip_cov_ub=5.0, kl_cov_ratio=2e-4, kl_cov_coef=1.0),
      clip_ratio_low=0.2,
      clip_ratio_high=0.2,   # > low = DAPO clip-higher
      dual_clip=0.0,         # 0 = off, else the dual-clip constant c > 1
      ratio_level="token",   # token | sequence (GSPO)
      # token-mean | seq-mean-token-sum | seq-mean-token-mean | seq-mean-token-sum-norm
      loss_agg="token-mean",
      entropy_coef=0.0,
      # k3_cap: a token's k3 estimate at most this (verl's 10; 0 = no cap): k3 grows
      # exponentially in the log-ratio, so one degenerate token would swamp a step.
      kl=dict(coef=0.0, estimator="k3", in_reward=False, target=0.0, horizon=10000,
              k3_cap=10.0),
      # With one epoch over one mini-batch the rollout's log-probs serve as the old
      # log-probs and the logprob node skips its forward pass; True forces the pass (so
      # does an off_policy.correction other than none).
      recompute_old_logprobs=False,
      # Off-policy correction of the rollout engine's log-probs (mu) against the trainer's
      # recomputed old ones (algos/off_policy.py): none | tis (loss x min(pi_old/mu, C)) |
      # decoupled (AReaL: loss x pi_old/mu, tokens above C dropped) | seq_tis (loss x
      # min(prod_t pi_old/mu, C), per sequence) | token_reject (tokens with pi_old/mu
      # outside [reject_low, reject_high] dropped) | seq_reject (sequences whose
      # geometric-mean ratio lies outside dropped); C = tis_cap > 0.
      off_policy=dict(correction="none", tis_cap=2.0, reject_low=0.5, reject_high=2.0),
  )
  c.critic = dict(
      optimizer=optimizer(1e-5),
      micro_batch_size=8,
      micro_batch_tokens=0,  # as actor.micro_batch_tokens, for the critic's train step
      ppo_epochs=1,
      value_clip=0.2,
      # Steps at the start in which only the critic trains (the actor's update is skipped):
      # a fresh critic's values are not yet worth subtracting from the returns.
      warmup_steps=0,
  )
  c.reference = dict()
  c.reward = dict(
      weight=1.0,
      correct=1.0,
      wrong=0.0,
      tolerance=1e-6,
      # How reward.math compares the final answer with the ground truth: numeric (equal
      # values: "09" is right for "009") | exact (equal strings) | math_verify (symbolic,
      # LaTeX; needs the math-verify package: pip install 'distflow-jax[math]').
      match="numeric",
      # For 'reward.model' nodes: a local *ForSequenceClassification checkpoint (num_labels=1)
      # sharing the actor's tokenizer; it scores prompt + response at the last real token.
      model_path="",
  )
  c.algo = dict(
      gamma=1.0,
      lam=1.0,
      norm_by_std=True,      # False = Dr.GRPO
      # DAPO dynamic sampling: generate up to this many rounds per step (the first plus
      # tries - 1 refills) to replace prompt groups whose rewards are all equal (0 = off).
      dynamic_sampling_tries=0,
  )
  c.placement = dict(actor=mesh(), reference=mesh(), critic=mesh(), reward=mesh(),
                     # The rollout replicas' devices: "actor" (the actor's), or a device
                     # spec ("0:4") of their own, e.g. apart from training for
                     # trainer.max_staleness > 0.
                     rollout=dict(devices="actor"))
  c.trainer = dict(
      total_steps=20,
      eval_every=5,
      # The rule verifier of the held-out evaluation (eval/accuracy): math | math_lenient
      # (an answer without #### / \\boxed{} is its last number) | any registered reward;
      # when it is not math, eval/accuracy_strict (math's score) is logged beside it.
      eval_reward="math",
      # Held-out samples (prompt, response, reward, ground truth) logged at each evaluation
      # to run_dir/samples.jsonl and TensorBoard text (observe/samples.py); 0 = off.
      log_samples=4,
      save_every=10,         # checkpoint every K steps (and at the end); 0 = only at the end
      keep=3,                # keep the last N checkpoints; 0 = all
      async_save=True,       # write checkpoints in the background
      # Bitwise-equal weights, samples and metrics on any data-parallel layout of the same
      # config (1 x 8, 2 x 2, 4 x 1 devices): every sum over samples runs in one fixed tree
      # over units of <role>.micro_batch_size rows (train/deterministic.py).  Costs memory
      # (parameters whole on each device in a step) and speed; see the README.
      deterministic=False,
      # Asynchronous RL (run/async_rollout.py): batch j is generated by policy version
      # max(0, j - K) on the rollout devices while the trainer trains earlier batches;
      # 0 = the synchronous loop.  K > 0 needs placement.rollout apart from training.
      max_staleness=0,
      # Training health (observe/health.py): warn on the progress line and in the metrics
      # (health/<signal>) when a run looks like it is collapsing; 0 disables a signal.
      health=dict(
          kl_max=1.0,             # KL to the reference, nats per token
          length_fraction=0.25,   # mean response length below this x its first steps' mean
          baseline_steps=3,
          patience=3,             # steps a length / entropy signal must hold
          zero_reward_steps=20,   # mean reward exactly 0 this many steps in a row
          min_entropy=0.02,       # policy entropy (or sampled tokens' NLL), nats per token
          clip_idle_steps=10,     # PPO clip fraction exactly 0 this many steps in a row
          eval_drop=0.05,         # held-out accuracy this far below its best (step 0 too)
      ),
      # Stop on a collapse signal (not on idle clipping) with one line naming it and the
      # last checkpoint saved before it.
      stop_on_collapse=False,
      # JAX's persistent compilation cache (run/compile_cache.py): a second run of the
      # same shapes loads its executables instead of compiling them.  "" = off; the
      # environment variable DISTFLOW_JAX_COMPILE_CACHE, when set, takes its place.
      compile_cache_dir=compile_cache_dir(),
      # When the shapes a run has not met yet compile (state/warm_shapes.py): every
      # prompt width a step can pad to, and the rollout engines' prefill shapes.  auto:
      # with the compile cache on (paid once; later runs load them) | always | never
      # (each when first met: a stall mid-run).
      compile_ahead="auto",
      # Compile the first step's training programs (passes, train steps) in background
      # threads while its rollout runs (run/compile_overlap.py); the same programs, once.
      compile_overlap=True,
  )
  # Where `train` logs besides metrics.jsonl and TensorBoard (always on).  wandb: Weights &
  # Biases (observe/wandb_log.py; needs pip install 'distflow-jax[wandb]'): process 0 logs
  # each step's metrics and each evaluation's samples as a table.  name "" = the config's
  # name; mode "" = wandb's own (WANDB_MODE, else online) | online | offline.
  # heartbeat_s: while a long phase prints nothing (compiling the first step, eval's and
  # generate's first chunk), a line naming it every N seconds (observe/heartbeat.py); 0 = off.
  c.logging = dict(wandb=dict(enabled=False, project="distflow-jax", name="", mode=""),
                   heartbeat_s=15.0)
  # `distflow-jax sft` (run/sft_run.py): supervised fine-tuning on data.train's
  # prompt/answer (or chat `messages`) rows.  Its checkpoints and metrics.jsonl go to
  # <run_dir>/sft; the final Hugging Face folder to `out` ("" = <run_dir>/sft/model).
  c.sft = dict(
      steps=200,
      lr=1e-4,
      batch_size=16,         # global rows per step; a multiple of the actor's data-parallel size
      warmup_steps=20,       # linear warm-up to lr, then cosine decay to 0 at `steps`
      weight_decay=0.0,
      grad_clip=1.0,         # global-norm clip; 0 disables
      eval_every=50,         # held-out loss (and accuracy) every K steps, first and last; 0 = off
      eval_size=64,          # held-out rows: of --eval_data, else split off data.train
      save_every=100,        # checkpoint every K steps (and at the end); 0 = only at the end
      keep=2,                # keep the last N checkpoints; 0 = all
      out="",
  )
  c.entry = ""               # "" = the single generate node
  c.dag = []
  return c
