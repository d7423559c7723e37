"""Mixture-of-experts feed-forward (Qwen3-MoE): a router, top-k experts, dropless dispatch.

    spec = MoeSpec(num_experts=8, top_k=2, intermediate_size=64)
    cfg = ModelConfig(arch="qwen3_moe", ..., moe=spec)   # its sparse layers get a `MoE`

Each token's router logits (``mlp/gate``, ``[D, E]``) go through a float32 softmax; the
token takes its ``top_k`` most probable experts, weighted by their probabilities
(renormalised to sum to 1 when ``norm_topk_prob``), as transformers' Qwen3-MoE does.
Dispatch is dropless, with no capacity factor: the ``N x top_k`` (token, expert)
assignments are sorted by expert and each expert's rows run through its own SwiGLU --
with ``jax.lax.ragged_dot`` (a grouped matmul over the contiguous groups) on GPU and TPU,
or on a CPU in blocks padded per expert (``experts_ffn``'s ``impl``) -- then the outputs
are put back in token order and summed with the routing weights.  Every assignment is
computed, whatever the experts' load.

Parameters (HF names in hf_names): ``mlp/gate/kernel`` ``[D, E]`` (``mlp.gate.weight``)
and ``mlp/experts/{gate,up}_proj`` ``[E, D, I]``, ``mlp/experts/down_proj`` ``[E, I, D]``,
each expert's slice stored as ``mlp.experts.{e}.{gate,up,down}_proj.weight``.

Which layers are sparse: ``MoeSpec.sparse(i)`` -- not in ``mlp_only_layers`` and
``(i + 1) % sparse_step == 0`` (HF's ``mlp_only_layers`` / ``decoder_sparse_step``);
the others keep the dense MLP of ``ModelConfig.intermediate_size``.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from jax.sharding import PartitionSpec as P

from distflow_jax.models import sharding, target as target_lib


@dataclasses.dataclass(frozen=True)
class MoeSpec:
  """The experts of a Qwen3-MoE model (its config.json's names in ``ModelConfig``)."""
  num_experts: int
  top_k: int
  intermediate_size: int
  norm_topk_prob: bool = True
  sparse_step: int = 1
  mlp_only_layers: tuple[int, ...] = ()
  # Kept for the config.json round trip; the training's own coefficient is a train option.
  router_aux_loss_coef: float = 0.001

  def __post_init__(self):
    for name in ("num_experts", "top_k", "intermediate_size", "sparse_step"):
      value = getattr(self, name)
      if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"MoE: {name}={value!r} must be a positive int")
    if self.top_k > self.num_experts:
      raise ValueError(f"MoE: num_experts_per_tok={self.top_k} is above num_experts="
                       f"{self.num_experts}: a token cannot take more experts than there are")
    layers = tuple(self.mlp_only_layers)
    if any(isinstance(i, bool) or not isinstance(i, int) or i < 0 for i in layers):
      raise ValueError(f"MoE: mlp_only_layers={list(layers)} must be layer indices >= 0")
    object.__setattr__(self, "mlp_only_layers", layers)

  def sparse(self, layer: int) -> bool:
    """Whether layer ``layer`` (0-based) has experts, as transformers decides it."""
    return layer not in self.mlp_only_layers and (layer + 1) % self.sparse_step == 0

  def num_params(self, hidden_size: int) -> int:
    """A sparse layer's feed-forward parameters: the router and every expert."""
    return hidden_size * self.num_experts * (1 + 3 * self.intermediate_size)


def route(h_NxD: jax.Array, router_DxE: jax.Array, spec: MoeSpec
          ) -> tuple[jax.Array, jax.Array, jax.Array]:
  """``(weights_NxK in h's dtype, experts_NxK int32, router logits_NxE)``: each token's
  ``top_k`` experts by float32 softmax probability, weights renormalised where
  ``spec.norm_topk_prob``."""
  logits_NxE = h_NxD @ router_DxE
  probs = jax.nn.softmax(logits_NxE.astype(jnp.float32), axis=-1)
  weights, experts = jax.lax.top_k(probs, spec.top_k)
  if spec.norm_topk_prob:
    weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
  return weights.astype(h_NxD.dtype), experts.astype(jnp.int32), logits_NxE


def experts_ffn(h_NxD: jax.Array, weights_NxK: jax.Array, experts_NxK: jax.Array,
                gate_ExDxI: jax.Array, up_ExDxI: jax.Array, down_ExIxD: jax.Array,
                impl: str = "auto") -> jax.Array:
  """``sum_k weights[n, k] * SwiGLU_{experts[n, k]}(h[n])``, ``[N, D]``, every assignment
  computed (dropless).  ``impl``: ``ragged_dot`` (one grouped matmul per projection over
  the experts' contiguous rows: a kernel on GPU and TPU, but XLA:CPU runs it as every
  expert on every row, masked), ``blocked`` (each expert's rows padded to whole blocks, a
  loop over the blocks: about the routed FLOPs on any device) or ``auto``
  (blocked on a CPU target, else ragged_dot).  The same sums either way."""
  impl = resolve_impl(impl)
  n, k = experts_NxK.shape
  flat = experts_NxK.reshape(-1)
  order = jnp.argsort(flat, stable=True)                       # sorted slot -> assignment
  y = IMPLS[impl](h_NxD, flat, order, k, gate_ExDxI, up_ExDxI, down_ExIxD)
  y_NxKxD = y.reshape(n, k, -1)                                # back in assignment order
  return jnp.einsum("nkd,nk->nd", y_NxKxD, weights_NxK.astype(y.dtype))


def resolve_impl(impl: str) -> str:
  """``auto``: ``blocked`` on a CPU target (the one being lowered for, else jax's), else
  ``ragged_dot``."""
  if impl == "auto":
    impl = "blocked" if target_lib.current().platform is target_lib.Platform.CPU else "ragged_dot"
  if impl not in IMPLS:
    raise ValueError(f"moe: impl={impl!r} is unknown; valid: auto, {', '.join(IMPLS)}")
  return impl


def _unsort(order: jax.Array) -> jax.Array:
  """The inverse permutation of ``order``: assignment -> its sorted slot."""
  return jnp.zeros_like(order).at[order].set(jnp.arange(order.shape[0], dtype=order.dtype))


def _ragged(h, flat, order, k, gate, up, down):
  """Each assignment's expert output, ``[N * K, D]`` in assignment order (ragged_dot)."""
  sizes = jnp.bincount(flat, length=gate.shape[0]).astype(jnp.int32)
  x = h[order // k]                                            # the token of each slot
  g = jax.lax.ragged_dot(x, gate, sizes)
  y = jax.lax.ragged_dot(jax.nn.silu(g) * jax.lax.ragged_dot(x, up, sizes), down, sizes)
  return y[_unsort(order)]


def block_rows(assignments: int, num_experts: int) -> int:
  """The block size of the ``blocked`` dispatch: a power of two near an expert's even
  share of the assignments, 8 to 128 (the padding is at most one block per expert)."""
  share = max(1, assignments // num_experts)
  return int(min(128, max(8, 1 << (share.bit_length() - 1))))


def _blocked(h, flat, order, k, gate, up, down):
  """Each assignment's expert output, ``[N * K, D]`` in assignment order: expert e's
  sorted rows padded to a whole number of ``block_rows`` blocks, each block multiplied by
  its own expert's weights (a loop over the blocks), padding rows zero and dropped."""
  m, num_experts = flat.shape[0], gate.shape[0]
  b = block_rows(m, num_experts)
  blocks = -(-(m + num_experts * (b - 1)) // b)                # static: the most it can need
  sizes = jnp.bincount(flat, length=num_experts).astype(jnp.int32)
  padded = -(-sizes // b) * b
  start_p = jnp.cumsum(padded) - padded                        # each expert's first padded row
  start = jnp.cumsum(sizes) - sizes
  e_sorted = flat[order]
  dest = start_p[e_sorted] + jnp.arange(m, dtype=jnp.int32) - start[e_sorted]
  token = jnp.full((blocks * b,), h.shape[0], jnp.int32).at[dest].set(order // k)
  x = jnp.concatenate([h, jnp.zeros((1, h.shape[1]), h.dtype)])[token]
  x = x.reshape(blocks, b, -1)
  # The expert of each block: the one whose padded range holds its first row (blocks past
  # the last expert's take it too, over zero rows).
  block_expert = jnp.minimum(jnp.searchsorted(jnp.cumsum(padded), jnp.arange(blocks) * b,
                                              side="right"), num_experts - 1)

  # One block at a time, its expert's weights sliced in the loop: no per-block copy of the
  # weights is held (saving only the matmuls' outputs for the backward pass, whose
  # weight gradients accumulate into one [E, ...] buffer).
  def one(_, xs):
    x_bxD, e = xs
    g, u = x_bxD @ gate[e], x_bxD @ up[e]
    return None, (jax.nn.silu(g) * u) @ down[e]

  body = jax.checkpoint(one, policy=jax.checkpoint_policies.dots_with_no_batch_dims_saveable)
  _, y = jax.lax.scan(body, None, (x, block_expert))
  return y.reshape(blocks * b, -1)[dest[_unsort(order)]]


IMPLS = {"ragged_dot": _ragged, "blocked": _blocked}


class Experts(nnx.Module):
  """Every expert's SwiGLU weights, stacked on a leading expert axis."""

  def __init__(self, num_experts: int, d: int, f: int, dtype, init, rngs: nnx.Rngs):
    self.gate_proj = nnx.Param(init(rngs.params(), (num_experts, d, f), dtype))
    self.up_proj = nnx.Param(init(rngs.params(), (num_experts, d, f), dtype))
    self.down_proj = nnx.Param(init(rngs.params(), (num_experts, f, d), dtype))


class MoE(nnx.Module):
  """A sparse layer's feed-forward: the router (``gate``) and the experts."""

  def __init__(self, spec: MoeSpec, d: int, dtype, init, rngs: nnx.Rngs):
    self.spec = spec
    self.gate = nnx.Linear(d, spec.num_experts, use_bias=False, dtype=dtype,
                           param_dtype=dtype, kernel_init=init, rngs=rngs)
    self.experts = Experts(spec.num_experts, d, spec.intermediate_size, dtype, init, rngs)

  def __call__(self, x_BxTxD: jax.Array) -> jax.Array:
    """Which tokens dispatch together: one token a row (a decode step) the whole batch;
    else, blocked, each row's tokens among themselves (so a row's result does not depend
    on the layout), and with ragged_dot each device's rows where the rows are split over
    devices (``sharding.rows_sharded``: a ``shard_map``), else the whole call's.  Never a
    sort across devices, which would gather every row onto every device."""
    b, t, d = x_BxTxD.shape
    impl = resolve_impl("auto")
    weights = (self.gate.kernel[...], self.experts.gate_proj[...], self.experts.up_proj[...],
               self.experts.down_proj[...])

    def ffn(h_NxD, router, gate, up, down):
      w, experts, _ = route(h_NxD, router, self.spec)
      return experts_ffn(h_NxD, w, experts, gate, up, down, impl)

    def flat(x, *ws):
      return ffn(x.reshape(-1, d), *ws).reshape(x.shape)
    rows = sharding.row_sharding()
    if t == 1:
      y = flat(x_BxTxD, *weights)
    elif impl == "blocked":
      y = jax.vmap(ffn, in_axes=(0, None, None, None, None))(x_BxTxD, *weights)
    elif rows is not None and b % sharding.shard_count(rows) == 0:
      y = jax.shard_map(flat, mesh=rows.mesh, in_specs=(rows.spec,) + (P(),) * 4,
                        out_specs=rows.spec, check_vma=False)(x_BxTxD, *weights)
    else:
      y = flat(x_BxTxD, *weights)
    return y.astype(x_BxTxD.dtype)
