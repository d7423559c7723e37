"""Writing small GGUF files for the tests, as llama.cpp's converter lays them out.

    path = write_gguf(tmp / "m.gguf", hf_model, tokenizer, arch="llama", qtype="Q4_1")

Tensors get GGUF names, Llama's q/k rows llama.cpp's interleaved order, 2-D weights whose
rows are whole blocks the quantization ``qtype`` (norms and biases stay F32, as there);
the tokenizer (a ``tokenizers.Tokenizer`` of byte-level BPE) becomes the tokenizer.ggml.*
metadata.  ``drop`` leaves metadata keys or tensors out, ``extra`` adds metadata, to make
the bad files the refusal tests need.
"""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np

from distflow_jax.models import gguf_import

CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
                 "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
                 "{% endif %}")
# HF -> GGUF names: the converter's table read backwards (the tests check it against
# transformers' own loader and against the source model's tensors).
_BLOCK = {hf: g for g, hf in gguf_import.BLOCK_NAMES.items()}
_TOP = {hf: g for g, hf in gguf_import.TOP_NAMES.items()}


def gguf_name(hf: str) -> str:
  base, _, kind = hf.rpartition(".")
  if base.startswith("model.layers."):
    _, _, i, rest = base.split(".", 3)
    return f"blk.{i}.{_BLOCK[rest]}.{kind}"
  return f"{_TOP[base]}.{kind}"


def permute(w: np.ndarray, n_head: int) -> np.ndarray:
  """llama.cpp's q/k row order (each head's two rotary halves interleaved)."""
  return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(
      w.shape)


def write_gguf(path: Path, model, tokenizer, *, arch: str, qtype: str = "F32",
               pre: str = "qwen2", tok_model: str = "gpt2", drop: tuple[str, ...] = (), extra: dict | None = None,
               tensor_types: dict[str, str] | None = None) -> Path:
  cfg = model.config
  w = gguf.GGUFWriter(str(path), arch)
  meta = {
      "block_count": cfg.num_hidden_layers, "context_length": cfg.max_position_embeddings,
      "embedding_length": cfg.hidden_size, "feed_forward_length": cfg.intermediate_size,
      "head_count": cfg.num_attention_heads, "head_count_kv": cfg.num_key_value_heads,
      "rope_freq_base": float((getattr(cfg, "rope_parameters", None) or {}).get(
          "rope_theta", 10000.0)), "layer_norm_rms_eps": float(cfg.rms_norm_eps),
      "key_length": cfg.head_dim, "value_length": cfg.head_dim,
  }
  for key, value in meta.items():
    if key not in drop:
      getattr(w, f"add_{key}")(value)
  d = json.loads(tokenizer.to_str())
  vocab = d["model"]["vocab"]
  tokens = [None] * len(vocab)
  for t, i in vocab.items():
    tokens[i] = t
  special = {t["content"] for t in d["added_tokens"] if t["special"]}
  if "tokens" not in drop:
    w.add_tokenizer_model(tok_model)
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types([3 if t in special else 1 for t in tokens])
    w.add_token_merges([" ".join(m) if isinstance(m, list) else m for m in d["model"]["merges"]])
    w.add_bos_token_id(vocab["<|im_start|>"])
    w.add_eos_token_id(vocab["<|im_end|>"])
    w.add_pad_token_id(vocab["<|endoftext|>"])
    w.add_chat_template(CHAT_TEMPLATE)
  for key, value in (extra or {}).items():
    if isinstance(value, str):
      w.add_string(key, value)
    else:
      w.add_uint32(key, value)
  state = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
  if cfg.tie_word_embeddings:
    state.pop("lm_head.weight", None)
  for hf, value in state.items():
    name = gguf_name(hf)
    if name in drop:
      continue
    if arch == "llama" and hf.endswith(("q_proj.weight", "k_proj.weight")):
      value = permute(value, cfg.num_attention_heads if "q_proj" in hf
                      else cfg.num_key_value_heads)
    kind = gguf.GGMLQuantizationType[(tensor_types or {}).get(name, qtype)]
    block = gguf.GGML_QUANT_SIZES[kind][0]
    if value.ndim != 2 or value.shape[-1] % block:
      kind = gguf.GGMLQuantizationType.F32
    try:
      data = gguf.quants.quantize(np.ascontiguousarray(value, np.float32), kind)
    except NotImplementedError:  # a type gguf cannot make: its bytes, as a file would hold them
      data = np.zeros(gguf.quant_shape_to_byte_shape(value.shape, kind), np.uint8)
    w.add_tensor(name, data, raw_dtype=kind)
  w.write_header_to_file()
  w.write_kv_data_to_file()
  w.write_tensors_to_file()
  w.close()
  return path
