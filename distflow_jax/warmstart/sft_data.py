"""SFT examples from a JSONL/Parquet file: prompt/answer rows or chat ``messages`` rows.

A row is either ``{<data.prompt_key>: text or messages, <data.answer_key>: completion}``
(the answer is the target completion) or ``{"messages": [{role, content}, ...]}``: a
conversation gives one example per assistant turn (its prompt is the conversation
before the turn), so every assistant turn is trained on and nothing else.  Prompts
are rendered and tokenized as the RL loader does (``rows.parse_row``); the
completion gets EOS and must fit ``rollout.max_new_tokens`` (what the trained
model may generate).  Bad rows follow ``data.on_bad_row``: skipped and counted, or
refused; every refusal is a ``ConfigError`` naming the file and line.

    pairs = read_pairs(path, cfg.data)                       # [Pair], rows split into turns
    enc = encode(pairs, tokenizer, cfg, log)                 # Encoded: arrays + answers
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from distflow_jax.config.errors import ConfigError
from distflow_jax.data.loader import OnBadRow
from distflow_jax.data.rows import parse_row
from distflow_jax.data.sources import BadRow, open_source
from distflow_jax.models.tokenizer import Tokenizer
from distflow_jax.data.fields import PROMPT_MASK, PROMPT_TOKENS, RESPONSE_MASK, RESPONSE_TOKENS

MESSAGES = "messages"


@dataclasses.dataclass(frozen=True)
class Pair:
  """One example: the prompt (text or chat messages) and the completion to learn."""
  prompt: Any
  completion: str
  where: str   # file:line of its row
  row: int     # index of its row (the turns of one conversation share it)


@dataclasses.dataclass
class Encoded:
  """The RL batch layout of a list of pairs (see warmstart.encode_examples)."""
  data: dict[str, np.ndarray]
  pairs: list[Pair]

  def __len__(self) -> int:
    return len(self.pairs)

  def take(self, idx: Sequence[int]) -> "Encoded":
    idx = np.asarray(idx, int)
    return Encoded({k: v[idx] for k, v in self.data.items()}, [self.pairs[i] for i in idx])


def _turns(raw: dict, where: str, row: int) -> list[Pair] | BadRow:
  msgs = raw[MESSAGES]
  if not isinstance(msgs, (list, tuple)) or not all(
      isinstance(m, dict) and isinstance(m.get("content"), str) for m in msgs):
    return BadRow("missing_field", f"field {MESSAGES!r} must be a list of "
                  f"{{'role', 'content'}} messages with text content")
  turns = [i for i, m in enumerate(msgs) if m.get("role") == "assistant" and i > 0]
  if not turns:
    return BadRow("missing_field", f"field {MESSAGES!r} has no assistant turn after a "
                  f"prompt (roles {[m.get('role') for m in msgs]})")
  # An empty assistant turn is nothing to learn (it would train EOS alone); it stays in
  # the prompts of the turns after it.
  out = [Pair(list(msgs[:i]), msgs[i]["content"], where, row) for i in turns
         if msgs[i]["content"].strip()]
  if not out:
    return BadRow("empty_answer", f"field {MESSAGES!r}: every assistant turn is empty")
  return out


def _pairs_of(raw: dict | BadRow, where: str, row: int, prompt_key: str, answer_key: str
              ) -> list[Pair] | BadRow:
  if isinstance(raw, BadRow):
    return raw
  if prompt_key not in raw and MESSAGES in raw:
    return _turns(raw, where, row)
  for key in (prompt_key, answer_key):
    if raw.get(key) is None:
      return BadRow("missing_field", f"no {key!r} field (row has {sorted(raw)}); set "
                    f"data.prompt_key / data.answer_key, or give chat rows a {MESSAGES!r} list")
  answer = raw[answer_key]
  if not isinstance(answer, str):
    return BadRow("missing_field", f"field {answer_key!r} must be text, got "
                  f"{type(answer).__name__}")
  if not answer.strip():
    return BadRow("empty_answer", f"field {answer_key!r} is empty (no target to learn; is "
                  f"data.answer_key the right field?)")
  return [Pair(raw[prompt_key], answer, where, row)]


class BadRows:
  """Counts bad rows by reason; refuses the first under ``on_bad_row=error``."""

  def __init__(self, on_bad_row: str, log: Callable[[str], None]):
    self.error = OnBadRow(on_bad_row) is OnBadRow.ERROR
    self.log = log
    self.counts: dict[str, int] = {}
    self.first: dict[str, str] = {}

  def add(self, where: str, bad: BadRow) -> None:
    if self.error:
      raise ConfigError(f"{where}: {bad.detail} (data.on_bad_row=error; fix the row or set "
                        f"data.on_bad_row=skip)")
    if bad.reason not in self.counts:
      self.first[bad.reason] = f"{where}: {bad.detail}"
      self.log(f"sft: skipping bad rows ({bad.reason}), the first {where}: {bad.detail}")
    self.counts[bad.reason] = self.counts.get(bad.reason, 0) + 1

  def summary(self) -> str:
    if not self.counts:
      return "no bad rows"
    return "; ".join(f"{n} {r} (first {self.first[r]})" for r, n in sorted(self.counts.items()))


def read_pairs(path: str, data_cfg: Any, bad: BadRows) -> tuple[list[Pair], int]:
  """Every example of ``path`` (rows split into turns) and the number of rows."""
  try:
    source = open_source(path)
  except (OSError, ValueError) as e:
    raise ConfigError(f"sft data {path!r}: {e}") from None
  if len(source) == 0:
    raise ConfigError(f"sft data {path!r} has no rows; give a JSONL/Parquet file of "
                      f"{data_cfg.prompt_key!r}/{data_cfg.answer_key!r} or {MESSAGES!r} rows")
  out: list[Pair] = []
  for i in range(len(source)):
    got = _pairs_of(source[i], source.where(i), i, data_cfg.prompt_key, data_cfg.answer_key)
    if isinstance(got, BadRow):
      bad.add(source.where(i), got)
    else:
      out.extend(got)
  return out, len(source)


def encode(pairs: Sequence[Pair], tokenizer: Tokenizer, cfg: Any, bad: BadRows) -> Encoded:
  """Left-padded prompts and right-padded completion + EOS; too-long pairs are bad rows."""
  plen, rlen = cfg.data.max_prompt_len, cfg.rollout.max_new_tokens
  rows, kept = [], []
  for i, p in enumerate(pairs):
    ex = parse_row({"prompt": p.prompt, "answer": p.completion}, i, tokenizer=tokenizer,
                   max_prompt_len=plen, use_chat_template=cfg.data.chat_template)
    if isinstance(ex, BadRow):
      bad.add(p.where, ex)
      continue
    out = list(tokenizer.encode(p.completion)) + [tokenizer.eos_id]
    if len(out) > rlen:
      bad.add(p.where, BadRow("too_long", f"{len(out)} completion tokens (with EOS) > "
                              f"rollout.max_new_tokens {rlen}; raise it or shorten the answer"))
      continue
    rows.append((ex.prompt_ids, out))
    kept.append(p)
  n = len(rows)
  data = {PROMPT_TOKENS: np.full((n, plen), tokenizer.pad_id, np.int32),
          PROMPT_MASK: np.zeros((n, plen), bool),
          RESPONSE_TOKENS: np.full((n, rlen), tokenizer.pad_id, np.int32),
          RESPONSE_MASK: np.zeros((n, rlen), bool)}
  for i, (ids, out) in enumerate(rows):
    data[PROMPT_TOKENS][i, plen - len(ids):] = ids
    data[PROMPT_MASK][i, plen - len(ids):] = True
    data[RESPONSE_TOKENS][i, :len(out)] = out
    data[RESPONSE_MASK][i, :len(out)] = True
  return Encoded(data, kept)


def split_rows(pairs: list[Pair], num_rows: int, eval_size: int, seed: int
               ) -> tuple[list[Pair], list[Pair]]:
  """(train, held-out): ``eval_size`` rows drawn with ``seed`` are held out whole (all the
  turns of a held-out conversation), so no held-out answer is trained on."""
  held = set(np.random.default_rng([seed, 17]).permutation(num_rows)[:eval_size].tolist())
  return ([p for p in pairs if p.row not in held], [p for p in pairs if p.row in held])
