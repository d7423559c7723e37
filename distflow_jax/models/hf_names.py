"""Our parameter paths <-> Hugging Face tensor names (the naming both import and export use).

Parameter path -> HF tensor name (kernels are stored transposed, `[out, in]`):

    embed/embedding                      model.embed_tokens.weight
    layers/i/input_norm/scale            model.layers.i.input_layernorm.weight
    layers/i/attn/{q,k,v,o}_proj/kernel  model.layers.i.self_attn.{q,k,v,o}_proj.weight
    layers/i/attn/{q,k,v}_proj/bias      model.layers.i.self_attn.{q,k,v}_proj.bias
    layers/i/attn/{q,k}_norm/scale       model.layers.i.self_attn.{q,k}_norm.weight
    layers/i/post_attn_norm/scale        model.layers.i.post_attention_layernorm.weight
    layers/i/mlp/{gate,up,down}_proj/kernel  model.layers.i.mlp.{...}_proj.weight
    layers/i/mlp/gate/kernel             model.layers.i.mlp.gate.weight (a MoE router)
    layers/i/mlp/experts/{gate,up,down}_proj [E, ...]
                                         model.layers.i.mlp.experts.{e}.{...}_proj.weight
    final_norm/scale                     model.norm.weight
    lm_head/kernel                       lm_head.weight

An expert parameter is read from, and written as, its E per-expert tensors
(`expert_path`: the virtual path `layers/i/mlp/experts/{e}/gate_proj` of expert e's slice).
A `RewardModel`'s (`*ForSequenceClassification`) are its backbone's plus `score.weight`.
With `scan_layers` a `layers/...` parameter is stacked `[L, ...]` (stacking.py): hf_io
reads it from, and hf_export writes it as, the L tensors `model.layers.{i}.*`.
"""

from __future__ import annotations

import re

_RENAMES = (("input_norm/scale", "input_layernorm.weight"),
            ("post_attn_norm/scale", "post_attention_layernorm.weight"),
            ("attn/", "self_attn."), ("/kernel", ".weight"), ("/scale", ".weight"),
            ("/bias", ".bias"))


# An experts parameter [E, ...] (models/moe.py), and the virtual path of one expert's slice.
_EXPERTS = re.compile(r"^(?P<head>.*/mlp/experts/)(?P<w>(gate|up|down)_proj)$")
_EXPERT = re.compile(r"^(?P<head>.*/mlp/experts/)(?P<e>\d+)/(?P<w>(gate|up|down)_proj)$")


def experts_path(path: str) -> bool:
  """Whether ``path`` (loop layout) is an experts parameter, stacked on an expert axis."""
  return _EXPERTS.match(path) is not None


def expert_path(path: str, e: int) -> str:
  """The virtual path of expert ``e``'s slice of experts parameter ``path``."""
  m = _EXPERTS.match(path)
  return f"{m['head']}{e}/{m['w']}"


def hf_name(path: str) -> tuple[str, bool]:
  """(HF tensor name, stored transposed?) of one of our parameter paths."""
  m = _EXPERT.match(path)
  if m:  # one expert's [D, I] / [I, D] slice: nn.Linear's [out, in] in the file
    return f"model.{m['head'].replace('/', '.')}{m['e']}.{m['w']}.weight", True
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

