"""The actor and critic steps: pure functions, jitted once, with donated state.

The losses read log-probs and values of a sequence batch's responses (and
``sequence_scores`` a reward model's score of each sequence), computed from the hidden
states train/hidden.py gives (the batch's keys, "Shared prompts", "Packed rows").  The train step splits a batch into micro-batches
(train/micro_batches.py: rows dealt round robin in whole groups, or a token-budget
plan's slots) and accumulates their gradients.  The loss of each micro-batch is its
*sum* divided by the whole batch's denominator, so the accumulated gradient is exactly
the full-batch mean's.  The accumulator is float32 whatever the parameters' dtype
(bfloat16 parameters: each micro-batch's gradient is added to a float32 sum, cast back
for an optimizer without float32 master weights only once, before the update).  The
jitted step's outputs are pinned to its inputs' shardings (train/placement.py).

A step whose loss, gradient, new parameters or new optimizer state are not all
finite leaves parameters and optimizer state unchanged and reports ``skipped = 1``; one
given an ungrouped batch with shared prompts (``hidden.prompts_grouped``) leaves them
unchanged too and reports ``ungrouped = 1``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from distflow_jax.algos import losses, off_policy
from distflow_jax.models import heads, lora, lora_layer
from distflow_jax.train import hidden as hidden_lib, micro_batches, optim, packing, placement
from distflow_jax.train.loss_mask import loss_mask
from distflow_jax.data.fields import (ADVANTAGES, OLD_LOGPROBS, PROMPT_TOKENS, REF_LOGPROBS,
                                      RESPONSE_MASK, RESPONSE_TOKENS, RETURNS, ROLLOUT_LOGPROBS,
                                      VALUES)

Batch = Mapping[str, jax.Array]


def response_logprobs(graphdef: nnx.GraphDef, params: nnx.State, batch: Batch, *,
                      chunk_size: int = 512, group_size: int = 1, temperature: float = 1.0
                      ) -> tuple[jax.Array, jax.Array]:
  """Float32 ``(logp, entropy)`` of every response token under ``softmax(logits /
  temperature)``, ``[B, N]`` (0 on padding); the training passes give the rollout's
  temperature (config/temperature.py).

  ``group_size``: see "Shared prompts" in train/hidden.py."""
  hidden = hidden_lib.response_hidden(graphdef, params, batch, group_size)
  model = nnx.merge(graphdef, params)
  logp, ent = heads.token_logprobs_and_entropy(hidden, model.unembed_matrix(),
                                               batch[RESPONSE_TOKENS], chunk_size=chunk_size,
                                               temperature=temperature)
  m = batch[RESPONSE_MASK].astype(jnp.float32)
  return logp * m, ent * m


def response_logprob_stats(graphdef: nnx.GraphDef, params: nnx.State, batch: Batch, *,
                           chunk_size: int = 512, group_size: int = 1,
                           temperature: float = 1.0) -> jax.Array:
  """``[B, N, 2]`` float32: each response token's log-prob (as ``response_logprobs``) and
  sum_v pi_v^2 of its position's distribution (0 on padding); one array, so the passes'
  sharding and deterministic units take it as they take the log-probs."""
  hidden = hidden_lib.response_hidden(graphdef, params, batch, group_size)
  model = nnx.merge(graphdef, params)
  logp, sq = heads.token_logprobs_and_sum_pi_squared(
      hidden, model.unembed_matrix(), batch[RESPONSE_TOKENS], chunk_size=chunk_size,
      temperature=temperature)
  m = batch[RESPONSE_MASK].astype(jnp.float32)
  return jnp.stack([logp * m, sq * m], axis=-1)


def response_values(graphdef: nnx.GraphDef, params: nnx.State, batch: Batch) -> jax.Array:
  """Critic value of the state before each response token, ``[B, N]`` (0 on padding)."""
  if "pack" in batch:
    tokens, positions, seg = packing.packed_inputs(batch, batch["pack"])
    values = heads.critic_values(graphdef, params, tokens, positions, seg > 0, seg)
    return (packing.unpack(values, batch["pack"]["out"])
            * batch[RESPONSE_MASK].astype(jnp.float32))
  tokens, mask, positions = hidden_lib.sequence_inputs(batch)
  p = batch[PROMPT_TOKENS].shape[1]
  n = batch[RESPONSE_TOKENS].shape[1]
  values = heads.critic_values(graphdef, params, tokens[:, :-1], positions[:, :-1],
                               mask[:, :-1])
  return values[:, p - 1:p - 1 + n] * batch[RESPONSE_MASK].astype(jnp.float32)


def sequence_scores(graphdef: nnx.GraphDef, params: nnx.State, batch: Batch) -> jax.Array:
  """A reward model's scalar score of each ``prompt ++ response``, ``[B]`` float32."""
  tokens, mask, positions = hidden_lib.sequence_inputs(batch)
  return heads.reward_scores(graphdef, params, tokens, positions, mask)


@dataclasses.dataclass(frozen=True)
class ActorLoss:
  """The actor objective's settings: the keys of config.actor the loss reads (their defaults
  are the config's, declared once in config/sections.py; ``from_config`` reads them), and
  what the step adds."""
  clip_ratio_low: float
  clip_ratio_high: float
  dual_clip: float
  ratio_level: str
  policy_loss: str                   # by name: algos/policy_losses.py
  loss_args: tuple[tuple[str, float], ...]  # actor.loss_args, sorted (hashable)
  loss_agg: str
  entropy_coef: float
  kl_coef: float
  kl_estimator: str
  k3_cap: float                      # actor.kl.k3_cap (algos/kl.py; 0 = none)
  kl_in_loss: bool
  off_policy: str                    # correction (algos/off_policy.py); else reads
  tis_cap: float                     # the batch's 'rollout_logprobs'
  reject_low: float                  # actor.off_policy.reject_low / _high: the rejection
  reject_high: float                 # corrections' bounds on pi_old / mu
  norm_length: float | None = None  # for seq-mean-token-sum-norm (Dr.GRPO)
  group_size: int = 1                # rows per shared prompt (train/hidden.py)
  temperature: float = 1.0           # the rollout's: log-probs of softmax(logits / T)

  @classmethod
  def from_config(cls, actor, max_new_tokens: int | None = None,
                  group_size: int = 1, temperature: float = 1.0) -> "ActorLoss":
    return cls(clip_ratio_low=actor.clip_ratio_low, clip_ratio_high=actor.clip_ratio_high,
               dual_clip=actor.dual_clip, ratio_level=actor.ratio_level,
               policy_loss=actor.policy_loss,
               loss_args=tuple(sorted((k, float(v)) for k, v in actor.loss_args.to_dict().items())),
               loss_agg=actor.loss_agg, entropy_coef=actor.entropy_coef,
               kl_coef=actor.kl.coef, kl_estimator=actor.kl.estimator,
               k3_cap=float(actor.kl.k3_cap),
               kl_in_loss=not actor.kl.in_reward,
               norm_length=float(max_new_tokens) if max_new_tokens else None,
               group_size=group_size, off_policy=actor.off_policy.correction,
               tis_cap=float(actor.off_policy.tis_cap),
               reject_low=float(actor.off_policy.reject_low),
               reject_high=float(actor.off_policy.reject_high), temperature=float(temperature))

  @property
  def correction(self) -> off_policy.OffPolicyCorrection:
    return off_policy.OffPolicyCorrection.parse(self.off_policy)


def actor_loss(graphdef: nnx.GraphDef, params: nnx.State, mb: Batch, cfg: ActorLoss,
               chunk_size: int) -> losses.LossOutput:
  logp, ent = response_logprobs(graphdef, params, mb, chunk_size=chunk_size,
                                group_size=cfg.group_size, temperature=cfg.temperature)
  use_kl = cfg.kl_in_loss and cfg.kl_coef > 0
  weights = None  # none: the loss is built exactly as without a correction
  if cfg.correction is not off_policy.OffPolicyCorrection.NONE:
    weights = off_policy.token_weights(mb[OLD_LOGPROBS], mb[ROLLOUT_LOGPROBS],
                                       loss_mask(mb), cfg.correction, cfg.tis_cap,
                                       cfg.reject_low, cfg.reject_high)
  return losses.actor_loss(
      logp, mb[OLD_LOGPROBS], mb[ADVANTAGES], loss_mask(mb),
      entropy_BxT=ent, entropy_coef=cfg.entropy_coef,  # entropy is always reported
      ref_logprobs_BxT=mb[REF_LOGPROBS] if use_kl else None,
      kl_coef=cfg.kl_coef if use_kl else 0.0, kl_estimator=cfg.kl_estimator,
      k3_cap=cfg.k3_cap,
      agg_mode=cfg.loss_agg, clip_ratio_low=cfg.clip_ratio_low,
      clip_ratio_high=cfg.clip_ratio_high, clip_ratio_c=cfg.dual_clip or None,
      ratio_level=cfg.ratio_level, norm_length=cfg.norm_length, token_weights_BxT=weights,
      loss=cfg.policy_loss, loss_args=cfg.loss_args)


def critic_loss(graphdef: nnx.GraphDef, params: nnx.State, mb: Batch, value_clip: float,
                loss_agg: str = "token-mean") -> losses.LossOutput:
  values = response_values(graphdef, params, mb)
  return losses.value_loss(values, mb[VALUES], mb[RETURNS], loss_mask(mb),
                           clip_range=value_clip or None, agg_mode=loss_agg)


def make_train_step(loss_fn: Callable[[nnx.GraphDef, nnx.State, Batch], losses.LossOutput],
                    graphdef: nnx.GraphDef, tx: optax.GradientTransformation,
                    num_micro_batches: int | None, agg_mode: str, group_size: int = 1
                    ) -> Callable:
  """``step(params, opt_state, batch, rng=None) -> (params, opt_state, stats)``, jitted,
  state donated.

  ``stats`` holds sums (``total``, ``count``, ``token_count``, metric sums) plus
  ``grad_norm`` and ``skipped``; ``losses.finalize`` turns the sums into means.
  ``group_size`` keeps blocks of that many consecutive rows in one micro-batch (see
  "Micro-batches" in train/micro_batches.py); the loss function decides whether it shares
  their prompts.  A batch holding ``pack`` (``[M, ...]``: one plan per micro-batch) runs
  packed (see "Packed rows" in train/hidden.py).  ``num_micro_batches=None``: every batch
  brings a token-budget plan, whose M is used (see "Token-budget micro-batches" in
  train/micro_batches.py; a new M compiles the step once more).  ``rng``: the raw key data
  (``jax.random.key_data``) of this call's adapter dropout, micro-batch ``m`` drawing from
  ``fold_in(key, m)`` (models/lora_layer.py); None: no dropout, and no random op in the step.
  """

  def step(params, opt_state, batch, rng=None):
    # LoRA: only the adapters are differentiated and updated; the base rides along frozen.
    params, frozen = lora.split_trainable(params)
    pack = batch.get("pack")
    batch = {k: v for k, v in batch.items() if k != "pack"}
    mbs = micro_batches.for_step(batch, pack, num_micro_batches, group_size)
    denom = losses.loss_denominator(loss_mask(batch), agg_mode)

    def one(carry, xs):
      grads_acc, out_acc = carry
      mb, m = xs

      def objective(p):
        out = loss_fn(graphdef, lora.merge_trainable(p, frozen), mb)
        return out.total / jnp.maximum(denom, 1.0), out

      with lora_layer.adapter_dropout(micro_key(rng, m)):
        (_, out), grads = jax.value_and_grad(objective, has_aux=True)(params)
      grads_acc = jax.tree.map(lambda a, g: a + g.astype(a.dtype), grads_acc, grads)
      out_acc = out if out_acc is None else jax.tree.map(jnp.add, out_acc, out)
      return (grads_acc, out_acc), None

    # The accumulator is float32 whatever the parameters' dtype: summing M bfloat16
    # micro-batch gradients in bfloat16 rounds the running sum M - 1 times (8 mantissa
    # bits); apply_update casts the sum back where the optimizer wants the parameters'.
    zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, accumulator_dtype(p.dtype)), params)
    first = jax.tree.map(lambda x: x[0], mbs)
    # Trace one micro-batch to get the loss output's structure for the carry.
    out0 = jax.eval_shape(lambda p, b: loss_fn(graphdef, lora.merge_trainable(p, frozen), b),
                          params, first)
    out_init = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), out0)
    index = None if rng is None else jnp.arange(jax.tree.leaves(mbs)[0].shape[0])
    (grads, out), _ = jax.lax.scan(one, (zeros, out_init), (mbs, index))
    params, opt_state, stats = apply_update(tx, params, opt_state, batch, grads, out,
                                            optax.global_norm(grads), group_size)
    return lora.merge_trainable(params, frozen), opt_state, stats

  return placement.PinnedStep(step)


def replicated_key(key: jax.Array, mesh) -> jax.Array:
  """A typed PRNG key's raw data, replicated on ``mesh`` (the same on every process): a
  train step's ``rng`` input."""
  data = np.asarray(jax.random.key_data(key))
  return jax.make_array_from_process_local_data(NamedSharding(mesh, PartitionSpec()), data,
                                                data.shape)


def micro_key(rng: jax.Array | None, index) -> jax.Array | None:
  """The adapter-dropout key of micro-batch (or unit) ``index`` of a step given ``rng`` (raw
  key data; None: no dropout)."""
  if rng is None:
    return None
  return jax.random.fold_in(jax.random.wrap_key_data(rng), index)


def accumulator_dtype(dtype) -> jnp.dtype:
  """The gradient accumulator's dtype for a parameter of ``dtype``: float32 for 16-bit
  floats (float64 stays), the dtype itself otherwise."""
  if jnp.issubdtype(dtype, jnp.floating):
    return jnp.promote_types(dtype, jnp.float32)
  return jnp.dtype(dtype)


def apply_update(tx: optax.GradientTransformation, params, opt_state, batch: Batch, grads,
                 out: losses.LossOutput, grad_norm: jax.Array, group_size: int):
  """The optimizer step on summed gradients of the trainable ``params`` (float32 from
  `make_train_step`: cast to the parameters' dtype unless the optimizer keeps float32
  master weights), kept only if `step_ok` and the rows are grouped; returns
  ``(params, opt_state, stats)``."""
  grouped = hidden_lib.prompts_grouped(batch, group_size) if group_size > 1 else jnp.bool_(True)
  if not isinstance(opt_state, optim.MasterState):
    # A float32 master copy takes the float32 sum as it is; otherwise the optimizer's
    # state is in the parameters' dtype and so must its gradient be.
    grads = jax.tree.map(lambda g, p: g.astype(p.dtype), grads, params)
  updates, new_opt = tx.update(grads, opt_state, params)
  new_params = optax.apply_updates(params, updates)
  ok = step_ok(out.total, grad_norm, new_params, new_opt) & grouped
  keep = lambda new, old: jnp.where(ok, new, old)  # noqa: E731
  new_params = jax.tree.map(keep, new_params, params)
  new_opt = jax.tree.map(keep, new_opt, opt_state)
  stats = {"total": out.total, "count": out.count, "token_count": out.token_count,
           "grad_norm": grad_norm, "skipped": (~ok).astype(jnp.int32),
           "ungrouped": (~grouped).astype(jnp.int32),
           **{f"m/{k}": v for k, v in out.metrics.items()}}
  return new_params, new_opt, stats


def step_ok(total: jax.Array, grad_norm: jax.Array, new_params: Any, new_opt: Any) -> jax.Array:
  """Whether a step may be kept: a finite loss and gradient norm, and finite new
  parameters and optimizer state (a finite gradient times an infinite or huge learning
  rate is not)."""
  ok = jnp.isfinite(total) & jnp.isfinite(grad_norm)
  for leaf in jax.tree.leaves((new_params, new_opt)):
    if jnp.issubdtype(leaf.dtype, jnp.inexact):
      ok = ok & jnp.all(jnp.isfinite(leaf))
  return ok


def finalize_stats(stats: Mapping[str, jax.Array], where: str) -> dict[str, float]:
  """Host-side means of a step's stats; a skipped step is reported, never raised, except
  one refused for an ungrouped batch (a wiring error, not a numerical event)."""
  if int(stats.get("ungrouped", 0)):
    raise ValueError(hidden_lib.UNGROUPED.format(where=where))
  out = losses.LossOutput(stats["total"], stats["count"], stats["token_count"],
                          {k[2:]: v for k, v in stats.items() if k.startswith("m/")})
  skipped = int(stats["skipped"])
  if skipped:
    return {"skipped": 1.0, "grad_norm": float(stats["grad_norm"]),
            "token_count": float(stats["token_count"])}
  result = losses.finalize(out, where)
  result.update(grad_norm=float(stats["grad_norm"]), skipped=0.0)
  return result
