"""Model configuration for the Llama / Qwen2 / Qwen3 / Qwen3-MoE decoder family.

`ModelConfig` is a frozen, validated dataclass.  `PRESETS` is the one table
of built-in architectures (`model.preset`, used when no `model.path` is
given): `preset("tiny", vocab_size)` is the default run's model;
`ModelConfig.from_hf_dict(d)` / `cfg.to_hf_dict()` convert to and from a
Hugging Face `config.json` dictionary.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax.numpy as jnp

from distflow_jax.models.lora_layer import LoraSpec
from distflow_jax.models.moe import MoeSpec

ARCHS = ("llama", "qwen2", "qwen3", "qwen3_moe")
# Archs with Qwen3's per-head RMSNorm of queries and keys.
_QK_NORM = ("qwen3", "qwen3_moe")
DTYPES = ("float32", "bfloat16", "float16")
REMATS = ("none", "full", "dots_saveable")
ATTENTION_IMPLS = ("auto", "xla", "cudnn", "einsum", "blockwise")

# HF `architectures` / `model_type` names -> our arch.
_HF_ARCH = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Qwen3MoeForCausalLM": "qwen3_moe",
}
_HF_MODEL_TYPE = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "qwen3_moe": "qwen3_moe"}
_ARCH_TO_HF = {v: k for k, v in _HF_ARCH.items()}


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """Shape and numerics of a decoder-only transformer.

  `qkv_bias` is Qwen2's bias on the q/k/v projections; `qk_norm` is Qwen3's
  per-head RMSNorm of queries and keys before RoPE.  `dtype` is used for the
  parameters and the activations (RMSNorm, softmax and log-probs always run in
  float32).

  Compile and memory levers (numerics unchanged; not part of a `config.json`):
  `scan_layers` stores the layers' parameters stacked on a leading layer axis and runs
  them under `lax.scan` (compile time flat in depth); `remat` rematerialises each layer
  in the backward pass (none | full | dots_saveable, a `jax.checkpoint` policy);
  `attention_impl` picks the multi-token attention: `jax.nn.dot_product_attention` with
  XLA's or cuDNN's kernel, `einsum` (the hand-written masked softmax), `blockwise`
  (flash-style blocks of `attention_block` queries and keys, memory linear in the length:
  blockwise.py) or `auto` (cuDNN on GPU for 16-bit shapes it takes, else blockwise for
  rows of >= 2048 x 2048 query x key pairs, else XLA).
  """
  arch: str = "llama"
  vocab_size: int = 128
  hidden_size: int = 128
  intermediate_size: int = 384
  num_layers: int = 2
  num_heads: int = 4
  num_kv_heads: int = 2
  head_dim: int = 32
  rope_theta: float = 10000.0
  rms_norm_eps: float = 1e-6
  qkv_bias: bool = False
  qk_norm: bool = False
  tie_embeddings: bool = True
  max_position_embeddings: int = 2048
  dtype: str = "float32"
  # Llama 3's RoPE frequency scaling ("llama3"), as (factor, low_freq_factor,
  # high_freq_factor, original_max_position_embeddings); () = plain RoPE.
  rope_llama3: tuple[float, float, float, int] | tuple[()] = ()
  # Qwen2-VL's multimodal RoPE ("mrope"): the head's head_dim / 2 frequencies split into
  # (temporal, height, width) sections, each rotated by its own row of the call's
  # `rope_positions_3xBxT`; () = 1-D RoPE only (set by vl.VLConfig; not in to_hf_dict).
  mrope_section: tuple[int, ...] = ()
  scan_layers: bool = False
  remat: str = "none"
  attention_impl: str = "auto"
  attention_block: int = 512
  # LoRA adapters (lora_layer.py, lora.py; the config's model.lora); None = none.  Not part
  # of a `config.json`.
  lora: LoraSpec | None = None
  # The rollout engine's layout (fused.py): the fused projections it holds, of `qkv_proj`
  # (q/k/v) and `gate_up_proj` (gate/up).  Never a checkpoint's or a trained model's; not
  # part of a `config.json`.
  fused_projections: tuple[str, ...] = ()
  # Qwen3-MoE's experts (moe.py): the sparse layers' router and experts; None = dense.
  moe: MoeSpec | None = None

  def __post_init__(self):
    if isinstance(self.lora, dict):  # a checkpoint's meta (dataclasses.asdict) read back
      object.__setattr__(self, "lora", LoraSpec(**self.lora))
    if isinstance(self.moe, dict):
      object.__setattr__(self, "moe", MoeSpec(**self.moe))
    if self.arch not in ARCHS:
      raise ValueError(f"ModelConfig.arch={self.arch!r} is unknown; valid: {ARCHS}")
    if self.dtype not in DTYPES:
      raise ValueError(f"ModelConfig.dtype={self.dtype!r} is unknown; valid: {DTYPES}")
    if self.remat not in REMATS:
      raise ValueError(f"ModelConfig.remat={self.remat!r} is unknown; valid: {REMATS}")
    if self.attention_impl not in ATTENTION_IMPLS:
      raise ValueError(f"ModelConfig.attention_impl={self.attention_impl!r} is unknown; "
                       f"valid: {ATTENTION_IMPLS}")
    for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers",
                 "num_heads", "num_kv_heads", "head_dim", "max_position_embeddings",
                 "attention_block"):
      value = getattr(self, name)
      if not isinstance(value, int) or value <= 0:
        raise ValueError(f"ModelConfig.{name}={value!r} must be a positive int")
    object.__setattr__(self, "fused_projections", tuple(self.fused_projections))
    if not set(self.fused_projections) <= {"qkv_proj", "gate_up_proj"}:
      raise ValueError(f"ModelConfig.fused_projections={self.fused_projections}: valid "
                       f"names are qkv_proj, gate_up_proj")
    self._check_moe()
    if self.num_heads % self.num_kv_heads:
      raise ValueError(
          f"ModelConfig.num_heads={self.num_heads} must be a multiple of "
          f"num_kv_heads={self.num_kv_heads} (grouped-query attention)")
    if self.head_dim % 2:
      raise ValueError(f"ModelConfig.head_dim={self.head_dim} must be even for RoPE")
    if self.rope_theta <= 0 or self.rms_norm_eps <= 0:
      raise ValueError("ModelConfig.rope_theta and rms_norm_eps must be > 0, got "
                       f"{self.rope_theta}, {self.rms_norm_eps}")
    if self.rope_llama3:
      factor, low, high, orig = self.rope_llama3
      if not (factor > 0 and 0 < low < high and orig > 0):
        raise ValueError(f"ModelConfig.rope_llama3={self.rope_llama3}: need factor > 0, "
                         f"0 < low_freq_factor < high_freq_factor, original positions > 0")

    if self.mrope_section and (len(self.mrope_section) != 3
                               or sum(self.mrope_section) != self.head_dim // 2
                               or min(self.mrope_section) < 0):
      raise ValueError(f"ModelConfig.mrope_section={self.mrope_section}: need 3 sections "
                       f"(temporal, height, width) >= 0 summing to head_dim / 2 = "
                       f"{self.head_dim // 2}")

  def _check_moe(self) -> None:
    if (self.arch == "qwen3_moe") != (self.moe is not None):
      raise ValueError(f"ModelConfig: arch={self.arch!r} with moe={self.moe}: experts "
                       f"(moe) go with arch 'qwen3_moe' only, and it needs them")
    if self.moe is None:
      return
    kinds = {self.moe.sparse(i) for i in range(self.num_layers)}
    if self.scan_layers and len(kinds) > 1:
      dense = [i for i in range(self.num_layers) if not self.moe.sparse(i)]
      raise ValueError(f"ModelConfig.scan_layers=True needs every layer alike, and this "
                       f"MoE model has dense layers {dense[:8]} beside sparse ones "
                       f"(mlp_only_layers / decoder_sparse_step): set model.scan_layers=False")
    if "gate_up_proj" in self.fused_projections and kinds != {False}:
      raise ValueError("ModelConfig.fused_projections: gate_up_proj has no meaning for "
                       "expert layers (each expert keeps its own gate and up)")

  @property
  def jnp_dtype(self) -> jnp.dtype:
    return jnp.dtype(self.dtype)

  @property
  def num_params(self) -> int:
    """Exact parameter count (embeddings counted once when tied)."""
    d, f, dh = self.hidden_size, self.intermediate_size, self.head_dim
    q, kv = self.num_heads * dh, self.num_kv_heads * dh
    attn = d * q + 2 * d * kv + q * d
    if self.qkv_bias:
      attn += q + 2 * kv
    if self.qk_norm:
      attn += 2 * dh
    emb = self.vocab_size * d * (1 if self.tie_embeddings else 2)
    ffn = sum(self.moe.num_params(d) if self.moe is not None and self.moe.sparse(i)
              else 3 * d * f for i in range(self.num_layers))
    return self.num_layers * (attn + 2 * d) + ffn + emb + d

  def replace(self, **changes: Any) -> "ModelConfig":
    return dataclasses.replace(self, **changes)

  @classmethod
  def tiny(cls, vocab_size: int = 128, arch: str = "qwen2") -> "ModelConfig":
    """The built-in tiny model (~1.24 M params at vocab 128): d=192, 3 layers, GQA 4:2."""
    return cls(arch=arch, vocab_size=vocab_size, hidden_size=192, intermediate_size=512,
               num_layers=3, num_heads=4, num_kv_heads=2, head_dim=48,
               rope_theta=10000.0, rms_norm_eps=1e-6, qkv_bias=arch == "qwen2",
               qk_norm=arch in _QK_NORM, tie_embeddings=True,
               max_position_embeddings=1024, dtype="float32")

  @classmethod
  def from_hf_dict(cls, d: dict[str, Any], dtype: str | None = None) -> "ModelConfig":
    """Builds a config from a Hugging Face `config.json` dictionary.

    Raises ValueError naming the architecture when it is not Llama / Qwen2 /
    Qwen3, or naming the option when it asks for something not implemented
    (RoPE scaling, sliding window, biases other than Qwen2's).
    """
    archs = d.get("architectures") or []
    arch = next((_HF_ARCH[a] for a in archs if a in _HF_ARCH), None)
    if arch is None:
      arch = _HF_MODEL_TYPE.get(d.get("model_type", ""))
    if arch is None:
      raise ValueError(
          f"unknown architecture: architectures={archs}, model_type={d.get('model_type')!r}; "
          f"supported: {sorted(_HF_ARCH)} (model_type {sorted(_HF_MODEL_TYPE)})")
    rope = d.get("rope_parameters") or d.get("rope_scaling") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ("default", "llama3"):
      raise ValueError(f"{arch}: RoPE scaling {rope_type!r} is not supported "
                       f"(only 'default' and 'llama3')")
    llama3 = ()
    if rope_type == "llama3":
      try:
        llama3 = (float(rope["factor"]), float(rope["low_freq_factor"]),
                  float(rope["high_freq_factor"]),
                  int(rope["original_max_position_embeddings"]))
      except KeyError as e:
        raise ValueError(f"{arch}: rope_scaling 'llama3' lacks {e.args[0]!r}") from None
    if d.get("use_sliding_window"):
      raise ValueError(f"{arch}: use_sliding_window=True is not supported")
    if d.get("mlp_bias"):
      raise ValueError(f"{arch}: mlp_bias=True is not supported")
    if arch != "qwen2" and d.get("attention_bias"):
      raise ValueError(f"{arch}: attention_bias=True is not supported")
    act = d.get("hidden_act", "silu")
    if act != "silu":
      raise ValueError(f"{arch}: hidden_act={act!r} is not supported (only 'silu')")
    num_heads = d["num_attention_heads"]
    hidden = d["hidden_size"]
    hf_dtype = d.get("dtype") or d.get("torch_dtype") or "float32"
    if dtype is None:
      dtype = hf_dtype if hf_dtype in DTYPES else "float32"
    return cls(
        arch=arch, vocab_size=d["vocab_size"], hidden_size=hidden,
        intermediate_size=d["intermediate_size"], num_layers=d["num_hidden_layers"],
        num_heads=num_heads, num_kv_heads=d.get("num_key_value_heads") or num_heads,
        head_dim=d.get("head_dim") or hidden // num_heads,
        rope_theta=float(rope.get("rope_theta", d.get("rope_theta", 10000.0))),
        rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
        qkv_bias=arch == "qwen2", qk_norm=arch in _QK_NORM,
        tie_embeddings=bool(d.get("tie_word_embeddings", arch != "llama")),
        max_position_embeddings=d.get("max_position_embeddings", 2048), dtype=dtype,
        rope_llama3=llama3, moe=_moe_from_hf(d) if arch == "qwen3_moe" else None)

  def to_hf_dict(self, bos_token_id: int | None = None,
                 eos_token_id: int | None = None) -> dict[str, Any]:
    """The Hugging Face `config.json` dictionary for this config."""
    d: dict[str, Any] = {
        "architectures": [_ARCH_TO_HF[self.arch]],
        "model_type": self.arch,
        "vocab_size": self.vocab_size,
        "hidden_size": self.hidden_size,
        "intermediate_size": self.intermediate_size,
        "num_hidden_layers": self.num_layers,
        "num_attention_heads": self.num_heads,
        "num_key_value_heads": self.num_kv_heads,
        "head_dim": self.head_dim,
        "hidden_act": "silu",
        "rope_theta": self.rope_theta,
        "rms_norm_eps": self.rms_norm_eps,
        "tie_word_embeddings": self.tie_embeddings,
        "max_position_embeddings": self.max_position_embeddings,
        "torch_dtype": self.dtype,
        "attention_dropout": 0.0,
        "use_cache": True,
    }
    if self.arch == "llama":
      d.update(attention_bias=False, mlp_bias=False)
    if self.rope_llama3:
      factor, low, high, orig = self.rope_llama3
      d["rope_scaling"] = {"rope_type": "llama3", "factor": factor, "low_freq_factor": low,
                           "high_freq_factor": high, "original_max_position_embeddings": orig}
    if self.arch == "qwen2":
      d.update(use_sliding_window=False)
    if self.arch in _QK_NORM:
      d.update(attention_bias=False, use_sliding_window=False)
    if self.moe is not None:
      m = self.moe
      d.update(num_experts=m.num_experts, num_experts_per_tok=m.top_k,
               moe_intermediate_size=m.intermediate_size, norm_topk_prob=m.norm_topk_prob,
               decoder_sparse_step=m.sparse_step, mlp_only_layers=list(m.mlp_only_layers),
               router_aux_loss_coef=m.router_aux_loss_coef, output_router_logits=False)
    if bos_token_id is not None:
      d["bos_token_id"] = bos_token_id
    if eos_token_id is not None:
      d["eos_token_id"] = eos_token_id
    return d


def _moe_from_hf(d: dict[str, Any]) -> MoeSpec:
  """A Qwen3-MoE config.json's experts (transformers' names; ``num_local_experts`` is the
  alias transformers 5 writes)."""
  if d.get("shared_expert_intermediate_size"):
    raise ValueError("qwen3_moe: shared_expert_intermediate_size is set, but Qwen3-MoE has "
                     "no shared expert (a Qwen2-MoE config?): not supported")
  experts = d.get("num_experts", d.get("num_local_experts"))
  for key, value in (("num_experts", experts),
                     ("num_experts_per_tok", d.get("num_experts_per_tok")),
                     ("moe_intermediate_size", d.get("moe_intermediate_size"))):
    if value is None:
      raise ValueError(f"qwen3_moe: config.json lacks {key!r}")
  try:
    return MoeSpec(num_experts=experts, top_k=d["num_experts_per_tok"],
                   intermediate_size=d["moe_intermediate_size"],
                   norm_topk_prob=bool(d.get("norm_topk_prob", False)),
                   sparse_step=d.get("decoder_sparse_step", 1),
                   mlp_only_layers=tuple(d.get("mlp_only_layers") or ()),
                   router_aux_loss_coef=float(d.get("router_aux_loss_coef", 0.001)))
  except ValueError as e:
    raise ValueError(f"qwen3_moe: {e}") from None


# --------------------------------------------------------------------------
# Built-in architectures (`model.preset`): name -> factory(vocab_size).  Every
# user of a preset (roles, generate, eval, warm start, config checks) goes through
# this table, so a new entry is usable everywhere and listed in every error.

PRESETS: dict[str, Callable[[int], ModelConfig]] = {
    # The default run's model: ~1.2 M parameters, Qwen2-shaped.
    "tiny": lambda vocab_size: ModelConfig.tiny(vocab_size=vocab_size),
    # One small layer: for smoke tests of the whole workflow, compiles in seconds.
    # The tiny model's shape with experts (Qwen3-MoE): 8 experts of 128, top 2, every layer.
    "tiny_moe": lambda vocab_size: ModelConfig.tiny(vocab_size=vocab_size).replace(
        arch="qwen3_moe", qkv_bias=False, qk_norm=True,
        moe=MoeSpec(num_experts=8, top_k=2, intermediate_size=128)),
    "micro": lambda vocab_size: ModelConfig(
        arch="qwen2", vocab_size=vocab_size, hidden_size=64, intermediate_size=128,
        num_layers=1, num_heads=4, num_kv_heads=2, head_dim=16, qkv_bias=True),
}


def preset_names() -> list[str]:
  return sorted(PRESETS)


def preset(name: str, vocab_size: int, dtype: str = "float32") -> ModelConfig:
  """The built-in architecture ``name`` for a tokenizer of ``vocab_size`` tokens.

  Raises ValueError listing the valid names when ``name`` is not one.
  """
  if name not in PRESETS:
    raise ValueError(f"unknown model preset {name!r}; built-in: {preset_names()}")
  return PRESETS[name](vocab_size).replace(dtype=dtype)
