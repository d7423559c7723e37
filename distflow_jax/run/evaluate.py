"""Held-out evaluation: greedy (or sampled, for pass@k) answers scored by a rule verifier.

``evaluate`` scores one batch of prompts (the trainer's periodic evaluation);
``evaluate_file`` scores every row of a dataset file in chunks (``distflow-jax
eval``).  Each process evaluates its own shard on its rollout replica;
accuracies are reduced across hosts by sample count.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils

from distflow_jax.config.errors import ConfigError
from distflow_jax.dag.spec import Role
from distflow_jax.data.batch import Batch
from distflow_jax.data.fields import GROUP_ID
from distflow_jax.data.loader import PromptLoader
from distflow_jax.data.sources import open_source
from distflow_jax.observe import samples as samples_lib
from distflow_jax.observe.heartbeat import heartbeat, interval as heartbeat_interval
from distflow_jax.rewards import registry as reward_registry
from distflow_jax.rollout import episodes
from distflow_jax.state import vision as vision_lib
from distflow_jax.state.context import RunContext
from distflow_jax.state.metrics import Metrics


def pass_at_k(num_samples: int, num_correct: int, k: int) -> float:
  """Unbiased pass@k estimator (Chen et al. 2021): 1 - C(n-c, k) / C(n, k)."""
  if k > num_samples:
    raise ValueError(f"pass@{k} needs at least {k} samples per prompt, got {num_samples}")
  if num_samples - num_correct < k:
    return 1.0
  return 1.0 - float(np.prod(1.0 - k / np.arange(num_samples - num_correct + 1,
                                                  num_samples + 1)))


def evaluate(ctx: RunContext, prompts: Batch, *, k: int = 1, reward: str = "math",
             samples: list[dict[str, Any]] | None = None,
             num_samples: int = 0) -> dict[str, float]:
  """Accuracy (greedy, k=1: ``eval/accuracy``) or pass@k and the mean accuracy of the k
  samples at the rollout temperature (``eval/pass@k``, ``eval/mean_accuracy@k``).

  With ``rollout.env`` set each answer is an episode (rollout/episodes.py): the verifier
  scores the model's own tokens of all its turns (observations left out), and
  ``eval/turns_mean`` / ``eval/env_reward`` (the environment's reward) are added.

  With a ``samples`` list, the first ``num_samples`` prompts of this process's batch are
  appended to it as records (prompt, response, reward, correct, answer;
  ``observe/samples.py``); the metrics are the same either way."""
  rollout = ctx.cfg.rollout
  if k > 1:
    rollout = dataclasses.replace(rollout, n=k)
  backend = ctx.replicas.backend(rollout, greedy=(k == 1))
  params = backend.update_weights(ctx.roles[Role.ACTOR].params)
  ids, lens = np.asarray(prompts.data["prompt_ids"]), np.asarray(prompts.data["prompt_len"])
  plist = [ids[i, :lens[i]] for i in range(len(lens))]
  fields = prompts.host_fields(prompts.data[GROUP_ID])
  extra = {}
  if ctx.vision is not None:  # each prompt's features once (state/vision.py)
    feats, grids = vision_lib.batch_images(ctx.vision, fields, plist)
    extra["images"] = vision_lib.prompt_images(ctx.vision.cfg, feats, plist, grids)
  m = Metrics()
  if rollout.env:  # episodes: the model's own tokens are scored, not observations
    ep = episodes.run_episodes(backend, params, plist, [f or {} for f in fields], k,
                               env=episodes.EnvSetup.from_config(rollout),
                               tokenizer=ctx.tokenizer, width=rollout.response_width,
                               pad_id=ctx.tokenizer.pad_id)
    ro, scored = ep.rollout, ep.loss_mask_RxN
    m.add_mean("eval/turns_mean", ep.turns_R)
    m.add_mean("eval/env_reward", ep.reward_R)
  else:
    ro = backend.generate(params, plist, k, pad_id=ctx.tokenizer.pad_id, **extra)
    scored = ro.mask_RxN
  texts = [_own_text(ctx.tokenizer, ro.tokens_RxN[r], scored[r]) for r in range(len(ro.lengths_R))]
  truths = [fields[r // k]["answer"] for r in range(len(texts))]
  scores = reward_registry.score_batch(
      reward_registry.configured_reward(reward, ctx.cfg.reward), texts, truths)
  if samples is not None and num_samples > 0:  # the whole episode, observations included
    shown = texts if scored is ro.mask_RxN else [
        ctx.tokenizer.decode(ro.tokens_RxN[r][ro.mask_RxN[r]].tolist()) for r in range(len(texts))]
    samples.extend(samples_lib.sample_records(ctx.tokenizer, fields, plist, shown, truths,
                                              scores, k, num_samples))
  correct = (scores > 0).reshape(len(plist), k)
  if k == 1:
    m.add_mean("eval/accuracy", correct[:, 0])
    if reward != "math":  # the strict verifier's accuracy beside a lenient one's
      m.add_mean("eval/accuracy_strict", reward_registry.score_batch(
          reward_registry.configured_reward("math", ctx.cfg.reward), texts, truths) > 0)
  else:
    m.add_mean(f"eval/pass@{k}", [pass_at_k(k, int(c.sum()), k) for c in correct])
    # One sample's accuracy, averaged over the k: not greedy accuracy, so not its key.
    m.add_mean(f"eval/mean_accuracy@{k}", correct)
  m.add_mean("eval/response_length", ro.lengths_R)
  # Prompts holding the tokenizer's unknown token (characters its vocabulary lacks): kept,
  # counted (their answers are scored like any other).
  m.add_mean("eval/unk_prompts", [bool((f or {}).get("unk_tokens")) for f in fields])
  # How many answers end in the verifier's "#### N" form: separates learning the answer
  # convention from getting the arithmetic right.
  m.add_mean("eval/formatted", reward_registry.score_batch(
      reward_registry.get_reward("format"), texts, truths) > 0)
  return m.reduce()


def _own_text(tokenizer, tokens: np.ndarray, own: np.ndarray) -> str:
  """The text of ``tokens`` where ``own`` (the model's, not an observation's), each run of
  them (a turn) on its own line: the final turn's last line is the answer's."""
  edges = np.flatnonzero(np.diff(np.concatenate([[0], own.astype(np.int8), [0]])))
  return "\n".join(tokenizer.decode(tokens[a:b].tolist()) for a, b in zip(edges[::2], edges[1::2]))


class _Head:
  """The first ``n`` records of a source (``--limit``)."""

  def __init__(self, source: Any, n: int):
    self.source, self.n, self.path = source, min(n, len(source)), source.path

  def __len__(self) -> int:
    return self.n

  def __getitem__(self, index: int) -> Any:
    if not 0 <= index < self.n:
      raise IndexError(index)
    return self.source[index]


def _concat(batches: list[Batch]) -> Batch:
  data = {k: np.concatenate([np.asarray(b.data[k]) for b in batches]) for k in batches[0].data}
  host = {}
  for b in batches:
    host.update(b.host)
  return Batch(data, host)


def _global_sum(x: float) -> float:
  if jax.process_count() == 1:
    return float(x)
  return float(np.asarray(multihost_utils.process_allgather(np.array([x], np.float64))).sum())


def load_shard(ctx: RunContext, path: str, limit: int = 0
               ) -> tuple[list[Batch], dict[str, int], int]:
  """This process's valid prompts as one-row batches, the loader's counts, and the row count."""
  cfg = ctx.cfg
  source = open_source(path)
  if limit:
    source = _Head(source, limit)
  loader = PromptLoader(source, ctx.tokenizer, batch_size=1, max_prompt_len=cfg.data.max_prompt_len,
                        shuffle=False, num_epochs=1, pad_id=ctx.tokenizer.pad_id,
                        prompt_key=cfg.data.prompt_key, answer_key=cfg.data.answer_key,
                        use_chat_template=cfg.data.chat_template,
                        on_bad_row=cfg.data.on_bad_row,
                        image_key=cfg.image_key,
                        image_root=cfg.data.image_root)
  return list(loader), loader.counts, len(source)


def evaluate_file(ctx: RunContext, path: str, *, k: int = 1, batch_size: int = 64,
                  limit: int = 0, reward: str = "math",
                  log: Callable[[str], None] = print) -> dict[str, float | int]:
  """Metrics over every valid row of ``path``: means weighted by each chunk's prompt count."""
  rows, counts, num_records = load_shard(ctx, path, limit)
  nproc = jax.process_count()
  # Same on every process (from the row count alone), so collectives stay in step.
  chunks = max(math.ceil(math.ceil(num_records / nproc) / batch_size), 1)
  if len(rows) < chunks:
    bad = {key: v for key, v in counts.items() if key != "ok" and v}
    # Rows too long for the prompt budget are the usual cause: name the setting that keeps them.
    fix = (f"raise --config.data.max_prompt_len (now {ctx.cfg.data.max_prompt_len}; rows longer "
           f"are skipped) and rollout.prefill_buckets with it" if bad.get("too_long") else
           "fix the rows (see data.prompt_key, data.answer_key)")
    raise ConfigError(f"{path!r}: this process has {len(rows)} valid prompt(s) for {chunks} "
                      f"chunk(s) of --batch_size={batch_size} (bad rows {bad}); {fix}")
  totals: dict[str, float] = {}
  done = 0.0
  for c, part in enumerate(np.array_split(np.arange(len(rows)), chunks)):
    # The first chunk compiles the rollout (a minute on a big model): say it is alive.
    with heartbeat(log if c == 0 else None, f"eval: compiling the rollout, chunk 1/{chunks}",
                   heartbeat_interval(ctx.cfg), compiles=True):
      m = evaluate(ctx, _concat([rows[i] for i in part]), k=k, reward=reward)
    n = _global_sum(len(part))
    for key, v in m.items():
      totals[key] = totals.get(key, 0.0) + v * n
    done += n
    key = "eval/accuracy" if k == 1 else f"eval/pass@{k}"
    acc = totals.get(key, float("nan")) / done
    log(f"eval chunk {c + 1}/{chunks}: {int(done)} prompts, {key.split('/')[-1]} so far "
        f"{acc:.4f}")
  out = {key: v / done for key, v in totals.items()}
  out["prompts"] = int(done)
  out["skipped_rows"] = int(_global_sum(sum(v for key, v in counts.items() if key != "ok")))
  return out
