"""Held-out evaluation: greedy (or sampled, for pass@k) answers scored by a rule verifier.

Each process evaluates its own shard of the evaluation set on its rollout
replica; accuracies are reduced across hosts by sample count.
"""

from __future__ import annotations

import ml_collections
import numpy as np

from distflow_jax.dag.spec import Role
from distflow_jax.data.batch import Batch
from distflow_jax.rewards import registry as reward_registry
from distflow_jax.rollout import driver
from distflow_jax.workflow.context import RunContext
from distflow_jax.workflow.metrics import Metrics


def pass_at_k(num_samples: int, num_correct: int, k: int) -> float:
  """Unbiased pass@k estimator (Chen et al. 2021): 1 - C(n-c, k) / C(n, k)."""
  if k > num_samples:
    raise ValueError(f"pass@{k} needs at least {k} samples per prompt, got {num_samples}")
  if num_samples - num_correct < k:
    return 1.0
  return 1.0 - float(np.prod(1.0 - k / np.arange(num_samples - num_correct + 1,
                                                  num_samples + 1)))


def evaluate(ctx: RunContext, prompts: Batch, *, k: int = 1,
             reward: str = "math") -> dict[str, float]:
  """Accuracy (greedy, k=1) or pass@k (k samples at the rollout temperature)."""
  rollout = ctx.cfg.rollout
  if k > 1:
    rollout = ml_collections.ConfigDict(rollout.to_dict())
    rollout.n = k
  engine = ctx.engine(rollout, greedy=(k == 1))
  params = engine.update_params(ctx.roles[Role.ACTOR].params)
  ids, lens = np.asarray(prompts.data["prompt_ids"]), np.asarray(prompts.data["prompt_len"])
  plist = [ids[i, :lens[i]] for i in range(len(lens))]
  ro = driver.generate(engine, params, plist, k, pad_id=ctx.tokenizer.pad_id)
  fields = prompts.host_fields(prompts.data["group_id"])
  texts = [ctx.tokenizer.decode(ro.tokens_RxN[r][ro.mask_RxN[r]].tolist())
           for r in range(len(ro.lengths_R))]
  truths = [fields[r // k]["answer"] for r in range(len(texts))]
  scores = reward_registry.score_batch(reward_registry.get_reward(reward), texts, truths)
  m = Metrics()
  correct = (scores > 0).reshape(len(plist), k)
  if k == 1:
    m.add_mean("eval/accuracy", correct[:, 0])
  else:
    m.add_mean(f"eval/pass@{k}", [pass_at_k(k, int(c.sum()), k) for c in correct])
    m.add_mean("eval/accuracy", correct)
  m.add_mean("eval/response_length", ro.lengths_R)
  # How many answers end in the verifier's "#### N" form: separates learning the answer
  # convention from getting the arithmetic right.
  m.add_mean("eval/formatted", reward_registry.score_batch(
      reward_registry.get_reward("format"), texts, truths) > 0)
  return m.reduce()
