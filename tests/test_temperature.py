"""The training passes read the policy at the rollout's temperature (config/temperature.py):
log-probs and entropy of softmax(logits / T), as verl and TRL compute them; at T != 1 the
old log-probs are recomputed (the rollout's are temperature 1), and what cannot be right
at T != 1 is refused in one line."""

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


def test_a_step_at_temperature_05_recomputes_old_logprobs_at_it(tmp_path):
  """At T = 0.5 the old log-probs are the logprob node's (not the rollout's temperature-1
  ones) at T, so the one-epoch ratio is exactly 1: no clipping, no PPO KL."""
  m = _train(tmp_path, "--config.rollout.temperature=0.5")
  assert "old_logprob_from_rollout" not in m, m
  assert m["actor/pg_clipfrac"] == 0.0 and abs(m["actor/ppo_kl"]) < 1e-6, m
  one = _train(tmp_path / "t1", "--config.rollout.temperature=1.0")
  assert one["old_logprob_from_rollout"] == 1.0  # at T = 1 the rollout's stand in, as before


@pytest.mark.parametrize("flags,needle", [
    (["--config.rollout.temperature=0.7", "--config.actor.off_policy.correction=tis"],
     "actor.off_policy.correction='tis' at rollout.temperature=0.7: the rollout records "
     "temperature-1 log-probs"),
    (["--config=NO_OLD", "--config.rollout.temperature=0.7"],
     "rollout.temperature=0.7: node 'train_actor' (train.actor) needs the old log-probs at "
     "that temperature"),
])
def test_what_training_at_another_temperature_cannot_do_is_refused(flags, needle, tmp_path,
                                                                    capsys):
  (tmp_path / "no_old.py").write_text(
      "from distflow_jax.config import loading\n\ndef get_config():\n"
      "  c = loading.load('grpo:tiny')\n"
      "  c.dag = [d for d in c.dag if d['id'] != 'old_logprob']\n"
      "  c.dag[-1] = dict(c.dag[-1], deps=['advantage', 'ref_logprob'])\n  return c\n")
  flags = [f.replace("NO_OLD", str(tmp_path / "no_old.py")) for f in flags]
  assert cli.main(["plan", *flags]) == 2
  err = capsys.readouterr().err.strip()
  assert len(err.splitlines()) == 1 and needle in err, err
