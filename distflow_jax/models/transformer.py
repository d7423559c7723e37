"""Decoder-only transformer (Llama / Qwen2 / Qwen3 / Qwen3-MoE) in Flax NNX, with a KV cache.

Masking is done with explicit positions, never by token index, so left
padding, right padding and per-row lengths are all the same case:

* `positions_BxT` (int32) is the RoPE position of every token;
* `mask_BxT` (bool) says which tokens are real; a padding token is never
  attended to (its key position is stored as -1);
* a query at position p attends to every real key at position <= p.

Pure functional use (inside `jax.jit`, `lax.while_loop`, `lax.scan`):

    graphdef, params = nnx.split(model)
    logits_BxTxV, cache = forward(graphdef, params, tokens_BxT, positions_BxT, mask_BxT)

KV cache (an explicit pytree, never module state).  `KVCache.k`/`v` are
tuples of one `[B, Hkv, S, Dh]` buffer per layer: separate buffers, heads
before slots, so that a decode step writes and reads each in place (a stacked
array costs a copy of the layer's slice per step, slots before heads a
transposing copy) and `KVCache.pos` is `[B, S]` (-1 = empty slot).
A call with a cache writes the T new tokens of row b at slots
`cache_index_B[b] + t` (writes past S are dropped) and attends over all S
slots, so every row of a decode batch can sit at its own length:

    cache = init_cache(cfg, batch=B, max_len=S)
    # prefill a padded prompt of length T (true length n_B), right padded:
    mask = jnp.arange(T)[None] < n_B[:, None]
    logits, cache = forward(g, p, prompt_BxT, positions_from_mask(mask), mask,
                            cache, jnp.zeros((B,), jnp.int32))
    # decode one token per row; row b's next token sits at slot/position n_B[b]:
    logits, cache = forward(g, p, tok_Bx1, n_B[:, None], jnp.ones((B, 1), bool),
                            cache, n_B)

With left padding use the same calls: the pads get position -1 in the cache,
so the only rule is that the slot `cache_index_B` must be past the prompt's
last slot.  `cache_insert` copies one row of a (prefill) cache into a slot
of a (decode) cache, for continuous batching.

Shared prefixes (training and scoring passes of a GRPO group, whose n rows
share one prompt).  `return_kv=True` on a cache-less call also returns the
call's keys/values as a `KVCache` of `[G, Hkv, T, Dh]` per layer (pos = the key positions).
A later call with `prefix=that, prefix_repeat=n` runs `G * n` rows (row r
continues prefix row r // n): each row attends to its prefix and then to its
own tokens, so the prompt is computed once per group, and gradients flow
back into it from every row:

    h_G, kv = forward(g, p, prompt_GxP, pos_GxP, mask_GxP, return_kv=True,
                      return_hidden=True)
    h_R, _ = forward(g, p, resp_RxN, pos_RxN, mask_RxN, prefix=kv,
                     prefix_repeat=n, return_hidden=True)

`return_hidden=True` returns the final-normed hidden states `[B, T, D]`
instead of logits; pair it with `Transformer.unembed_matrix()` and
`heads.token_logprobs_and_entropy` so the `[B, T, V]` logits are never
materialised at once.

Levers (`ModelConfig`): `scan_layers` stacks the layers' parameters on a leading
axis (stacking.py) and runs the cache-less calls (plain, `return_kv`, `prefix`) under
`lax.scan`, whose recorded k/v are then `[L, G, Hkv, T, Dh]` arrays; a call with a
cache still runs layer by layer.  `remat` rematerialises each layer of the cache-less
calls; `attention_impl` picks the multi-token attention (attention.py).

The pieces, by job: layers.py (RMSNorm, MLP, linear layers), moe.py (the experts of a
sparse layer), attention.py
(RoPE, masked and decode attention), kv_cache.py (the cache and how a call
writes, records or reads a prefix of it); here the stack and `forward`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from distflow_jax.models import lora_layer, sharding, stacking
from distflow_jax.models.attention import Attention, RopeTable, rope_table
from distflow_jax.models.config import ModelConfig
# KVCache, init_cache, cache_insert and positions_from_mask are imported from here by
# the rollout, the train steps and the models package: re-exported.
from distflow_jax.models.kv_cache import (CacheWriter, KVCache, KVRecorder, PrefixReader,  # noqa: F401
                                          cache_insert, init_cache, positions_from_mask)
from distflow_jax.models.layers import INIT, MLP, RMSNorm, linear
from distflow_jax.models.moe import MoE

# model.remat -> the jax.checkpoint policy of each layer (None: save only its input).
_REMAT_POLICIES = {"full": None, "dots_saveable": jax.checkpoint_policies.dots_saveable}


class Block(nnx.Module):
  def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, index: int = 0):
    self.input_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.jnp_dtype)
    self.attn = Attention(cfg, rngs)
    self.post_attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.jnp_dtype)
    # Layer `index`'s feed-forward: the experts where the config's MoE makes it sparse.
    self.mlp = (MoE(cfg.moe, cfg.hidden_size, cfg.jnp_dtype, INIT, rngs)
                if cfg.moe is not None and cfg.moe.sparse(index) else MLP(cfg, rngs))

  def __call__(self, x, positions_BxT, key_pos_BxS, writer, segment_ids_BxT=None,
               rope: RopeTable | None = None):
    x = x + self.attn(self.input_norm(x), positions_BxT, key_pos_BxS, writer, segment_ids_BxT,
                      rope)
    return x + self.mlp(self.post_attn_norm(x))


class Transformer(nnx.Module):
  """Llama / Qwen2 / Qwen3 decoder.  Parameter paths mirror HF names (see hf_names)."""

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    self.cfg = cfg
    self.embed = nnx.Embed(cfg.vocab_size, cfg.hidden_size, dtype=cfg.jnp_dtype,
                           param_dtype=cfg.jnp_dtype, embedding_init=INIT, rngs=rngs)
    blocks = [Block(cfg, rngs, i) for i in range(cfg.num_layers)]
    # Stacked (one Block, leading layer axis) under scan_layers: see stacking.py.
    self.layers = stacking.stack_modules(blocks) if cfg.scan_layers else nnx.List(blocks)
    self.final_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.jnp_dtype)
    if not cfg.tie_embeddings:
      self.lm_head = linear(cfg, cfg.hidden_size, cfg.vocab_size, False, rngs)

  def unembed_matrix(self) -> jax.Array:
    """The `[D, V]` output projection (the embedding's transpose when tied)."""
    if self.cfg.tie_embeddings:
      return self.embed.embedding[...].T
    return self.lm_head.kernel[...]

  def logits(self, hidden_BxTxD: jax.Array) -> jax.Array:
    return jnp.einsum("btd,dv->btv", hidden_BxTxD, self.unembed_matrix())

  def __call__(self, tokens_BxT: jax.Array, positions_BxT: jax.Array,
               mask_BxT: jax.Array | None = None, cache: KVCache | None = None,
               cache_index_B: jax.Array | None = None, *, return_hidden: bool = False,
               remat: bool | str | None = None, prefix: KVCache | None = None,
               prefix_repeat: int = 1, return_kv: bool = False,
               segment_ids_BxT: jax.Array | None = None,
               inputs_embeds_BxTxD: jax.Array | None = None,
               rope_positions_3xBxT: jax.Array | None = None
               ) -> tuple[jax.Array, KVCache | None]:
    """Returns `(logits_BxTxV or hidden_BxTxD, new_cache)`; see the module docstring.

    `remat` rematerialises each block in the backward pass (less activation memory for
    training): a policy name of `ModelConfig.remat`, True for "full", None for the
    config's; ignored with a cache.  `new_cache` is the updated cache, the recorded k/v
    (`return_kv`; under `scan_layers` its k/v are `[L, G, Hkv, T, Dh]` arrays) or None.

    `segment_ids_BxT` (int32, plain calls only): packed rows, several sequences per row
    (train/packing.py); a token attends only to earlier tokens of its own segment, and
    `positions_BxT` restart at 0 in each segment.

    Multimodal hooks (vl.py), both off by default: `inputs_embeds_BxTxD` replaces the
    token embedding (`tokens_BxT` may then be None); `rope_positions_3xBxT` (int32, needs
    `cfg.mrope_section`) are Qwen2-VL's (temporal, height, width) RoPE positions, while
    masking still follows `positions_BxT` (the order of the tokens).
    """
    if inputs_embeds_BxTxD is not None:
      b, t = inputs_embeds_BxTxD.shape[:2]
    else:
      b, t = tokens_BxT.shape
    if rope_positions_3xBxT is not None:
      if not self.cfg.mrope_section:
        raise ValueError("Transformer: rope_positions_3xBxT needs ModelConfig.mrope_section")
      rope_positions_3xBxT = rope_positions_3xBxT.astype(jnp.int32)
    positions_BxT = positions_BxT.astype(jnp.int32)
    if mask_BxT is None:
      mask_BxT = jnp.ones((b, t), bool)
    own_pos_BxT = jnp.where(mask_BxT, positions_BxT, -1)
    if sum(x is not None and x is not False for x in (cache, prefix, return_kv)) > 1:
      raise ValueError("Transformer: cache, prefix and return_kv exclude each other")
    if segment_ids_BxT is not None and (cache is not None or prefix is not None or return_kv):
      raise ValueError("Transformer: segment_ids (packed rows) work only in a plain call "
                       "(no cache, prefix or return_kv)")
    writer = None
    if cache is not None:
      if cache_index_B is None:
        raise ValueError("Transformer: a cache needs cache_index_B (the slot of each row's first token)")
      writer = CacheWriter(cache, cache_index_B, t)
    elif prefix is not None:
      writer = PrefixReader(prefix, prefix_repeat, b)
    elif return_kv:
      writer = KVRecorder()
    key_pos_BxS = own_pos_BxT if writer is None else writer.pos(own_pos_BxT)
    rope = rope_table(self.cfg, positions_BxT, rope_positions_3xBxT)  # once, for every layer
    x = sharding.constrain_rows(self.embed(tokens_BxT) if inputs_embeds_BxTxD is None
                                else inputs_embeds_BxTxD.astype(self.cfg.jnp_dtype))
    new_cache = None
    if isinstance(writer, CacheWriter):
      # Layer by layer (stacked layers sliced): each layer's cache buffer is written in place.
      for i in range(self.cfg.num_layers):
        layer = stacking.layer_of(self.layers, i) if self.cfg.scan_layers else self.layers[i]
        x = layer(x, positions_BxT, key_pos_BxS, writer, None, rope)
        writer.layer += 1
      new_cache = KVCache(k=tuple(writer.k), v=tuple(writer.v), pos=key_pos_BxS)
    else:
      policy = self.cfg.remat if remat is None else {True: "full", False: "none"}.get(remat, remat)
      x, kv = self._run_layers(x, positions_BxT, key_pos_BxS, writer, policy,
                               segment_ids_BxT, rope)
      if isinstance(writer, KVRecorder):
        new_cache = KVCache(k=kv[0], v=kv[1], pos=own_pos_BxT)
    hidden = sharding.constrain_rows(self.final_norm(x))
    if return_hidden:
      return hidden, new_cache
    return self.logits(hidden), new_cache


  def _run_layers(self, x, positions_BxT, key_pos_BxS, writer, remat: str,
                  segment_ids_BxT=None, rope: RopeTable | None = None):
    """The cache-less passes (plain, `return_kv`, `prefix`): every layer as a pure function
    of its parameters, looped or scanned, each rematerialised under `remat`.  Returns
    `(x, (ks, vs))`, the recorded keys/values when `writer` is a KVRecorder."""
    record = isinstance(writer, KVRecorder)
    prefix = writer.prefix if isinstance(writer, PrefixReader) else None
    b = x.shape[0]

    def one(graphdef, layer_state, x, pk, pv, index):
      layer = nnx.merge(graphdef, layer_state)
      w = (KVRecorder() if record else None if prefix is None else
           PrefixReader(KVCache(k=(pk,), v=(pv,), pos=prefix.pos), writer.repeat, b))
      with lora_layer.dropout_layer(index):  # a train step's adapter dropout: own masks
        y = sharding.constrain_rows(layer(x, positions_BxT, key_pos_BxS, w, segment_ids_BxT,
                                          rope))
      return y, ((w.ks[0], w.vs[0]) if record else None)

    def wrap(graphdef, scanned):
      fn = functools.partial(one, graphdef)
      if remat == "none":
        return fn
      return jax.checkpoint(fn, policy=_REMAT_POLICIES[remat], prevent_cse=not scanned)

    if self.cfg.scan_layers:
      graphdef, state = stacking.split_stacked(self.layers)
      pk = pv = None
      if prefix is not None:  # a recorded prefix: stacked by a scanned pass, a tuple by a loop
        pk, pv = (p if isinstance(p, jax.Array) else jnp.stack(p) for p in (prefix.k, prefix.v))
      body = wrap(graphdef, True)
      # The layer index only where adapter dropout needs it (else the program is as before).
      index = jnp.arange(self.cfg.num_layers) if lora_layer.dropout_on() else None
      x, kv = jax.lax.scan(lambda x, xs: body(xs[0], x, xs[1], xs[2], xs[3]), x,
                           (state, pk, pv, index))
      return x, kv
    ks, vs = [], []
    for i, layer in enumerate(self.layers):
      graphdef, state = nnx.split(layer)
      pk, pv = (None, None) if prefix is None else (prefix.k[i], prefix.v[i])
      x, kv = wrap(graphdef, False)(state, x, pk, pv, i if lora_layer.dropout_on() else None)
      if record:
        ks.append(kv[0])
        vs.append(kv[1])
    return x, (tuple(ks), tuple(vs))


def forward(graphdef: nnx.GraphDef, params: nnx.State, tokens_BxT: jax.Array,
            positions_BxT: jax.Array, mask_BxT: jax.Array | None = None,
            cache: KVCache | None = None, cache_index_B: jax.Array | None = None, *,
            return_hidden: bool = False, remat: bool | str | None = None,
            prefix: KVCache | None = None,
            prefix_repeat: int = 1, return_kv: bool = False,
            segment_ids_BxT: jax.Array | None = None,
            inputs_embeds_BxTxD: jax.Array | None = None,
            rope_positions_3xBxT: jax.Array | None = None
            ) -> tuple[jax.Array, KVCache | None]:
  """Pure forward over `nnx.split(model)`: safe inside jit / while_loop / scan."""
  model = nnx.merge(graphdef, params)
  return model(tokens_BxT, positions_BxT, mask_BxT, cache, cache_index_B,
               return_hidden=return_hidden, remat=remat, prefix=prefix,
               prefix_repeat=prefix_repeat, return_kv=return_kv,
               segment_ids_BxT=segment_ids_BxT, inputs_embeds_BxTxD=inputs_embeds_BxTxD,
               rope_positions_3xBxT=rope_positions_3xBxT)
