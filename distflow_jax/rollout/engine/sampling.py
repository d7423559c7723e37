"""Token sampling: greedy, temperature, top-k, top-p; per-request PRNG streams.

The logprob returned for a sampled token is its log-probability under the model's
*untruncated* softmax at the sampling temperature, softmax(logits / T) (T = 1 for greedy):
exactly what the training passes compute over the same tokens, since they read the policy
at the rollout's temperature (config/temperature.py).  So the rollout's log-probs stand in
for the old ones at any temperature, and they do not depend on top-k / top-p.  The
log-probability under the truncated distribution actually sampled from is returned too,
for importance corrections that need it.

Randomness is per request, not per batch: token t of a request is drawn with
`fold_in(request_key, t)`.  A request therefore samples the same tokens
whatever slot it lands in and whatever else is decoding beside it, so
continuous batching never changes results, sampled or greedy.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

_NEG_INF = -jnp.inf


@dataclasses.dataclass(frozen=True)
class SamplingParams:
  """How to pick the next token.  Hashable: it is a static argument of the decode loop.

  temperature 0 means greedy (argmax); top_k 0 and top_p 1 mean off.
  """
  temperature: float = 1.0
  top_p: float = 1.0
  top_k: int = 0

  def __post_init__(self):
    if not self.temperature >= 0:
      raise ValueError(f"SamplingParams.temperature={self.temperature} must be >= 0 (0 = greedy)")
    if not 0 < self.top_p <= 1:
      raise ValueError(f"SamplingParams.top_p={self.top_p} must be in (0, 1] (1 = off)")
    if not isinstance(self.top_k, int) or self.top_k < 0:
      raise ValueError(f"SamplingParams.top_k={self.top_k!r} must be an int >= 0 (0 = off)")

  @property
  def greedy(self) -> bool:
    return self.temperature == 0


def logprob_temperature(sp: SamplingParams) -> float:
  """The temperature of the recorded log-probs: the sampling one, 1 for greedy (what the
  training passes read, ``config.response.pass_temperature``)."""
  return 1.0 if sp.greedy else float(sp.temperature)


def sampling_logits(logits_BxV: jax.Array, sp: SamplingParams) -> jax.Array:
  """Tempered logits with everything outside top-k / top-p set to -inf (float32).

  Top-p keeps the smallest prefix of tokens, by descending probability, whose
  mass reaches `top_p` (the token that crosses the threshold is kept).  Ties at
  the cut-off logit are all kept.
  """
  x = logits_BxV.astype(jnp.float32)
  if sp.greedy:
    return x
  x = x / sp.temperature
  v = x.shape[-1]
  if sp.top_k and sp.top_k < v:
    kth_Bx1 = jax.lax.top_k(x, sp.top_k)[0][:, -1:]
    x = jnp.where(x >= kth_Bx1, x, _NEG_INF)
  if sp.top_p < 1.0:
    x = jnp.where(_order_keys(x) >= top_p_cut(x, sp.top_p), x, _NEG_INF)
  return x


def _order_keys(x: jax.Array) -> jax.Array:
  """int32 keys in the order of the float32 values ``x`` (-0 taken as +0; no NaN)."""
  i = jax.lax.bitcast_convert_type(jnp.where(x == 0, 0.0, x), jnp.int32)  # x: float32
  return jnp.where(i < 0, i ^ jnp.int32(0x7FFFFFFF), i)


def top_p_cut(x_BxV: jax.Array, top_p: float) -> jax.Array:
  """The order key (`_order_keys`) of the smallest logit top-p keeps, ``[B, 1]``.

  A token is kept when the probability mass of the tokens strictly above it is below
  `top_p`: the smallest descending prefix that reaches `top_p`, ties at the cut all kept.
  That mass falls as the cut rises, so the cut is found by bisection over the 2^32 order
  keys: 32 masked sums over the vocabulary, where a sort would take O(V log^2 V) passes on
  an accelerator.  It is the sort's cut but where a token's mass above lies
  within float32 rounding of `top_p` (summed in another order)."""
  probs_BxV = jax.nn.softmax(x_BxV, axis=-1)
  keys_BxV = _order_keys(x_BxV)

  def above(t_Bx1):  # the mass strictly above each row's key t
    return jnp.sum(jnp.where(keys_BxV > t_Bx1, probs_BxV, 0.0), axis=-1, keepdims=True)

  def halve(_, lo_hi):
    lo, hi = lo_hi  # above(hi) < top_p; above(lo) >= top_p unless lo is below every key
    mid = (lo >> 1) + (hi >> 1) + (lo & hi & 1)  # floor((lo + hi) / 2) without overflow
    below = above(mid) < top_p
    return jnp.where(below, lo, mid), jnp.where(below, mid, hi)

  lo = jnp.min(keys_BxV, axis=-1, keepdims=True) - 1
  hi = jnp.max(keys_BxV, axis=-1, keepdims=True)
  return jax.lax.fori_loop(0, 32, halve, (lo, hi))[1]


def request_keys(base_key: jax.Array, request_ids_B: jax.Array) -> jax.Array:
  """Raw uint32 key data `[B, 2]` of each request's PRNG stream."""
  keys = jax.vmap(lambda i: jax.random.fold_in(base_key, i))(request_ids_B.astype(jnp.uint32))
  return keys if keys.dtype == jnp.uint32 else jax.random.key_data(keys)


def sample(logits_BxV: jax.Array, keys_Bx2: jax.Array, steps_B: jax.Array,
           sp: SamplingParams) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Picks one token per row.

  `keys_Bx2` are per-request raw keys (`request_keys`), `steps_B` the index of
  the token being drawn in its request (the PRNG stream position).  Returns
  `(tokens_B int32, logprob_B, sampling_logprob_B)`: the token's untruncated log-prob at
  the sampling temperature (`logprob_temperature`), and its log-prob under the tempered,
  truncated distribution it was drawn from (0 for greedy).
  """
  logits32 = logits_BxV.astype(jnp.float32)
  t = logprob_temperature(sp)
  logp_BxV = jax.nn.log_softmax(logits32 if t == 1.0 else logits32 / t, axis=-1)
  if sp.greedy:
    tokens_B = jnp.argmax(logits32, axis=-1).astype(jnp.int32)
    samp_lp_B = jnp.zeros(tokens_B.shape, jnp.float32)
  else:
    x_BxV = sampling_logits(logits32, sp)

    def gumbel(key_data, step):
      key = jax.random.fold_in(jax.random.wrap_key_data(key_data), step)
      return jax.random.gumbel(key, x_BxV.shape[-1:], jnp.float32)

    g_BxV = jax.vmap(gumbel)(keys_Bx2, steps_B.astype(jnp.uint32))
    # Gumbel-max: argmax(x + g) is a draw from softmax(x); -inf stays excluded.
    tokens_B = jnp.argmax(x_BxV + g_BxV, axis=-1).astype(jnp.int32)
    samp_lp_B = jnp.take_along_axis(jax.nn.log_softmax(x_BxV, axis=-1),
                                    tokens_B[:, None], axis=-1)[:, 0]
  lp_B = jnp.take_along_axis(logp_BxV, tokens_B[:, None], axis=-1)[:, 0]
  return tokens_B, lp_B, samp_lp_B
