"""Tokenizer: `tokenizers.Tokenizer` from a local directory, plus a chat template.

    tok = Tokenizer.from_dir("/ckpt/qwen2.5-0.5b")     # tokenizer.json [+ tokenizer_config.json]
    tok = Tokenizer.builtin()                          # the tiny built-in one (assets/)
    text = tok.apply_chat_template([{"role": "user", "content": "What is 12 + 7?"}])
    ids = tok.encode(text)
    tok.decode(ids)

EOS: `eos_id` is `tokenizer_config.json`'s `eos_token`; `eos_ids` adds every
id listed by `generation_config.json` (chat models stop on several).  `pad_id`
falls back to `eos_id` when no pad token is configured.  The chat template
(`chat_template` in `tokenizer_config.json`, or `chat_template.jinja`) is
rendered with jinja2 in a sandbox, with HF's helpers (`raise_exception`,
`tojson`).

The built-in tokenizer is character level (digits are single tokens, all
printable ASCII, newline, tab) with special tokens `<|pad|>`,
`<|endoftext|>`, `<|im_end|>` (end of turn = EOS), `<|system|>`, `<|user|>`,
`<|assistant|>`, `<|unk|>`; see tools/make_tiny_tokenizer.py.

Saving (`save`, used by exports and checkpoints) writes a tokenizer that
`transformers.AutoTokenizer` loads with the same ids.  transformers 5 rebuilds
the tokenizer of a `qwen2` model as byte-level BPE from tokenizer.json's vocab
and merges alone (its own pre-tokenizer and decoder, whatever the file or
`tokenizer_class` say), so a character-level vocabulary such as the built-in
one would lose every space and newline; it is saved as the equivalent
byte-level BPE (`byte_level_json`): the same ids on every text of its
characters.  Byte-level BPE tokenizers (Qwen, Llama 3) are saved as they are.
"""

from __future__ import annotations

import json
import os
import shutil
from importlib import resources
from pathlib import Path
from typing import Any, Sequence

import tokenizers

from distflow_jax import io_errors
from distflow_jax.models.errors import ModelFileError, ModelFileNotFoundError, read_json_object

TOKENIZER_FILE = "tokenizer.json"
CONFIG_FILE = "tokenizer_config.json"
BUILTIN_TOKENIZER = "tiny_tokenizer.json"
BUILTIN_CONFIG = "tiny_tokenizer_config.json"


def _bytes_to_unicode() -> dict[int, str]:
  """GPT-2's byte -> printable character table, the alphabet of byte-level BPE vocabularies."""
  bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("\u00a1"), ord("\u00ac") + 1)) + \
      list(range(ord("\u00ae"), ord("\u00ff") + 1))
  cs = bs[:]
  n = 0
  for b in range(256):
    if b not in bs:
      bs.append(b)
      cs.append(256 + n)
      n += 1
  return {b: chr(c) for b, c in zip(bs, cs)}


def byte_level_json(tok: tokenizers.Tokenizer) -> str | None:
  """tokenizer.json of a character-level BPE tokenizer (no pre-tokenizer, no merges, every
  regular token one byte long) rewritten as byte-level BPE with the same ids, which
  transformers loads faithfully whatever tokenizer class it picks; None for any other
  tokenizer (saved as it is).  Text of the vocabulary's characters encodes and decodes
  the same; a character outside it (unknown either way) becomes one unknown token per
  UTF-8 byte instead of one per character."""
  d = json.loads(tok.to_str())
  model = d.get("model") or {}
  if model.get("type") != "BPE" or d.get("pre_tokenizer") is not None or model.get("merges"):
    return None
  special = {t["content"] for t in d.get("added_tokens", [])}
  regular = [t for t in model["vocab"] if t not in special]
  if not regular or any(len(t.encode("utf-8")) != 1 for t in regular):
    return None
  table = _bytes_to_unicode()
  model["vocab"] = {(t if t in special else table[t.encode("utf-8")[0]]): i
                    for t, i in model["vocab"].items()}
  # No regex split (there are no merges to keep apart) and no prefix space: one token a byte.
  d["pre_tokenizer"] = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True,
                        "use_regex": False}
  d["decoder"] = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True,
                  "use_regex": False}
  return json.dumps(d, ensure_ascii=False, indent=2)


def _token_str(value: Any) -> str | None:
  if isinstance(value, dict):  # HF AddedToken serialisation
    return value.get("content")
  return value


class Tokenizer:
  """Thin wrapper: encode / decode / special ids / chat template."""

  def __init__(self, tokenizer: tokenizers.Tokenizer, config: dict[str, Any] | None = None,
               generation_config: dict[str, Any] | None = None):
    self.tok = tokenizer
    self.config = dict(config or {})
    self.generation_config = dict(generation_config or {})
    self.eos_token = _token_str(self.config.get("eos_token"))
    if self.eos_token is None:
      raise ValueError("tokenizer config has no eos_token (needed to stop generation)")
    self.eos_id = self._id(self.eos_token, "eos_token")
    pad = _token_str(self.config.get("pad_token"))
    self.pad_token = pad if pad is not None else self.eos_token
    self.pad_id = self._id(self.pad_token, "pad_token")
    bos = _token_str(self.config.get("bos_token"))
    self.bos_token = bos
    self.bos_id = None if bos is None else self._id(bos, "bos_token")
    extra = self.generation_config.get("eos_token_id", [])
    extra = [i for i in (extra if isinstance(extra, list) else [extra]) if i is not None]
    self.eos_ids = tuple(dict.fromkeys([self.eos_id, *extra]))
    self.chat_template = self.config.get("chat_template")
    if self.chat_template is not None and not isinstance(self.chat_template, str):
      raise ValueError(f"chat_template must be a string, got a {type(self.chat_template).__name__}"
                       " (named templates are not supported)")
    self.template_source: str | None = None  # the file the chat template came from
    self._compiled = None
    # The id text the vocabulary cannot spell becomes (None: none, as in byte-level BPE).
    unk = _token_str(self.config.get("unk_token")) or getattr(self.tok.model, "unk_token", None)
    self.unk_id = None if not unk else self.tok.token_to_id(unk)

  def _id(self, token: str, what: str) -> int:
    i = self.tok.token_to_id(token)
    if i is None:
      raise ValueError(f"{what} {token!r} is not in the tokenizer's vocabulary")
    return i

  @classmethod
  def from_files(cls, tokenizer_json: str | os.PathLike,
                 config_json: str | os.PathLike | None = None,
                 generation_config_json: str | os.PathLike | None = None) -> "Tokenizer":
    """Errors are `ModelFileError`s naming the file that cannot be used."""
    try:
      tok = tokenizers.Tokenizer.from_file(str(tokenizer_json))
    except Exception as e:  # pylint: disable=broad-except  (tokenizers raises plain Exception)
      if not Path(tokenizer_json).exists():
        raise ModelFileNotFoundError(f"missing {tokenizer_json}") from None
      raise ModelFileError(f"{tokenizer_json} is not a readable tokenizers file: "
                           f"{str(e).splitlines()[0] if str(e) else type(e).__name__}") from None
    config = read_json_object(config_json, "tokenizer config") if config_json else {}
    gen = (read_json_object(generation_config_json, "generation config")
           if generation_config_json else {})
    eos = gen.get("eos_token_id", [])
    if not all(i is None or isinstance(i, int) and not isinstance(i, bool) and i >= 0
               for i in (eos if isinstance(eos, list) else [eos])):
      raise ModelFileError(f"{generation_config_json}: eos_token_id must be a token id or a list "
                           f"of them, got {eos!r}")
    try:
      out = cls(tok, config, gen)
    except (ValueError, TypeError) as e:
      where = config_json if config_json else f"{tokenizer_json} (no {CONFIG_FILE})"
      raise ModelFileError(f"{where}: {e}") from None
    out.template_source = str(config_json) if out.chat_template is not None else None
    return out

  @classmethod
  def from_dir(cls, path: str | os.PathLike) -> "Tokenizer":
    """Loads `tokenizer.json` (+ `tokenizer_config.json`, `generation_config.json`,
    `chat_template.jinja` when present) from a local directory."""
    path = Path(path)
    if not path.is_dir():
      raise ModelFileNotFoundError(f"tokenizer directory {path} does not exist")
    if not (path / TOKENIZER_FILE).exists():
      raise ModelFileNotFoundError(f"missing {path / TOKENIZER_FILE} (only the fast tokenizer "
                                   "format is supported)")
    cfg = path / CONFIG_FILE
    gen = path / "generation_config.json"
    out = cls.from_files(path / TOKENIZER_FILE, cfg if cfg.exists() else None,
                         gen if gen.exists() else None)
    template = path / "chat_template.jinja"
    if out.chat_template is None and template.exists():
      try:
        out.chat_template = template.read_text(encoding="utf-8")
      except (OSError, UnicodeDecodeError) as e:
        raise ModelFileError(f"cannot read {template}: {e}") from None
      out.template_source = str(template)
    return out

  @classmethod
  def builtin(cls) -> "Tokenizer":
    """The tiny character-level tokenizer shipped in `distflow_jax/assets/`."""
    assets = resources.files("distflow_jax") / "assets"
    with resources.as_file(assets / BUILTIN_TOKENIZER) as t, \
         resources.as_file(assets / BUILTIN_CONFIG) as c:
      return cls.from_files(t, c)

  @property
  def vocab_size(self) -> int:
    return self.tok.get_vocab_size(with_added_tokens=True)

  def same_ids(self, other: "Tokenizer") -> bool:
    """Whether both give every id the same text: equal vocabularies, or the same tokens
    written another way (a character vocabulary and its byte-level equivalent, as ``save``
    writes the built-in one)."""
    mine, theirs = (t.tok.get_vocab(with_added_tokens=True) for t in (self, other))
    if mine == theirs:
      return True
    if len(mine) != len(theirs):
      return False
    ids = [[i] for i in range(self.vocab_size)]
    return (self.tok.decode_batch(ids, skip_special_tokens=False)
            == other.tok.decode_batch(ids, skip_special_tokens=False))

  def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
    return self.tok.encode(text, add_special_tokens=add_special_tokens).ids

  def encode_batch(self, texts: Sequence[str], add_special_tokens: bool = False) -> list[list[int]]:
    return [e.ids for e in self.tok.encode_batch(list(texts), add_special_tokens=add_special_tokens)]

  def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
    return self.tok.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

  def apply_chat_template(self, messages: Sequence[dict[str, str]],
                          add_generation_prompt: bool = True, tokenize: bool = False,
                          **kwargs: Any) -> str | list[int]:
    """Renders `messages` ([{"role", "content"}, ...]) with the configured chat template."""
    if self.chat_template is None:
      raise ValueError("this tokenizer has no chat_template (tokenizer_config.json)")
    if self._compiled is None:
      import jinja2  # pylint: disable=import-outside-toplevel
      try:
        self._compiled = _jinja_env().from_string(self.chat_template)
      except jinja2.TemplateSyntaxError as e:
        raise ModelFileError(f"{self.template_source or 'chat_template'}: the chat template "
                             f"does not parse: {e.message} (template line {e.lineno})") from None
    text = self._compiled.render(messages=list(messages), add_generation_prompt=add_generation_prompt,
                                 bos_token=self.bos_token or "", eos_token=self.eos_token,
                                 pad_token=self.pad_token, **kwargs)
    return self.encode(text) if tokenize else text

  def save(self, path: str | os.PathLike) -> None:
    """Writes `tokenizer.json` and `tokenizer_config.json`, which transformers'
    `AutoTokenizer` loads with our ids (see the module doc)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    converted = byte_level_json(self.tok)
    if converted is None:
      with io_errors.writing(path / TOKENIZER_FILE):  # a Rust error names no path
        self.tok.save(str(path / TOKENIZER_FILE))
    else:
      (path / TOKENIZER_FILE).write_text(converted, encoding="utf-8")
    config = dict(self.config)
    config.setdefault("tokenizer_class", "PreTrainedTokenizerFast")
    config.setdefault("pad_token", self.pad_token)
    if self.chat_template is not None:
      config["chat_template"] = self.chat_template
    (path / CONFIG_FILE).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    if self.generation_config:
      (path / "generation_config.json").write_text(json.dumps(self.generation_config, indent=2))


def _jinja_env():
  # Imported lazily: only chat templating needs jinja2.
  import jinja2  # pylint: disable=import-outside-toplevel
  from jinja2 import sandbox  # pylint: disable=import-outside-toplevel

  def raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)

  def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)

  env = sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                              extensions=["jinja2.ext.loopcontrols"])
  env.filters["tojson"] = tojson
  env.globals["raise_exception"] = raise_exception
  return env


def copy_tokenizer_files(src: str | os.PathLike, dst: str | os.PathLike) -> None:
  """Copies a checkpoint's tokenizer files verbatim (keeps formats this wrapper ignores)."""
  for name in (TOKENIZER_FILE, CONFIG_FILE, "generation_config.json", "chat_template.jinja",
               "special_tokens_map.json"):
    if (Path(src) / name).exists():
      shutil.copy(Path(src) / name, Path(dst) / name)
