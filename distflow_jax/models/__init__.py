"""Models: Llama / Qwen2 / Qwen3 decoder in Flax NNX, KV cache, critic, HF interop.

How to use:

    from flax import nnx
    from distflow_jax.models import ModelConfig, Transformer, forward, init_cache

    cfg = ModelConfig.tiny(vocab_size=128)
    model = Transformer(cfg, rngs=nnx.Rngs(0))
    graphdef, params = nnx.split(model)          # pure-function view
    logits_BxTxV, _ = jax.jit(forward)(graphdef, params, tokens_BxT, positions_BxT, mask_BxT)

    # decoding with a KV cache: see transformer.py's docstring
    cache = init_cache(cfg, batch=B, max_len=S)
    logits, cache = forward(graphdef, params, tokens_BxT, positions_BxT, mask_BxT,
                            cache, cache_index_B)

Modules: config (ModelConfig), transformer (model, KV cache, pure forward),
heads (chunked log-probs / entropy, Critic, reference copy), sharding (rules
as data, sharded creation), hf_io (safetensors import/export), tokenizer
(HF `tokenizer.json` + chat template, built-in tiny tokenizer).
"""

from distflow_jax.models.config import ModelConfig
from distflow_jax.models.transformer import (KVCache, Transformer, cache_insert, forward,
                                             init_cache, positions_from_mask)

__all__ = ["ModelConfig", "KVCache", "Transformer", "cache_insert", "forward", "init_cache",
           "positions_from_mask"]
