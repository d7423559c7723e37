"""RL losses that return a sum and a denominator, so means are exact anywhere.

Every loss returns ``LossOutput(total, count, token_count, metrics)``:

* ``total``: the aggregated loss *sum* of this micro-batch (a scalar);
* ``count``: its denominator (tokens or sequences, by aggregation mode);
* ``token_count``: the number of real response tokens;
* ``metrics``: per-token *sums* (clip fraction, approx KL, entropy, ...).

Summing outputs over micro-batches and hosts (``jax.tree.map(jnp.add, ...)``
or a ``psum``) and dividing once (``finalize``) gives exactly the full-batch
mean.  For gradients the same holds: the trainer computes the full batch's
denominator first (``loss_denominator`` on every micro-batch, summed, psum'd
across hosts) and differentiates ``total / global_count`` per micro-batch;
the accumulated gradient is then the gradient of the full-batch mean.

Aggregation modes (l = per-token loss, m = response mask, i = sequence):

* ``token-mean``:             sum_i sum_t m l / sum_i sum_t m
* ``seq-mean-token-sum``:     (1/N) sum_i sum_t m l
* ``seq-mean-token-mean``:    (1/N) sum_i (sum_t m l / sum_t m)
* ``seq-mean-token-sum-norm``: (1/N) sum_i sum_t m l / L   (Dr.GRPO, L fixed)

with N the number of non-empty sequences.  The seq-mean modes stay exact
across micro-batches because a sequence never straddles two micro-batches: its
inner token mean is complete inside one, so ``total`` is a sum of whole
per-sequence terms and ``count`` the number of sequences; summing both over
micro-batches gives the full-batch sums.  An empty response (all-zero mask)
adds nothing to either.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, Iterable, NamedTuple

import jax
import jax.numpy as jnp

from distflow_jax.algos import kl as kl_lib, policy_losses
from distflow_jax.algos.choice import Choice
from distflow_jax.algos.masked import masked_sum, real

_LOG_RATIO_CLAMP = 20.0


class LossAggMode(Choice):
  """loss aggregation mode"""
  TOKEN_MEAN = "token-mean"
  SEQ_MEAN_TOKEN_SUM = "seq-mean-token-sum"
  SEQ_MEAN_TOKEN_MEAN = "seq-mean-token-mean"
  SEQ_MEAN_TOKEN_SUM_NORM = "seq-mean-token-sum-norm"


class RatioLevel(Choice):
  """ratio level"""
  TOKEN = "token"        # PPO / GRPO / DAPO
  SEQUENCE = "sequence"  # GSPO


class LossOutput(NamedTuple):
  total: jax.Array
  count: jax.Array
  token_count: jax.Array
  metrics: dict[str, jax.Array]


# --------------------------------------------------------------------------
# Aggregation.


def _check_same_shape(**arrays: jax.Array) -> None:
  shapes = {k: tuple(v.shape) for k, v in arrays.items()}
  if len(set(shapes.values())) != 1 or any(len(s) != 2 for s in shapes.values()):
    detail = ", ".join(f"{k} {s}" for k, s in shapes.items())
    raise ValueError(f"expected matching [B, T] shapes, got {detail}")


def loss_denominator(response_mask_BxT: jax.Array,
                     agg_mode: "str | LossAggMode" = LossAggMode.TOKEN_MEAN
                     ) -> jax.Array:
  """The ``count`` a loss over this mask would return (tokens or sequences)."""
  mode = LossAggMode.parse(agg_mode)
  m = response_mask_BxT.astype(jnp.float32)
  if mode is LossAggMode.TOKEN_MEAN:
    return jnp.sum(m)
  return jnp.sum((jnp.sum(m, axis=1) > 0).astype(jnp.float32))


def aggregate(loss_BxT: jax.Array, response_mask_BxT: jax.Array,
              agg_mode: "str | LossAggMode" = LossAggMode.TOKEN_MEAN,
              norm_length: float | None = None) -> tuple[jax.Array, jax.Array]:
  """(total, count) of a per-token loss under ``agg_mode`` (module docstring)."""
  mode = LossAggMode.parse(agg_mode)
  m = response_mask_BxT.astype(jnp.float32)
  # where(), not multiply: a NaN/inf on padding must not poison the sum.
  lm = jnp.where(m > 0, loss_BxT.astype(jnp.float32), 0.0) * m
  count = loss_denominator(m, mode)
  if mode is LossAggMode.TOKEN_MEAN:
    return jnp.sum(lm), count
  if mode is LossAggMode.SEQ_MEAN_TOKEN_SUM:
    return jnp.sum(lm), count
  if mode is LossAggMode.SEQ_MEAN_TOKEN_MEAN:
    per_seq = jnp.sum(lm, axis=1) / jnp.maximum(jnp.sum(m, axis=1), 1.0)
    return jnp.sum(per_seq), count
  if norm_length is None or norm_length <= 0:
    raise ValueError(f"{mode.value} needs a positive norm_length (a fixed "
                     f"length such as the max response length), got {norm_length}")
  return jnp.sum(lm) / norm_length, count


# --------------------------------------------------------------------------
# Policy loss.


def policy_loss(logprobs_BxT: jax.Array, old_logprobs_BxT: jax.Array,
                advantages_BxT: jax.Array, response_mask_BxT: jax.Array, *,
                clip_ratio_low: float = 0.2,
                clip_ratio_high: float | None = None,
                clip_ratio_c: float | None = None,
                ratio_level: "str | RatioLevel" = RatioLevel.TOKEN,
                agg_mode: "str | LossAggMode" = LossAggMode.TOKEN_MEAN,
                norm_length: float | None = None,
                token_weights_BxT: jax.Array | None = None,
                loss: str = "ppo",
                loss_args: "Mapping[str, float] | Iterable[tuple[str, float]]" = ()
                ) -> LossOutput:
  """The policy loss ``loss`` (algos/policy_losses.py; default PPO's clipped surrogate with
  clip-higher and dual clip), aggregated by ``agg_mode``.

  ``ratio_level='token'``: rho_t = pi(y_t) / pi_old(y_t).
  ``ratio_level='sequence'`` (GSPO, Zheng et al. 2025, its token form):
    log s_i   = (1/|y_i|) sum_t log(pi(y_t) / pi_old(y_t))
    rho_{i,t} = sg(s_i) * pi(y_t) / sg(pi(y_t))
  so every token of a sequence shares the value s_i while the gradient flows
  per token; with a sequence advantage broadcast over tokens this is GSPO.  GSPO's loss
  is aggregated by ``agg_mode`` like any other (verl's GSPO always takes
  seq-mean-token-mean: set ``actor.loss_agg`` to that for its numbers).
  ``token_weights_BxT`` (off-policy correction, algos/off_policy.py): l_t * w_t.
  ``loss_args``: the settings of losses that have their own (``actor.loss_args``), checked
  by the loss's own check.

  Metrics (token sums): the loss's own (PPO: ``pg_clipfrac``, ``pg_clipfrac_lower``),
  ``ppo_kl`` (log pi_old - log pi, k1), ``ratio``, ``pg_loss`` (the total again, so it
  survives ``actor_loss``'s combination).
  """
  _check_same_shape(logprobs_BxT=logprobs_BxT, old_logprobs_BxT=old_logprobs_BxT,
                    advantages_BxT=advantages_BxT,
                    response_mask_BxT=response_mask_BxT)
  eps_low = clip_ratio_low
  eps_high = clip_ratio_low if clip_ratio_high is None else clip_ratio_high
  if not (0 <= eps_low < 1) or eps_high < 0:
    raise ValueError(f"clip ratios must satisfy 0 <= low < 1 and high >= 0, got "
                     f"low={eps_low}, high={eps_high}")
  if clip_ratio_c is not None and clip_ratio_c <= 1.0:
    raise ValueError(f"dual-clip clip_ratio_c must be > 1, got {clip_ratio_c}")
  level = RatioLevel.parse(ratio_level)
  fn = policy_losses.get(loss)
  args = dict(loss_args)
  policy_losses.check(loss, args, level.value)

  m = response_mask_BxT.astype(jnp.float32)
  logp = real(logprobs_BxT, m)
  old = real(old_logprobs_BxT, m)
  token_log_ratio = logp - old
  if level is RatioLevel.TOKEN:
    log_ratio = token_log_ratio
  else:
    seq_log_ratio_B = (jnp.sum(token_log_ratio, axis=1)
                       / jnp.maximum(jnp.sum(m, axis=1), 1.0))
    log_ratio = (jax.lax.stop_gradient(seq_log_ratio_B)[:, None]
                 + logp - jax.lax.stop_gradient(logp))
  log_ratio = jnp.clip(log_ratio, -_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)
  ratio = jnp.exp(log_ratio)
  terms = fn(policy_losses.PolicyInput(
      logp=logp, old_logp=old, advantages=real(advantages_BxT, m), mask=m,
      log_ratio=log_ratio, ratio=ratio, clip_ratio_low=eps_low, clip_ratio_high=eps_high,
      clip_ratio_c=clip_ratio_c, args=args))
  per_token = terms.loss
  if token_weights_BxT is not None:
    per_token = per_token * real(token_weights_BxT, m)

  total, count = aggregate(per_token, m, agg_mode, norm_length)
  metrics = {"pg_loss": total,
             **{k: masked_sum(v, m) for k, v in terms.metrics.items()},
             "ppo_kl": masked_sum(-token_log_ratio, m),
             "ratio": masked_sum(ratio, m)}
  return LossOutput(total, count, jnp.sum(m), metrics)


def kl_loss(logprobs_BxT: jax.Array, ref_logprobs_BxT: jax.Array,
            response_mask_BxT: jax.Array, *,
            estimator: "str | kl_lib.KLEstimator" = kl_lib.KLEstimator.K3,
            agg_mode: "str | LossAggMode" = LossAggMode.TOKEN_MEAN,
            norm_length: float | None = None,
            k3_cap: float = kl_lib.K3_CAP) -> LossOutput:
  """KL(pi || pi_ref) as a loss term, per-token estimator aggregated (k3 capped)."""
  _check_same_shape(logprobs_BxT=logprobs_BxT, ref_logprobs_BxT=ref_logprobs_BxT,
                    response_mask_BxT=response_mask_BxT)
  m = response_mask_BxT.astype(jnp.float32)
  kl = kl_lib.kl_divergence(real(logprobs_BxT, m), real(ref_logprobs_BxT, m),
                            estimator, k3_cap)
  total, count = aggregate(kl, m, agg_mode, norm_length)
  return LossOutput(total, count, jnp.sum(m), {"kl": masked_sum(kl, m)})


def entropy_loss(entropy_BxT: jax.Array, response_mask_BxT: jax.Array, *,
                 agg_mode: "str | LossAggMode" = LossAggMode.TOKEN_MEAN,
                 norm_length: float | None = None) -> LossOutput:
  """The aggregated entropy H (to be *subtracted*, times a coefficient)."""
  _check_same_shape(entropy_BxT=entropy_BxT, response_mask_BxT=response_mask_BxT)
  m = response_mask_BxT.astype(jnp.float32)
  ent = real(entropy_BxT, m)
  total, count = aggregate(ent, m, agg_mode, norm_length)
  return LossOutput(total, count, jnp.sum(m), {"entropy": masked_sum(ent, m)})


def actor_loss(logprobs_BxT: jax.Array, old_logprobs_BxT: jax.Array,
               advantages_BxT: jax.Array, response_mask_BxT: jax.Array, *,
               entropy_BxT: jax.Array | None = None, entropy_coef: float = 0.0,
               ref_logprobs_BxT: jax.Array | None = None, kl_coef: float = 0.0,
               kl_estimator: "str | kl_lib.KLEstimator" = kl_lib.KLEstimator.K3,
               agg_mode: "str | LossAggMode" = LossAggMode.TOKEN_MEAN,
               norm_length: float | None = None, k3_cap: float = kl_lib.K3_CAP,
               **policy_kwargs: Any) -> LossOutput:
  """policy_loss - entropy_coef * H + kl_coef * KL, all under one agg mode.

  The three terms share the mask and mode, hence the denominator, so a linear
  combination of their totals is the total of the combined loss.
  """
  pg = policy_loss(logprobs_BxT, old_logprobs_BxT, advantages_BxT,
                   response_mask_BxT, agg_mode=agg_mode, norm_length=norm_length,
                   **policy_kwargs)
  total, metrics = pg.total, dict(pg.metrics)
  if entropy_BxT is not None:
    ent = entropy_loss(entropy_BxT, response_mask_BxT, agg_mode=agg_mode,
                       norm_length=norm_length)
    total = total - entropy_coef * ent.total
    metrics.update(ent.metrics)
  elif entropy_coef:
    raise ValueError(f"entropy_coef={entropy_coef} needs entropy_BxT")
  if ref_logprobs_BxT is not None:
    kl = kl_loss(logprobs_BxT, ref_logprobs_BxT, response_mask_BxT,
                 estimator=kl_estimator, agg_mode=agg_mode, k3_cap=k3_cap,
                 norm_length=norm_length)
    total = total + kl_coef * kl.total
    metrics.update(kl.metrics)
  elif kl_coef:
    raise ValueError(f"kl_coef={kl_coef} needs ref_logprobs_BxT")
  return LossOutput(total, pg.count, pg.token_count, metrics)


# --------------------------------------------------------------------------
# Value loss.


def value_loss(values_BxT: jax.Array, old_values_BxT: jax.Array,
               returns_BxT: jax.Array, response_mask_BxT: jax.Array, *,
               clip_range: float | None = 0.2,
               agg_mode: "str | LossAggMode" = LossAggMode.TOKEN_MEAN,
               norm_length: float | None = None) -> LossOutput:
  """Clipped value loss (PPO2):

    V_clip = V_old + clip(V - V_old, -eps, eps)
    l      = 0.5 * max((V - R)^2, (V_clip - R)^2)

  ``clip_range=None`` gives the plain 0.5 (V - R)^2.  Metric ``vf_clipfrac``
  counts tokens where the clipped branch was larger.
  """
  _check_same_shape(values_BxT=values_BxT, old_values_BxT=old_values_BxT,
                    returns_BxT=returns_BxT, response_mask_BxT=response_mask_BxT)
  m = response_mask_BxT.astype(jnp.float32)
  v = real(values_BxT, m)
  ret = real(returns_BxT, m)
  unclipped = jnp.square(v - ret)
  if clip_range is None:
    loss, taken = 0.5 * unclipped, jnp.zeros_like(v)
  else:
    if clip_range <= 0:
      raise ValueError(f"value clip_range must be > 0 or None, got {clip_range}")
    old = real(old_values_BxT, m)
    # V clamped into [V_old - eps, V_old + eps] (verl's form): exactly V where it is
    # inside, so vf_clipfrac counts only tokens the clip changed (old + clip(V - old) is
    # not V in float32, and counted unclipped tokens).
    v_clip = jnp.clip(v, old - clip_range, old + clip_range)
    clipped = jnp.square(v_clip - ret)
    loss = 0.5 * jnp.maximum(unclipped, clipped)
    taken = (clipped > unclipped).astype(jnp.float32)
  total, count = aggregate(loss, m, agg_mode, norm_length)
  metrics = {"vf_loss": total, "vf_clipfrac": masked_sum(taken, m),
             "vpred": masked_sum(v, m)}
  return LossOutput(total, count, jnp.sum(m), metrics)


# --------------------------------------------------------------------------
# Host-side reduction.


def combine(outputs: Iterable[LossOutput]) -> LossOutput:
  """Sums loss outputs of micro-batches (or hosts) field by field."""
  outputs = list(outputs)
  if not outputs:
    raise ValueError("combine() needs at least one LossOutput")
  return jax.tree.map(lambda *xs: sum(xs[1:], xs[0]), *outputs)


class EmptyBatchError(ValueError):
  """The batch holds no real response token: no update can be computed."""


class NonFiniteLossError(FloatingPointError):
  """The loss sum is NaN or infinite: the update must not be applied."""


def finalize(out: LossOutput, where: str = "loss") -> dict[str, float]:
  """Turns summed outputs into means on the host; refuses bad batches.

  ``loss`` = total / count; loss-like metrics (``*_loss``) likewise; other
  metrics are per-token means.  Raises ``EmptyBatchError`` when there is no
  real token and ``NonFiniteLossError`` when the total is NaN/inf, naming
  ``where`` (e.g. the DAG node), so a bad batch never becomes a silent update.
  """
  count = float(out.count)
  tokens = float(out.token_count)
  total = float(out.total)
  if count <= 0 or tokens <= 0:
    raise EmptyBatchError(
        f"{where}: no real response tokens (count={count:g}, "
        f"token_count={tokens:g}); every response in the batch is empty")
  if not math.isfinite(total):
    raise NonFiniteLossError(f"{where}: loss total is {total} over count "
                             f"{count:g}; refusing to report or apply it")
  result = {"loss": total / count, "count": count, "token_count": tokens}
  for k, v in out.metrics.items():
    result[k] = float(v) / (count if k.endswith("_loss") else tokens)
  return result
