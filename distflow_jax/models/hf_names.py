"""Our parameter paths <-> Hugging Face tensor names (the naming both import and export use).

Parameter path -> HF tensor name (kernels are stored transposed, `[out, in]`):

    embed/embedding                      model.embed_tokens.weight
    layers/i/input_norm/scale            model.layers.i.input_layernorm.weight
    layers/i/attn/{q,k,v,o}_proj/kernel  model.layers.i.self_attn.{q,k,v,o}_proj.weight
    layers/i/attn/{q,k,v}_proj/bias      model.layers.i.self_attn.{q,k,v}_proj.bias
    layers/i/attn/{q,k}_norm/scale       model.layers.i.self_attn.{q,k}_norm.weight
    layers/i/post_attn_norm/scale        model.layers.i.post_attention_layernorm.weight
    layers/i/mlp/{gate,up,down}_proj/kernel  model.layers.i.mlp.{...}_proj.weight
    final_norm/scale                     model.norm.weight
    lm_head/kernel                       lm_head.weight

A `RewardModel`'s (`*ForSequenceClassification`) are its backbone's plus `score.weight`.
With `scan_layers` a `layers/...` parameter is stacked `[L, ...]` (stacking.py): hf_io
reads it from, and hf_export writes it as, the L tensors `model.layers.{i}.*`.
"""

from __future__ import annotations

_RENAMES = (("input_norm/scale", "input_layernorm.weight"),
            ("post_attn_norm/scale", "post_attention_layernorm.weight"),
            ("attn/", "self_attn."), ("/kernel", ".weight"), ("/scale", ".weight"),
            ("/bias", ".bias"))


def hf_name(path: str) -> tuple[str, bool]:
  """(HF tensor name, stored transposed?) of one of our parameter paths."""
  if path == "embed/embedding":
    return "model.embed_tokens.weight", False
  if path == "final_norm/scale":
    return "model.norm.weight", False
  if path == "lm_head/kernel":
    return "lm_head.weight", True
  if not path.startswith("layers/"):
    raise ValueError(f"parameter {path!r} has no Hugging Face name")
  name = path
  for ours, theirs in _RENAMES:
    name = name.replace(ours, theirs)
  return "model." + name.replace("/", "."), path.endswith("/kernel")


def reward_hf_name(path: str) -> tuple[str, bool]:
  """(HF tensor name, transposed?) of a `RewardModel` parameter (`*ForSequenceClassification`)."""
  if path == "score/kernel":
    return "score.weight", True
  if not path.startswith("backbone/"):
    raise ValueError(f"reward-model parameter {path!r} has no Hugging Face name")
  return hf_name(path[len("backbone/"):])

