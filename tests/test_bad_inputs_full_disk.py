"""A full disk (issue 36) through the real command line and the writers a run uses: one line
naming the file being written, whichever thread or library hit it (distflow_jax/io_errors.py),
never a traceback and never "out of memory"."""

from __future__ import annotations

import errno
import io
import json
import os
import subprocess
import tempfile

import pytest

from distflow_jax import cli
from test_bad_inputs_corpus import assert_one_line

ORBAX_TEXT = ('RESOURCE_EXHAUSTED: Error writing "actor.params.x/0.0.0" in OCDBT database at local '
              'file "/runs/x/checkpoints/1.orbax-checkpoint-tmp/state/ocdbt.process_0/": Failed '
              'writing: "/runs/x/checkpoints/1.orbax-checkpoint-tmp/state/ocdbt.process_0/d/ab12": '
              "Failed to write 99536 bytes to file 7: No space left on device "
              "[os_error_code='28']")


class _FullFile:
  """A file object whose write fails as a full disk's does (no file name on the error)."""

  def __init__(self, path):
    self._f = open(path, "w")

  def write(self, text):
    self._f.write(text)
    raise OSError(28, "No space left on device")


def test_disk_errors_are_found_with_their_path(tmp_path):
  import errno

  from distflow_jax import io_errors
  from distflow_jax.observe import hints
  disk = io_errors.find(ValueError(ORBAX_TEXT))
  assert disk == io_errors.DiskError(errno.ENOSPC,
                                     "/runs/x/checkpoints/1.orbax-checkpoint-tmp/state/"
                                     "ocdbt.process_0/d/ab12")
  assert not hints.is_oom(ValueError(ORBAX_TEXT))  # RESOURCE_EXHAUSTED, but not memory
  assert hints.is_oom(ValueError("RESOURCE_EXHAUSTED: Out of memory allocating 4 GiB"))
  path = tmp_path / "config.json.tmp"
  try:
    with open(path, "w") as f:  # what write_resolved does; the error names no file
      f.write("x")
      raise OSError(28, "No space left on device")
  except OSError as e:
    assert io_errors.find(e).path == str(path)
  try:
    holder = _FullFile(tmp_path / "events")  # a writer holding its file (tensorboardX)
    holder.write("x")
  except OSError as e:
    assert io_errors.find(e).path == str(tmp_path / "events")
  assert io_errors.find(ValueError("bad value")) is None


class _CaptureFile(io.TextIOWrapper):
  """A stream named like pytest's capture file (``EncodedFile.name`` is ``repr(buffer)``)."""

  @property
  def name(self):
    return repr(self.buffer)


@pytest.mark.timeout(60)
def test_a_stream_named_like_no_path_is_never_the_full_disks_path(tmp_path):
  """Found in CI: the innermost frame of a failed write held the captured stderr, and the
  line named ``<cwd>/<_io.FileIO name=51 mode='rb+' closefd=True>``; the file being
  written, one frame out, is the path."""
  from distflow_jax import io_errors
  stream = _CaptureFile(tempfile.TemporaryFile(buffering=0), encoding="utf-8")

  def inner(log_stream):
    raise OSError(28, "No space left on device")

  path = tmp_path / "metrics.jsonl"
  try:
    with open(path, "w") as f:
      f.write("x")
      inner(stream)
  except OSError as e:
    assert io_errors.find(e).path == str(path)
  stream.close()


@pytest.mark.timeout(60)
def test_a_full_disk_in_a_background_thread_is_one_line_naming_the_path(capfd, monkeypatch):
  import concurrent.futures

  from distflow_jax.commands import report

  def fails_in_a_thread(argv):
    def save():
      raise ValueError(ORBAX_TEXT)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
      return pool.submit(save).result()
  monkeypatch.setattr(report, "run", fails_in_a_thread)
  code = cli.main(["report", "/runs/x"])
  err = capfd.readouterr().err
  assert code == 1, err
  assert_one_line(err, "distflow-jax report: error: no space left on device: "
                  "/runs/x/checkpoints/1.orbax-checkpoint-tmp/state/ocdbt.process_0/d/ab12")
  assert "memory" not in err


@pytest.fixture
def small_disk(tmp_path):
  """A 200 kB tmpfs (needs root; skipped where it cannot be mounted)."""
  where = tmp_path / "disk"
  where.mkdir()
  r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=200k", "tmpfs", str(where)],
                     capture_output=True, timeout=30)
  if r.returncode != 0:
    pytest.skip(f"cannot mount a tmpfs here: {r.stderr.decode().strip()[:80]}")
  yield where
  subprocess.run(["umount", "-l", str(where)], capture_output=True, timeout=30)


def _fill(disk) -> None:
  """Leaves ``disk`` (a small tmpfs) with no free block."""
  with open(disk / "filler", "wb", buffering=0) as f:  # unbuffered: close writes nothing
    try:
      while True:
        f.write(b"x" * 4096)
    except OSError as e:
      assert e.errno == errno.ENOSPC, e


@pytest.mark.timeout(60)
def test_rust_writers_on_a_full_disk_name_their_file(small_disk):
  """tokenizers' save and safetensors' save_file fail on a full disk with a plain
  Exception, "No space left on device (os error 28)": no path of their own.  The CI run of
  2026-11-29 failed on exactly this (the tokenizer of train's first checkpoint).  Each of
  our calls to one names the file it was writing, and a copy names its destination."""
  import numpy as np
  import tokenizers

  from distflow_jax import io_errors
  from distflow_jax.models import hf_export, tokenizer as tokenizer_lib

  src = small_disk.parent / "src"
  src.mkdir()
  word_level = tokenizers.Tokenizer(tokenizers.models.WordLevel(
      {f"w{i}": i for i in range(400)}, unk_token="w0"))  # not byte-level BPE: Rust saves it
  word_level.save(str(src / "tokenizer.json"))
  (src / "tokenizer_config.json").write_text('{"eos_token": "w1"}')
  tok = tokenizer_lib.Tokenizer(word_level, {"eos_token": "w1"})
  (small_disk / "m").mkdir()
  _fill(small_disk)
  cases = {
      "tokenizer.json": lambda: tok.save(small_disk / "tok"),
      "model.safetensors": lambda: hf_export.write_safetensors(
          small_disk / "m", {"w": np.zeros(50_000, np.float32)}),
      "copied": lambda: tokenizer_lib.copy_tokenizer_files(src, small_disk),
  }
  for name, write in cases.items():
    with pytest.raises(Exception) as caught:
      write()
    disk = io_errors.find(caught.value)
    assert disk is not None and disk.code == errno.ENOSPC, (name, caught.value)
    want = str(small_disk / "tokenizer.json") if name == "copied" else name
    assert disk.path is not None and disk.path.startswith(str(small_disk)), (name, disk)
    assert disk.path.endswith(want), (name, disk)


@pytest.mark.timeout(60)
def test_tensorboard_on_a_full_disk_raises_here_naming_its_file(small_disk, capfd):
  """The TensorBoard writer writes in the caller's thread: tensorboardX's SummaryWriter
  wrote from a thread of its own, which on a full disk printed its own traceback beside
  the command's line (seen in a sweep of disk sizes) and lost every later event."""
  import threading

  from distflow_jax import io_errors
  from distflow_jax.observe import tensorboard

  before = threading.active_count()
  board = tensorboard.TensorBoardWriter(str(small_disk / "tb"), enabled=True)
  assert threading.active_count() == before  # no writer thread
  board.write({"step": 1, "loss": 0.5})
  _fill(small_disk)
  with pytest.raises(OSError) as caught:
    for step in range(2, 200):  # a buffered write fails at its flush, each row flushes
      board.write({"step": step, "loss": 0.5, "note": "x" * 2000})
      board.add_text("sample", "y" * 4000, step)
  disk = io_errors.find(caught.value)
  assert disk is not None and disk.code == errno.ENOSPC
  assert disk.path and os.path.basename(disk.path).startswith("events.out.tfevents."), disk
  assert os.path.dirname(disk.path) == str(small_disk / "tb")
  assert capfd.readouterr().err == ""


@pytest.mark.timeout(300)
def test_train_on_a_full_disk_is_one_line_naming_the_path(tmp_path, small_disk, capfd):
  from workflow_util import tiny_model_folder
  data = tmp_path / "d.jsonl"
  data.write_text("".join(json.dumps({"prompt": f"What is {i}+1?", "answer": str(i + 1)})
                          + "\n" for i in range(40)))
  run_dir = small_disk / "run"
  code = cli.main(["train", f"--config.run_dir={run_dir}",
                   f"--config.model.path={tiny_model_folder(tmp_path)}",
                   f"--config.data.train={data}", "--config.data.eval=",
                   "--config.data.max_prompt_len=40", "--config.rollout.prefill_buckets=(40,)",
                   "--config.rollout.max_new_tokens=8", "--config.rollout.n=2",
                   "--config.data.prompts_per_step=8", "--config.actor.micro_batch_size=1",
                   "--config.trainer.eval_every=0", "--config.trainer.total_steps=2",
                   "--config.data.chat_template=True", "--config.trainer.save_every=1"])
  err = capfd.readouterr().err  # file descriptor 2: C++ threads print there too
  assert code == 1, err
  assert_one_line(err, "distflow-jax train: error: no space left on device: "
                  f"{run_dir}{os.sep}")
  assert "memory" not in err and "Event loop" not in err, err
