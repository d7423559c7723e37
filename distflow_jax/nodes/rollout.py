"""Rollout nodes: ``generate`` samples ``rollout.n`` responses per prompt with the
rollout backend the config names (``rollout.backend``, see ``rollout/backend.py``);
``generate.greedy`` adds each prompt's greedy response (ReMax's baseline)."""

from __future__ import annotations

import numpy as np

from distflow_jax.dag.spec import DagError, Node, Role
from distflow_jax.data import layout as dlayout
from distflow_jax.data.batch import Batch, expand_groups, to_global, to_local
from distflow_jax.nodes.common import NodeOut, NodeTable
from distflow_jax.rollout import episodes
from distflow_jax.state import vision as vision_lib
from distflow_jax.state.context import RunContext, put_local
from distflow_jax.state.metrics import Metrics, gather_processes
from distflow_jax.data.fields import (BASELINE_MASK, BASELINE_TOKENS, EPISODE, GROUP_ID, LOSS_MASK,
                                      PROMPT_MASK, PROMPT_TOKENS, RESPONSE_MASK, RESPONSE_TOKENS,
                                      ROLLOUT_LOGPROBS, SAMPLE_ID)


def generate_node(ctx: RunContext, node: Node, lay: dlayout.Layout, prompts: Batch) -> NodeOut:
  """n samples per prompt on this host's rollout replica (the ``rollout.backend``);
  weight sync first."""
  rollout = ctx.section(node, "rollout")
  backend = ctx.replicas.backend(rollout)
  params = backend.update_weights(ctx.roles[Role.ACTOR].params)
  metrics = Metrics()
  # Bytes the sync resharded (LoRA with rollout.lora_sync=adapters: the adapters alone from
  # the second step on).
  metrics.set_max("sync/bytes_moved", backend.sync_bytes)
  ids, lens = np.asarray(prompts.data["prompt_ids"]), np.asarray(prompts.data["prompt_len"])
  plist = [ids[i, :lens[i]] for i in range(len(lens))]
  n = rollout.n
  # Keys from (seed, step, node, global sample id): samples do not depend on how prompts
  # are spread over hosts, so 1 x 8 and 2 x 2 devices generate the same tokens.
  sample_ids = np.asarray(prompts.data[SAMPLE_ID]).astype(np.int64)[:, None] * n + np.arange(n)
  # Vision-language runs: each prompt's features once, here, for all its n samples.
  images = None if ctx.vision is None else vision_lib.batch_images(
      ctx.vision, prompts.host_fields(prompts.data[GROUP_ID]), plist)
  extra = {} if images is None else {
      "images": vision_lib.prompt_images(ctx.vision.cfg, images[0], plist, images[1])}
  episode_fields: dict = {}
  if rollout.env:  # multi-turn episodes (rollout/episodes.py)
    ro, episode_fields = _episodes(ctx, rollout, backend, params, prompts, plist,
                                   sample_ids.reshape(-1), ctx.step_rng(node), metrics)
  else:
    ro = backend.generate(params, plist, n, rng=ctx.step_rng(node),
                          pad_id=ctx.tokenizer.pad_id, request_ids=sample_ids.reshape(-1),
                          **extra)
  p_max = prompt_width(int(lens.max(initial=0)), rollout.prefill_buckets,
                       ctx.cfg.data.max_prompt_len)
  rows = np.repeat(np.arange(len(plist)), n)
  prompt_tokens = np.full((len(rows), p_max), ctx.tokenizer.pad_id, np.int32)
  prompt_mask = np.zeros((len(rows), p_max), bool)
  for r, i in enumerate(rows):  # left-pad: the response follows the prompt directly
    prompt_tokens[r, p_max - lens[i]:] = plist[i]
    prompt_mask[r, p_max - lens[i]:] = True
  groups = expand_groups(Batch({SAMPLE_ID: prompts.data[SAMPLE_ID],
                                GROUP_ID: prompts.data[GROUP_ID]}, prompts.host), n)
  local = Batch({**groups.data, PROMPT_TOKENS: prompt_tokens, PROMPT_MASK: prompt_mask,
                 RESPONSE_TOKENS: ro.tokens_RxN, RESPONSE_MASK: ro.mask_RxN,
                 ROLLOUT_LOGPROBS: ro.logprobs_RxN, **episode_fields}, prompts.host)
  if images is not None:  # features travel with their samples (state/vision.py)
    feats, grids = images
    local = local.replace(**vision_lib.image_fields(
        ctx.vision.cfg, [feats[i] for i in rows], prompt_tokens, prompt_mask,
        [grids[i] for i in rows], np.asarray(ro.tokens_RxN).shape[1]))
  metrics.add_mean("response_length", ro.lengths_R)
  metrics.add_mean("prompt_length", lens[rows])
  metrics.set_max("prompt_width", p_max)
  metrics.add_mean("response_stopped", ro.stopped_R)
  # The sampled tokens' mean negative log-prob under the policy: an estimate of its entropy
  # per token that needs no extra pass (the health monitor's entropy signal reads it).
  mask = np.asarray(episode_fields.get(LOSS_MASK, ro.mask_RxN), bool)  # generated tokens
  metrics.add("rollout_nll", float(-np.asarray(ro.logprobs_RxN, np.float64)[mask].sum()),
              float(mask.sum()))
  return NodeOut(to_global(local, lay), metrics)


def greedy_baseline_node(ctx: RunContext, node: Node, lay: dlayout.Layout,
                         batch: Batch) -> NodeOut:
  """ReMax's baseline: one greedy response per prompt group of the batch (the held-out
  evaluation's greedy replica, weights synced first), on every row of its group as
  ``baseline_tokens`` / ``baseline_mask``; the rule rewards after it score it
  (``baseline_rewards``).  Text, single-turn rollouts only."""
  rollout = ctx.section(node, "rollout")
  if rollout.env or ctx.vision is not None:
    raise DagError(f"DAG node {node.id!r} (generate.greedy): the greedy baseline is built "
                   f"for single-turn text rollouts only; unset rollout.env / use a text model")
  backend = ctx.replicas.backend(rollout, greedy=True)
  params = backend.update_weights(ctx.roles[Role.ACTOR].params)
  local = to_local(Batch({k: batch.data[k] for k in (
      PROMPT_TOKENS, PROMPT_MASK, RESPONSE_TOKENS, SAMPLE_ID, GROUP_ID)}, batch.host))
  groups = np.asarray(local.data[GROUP_ID])
  _, first, inverse = np.unique(groups, return_index=True, return_inverse=True)
  toks, pmask = np.asarray(local.data[PROMPT_TOKENS]), np.asarray(local.data[PROMPT_MASK])
  ro = backend.generate(params, [toks[r][pmask[r]] for r in first], 1,
                        pad_id=ctx.tokenizer.pad_id, request_ids=groups[first].tolist())
  width = np.asarray(local.data[RESPONSE_TOKENS]).shape[1]
  got = np.asarray(ro.tokens_RxN).shape[1]
  if got > width:
    raise DagError(f"DAG node {node.id!r}: its greedy responses are {got} tokens wide, the "
                   f"batch's {width}; give it the rollout's max_new_tokens")
  pad = ((0, 0), (0, width - got))
  tokens = np.pad(np.asarray(ro.tokens_RxN), pad, constant_values=ctx.tokenizer.pad_id)
  mask = np.pad(np.asarray(ro.mask_RxN, bool), pad)
  rows = inverse.reshape(-1)
  metrics = Metrics()
  metrics.add_mean("baseline_length", ro.lengths_R)
  made = {BASELINE_TOKENS: tokens[rows], BASELINE_MASK: mask[rows]}
  return NodeOut(put_local(batch, lay, **made), metrics)


# The batch fields episodes add (plan --lower's catalogue moves and trains them too).


def _episodes(ctx: RunContext, rollout, backend, params, prompts: Batch, plist, ids, rng,
              metrics: Metrics):
  """``rollout.n`` episodes per prompt with ``rollout.env``: the rollout, the batch fields
  ``loss_mask`` (generated tokens; observation tokens are never trained on),
  ``env_rewards`` and ``env_turn_rewards`` (``reward.env`` reads them); the ``env/*``
  metrics go into ``metrics``."""
  rows = [f or {} for f in prompts.host_fields(prompts.data[GROUP_ID])]
  ep = episodes.run_episodes(backend, params, plist, rows, rollout.n,
                             env=episodes.EnvSetup.from_config(rollout),
                             tokenizer=ctx.tokenizer, width=rollout.response_width,
                             rng=rng, request_ids=ids,
                             pad_id=ctx.tokenizer.pad_id)
  metrics.add_mean("env/turns_mean", ep.turns_R)
  metrics.add_mean("env/truncated", ep.truncated_R)
  metrics.add("env/errors", float(ep.errors), float(len(ep.reward_R)))  # per episode
  metrics.add_mean("env/reward", ep.reward_R)
  return ep.rollout, dict(zip(EPISODE,
                              (ep.loss_mask_RxN, ep.reward_R, ep.turn_rewards_RxN)))


def prompt_width(longest_here: int, buckets, max_prompt_len: int) -> int:
  """How wide the batch's prompt columns are: the smallest prefill bucket that holds the
  longest prompt on any host (else ``max_prompt_len``).  Length bucketing: short prompts
  are not padded to ``max_prompt_len`` through the reference and training passes, and
  the few widths bound the number of compiles.  One tiny all-gather keeps hosts agreed."""
  longest = int(gather_processes(np.array([longest_here], np.int64)).max())
  fits = [b for b in sorted(buckets) if longest <= b <= max_prompt_len]
  return fits[0] if fits else max_prompt_len


def prompt_widths(buckets, max_prompt_len: int) -> tuple[int, ...]:
  """Every width ``prompt_width`` can return under these settings."""
  return tuple(sorted({b for b in buckets if b <= max_prompt_len} | {max_prompt_len}))


NODES: NodeTable = {"generate": generate_node, "generate.greedy": greedy_baseline_node}
