"""Generates the built-in tiny tokenizer (deterministic): character level, digits single tokens.

    python tools/make_tiny_tokenizer.py [OUT_DIR]   # default: distflow_jax/assets

Writes `tiny_tokenizer.json` (a `tokenizers` BPE model with no merges, so every
character is one token) and `tiny_tokenizer_config.json` (special tokens and a
compact chat template: `<|user|>text<|im_end|><|assistant|>`).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

SPECIALS = ["<|pad|>", "<|endoftext|>", "<|im_end|>", "<|system|>", "<|user|>",
            "<|assistant|>", "<|unk|>"]
CHARS = ["\n", "\t"] + [chr(c) for c in range(32, 127)]

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('unknown role ' + message['role']) }}{% endif %}"
    "{{ '<|' + message['role'] + '|>' + message['content'] + '<|im_end|>' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}")


def build():
  """Returns (tokenizers.Tokenizer, config dict)."""
  from tokenizers import AddedToken, Tokenizer, decoders, models  # pylint: disable=import-outside-toplevel
  vocab = {tok: i for i, tok in enumerate(SPECIALS + CHARS)}
  tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<|unk|>"))
  tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in SPECIALS])
  tok.decoder = decoders.Fuse()
  config = {
      "tokenizer_class": "PreTrainedTokenizerFast",
      "eos_token": "<|im_end|>",
      "pad_token": "<|pad|>",
      "unk_token": "<|unk|>",
      "bos_token": None,
      "model_max_length": 1024,
      "chat_template": CHAT_TEMPLATE,
  }
  return tok, config


def write(out_dir: Path) -> None:
  tok, config = build()
  out_dir.mkdir(parents=True, exist_ok=True)
  tok.save(str(out_dir / "tiny_tokenizer.json"))
  (out_dir / "tiny_tokenizer_config.json").write_text(
      json.dumps(config, indent=2, sort_keys=True) + "\n")


if __name__ == "__main__":
  write(Path(sys.argv[1]) if len(sys.argv) > 1 else
        Path(__file__).resolve().parents[1] / "distflow_jax" / "assets")
