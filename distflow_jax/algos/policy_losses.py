"""Policy losses by name (``actor.policy_loss``): one function each, registered where it
is defined.

A policy loss maps the response tokens' log-probs under the policy being trained and under
the rollout's (old) policy, the advantages and the importance ratio to a per-token loss
and per-token metrics; ``losses.policy_loss`` computes the ratio (token level, or GSPO's
sequence level: ``actor.ratio_level``), applies the off-policy weights, aggregates the
loss by ``actor.loss_agg`` and token-sums the metrics, adding the generic ones (``ppo_kl``,
``ratio``, ``pg_loss``).  A new loss is this one function and its name in the config:

    from distflow_jax.algos import policy_losses

    @policy_losses.register("reinforce")     # in a module listed in config.plugins
    def reinforce(x: policy_losses.PolicyInput) -> policy_losses.PolicyTerms:
      return policy_losses.PolicyTerms(-x.advantages * x.logp, {})

    # distflow-jax train --config.plugins='("my_losses",)' --config.actor.policy_loss=reinforce

A name is registered once (a second registration is refused, naming the first's module);
an unknown ``actor.policy_loss`` is refused at start-up, listing the registered names.
A loss with settings of its own reads them from ``x.args`` (``actor.loss_args``) and
registers a ``check(args, ratio_level)`` that raises ``ValueError`` naming the key out of
range; ``check`` runs at start-up (the config checks) and again when the loss is traced.

Built in: ppo, gpg, cispo, gmpo, sapo, clip_cov, kl_cov (each one's formula below).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping

import jax
import jax.numpy as jnp

from distflow_jax.algos import token_select


@dataclasses.dataclass(frozen=True)
class PolicyInput:
  """``[B, T]`` float32 arrays, 0 at masked positions, and the actor's clip settings.

  ``ratio`` is pi / pi_old at the run's ratio level (exp of the clamped ``log_ratio``);
  ``clip_ratio_high`` is ``clip_ratio_low`` where not set; ``clip_ratio_c`` is None where
  dual clip is off."""
  logp: jax.Array
  old_logp: jax.Array
  advantages: jax.Array
  mask: jax.Array
  log_ratio: jax.Array
  ratio: jax.Array
  clip_ratio_low: float
  clip_ratio_high: float
  clip_ratio_c: float | None
  # actor.loss_args: the settings of the losses that have their own (sapo_tau_pos, ...).
  args: Mapping[str, float] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class PolicyTerms:
  """The per-token loss ``[B, T]`` and per-token metrics (token-summed by the caller, so
  a metric's mean is its share of real tokens)."""
  loss: jax.Array
  metrics: Mapping[str, jax.Array]


PolicyLoss = Callable[[PolicyInput], PolicyTerms]
# check(args, ratio_level): raises ValueError naming the setting out of range.
PolicyCheck = Callable[[Mapping[str, float], str], None]
POLICY_LOSSES: dict[str, PolicyLoss] = {}
CHECKS: dict[str, PolicyCheck] = {}


def register(name: str, check: PolicyCheck | None = None
             ) -> Callable[[PolicyLoss], PolicyLoss]:
  """Registers the decorated function as policy loss ``name``; a taken name is refused.
  ``check`` (optional) validates the loss's settings (module docstring)."""
  if not isinstance(name, str) or not name:
    raise ValueError(f"a policy loss needs a non-empty name, got {name!r}")

  def add(fn: PolicyLoss) -> PolicyLoss:
    if name in POLICY_LOSSES:
      first = POLICY_LOSSES[name]
      raise ValueError(f"policy loss {name!r} is registered already (by "
                       f"{first.__module__}.{first.__qualname__}); pick another name")
    POLICY_LOSSES[name] = fn
    if check is not None:
      CHECKS[name] = check
    return fn
  return add


def check(name: str, args: Mapping[str, float], ratio_level: str = "token") -> None:
  """Runs loss ``name``'s own check of its settings (none: nothing to check)."""
  get(name)
  if name in CHECKS:
    CHECKS[name](args, ratio_level)


def names() -> list[str]:
  return sorted(POLICY_LOSSES)


def get(name: str) -> PolicyLoss:
  if name not in POLICY_LOSSES:
    raise ValueError(f"actor.policy_loss={name!r} is not a registered policy loss; "
                     f"registered: {names()} (a plugin registers one with "
                     f"policy_losses.register)")
  return POLICY_LOSSES[name]


@register("ppo")
def ppo_clip(x: PolicyInput) -> PolicyTerms:
  """PPO's clipped surrogate, with DAPO's clip-higher and dual clip.

  l = max(-A rho, -A clip(rho, 1 - eps_low, 1 + eps_high)); with dual clip (Ye et al.
  2020, c > 1) l = min(l, -A c) where A < 0.  Metrics: ``pg_clipfrac`` (the clipped
  branch was taken), ``pg_clipfrac_lower`` (the dual clip was)."""
  adv, ratio = x.advantages, x.ratio
  unclipped = -adv * ratio
  clipped = -adv * jnp.clip(ratio, 1.0 - x.clip_ratio_low, 1.0 + x.clip_ratio_high)
  loss = jnp.maximum(unclipped, clipped)
  clip_taken = (clipped > unclipped).astype(jnp.float32)
  if x.clip_ratio_c is not None:
    bound = -adv * x.clip_ratio_c
    dual_taken = ((adv < 0) & (loss > bound)).astype(jnp.float32)
    loss = jnp.where(adv < 0, jnp.minimum(loss, bound), loss)
  else:
    dual_taken = jnp.zeros_like(loss)
  return PolicyTerms(loss, {"pg_clipfrac": clip_taken, "pg_clipfrac_lower": dual_taken})


@register("gpg")
def gpg(x: PolicyInput) -> PolicyTerms:
  """GPG (Chu et al. 2025, "GPG: A Simple and Strong Reinforcement Learning Baseline"): the
  plain policy gradient of the (group-normalized) advantages, no ratio, no clip, no KL:

    l_t = -A_t log pi(y_t)

  Its gradient at the rollout's policy equals PPO's unclipped one; it differs once the
  policy has moved (later mini-batches or epochs), where nothing bounds the step."""
  return PolicyTerms(-x.advantages * x.logp, {})


@register("cispo")
def cispo(x: PolicyInput) -> PolicyTerms:
  """CISPO (MiniMax-M1, 2025): clip the importance weight, not the update, so every token
  keeps a gradient:

    l_t = -sg(clip(rho_t, 1 - eps_low, 1 + eps_high)) A_t log pi(y_t)

  with eps_low = ``actor.clip_ratio_low`` and eps_high = ``actor.clip_ratio_high``
  (the paper leaves the lower bound open: a clip_ratio_low near 1).  Metric
  ``pg_clipfrac``: tokens whose weight the clip changed."""
  lo, hi = 1.0 - x.clip_ratio_low, 1.0 + x.clip_ratio_high
  weight = jax.lax.stop_gradient(jnp.clip(x.ratio, lo, hi))
  clipped = ((x.ratio < lo) | (x.ratio > hi)).astype(jnp.float32)
  return PolicyTerms(-weight * x.advantages * x.logp, {"pg_clipfrac": clipped})


# --------------------------------------------------------------------------
# The settings of the losses below (actor.loss_args), and their checks.


def _arg(args: Mapping[str, float], key: str) -> float:
  if key not in args:
    raise ValueError(f"actor.loss_args.{key} is not set; it needs a number (the defaults: "
                     f"config/defaults.py)")
  value = args[key]
  if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
    raise ValueError(f"actor.loss_args.{key}={value!r} must be a finite number")
  return float(value)


def _needs_token_ratio(name: str, ratio_level: str) -> None:
  if ratio_level != "token":
    raise ValueError(f"actor.policy_loss={name} is built from the token log-ratios; it "
                     f"needs actor.ratio_level=token, got {ratio_level!r}")


def _check_gmpo(args: Mapping[str, float], ratio_level: str) -> None:
  _needs_token_ratio("gmpo", ratio_level)


def _check_sapo(args: Mapping[str, float], ratio_level: str) -> None:
  for key in ("sapo_tau_pos", "sapo_tau_neg"):
    if _arg(args, key) <= 0:
      raise ValueError(f"actor.loss_args.{key}={args[key]!r} must be > 0 (the gate's "
                       f"temperature; the paper's 1.0 and 1.05)")


def _check_fraction(args: Mapping[str, float], key: str) -> None:
  v = _arg(args, key)
  if not 0 < v <= 1:
    raise ValueError(f"actor.loss_args.{key}={args[key]!r} must be in (0, 1]: the share of "
                     f"a micro-batch's tokens selected (verl's 2e-4)")


def _check_clip_cov(args: Mapping[str, float], ratio_level: str) -> None:
  _needs_token_ratio("clip_cov", ratio_level)
  _check_fraction(args, "clip_cov_ratio")
  lb, ub = _arg(args, "clip_cov_lb"), _arg(args, "clip_cov_ub")
  if not lb < ub:
    raise ValueError(f"actor.loss_args.clip_cov_lb={args['clip_cov_lb']!r} must be below "
                     f"clip_cov_ub={args['clip_cov_ub']!r} (the covariance band whose tokens "
                     f"may be detached; verl's 1 and 5)")


def _check_kl_cov(args: Mapping[str, float], ratio_level: str) -> None:
  _needs_token_ratio("kl_cov", ratio_level)
  _check_fraction(args, "kl_cov_ratio")
  if _arg(args, "kl_cov_coef") < 0:
    raise ValueError(f"actor.loss_args.kl_cov_coef={args['kl_cov_coef']!r} must be >= 0 "
                     f"(the |log ratio| penalty's coefficient; verl's 1)")


# --------------------------------------------------------------------------
# GMPO, SAPO, Clip-Cov, KL-Cov.


@register("gmpo", check=_check_gmpo)
def gmpo(x: PolicyInput) -> PolicyTerms:
  """GMPO (Zhao et al. 2025, "Geometric-Mean Policy Optimization"): the geometric mean of a
  sequence's token ratios instead of their arithmetic mean, clipped per token in log space:

    d_t   = sgn(A_t) min(sgn(A_t) log rho_t, sgn(A_t) clip(log rho_t, -eps_low, eps_high))
    rho_i = exp((1/|y_i|) sum_t d_t),   A_i = (1/|y_i|) sum_t A_t
    l_i   = -A_i rho_i

  with eps_low = ``actor.clip_ratio_low`` and eps_high = ``actor.clip_ratio_high`` taken
  as log-space bounds (the paper's 0.4 and 0.4: ratios in [e^-0.4, e^0.4]).  l_i is
  placed on every token of sequence i, so ``actor.loss_agg=seq-mean-token-mean`` gives the
  paper's (and verl's) mean over sequences; ``token-mean`` weighs each sequence by its
  length.  verl divides by all rows, empty responses too; here an empty response counts
  nowhere.  Needs ``actor.ratio_level=token``.  Metrics: ``pg_clipfrac`` (tokens whose
  log-ratio the clip changed, A > 0), ``pg_clipfrac_lower`` (the same, A < 0)."""
  m = x.mask
  lr = x.log_ratio
  lr_clip = jnp.clip(lr, -x.clip_ratio_low, x.clip_ratio_high)
  sgn = jnp.sign(x.advantages)
  d = sgn * jnp.minimum(sgn * lr, sgn * lr_clip)
  n = jnp.maximum(jnp.sum(m, axis=1), 1.0)
  seq_ratio = jnp.exp(jnp.sum(d * m, axis=1) / n)
  seq_adv = jnp.sum(x.advantages * m, axis=1) / n
  loss = jnp.broadcast_to((-seq_adv * seq_ratio)[:, None], m.shape)
  clipped = lr != lr_clip
  return PolicyTerms(loss, {
      "pg_clipfrac": (clipped & (x.advantages > 0)).astype(jnp.float32),
      "pg_clipfrac_lower": (clipped & (x.advantages < 0)).astype(jnp.float32)})


@register("sapo", check=_check_sapo)
def sapo(x: PolicyInput) -> PolicyTerms:
  """SAPO (Gao et al. 2025, "Soft Adaptive Policy Optimization", arXiv 2511.20347): a
  smooth gate of the ratio in place of the hard clip:

    f(rho) = (4 / tau) sigmoid(tau (rho - 1)),   tau = tau_pos if A > 0 else tau_neg
    l_t    = -f(rho_t) A_t

  ``actor.loss_args.sapo_tau_pos`` / ``sapo_tau_neg`` (the paper's 1.0 and 1.05: negative
  advantages' gate decays faster).  f'(1) = 1, so on-policy the gradient is the plain
  policy gradient; away from 1 it fades smoothly instead of stopping at a clip edge.  The
  paper averages tokens per sequence, then sequences: ``actor.loss_agg=seq-mean-token-mean``
  (the shipped variant).  Works at either ratio level (``sequence``: one gate per sequence).
  Metric ``sapo_gate``: the gate's mean."""
  tau = jnp.where(x.advantages > 0, _arg(x.args, "sapo_tau_pos"), _arg(x.args, "sapo_tau_neg"))
  gate = jax.nn.sigmoid(tau * (x.ratio - 1.0)) * (4.0 / tau)
  return PolicyTerms(-gate * x.advantages, {"sapo_gate": gate})


@register("clip_cov", check=_check_clip_cov)
def clip_cov(x: PolicyInput) -> PolicyTerms:
  """Clip-Cov (Cui et al. 2025, "The Entropy Mechanism of Reinforcement Learning for
  Reasoning Language Models"): PPO's clipped surrogate, with the gradient of a few
  high-covariance tokens cut, against entropy collapse.  With

    cov_t = (A_t - mean A)(log pi_t - mean log pi)   (means over the micro-batch's tokens)

  the candidates are the real tokens PPO's clip did not already take with
  lb < cov_t < ub; max(1, floor(r N)) of them (N = real tokens of the micro-batch), drawn
  at random, get l_t = 0 (detached); the rest keep PPO's l_t.  r, lb, ub =
  ``actor.loss_args.clip_cov_ratio`` / ``clip_cov_lb`` / ``clip_cov_ub`` (verl's 2e-4, 1,
  5).  As in verl the draw is per micro-batch, so which tokens are cut depends on the
  micro-batch layout; the draw's key comes from the micro-batch's old log-probs (the same
  on every host and epoch).  Metrics: ``pg_clipfrac`` (the share cut: verl's), and
  ``pg_clipfrac_ppo`` / ``pg_clipfrac_lower`` (PPO's own clip and dual clip)."""
  ppo = ppo_clip(x)
  m = x.mask
  clipped_by_ppo = ppo.metrics["pg_clipfrac"] > 0  # the clipped branch was taken
  cov = token_select.centred_cov(x.advantages, x.logp, x.mask)
  lb, ub = _arg(x.args, "clip_cov_lb"), _arg(x.args, "clip_cov_ub")
  candidate = (m > 0) & ~clipped_by_ppo & (cov > lb) & (cov < ub)
  priority = jax.random.uniform(token_select.data_key(x.old_logp), m.shape)
  rank = token_select.ranks(jnp.where(candidate, priority, 2.0))
  cut = candidate & (rank < token_select.selected_count(m, _arg(x.args, "clip_cov_ratio")))
  return PolicyTerms(jnp.where(cut, 0.0, ppo.loss), {
      "pg_clipfrac": cut.astype(jnp.float32),
      "pg_clipfrac_ppo": ppo.metrics["pg_clipfrac"],
      "pg_clipfrac_lower": ppo.metrics["pg_clipfrac_lower"]})


@register("kl_cov", check=_check_kl_cov)
def kl_cov(x: PolicyInput) -> PolicyTerms:
  """KL-Cov (Cui et al. 2025, as ``clip_cov``): the unclipped surrogate -A rho, plus a
  |log rho| penalty on the tokens of largest covariance:

    l_t = -A_t rho_t + c |log rho_t|   for the max(1, floor(r N)) real tokens of largest
    l_t = -A_t rho_t                   cov_t (``clip_cov``'s), and otherwise

  r, c = ``actor.loss_args.kl_cov_ratio`` / ``kl_cov_coef`` (verl's 2e-4 and 1); the
  selection is per micro-batch, ties by position.  No clip: the penalty is the only brake,
  and only where the covariance (the entropy's drop) is largest.  Metric ``kl_cov_share``:
  the share of tokens penalized."""
  m = x.mask
  cov = token_select.centred_cov(x.advantages, x.logp, x.mask)
  rank = token_select.ranks(jnp.where(m > 0, -cov, jnp.inf))
  chosen = (m > 0) & (rank < token_select.selected_count(m, _arg(x.args, "kl_cov_ratio")))
  penalty = _arg(x.args, "kl_cov_coef") * jnp.abs(x.log_ratio)
  loss = -x.advantages * x.ratio + jnp.where(chosen, penalty, 0.0)
  return PolicyTerms(loss, {"kl_cov_share": chosen.astype(jnp.float32)})
