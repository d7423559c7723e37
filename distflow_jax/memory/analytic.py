"""The analytic memory model: per-device bytes from the model's shape, no jax needed.

Used where the compiled figure is not available (``--memory=analytic``, or a model too
big to compile on this host's simulated devices) and checked against the compiled one on
small sizes (tests/test_memory_plan.py).  Bytes per device:

* parameters: ``num_params x dtype bytes / (fsdp x tensor)``;
* optimizer: Adam's two moments in the parameters' dtype (``2 x`` the parameter bytes),
  or with ``model.master_weights`` and 16-bit parameters a float32 master copy and
  float32 moments (12 bytes per parameter); SGD no moments;
* gradients: the micro-batch accumulator, float32 whatever the parameters' dtype
  (train/steps.py), plus one micro-batch's gradients in the parameters' dtype;
* activations (``model.remat=none``): per layer and token ``dtype x (ACT_D x D + ACT_F x
  F + ACT_QKV x (heads + 2 kv_heads) x head_dim) + 4 x ACT_SCORES x heads x keys``
  (a MoE layer: F is its top_k experts' width, plus its dispatch buffers, ``dispatch_width``)
  (float32 attention scores; none with ``attention_impl=cudnn``, a fused kernel, or
  ``blockwise``, which holds one block of them), plus one
  ``[chunk, vocab]`` float32 logits block x ``ACT_LOGITS``; with ``remat=full`` each layer
  keeps only its input (``D``) and one layer's set is live, ``dots_saveable`` half;
* KV cache: ``slots x len x layers x 2 x kv_heads x head_dim x dtype bytes``;
* weight sync (rollout/weight_sync.py): straight into the rollout layout, one step per
  layer (the embedding and the head alone): each device receives its rollout shard,
  ``params / tensor_parallel`` (the synced weights), plus ``SYNC_TEMP x`` the largest
  step's shard in buffers.
"""

from __future__ import annotations

import re

from distflow_jax.models.config import ModelConfig

ACT_D, ACT_F, ACT_QKV, ACT_SCORES, ACT_LOGITS = 10.0, 4.0, 2.0, 2.0, 3.0
ACT_DISPATCH = 3.0  # a MoE layer's gathered rows, expert outputs, and outputs back in order
# A forward-only pass keeps about one layer's buffers (and its scores) alive at a time.
FWD_D, FWD_F = 4.0, 2.0
LOGITS_CHUNK = 512  # train.steps' chunk_size of the log-prob head
# The weight sync's buffers per step, in units of that step's output shard: XLA:CPU's
# memory_analysis gave 2.0x for the embedding and head steps and 1.7x (Qwen2.5-72B, 8 x 8
# devices, tensor_parallel 8: 311 MB out, 623 MB temp for the embedding) to 2.0x
# (Qwen2.5-7B, 2 x 4, tensor_parallel 2) for a layer's, 2026-11-27; tiny models keep less.
SYNC_TEMP = 2.0

_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9,
          "gb": 10**9, "t": 10**12, "tb": 10**12, "kib": 2**10, "mib": 2**20, "gib": 2**30,
          "tib": 2**40}


def parse_bytes(text: str | int, where: str = "--device_memory") -> int:
  """``"80GB"`` -> 80e9, ``"80GiB"`` -> 80 x 2**30, ``"512MB"``, plain bytes; ValueError
  naming ``where`` otherwise."""
  m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(text))
  if not m or m.group(2).lower() not in _UNITS or float(m.group(1)) <= 0:
    raise ValueError(f"{where}={text!r} is not a memory size; write e.g. 80GB, 141GB, 96GiB "
                     f"or 512MB")
  return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def fmt(n: float) -> str:
  """Bytes as GB / MB (decimal, as accelerator memory is sold)."""
  if abs(n) >= 10**9:
    return f"{n / 1e9:.2f} GB"
  return f"{n / 1e6:.1f} MB"


def dtype_bytes(dtype: str) -> int:
  return 4 if dtype == "float32" else 2


def adapter_params(m: ModelConfig) -> int:
  """LoRA adapter parameters (float32; models/lora.py), 0 without LoRA.  They are sharded
  like their base kernels (models/sharding.py: one of a, b split on an fsdp-only mesh);
  counted whole on every device here, an upper bound off by at most their size."""
  if m.lora is None:
    return 0
  d, f, q, kv = m.hidden_size, m.intermediate_size, m.num_heads * m.head_dim, \
      m.num_kv_heads * m.head_dim
  dims = {"q_proj": d + q, "k_proj": d + kv, "v_proj": d + kv, "o_proj": q + d,
          "gate_proj": d + f, "up_proj": d + f, "down_proj": f + d}
  return m.num_layers * m.lora.rank * sum(dims[t] for t in m.lora.targets_in_layer(0))


def param_bytes(m: ModelConfig, shards: int = 1) -> float:
  """The base model's bytes split over ``shards``, plus any LoRA adapters (whole)."""
  return m.num_params * dtype_bytes(m.dtype) / shards + 4 * adapter_params(m)


def opt_bytes(m: ModelConfig, shards: int, optimizer: str, master: bool = False) -> float:
  if m.lora is not None:  # the adapters' moments only (float32, no master copy)
    return 0.0 if optimizer == "sgd" else 8.0 * adapter_params(m)
  if master and m.dtype != "float32":
    return m.num_params * (4 + (0 if optimizer == "sgd" else 8)) / shards
  return 0.0 if optimizer == "sgd" else 2 * param_bytes(m, shards)


def grad_bytes(m: ModelConfig, shards: int) -> float:
  """The float32 accumulator plus one micro-batch's gradients (parameters' dtype); with
  LoRA of the adapters only."""
  if m.lora is not None:
    return 8.0 * adapter_params(m)
  return m.num_params * (4 + dtype_bytes(m.dtype)) / shards


def layer_params(m: ModelConfig) -> int:
  """Parameters of the largest decoder layer (projections, biases, norms; a MoE layer's
  router and every expert)."""
  q, kv = m.num_heads * m.head_dim, m.num_kv_heads * m.head_dim
  attn = m.hidden_size * (q + 2 * kv) + q * m.hidden_size
  if m.qkv_bias:
    attn += q + 2 * kv
  if getattr(m, "qk_norm", False):
    attn += 2 * m.head_dim
  ffn = max(m.moe.num_params(m.hidden_size) if _sparse(m, i) else
            3 * m.hidden_size * m.intermediate_size for i in range(m.num_layers))
  return attn + ffn + 2 * m.hidden_size


def _sparse(m: ModelConfig, layer: int) -> bool:
  return getattr(m, "moe", None) is not None and m.moe.sparse(layer)


def ffn_width(m: ModelConfig) -> float:
  """The feed-forward width a token's activations hold, averaged over the layers: the
  dense MLP's intermediate size, or in a MoE layer its top_k experts' (top_k x I)."""
  return sum(m.moe.top_k * m.moe.intermediate_size if _sparse(m, i) else m.intermediate_size
             for i in range(m.num_layers)) / m.num_layers


def dispatch_width(m: ModelConfig) -> float:
  """A token's MoE dispatch buffers per layer, in units of the model dtype, averaged over
  the layers: its top_k gathered input rows and output rows (``ACT_DISPATCH x top_k x D``;
  the blocked dispatch's padding, at most one block per expert, is left out) and the
  float32 router logits and probabilities (``2 x 2 x E`` dtype units at 16 bits)."""
  return sum(ACT_DISPATCH * m.moe.top_k * m.hidden_size + 4 * m.moe.num_experts
             if _sparse(m, i) else 0 for i in range(m.num_layers)) / m.num_layers


def sync_step_bytes(m: ModelConfig, tensor_parallel: int) -> float:
  """The weight sync's buffers on one device: ``SYNC_TEMP x`` its largest step's output
  (the embedding, the head or one layer, split over ``tensor_parallel``)."""
  largest = max(m.vocab_size * m.hidden_size, layer_params(m))
  return SYNC_TEMP * largest * dtype_bytes(m.dtype) / tensor_parallel


def tokens(rows: int, prompt_len: int, new_tokens: int, group_size: int) -> int:
  """Tokens one pass runs for ``rows`` samples; a shared prompt runs once per group."""
  return rows // max(group_size, 1) * prompt_len + rows * new_tokens


def activation_bytes(m: ModelConfig, rows: int, prompt_len: int, new_tokens: int,
                     group_size: int, tensor: int = 1, train: bool = True,
                     remat: str = "none", attention_impl: str = "auto") -> float:
  """One device's activations for ``rows`` samples (a micro-batch on training, the pass's
  whole shard on a forward-only pass); ``tensor`` splits heads and the MLP."""
  s = dtype_bytes(m.dtype)
  toks = tokens(rows, prompt_len, new_tokens, group_size)
  keys = prompt_len + new_tokens
  qkv = (m.num_heads + 2 * m.num_kv_heads) * m.head_dim / tensor
  if train:
    per = s * (ACT_D * m.hidden_size + ACT_F * ffn_width(m) / tensor + ACT_QKV * qkv
               + dispatch_width(m))
    if attention_impl not in ("cudnn", "blockwise"):  # no [T, S] scores held
      per += 4 * ACT_SCORES * m.num_heads / tensor * keys
    if remat == "full":
      body = toks * (m.num_layers * s * m.hidden_size + per)
    else:
      body = m.num_layers * toks * per * (0.5 if remat == "dots_saveable" else 1.0)
  else:
    body = toks * s * (FWD_D * m.hidden_size + FWD_F * ffn_width(m) / tensor
                       + dispatch_width(m))
    if attention_impl not in ("cudnn", "blockwise"):  # one layer's float32 scores, probabilities
      body += toks * 4 * ACT_SCORES * m.num_heads / tensor * keys
  logits = min(LOGITS_CHUNK, rows * new_tokens) * m.vocab_size / tensor * 4 * ACT_LOGITS
  return body + logits


def packed_train_activation_bytes(m: ModelConfig, rows: int, pack_len: int, tensor: int = 1,
                                  remat: str = "none", attention_impl: str = "auto") -> float:
  """One device's train-step activations for a micro-batch of ``rows`` packed rows of
  ``pack_len`` tokens (model.pack_sequences; with actor.micro_batch_tokens, rows =
  ceil(budget / pack_len)): the body sees ``rows x pack_len`` tokens whose keys span one
  row, and the log-prob head one chunk of logits."""
  body = activation_bytes(m, rows, pack_len, 0, 1, tensor, True, remat, attention_impl)
  return body + LOGITS_CHUNK * m.vocab_size / tensor * 4 * ACT_LOGITS


def kv_cache_bytes(m: ModelConfig, slots: int, cache_len: int) -> float:
  """The whole cache of ``slots`` rows of ``cache_len`` (divide by the devices sharing it)."""
  return slots * cache_len * m.num_layers * 2 * m.num_kv_heads * m.head_dim * dtype_bytes(m.dtype)
