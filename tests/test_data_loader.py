"""Prompt loader: sharding, shuffling, tokenisation, bad rows, exact state restore."""

import json
import logging

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from distflow_jax.data import loader as loader_lib
from distflow_jax.config.loading import ConfigError
from distflow_jax.data.loader import BadRowError, PromptLoader, TooFewRowsError, epoch_seed


class CharTokenizer:
  """Character-level stand-in: id = code point + 1 (0 is padding)."""

  def encode(self, text):
    return [ord(c) + 1 for c in text]

  def apply_chat_template(self, messages, add_generation_prompt=True):
    body = "".join(f"<{m['role']}>{m['content']}" for m in messages)
    return body + ("<assistant>" if add_generation_prompt else "")


class PlainTokenizer:
  def encode(self, text):
    return [ord(c) + 1 for c in text]


def _records(n):
  return [{"prompt": f"q{i}", "answer": str(i), "data_source": "toy"}
          for i in range(n)]


def _write_jsonl(path, rows):
  with open(path, "wb") as f:
    for r in rows:
      f.write(r if isinstance(r, bytes) else json.dumps(r).encode())
      f.write(b"\n")
  return str(path)


def _loader(path, **kw):
  base = dict(batch_size=2, max_prompt_len=32, seed=3, process_index=0,
              process_count=1)
  return PromptLoader(path, CharTokenizer(), **{**base, **kw})


def _records_seen(ld, num_batches):
  out = []
  for _ in range(num_batches):
    b = next(ld)
    out.extend(b.host[int(s)]["record"] for s in b.data["sample_id"])
  return out


@pytest.mark.parametrize("count", [1, 2, 3])
def test_shards_are_disjoint_and_cover_each_epoch(tmp_path, count):
  path = _write_jsonl(tmp_path / "d.jsonl", _records(11))
  for epoch in range(2):
    seen = []
    for p in range(count):
      ld = _loader(path, batch_size=1, process_index=p, process_count=count)
      ld.set_state({**ld.get_state(), "epoch": epoch})
      n = len(range(p, 11, count))
      seen.append(_records_seen(ld, n))
    flat = [r for s in seen for r in s]
    assert sorted(flat) == list(range(11))  # disjoint (no repeats) and covering
    for a in range(count):
      for b in range(a + 1, count):
        assert not set(seen[a]) & set(seen[b])


def test_shuffle_depends_on_seed_and_epoch_only(tmp_path):
  path = _write_jsonl(tmp_path / "d.jsonl", _records(40))
  a = _records_seen(_loader(path, batch_size=4, seed=7), 20)
  b = _records_seen(_loader(path, batch_size=4, seed=7), 20)
  c = _records_seen(_loader(path, batch_size=4, seed=8), 20)
  assert a == b
  assert a[:40] != c[:40]
  # Two epochs: each a permutation of all records, in different orders.
  assert sorted(a[:40]) == sorted(a[40:]) == list(range(40))
  assert a[:40] != a[40:]
  assert epoch_seed(7, 0) != epoch_seed(7, 1)
  # No shuffle: file order.
  assert _records_seen(_loader(path, batch_size=4, shuffle=False), 2) == list(range(8))


def test_sample_ids_unique_across_epochs(tmp_path):
  path = _write_jsonl(tmp_path / "d.jsonl", _records(5))
  ld = _loader(path, batch_size=5)
  first, second = next(ld), next(ld)
  ids = np.concatenate([first.data["sample_id"], second.data["sample_id"]])
  assert len(set(ids.tolist())) == 10
  np.testing.assert_array_equal(np.sort(second.data["sample_id"]), np.arange(5, 10))
  np.testing.assert_array_equal(first.data["group_id"], first.data["sample_id"])


def test_restoring_state_reproduces_next_batches(tmp_path):
  rows = _records(9)
  rows[4] = {"prompt": "", "answer": "x"}  # a skipped row inside the stream
  path = _write_jsonl(tmp_path / "d.jsonl", rows)
  ld = _loader(path, batch_size=4)
  for _ in range(3):
    next(ld)
  state = json.loads(json.dumps(ld.get_state()))  # must survive JSON
  want = [next(ld) for _ in range(4)]  # crosses epoch boundaries
  other = _loader(path, batch_size=4)
  other.set_state(state)
  got = [next(other) for _ in range(4)]
  for w, g in zip(want, got):
    for k in w.data:
      np.testing.assert_array_equal(w.data[k], g.data[k])
    assert w.host == g.host
  assert other.counts == ld.counts


def test_set_state_refuses_other_configuration(tmp_path):
  path = _write_jsonl(tmp_path / "d.jsonl", _records(6))
  state = _loader(path).get_state()
  with pytest.raises(ValueError, match="seed=3.*seed=4"):
    _loader(path, seed=4).set_state(state)
  with pytest.raises(ValueError, match="process_count"):
    _loader(path, process_index=0, process_count=2).set_state(state)


def test_tokenisation_chat_template_and_padding(tmp_path):
  rows = [{"prompt": "hi", "answer": "1"},
          {"prompt": [{"role": "system", "content": "S"},
                      {"role": "user", "content": "yo"}], "answer": "2"}]
  path = _write_jsonl(tmp_path / "d.jsonl", rows)
  b = next(_loader(path, shuffle=False, max_prompt_len=40))
  tok = CharTokenizer()
  want0 = tok.encode("<user>hi<assistant>")
  want1 = tok.encode("<system>S<user>yo<assistant>")
  np.testing.assert_array_equal(b.data["prompt_len"], [len(want0), len(want1)])
  np.testing.assert_array_equal(b.data["prompt_ids"][0, :len(want0)], want0)
  np.testing.assert_array_equal(b.data["prompt_ids"][0, len(want0):], 0)
  np.testing.assert_array_equal(b.data["prompt_ids"][1, :len(want1)], want1)
  assert b.data["prompt_ids"].shape == (2, 40)
  h = b.host[int(b.data["sample_id"][0])]
  assert h == {"prompt": "hi", "prompt_text": "<user>hi<assistant>", "answer": "1",
               "data_source": "d", "record": 0}
  # Without a chat template (or with it switched off) the raw text is encoded.
  plain = PromptLoader(path, PlainTokenizer(), batch_size=2, max_prompt_len=40,
                       shuffle=False, process_index=0, process_count=1)
  np.testing.assert_array_equal(next(plain).data["prompt_len"], [2, 4])  # "S\nyo"
  off = _loader(path, shuffle=False, use_chat_template=False)
  np.testing.assert_array_equal(next(off).data["prompt_ids"][0, :2], tok.encode("hi"))


BAD_ROWS = [
    (b'{"prompt": "ok0", "answer": "0"}', None),
    (b'{"prompt": "broken", ', "bad_json"),
    (b'[1, 2]', "bad_json"),
    (b'{"prompt": "caf\xe9", "answer": "1"}', "not_utf8"),
    (b'{"prompt": "lone \\ud800", "answer": "1"}', "not_utf8"),
    (b'{"answer": "2"}', "missing_field"),
    (b'{"prompt": "no answer"}', "missing_field"),
    (b'{"prompt": 5, "answer": "2"}', "missing_field"),
    (b'{"prompt": "   ", "answer": "3"}', "empty_prompt"),
    (b'{"prompt": [], "answer": "3"}', "empty_prompt"),
    (b'{"prompt": "' + b"x" * 30 + b'", "answer": "4"}', "too_long"),
    (b'{"prompt": "ok1", "answer": "5", "data_source": "gsm"}', None),
]


def test_bad_rows_are_counted_and_skipped(tmp_path, caplog):
  path = _write_jsonl(tmp_path / "d.jsonl", [r for r, _ in BAD_ROWS])
  ld = _loader(path, shuffle=False, max_prompt_len=30, num_epochs=1)
  with caplog.at_level(logging.WARNING, logger=loader_lib.__name__):
    b = next(ld)
  assert [b.host[int(s)]["record"] for s in b.data["sample_id"]] == [0, 11]
  assert b.host[int(b.data["sample_id"][1])]["data_source"] == "gsm"
  want = {r: 0 for r in loader_lib.REASONS}
  for _, reason in BAD_ROWS:
    if reason:
      want[reason] += 1
  assert ld.counts == {"ok": 2, **want, "blank_lines": 0}
  assert sum(ld.counts.values()) == len(BAD_ROWS)
  assert f"{path}:2: bad_json" in caplog.text
  with pytest.raises(StopIteration):
    next(ld)


def test_bad_rows_refused_with_error_policy(tmp_path):
  path = _write_jsonl(tmp_path / "d.jsonl", [r for r, _ in BAD_ROWS])
  ld = _loader(path, shuffle=False, on_bad_row="error")
  with pytest.raises(BadRowError, match=r"d\.jsonl:2: bad_json.*on_bad_row=skip"):
    next(ld)
  assert ld.counts["bad_json"] == 1
  # Blank lines count in the line number a user looks up in an editor.
  lines = open(path, "rb").read().splitlines()
  blanked = tmp_path / "blank.jsonl"
  blanked.write_bytes(b"\n\n" + lines[0] + b"\n\n" + b"\n".join(lines[1:]) + b"\n")
  with pytest.raises(BadRowError, match=r"blank\.jsonl:5: bad_json"):
    next(_loader(str(blanked), shuffle=False, on_bad_row="error"))
  with pytest.raises(ValueError, match=r"valid values: \['skip', 'error'\]"):
    _loader(path, on_bad_row="drop")


def test_shard_without_valid_rows_fails_instead_of_spinning(tmp_path):
  path = _write_jsonl(tmp_path / "d.jsonl", [{"prompt": "", "answer": "1"}] * 3)
  with pytest.raises(ValueError, match="no valid rows"):
    next(_loader(path))


def test_parquet_matches_jsonl_and_checks_binary_utf8(tmp_path):
  rows = _records(7)
  jpath = _write_jsonl(tmp_path / "d.jsonl", rows)
  ppath = str(tmp_path / "d.parquet")
  pq.write_table(pa.Table.from_pylist(rows), ppath)
  a, b = _loader(jpath, batch_size=3), _loader(ppath, batch_size=3)
  for _ in range(3):
    x, y = next(a), next(b)
    for k in x.data:
      np.testing.assert_array_equal(x.data[k], y.data[k])
  bpath = str(tmp_path / "b.parquet")
  pq.write_table(pa.table({"prompt": pa.array([b"fine", b"\xff\xfe"], pa.binary()),
                           "answer": ["1", "2"]}), bpath)
  ld = _loader(bpath, batch_size=1, shuffle=False, num_epochs=1)
  first = next(ld)
  assert first.host[int(first.data["sample_id"][0])]["prompt"] == "fine"
  with pytest.raises(StopIteration):
    next(ld)
  assert ld.counts["not_utf8"] == 1


def test_unknown_suffix_and_missing_file(tmp_path):
  (tmp_path / "d.csv").write_text("prompt,answer\n")
  with pytest.raises(ValueError, match=r"valid suffixes are \['.jsonl'"):
    _loader(str(tmp_path / "d.csv"))
  with pytest.raises(FileNotFoundError, match="nope.jsonl"):
    _loader(str(tmp_path / "nope.jsonl"))


def test_blank_lines_are_counted_and_reported(tmp_path, caplog):
  path = tmp_path / "d.jsonl"
  rows = [json.dumps(r) for r in _records(4)]
  path.write_text(rows[0] + "\n\n" + rows[1] + "\n   \n" + rows[2] + "\n" + rows[3] + "\n\n")
  with caplog.at_level(logging.WARNING, logger=loader_lib.__name__):
    ld = _loader(str(path), batch_size=4, shuffle=False, num_epochs=1)
  assert "3 blank line(s) skipped, the first at line 2" in caplog.text
  assert ld.num_records == 4
  b = next(ld)
  assert [b.host[int(s)]["prompt"] for s in b.data["sample_id"]] == ["q0", "q1", "q2", "q3"]
  assert ld.counts == {"ok": 4, **{r: 0 for r in loader_lib.REASONS}, "blank_lines": 3}
  assert "blank_lines" not in ld.get_state()["counts"]  # a property of the file, not a position
  again = _loader(str(path), batch_size=4, shuffle=False, num_epochs=1)
  again.set_state(ld.get_state())
  assert again.counts == ld.counts


@pytest.mark.parametrize("records, count, batch, pattern", [
    (5, 1, 8, r"has 5 records \(5 per process over 1 process\(es\)\), fewer than the batch "
              r"of 8 per process .*data\.eval_size"),
    (9, 2, 5, r"has 9 records \(4 per process over 2 process\(es\)\), fewer than the batch "
              r"of 5"),
])
def test_finite_loader_smaller_than_a_batch_is_refused_at_once(tmp_path, records, count,
                                                               batch, pattern):
  path = _write_jsonl(tmp_path / "eval.jsonl", _records(records))
  with pytest.raises(TooFewRowsError, match=pattern) as e:
    _loader(path, batch_size=batch, num_epochs=1, process_count=count, process_index=count - 1)
  assert isinstance(e.value, ConfigError) and "\n" not in str(e.value)


@pytest.mark.parametrize("prompts, pattern", [
    (["x" * 40] * 4, r"gave 0 valid prompt\(s\), fewer than one batch of 2; bad rows "
                     r"\{'too_long': 4\}"),
    (["x" * 40, "ok", "x" * 40], r"gave 1 valid prompt\(s\), fewer than one batch of 2; "
                                 r"bad rows \{'too_long': 2\}"),
])
def test_finite_loader_without_a_batch_of_valid_rows_names_the_counts(tmp_path, prompts,
                                                                      pattern):
  path = _write_jsonl(tmp_path / "eval.jsonl", [{"prompt": p, "answer": "1"} for p in prompts])
  ld = _loader(path, batch_size=2, num_epochs=1, max_prompt_len=32)

  def first_batch():  # as the trainer takes its evaluation batch, inside a generator
    yield next(iter(ld))

  with pytest.raises(TooFewRowsError, match=pattern) as e:
    next(first_batch())
  assert "\n" not in str(e.value)


def test_finite_loader_still_stops_after_full_batches(tmp_path):
  path = _write_jsonl(tmp_path / "d.jsonl", _records(5))
  ld = _loader(path, batch_size=2, num_epochs=1)
  assert len(list(ld)) == 2  # the partial last batch is dropped, as before


@pytest.mark.parametrize("n, count", [(10, 1), (9, 2)])
def test_an_endless_loader_of_bad_rows_counts_each_row_once(tmp_path, n, count):
  """A training loader (endless epochs) whose every row is bad stops after one whole pass
  of its shard, and its counts are that shard's rows, not more (it said 12 of 10)."""
  path = _write_jsonl(tmp_path / "d.jsonl", [{"prompt": "x" * 40, "answer": "1"}] * n)
  shard = len(range(count - 1, n, count))
  ld = _loader(path, batch_size=2, num_epochs=None, max_prompt_len=32,
               process_count=count, process_index=count - 1)
  with pytest.raises(TooFewRowsError, match=rf"has no valid rows; bad rows "
                                            rf"\{{'too_long': {shard}\}}"):
    next(iter(ld))
