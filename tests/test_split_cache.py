"""tasks/split_cache.py: a built-in split comes from the cache only as the verified bytes
the generator writes, under a key naming everything it depends on."""

import importlib.util
import os
import sys

import pytest

from distflow_jax.tasks import registry as tasks
from distflow_jax.tasks import split_cache

pytestmark = pytest.mark.timeout(120)

ARGS = dict(seed=0, unique=False)


def _fresh(tmp_path, monkeypatch, name="fresh.jsonl", **kw):
  """The split as the generator writes it, the cache off."""
  monkeypatch.setenv(split_cache.ENV, "")
  path = str(tmp_path / name)
  assert split_cache.write_split(tasks.TASKS["arithmetic"], "basic", "train", 500,
                                 path=path, **{**ARGS, **kw}) is False
  return open(path, "rb").read()


def test_a_second_write_comes_from_the_cache_with_the_same_bytes(tmp_path, monkeypatch):
  want = _fresh(tmp_path, monkeypatch)
  monkeypatch.setenv(split_cache.ENV, str(tmp_path / "cache"))
  task = tasks.TASKS["arithmetic"]
  first, second = str(tmp_path / "a" / "t.jsonl"), str(tmp_path / "b" / "t.jsonl")
  assert split_cache.write_split(task, "basic", "train", 500, path=first, **ARGS) is False
  assert split_cache.write_split(task, "basic", "train", 500, path=second, **ARGS) is True
  assert open(first, "rb").read() == open(second, "rb").read() == want
  assert sorted(os.listdir(tmp_path / "cache")) == sorted(
      [split_cache.key(task, "basic", "train", 500, 0, False) + e for e in (".jsonl", ".sha256")])


def test_a_damaged_copy_is_regenerated_never_used(tmp_path, monkeypatch):
  want = _fresh(tmp_path, monkeypatch)
  monkeypatch.setenv(split_cache.ENV, str(tmp_path / "cache"))
  task = tasks.TASKS["arithmetic"]
  split_cache.write_split(task, "basic", "train", 500, path=str(tmp_path / "x.jsonl"), **ARGS)
  base = tmp_path / "cache" / split_cache.key(task, "basic", "train", 500, 0, False)
  data = (base.with_suffix(".jsonl")).read_bytes()
  (base.with_suffix(".jsonl")).write_bytes(data.replace(b"####", b"#### 1", 1))  # one row off
  out = str(tmp_path / "y.jsonl")
  assert split_cache.write_split(task, "basic", "train", 500, path=out, **ARGS) is False
  assert open(out, "rb").read() == want
  assert split_cache.write_split(task, "basic", "train", 500, path=out, **ARGS) is True
  (base.with_suffix(".sha256")).unlink()  # a copy without its sum is not read either
  assert split_cache.write_split(task, "basic", "train", 500, path=out, **ARGS) is False


def test_the_key_names_every_input_and_the_code(tmp_path, monkeypatch):
  task = tasks.TASKS["arithmetic"]
  base = dict(level="basic", split="train", count=500, seed=0, unique=False)
  keys = {split_cache.key(task, **{**base, **change}) for change in (
      {}, {"level": "easy"}, {"split": "eval"}, {"count": 501}, {"seed": 1}, {"unique": True})}
  assert len(keys) == 6
  assert split_cache.key(tasks.TASKS["letters"], **base) not in keys
  # A task of one's own: a change to its source is a new key.
  src = tmp_path / "my_task.py"
  body = ("class Mine:\n  name = 'mine'\n"
          "  def generate_split(self, level, split, count, *, seed, unique=True):\n"
          "    return [{'prompt': str(i), 'answer': '#### 1'} for i in range(count)]\n")
  src.write_text(body)

  def load():  # as a plugin is imported: a module in sys.modules
    spec = importlib.util.spec_from_file_location("my_task", src)
    mod = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "my_task", mod)
    spec.loader.exec_module(mod)
    return mod.Mine()
  before = split_cache.key(load(), **base)
  assert before is not None
  src.write_text(body.replace("'#### 1'", "'#### 2'"))
  assert split_cache.key(load(), **base) != before
  # One without a readable source is not cached at all.
  scope: dict = {}
  exec(body, scope)  # noqa: S102 - a class with no source file
  assert split_cache.key(scope["Mine"](), **base) is None


def test_off_or_unwritable_the_split_is_still_written(tmp_path, monkeypatch):
  want = _fresh(tmp_path, monkeypatch)
  blocker = tmp_path / "file"
  blocker.write_text("not a folder")
  monkeypatch.setenv(split_cache.ENV, str(blocker / "cache"))
  out = str(tmp_path / "z.jsonl")
  task = tasks.TASKS["arithmetic"]
  assert split_cache.write_split(task, "basic", "train", 500, path=out, **ARGS) is False
  assert open(out, "rb").read() == want
  monkeypatch.delenv(split_cache.ENV)
  assert split_cache.folder() == os.path.expanduser("~/.cache/distflow-jax/data")
  monkeypatch.setenv(split_cache.ENV, "")
  assert split_cache.folder() == ""
