"""Bad inputs about where a job writes (issue 36), through the real command line: a run dir
another live job holds, a stale lock, export / eval / generate destinations.
Each ends in ONE line naming the culprit (exit 2 for a user mistake, 1 for a failed run);
a full disk is tests/test_bad_inputs_full_disk.py's."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
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
