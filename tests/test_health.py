"""The training-health monitor: each signal provoked by a metric stream, and quiet on a
healthy one."""

import pytest

from distflow_jax.observe.health import HealthConfig, HealthMonitor, Signal

HEALTHY = {"reward": 0.3, "response_length": 40.0, "actor/kl": 0.02, "actor/entropy": 0.8,
           "actor/pg_clipfrac": 0.01}


def run(stream, cfg=HealthConfig(), clip_configured=True):
  mon = HealthMonitor(cfg, clip_configured)
  fired = []
  for step, m in enumerate(stream, 1):
    m = dict(m)
    for alarm in mon.update(step, m):
      fired.append((alarm.signal, alarm.step))
  return fired, m


def test_a_healthy_run_raises_nothing():
  fired, last = run([HEALTHY] * 50)
  assert fired == []
  assert all(last[f"health/{s.value}"] == 0.0 for s in Signal)


def test_kl_high_fires_at_once_and_once():
  stream = [HEALTHY] * 3 + [dict(HEALTHY, **{"actor/kl": 2.5})] * 4
  fired, last = run(stream)
  assert fired == [(Signal.KL_HIGH, 4)]
  assert last["health/kl_high"] == 1.0


def test_kl_in_reward_is_read_when_there_is_no_kl_loss():
  m = {k: v for k, v in HEALTHY.items() if k != "actor/kl"}
  fired, _ = run([m, dict(m, kl_penalty=3.0)])
  assert fired == [(Signal.KL_HIGH, 2)]


def test_length_collapse_needs_patience():
  short = dict(HEALTHY, response_length=2.0)
  fired, _ = run([HEALTHY] * 3 + [short] * 2 + [HEALTHY] + [short] * 3)
  assert fired == [(Signal.LENGTH_COLLAPSE, 9)]


def test_reward_zero_for_k_steps():
  zero = dict(HEALTHY, reward=0.0)
  fired, _ = run([zero] * 4, HealthConfig(zero_reward_steps=4))
  assert fired == [(Signal.REWARD_ZERO, 4)]
  fired, _ = run([zero] * 3 + [HEALTHY] + [zero] * 3, HealthConfig(zero_reward_steps=4))
  assert fired == []


def test_entropy_collapse_from_the_loss_or_the_rollout():
  low = dict(HEALTHY, **{"actor/entropy": 0.001})
  assert run([low] * 3)[0] == [(Signal.ENTROPY_COLLAPSE, 3)]
  m = {k: v for k, v in HEALTHY.items() if k != "actor/entropy"}
  assert run([dict(m, rollout_nll=0.001)] * 3)[0] == [(Signal.ENTROPY_COLLAPSE, 3)]


def test_clip_idle_only_when_clipping_is_configured():
  idle = dict(HEALTHY, **{"actor/pg_clipfrac": 0.0})
  assert run([idle] * 10)[0] == [(Signal.CLIP_IDLE, 10)]
  assert run([idle] * 10, clip_configured=False)[0] == []
  assert not Signal.CLIP_IDLE.is_collapse and Signal.KL_HIGH.is_collapse


def test_signal_fires_again_after_recovery():
  bad = dict(HEALTHY, **{"actor/kl": 5.0})
  fired, _ = run([bad, HEALTHY, bad])
  assert fired == [(Signal.KL_HIGH, 1), (Signal.KL_HIGH, 3)]


def test_state_round_trip_resumes_counters():
  zero = dict(HEALTHY, reward=0.0)
  cfg = HealthConfig(zero_reward_steps=4)
  a = HealthMonitor(cfg)
  for step in range(1, 3):
    a.update(step, dict(zero))
  b = HealthMonitor(cfg)
  b.load_state_dict(a.state_dict())
  assert b.update(3, dict(zero)) == []
  assert [x.signal for x in b.update(4, dict(zero))] == [Signal.REWARD_ZERO]


def _evals(points, every=4):
  """A stream with a held-out evaluation every ``every`` steps: ``points`` are its
  (accuracy, answers' length) from the start (step 0) on."""
  stream = []
  for i, (acc, length) in enumerate(points):
    if i:
      stream += [dict(HEALTHY)] * (every - 1)
    stream.append(dict(HEALTHY, **{"eval/accuracy": acc, "eval/response_length": length}))
  return stream


def run_from_zero(stream, cfg=HealthConfig()):
  mon = HealthMonitor(cfg)
  fired, rows = [], []
  for step, m in enumerate(stream):
    m = dict(m, step=step)
    fired += [(a.signal, a.step, a.message) for a in mon.update(step, m)]
    rows.append(m)
  return fired, rows, mon


def test_eval_fall_fires_when_held_out_accuracy_falls_below_its_best():
  """The shipped real-model recipe's try 2 (docs/real_model.md): 11.5% at the start,
  5.0% at step 8 while the answers grew to the cap."""
  fired, rows, _ = run_from_zero(_evals([(0.115, 81.0), (0.05, 95.0)], every=8))
  assert [(s, step) for s, step, _ in fired] == [(Signal.EVAL_FALL, 8)]
  msg = fired[0][2]
  assert "held-out accuracy 0.050 is 0.065 below its best 0.115 (step 0)" in msg, msg
  assert "held-out answers 81.0 -> 95.0 tokens" in msg, msg
  assert Signal.EVAL_FALL.is_collapse  # trainer.stop_on_collapse stops on it
  assert [r["health/eval_fall"] for r in rows] == [0.0] * 8 + [1.0]


def test_eval_fall_holds_between_evaluations_and_clears_on_recovery():
  points = [(0.20, 50.0), (0.30, 50.0), (0.24, 60.0), (0.22, 60.0), (0.29, 55.0)]
  fired, rows, _ = run_from_zero(_evals(points, every=4))
  assert [(s, step) for s, step, _ in fired] == [(Signal.EVAL_FALL, 8)]  # 0.30 -> 0.24: once
  flags = [r["health/eval_fall"] for r in rows]
  assert flags[:8] == [0.0] * 8 and flags[8:16] == [1.0] * 8  # steps 8-15, one alarm
  assert flags[16] == 0.0  # 0.29 is within 0.05 of the best


def test_eval_fall_small_dips_and_rises_are_quiet_and_can_be_disabled():
  fired, _, _ = run_from_zero(_evals([(0.1, 40.0), (0.3, 40.0), (0.26, 41.0), (0.5, 40.0)]))
  assert fired == []
  fall = _evals([(0.5, 40.0), (0.1, 90.0)])
  assert run_from_zero(fall, HealthConfig(eval_drop=0.0))[0] == []
  assert len(run_from_zero(fall, HealthConfig(eval_drop=0.5))[0]) == 0
  assert len(run_from_zero(fall, HealthConfig(eval_drop=0.3))[0]) == 1


def test_eval_fall_state_round_trip_keeps_the_best():
  a = HealthMonitor(HealthConfig())
  a.update(0, {"step": 0, "eval/accuracy": 0.4, "eval/response_length": 30.0})
  b = HealthMonitor(HealthConfig())
  b.load_state_dict(a.state_dict())
  alarms = b.update(4, {"step": 4, "eval/accuracy": 0.2, "eval/response_length": 70.0})
  assert [x.signal for x in alarms] == [Signal.EVAL_FALL]
  assert "best 0.400 (step 0)" in alarms[0].message


@pytest.mark.timeout(300)
def test_a_run_whose_held_out_accuracy_falls_raises_eval_fall(tmp_path, capsys):
  """A real tiny run: the plugin's held-out reward accepts every answer of the start's
  evaluation and none after, so eval/accuracy goes 1 -> 0 and the alarm names step 0."""
  import json

  import plugin_fading_reward
  from distflow_jax import cli
  from workflow_util import tiny_model_folder, tiny_train_argv

  tiny_model_folder(tmp_path)
  run_dir = tmp_path / "run"
  plugin_fading_reward.SEEN.update(calls=0, first=4)
  code = cli.main(tiny_train_argv(tmp_path, run_dir, "--config.data.eval_size=4",
                                  "--config.trainer.eval_every=1",
                                  "--config.trainer.total_steps=2",
                                  "--config.plugins=('plugin_fading_reward',)",
                                  "--config.trainer.eval_reward=fading"))
  out, err = capsys.readouterr()
  assert code == 0, err
  rows = [json.loads(l) for l in open(run_dir / "metrics.jsonl")]
  evals = [(r["step"], r["eval/accuracy"]) for r in rows if "eval/accuracy" in r]
  assert evals == [(0, 1.0), (1, 0.0), (2, 0.0)], evals
  assert [r.get("health/eval_fall") for r in rows if r["step"] > 0] == [1.0, 1.0]
  assert out.count("health collapse at step 1: eval_fall: held-out accuracy 0.000 is 1.000 "
                   "below its best 1.000 (step 0)") == 1, out


@pytest.mark.parametrize("kw", [dict(kl_max=-1.0), dict(kl_max=float("nan")),
                                dict(length_fraction=1.5), dict(patience=0),
                                dict(zero_reward_steps=-1), dict(eval_drop=-0.1),
                                dict(eval_drop=float("inf"))])
def test_bad_settings_are_refused(kw):
  with pytest.raises(ValueError, match="trainer.health"):
    HealthConfig(**kw)


@pytest.mark.timeout(300)
def test_stop_on_collapse_names_the_signal_and_the_last_good_checkpoint(tmp_path, capsys):
  """A random model never answers the arithmetic task: the reward is 0 every step, so with
  zero_reward_steps=2 the run stops at step 2, after step 1's checkpoint."""
  import json

  from distflow_jax import cli
  from workflow_util import tiny_model_folder, tiny_train_argv

  tiny_model_folder(tmp_path)
  run_dir = tmp_path / "run"
  code = cli.main(tiny_train_argv(tmp_path, run_dir, "--config.data.eval=",
                                  "--config.trainer.eval_every=0",
                                  "--config.trainer.total_steps=4",
                                  "--config.trainer.save_every=1",
                                  "--config.trainer.health.zero_reward_steps=2",
                                  "--config.trainer.stop_on_collapse=True"))
  out, err = capsys.readouterr()
  assert code == 1, err
  lines = [l for l in err.splitlines() if l.startswith("distflow-jax")]
  assert len(lines) == 1 and "Traceback" not in err, err
  assert "health collapse at step 2: reward_zero" in lines[0]
  assert "last good checkpoint is step 1" in lines[0]
  assert "health collapse at step 2: reward_zero" in out  # also on the progress log
  rows = [json.loads(l) for l in open(run_dir / "metrics.jsonl")]
  assert [r["step"] for r in rows] == [1, 2]
  assert rows[0]["health/reward_zero"] == 0.0 and rows[1]["health/reward_zero"] == 1.0
  assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()
                if p.name.isdigit()) == ["1"]


def test_progress_line_shows_skipped_steps_and_alarms():
  import io

  from distflow_jax.observe.progress import Logger

  out = io.StringIO()
  log = Logger(True, out)
  log.step({"step": 3, "reward": 0.5, "actor/skipped": 1.0, "critic/skipped": 0.0,
            "health/kl_high": 1.0, "health/clip_idle": 0.0}, 10)
  log.step({"step": 4, "reward": 0.5, "actor/skipped": 0.0, "health/kl_high": 0.0}, 10)
  first, second = out.getvalue().splitlines()
  assert "SKIPPED(actor)" in first and "!kl_high" in first and "clip_idle" not in first
  assert "SKIPPED" not in second and "!" not in second
