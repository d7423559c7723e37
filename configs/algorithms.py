"""Shipped settings per RL algorithm, on the default run's built-in task and model.

  distflow-jax train --config=configs/algorithms.py:rloo
  python tools/compare_algorithms.py --steps 50      # every variant, same sample budget

Variants: ``ppo``, ``grpo``, ``drgrpo``, ``rloo``, ``reinforce_pp_baseline``, ``dapo``,
``gspo``, ``gpg``, ``cispo``, ``gmpo``, ``sapo``, ``clip_cov``, ``kl_cov``, ``opo``,
``grpo_passk``, ``remax``, ``otb``.  Each starts from the default run (``grpo.py:tiny``: the 1.2 M-param model
warm-started on ``builtin:arithmetic:basic``, 50 steps, held-out accuracy every 10) and
changes only what its algorithm needs; every one trains on 128 samples a step (16 prompts
x 8 samples, or 128 prompts x 1 for PPO), so their curves compare at equal sample budget.
Another built-in task is an override away: ``--config.data.train=builtin:letters:basic
--config.data.eval=builtin:letters:basic``.

Why the KL coefficients differ: the KL-to-reference loss competes with the policy
gradient, whose size is the advantages' size.  GRPO divides by the group's std, so its
advantages are about 1; estimators that do not (Dr.GRPO, RLOO) keep the reward's scale,
the std of a 0/1 reward at success rate p, sqrt(p(1-p)) <= 0.5 (~0.4 here), and GRPO's
0.3 swamps them (an outside check measured Dr.GRPO flat at 23% held-out accuracy with 0.3
and rising to 39% with 0.067; RLOO flat with 0.3, 34% with 0.12).  REINFORCE++ with a
baseline whitens over the batch (algos/estimators.py), so its advantages are about 1 too.

Clipping (clip_ratio_*) acts only when the ratio pi/pi_old differs from 1: with one epoch
over one mini-batch the rollout's policy is the trained one and the ratio is exactly 1, so
the variants that rely on clipping (PPO, DAPO, GSPO) take actor.mini_batches = 2.
"""

import importlib.util
import os

VARIANTS = ("ppo", "grpo", "drgrpo", "rloo", "reinforce_pp_baseline", "dapo", "gspo", "gpg",
            "cispo", "gmpo", "sapo", "clip_cov", "kl_cov", "opo", "grpo_passk", "remax",
            "otb")
# Samples trained on per step, the same for every variant (prompts x rollout.n).
SAMPLES_PER_STEP = 128


def _sibling(name: str):
  """Another shipped config file (configs/<name>.py, next to this one) as a module."""
  path = os.path.join(os.path.dirname(os.path.abspath(__file__)), f"{name}.py")
  spec = importlib.util.spec_from_file_location(f"_distflow_configs_{name}", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def _with_dag(c, dag: list[dict], estimator: str) -> None:
  """``dag`` with its advantage node computing ``advantage.<estimator>``."""
  c.dag = [dict(d, fn=f"advantage.{estimator}") if d["fn"].startswith("advantage.")
           else dict(d) for d in dag]


def _grpo_family():
  """The default run (grpo.py:tiny): group estimators, 16 prompts x 8 samples a step."""
  grpo = _sibling("grpo")
  c = grpo.get_config("tiny")
  c.dag = list(grpo.DAG)
  return c


def _ppo():
  """PPO on the default run's task, model and warm start: GAE with a critic."""
  c = _grpo_family()
  ppo = _sibling("ppo").get_config("tiny")
  c.dag = list(ppo.dag)
  c.algo.gamma, c.algo.lam = ppo.algo.gamma, ppo.algo.lam
  # A sample's KL to the reference enters its per-token reward (the PPO/RLHF form, as
  # ppo.py); the advantages are whitened over the batch.
  c.actor.kl.coef = ppo.actor.kl.coef
  c.actor.kl.in_reward = True
  # One sample a prompt (GAE needs no group) and many prompts: an outside check with 16
  # prompts a step collapsed to 0% held-out accuracy at 2-4 nats/token of KL; 128 a step
  # learned (45.5%).  128 x 1 is also the group variants' 16 x 8 sample budget.
  c.rollout.n = 1
  c.data.prompts_per_step = SAMPLES_PER_STEP
  c.critic.optimizer.lr = ppo.critic.optimizer.lr
  c.critic.micro_batch_size = c.actor.micro_batch_size
  # A fresh critic predicts 0 (its value head starts at zero), so the first advantages are
  # the raw whitened returns, not yet measured against a learned baseline: the first steps
  # train the critic alone.
  c.critic.warmup_steps = 5  # a tenth of the run (tools/compare_algorithms.py keeps it so)
  # Two mini-batches so the clipped ratio acts (see the module docstring).
  c.actor.mini_batches = 2
  # Collapse warnings on the progress line and health/<signal> in the metrics (the
  # defaults, spelled out because PPO is the variant that needs them).  The run goes on
  # after an alarm, so a comparison sees the whole curve.
  c.trainer.health.kl_max = 1.0
  c.trainer.health.length_fraction = 0.25
  c.trainer.health.min_entropy = 0.02
  c.trainer.stop_on_collapse = False
  return c


def get_config(arg: str = "grpo"):
  if arg == "ppo":
    c = _ppo()
  elif arg in VARIANTS:
    c = _grpo_family()
  else:
    raise ValueError(f"unknown variant {arg!r} of algorithms.py; valid: {', '.join(VARIANTS)}")
  c.name = f"algo-{arg}"
  c.run_dir = f"runs/algo_{arg}"
  if arg == "grpo":
    # The default run unchanged: the reference the others are compared with.  Advantages
    # (r - mean) / std are about 1; KL 0.3 keeps the warm start's arithmetic from drifting.
    pass
  elif arg == "drgrpo":
    # Dr.GRPO: no division by the group std (a group that almost agrees is not blown up).
    # Advantages on the reward's scale (~0.4) call for a KL coefficient ~4.5x below GRPO's.
    # token-mean already has Dr.GRPO's other fix (no per-sequence length normalisation:
    # one denominator, the batch's token count, for every sequence).
    c.algo.norm_by_std = False
    c.actor.kl.coef = 0.067
  elif arg == "rloo":
    # RLOO: each sample's baseline is the mean of the other n - 1 of its group, so the
    # advantages are n/(n-1) (r - mean), on the reward's scale: KL 0.12, not 0.3.
    _with_dag(c, c.dag, "rloo")
    c.actor.kl.coef = 0.12
  elif arg == "reinforce_pp_baseline":
    # REINFORCE++ with a group-mean baseline, whitened over the whole batch: advantages
    # about 1 as GRPO's, so GRPO's KL coefficient fits (no group std: a group that almost
    # agrees is not blown up).
    _with_dag(c, c.dag, "reinforce_pp_baseline")
  elif arg == "dapo":
    # DAPO: clip-higher (a larger upper clip lets unlikely tokens gain probability, against
    # entropy collapse), token-mean loss (long answers weigh by their tokens), dynamic
    # sampling (up to 2 generation rounds a step: a fresh batch of prompts replaces the
    # groups whose rewards are all equal, which have zero advantage and teach nothing; the
    # comparison counts the extra samples generated).  The KL loss stays, unlike the
    # paper: on this task it keeps the warm start's arithmetic from drifting (grpo.py).
    c.actor.clip_ratio_low = 0.2
    c.actor.clip_ratio_high = 0.28
    c.actor.loss_agg = "token-mean"
    c.algo.dynamic_sampling_tries = 2
    c.actor.mini_batches = 2  # so the ratio leaves 1 and clip-higher acts
  elif arg == "gspo":
    # GSPO: one importance ratio per sequence (the geometric mean of its token ratios),
    # clipped to [1 - 3e-4, 1 + 4e-4] (sequence ratios sit much closer to 1 than token
    # ratios), each sequence's tokens averaged before the batch mean.
    c.actor.ratio_level = "sequence"
    c.actor.clip_ratio_low = 3e-4
    c.actor.clip_ratio_high = 4e-4
    c.actor.loss_agg = "seq-mean-token-mean"
    c.actor.mini_batches = 2  # so the ratio leaves 1 and the clip acts
  elif arg == "gpg":
    # GPG: the plain policy gradient -A log pi of GRPO's advantages (algos/policy_losses.py),
    # no ratio and no clip.  The KL loss stays, unlike the paper, as in dapo.
    c.actor.policy_loss = "gpg"
  elif arg == "cispo":
    # CISPO: the importance weight clipped (and held constant) instead of the update, so
    # every token keeps a gradient; the paper's open lower bound, an upper one of 0.28.
    c.actor.policy_loss = "cispo"
    c.actor.clip_ratio_low = 0.99
    c.actor.clip_ratio_high = 0.28
    c.actor.mini_batches = 2  # so the weight leaves 1 and the clip acts
  elif arg == "gmpo":
    # GMPO: the geometric mean of a sequence's token ratios, each clipped in log space to
    # [-0.4, 0.4] (the paper's range, wider than PPO's: a geometric mean moves less),
    # the mean over sequences.
    c.actor.policy_loss = "gmpo"
    c.actor.clip_ratio_low = 0.4
    c.actor.clip_ratio_high = 0.4
    c.actor.loss_agg = "seq-mean-token-mean"
    c.actor.mini_batches = 2  # so the ratio leaves 1 and the clip acts
  elif arg == "sapo":
    # SAPO: a smooth sigmoid gate of the ratio (temperatures 1.0 for A > 0, 1.05 for
    # A <= 0: actor.loss_args) instead of the hard clip; tokens averaged per sequence.
    c.actor.policy_loss = "sapo"
    c.actor.loss_agg = "seq-mean-token-mean"
    c.actor.mini_batches = 2  # so the ratio leaves 1 and the gate acts
  elif arg in ("clip_cov", "kl_cov"):
    # Clip-Cov / KL-Cov: against entropy collapse, the tokens whose advantage and log-prob
    # covary most lose their gradient (a random few within 1 < cov < 5) or pay |log ratio|
    # (the largest 2e-4 of them): verl's defaults, actor.loss_args.  At 8 rows x ~20
    # tokens a micro-batch that is one token of each micro-batch.
    c.actor.policy_loss = arg
    c.actor.mini_batches = 2  # so the ratio leaves 1
  elif arg == "opo":
    # OPO: the group's length-weighted mean reward as the baseline, no std division, so
    # the advantages keep the reward's scale: Dr.GRPO's KL coefficient.
    _with_dag(c, c.dag, "opo")
    c.actor.kl.coef = 0.067
  elif arg == "grpo_passk":
    # GRPO pass@k: only each group's best sample learns, (r_best - r_second) / std;
    # optimises the chance that one of the n samples is right, not each one.
    _with_dag(c, c.dag, "grpo_passk")
  elif arg == "remax":
    # ReMax: each sample's baseline is the reward of its prompt's greedy response, one
    # more rollout per prompt (16 greedy responses a step beside the 128 samples, not
    # counted in the sample budget): a generate.greedy node between the rollout and the
    # rule reward, which scores both.  Advantages r - r_greedy keep the reward's scale:
    # Dr.GRPO's KL coefficient.
    _with_dag(c, _with_greedy_baseline(c.dag), "remax")
    c.actor.kl.coef = 0.067
  elif arg == "otb":
    # The optimal token baseline: a baseline per token position, the group's returns
    # weighted by each sample's accumulated 1 - 2 pi + sum pi^2 under the old policy, which
    # the logprob.stats node computes (its pass always runs: one more forward pass a step
    # than GRPO's, whose old log-probs are the rollout's).  No std division: Dr.GRPO's KL.
    stats = next(d["id"] for d in c.dag if d["fn"] == "logprob")
    c.dag = [dict(d, fn="logprob.stats") if d["id"] == stats else
             dict(d, deps=[*d["deps"], stats]) if d["fn"].startswith("advantage.") else dict(d)
             for d in c.dag]
    _with_dag(c, c.dag, "otb")
    c.actor.kl.coef = 0.067
  return c


def _with_greedy_baseline(dag: list[dict]) -> list[dict]:
  """``dag`` with a generate.greedy node after its generate node, which the nodes that
  depended on generate for rewards now depend on instead."""
  gen = next(d["id"] for d in dag if d["fn"] == "generate")
  out = []
  for d in dag:
    out.append(dict(d))
    if d["fn"].startswith("reward.") and gen in d.get("deps", []):
      out[-1]["deps"] = ["baseline" if x == gen else x for x in d["deps"]]
    if d["id"] == gen:
      out.append(dict(id="baseline", fn="generate.greedy", deps=[gen]))
  return out
