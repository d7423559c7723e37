"""Token sampling: greedy, temperature, top-k, top-p; per-request PRNG streams.

The logprob returned for a sampled token is always its log-probability under
the model's *untruncated, temperature-1* softmax, i.e. exactly what a
teacher-forced forward pass over the same tokens gives.  RL losses compare the
training policy against it, so it must not depend on the sampling knobs.  The
log-probability under the (tempered, truncated) distribution actually sampled
from is returned too, for importance corrections that need it.

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
    sorted_BxV = jnp.flip(jnp.sort(x, axis=-1), axis=-1)
    probs_BxV = jax.nn.softmax(sorted_BxV, axis=-1)
    mass_before_BxV = jnp.cumsum(probs_BxV, axis=-1) - probs_BxV
    keep_BxV = mass_before_BxV < sp.top_p
    # The smallest logit still kept; the first token is always kept.
    cut_Bx1 = jnp.min(jnp.where(keep_BxV, sorted_BxV, jnp.inf), axis=-1, keepdims=True)
    x = jnp.where(x >= cut_Bx1, x, _NEG_INF)
  return x


def request_keys(base_key: jax.Array, request_ids_B: jax.Array) -> jax.Array:
  """Raw uint32 key data `[B, 2]` of each request's PRNG stream."""
  keys = jax.vmap(lambda i: jax.random.fold_in(base_key, i))(request_ids_B.astype(jnp.uint32))
  return keys if keys.dtype == jnp.uint32 else jax.random.key_data(keys)


def sample(logits_BxV: jax.Array, keys_Bx2: jax.Array, steps_B: jax.Array,
           sp: SamplingParams) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Picks one token per row.

  `keys_Bx2` are per-request raw keys (`request_keys`), `steps_B` the index of
  the token being drawn in its request (the PRNG stream position).  Returns
  `(tokens_B int32, logprob_B, sampling_logprob_B)`: the model's untruncated
  temperature-1 log-prob of the token, and its log-prob under the tempered,
  truncated distribution it was drawn from (0 for greedy).
  """
  logits32 = logits_BxV.astype(jnp.float32)
  logp_BxV = jax.nn.log_softmax(logits32, axis=-1)
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
