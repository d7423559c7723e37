"""A reference sampler: one full forward pass over the whole sequence per token, no KV cache.

    sampler = ReferenceSampler(model_cfg, EngineConfig(max_new_tokens=8, stop_ids=(eos,)))
    out = sampler.generate(sampler.load_params(model), prompts, n=2, rng=key, request_ids=ids)

It is the `reference` rollout backend (`backend`) and, mainly, the tests'
oracle for the engine: nothing of the engine's machinery is reused (no
prefill buckets, slots, cache or insert), only what
defines the result:

* the next token of a request is drawn from the logits after its last
  token, by `sampling.sample` with the engine's `SamplingParams`;
* request r draws token t with `fold_in(fold_in(rng, request_ids[r]), t)`
  (`driver.prepare_requests` derives the request keys for both backends);
* a request ends on a stop id or a stop sequence (kept) or after `max_new_tokens`
  tokens.

So greedy tokens and every log-prob match the engine up to float rounding,
and sampled tokens match exactly unless rounding moves a Gumbel-max argmax
(a near tie, which random weights make very unlikely).  It costs
O(length^2) per token and compiles once per batch size: tests only.

All requests advance in lock step as one batch `[R, T]`, T = the longest
prompt plus the response budget (rounded up to a multiple of 8 to bound
compiles); a finished request's row keeps running, and its outputs are
ignored.
"""

from __future__ import annotations

import functools
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from distflow_jax.models import sharding as msharding
from distflow_jax.models.config import ModelConfig
from distflow_jax.models.transformer import Transformer, forward
from distflow_jax.rollout import driver, weight_sync
from distflow_jax.rollout.engine import programs as engine_programs
from distflow_jax.rollout.images import PromptImages
from distflow_jax.rollout.engine.config import EngineConfig, place_params, replica_mesh
from distflow_jax.rollout.engine.sampling import SamplingParams, sample
from distflow_jax.train import image_inputs


def next_token(graphdef: nnx.GraphDef, params: nnx.State, tokens_RxT: jax.Array,
               lengths_R: jax.Array, keys_Rx2: jax.Array, step: jax.Array, images=None, *,
               sp: SamplingParams) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Token `step` of every request: a causal forward over whole rows, sampled after each
  row's last real token (`lengths_R - 1`); what follows it in the row cannot matter.
  `images`: `PromptImages.rows`' `(feats, slots, rope)`, merged as the passes do."""
  r, t = tokens_RxT.shape
  model = nnx.merge(graphdef, params)
  kwargs = {}
  if images is not None:
    feats_RxIxD, slots_RxT, rope_Rx3xT = images
    kwargs = {"inputs_embeds_BxTxD": image_inputs.merge_row_features(
                  model.embed(tokens_RxT), slots_RxT, feats_RxIxD),
              "rope_positions_3xBxT": jnp.moveaxis(rope_Rx3xT, 1, 0)}
  hidden_RxTxD, _ = forward(graphdef, params, tokens_RxT,
                            jnp.broadcast_to(jnp.arange(t)[None], (r, t)), return_hidden=True,
                            **kwargs)
  last_RxD = jnp.take_along_axis(hidden_RxTxD, (lengths_R - 1)[:, None, None], axis=1)[:, 0]
  logits_RxV = jnp.einsum("rd,dv->rv", last_RxD, model.unembed_matrix(),
                          preferred_element_type=jnp.float32)
  return sample(logits_RxV, keys_Rx2, jnp.full((r,), step, jnp.int32), sp)


class ReferenceSampler:
  """The `reference` rollout backend (see module doc); same settings as the engine's."""

  name = "reference"

  def __init__(self, model_cfg: ModelConfig, config: EngineConfig, mesh: Mesh | None = None,
               rules: msharding.Rules | None = None):
    self.model_cfg = model_cfg
    self.config = config
    self.mesh = mesh if mesh is not None else replica_mesh()
    self.rules = rules if rules is not None else msharding.fsdp_tp_rules()
    abstract = nnx.eval_shape(lambda: Transformer(model_cfg, rngs=nnx.Rngs(0)))
    graphdef, self._abstract_params = nnx.split(abstract)
    self.param_shardings = msharding.state_shardings(self._abstract_params, self.mesh,
                                                     self.rules)
    rep = NamedSharding(self.mesh, P())
    self._next = jax.jit(functools.partial(next_token, graphdef, sp=config.sampling),
                         out_shardings=(rep, rep, rep))
    self._sync: weight_sync.WeightSync | None = None

  @property
  def sync_bytes(self) -> int:
    return self._sync.bytes_moved if self._sync is not None else 0

  def load_params(self, params: nnx.State | nnx.Module | None = None) -> nnx.State:
    """Places `params` (a model or its state) on this replica; random init when None."""
    return place_params(self.model_cfg, params, self.mesh, self.rules, self.param_shardings,
                        self.config.seed)

  def update_weights(self, train_params: nnx.State) -> nnx.State:
    """The actor's parameters, in any training layout, resharded onto this replica."""
    if self._sync is None:
      self._sync = weight_sync.WeightSync(self.param_shardings)
    return self._sync(train_params)

  def sync_programs(self, train_params: Any, process_of=None) -> list:
    """The weight sync's steps for (abstract, sharded) ``train_params`` (plan --lower)."""
    return engine_programs.sync_programs(train_params, self.param_shardings,
                                         process_of=process_of)

  def generate(self, params: Any, prompts: Sequence[Sequence[int]], n: int = 1, *,
               rng: jax.Array | None = None, request_ids: Sequence[int] | None = None,
               pad_id: int = 0, max_new_tokens: int | None = None,
               images: PromptImages | None = None) -> driver.Rollout:
    """`n` responses per prompt, as `driver.generate` defines them (see module doc);
    `images`: the prompts' vision features and positions (rollout/images.py)."""
    req = driver.prepare_requests(self.config, prompts, n, max_new_tokens=max_new_tokens,
                                  rng=rng, request_ids=request_ids)
    num, n_max = len(req.prompts) * n, req.max_new_tokens
    if num == 0:
      return driver.assemble([], [], [], n, n_max, self.config.ends_on_stop, pad_id)
    rows = [req.prompts[r // n] for r in range(num)]
    width = -(-(max(map(len, rows)) + n_max) // 8) * 8
    tokens = np.zeros((num, width), np.int32)
    lengths = np.array([len(p) for p in rows], np.int32)
    for r, p in enumerate(rows):
      tokens[r, :len(p)] = p
    toks: list[list[int]] = [[] for _ in range(num)]
    lps: list[list[float]] = [[] for _ in range(num)]
    slps: list[list[float]] = [[] for _ in range(num)]
    live = np.ones((num,), bool)
    img = None if images is None else images.rows(np.arange(num) // n, width)
    for step in range(n_max):
      tok, lp, slp = (np.asarray(x) for x in self._next(
          params, tokens, lengths, req.keys_Rx2, np.int32(step), img))
      for r in np.flatnonzero(live):
        toks[r].append(int(tok[r]))
        lps[r].append(float(lp[r]))
        slps[r].append(float(slp[r]))
        tokens[r, lengths[r]] = tok[r]
        lengths[r] += 1
        live[r] = not self.config.ends_on_stop(toks[r])
      if not live.any():
        break
    return driver.assemble(toks, lps, slps, n, n_max, self.config.ends_on_stop, pad_id)

  def precompile(self) -> None:
    """Nothing: the oracle runs a full forward per token and is not for speed."""
