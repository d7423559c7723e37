"""Bad inputs about where a job writes (issue 36), through the real command line: a run dir
another live job holds, a stale lock, export / eval / generate destinations, a full disk.
Each ends in ONE line naming the culprit (exit 2 for a user mistake, 1 for a failed run)."""

from __future__ import annotations

import errno
import io
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time

import pytest

from distflow_jax import cli
from test_bad_inputs_corpus import assert_one_line

# A run dir whose latest checkpoint is at total_steps: train gets as far as the run dir
# (the lock, the preflight) and has nothing to do, without a model or a step.
FINISHED = ["--config=grpo:tiny", "--config.trainer.total_steps=2"]


def run(capsys, *argv: str) -> tuple[int, str, str]:
  code = cli.main(list(argv))
  out, err = capsys.readouterr()
  return code, out, err


def finished_run_dir(path) -> str:
  os.makedirs(path / "checkpoints" / "2")
  return str(path)


def sleeper() -> subprocess.Popen:
  """A live process to hold a lock (killed by the test)."""
  return subprocess.Popen(["sleep", "120"])  # it ends by itself in 120 s


def lock_file(run_dir: str) -> str:
  return os.path.join(run_dir, "run.lock")


def holder_of(run_dir: str) -> dict | None:
  """The lock file's record, read as plain JSON (what a user sees in it)."""
  try:
    with open(lock_file(run_dir)) as f:
      return json.load(f)
  except FileNotFoundError:
    return None


def write_lock(run_dir: str, pid: int, host: str | None = None) -> None:
  with open(os.path.join(run_dir, "run.lock"), "w") as f:
    json.dump({"host": host or socket.gethostname(), "pid": pid, "started": time.time(),
               "command": "train"}, f)


# ---- 1. one job per run dir ---------------------------------------------------------------------

@pytest.mark.timeout(120)
@pytest.mark.parametrize("command", ["train", "sft"])
def test_a_second_job_on_a_live_run_dir_is_refused_naming_the_holder(tmp_path, capsys,
                                                                      command):
  run_dir = finished_run_dir(tmp_path / "run")
  holder = sleeper()
  try:
    write_lock(run_dir, holder.pid)
    code, _, err = run(capsys, command, *FINISHED, f"--config.run_dir={run_dir}")
  finally:
    holder.kill()
    holder.wait()
  assert code == 2, err
  assert_one_line(err, f"distflow-jax {command}: error: run dir {run_dir} is in use by",
                  f"pid {holder.pid} on host {socket.gethostname()}")
  assert not os.path.exists(os.path.join(run_dir, "config.json"))  # nothing written
  assert holder_of(run_dir)["pid"] == holder.pid


@pytest.mark.timeout(120)
def test_another_hosts_lock_is_refused_naming_the_file(tmp_path, capsys):
  run_dir = finished_run_dir(tmp_path / "run")
  write_lock(run_dir, 1, host="elsewhere-host")
  code, _, err = run(capsys, "train", *FINISHED, f"--config.run_dir={run_dir}")
  assert code == 2, err
  assert_one_line(err, "pid 1 on host elsewhere-host", lock_file(run_dir))


@pytest.mark.timeout(120)
def test_train_holds_the_lock_while_it_runs_and_releases_it(tmp_path, capsys, monkeypatch):
  run_dir = finished_run_dir(tmp_path / "run")
  from distflow_jax.observe import run_config
  seen, preflight = [], run_config.preflight

  def spy(cfg, **kw):
    seen.append(holder_of(cfg.run_dir))
    return preflight(cfg, **kw)
  monkeypatch.setattr(run_config, "preflight", spy)
  code, out, err = run(capsys, "train", *FINISHED, f"--config.run_dir={run_dir}")
  assert code == 0, err
  assert "nothing to do" in out
  assert seen[0] is not None and (seen[0]["pid"], seen[0]["command"]) == (os.getpid(), "train")
  assert holder_of(run_dir) is None


@pytest.mark.timeout(120)
def test_the_lock_is_released_when_the_command_fails(tmp_path, capsys):
  run_dir = finished_run_dir(tmp_path / "run")
  from distflow_jax.config import loading
  from distflow_jax.observe import run_config
  saved = run_config.as_plain(loading.load("grpo:tiny"))
  saved["actor"]["optimizer"]["lr"] = 0.5  # a resume that changes the lr is refused
  os.makedirs(os.path.join(run_dir, "checkpoints", "2", "meta"))
  with open(os.path.join(run_dir, "checkpoints", "2", "meta", "metadata"), "w") as f:
    json.dump({"config": saved}, f)
  code, _, err = run(capsys, "train", "--config=grpo:tiny", "--config.trainer.total_steps=5",
                     f"--config.run_dir={run_dir}")
  assert code == 2, err
  assert "actor.optimizer.lr" in err
  assert holder_of(run_dir) is None


@pytest.mark.timeout(120)
def test_a_sigkilled_holders_stale_lock_is_taken_over_with_a_line(tmp_path, capsys):
  run_dir = finished_run_dir(tmp_path / "run")
  holder = subprocess.Popen(
      ["timeout", "-s", "KILL", "120", sys.executable, "-c",
       "import sys, time; from distflow_jax.persist import run_lock; "
       "import os; run_lock.take(sys.argv[1], 'train'); print(os.getpid(), flush=True); "
       "time.sleep(120)",
       run_dir], stdout=subprocess.PIPE, text=True,
      env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)))
  try:
    pid = int(holder.stdout.readline())
    os.kill(pid, signal.SIGKILL)  # no clean-up runs: the lock stays behind
  finally:
    holder.wait(timeout=30)  # `timeout` ends with its child
  assert holder_of(run_dir)["pid"] == pid
  code, out, err = run(capsys, "train", *FINISHED, f"--config.run_dir={run_dir}")
  assert code == 0, err
  assert (f"taking over the stale lock of `train` (pid {pid} on host "
          f"{socket.gethostname()}") in out, out
  assert holder_of(run_dir) is None


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_two_processes_share_one_run_dir_and_only_process_0_locks_it(tmp_path):
  from distflow_jax import launcher
  run_dir = finished_run_dir(tmp_path / "run")
  cmd = [sys.executable, "-m", "distflow_jax.cli", "train", *FINISHED,
         "--config.cluster.devices_per_process=1", f"--config.run_dir={run_dir}"]
  result = launcher.launch(2, 1, cmd, timeout_s=240, out=None)
  assert result.ok, result.describe() + "\n" + "\n".join(sum(result.outputs, []))
  assert holder_of(run_dir) is None
  # A second job while a live process holds the run dir: its process 0 refuses, and the
  # launcher stops the rest of that job.
  holder = sleeper()
  try:
    write_lock(run_dir, holder.pid)
    result = launcher.launch(2, 1, cmd, timeout_s=240, out=None)
  finally:
    holder.kill()
    holder.wait()
  assert result.first_failure == (0, 2), result.describe()
  assert any(f"is in use by `train` (pid {holder.pid}" in l for l in result.outputs[0])


# ---- 2. output destinations, checked before anything is loaded -------------------------------------

def a_run(tmp_path) -> str:
  """A run dir with a checkpoint step, a warm-start cache and metrics (no real weights: every
  case below must be refused before anything is read)."""
  run_dir = tmp_path / "run"
  os.makedirs(run_dir / "checkpoints" / "2" / "meta")
  os.makedirs(run_dir / "warmstart")
  (run_dir / "warmstart" / "distflow_warmstart.json").write_text("{}")
  (run_dir / "metrics.jsonl").write_text('{"step": 1}\n')
  return str(run_dir)


def a_model_folder(tmp_path) -> str:
  folder = tmp_path / "hf"
  os.makedirs(folder)
  (folder / "config.json").write_text("{}")
  return str(folder)


# (argv with {run} / {hf} / {file}, what the one line must name); --checkpoint, --model,
# --data and --prompts name nothing that exists: the destination must be refused first.
DEST_CASES = {
    "export_onto_a_model_folder": (
        ["export", "--checkpoint=/no/such", "--out={hf}"],
        ["--out={hf} is a folder that is not empty; pass --overwrite"]),
    "export_onto_the_run_dir": (
        ["export", "--checkpoint={run}", "--out={run}", "--overwrite"],
        ["--out={run} is the run dir {run}", "not even with --overwrite"]),
    "export_onto_the_warmstart": (
        ["export", "--checkpoint={run}", "--out={run}/warmstart", "--overwrite"],
        ["--out={run}/warmstart is inside run {run}'s warmstart folder"]),
    "export_onto_a_checkpoint": (
        ["export", "--checkpoint={run}", "--out={run}/checkpoints/2", "--overwrite"],
        ["inside run {run}'s checkpoints folder"]),
    "export_onto_a_file": (
        ["export", "--checkpoint=/no/such", "--out={file}", "--overwrite"],
        ["--out={file} is a file, not a folder"]),
    "eval_onto_a_file": (
        ["eval", "--model=/no/such", "--data=/no/such.jsonl", "--out={file}"],
        ["--out={file} exists; pass --overwrite"]),
    "eval_onto_the_runs_metrics": (
        ["eval", "--model=/no/such", "--data=/no/such.jsonl", "--out={run}/metrics.jsonl",
         "--overwrite"], ["run {run}'s own metrics.jsonl"]),
    "eval_onto_a_folder": (
        ["eval", "--model=/no/such", "--data=/no/such.jsonl", "--out={hf}", "--overwrite"],
        ["--out={hf} is a folder"]),
    "generate_onto_a_file": (
        ["generate", "--prompts=/no/such.jsonl", "--out={file}"],
        ["--out={file} exists; pass --overwrite"]),
    "generate_into_a_checkpoint": (
        ["generate", "--prompts=/no/such.jsonl", "--out={run}/checkpoints/2/out.jsonl",
         "--overwrite"], ["inside run {run}'s checkpoints folder"]),
}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("case", DEST_CASES)
def test_output_destination_is_refused_first(tmp_path, capsys, case):
  argv, needles = DEST_CASES[case]
  names = {"run": a_run(tmp_path), "hf": a_model_folder(tmp_path),
           "file": str(tmp_path / "old.jsonl")}
  (tmp_path / "old.jsonl").write_text("old\n")
  before = {p: sorted(os.listdir(p)) for p in (names["run"], names["hf"])}
  code, _, err = run(capsys, *[a.format(**names) for a in argv])
  assert code == 2, err
  assert_one_line(err, f"distflow-jax {argv[0]}: error:", *[n.format(**names) for n in needles])
  assert (tmp_path / "old.jsonl").read_text() == "old\n"
  assert {p: sorted(os.listdir(p)) for p in before} == before  # nothing written or removed


@pytest.mark.timeout(120)
@pytest.mark.parametrize("argv, culprit", [
    (["export", "--checkpoint=/no/such", "--out={run}/hf"], "/no/such"),
    (["eval", "--model=/no/such", "--data=/no/such.jsonl", "--out={run}/eval.json"], "/no/such"),
])
def test_a_new_path_beside_the_run_is_a_fine_destination(tmp_path, capsys, argv, culprit):
  names = {"run": a_run(tmp_path)}
  code, _, err = run(capsys, *[a.format(**names) for a in argv])
  assert code == 2, err
  assert_one_line(err, culprit)
  assert "--out" not in err


@pytest.mark.timeout(120)
def test_export_from_a_missing_checkpoint_creates_nothing(tmp_path, capsys):
  """orbax's CheckpointManager creates its directory: a reader must refuse before it."""
  missing = tmp_path / "no" / "such"
  code, _, err = run(capsys, "export", f"--checkpoint={missing}", f"--out={tmp_path}/hf")
  assert code == 2, err
  assert_one_line(err, str(missing), "does not exist")
  assert not (tmp_path / "no").exists()


@pytest.mark.timeout(300)
def test_export_overwrite_replaces_model_files_and_drops_the_warm_start_key(tmp_path, capsys):
  from test_checkpoint import one_saved_run
  one_saved_run(tmp_path)
  # A copied warm-start folder: the key would make the warm-start cache serve RL weights.
  old = tmp_path / "old_warmstart"
  os.makedirs(old)
  for name in ("config.json", "model-00001-of-00002.safetensors",
               "model.safetensors.index.json", "distflow_warmstart.json"):
    (old / name).write_text("{}")
  (old / "NOTES.md").write_text("mine")
  code, out, err = run(capsys, "export", f"--checkpoint={tmp_path}/run", f"--out={old}",
                       "--overwrite")
  assert code == 0, err
  assert "exported the actor of step 1" in out
  left = set(os.listdir(old))
  assert {"NOTES.md", "config.json", "model.safetensors", "tokenizer.json"} <= left, left
  assert not left & {"distflow_warmstart.json", "model-00001-of-00002.safetensors",
                     "model.safetensors.index.json"}, left
  from distflow_jax.models import hf_io
  assert hf_io.load_pretrained(str(old)).cfg.hidden_size == 32


# ---- 3. a full disk: one line naming the path, whichever thread hit it ---------------------------

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


@pytest.mark.timeout(60)
def test_generate_under_the_launcher_checks_its_own_process_file_first(tmp_path, capsys,
                                                                       monkeypatch):
  from distflow_jax import distributed
  monkeypatch.setenv(distributed.ENV_NUM_PROCESSES, "2")
  monkeypatch.setenv(distributed.ENV_PROCESS_ID, "1")
  (tmp_path / "out.jsonl.1").write_text("old\n")  # what process 1 wrote last time
  code, _, err = run(capsys, "generate", "--prompts=/no/such.jsonl",
                     f"--out={tmp_path}/out.jsonl")
  assert code == 2, err
  assert_one_line(err, f"--out={tmp_path}/out.jsonl.1 exists; pass --overwrite")


@pytest.mark.timeout(60)
def test_the_lock_works_on_a_filesystem_without_hard_links(tmp_path, monkeypatch):
  from distflow_jax.persist import run_lock

  def no_link(src, dst):
    raise PermissionError(1, "Operation not permitted", src)
  monkeypatch.setattr(run_lock.os, "link", no_link)
  path = run_lock.take(str(tmp_path), "sft")
  assert holder_of(str(tmp_path))["pid"] == os.getpid()
  assert os.listdir(tmp_path) == ["run.lock"]  # no temporary file left
  with pytest.raises(run_lock.RunLockError, match=f"pid {os.getpid()} on host"):
    run_lock.take(str(tmp_path), "train")  # the same process, a second job: refused
  run_lock.release(path)
  assert holder_of(str(tmp_path)) is None


@pytest.mark.timeout(60)
def test_a_dead_holders_pid_reused_by_a_newer_process_is_a_stale_lock(tmp_path):
  """A lock older than the live process with its pid is not that process's: taken over."""
  from distflow_jax.persist import run_lock
  newer = subprocess.Popen(["sleep", "30"])
  try:
    with open(tmp_path / "run.lock", "w") as f:  # written an hour before `newer` started
      json.dump({"host": socket.gethostname(), "pid": newer.pid, "started": time.time() - 3600,
                 "command": "train"}, f)
    lines = []
    path = run_lock.take(str(tmp_path), "train", lines.append)
    assert holder_of(str(tmp_path))["pid"] == os.getpid()
    assert len(lines) == 1 and f"stale lock of `train` (pid {newer.pid}" in lines[0], lines
    run_lock.release(path)
    # The same pid with a lock written after it started is its own: refused.
    with open(tmp_path / "run.lock", "w") as f:
      json.dump({"host": socket.gethostname(), "pid": newer.pid, "started": time.time(),
                 "command": "train"}, f)
    with pytest.raises(run_lock.RunLockError, match=f"pid {newer.pid} on host"):
      run_lock.take(str(tmp_path), "train")
  finally:
    newer.kill()
    newer.wait(timeout=10)
