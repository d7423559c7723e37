"""Everyday use (issue 22): --help, `config`, the resolved config in the run dir, safe
resume, the keyed warm-start cache, and the progress display (bar, ETA, 80 columns, the
end summary, Ctrl-C, plain lines off a terminal)."""

from __future__ import annotations

import io
import json
import os

import pytest

from distflow_jax.commands import NAMES
from distflow_jax.observe import progress, run_config
from workflow_util import cli_in_process, tiny_model_folder


_main = cli_in_process


def _error_lines(err: str) -> list[str]:
  return [l for l in err.splitlines() if l.startswith("distflow-jax")]


# ---- help ---------------------------------------------------------------------------------------

FLAG_OF = {"plan": "--process=N", "train": "--[no]allow_config_change", "eval": "--model=VALUE",
           "generate": "--prompts=VALUE", "export": "--checkpoint", "report": "RUN_DIR",
           "launch": "-n, --num-processes", "config": "--[no]diff"}


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("flag", ["--help", "-h"])
def test_help_of_every_command(capsys, name, flag):
  code, out, err = _main(capsys, name, flag)
  assert code == 0, err
  assert out.startswith(f"`distflow-jax {name}`"), out[:200]
  head, _, flag_part = out.partition("\nflags:\n")
  assert flag_part, out
  lines = [l for l in flag_part.splitlines() if l.startswith("  ")]
  assert lines and any(l.strip().startswith(FLAG_OF.get(name, "")) for l in lines), flag_part
  assert "unknown flag" not in out + err


def test_help_word_and_help_after_other_flags(capsys):
  code, out, _ = _main(capsys, "help", "train")
  assert code == 0 and "--[no]resume" in out
  code, out, _ = _main(capsys, "plan", "--config=grpo:tiny", "--help")
  assert code == 0 and "--num_processes=N" in out


# ---- the resolved config --------------------------------------------------------------------------

def test_config_prints_the_resolved_config_and_its_diff(capsys):
  code, out, err = _main(capsys, "config", "--config=grpo:tiny", "--config.rollout.n=2")
  assert code == 0, err
  assert "rollout.n: 2" in out.splitlines() and "actor.optimizer.weight_decay: 0.0" in out
  code, out, err = _main(capsys, "config", "--config=grpo:tiny", "--config.rollout.n=2", "--diff")
  assert code == 0, err
  lines = out.splitlines()
  assert "rollout.n: 2" in lines and 'name: "grpo-tiny"' in lines
  assert not any(l.startswith("actor.optimizer.weight_decay") for l in lines)
  assert "dag:" in lines and any('"train_actor"' in l for l in lines)
  code, out, _ = _main(capsys, "config", "--config=grpo:tiny", "--diff", "--json")
  assert code == 0 and json.loads(out)["rollout"]["n"] == 8


def test_config_with_an_unknown_key_is_one_line(capsys):
  code, _, err = _main(capsys, "config", "--config.rollout.nn=2")
  assert code == 2 and len(_error_lines(err)) == 1 and "rollout.nn" in err


def test_diff_and_which_keys_pass():
  old = {"actor": {"optimizer": {"lr": 1e-5}}, "trainer": {"total_steps": 3}, "dag": [{"id": "a"}]}
  new = {"actor": {"optimizer": {"lr": 1e-4}}, "trainer": {"total_steps": 5}, "dag": [{"id": "b"}],
         "extra": 1}
  changes = run_config.diff(old, new)
  assert set(changes) == {"actor.optimizer.lr", "trainer.total_steps", "dag", "extra"}
  assert changes["extra"][0] is run_config.MISSING
  assert run_config.passes("trainer.total_steps") and run_config.passes("trainer.health.kl_max")
  # When programs compile changes no result: a resume may switch compile_ahead.
  assert run_config.passes("trainer.compile_ahead")
  assert not run_config.passes("actor.optimizer.lr") and not run_config.passes("dag")
  assert not run_config.passes("seed") and not run_config.passes("trainer.deterministic")
  assert "dag (changed)" in run_config.describe({"dag": changes["dag"]})


def test_checkpoint_without_a_config_is_said_and_resumed(tmp_path):
  from distflow_jax.config import loading
  meta = tmp_path / "checkpoints" / "5" / "meta"
  meta.mkdir(parents=True)
  (meta / "metadata").write_text(json.dumps({"format": 1, "step": 5}))
  cfg = loading.load("grpo:tiny", [f"run_dir={tmp_path}", "trainer.total_steps=9"])
  said: list[str] = []
  state = run_config.preflight(cfg, resume=None, allow_change=False, log=said.append)
  assert state.latest == 5 and not state.finished
  assert len(said) == 1 and "records no config" in said[0] and "going on" in said[0]


# ---- a tiny run, interrupted, resumed, finished, resumed with changes -----------------------------

def _tiny_model(tmp_path) -> str:
  return tiny_model_folder(tmp_path)


def _step_lines(out: str) -> list[str]:
  return [l for l in out.splitlines() if l.startswith("step ")]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_run_interrupt_resume_finish_and_config_changes(tmp_path, capsys, monkeypatch):
  run_dir = tmp_path / "run"
  args = ["train", "--config=grpo:tiny", f"--config.run_dir={run_dir}",
          f"--config.model.path={_tiny_model(tmp_path)}", "--config.data.prompts_per_step=8",
          "--config.rollout.n=2", "--config.rollout.max_new_tokens=8",
          "--config.actor.micro_batch_size=1", "--config.data.eval_size=8",
          "--config.trainer.eval_every=1", "--config.trainer.save_every=1",
          "--config.trainer.async_save=False"]

  # Ctrl-C after step 1 (its checkpoint is saved before its line is printed).
  real_step = progress.Logger.step

  def interrupt(self, m, total):
    real_step(self, m, total)
    if m["step"] == 1:
      raise KeyboardInterrupt
  monkeypatch.setattr(progress.Logger, "step", interrupt)
  code, out, err = _main(capsys, *args, "--config.trainer.total_steps=2")
  assert code == 130, err
  (line,) = _error_lines(err)
  assert "interrupted" in line and "last complete checkpoint is step 1" in line, line
  monkeypatch.setattr(progress.Logger, "step", real_step)
  saved = json.loads((run_dir / "config.json").read_text())
  assert saved["rollout"]["n"] == 2 and saved["trainer"]["total_steps"] == 2
  # Off a terminal: plain lines, no carriage-return redraws; phases named as they start.
  assert "\r" not in out and "compile and first step" in out and "evaluation..." in out
  assert "checkpoint save..." in out

  # Resumed: step 2, then the end summary.
  code, out, err = _main(capsys, *args, "--config.trainer.total_steps=2")
  assert code == 0, err
  steps = _step_lines(out)
  assert steps and all(len(l) <= 80 for l in steps), steps
  # The resumed start's only step compiled: no warm step to time, and nothing left to do.
  assert any(l.startswith("step 2/2") and "ETA" not in l for l in steps), steps
  assert not (run_dir / "run.lock").exists()  # released after Ctrl-C and after the end
  assert "held-out accuracy:" in out and "at step 0 ->" in out and "at step 2" in out
  assert "done: 1 step(s) in" in out
  assert f"checkpoint: {run_dir / 'checkpoints' / '2'}" in out
  assert f"metrics:    {run_dir / 'metrics.jsonl'}" in out
  for command in ("distflow-jax report", "distflow-jax export --checkpoint",
                  "distflow-jax eval --config=grpo:tiny "):
    assert command in out, out
  # The eval command reads prompts and decodes answers as the run did.
  (hint,) = [l for l in out.splitlines() if "distflow-jax eval " in l]
  assert "--config.rollout.max_new_tokens=8 " in hint and f"--model={run_dir} " in hint, hint
  assert "--config.trainer." not in hint and "--config.model.path" not in hint, hint
  assert "\r" not in out

  # Finished: nothing to do, and how to extend it.
  code, out, err = _main(capsys, *args, "--config.trainer.total_steps=2")
  assert code == 0 and not _error_lines(err), err
  (msg,) = [l for l in out.splitlines() if "nothing to do" in l]
  assert "--config.trainer.total_steps=N" in msg and "step 2" in msg

  # A changed learning rate is refused in one line naming it (before any weights load).
  code, out, err = _main(capsys, *args, "--config.trainer.total_steps=3",
                         "--config.actor.optimizer.lr=0.001")
  assert code == 2
  (line,) = _error_lines(err)
  assert "actor.optimizer.lr 0.0001 -> 0.001" in line and "--allow_config_change" in line
  assert "total_steps" not in line and "Traceback" not in err

  # A changed total_steps passes and is reported.
  code, out, err = _main(capsys, *args, "--config.trainer.total_steps=3")
  assert code == 0, err
  assert "config changed since checkpoint step 2: trainer.total_steps 2 -> 3" in out

  # The learning rate with --allow_config_change: resumed, and said so.
  code, out, err = _main(capsys, *args, "--config.trainer.total_steps=4",
                         "--config.actor.optimizer.lr=0.001", "--allow_config_change")
  assert code == 0, err
  assert "--allow_config_change" in out and "actor.optimizer.lr 0.0001 -> 0.001" in out
  assert json.loads((run_dir / "config.json").read_text())["actor"]["optimizer"]["lr"] == 0.001
  history = [json.loads(l) for l in open(run_dir / run_config.HISTORY_FILE)]
  assert [h["start_step"] for h in history] == [0, 1, 2, 3]
  assert "config" in history[0] and history[1]["changed"] == {}
  assert history[2]["changed"] == {"trainer.total_steps": {"from": 2, "to": 3}}
  assert history[3]["changed"]["actor.optimizer.lr"] == {"from": 0.0001, "to": 0.001}


# ---- the warm-start cache ----------------------------------------------------------------------

@pytest.mark.timeout(300)
def test_warm_start_cache_is_keyed_by_its_settings(tmp_path):
  from distflow_jax.config import checks, loading
  from distflow_jax.dag import FUNCTIONS
  from distflow_jax.models.tokenizer import Tokenizer
  from distflow_jax.warmstart import text as warmstart

  def cfg_with(*overrides):
    return loading.load("grpo:tiny", [f"run_dir={tmp_path}", "model.warmstart.steps=0",
                                      "cluster.devices_per_process=0", *overrides])

  tok = Tokenizer.builtin()
  base = str(tmp_path / "warmstart")

  def ensure(cfg):
    said: list[str] = []
    plan = checks.plan_from_config(cfg, checks.topology(cfg), FUNCTIONS)
    return warmstart.ensure_model(cfg, plan, tok, said.append), said

  path, said = ensure(cfg_with())
  assert path == base and os.path.isfile(os.path.join(base, warmstart.KEY_FILE))
  path, said = ensure(cfg_with())
  assert path == base and any("using the cached model" in s for s in said)
  other = cfg_with("model.warmstart.lr=0.002")
  path, said = ensure(other)
  assert path == f"{base}-{warmstart.key_hash(warmstart.settings(other, tok))}"
  assert any("is not reused" in s and "warmstart" in s for s in said), said
  assert os.path.isfile(os.path.join(path, "config.json"))
  again, said = ensure(other)
  assert again == path and any("using the cached model" in s for s in said)
  # A cache without a key (an older version's) is not taken for any settings.
  os.remove(os.path.join(base, warmstart.KEY_FILE))
  assert warmstart.model_dir(cfg_with(), warmstart.settings(cfg_with(), tok)) != base


# ---- the progress display ---------------------------------------------------------------------

def _busy_metrics(step: int) -> dict[str, float]:
  m = {"step": step, "reward": 0.5, "accuracy": 0.25, "eval/accuracy": 0.75,
       "response_length": 12.0, "actor/kl": 0.001, "tokens_per_s": 12345.0,
       "actor/skipped": 1.0, "health/kl_high": 1.0, "health/entropy_low": 1.0,
       "time/step": 1.6}
  for node in ("generate", "reward", "advantage", "old_logprob", "ref_logprob", "train_actor"):
    m[f"time/{node}"] = 0.25
  return m


def test_progress_lines_fit_80_columns_with_eta_and_times_in_run_order():
  out = io.StringIO()
  log = progress.Logger(True, out, times_every=2)
  log.nodes = ["generate", "reward", "advantage", "old_logprob", "ref_logprob", "train_actor"]
  progress.phase(log, "compile/first step")
  for step in (1, 2, 3):
    log.step(_busy_metrics(step), 200)
  lines = out.getvalue().splitlines()
  assert all(len(l) <= 80 for l in lines), [l for l in lines if len(l) > 80]
  steps = [l for l in lines if l.startswith("step ")]
  assert len(steps) == 3 and all("ETA" in l and "s/step" in l for l in steps[1:])
  assert "ETA after step 2" in steps[0]  # step 1 compiles: its time predicts nothing
  assert all("SKIPPED(actor)" in l and "!entropy_low,kl_high" in l for l in steps)
  times = [l for l in lines if l.startswith("  times:") or l.startswith("        ")]
  assert times, lines  # every 2nd step
  words = " ".join(times).split()
  order = [w for w in words if w in log.nodes]
  assert order == log.nodes
  assert "\r" not in out.getvalue()


def test_progress_redraws_in_place_on_a_terminal_only():
  tty = io.StringIO()
  log = progress.Logger(True, tty, tty=True, times_every=10)
  for step in (1, 2, 3):
    log.step({"step": step, "reward": 0.5}, 20)
  progress.phase(log, "evaluation")
  assert "\r" in tty.getvalue() and tty.getvalue().count("\n") == 0
  assert "evaluation..." in tty.getvalue()
  log("a message")  # a message above the live line, which is drawn again
  assert tty.getvalue().endswith("| evaluation...")
  progress.phase(log, "checkpoint save")  # replaces the phase shown, behind the same step
  assert tty.getvalue().endswith("reward 0.500 | checkpoint save...\x1b[K")
  plain = io.StringIO()
  log = progress.Logger(True, plain)
  for step in (1, 2, 3):
    log.step({"step": step, "reward": 0.5}, 20)
  assert "\r" not in plain.getvalue() and len(plain.getvalue().splitlines()) == 3


def test_fit_drops_the_least_useful_fields_first():
  parts = [("step 1/9", 0), ("x" * 40, 5), ("y" * 30, 1), ("!alarm", 0), ("z" * 30, 6)]
  line = progress.fit(parts, 80)
  assert line == "step 1/9 " + "y" * 30 + " !alarm"
  assert progress.clock(59) == "0:59" and progress.clock(3725) == "1:02:05"


@pytest.mark.timeout(120)
def test_warm_start_over_a_device_count_the_model_does_not_divide_is_one_line(tmp_path):
  """With the rollout on a process of its own, the built-in model's warm start shards it
  over every device of the run (warmstart/text.py); 3 devices do not divide its sizes:
  refused in one line naming the way out, not a traceback from the sharding rules."""
  from distflow_jax.config import checks, loading
  from distflow_jax.config.loading import ConfigError
  from distflow_jax.dag import FUNCTIONS, Topology
  from distflow_jax.models.tokenizer import Tokenizer
  from distflow_jax.warmstart import text as warmstart
  cfg = loading.load("grpo:tiny", [f"run_dir={tmp_path}", "model.warmstart.steps=0",
                                   "model.preset=micro",
                                   "trainer.max_staleness=1", "cluster.num_processes=3",
                                   "cluster.devices_per_process=1",
                                   "placement.rollout.devices=2:3", "placement.actor.devices=0:2",
                                   "placement.reference.devices=0:2", "trainer.eval_every=0",
                                   "data.prompts_per_step=4", "actor.micro_batch_size=1"])
  plan = checks.plan_from_config(cfg, Topology(3, 1), FUNCTIONS)
  with pytest.raises(ConfigError) as e:
    warmstart.ensure_model(cfg, plan, Tokenizer.builtin(), lambda m: None)
  line = str(e.value)
  assert "\n" not in line and "{'data': 1, 'fsdp': 3, 'tensor': 1}" in line, line
  assert "model.path" in line and "device count that divides" in line, line
