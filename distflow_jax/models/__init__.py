"""Models: Llama / Qwen2 / Qwen3 decoder in Flax NNX, KV cache, critic, HF interop.

How to use:

    import jax, jax.numpy as jnp
    from flax import nnx
    from distflow_jax import models

    tok = models.Tokenizer.builtin()                       # or Tokenizer.from_dir(ckpt_dir)
    cfg = models.ModelConfig.tiny(vocab_size=128)
    mesh = models.make_mesh({"fsdp": 2, "tensor": 4})
    model = models.create_sharded(lambda: models.Transformer(cfg, rngs=nnx.Rngs(0)),
                                  mesh, models.fsdp_tp_rules())
    # or: model = models.load_pretrained(ckpt_dir, mesh=mesh, rules=models.fsdp_tp_rules())

    graphdef, params = nnx.split(model)                    # the pure-function view
    mask_BxT = tokens_BxT != tok.pad_id
    positions_BxT = models.positions_from_mask(mask_BxT)   # left or right padding
    logits_BxTxV, _ = jax.jit(models.forward)(graphdef, params, tokens_BxT, positions_BxT,
                                              mask_BxT)

    # Log-probs / entropy without the full [B, T, V] float32 logits:
    hidden, _ = models.forward(graphdef, params, tokens_BxT, positions_BxT, mask_BxT,
                               return_hidden=True)
    logp_BxT, ent_BxT = models.token_logprobs_and_entropy(
        hidden[:, :-1], nnx.merge(graphdef, params).unembed_matrix(), tokens_BxT[:, 1:])

    # KV cache (per-row write slots, continuous batching): see transformer.py.
    cache = models.init_cache(cfg, batch=B, max_len=S)
    logits, cache = models.forward(graphdef, params, tokens_BxT, positions_BxT, mask_BxT,
                                   cache, cache_index_B)

    critic = models.Critic(cfg, rngs=nnx.Rngs(1))          # backbone + value head
    ref_params = models.reference_params(params)           # frozen copy for the KL term
    models.save_pretrained(out_dir, model, tokenizer=tok)  # loads in transformers

Modules: config (ModelConfig), transformer (model, KV cache, pure forward),
heads (chunked log-probs / entropy, Critic, reference copy), stacking (the
`scan_layers` layout and conversions), sharding (rules as data, sharded
creation), hf_io (safetensors import; re-exports the names of hf_files: config.json
and weight-file checks, hf_names: parameter <-> tensor names, hf_export: writing
checkpoints), tokenizer (HF `tokenizer.json` + chat template, built-in tiny tokenizer),
errors (`ModelFileError`, a `ConfigError` naming the model folder file at fault),
vision + vl (Qwen2.5-VL: the vision tower, the composed model with multimodal
RoPE, its safetensors import/export; imported from their modules, not re-exported).
"""

from distflow_jax.models.config import ModelConfig
from distflow_jax.models.errors import ModelFileError, ModelFileNotFoundError
from distflow_jax.models.heads import (Critic, critic_values, reference_params,
                                       token_logprobs_and_entropy)
from distflow_jax.models.hf_io import export_state_dict, load_pretrained, read_config, save_pretrained
from distflow_jax.models.sharding import (Rules, create_sharded, fsdp_tp_rules, make_mesh,
                                          no_sharding, shard_state, spec_for, state_shardings)
from distflow_jax.models.tokenizer import Tokenizer
from distflow_jax.models.transformer import (KVCache, Transformer, cache_insert, forward,
                                             init_cache, positions_from_mask)

__all__ = [
    "ModelConfig", "ModelFileError", "ModelFileNotFoundError", "Critic", "critic_values",
    "reference_params", "token_logprobs_and_entropy",
    "export_state_dict", "load_pretrained", "read_config", "save_pretrained", "Rules",
    "create_sharded", "fsdp_tp_rules", "make_mesh", "no_sharding", "shard_state", "spec_for",
    "state_shardings", "Tokenizer", "KVCache", "Transformer", "cache_insert", "forward",
    "init_cache", "positions_from_mask",
]
