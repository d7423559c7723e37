"""Writes a random-init Hugging Face model folder of a real architecture's exact shape.

    python tools/make_random_model.py --preset qwen2.5-0.5b --out /tmp/qwen0.5b-random
    python tools/make_random_model.py --preset llama-3.2-1b --out /tmp/llama1b-random
    python tools/make_random_model.py --preset qwen2.5-7b --out /tmp/q7 --config-only
    python tools/make_random_model.py --preset qwen2.5-0.5b --out /tmp/t \\
        --override num_hidden_layers=2 hidden_size=64 intermediate_size=128 \\
                   num_attention_heads=4 num_key_value_heads=2 head_dim=16 vocab_size=512

So a real-size run (memory, compile time, checkpoint size) can be measured on a
machine that cannot download: the folder has the real `config.json`, bf16
`*.safetensors` shards named as `models/hf_names.py` names them (one shard per
layer, written one at a time, so the whole model is never held in float32), a
byte-level BPE `tokenizer.json` trained on the spot on the built-in arithmetic
task's text and padded with unreachable dummy entries up to the model's vocab,
a `tokenizer_config.json` with a Qwen-style `<|im_start|>`/`<|im_end|>` chat
template, and a `generation_config.json`.  Weights are N(0, 0.02) (the HF
`initializer_range`), norms 1, biases 0: the model is untrained, so what it
generates is noise; only shapes, dtypes and timings are real.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, Iterator, Sequence

import numpy as np

_SHAPES = Path(__file__).resolve().parent / "model_shapes"

# The HF config.json of each preset.  Qwen's come from tools/model_shapes/ (real files).
_LLAMA_3_2_1B: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 128256,
    "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16,
    "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 64, "hidden_act": "silu",
    "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "tie_word_embeddings": True,
    "max_position_embeddings": 131072, "attention_bias": False, "mlp_bias": False,
    "torch_dtype": "bfloat16",
    # models/config.py implements llama3 RoPE scaling (ModelConfig.rope_llama3).
    "rope_scaling": {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                     "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
}
PRESETS = {"qwen2.5-0.5b": "qwen2.5-0.5b", "qwen2.5-7b": "qwen2.5-7b",
           "qwen2.5-72b": "qwen2.5-72b", "llama-3.2-1b": _LLAMA_3_2_1B}
# Too big to write here: config.json only, for `plan --memory`.
CONFIG_ONLY = ("qwen2.5-7b", "qwen2.5-72b")

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# BPE merges learned beyond the 256 bytes: enough for the arithmetic text.
_BPE_SIZE = 2048


def hf_config(preset: str, overrides: Sequence[str] = ()) -> dict[str, Any]:
  """The preset's config.json dictionary with `key=value` overrides (values parsed as JSON)."""
  if preset not in PRESETS:
    raise SystemExit(f"unknown preset {preset!r}; valid: {', '.join(sorted(PRESETS))}")
  src = PRESETS[preset]
  d = dict(src) if isinstance(src, dict) else json.loads(
      (_SHAPES / src / "config.json").read_text())
  for item in overrides:
    key, sep, value = item.partition("=")
    if not sep:
      raise SystemExit(f"--override {item!r}: expected key=value")
    try:
      d[key] = json.loads(value)
    except json.JSONDecodeError:
      d[key] = value
  d.setdefault("head_dim", d["hidden_size"] // d["num_attention_heads"])
  d.setdefault("initializer_range", 0.02)
  return d


def corpus() -> list[str]:
  """Text to learn merges from: the built-in arithmetic task, as the chat template shows it."""
  from distflow_jax.tasks import arithmetic  # pylint: disable=import-outside-toplevel
  recs = arithmetic.make_examples(arithmetic.ArithmeticConfig(), "train", 2000, seed=0)
  return [f"user\n{r['prompt']}\nassistant\n{r['answer']}" for r in recs]


def build_tokenizer(vocab_size: int):
  """A byte-level BPE (`tokenizers.Tokenizer`) of exactly `vocab_size` ids.

  Ids 0-2 are the specials; then the 256 bytes and learned merges; then
  `<|dummy_i|>` model entries that no merge produces (so never emitted), which
  fill the vocabulary up to the embedding's rows as a real checkpoint's does.
  """
  from tokenizers import (  # pylint: disable=import-outside-toplevel
      Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers)
  base = len(SPECIALS) + 256
  if vocab_size < base:
    raise SystemExit(f"vocab_size {vocab_size} < {base} (specials + 256 bytes)")
  tok = Tokenizer(models.BPE())
  # Qwen2's own normalizer and split (digits one by one): transformers 5 rebuilds a
  # qwen2 folder's tokenizer with these whatever tokenizer.json says, so ids agree only so.
  tok.normalizer = normalizers.NFC()
  tok.pre_tokenizer = pre_tokenizers.Sequence([
      pre_tokenizers.Split(Regex(_QWEN2_SPLIT), behavior="isolated"),
      pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
  tok.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(vocab_size=min(vocab_size, _BPE_SIZE), special_tokens=SPECIALS,
                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                show_progress=False)
  tok.train_from_iterator(corpus(), trainer=trainer)
  d = json.loads(tok.to_str())
  vocab = d["model"]["vocab"]
  for i in range(vocab_size - len(vocab)):
    vocab[f"<|dummy_{i}|>"] = len(vocab)
  for t in d["added_tokens"]:
    t.update(special=True, normalized=False)
  return Tokenizer.from_str(json.dumps(d))


def write_tokenizer(out: Path, vocab_size: int, max_len: int) -> dict[str, int]:
  """Writes the three tokenizer files; returns the special ids."""
  tok = build_tokenizer(vocab_size)
  tok.save(str(out / "tokenizer.json"))
  ids = {s: tok.token_to_id(s) for s in SPECIALS}
  config = {
      "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>",
      "pad_token": "<|endoftext|>", "bos_token": None, "unk_token": None,
      "model_max_length": max_len, "chat_template": CHAT_TEMPLATE,
      "clean_up_tokenization_spaces": False,
  }
  (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
  gen = {"bos_token_id": ids["<|endoftext|>"], "pad_token_id": ids["<|endoftext|>"],
         "eos_token_id": [ids["<|im_end|>"], ids["<|endoftext|>"]], "do_sample": True}
  (out / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
  return ids


def _normal(rng: np.random.Generator, shape: tuple[int, ...], std: float) -> np.ndarray:
  """bf16 N(0, std), drawn 64 Mi values at a time so a big embedding never sits in float32."""
  import ml_dtypes  # pylint: disable=import-outside-toplevel
  out = np.empty(shape, ml_dtypes.bfloat16)
  flat = out.reshape(-1)
  step = 1 << 26
  for i in range(0, flat.size, step):
    n = min(step, flat.size - i)
    flat[i:i + n] = (rng.standard_normal(n, dtype=np.float32) * std).astype(ml_dtypes.bfloat16)
  return out


def shards(d: dict[str, Any], seed: int) -> Iterator[tuple[str, dict[str, np.ndarray]]]:
  """(file name, {HF tensor name: bf16 array}) per shard: embeddings, one per layer, head."""
  import ml_dtypes  # pylint: disable=import-outside-toplevel
  rng = np.random.default_rng(seed)
  std = float(d.get("initializer_range", 0.02))
  h, inter, vocab = d["hidden_size"], d["intermediate_size"], d["vocab_size"]
  hd, nh, nkv = d["head_dim"], d["num_attention_heads"], d["num_key_value_heads"]
  n_layers = d["num_hidden_layers"]
  arch = d["model_type"]
  ones = lambda n: np.ones((n,), ml_dtypes.bfloat16)  # pylint: disable=unnecessary-lambda-assignment
  total = n_layers + 2
  yield (f"model-00001-of-{total:05d}.safetensors",
         {"model.embed_tokens.weight": _normal(rng, (vocab, h), std)})
  for i in range(n_layers):
    p = f"model.layers.{i}."
    t = {p + "input_layernorm.weight": ones(h), p + "post_attention_layernorm.weight": ones(h),
         p + "self_attn.q_proj.weight": _normal(rng, (nh * hd, h), std),
         p + "self_attn.k_proj.weight": _normal(rng, (nkv * hd, h), std),
         p + "self_attn.v_proj.weight": _normal(rng, (nkv * hd, h), std),
         p + "self_attn.o_proj.weight": _normal(rng, (h, nh * hd), std),
         p + "mlp.gate_proj.weight": _normal(rng, (inter, h), std),
         p + "mlp.up_proj.weight": _normal(rng, (inter, h), std),
         p + "mlp.down_proj.weight": _normal(rng, (h, inter), std)}
    if arch == "qwen2":
      for n, size in (("q", nh * hd), ("k", nkv * hd), ("v", nkv * hd)):
        t[p + f"self_attn.{n}_proj.bias"] = np.zeros((size,), ml_dtypes.bfloat16)
    if arch == "qwen3":
      t[p + "self_attn.q_norm.weight"] = ones(hd)
      t[p + "self_attn.k_norm.weight"] = ones(hd)
    yield f"model-{i + 2:05d}-of-{total:05d}.safetensors", t
  head = {"model.norm.weight": ones(h)}
  if not d.get("tie_word_embeddings", arch != "llama"):
    head["lm_head.weight"] = _normal(rng, (vocab, h), std)
  yield f"model-{total:05d}-of-{total:05d}.safetensors", head


def write(out: Path, d: dict[str, Any], seed: int = 0, config_only: bool = False) -> None:
  """Writes the folder: config.json (+ tokenizer files and weight shards unless config_only)."""
  out.mkdir(parents=True, exist_ok=True)
  d = dict(d, torch_dtype="bfloat16")
  if not config_only:
    ids = write_tokenizer(out, d["vocab_size"], int(d.get("max_position_embeddings", 2048)))
    d.update(bos_token_id=ids["<|endoftext|>"], eos_token_id=ids["<|im_end|>"])
  (out / "config.json").write_text(json.dumps(d, indent=2, sort_keys=True) + "\n")
  if config_only:
    return
  from safetensors.numpy import save_file  # pylint: disable=import-outside-toplevel
  weight_map, total_bytes = {}, 0
  for name, tensors in shards(d, seed):
    save_file(tensors, str(out / name), metadata={"format": "pt"})
    for k, v in tensors.items():
      weight_map[k] = name
      total_bytes += v.nbytes
  index = {"metadata": {"total_size": total_bytes}, "weight_map": dict(sorted(weight_map.items()))}
  (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


def main(argv: Sequence[str] | None = None) -> None:
  ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
  ap.add_argument("--preset", required=True, choices=sorted(PRESETS))
  ap.add_argument("--out", required=True, type=Path)
  ap.add_argument("--override", nargs="*", default=[], metavar="KEY=VALUE",
                  help="config.json entries to change (JSON values), e.g. num_hidden_layers=2")
  ap.add_argument("--seed", type=int, default=0)
  ap.add_argument("--config-only", action="store_true",
                  help="write config.json alone (implied for qwen2.5-7b / 72b)")
  args = ap.parse_args(argv)
  d = hf_config(args.preset, args.override)
  config_only = args.config_only or (args.preset in CONFIG_ONLY and not args.override)
  write(args.out, d, args.seed, config_only)
  print(f"wrote {args.out} ({'config only' if config_only else 'weights + tokenizer'})",
        file=sys.stderr)


if __name__ == "__main__":
  main()
