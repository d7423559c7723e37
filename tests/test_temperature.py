"""The training passes read the policy at the rollout's temperature (config/temperature.py):
log-probs and entropy of softmax(logits / T), as verl and TRL compute them; the rollout
records its log-probs at the same T, so they stand in for the old log-probs and are the
behaviour policy of an off-policy correction at any temperature."""

import json

import jax
import numpy as np
import pytest
from flax import nnx

from distflow_jax import cli
from distflow_jax.models import Transformer
from distflow_jax.train import steps
from test_train_steps import CFG, make_batch

pytestmark = pytest.mark.timeout(300)


@pytest.mark.parametrize("t", [1.0, 0.6, 1.7])
def test_response_logprobs_are_those_of_the_tempered_softmax(t):
  graphdef, params = nnx.split(Transformer(CFG, rngs=nnx.Rngs(0)))
  batch = make_batch(3)
  logp, ent = steps.response_logprobs(graphdef, params, batch, temperature=t)
  # By hand: the full logits of prompt + response, each response token read one position
  # before it, divided by t.
  model = nnx.merge(graphdef, params)
  tokens = np.concatenate([batch["prompt_tokens"], batch["response_tokens"]], 1)
  mask = np.concatenate([batch["prompt_mask"], batch["response_mask"]], 1)
  positions = np.maximum(np.cumsum(mask, 1) - 1, 0)
  logits = np.asarray(model(tokens, positions, mask)[0] if isinstance(
      model(tokens, positions, mask), tuple) else model(tokens, positions, mask), np.float64)
  p = batch["prompt_tokens"].shape[1]
  n = batch["response_tokens"].shape[1]
  z = logits[:, p - 1:p - 1 + n] / t
  z = z - z.max(-1, keepdims=True)
  lsm = z - np.log(np.exp(z).sum(-1, keepdims=True))
  want = np.take_along_axis(lsm, batch["response_tokens"][..., None], -1)[..., 0]
  want_ent = -(np.exp(lsm) * lsm).sum(-1)
  m = batch["response_mask"]
  np.testing.assert_allclose(np.asarray(logp)[m], want[m], atol=2e-5)
  np.testing.assert_allclose(np.asarray(ent)[m], want_ent[m], atol=2e-5)


def _train(tmp_path, *flags):
  from workflow_util import SMOKE
  run_dir = tmp_path / "run"
  code = cli.main(["train", "--config=grpo:tiny", *(f"--config.{o}" for o in SMOKE),
                   f"--config.run_dir={run_dir}", "--config.trainer.total_steps=1",
                   "--config.data.prompts_per_step=8", "--config.rollout.n=2",
                   "--config.actor.micro_batch_size=2", *flags])
  assert code == 0
  return [json.loads(l) for l in open(run_dir / "metrics.jsonl")][-1]


def test_at_temperature_05_the_rollouts_logprobs_are_the_old_ones_at_it(tmp_path):
  """At T = 0.5 the rollout's log-probs stand in for the old ones (no recompute) and the
  one-epoch ratio against the trainer's pass at T is 1 to float rounding: no clipping, no
  PPO KL.  Recomputed, they equal the rollout's to the engine's rounding."""
  m = _train(tmp_path, "--config.rollout.temperature=0.5")
  assert m["old_logprob_from_rollout"] == 1.0, m
  assert m["actor/pg_clipfrac"] == 0.0 and abs(m["actor/ppo_kl"]) < 1e-5, m
  again = _train(tmp_path / "again", "--config.rollout.temperature=0.5",
                 "--config.actor.recompute_old_logprobs=True")
  assert "old_logprob_from_rollout" not in again, again
  assert again["off_policy/logprob_gap"] < 1e-4 and again["off_policy/logprob_gap_max"] < 1e-3
  one = _train(tmp_path / "t1", "--config.rollout.temperature=1.0")
  assert one["old_logprob_from_rollout"] == 1.0


def test_at_another_temperature_a_correction_and_a_dag_without_logprob_train(tmp_path):
  """What was refused while the rollout recorded temperature-1 log-probs: an off-policy
  correction (its behaviour policy is now the tempered distribution) and a DAG whose old
  log-probs are the rollout's."""
  m = _train(tmp_path, "--config.rollout.temperature=0.7",
             "--config.actor.off_policy.correction=tis")
  assert m["off_policy/logprob_gap"] < 1e-4 and abs(m["off_policy/is_weight_mean"] - 1) < 1e-4
  (tmp_path / "no_old.py").write_text(
      "from distflow_jax.config import loading\n\ndef get_config():\n"
      "  c = loading.load('grpo:tiny')\n"
      "  c.dag = [d for d in c.dag if d['id'] != 'old_logprob']\n"
      "  c.dag[-1] = dict(c.dag[-1], deps=['advantage', 'ref_logprob'])\n  return c\n")
  from workflow_util import SMOKE
  run_dir = tmp_path / "run_no_old"
  assert cli.main(["train", f"--config={tmp_path / 'no_old.py'}",
                   *(f"--config.{o}" for o in SMOKE), f"--config.run_dir={run_dir}",
                   "--config.trainer.total_steps=1", "--config.data.prompts_per_step=8",
                   "--config.rollout.n=2", "--config.actor.micro_batch_size=2",
                   "--config.rollout.temperature=0.7"]) == 0
  m = [json.loads(l) for l in open(run_dir / "metrics.jsonl")][-1]
  assert m["actor/pg_clipfrac"] == 0.0 and abs(m["actor/ppo_kl"]) < 1e-5, m
