"""Processes started with different configs are refused at start-up, naming the keys."""

import sys

import pytest

from distflow_jax import launcher
from distflow_jax.config import consistency, loading


def fake_group(*cfgs, exclude=()):
  """A gather over processes holding ``cfgs``, seen from process 0."""
  flats = [consistency._kept(consistency.flatten(c), exclude) for c in cfgs]

  def gather(obj):
    return [consistency.fingerprint(f) for f in flats] if isinstance(obj, str) else flats
  return gather


def test_flatten_names_nested_keys_and_dag_entries():
  flat = consistency.flatten(loading.load("grpo:tiny", ["rollout.temperature=inf"]))
  assert flat["actor.optimizer.lr"] == 1e-4
  assert flat["rollout.prefill_buckets[2]"] == 32
  assert flat["dag[0].id"] == "generate"
  assert flat["rollout.temperature"] == "inf"
  assert flat["plugins"] == []


def test_same_config_passes():
  a, b = loading.load("grpo:tiny"), loading.load("grpo:tiny")
  consistency.check_same_config(a, gather=fake_group(a, b))


@pytest.mark.parametrize("overrides, pattern", [
    ([["actor.optimizer.lr=1e-5"], ["actor.optimizer.lr=2e-5"]],
     "the 2 processes were started with different configs: actor.optimizer.lr: 1e-05 on "
     "process 0, 2e-05 on process 1. Start every process"),
    ([["rollout.n=4"], ["rollout.n=8"], ["rollout.n=8"], ["rollout.n=4"]],
     "the 4 processes were started with different configs: rollout.n: 4 on processes 0,3, "
     "8 on processes 1-2. "),
    ([["run_dir=a", "seed=1"], ["run_dir=b", "seed=1"], ["run_dir=b", "seed=2"]],
     "run_dir: 'a' on process 0, 'b' on processes 1-2; seed: 1 on processes 0-1, 2 on "
     "process 2. "),
])
def test_different_configs_are_named_in_one_line(overrides, pattern):
  cfgs = [loading.load("grpo:tiny", o) for o in overrides]
  with pytest.raises(loading.ConfigError) as e:
    consistency.check_same_config(cfgs[0], gather=fake_group(*cfgs))
  assert "\n" not in str(e.value)
  assert pattern in str(e.value), str(e.value)


def test_many_differences_are_cut_short_and_excluded_keys_ignored():
  a = loading.load("grpo:tiny")
  b = loading.load("grpo:tiny", ["seed=9", "run_dir=x", "name=y", "rollout.n=2", "rollout.top_k=3",
                                 "data.eval_size=3", "trainer.keep=9", "algo.gamma=0.5"])
  with pytest.raises(loading.ConfigError, match=r"; and 2 more key\(s\)\. Start"):
    consistency.check_same_config(a, gather=fake_group(a, b))
  c = loading.load("grpo:tiny", ["run_dir=elsewhere"])
  consistency.check_same_config(a, gather=fake_group(a, c, exclude=("run_dir",)),
                                exclude=("run_dir",))


@pytest.mark.multiprocess
@pytest.mark.timeout(180)
def test_two_processes_with_different_lr_are_refused_at_start():
  result = launcher.launch(2, 1, [sys.executable, "tests/mp/config_consistency.py", "1e-5",
                                  "3e-5"], timeout_s=150, out=None)
  assert result.ok, result.describe() + "\n" + "\n".join(sum(result.outputs, [])[-20:])
  want = ("ConfigError: the 2 processes were started with different configs: "
          "actor.optimizer.lr: 1e-05 on process 0, 3e-05 on process 1. Start every process "
          "with the same config file and --config overrides")
  for out in result.outputs:
    assert want in out, out
