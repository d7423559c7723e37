"""The tokenizer of a GGUF file (its ``tokenizer.ggml.*`` metadata) as tokenizer.json and
tokenizer_config.json.

    tok, config = tokenizer_files(path, meta)   # tokenizers.Tokenizer, tokenizer_config dict

Byte-level BPE only (``tokenizer.ggml.model = gpt2``: Llama 3, Qwen2, SmolLM): the
vocabulary and merges as the file spells them, the split its pre-tokenizer names
(``tokenizer.ggml.pre``, llama.cpp's names; an unknown one is refused, since text would
split otherwise than in training), control tokens as special tokens, user-defined ones as
plain added tokens, bos / eos / unk / pad and the chat template into the config.  Anything
else is a `GGUFError` naming the file.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import tokenizers
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers

from distflow_jax.models.errors import GGUFError
from distflow_jax.models.tokenizer import _bytes_to_unicode

# tokenizer.ggml.pre -> how text is split before BPE (llama.cpp's pre-tokenizer names).
_LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
           r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
          r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_SPLITS = {"llama3": _LLAMA3, "llama-v3": _LLAMA3, "llama-bpe": _LLAMA3, "smaug-bpe": _LLAMA3,
           "dbrx": _LLAMA3, "falcon3": _LLAMA3, "qwen2": _QWEN2, "deepseek-r1-qwen": _QWEN2}
_GPT2_STYLE = ("default", "gpt2", "gpt-2")  # GPT-2's own split (ByteLevel's regex)
_DIGITS_THEN_GPT2 = ("smollm",)  # digits one by one, then GPT-2's split (SmolLM's tokenizer)
PRE_TOKENIZERS = tuple(sorted([*_SPLITS, *_GPT2_STYLE, *_DIGITS_THEN_GPT2]))
_CONTROL, _USER_DEFINED = 3, 4  # tokenizer.ggml.token_type values


def tokenizer_files(path: Path, meta: dict[str, Any]) -> tuple[tokenizers.Tokenizer, dict]:
  """(tokenizer.json's tokenizer, tokenizer_config.json) from the file's metadata."""
  if "tokenizer.ggml.tokens" not in meta:
    raise GGUFError(f"{path} holds no tokenizer (no 'tokenizer.ggml.tokens'): a model "
                    f"without its tokenizer cannot be trained or evaluated")
  kind = meta.get("tokenizer.ggml.model")
  if kind != "gpt2":
    raise GGUFError(f"{path}: tokenizer model {kind!r} is not supported; supported: 'gpt2' "
                    f"(byte-level BPE, as in Llama 3, Qwen2, SmolLM)")
  if "tokenizer.ggml.merges" not in meta:
    raise GGUFError(f"{path}: its byte-level BPE tokenizer has no 'tokenizer.ggml.merges'")
  pre = meta.get("tokenizer.ggml.pre", "default")
  if pre not in PRE_TOKENIZERS:
    raise GGUFError(f"{path}: pre-tokenizer {pre!r} (tokenizer.ggml.pre) is not known here, "
                    f"so its text would split differently from the model's training; known: "
                    f"{', '.join(PRE_TOKENIZERS)}")
  tokens = list(meta["tokenizer.ggml.tokens"])
  spelling = _bytes_to_unicode()
  alphabet = set(spelling.values())
  vocab = {}
  for i, t in enumerate(tokens):
    vocab.setdefault(t if set(t) <= alphabet else "".join(spelling[b] for b in t.encode()), i)
  merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
  tok = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=merges, dropout=None,
                                        continuing_subword_prefix="", end_of_word_suffix="",
                                        fuse_unk=False))
  if pre in _SPLITS:
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(_SPLITS[pre]), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
  elif pre in _DIGITS_THEN_GPT2:
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
  else:
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
  tok.decoder = decoders.ByteLevel()
  types = list(meta.get("tokenizer.ggml.token_type") or [])
  special = [t for t, k in zip(tokens, types) if k == _CONTROL and set(t) <= alphabet]
  plain = [t for t, k in zip(tokens, types) if k == _USER_DEFINED and t in vocab]
  tok.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in special])
  tok.add_tokens([AddedToken(t, normalized=False, special=False) for t in plain])

  def token(key: str) -> str | None:
    i = meta.get(f"tokenizer.ggml.{key}_token_id")
    if i is None:
      return None
    if not 0 <= int(i) < len(tokens):
      raise GGUFError(f"{path}: tokenizer.ggml.{key}_token_id = {i} is outside its "
                      f"{len(tokens)} tokens")
    return tokens[int(i)]

  eos = token("eos")
  if eos is None:
    raise GGUFError(f"{path} has no 'tokenizer.ggml.eos_token_id': generation would not stop")
  config: dict[str, Any] = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": eos,
                            "bos_token": token("bos"), "unk_token": token("unknown"),
                            "pad_token": token("padding") or eos,
                            "add_bos_token": bool(meta.get("tokenizer.ggml.add_bos_token", False)),
                            "add_eos_token": bool(meta.get("tokenizer.ggml.add_eos_token", False)),
                            "model_max_length": int(meta.get(
                                f"{meta.get('general.architecture')}.context_length", 2048))}
  if "tokenizer.chat_template" in meta:
    config["chat_template"] = str(meta["tokenizer.chat_template"])
  return tok, config
