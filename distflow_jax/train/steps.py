"""The actor and critic steps: pure functions, jitted once, with donated state.

A sequence batch is a dict of sample-leading arrays:

* ``prompt_tokens`` ``[B, P]`` left-padded, ``prompt_mask`` ``[B, P]``;
* ``response_tokens`` ``[B, N]`` right-padded, ``response_mask`` ``[B, N]``;
* per response token: ``old_logprobs``, ``ref_logprobs``, ``advantages``,
  ``returns``, ``values`` (``[B, N]`` float32), as a step needs them.

The model sees ``prompt ++ response`` with explicit positions, so left
padding of the prompt costs nothing in correctness.  Response token ``t`` is
predicted by the hidden state at index ``P - 1 + t``.

Shared prompts.  With ``group_size=n > 1`` the rows come in groups of n
consecutive rows (a GRPO group: n samples of one prompt), and each group's
prompt (that of its first row) is run once; its n responses attend to its
keys/values (``Transformer``'s ``prefix``).  That saves ``(n - 1) / n`` of the
prompt's compute, forward and backward, and gives the per-row pass's numbers
when the rows are so grouped.  Callers check that with ``prompts_grouped``
(on device, per batch): the train step refuses an ungrouped batch (no update,
``ungrouped = 1`` in its stats) and the workflow nodes raise.

Micro-batches.  Blocks of ``group_size`` consecutive rows (single rows when
it is 1) are dealt round robin: block ``j`` goes to micro-batch ``j % M``.
With the batch sharded over data-parallel devices in contiguous rows, every
micro-batch then takes rows from every device, so accumulation adds no
communication, and groups stay whole.  The
loss of each micro-batch is its *sum* divided by the whole batch's
denominator, so the accumulated gradient is exactly the full-batch mean's.  The
accumulator is float32 whatever the parameters' dtype (bfloat16 parameters: each
micro-batch's gradient is added to a float32 sum, cast back for an optimizer without
float32 master weights only once, before the update).

Packed rows.  A batch holding ``pack`` (a plan of train/packing.py: ``model.pack_sequences``)
runs its passes padding-free: the samples' real tokens packed into ``[rows, pack_len]``
rows with per-token segment ids, the hidden states gathered back to ``[B, N]`` before
the heads.  The train step takes ``pack`` with a leading micro-batch axis (one plan per
micro-batch, ``packing.plan_parts``).  With shared prompts the plan lays each group's
prompt once and its responses after it, each response seeing the prompt and itself
(train/packing_shared.py): the padded shared pass's numbers, padding-free.

Token-budget micro-batches.  A plan that also holds ``idx`` / ``valid`` ``[M, S]``
(train/token_budget.py: ``<role>.micro_batch_tokens``) names each micro-batch's rows
itself instead of dealing rows round robin: the step gathers them
(``gather_micro_batches``), padding slots' masks off, and M comes from the plan.

A step whose loss, gradient, new parameters or new optimizer state are not all
finite leaves parameters and optimizer state unchanged and reports ``skipped = 1``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from distflow_jax.algos import losses
from distflow_jax.models import heads, sharding
from distflow_jax.models.transformer import forward, positions_from_mask
from distflow_jax.train import image_inputs, optim, packing

Batch = Mapping[str, jax.Array]


def sequence_inputs(batch: Batch) -> tuple[jax.Array, jax.Array, jax.Array]:
  """``(tokens, mask, positions)`` of ``prompt ++ response``, ``[B, P + N]``."""
  tokens = jnp.concatenate([batch["prompt_tokens"], batch["response_tokens"]], axis=1)
  mask = jnp.concatenate([batch["prompt_mask"], batch["response_mask"]], axis=1).astype(bool)
  return tokens.astype(jnp.int32), mask, positions_from_mask(mask)


def _response_hidden_plain(graphdef: nnx.GraphDef, params: nnx.State, batch: Batch
                           ) -> jax.Array:
  tokens, mask, positions = sequence_inputs(batch)
  p = batch["prompt_tokens"].shape[1]
  n = batch["response_tokens"].shape[1]
  hidden, _ = forward(graphdef, params, tokens[:, :-1], positions[:, :-1], mask[:, :-1],
                      return_hidden=True,
                      **image_inputs.sequence_kwargs(graphdef, params, batch, tokens[:, :-1]))
  return hidden[:, p - 1:p - 1 + n]


def _response_hidden_shared(graphdef: nnx.GraphDef, params: nnx.State, batch: Batch,
                            group_size: int) -> jax.Array:
  """`_response_hidden_plain` with each group's prompt (that of its first row) run once."""
  prompt_mask_GxP = batch["prompt_mask"][::group_size].astype(bool)
  prompt_GxP = batch["prompt_tokens"][::group_size].astype(jnp.int32)
  resp_BxN = batch["response_tokens"].astype(jnp.int32)
  resp_mask_BxN = batch["response_mask"].astype(bool)
  hidden_GxPxD, kv = forward(
      graphdef, params, prompt_GxP, positions_from_mask(prompt_mask_GxP), prompt_mask_GxP,
      return_hidden=True, return_kv=True, **image_inputs.sequence_kwargs(
          graphdef, params, image_inputs.group_rows(batch, group_size), prompt_GxP))
  first_BxD = jnp.repeat(hidden_GxPxD[:, -1], group_size, axis=0)  # predicts response token 0
  if resp_BxN.shape[1] == 1:
    return first_BxD[:, None]
  # Response token t sits at position (real prompt length) + t, as `sequence_inputs` gives.
  start_B = jnp.repeat(prompt_mask_GxP.sum(axis=1, dtype=jnp.int32), group_size)
  pos_BxN = start_B[:, None] + jnp.cumsum(resp_mask_BxN, axis=1, dtype=jnp.int32) - 1
  hidden_BxNxD, _ = forward(graphdef, params, resp_BxN[:, :-1], pos_BxN[:, :-1],
                            resp_mask_BxN[:, :-1], prefix=kv, prefix_repeat=group_size,
                            return_hidden=True, **image_inputs.sequence_kwargs(
                                graphdef, params, batch, resp_BxN[:, :-1],
                                start=prompt_GxP.shape[1]))
  return jnp.concatenate([first_BxD[:, None], hidden_BxNxD], axis=1)


UNGROUPED = ("{where}: the batch's rows are not in groups of consecutive rows with one prompt, "
             "which model.share_prompt_prefix=True needs (nothing was updated); keep each "
             "prompt's rollout.n samples together and in order, or set "
             "model.share_prompt_prefix=False")


def prompts_grouped(batch: Batch, group_size: int) -> jax.Array:
  """Scalar bool: each block of `group_size` consecutive rows has one prompt (tokens and mask)."""
  def same(x):
    x = x.reshape(-1, group_size, *x.shape[1:])
    return jnp.all(x == x[:, :1])
  return same(batch["prompt_tokens"]) & same(batch["prompt_mask"])


def _response_hidden_packed(graphdef: nnx.GraphDef, params: nnx.State, batch: Batch
                            ) -> jax.Array:
  """`_response_hidden_plain` over packed rows (see "Packed rows")."""
  pack = batch["pack"]
  tokens, positions, seg = packing.packed_inputs(batch, pack)
  hidden, _ = forward(graphdef, params, tokens, positions, seg > 0, return_hidden=True,
                      segment_ids_BxT=seg)
  return packing.unpack(hidden, pack["out"])


PACK_IMAGES = ("model.pack_sequences=True does not take images yet; set "
               "model.pack_sequences=False for a vision-language run")


def _response_hidden(graphdef: nnx.GraphDef, params: nnx.State, batch: Batch,
                     group_size: int = 1) -> jax.Array:
  """Hidden states predicting each response token, ``[B, N, D]`` (see "Shared prompts")."""
  if "pack" in batch:  # a shared-prompt plan lays each group's prompt once itself
    if image_inputs.has_images(batch):
      raise ValueError(PACK_IMAGES)
    return _response_hidden_packed(graphdef, params, batch)
  if group_size <= 1:
    return _response_hidden_plain(graphdef, params, batch)
  b = batch["prompt_tokens"].shape[0]
  if b % group_size:
    raise ValueError(f"shared prompts: {b} rows are not whole groups of {group_size}")
  return _response_hidden_shared(graphdef, params, batch, group_size)


def response_logprobs(graphdef: nnx.GraphDef, params: nnx.State, batch: Batch, *,
                      chunk_size: int = 512, group_size: int = 1
                      ) -> tuple[jax.Array, jax.Array]:
  """Float32 ``(logp, entropy)`` of every response token, ``[B, N]`` (0 on padding).

  ``group_size``: see "Shared prompts" in the module docstring."""
  hidden = _response_hidden(graphdef, params, batch, group_size)
  model = nnx.merge(graphdef, params)
  logp, ent = heads.token_logprobs_and_entropy(hidden, model.unembed_matrix(),
                                               batch["response_tokens"], chunk_size=chunk_size)
  m = batch["response_mask"].astype(jnp.float32)
  return logp * m, ent * m


def response_values(graphdef: nnx.GraphDef, params: nnx.State, batch: Batch) -> jax.Array:
  """Critic value of the state before each response token, ``[B, N]`` (0 on padding)."""
  if "pack" in batch:
    tokens, positions, seg = packing.packed_inputs(batch, batch["pack"])
    values = heads.critic_values(graphdef, params, tokens, positions, seg > 0, seg)
    return (packing.unpack(values, batch["pack"]["out"])
            * batch["response_mask"].astype(jnp.float32))
  tokens, mask, positions = sequence_inputs(batch)
  p = batch["prompt_tokens"].shape[1]
  n = batch["response_tokens"].shape[1]
  values = heads.critic_values(graphdef, params, tokens[:, :-1], positions[:, :-1],
                               mask[:, :-1])
  return values[:, p - 1:p - 1 + n] * batch["response_mask"].astype(jnp.float32)


def sequence_scores(graphdef: nnx.GraphDef, params: nnx.State, batch: Batch) -> jax.Array:
  """A reward model's scalar score of each ``prompt ++ response``, ``[B]`` float32."""
  tokens, mask, positions = sequence_inputs(batch)
  return heads.reward_scores(graphdef, params, tokens, positions, mask)


@dataclasses.dataclass(frozen=True)
class ActorLoss:
  """The actor objective's settings (the keys of config.actor that the loss reads)."""
  clip_ratio_low: float = 0.2
  clip_ratio_high: float = 0.2
  dual_clip: float = 0.0
  ratio_level: str = "token"
  loss_agg: str = "token-mean"
  entropy_coef: float = 0.0
  kl_coef: float = 0.0
  kl_estimator: str = "k3"
  kl_in_loss: bool = True
  norm_length: float | None = None  # for seq-mean-token-sum-norm (Dr.GRPO)
  group_size: int = 1                # rows per shared prompt (see "Shared prompts")

  @classmethod
  def from_config(cls, actor, max_new_tokens: int | None = None,
                  group_size: int = 1) -> "ActorLoss":
    return cls(clip_ratio_low=actor.clip_ratio_low, clip_ratio_high=actor.clip_ratio_high,
               dual_clip=actor.dual_clip, ratio_level=actor.ratio_level,
               loss_agg=actor.loss_agg, entropy_coef=actor.entropy_coef,
               kl_coef=actor.kl.coef, kl_estimator=actor.kl.estimator,
               kl_in_loss=not actor.kl.in_reward,
               norm_length=float(max_new_tokens) if max_new_tokens else None,
               group_size=group_size)


def actor_loss(graphdef: nnx.GraphDef, params: nnx.State, mb: Batch, cfg: ActorLoss,
               chunk_size: int) -> losses.LossOutput:
  logp, ent = response_logprobs(graphdef, params, mb, chunk_size=chunk_size,
                                group_size=cfg.group_size)
  use_kl = cfg.kl_in_loss and cfg.kl_coef > 0
  return losses.actor_loss(
      logp, mb["old_logprobs"], mb["advantages"], mb["response_mask"],
      entropy_BxT=ent, entropy_coef=cfg.entropy_coef,  # entropy is always reported
      ref_logprobs_BxT=mb["ref_logprobs"] if use_kl else None,
      kl_coef=cfg.kl_coef if use_kl else 0.0, kl_estimator=cfg.kl_estimator,
      agg_mode=cfg.loss_agg, clip_ratio_low=cfg.clip_ratio_low,
      clip_ratio_high=cfg.clip_ratio_high, clip_ratio_c=cfg.dual_clip or None,
      ratio_level=cfg.ratio_level, norm_length=cfg.norm_length)


def critic_loss(graphdef: nnx.GraphDef, params: nnx.State, mb: Batch, value_clip: float,
                loss_agg: str = "token-mean") -> losses.LossOutput:
  values = response_values(graphdef, params, mb)
  return losses.value_loss(values, mb["values"], mb["returns"], mb["response_mask"],
                           clip_range=value_clip or None, agg_mode=loss_agg)


def deal_rows(batch: Batch, m: int, block: int = 1) -> Batch:
  """``[B, ...] -> [M, B/M, ...]``: blocks of `block` consecutive rows dealt round robin
  (block j to part j % M); single rows when B is not a multiple of M * block.  Splits a
  batch into micro-batches here and into mini-batches in the train node."""
  b = jax.tree.leaves(batch)[0].shape[0]
  if b % m:
    raise ValueError(f"batch of {b} rows does not split into {m} equal parts (micro- or "
                     f"mini-batches)")
  if b % (m * block):
    block = 1

  def split(x):
    x = x.reshape(b // (m * block), m, block, *x.shape[1:])
    return jnp.moveaxis(x, 1, 0).reshape(m, b // m, *x.shape[3:])
  return jax.tree.map(split, dict(batch))


SLOT_KEYS = ("idx", "valid")  # a token-budget plan's slots (train/token_budget.py)


def gather_micro_batches(batch: Batch, pack: Mapping[str, jax.Array]) -> Batch:
  """``[B, ...] -> [M, S, ...]``: the rows each micro-batch's slots name (``pack["idx"]``),
  with the prompt and response masks off on padding slots (``pack["valid"]``), so a
  padding slot adds nothing to a loss sum, a count or a gradient."""
  idx_MxS, valid_MxS = pack["idx"], pack["valid"].astype(bool)
  mbs = {k: v[idx_MxS] for k, v in batch.items()}
  for k in ("prompt_mask", "response_mask"):
    x = mbs[k]
    mbs[k] = jnp.where(valid_MxS[..., None], x, jnp.zeros_like(x))
  return mbs


def _micro_batches(batch: Batch, pack, num_micro_batches: int | None, group_size: int
                   ) -> Batch:
  """The step's ``[M, ...]`` micro-batches (plan included): dealt rows, or a token-budget
  plan's slots (see "Token-budget micro-batches")."""
  if pack is not None and "idx" in pack:
    rows = {k: v for k, v in pack.items() if k not in SLOT_KEYS}
    return {**gather_micro_batches(batch, pack), "pack": rows}
  if num_micro_batches is None:
    raise ValueError("train step: num_micro_batches=None needs a token-budget plan "
                     "(pack with 'idx'; train/token_budget.py)")
  b = jax.tree.leaves(batch)[0].shape[0]
  if group_size > 1 and b % (num_micro_batches * group_size):
    raise ValueError(f"train step: {b} rows do not split into {num_micro_batches} "
                     f"micro-batches of whole groups of {group_size}")
  mbs = deal_rows(batch, num_micro_batches, group_size)
  if pack is not None:
    if jax.tree.leaves(pack)[0].shape[0] != num_micro_batches:
      raise ValueError(f"train step: the packing plan has {jax.tree.leaves(pack)[0].shape[0]} "
                       f"micro-batches, the step {num_micro_batches}")
    mbs = {**mbs, "pack": pack}
  return mbs


def make_train_step(loss_fn: Callable[[nnx.GraphDef, nnx.State, Batch], losses.LossOutput],
                    graphdef: nnx.GraphDef, tx: optax.GradientTransformation,
                    num_micro_batches: int | None, agg_mode: str, group_size: int = 1
                    ) -> Callable:
  """``step(params, opt_state, batch) -> (params, opt_state, stats)``, jitted, state donated.

  ``stats`` holds sums (``total``, ``count``, ``token_count``, metric sums) plus
  ``grad_norm`` and ``skipped``; ``losses.finalize`` turns the sums into means.
  ``group_size`` keeps blocks of that many consecutive rows in one micro-batch (see
  "Micro-batches"); the loss function decides whether it shares their prompts.  A batch
  holding ``pack`` (``[M, ...]``: one plan per micro-batch) runs packed (see "Packed rows").
  ``num_micro_batches=None``: every batch brings a token-budget plan, whose M is used (see
  "Token-budget micro-batches"; a new M compiles the step once more).
  """

  def step(params, opt_state, batch):
    pack = batch.get("pack")
    batch = {k: v for k, v in batch.items() if k != "pack"}
    mbs = _micro_batches(batch, pack, num_micro_batches, group_size)
    denom = losses.loss_denominator(batch["response_mask"], agg_mode)

    def one(carry, mb):
      grads_acc, out_acc = carry

      def objective(p):
        out = loss_fn(graphdef, p, mb)
        return out.total / jnp.maximum(denom, 1.0), out

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
    out0 = jax.eval_shape(lambda p, b: loss_fn(graphdef, p, b), params, first)
    out_init = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), out0)
    (grads, out), _ = jax.lax.scan(one, (zeros, out_init), mbs)
    return apply_update(tx, params, opt_state, batch, grads, out, optax.global_norm(grads),
                        group_size)

  return PinnedStep(step)


def accumulator_dtype(dtype) -> jnp.dtype:
  """The gradient accumulator's dtype for a parameter of ``dtype``: float32 for 16-bit
  floats (float64 stays), the dtype itself otherwise."""
  if jnp.issubdtype(dtype, jnp.floating):
    return jnp.promote_types(dtype, jnp.float32)
  return jnp.dtype(dtype)


def apply_update(tx: optax.GradientTransformation, params, opt_state, batch: Batch, grads,
                 out: losses.LossOutput, grad_norm: jax.Array, group_size: int):
  """The optimizer step on summed gradients (float32 from `make_train_step`: cast to the
  parameters' dtype unless the optimizer keeps float32 master weights), kept only if
  `step_ok` and the rows are grouped; returns ``(params, opt_state, stats)``."""
  grouped = prompts_grouped(batch, group_size) if group_size > 1 else jnp.bool_(True)
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


def params_mesh(params: Any):
  """The mesh of the first NamedSharding-placed leaf of ``params`` (None if none)."""
  return next((x.sharding.mesh for x in jax.tree.leaves(params)
               if isinstance(x.sharding, NamedSharding)), None)


def _on_mesh(x: jax.Array, mesh) -> NamedSharding:
  if isinstance(x.sharding, NamedSharding):
    return x.sharding
  return NamedSharding(mesh, P())


def init_opt_state(tx: optax.GradientTransformation, params: nnx.State) -> Any:
  """``tx.init(params)`` with every leaf on the parameters' mesh (scalars replicated),
  so the state's layout never changes between steps."""
  mesh = params_mesh(params)
  state = tx.init(params)
  if mesh is None:
    return state
  return jax.tree.map(lambda x: jax.device_put(x, _on_mesh(x, mesh)), state)


def rows_sharded_on(fn: Callable, mesh) -> Callable:
  """``fn`` traced with its activations' rows split over ``mesh``'s data and fsdp axes
  (``sharding.rows_sharded``): FSDP keeps each device's own rows only.

  ``fn``'s last argument is the batch (a dict of row-leading arrays, plus an optional
  packing plan under ``pack``): its rows are re-stated on ``mesh`` at entry.  The batch
  arrives in its data layout's mesh (``data`` x ``tensor``), the parameters in the
  role's (``data`` x ``fsdp`` x ``tensor``) over the same devices; values mixing both
  would reach cuDNN's attention, whose partitioner refuses two meshes in one program."""

  def traced(*args):
    with sharding.rows_sharded(mesh):
      if args and isinstance(args[-1], Mapping):
        batch = {k: v if k == "pack" else jax.tree.map(sharding.constrain_rows, v)
                 for k, v in args[-1].items()}
        args = (*args[:-1], batch)
      return fn(*args)
  # Named after fn: compile logs and `plan --lower` show what the program is.
  traced.__name__ = getattr(fn, "__name__", traced.__name__)
  return traced


class PinnedStep:
  """Jits ``step`` on first use with outputs pinned to the inputs' shardings.

  Left to sharding propagation, the updated state can come back laid out
  differently from how it went in, and the next call would then compile again.
  """

  def __init__(self, step: Callable):
    self._step = step
    self._jitted = None

  def jitted_for(self, params, opt_state):
    """The jitted step for state laid out like ``params`` / ``opt_state`` (arrays or
    ``ShapeDtypeStruct``s with shardings: ``plan --memory`` lowers this same object)."""
    mesh = params_mesh(params)
    if mesh is None:  # unsharded parameters: nothing to pin
      return jax.jit(self._step, donate_argnums=(0, 1))
    sh = lambda tree: jax.tree.map(lambda x: _on_mesh(x, mesh), tree)  # noqa: E731
    return jax.jit(rows_sharded_on(self._step, mesh), donate_argnums=(0, 1),
                   out_shardings=(sh(params), sh(opt_state), None))

  def _get(self, params, opt_state):
    if self._jitted is None:
      self._jitted = self.jitted_for(params, opt_state)
    return self._jitted

  def __call__(self, params, opt_state, batch):
    return self._get(params, opt_state)(params, opt_state, batch)

  def lower(self, params, opt_state, batch):
    """The step lowered for these (possibly abstract) arguments, by the same jitted
    function the calls use: compiling it fills their cache (state/warm_shapes.py)."""
    return self._get(params, opt_state).lower(params, opt_state, batch)

  def _cache_size(self) -> int:
    return 0 if self._jitted is None else self._jitted._cache_size()


def finalize_stats(stats: Mapping[str, jax.Array], where: str) -> dict[str, float]:
  """Host-side means of a step's stats; a skipped step is reported, never raised, except
  one refused for an ungrouped batch (a wiring error, not a numerical event)."""
  if int(stats.get("ungrouped", 0)):
    raise ValueError(UNGROUPED.format(where=where))
  out = losses.LossOutput(stats["total"], stats["count"], stats["token_count"],
                          {k[2:]: v for k, v in stats.items() if k.startswith("m/")})
  skipped = int(stats["skipped"])
  if skipped:
    return {"skipped": 1.0, "grad_norm": float(stats["grad_norm"]),
            "token_count": float(stats["token_count"])}
  result = losses.finalize(out, where)
  result.update(grad_norm=float(stats["grad_norm"]), skipped=0.0)
  return result
