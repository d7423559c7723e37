"""Supervised warm start: teach a fresh model the task's answer format.

RL needs a policy that is right some of the time.  With no checkpoint given,
the built-in tiny model is first trained on worked answers (prompt ->
completion + EOS) for a few hundred steps, then written as a Hugging Face
directory in the run directory, so the next run loads it and skips this.
The cache is keyed by its settings (``settings``: model preset and dtype,
warm-start settings, task, seed, lengths, chat template, tokenizer), stored
in ``KEY_FILE`` next to the weights: ``run_dir/warmstart`` serves the settings
it was made with; other settings get (or reuse) a sibling
``run_dir/warmstart-<hash>``, so a cache is never used for settings it was
not made with.  A cache without a key (an older version's) counts as made
with other settings.
Prompts are encoded exactly as the RL loader encodes them.  The
demonstrations come from the built-in task named by ``data.train``
(tasks/registry.py).

    model_dir = ensure_model(cfg, plan, tokenizer, log)   # cached, or warm-started now
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import time
from collections.abc import Callable, Sequence

import jax
import ml_collections
import numpy as np
from flax import nnx
from jax.experimental import multihost_utils

from distflow_jax.config.errors import ConfigError
from distflow_jax.dag.planner import Plan
from distflow_jax.dag.spec import Role
from distflow_jax.data.fields import PROMPT_MASK, PROMPT_TOKENS, RESPONSE_MASK, RESPONSE_TOKENS
from distflow_jax.data.loader import parse_row
from distflow_jax.models import hf_io
from distflow_jax.models.tokenizer import Tokenizer
from distflow_jax.observe import progress
from distflow_jax.state import roles as roles_lib
from distflow_jax.state.roles import ModelState
from distflow_jax.tasks import registry as tasks
from distflow_jax.train import placement
from distflow_jax.warmstart import sft

# The loss, shared with `distflow-jax sft` (kept importable here).
sft_loss = sft.sft_loss


def fitting_demonstrations(records: Sequence[dict], tokenizer: Tokenizer, max_new_tokens: int,
                           log: Callable[[str], None] = print
                           ) -> tuple[list[dict], list[list[int]]]:
  """The demonstrations whose completion + EOS fits ``max_new_tokens``, and those token ids.

  A longer one is left out, never cut: a cut answer given an EOS teaches the model to stop
  mid-answer ("...The answe" with a clean stop), and a rollout of that length could never
  finish it.  Logs one line when any is left out; refuses (``ConfigError``) when none fits."""
  kept, ids, long = [], [], []
  for r in records:
    out = tokenizer.encode(r["completion"]) + [tokenizer.eos_id]
    if len(out) > max_new_tokens:
      long.append(len(out))
    else:
      kept.append(r)
      ids.append(out)
  if long and not kept:
    raise ConfigError(f"rollout.max_new_tokens={max_new_tokens}: none of the {len(records)} "
                      f"warm-start demonstrations fits (completion + EOS: {min(long)} to "
                      f"{max(long)} tokens); raise rollout.max_new_tokens to {max(long)}")
  if long:
    log(f"WARNING: {len(long)} of {len(records)} warm-start demonstrations are longer than "
        f"rollout.max_new_tokens={max_new_tokens} (up to {max(long)} tokens with EOS) and are "
        f"left out, not cut; raise rollout.max_new_tokens to {max(long)} to keep them all")
  return kept, ids


def encode_examples(records: Sequence[dict], tokenizer: Tokenizer, *, max_prompt_len: int,
                    max_new_tokens: int, use_chat_template: bool,
                    log: Callable[[str], None] = print) -> dict[str, np.ndarray]:
  """Left-padded prompts and right-padded completion + EOS, as the RL batch lays them out;
  only the demonstrations that fit ``max_new_tokens`` (``fitting_demonstrations``)."""
  records, outs = fitting_demonstrations(records, tokenizer, max_new_tokens, log)
  n = len(records)
  prompt = np.full((n, max_prompt_len), tokenizer.pad_id, np.int32)
  prompt_mask = np.zeros((n, max_prompt_len), bool)
  resp = np.full((n, max_new_tokens), tokenizer.pad_id, np.int32)
  resp_mask = np.zeros((n, max_new_tokens), bool)
  for i, (rec, out) in enumerate(zip(records, outs)):
    ex = parse_row({"prompt": rec["prompt"], "answer": rec["completion"]}, i,
                   tokenizer=tokenizer, max_prompt_len=max_prompt_len,
                   use_chat_template=use_chat_template)
    if not hasattr(ex, "prompt_ids"):
      raise ValueError(f"warm-start example {i} cannot be encoded: {ex}")
    ids = ex.prompt_ids
    prompt[i, max_prompt_len - len(ids):] = ids
    prompt_mask[i, max_prompt_len - len(ids):] = True
    resp[i, :len(out)] = out
    resp_mask[i, :len(out)] = True
  return {PROMPT_TOKENS: prompt, PROMPT_MASK: prompt_mask, RESPONSE_TOKENS: resp,
          RESPONSE_MASK: resp_mask}


def optimizer(lr: float, steps: int):
  """The warm start's optimizer: AdamW, warm-up over a tenth of the steps, cosine decay,
  clip 1, no weight decay."""
  return sft.optimizer(lr=lr, steps=steps, warmup_steps=max(steps // 10, 1))


def run(state: ModelState, data: dict[str, np.ndarray], *, steps: int, batch_size: int,
        lr: float, seed: int, on_step: Callable[[int, float], None] | None = None) -> float:
  """Trains ``state`` in place on ``data`` (global rows, same on every process) with the
  SFT loop (warmstart/sft.py) that ``distflow-jax sft`` runs too.

  Returns the final loss (mean token NLL); ``on_step(i, loss)`` every 10 steps and at the
  last.  AdamW, warm-up over a tenth of the steps, cosine decay, clip 1, no weight decay.
  """
  n = len(data[RESPONSE_MASK])
  if batch_size > n:
    raise ConfigError(f"model.warmstart.batch_size={batch_size} exceeds the {n} warm-start "
                      f"examples (the demonstrations that fit rollout.max_new_tokens)")
  tx = optimizer(lr, steps)
  # A trainable copy: the caller's state keeps no optimizer.
  st = dataclasses.replace(state, tx=tx, opt_state=placement.init_opt_state(tx, state.params))
  loss = float("nan")

  def report(done: int, stats: dict) -> None:
    nonlocal loss
    if on_step is not None and ((done - 1) % 10 == 0 or done == steps):
      loss = sft.mean_loss(stats)
      on_step(done - 1, loss)
  sft.train(st, data, steps=steps, batch_size=batch_size, seed=seed, on_step=report)
  state.params = st.params
  return loss


KEY_FILE = "distflow_warmstart.json"


def settings(cfg: ml_collections.ConfigDict, tokenizer: Tokenizer) -> dict:
  """Everything the warm-started weights depend on (the cache's key)."""
  tok = hashlib.sha256(tokenizer.tok.to_str().encode()
                       + json.dumps(tokenizer.config, sort_keys=True, default=str).encode())
  return {"preset": cfg.model.preset, "dtype": cfg.model.dtype,
          "warmstart": cfg.model.warmstart.to_dict(), "task": cfg.data.train,
          "seed": cfg.seed, "max_prompt_len": cfg.data.max_prompt_len,
          "max_new_tokens": cfg.rollout.max_new_tokens,
          "chat_template": cfg.data.chat_template, "tokenizer": tok.hexdigest()[:16]}


def key_hash(key: dict) -> str:
  return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:8]


def _saved_key(directory: str) -> dict | None:
  try:
    with open(os.path.join(directory, KEY_FILE)) as f:
      return json.load(f)
  except (OSError, ValueError):
    return None


def model_dir(cfg: ml_collections.ConfigDict, key: dict | None = None) -> str:
  """Where the warm-started built-in model of a run with these settings is cached:
  ``run_dir/warmstart`` when it is free or made with ``key``, else a keyed sibling."""
  base = os.path.join(cfg.run_dir, "warmstart")
  if key is None or not os.path.exists(base) or _saved_key(base) == key:
    return base
  return f"{base}-{key_hash(key)}"


def _differences(old: dict | None, new: dict) -> str:
  if old is None:
    return "settings unknown (made before caches were keyed)"
  keys = sorted(k for k in set(old) | set(new) if old.get(k) != new.get(k))
  return "made with other " + ", ".join(keys)


def ensure_model(cfg: ml_collections.ConfigDict, plan: Plan, tokenizer: Tokenizer,
                 log: Callable[[str], None]) -> str:
  """The model directory to load: ``model.path``, else the built-in ``model.preset`` model
  warm-started on ``data.train``'s built-in task (cached in the run dir, made now if absent)."""
  if cfg.model.path:
    return cfg.model.path
  if not tasks.is_builtin(cfg.data.train):
    raise ConfigError(f"model.path is empty, so the built-in {cfg.model.preset!r} model would "
                      f"be used, but it is warm-started on a built-in task only "
                      f"(data.train={tasks.PREFIX}<task>, valid: {tasks.names()}), not on "
                      f"data.train={cfg.data.train!r}; set --config.model.path to a local "
                      f"Hugging Face model directory")
  try:
    task, level = tasks.parse(cfg.data.train)
  except tasks.UnknownTaskError as e:
    raise ConfigError(f"data.train={cfg.data.train!r}: {e}") from None
  key = settings(cfg, tokenizer)
  wdir = model_dir(cfg, key)
  base = model_dir(cfg)
  if wdir != base:
    log(f"warm start: {base} is not reused ({_differences(_saved_key(base), key)}); the "
        f"warm start for these settings is cached in {wdir}")
  if os.path.isfile(os.path.join(wdir, "config.json")) and _saved_key(wdir) == key:
    log(f"warm start: using the cached model in {wdir}")
    return wdir
  progress.phase(log, "warm start")
  model_cfg = roles_lib.model_config(cfg, tokenizer, "").replace(lora=None)  # full SFT
  mesh = _warm_start_mesh(plan)
  actor_mesh = roles_lib.jax_mesh(mesh)
  try:
    model = roles_lib.build_actor(model_cfg, actor_mesh, "", cfg.seed)
  except ValueError as e:
    if "is not divisible by mesh axes" not in str(e):
      raise
    raise ConfigError(f"the warm start of the built-in {cfg.model.preset!r} model shards it "
                      f"over {dict(mesh.axes)}, which it does not divide ({e}); with the "
                      f"rollout on processes of its own every device of the run takes part, "
                      f"so use a device count that divides the model's sizes, or set "
                      f"model.path") from None
  graphdef, params = nnx.split(model)
  state = ModelState(Role.ACTOR, actor_mesh, graphdef, params)
  ws = cfg.model.warmstart
  if ws.steps > 0:
    records = task.demonstrations(level, ws.examples, seed=cfg.seed,
                                  plain_answer_prob=ws.plain_answer_prob)
    data = encode_examples(records, tokenizer, max_prompt_len=cfg.data.max_prompt_len,
                           max_new_tokens=cfg.rollout.max_new_tokens,
                           use_chat_template=cfg.data.chat_template, log=log)
    t0 = time.perf_counter()
    loss = run(state, data, steps=ws.steps, batch_size=ws.batch_size, lr=ws.lr, seed=cfg.seed,
               on_step=lambda i, l: _show(log, i + 1, ws.steps, l))
    log(f"warm start: {ws.steps} supervised steps in {time.perf_counter() - t0:.0f}s, "
        f"final loss {loss:.3f}")
  hf_io.save_pretrained(wdir, nnx.merge(graphdef, state.params), tokenizer)
  if jax.process_index() == 0:  # the key last: a folder with it is complete
    with open(os.path.join(wdir, KEY_FILE + ".tmp"), "w") as f:
      json.dump(key, f, indent=2, sort_keys=True)
    os.replace(os.path.join(wdir, KEY_FILE + ".tmp"), os.path.join(wdir, KEY_FILE))
  if jax.process_count() > 1:  # only process 0 writes; the others read it next
    multihost_utils.sync_global_devices("distflow_warmstart_written")
  return wdir


def _warm_start_mesh(plan: Plan):
  """The actor's mesh, or -- where it leaves whole processes out (an asynchronous run with
  the rollout on processes of its own) -- FSDP over every device, so that every process
  takes part in the warm start and its save, as they all wait for it."""
  actor = next(m for m in plan.meshes if m.role is Role.ACTOR)
  topo = plan.topology
  if {topo.process_of(d) for d in actor.devices} == set(range(topo.num_processes)):
    return actor
  n = topo.num_devices
  return dataclasses.replace(actor, devices=tuple(range(n)),
                             axes=tuple((a, n if a == "fsdp" else 1) for a, _ in actor.axes))


def _show(log: Callable[[str], None], done: int, total: int, loss: float) -> None:
  """The warm start's bar on a progress Logger, a plain line on any other callable."""
  if isinstance(log, progress.Logger):
    log.progress("warm start", done, total, f"loss {loss:.3f}")
  else:
    log(f"warm start {done}/{total} loss {loss:.3f}")
