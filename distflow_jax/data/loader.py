"""Per-process prompt loader: a grain pipeline over this process's shard.

Per epoch the pipeline is ``range(records) -> shuffle(seed, epoch) ->
[process_index::process_count] -> map(read + validate + render + tokenize)``; the
map step is :func:`~distflow_jax.data.rows.parse_row`, whose module says what a row's
fields and images may be.  Every process computes the same shuffle, so the shards of one
epoch are disjoint and together cover the dataset; the shuffle (hence the shard) changes
every epoch.

The iterator yields host-local :class:`~distflow_jax.data.batch.Batch`es of
exactly ``batch_size`` valid prompts and runs across epoch boundaries, so all
processes produce batches in lock-step even when their shards lose different
numbers of bad rows.  Its state (epoch, position in the shard, bad-row counts)
is a small JSON-able dict; restoring it reproduces the following batches
exactly.

Malformed rows (unreadable JSON, non-UTF-8, missing field, empty prompt or answer,
prompt longer than ``max_prompt_len`` tokens, an image that is missing, not an image or
over ``max_image_pixels``) are counted by reason and either
skipped (``on_bad_row="skip"``, with a warning on the first of each reason) or
refused (``on_bad_row="error"``, raising :class:`BadRowError`).  Blank JSONL lines
are not records; the loader warns about them and reports their number in
``counts["blank_lines"]`` (for the whole file, on every process).

A loader with a finite ``num_epochs`` (an evaluation set) that cannot fill its
first batch raises :class:`TooFewRowsError`, one line with the counts: at
construction when the file has too few records, while iterating when too many
of them are malformed (all too long, say).
"""

from __future__ import annotations

import enum
import logging
import os
from typing import Any

import grain
import jax
import numpy as np

from distflow_jax.config.errors import ConfigError
from distflow_jax.data import images as images_lib
from distflow_jax.data.batch import GROUP_ID, SAMPLE_ID, Batch
from distflow_jax.data.rows import REASONS, Example, Tokenizer, parse_row
from distflow_jax.data.sources import RecordSource, open_source

log = logging.getLogger(__name__)


# Rows kept whose prompt holds the tokenizer's unknown token: counted, not bad.
UNK_PROMPTS = "unk_prompts"

class OnBadRow(enum.Enum):
  SKIP = "skip"
  ERROR = "error"


class BadRowError(ConfigError):
  """A malformed row met with ``on_bad_row="error"``; names the file and line."""


class TooFewRowsError(ConfigError):
  """The data cannot fill a batch: too few records, or too few valid ones."""


def epoch_seed(seed: int, epoch: int) -> int:
  """Shuffle seed of an epoch; the same on every process."""
  return int(np.random.SeedSequence([seed, epoch]).generate_state(1)[0])


def _parse_on_bad_row(value: OnBadRow | str) -> OnBadRow:
  try:
    return OnBadRow(value)
  except ValueError:
    raise ValueError(f"on_bad_row={value!r} is not valid; valid values: "
                     f"{[v.value for v in OnBadRow]}") from None


class PromptLoader:
  """Iterator of host-local prompt batches from this process's shard."""

  def __init__(self, path_or_source: str | RecordSource, tokenizer: Tokenizer, *,
               batch_size: int, max_prompt_len: int, seed: int = 0,
               shuffle: bool = True, process_index: int | None = None,
               process_count: int | None = None,
               on_bad_row: OnBadRow | str = OnBadRow.SKIP, pad_id: int = 0,
               num_epochs: int | None = None, prompt_key: str = "prompt",
               answer_key: str = "answer", source_key: str = "data_source",
               use_chat_template: bool = True, image_key: str = "", image_root: str = "",
               image_processor: images_lib.ImageProcessor | None = None,
               max_image_pixels: int = images_lib.DEFAULT_MAX_IMAGE_PIXELS):
    if process_index is None or process_count is None:
      # after distributed.initialize(), like grain's ShardByJaxProcess
      process_index, process_count = jax.process_index(), jax.process_count()
    if not 0 <= process_index < process_count:
      raise ValueError(f"process_index {process_index} is not in "
                       f"[0, {process_count})")
    if batch_size < 1 or max_prompt_len < 1:
      raise ValueError(f"batch_size ({batch_size}) and max_prompt_len "
                       f"({max_prompt_len}) must be >= 1")
    self.source = (open_source(path_or_source)
                   if isinstance(path_or_source, (str, os.PathLike))
                   else path_or_source)
    if len(self.source) < process_count:
      raise TooFewRowsError(f"{self.source.path!r} has {len(self.source)} records, "
                            f"fewer than the {process_count} processes reading it")
    shard = len(self.source) // process_count  # the smallest shard: the same on all processes
    if num_epochs is not None and shard * num_epochs < batch_size:
      raise TooFewRowsError(
          f"{self.source.path!r} has {len(self.source)} records ({shard} per process over "
          f"{process_count} process(es)), fewer than the batch of {batch_size} per process "
          f"that {num_epochs} pass(es) over it must fill; ask for fewer (for an evaluation "
          f"set: data.eval_size) or use a larger file")
    blank = getattr(self.source, "blank_lines", 0)
    if blank:
      log.warning("%r: %d blank line(s) skipped, the first at line %d (they are not rows; "
                  "counted in loader.counts['blank_lines'])", self.source.path, blank,
                  self.source.first_blank_line)
    self.tokenizer = tokenizer
    self.batch_size = batch_size
    self.max_prompt_len = max_prompt_len
    self.seed = seed
    self.shuffle = shuffle
    self.process_index = process_index
    self.process_count = process_count
    self.on_bad_row = _parse_on_bad_row(on_bad_row)
    self.pad_id = pad_id
    self.num_epochs = num_epochs
    self._parse_kw = dict(
        tokenizer=tokenizer, max_prompt_len=max_prompt_len, prompt_key=prompt_key,
        answer_key=answer_key, source_key=source_key,
        default_source=os.path.splitext(os.path.basename(self.source.path))[0],
        use_chat_template=use_chat_template)
    if image_key:
      if not isinstance(max_image_pixels, int) or max_image_pixels < 1:
        raise ValueError(f"max_image_pixels={max_image_pixels!r} must be a positive integer")
      images_lib.require_pillow()
      # A tokenizer without the vision tokens is refused here, in one line.
      image_pad = images_lib.vision_token_ids(tokenizer)[images_lib.IMAGE_PAD]
      if image_root and not os.path.isdir(image_root):
        raise ConfigError(f"data.image_root={image_root!r} is not a folder (image paths are "
                          f"read from it; '' = the data file's folder)")
      self._parse_kw.update(
          image_key=image_key,
          image_dir=os.path.abspath(image_root or os.path.dirname(self.source.path)),
          image_processor=image_processor or images_lib.ImageProcessor(),
          max_image_pixels=max_image_pixels, image_pad_id=image_pad)
    self._epoch = 0
    self._position = 0
    self._counts = {"ok": 0, **{r: 0 for r in REASONS}}
    self._first_bad: dict[str, str] = {}  # reason -> its first row met, for the summary
    self._dataset = self._epoch_dataset(0)

  def short_epochs(self) -> str:
    """Where a batch asks for more rows than this process's shard has (every batch then
    repeats rows): a line saying so; "" otherwise."""
    shard = len(self.source) // self.process_count
    if shard >= self.batch_size:
      return ""
    return (f"{len(self.source)} row(s) ({shard} per process), fewer than the "
            f"{self.batch_size} prompts each step draws per process: every step repeats "
            f"rows, each about {self.batch_size / max(shard, 1):.1f} times")

  @property
  def num_records(self) -> int:
    return len(self.source)

  def _epoch_dataset(self, epoch: int) -> grain.MapDataset:
    ds = grain.MapDataset.range(len(self.source))
    if self.shuffle:
      ds = ds.shuffle(seed=epoch_seed(self.seed, epoch))
    ds = ds[self.process_index::self.process_count]
    return ds.map(lambda i: (int(i), parse_row(self.source[int(i)], int(i),
                                               **self._parse_kw)))

  @property
  def counts(self) -> dict[str, int]:
    """Rows accepted (``ok``) and rows refused, by reason, so far; and the blank lines of
    the file (``blank_lines``: all of them, not just this shard's)."""
    return {**self._counts, "blank_lines": int(getattr(self.source, "blank_lines", 0))}

  def __iter__(self) -> "PromptLoader":
    return self

  def _next_example(self) -> tuple[int, Example]:
    """The next valid example of this shard and the epoch it belongs to."""
    scanned = 0
    while True:
      if self._position >= len(self._dataset):
        if self.num_epochs is not None and self._epoch + 1 >= self.num_epochs:
          raise StopIteration
        self._epoch += 1
        self._position = 0
        self._dataset = self._epoch_dataset(self._epoch)
      record, item = self._dataset[self._position]
      self._position += 1
      scanned += 1
      if isinstance(item, Example):
        self._counts["ok"] += 1
        if item.host.get("unk_tokens"):  # kept, but counted and said once
          self._counts[UNK_PROMPTS] = self._counts.get(UNK_PROMPTS, 0) + 1
          if self._counts[UNK_PROMPTS] == 1:
            log.warning("%s: %d of its prompt's tokens are the tokenizer's unknown token "
                        "(characters its vocabulary lacks); such prompts are kept and counted "
                        "(data/unk_prompts)", _where(self.source, record),
                        item.host["unk_tokens"])
        return self._epoch, item
      self._counts[item.reason] += 1
      where = f"{_where(self.source, record)}: {item.reason}: {item.detail}"
      self._first_bad.setdefault(item.reason, where)
      if self.on_bad_row is OnBadRow.ERROR:
        raise BadRowError(f"{where} (data.on_bad_row=error; fix the row or set "
                          f"--config.data.on_bad_row=skip to count and skip such rows)")
      if self._counts[item.reason] == 1:
        log.warning("skipping malformed row %s (further %s rows are counted, "
                    "see loader.counts)", where, item.reason)
      if self.num_epochs is None and scanned >= len(self._dataset):  # a pass, all bad
        raise TooFewRowsError(f"shard {self.process_index}/{self.process_count} of "
                              f"{self.source.path!r} has no valid rows; "
                              f"{self._bad_summary()}")

  def _bad_summary(self) -> str:
    bad = {k: v for k, v in self.counts.items() if k not in ("ok", UNK_PROMPTS) and v}
    first = "".join(f"; first {r}: {w}" for r, w in self._first_bad.items())
    return (f"bad rows {bad}{first} (see data.max_prompt_len, data.prompt_key/answer_key, "
            f"data.image_key, data.on_bad_row)" if bad else "no bad rows")

  def __next__(self) -> Batch:
    pairs = []
    while len(pairs) < self.batch_size:
      try:
        pairs.append(self._next_example())
      except StopIteration:
        # The end of the last epoch.  After a full batch it ends the iteration (a partial
        # last batch is dropped); before the first one the data cannot fill a batch.
        if self._counts["ok"] > len(pairs):
          raise
        raise TooFewRowsError(
            f"{self.source.path!r}: {self.num_epochs} pass(es) over shard "
            f"{self.process_index}/{self.process_count} ({len(self._dataset)} records) gave "
            f"{len(pairs)} valid prompt(s), fewer than one batch of {self.batch_size}; "
            f"{self._bad_summary()}" + (
                f"; for an evaluation set, lower data.eval_size so that each of the "
                f"{self.process_count} process(es) needs at most {len(pairs)}" if pairs
                else "")) from None
    ids = np.full((self.batch_size, self.max_prompt_len), self.pad_id, np.int32)
    for r, (_, ex) in enumerate(pairs):
      ids[r, :ex.prompt_ids.size] = ex.prompt_ids
    sample_ids = np.array([e * self.num_records + ex.record for e, ex in pairs],
                          dtype=np.int64)
    if sample_ids.max() > np.iinfo(np.int32).max:
      raise ValueError(f"sample id {sample_ids.max()} overflows int32 after "
                       f"{self._epoch} epochs of {self.num_records} records")
    sample_ids = sample_ids.astype(np.int32)
    data = {"prompt_ids": ids,
            "prompt_len": np.array([ex.prompt_ids.size for _, ex in pairs], np.int32),
            SAMPLE_ID: sample_ids, GROUP_ID: sample_ids.copy()}
    host = {int(s): ex.host for s, (_, ex) in zip(sample_ids, pairs)}
    return Batch(data, host)

  def steps_per_epoch(self) -> int:
    """Batches per epoch if no row were malformed; the same on every process."""
    return (len(self.source) // self.process_count) // self.batch_size

  def get_state(self) -> dict[str, Any]:
    """JSON-able state; :meth:`set_state` on it reproduces the next batches."""
    return {"epoch": self._epoch, "position": self._position,
            "counts": dict(self._counts), "seed": self.seed,
            "num_records": self.num_records, "process_index": self.process_index,
            "process_count": self.process_count}

  def set_state(self, state: dict[str, Any]) -> None:
    for key in ("seed", "num_records", "process_index", "process_count"):
      if state.get(key) != getattr(self, key):
        raise ValueError(f"loader state was saved with {key}={state.get(key)!r} "
                         f"but this loader has {key}={getattr(self, key)!r}")
    self._epoch = int(state["epoch"])
    self._position = int(state["position"])
    self._counts = {"ok": 0, **{r: 0 for r in REASONS}, **state["counts"]}
    self._dataset = self._epoch_dataset(self._epoch)


def _where(source: Any, record: int) -> str:
  """Where record ``record`` is in its file: ``path:line`` for JSONL, else ``path row N``."""
  where = getattr(source, "where", None)
  return where(record) if where is not None else f"{source.path} record {record}"
