"""The built-in node functions, bound to their names in the registry.

Each is ``fn(ctx, node, layout, batch) -> batch``: it reads fields of the
batch (global arrays laid out as ``layout``), adds the fields it makes, and
records metrics in ``ctx.metrics``.  Host-side nodes work on this process's
rows only (``to_local`` / ``put_local``), so no data leaves the host.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from distflow_jax.algos import advantages as adv_lib
from distflow_jax.algos import kl as kl_lib
from distflow_jax.dag.registry import FUNCTIONS
from distflow_jax.dag.spec import DagError, Node, Role
from distflow_jax.data import layout as dlayout
from distflow_jax.data.batch import GROUP_ID, SAMPLE_ID, Batch, expand_groups, to_global, to_local
from distflow_jax.rewards import registry as reward_registry
from distflow_jax.rollout import driver
from distflow_jax.train import deterministic, steps as steps_lib
from distflow_jax.workflow.context import RunContext, put_local, shared_prompt_group
from distflow_jax.workflow.metrics import gather_processes

SEQ_FIELDS = ("prompt_tokens", "prompt_mask", "response_tokens", "response_mask")


def generate(ctx: RunContext, node: Node, lay: dlayout.Layout, prompts: Batch) -> Batch:
  """n samples per prompt on this host's rollout replica; weight sync first."""
  rollout = ctx.section(node, "rollout")
  engine = ctx.engine(rollout)
  params = engine.update_params(ctx.roles[Role.ACTOR].params)
  ids, lens = np.asarray(prompts.data["prompt_ids"]), np.asarray(prompts.data["prompt_len"])
  plist = [ids[i, :lens[i]] for i in range(len(lens))]
  n = rollout.n
  # Keys from (seed, step, node, global sample id): samples do not depend on how prompts
  # are spread over hosts, so 1 x 8 and 2 x 2 devices generate the same tokens.
  sample_ids = np.asarray(prompts.data[SAMPLE_ID]).astype(np.int64)[:, None] * n + np.arange(n)
  ro = driver.generate(engine, params, plist, n, rng=ctx.step_rng(node),
                       pad_id=ctx.tokenizer.pad_id, request_ids=sample_ids.reshape(-1))
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
  local = Batch({**groups.data, "prompt_tokens": prompt_tokens, "prompt_mask": prompt_mask,
                 "response_tokens": ro.tokens_RxN, "response_mask": ro.mask_RxN,
                 "rollout_logprobs": ro.logprobs_RxN}, prompts.host)
  ctx.metrics.add_mean("response_length", ro.lengths_R)
  ctx.metrics.add_mean("prompt_length", lens[rows])
  ctx.metrics.set_max("prompt_width", p_max)
  ctx.metrics.add_mean("response_stopped", ro.stopped_R)
  return to_global(local, lay)


def prompt_width(longest_here: int, buckets, max_prompt_len: int) -> int:
  """How wide the batch's prompt columns are: the smallest prefill bucket that holds the
  longest prompt on any host (else ``max_prompt_len``).  Length bucketing: short prompts
  are not padded to ``max_prompt_len`` through the reference and training passes, and
  the few widths bound the number of compiles.  One tiny all-gather keeps hosts agreed."""
  longest = int(gather_processes(np.array([longest_here], np.int64)).max())
  fits = [b for b in sorted(buckets) if longest <= b <= max_prompt_len]
  return fits[0] if fits else max_prompt_len


def _rule_reward(name: str, ctx: RunContext, node: Node, lay: dlayout.Layout,
                 batch: Batch) -> Batch:
  local = to_local(Batch({k: batch.data[k] for k in
                          ("response_tokens", "response_mask", SAMPLE_ID, GROUP_ID)},
                         batch.host))
  toks, mask = local.data["response_tokens"], local.data["response_mask"]
  texts = [ctx.tokenizer.decode(toks[i][mask[i]].tolist()) for i in range(len(toks))]
  fields = local.host_fields(local.data[GROUP_ID])
  missing = [int(g) for g, f in zip(local.data[GROUP_ID], fields) if f is None]
  if missing:
    raise DagError(f"DAG node {node.id!r}: prompt groups {missing[:4]} are not on the host "
                   f"that loaded them, so their ground truth is not here; run rule rewards "
                   f"before any node that re-partitions the batch")
  truths = [f["answer"] for f in fields]
  scores = reward_registry.score_batch(reward_registry.get_reward(name), texts, truths,
                                       sample_ids=local.data[SAMPLE_ID].tolist())
  weight = ctx.section(node, "reward").weight
  ctx.metrics.add_mean(f"reward/{node.id}", scores)
  if name == "math":
    ctx.metrics.add_mean("accuracy", scores > 0)
  rewards = weight * scores.astype(np.float32)
  if "rewards" in batch.data:
    rewards = rewards + to_local(Batch({"rewards": batch.data["rewards"],
                                        SAMPLE_ID: batch.data[SAMPLE_ID],
                                        GROUP_ID: batch.data[GROUP_ID]})).data["rewards"]
  return put_local(batch, lay, rewards=rewards)


def rule_reward_node(name: str):
  """The node function of a rule reward registered in ``distflow_jax.rewards`` as ``name``;
  plugins use it to expose their own rewards as DAG functions."""
  return functools.partial(_rule_reward, name)


def reward_model(ctx: RunContext, node: Node, lay: dlayout.Layout, batch: Batch) -> Batch:
  """The learned reward model's score of prompt + response, on the reward mesh; added to
  any rewards already in the batch (rule rewards), times ``reward.weight``."""
  state = ctx.roles[Role.REWARD]
  fn = ctx.jitted(("reward_model", lay), lambda: _pass_fn(
      ctx, lay, steps_lib.sequence_scores, ctx.cfg.actor.micro_batch_size))
  scores = fn(state.graphdef, state.params, _seq(batch))
  weight = ctx.section(node, "reward").weight
  ctx.metrics.add(f"reward/{node.id}", float(jnp.sum(scores)), scores.shape[0])
  rewards = weight * scores
  if "rewards" in batch.data:
    rewards = rewards + batch.data["rewards"]
  return batch.replace(rewards=rewards)


def _local(batch: Batch, *keys: str) -> dict[str, np.ndarray]:
  sub = Batch({k: batch.data[k] for k in (*keys, SAMPLE_ID, GROUP_ID)})
  return dict(to_local(sub).data)


def _check_groups(node: Node, group_ids: np.ndarray, n: int) -> None:
  blocks = group_ids.reshape(-1, n) if group_ids.size % n == 0 else None
  if blocks is None or (blocks != blocks[:, :1]).any():
    raise DagError(f"DAG node {node.id!r} needs the {n} samples of each prompt together on "
                   f"this host, but its rows hold groups {group_ids[:2 * n].tolist()}...: "
                   f"a group was split (check rollout.n and the re-partition before it)")


def _token_rewards(ctx: RunContext, node: Node, loc: dict, mask: np.ndarray) -> jax.Array:
  token_rewards = adv_lib.outcome_to_token_rewards(jnp.asarray(loc["rewards"]), mask)
  kl_cfg = ctx.cfg.actor.kl
  coef = ctx.kl_coef if ctx.kl_coef is not None else kl_cfg.coef
  if kl_cfg.in_reward and coef:
    if "ref_logprobs" not in loc:
      raise DagError(f"DAG node {node.id!r}: actor.kl.in_reward needs 'ref_logprobs'; add a "
                     f"ref_logprob node to its dependencies")
    logp = loc.get("old_logprobs", loc["rollout_logprobs"])
    kl = kl_lib.kl_divergence(logp, loc["ref_logprobs"], kl_cfg.estimator)
    token_rewards = kl_lib.apply_kl_penalty(token_rewards, kl, mask, coef)
    ctx.metrics.add("kl_coef", coef)
    ctx.metrics.add("kl_penalty", float(jnp.sum(kl * mask)), float(mask.sum()))
  return token_rewards


def _advantage(kind: str, ctx: RunContext, node: Node, lay: dlayout.Layout,
               batch: Batch) -> Batch:
  algo, n = ctx.section(node, "algo"), ctx.cfg.rollout.n
  keys = ["rewards", "response_mask", "rollout_logprobs"] + [
      k for k in ("values", "old_logprobs", "ref_logprobs") if k in batch.data]
  loc = _local(batch, *keys)
  mask = jnp.asarray(loc["response_mask"]).astype(jnp.float32)
  rewards = jnp.asarray(loc["rewards"])
  if kind in ("grpo", "rloo", "reinforce_pp_baseline"):
    _check_groups(node, loc[GROUP_ID], n)
  if kind == "grpo":
    out = adv_lib.grpo_advantages(rewards, mask, group_size=n,
                                  normalize_by_std=algo.norm_by_std)
  elif kind == "rloo":
    out = adv_lib.rloo_advantages(rewards, mask, group_size=n)
  elif kind == "reinforce_pp_baseline":
    out = adv_lib.reinforce_pp_baseline_advantages(rewards, mask, group_size=n, whiten=False)
  elif kind == "reinforce_pp":
    out = adv_lib.reinforce_pp_advantages(_token_rewards(ctx, node, loc, mask), mask,
                                          gamma=algo.gamma, whiten=False)
  else:  # gae
    out = adv_lib.gae_advantages(_token_rewards(ctx, node, loc, mask), jnp.asarray(loc["values"]),
                                 mask, gamma=algo.gamma, lam=algo.lam, whiten=False)
  if kind in ("reinforce_pp_baseline", "reinforce_pp", "gae"):
    out = out._replace(advantages_BxT=global_whiten(np.asarray(out.advantages_BxT),
                                                    np.asarray(mask), loc[SAMPLE_ID]))
  ctx.metrics.add_mean("reward", loc["rewards"])
  ctx.metrics.add("reward_sq", float(np.sum(np.square(loc["rewards"]))), loc["rewards"].size)
  return put_local(batch, lay, advantages=np.asarray(out.advantages_BxT, np.float32),
                   returns=np.asarray(out.returns_BxT, np.float32))


def global_whiten(x: np.ndarray, mask: np.ndarray, sample_ids: np.ndarray) -> np.ndarray:
  """``algos.advantages.masked_whiten`` over the whole batch of every host.

  The statistics come from per-row sums gathered from every host and added in sample-id
  order, so the result is bitwise the same however samples are spread over hosts.
  """
  m = mask.astype(np.float64)
  xr = np.where(m > 0, x.astype(np.float64), 0.0)

  def ordered_total(per_row: np.ndarray) -> np.ndarray:
    rows = gather_processes(np.concatenate([sample_ids[:, None].astype(np.float64), per_row],
                                           axis=1)).reshape(-1, per_row.shape[1] + 1)
    return rows[np.argsort(rows[:, 0], kind="stable"), 1:].sum(axis=0)

  n, s1 = ordered_total(np.stack([m.sum(axis=1), xr.sum(axis=1)], axis=1))
  mean = s1 / max(n, 1.0)
  s2 = ordered_total(((xr - mean) ** 2 * m).sum(axis=1)[:, None])[0]
  var = s2 / max(n - 1.0, 1.0)
  return ((xr - mean) / np.sqrt(var + 1e-8) * m).astype(np.float32)


def _seq(batch: Batch) -> dict:
  return {k: batch.data[k] for k in SEQ_FIELDS}


def _on_policy(ctx: RunContext) -> bool:
  """One epoch over one mini-batch: the policy is still the one that sampled, so the
  rollout's own log-probs (untruncated, temperature 1) are the old log-probs."""
  actor = ctx.cfg.actor
  return actor.ppo_epochs == 1 and actor.mini_batches == 1 and not actor.recompute_old_logprobs


def _prompt_group(ctx: RunContext, node: Node, data: dict, num_parts: int) -> int:
  """Rows per shared prompt for this pass: rollout.n when sharing is on, `num_parts` parts of
  the batch hold whole groups and the rows are so grouped (checked on device), else 1."""
  gs = shared_prompt_group(ctx.cfg, data["response_mask"].shape[0], num_parts)
  if gs > 1:
    check = ctx.jitted(("grouped", gs), lambda: jax.jit(
        functools.partial(steps_lib.prompts_grouped, group_size=gs)))
    if not bool(check(data)):
      gs = 1
  ctx.metrics.add(f"prompt_group/{node.id}", float(gs))
  return gs


def _model_pass(field: str, role: Role, ctx: RunContext, node: Node, lay: dlayout.Layout,
                batch: Batch) -> Batch:
  if field == "old_logprobs" and _on_policy(ctx):
    ctx.metrics.add("old_logprob_from_rollout", 1.0)
    return batch.replace(old_logprobs=batch.data["rollout_logprobs"])
  state = ctx.roles[role]
  if role is Role.CRITIC:
    fn = ctx.jitted(("values", lay), lambda: _pass_fn(
        ctx, lay, steps_lib.response_values, ctx.cfg.critic.micro_batch_size))
    out = fn(state.graphdef, state.params, _seq(batch))
  else:
    data = _seq(batch)
    unit = ctx.cfg.actor.micro_batch_size
    parts = data["response_mask"].shape[0] // unit if ctx.cfg.trainer.deterministic else None
    gs = _prompt_group(ctx, node, data, parts or lay.num_shards)
    fn = ctx.jitted(("logprobs", role, lay, gs), lambda: _pass_fn(
        ctx, lay, lambda g, p, b: steps_lib.response_logprobs(g, p, b, group_size=gs)[0], unit))
    out = fn(state.graphdef, state.params, data)
  return batch.replace(**{field: out})


def _pass_fn(ctx: RunContext, lay: dlayout.Layout, fn, unit_rows: int):
  """A sequence pass, jitted onto the layout; in deterministic mode unit by unit."""
  if ctx.cfg.trainer.deterministic:
    return deterministic.per_unit(fn, lay.mesh, unit_rows)
  return jax.jit(fn, static_argnums=0, out_shardings=lay.sharding)


def _train(role: Role, ctx: RunContext, node: Node, lay: dlayout.Layout, batch: Batch) -> Batch:
  state = ctx.roles[role]
  section = ctx.section(node, role.value.lower())
  data = _seq(batch)
  b = data["response_mask"].shape[0]
  minis = section.mini_batches if role is Role.ACTOR else 1
  micro = max(b // lay.num_shards // minis // section.micro_batch_size, 1)
  det = ctx.cfg.trainer.deterministic
  gs = 1
  if role is Role.ACTOR:
    parts = b // section.micro_batch_size if det else lay.num_shards * minis * micro
    gs = _prompt_group(ctx, node, data, parts)
    loss_cfg = steps_lib.ActorLoss.from_config(section, ctx.cfg.rollout.max_new_tokens, gs)
    data["advantages"] = batch.data["advantages"]
    data["old_logprobs"] = batch.data.get("old_logprobs", batch.data["rollout_logprobs"])
    if loss_cfg.kl_in_loss and loss_cfg.kl_coef:
      if "ref_logprobs" not in batch.data:
        raise DagError(f"DAG node {node.id!r}: actor.kl.coef > 0 needs 'ref_logprobs'; add a "
                       f"ref_logprob node to its deps or set actor.kl.coef=0")
      data["ref_logprobs"] = batch.data["ref_logprobs"]
    loss_fn = functools.partial(_actor_loss, cfg=loss_cfg)
    agg = loss_cfg.loss_agg
  else:
    data.update(values=batch.data["values"], returns=batch.data["returns"])
    loss_fn = functools.partial(_critic_loss, value_clip=section.value_clip)
    agg = "token-mean"
  if det:
    make = lambda: deterministic.make_train_step(  # noqa: E731
        loss_fn, state.graphdef, state.tx, lay.mesh, section.micro_batch_size, agg,
        section.optimizer.grad_clip, gs)
  else:
    make = lambda: steps_lib.make_train_step(  # noqa: E731
        loss_fn, state.graphdef, state.tx, micro, agg, gs)
  step = ctx.jitted(("train", role, lay, micro, agg, loss_fn.keywords.get("cfg"), det), make)
  # Mini-batch i: whole groups (blocks of gs rows) dealt round robin, as micro-batches are.
  take = ctx.jitted(("minibatch", minis, gs, lay), lambda: jax.jit(
      lambda d, i: jax.tree.map(lambda x: x[i], steps_lib.deal_rows(d, minis, gs)),
      out_shardings=lay.sharding))
  prefix = "actor" if role is Role.ACTOR else "critic"
  for _ in range(section.ppo_epochs):
    for i in range(minis):
      mb = data if minis == 1 else take(data, i)
      state.params, state.opt_state, stats = step(state.params, state.opt_state, mb)
      result = steps_lib.finalize_stats(jax.device_get(stats), node.id)
      for k, v in result.items():
        ctx.metrics.add(f"{prefix}/{k}", v)
  return batch


def _actor_loss(g, p, mb, cfg):
  return steps_lib.actor_loss(g, p, mb, cfg, 512)


def _critic_loss(g, p, mb, value_clip):
  return steps_lib.critic_loss(g, p, mb, value_clip)


def bind_builtins() -> None:
  impls = {
      "generate": generate,
      "reward.math": rule_reward_node("math"),
      "reward.format": rule_reward_node("format"),
      "reward.model": reward_model,
      "logprob": functools.partial(_model_pass, "old_logprobs", Role.ACTOR),
      "ref_logprob": functools.partial(_model_pass, "ref_logprobs", Role.REFERENCE),
      "values": functools.partial(_model_pass, "values", Role.CRITIC),
      "train.actor": functools.partial(_train, Role.ACTOR),
      "train.critic": functools.partial(_train, Role.CRITIC),
  }
  for kind in ("gae", "grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline"):
    impls[f"advantage.{kind}"] = functools.partial(_advantage, kind)
  for name, fn in impls.items():
    FUNCTIONS.bind(name, fn)
