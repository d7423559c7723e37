"""Packed rows with shared prompts: a group's prompt laid once, its responses after it.

With ``model.share_prompt_prefix`` the batch's rows come in groups of ``group_size``
consecutive rows with one prompt (hidden.py, "Shared prompts").  Packed per sample
(packing.py), each row would carry its own copy of the prompt: a GRPO group of 8 responses
to a 200-token prompt packs 1,600 prompt tokens where 200 say the same.  Here the packing
unit is a group: its prompt's real tokens once, then each response's real tokens less the
last (which predicts nothing), with

* ``seg``: the prompt ``g * PROMPT_STRIDE`` and the group's k-th laid response
  ``g * PROMPT_STRIDE + k`` (g = 1, 2, ... the unit's place in its row; segments.py), so a
  response sees its group's prompt and itself, never a sibling response;
* ``pos``: the prompt 0 .. Lp - 1 and every response Lp, Lp + 1, ... (the positions the
  padded row gives it);
* ``src``: the prompt's tokens read from the unit's first sample (all of a group's rows
  hold the same prompt), each response's from its own row;
* ``out``: response token 0 of every sample of the unit points at the one slot of the last
  prompt token (several samples read it), token t at its response's slot t - 1.

A group whose unit would exceed ``pack_len`` is split into several units, each with its own
copy of the prompt (a sample alone always fits: packing.check_fits), so no batch is refused
for it: ``place_rows`` (packing.plan) spreads its responses into the rows' gaps,
``group_units`` (token-budget micro-batches) cuts it where the next response would overflow.
A unit never spans rows, shards or micro-batches; a group that fits a row stays in one.  The numbers are those of the
padded pass: each response token sees exactly the keys it sees in its padded row.
"""

from __future__ import annotations

import numpy as np

from distflow_jax.models.segments import PROMPT_STRIDE

Unit = tuple[int, ...]  # samples sharing one laid prompt, the first one supplies it


def prompt_lengths(cols: list[np.ndarray], p: int) -> np.ndarray:
  """Per sample: its real prompt tokens (the compact columns below ``p``)."""
  return np.array([int((c < p).sum()) for c in cols], np.int64)


def group_units(samples: range | list[int], lengths: np.ndarray, prompt_len: np.ndarray,
                group_size: int, pack_len: int) -> tuple[list[Unit], np.ndarray]:
  """The units of ``samples`` (consecutive groups of ``group_size``) and their lengths:
  per group, its samples with a response, cut where the next would overflow ``pack_len``."""
  samples = list(samples)
  if group_size >= PROMPT_STRIDE:
    raise ValueError(f"shared-prompt packing: rollout.n={group_size} responses per prompt "
                     f"exceed the segment ids' {PROMPT_STRIDE - 1}; set "
                     f"model.share_prompt_prefix=False")
  if len(samples) % group_size:
    raise ValueError(f"shared-prompt packing: {len(samples)} rows are not whole groups of "
                     f"{group_size}; keep each prompt's rollout.n samples together")
  units: list[Unit] = []
  sizes: list[int] = []
  for g in range(0, len(samples), group_size):
    unit: list[int] = []
    size = 0
    for b in samples[g:g + group_size]:
      if lengths[b] <= 0:
        continue  # no response token to predict: nothing to lay
      lp, fed = int(prompt_len[b]), int(lengths[b] - prompt_len[b])
      if unit and size + fed > pack_len:
        units.append(tuple(unit))
        sizes.append(size)
        unit, size = [], 0
      if not unit:
        size = lp
      unit.append(b)
      size += fed
    if unit:
      units.append(tuple(unit))
      sizes.append(size)
  return units, np.array(sizes, np.int64)


def place_rows(samples: range | list[int], lengths: np.ndarray, prompt_len: np.ndarray,
               group_size: int, pack_len: int) -> list[list[Unit]]:
  """The packed rows of ``samples`` (consecutive groups of ``group_size``), each a list of
  units, first-fit decreasing over groups:

  * a group that fits a row (its prompt once plus its responses' fed tokens) goes whole, as
    one unit, into the first row with room, else into a new row: one prompt copy per group;
  * a longer group is spread response by response (longest first) into the first row
    already holding its prompt with room for the response, else the first row with room
    for the prompt and the response (a new unit: another prompt copy), else a new row; so
    its pieces fill the gaps the other groups leave instead of opening half-empty rows."""
  units, sizes = group_units(samples, lengths, prompt_len, group_size, 1 << 62)
  rows: list[list[list[int]]] = []
  free: list[int] = []

  def first_row(room: int, group=None) -> int:
    for j, f in enumerate(free):
      if f >= room and (group is None or any(u[0] in group for u in rows[j])):
        return j
    return -1

  def new_row() -> int:
    rows.append([])
    free.append(pack_len)
    return len(rows) - 1

  for i in np.argsort(-sizes, kind="stable"):
    group, size = units[i], int(sizes[i])
    if size <= pack_len:
      j = first_row(size)
      j = new_row() if j < 0 else j
      rows[j].append(list(group))
      free[j] -= size
      continue
    lp = int(prompt_len[group[0]])
    for b in sorted(group, key=lambda x: -int(lengths[x])):
      fed = int(lengths[b]) - lp
      j = first_row(fed, group)
      if j >= 0:
        next(u for u in rows[j] if u[0] in group).append(b)
        free[j] -= fed
        continue
      j = first_row(lp + fed)
      j = new_row() if j < 0 else j
      rows[j].append([b])
      free[j] -= lp + fed
  return [[tuple(u) for u in row] for row in rows]


def fill_rows(shard_bins, units: list[Unit], cols, lengths, prompt_len, n: int,
              p_plus_n: int, pack_len: int, rows_per_shard: int, num_samples: int
              ) -> dict[str, np.ndarray]:
  """packing.fill_rows for units: ``shard_bins[s][j]`` lists the units (indices into
  ``units``, whose samples index ``cols`` / ``lengths``) laid in row j of shard s."""
  num_rows = rows_per_shard * len(shard_bins)
  src = np.zeros((num_rows, pack_len), np.int32)
  pos = np.zeros((num_rows, pack_len), np.int32)
  seg = np.zeros((num_rows, pack_len), np.int32)
  out = np.zeros((num_samples, n), np.int32)
  p = p_plus_n - n
  most = (1 << 31) // PROMPT_STRIDE - 1  # group ids g * PROMPT_STRIDE + k stay int32
  for s, bins in enumerate(shard_bins):
    for j, bin_ in enumerate(bins):
      if len(bin_) > most:
        raise ValueError(f"shared-prompt packing: {len(bin_)} prompt groups in one packed row "
                         f"exceed the segment ids' {most}; lower model.pack_len")
      row, at = s * rows_per_shard + j, 0
      for g, u in enumerate(bin_, start=1):
        first = units[u][0]
        lp = int(prompt_len[first])
        src[row, at:at + lp] = first * p_plus_n + cols[first][:lp]
        pos[row, at:at + lp] = np.arange(lp)
        seg[row, at:at + lp] = g * PROMPT_STRIDE
        last_prompt = row * pack_len + at + lp - 1
        at += lp
        for k, b in enumerate(units[u], start=1):
          resp = cols[b][lp:] - p  # response columns of sample b
          fed = int(lengths[b]) - lp
          src[row, at:at + fed] = b * p_plus_n + p + resp[:fed]
          pos[row, at:at + fed] = lp + np.arange(fed)
          seg[row, at:at + fed] = g * PROMPT_STRIDE + k
          if lp:
            out[b, resp[0]] = last_prompt
          # Response token q >= 1 is predicted by the slot of response token q - 1.
          out[b, resp[1:fed + 1]] = row * pack_len + at + np.arange(min(fed, len(resp) - 1))
          at += fed
  return {"src": src, "pos": pos, "seg": seg, "out": out}
