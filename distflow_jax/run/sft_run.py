"""``distflow-jax sft``'s run: data, model, the SFT loop, evaluation, checkpoints, output.

    summary = run(cfg, eval_data="", resume=None, log=log)

1. reads ``data.train`` (sft_data.py) and the held-out rows (``eval_data``, else
   ``sft.eval_size`` rows split off the train file), before any weight is loaded;
2. builds the model with ``setup.prepare_run(roles="actor")``: ``model.path`` or the
   built-in ``model.preset`` fresh from ``seed``;
3. trains with the SFT loop (sft.py) on the actor's mesh, data-parallel;
4. every ``sft.eval_every`` steps (and first and last): the held-out loss, and when
   held-out answers are verifiable (``#### N`` / ``\\boxed{}``) the greedy accuracy
   under the ``math`` verifier; one metrics.jsonl line per step in ``<run_dir>/sft``;
5. checkpoints in ``<run_dir>/sft/checkpoints`` with ``checkpoint.open_run``'s
   resume, damage and refusal rules; the batch order replays from (seed, step), so a
   resumed run continues bitwise as the uninterrupted one;
6. writes the Hugging Face folder (weights, tokenizer, chat template) to ``sft.out``
   (default ``<run_dir>/sft/model``), which ``train --config.model.path=`` loads.

With ``model.lora.enabled`` it trains the adapters only (from ``model.lora.path`` when
set), checkpoints them (with the base's fingerprint) and writes the merged model to
``sft.out``; ``export --checkpoint <run_dir>/sft --lora=adapter`` gives the PEFT folder.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

import jax
import ml_collections
import numpy as np
from flax import nnx

from distflow_jax.config import loading
from distflow_jax.config.errors import ConfigError
from distflow_jax.dag.spec import Role
from distflow_jax.data.batch import Batch
from distflow_jax.data.fields import GROUP_ID, PROMPT_MASK, PROMPT_TOKENS, SAMPLE_ID
from distflow_jax.models import hf_io, lora
from distflow_jax.persist import checkpoint
from distflow_jax.rewards.math_answer import extract_answer
from distflow_jax.run import evaluate, setup
from distflow_jax.state import roles as roles_lib
from distflow_jax.state.metrics import JsonlWriter
from distflow_jax.tasks import registry as tasks
from distflow_jax.train import placement
from distflow_jax.warmstart import sft, sft_data


def sft_dir(cfg: ml_collections.ConfigDict) -> str:
  """Where an sft run keeps its checkpoints and metrics: apart from ``train``'s."""
  return os.path.join(cfg.run_dir, "sft")


def out_dir(cfg: ml_collections.ConfigDict) -> str:
  return cfg.sft.out or os.path.join(sft_dir(cfg), "model")


class Position:
  """The data position a checkpoint keeps: the step fixes the batches (they replay from
  the seed), so only the examples' count and seed are kept, to refuse other data."""

  def __init__(self, num_examples: int, seed: int, directory: str):
    self.num_records, self.seed, self.directory = num_examples, seed, directory
    self.process_index, self.process_count = jax.process_index(), jax.process_count()

  def get_state(self) -> dict[str, Any]:
    return {"epoch": 0, "num_examples": self.num_records, "seed": self.seed}

  def set_state(self, state: dict[str, Any]) -> None:
    saved = state.get("num_examples", state.get("num_records"))
    if saved != self.num_records:
      raise checkpoint.CheckpointError(
          f"the sft checkpoints in {self.directory} were trained on {saved} examples but "
          f"this run has {self.num_records}: the data changed; continue with the same data "
          f"or choose another --config.run_dir")


def run_config(cfg: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
  """The config ``checkpoint.open_run`` sees: the sft dir and the sft save policy."""
  return loading.with_values(cfg, {"run_dir": sft_dir(cfg),
                                   "trainer.save_every": cfg.sft.save_every,
                                   "trainer.keep": cfg.sft.keep})


def load_data(cfg: ml_collections.ConfigDict, eval_data: str, log: Callable[[str], None]
              ) -> tuple[sft_data.Encoded, sft_data.Encoded]:
  """(train, held-out) examples; ConfigError naming the file when they cannot train."""
  s, path = cfg.sft, cfg.data.train
  if tasks.is_builtin(path):
    raise ConfigError(f"sft trains on a JSONL/Parquet file of prompt/answer or "
                      f"{sft_data.MESSAGES!r} rows: set --config.data.train=FILE (data.train="
                      f"{path!r} is a built-in task; its demonstrations train the warm start, "
                      f"model.warmstart.*)")
  tokenizer = roles_lib.load_tokenizer(cfg.model)
  bad = sft_data.BadRows(cfg.data.on_bad_row, log)
  pairs, num_rows = sft_data.read_pairs(path, cfg.data, bad)
  if eval_data:
    held, _ = sft_data.read_pairs(eval_data, cfg.data, bad)
    held = [p for p in held if not s.eval_size or p.row < s.eval_size]
  else:
    if s.eval_size and s.eval_size >= num_rows:
      raise ConfigError(f"sft.eval_size={s.eval_size} would hold out all {num_rows} rows of "
                        f"{path}; lower it or give --eval_data")
    pairs, held = sft_data.split_rows(pairs, num_rows, s.eval_size, cfg.seed)
  train = sft_data.encode(pairs, tokenizer, cfg, bad)
  heldout = sft_data.encode(held, tokenizer, cfg, bad)
  if len(train) < s.batch_size:
    raise ConfigError(f"{path}: {len(train)} usable training example(s), fewer than "
                      f"sft.batch_size={s.batch_size} ({bad.summary()}); fix the rows or lower "
                      f"sft.batch_size")
  log(f"sft: {len(train)} training and {len(heldout)} held-out example(s) from {num_rows} "
      f"row(s) of {path} ({bad.summary()})")
  return train, heldout


def _accuracy_batch(held: sft_data.Encoded, rows: list[int]) -> Batch:
  """This process's share of the verifiable held-out rows as an evaluation prompt batch."""
  mine = rows[jax.process_index()::jax.process_count()]
  ptok, pmask = held.data[PROMPT_TOKENS][mine], held.data[PROMPT_MASK][mine]
  ids = np.zeros_like(ptok)
  for i in range(len(mine)):  # the loader's layout: prompts left-aligned
    ids[i, :pmask[i].sum()] = ptok[i][pmask[i]]
  gid = np.asarray(mine, np.int32)
  return Batch({"prompt_ids": ids, "prompt_len": pmask.sum(1).astype(np.int32),
                GROUP_ID: gid, SAMPLE_ID: gid},
               {int(g): {"answer": held.pairs[g].completion} for g in mine})


def run(cfg: ml_collections.ConfigDict, *, eval_data: str = "", resume: bool | None = None,
        log: Callable[[str], None] = print) -> dict[str, float]:
  """Fine-tunes, writes the output folder; returns the first and last evaluation
  (``eval/...`` and ``first/eval/...``) and ``wall_s``."""
  t0 = time.perf_counter()
  s = cfg.sft
  prepared = setup.prepare_run(cfg, roles="actor",
                               check_inputs=lambda: load_data(cfg, eval_data, log), log=log)
  ctx, (train, held) = prepared.ctx, prepared.inputs
  cfg = ctx.cfg  # model.path resolved
  state = ctx.roles[Role.ACTOR]
  _, dp = sft.data_parallel(state.mesh)
  if s.batch_size % dp:
    raise ConfigError(f"sft.batch_size={s.batch_size} does not split over the actor's {dp} "
                      f"data-parallel devices; use a multiple of {dp}")
  state.tx = sft.optimizer(lr=s.lr, steps=s.steps, warmup_steps=s.warmup_steps,
                           weight_decay=s.weight_decay, grad_clip=s.grad_clip)
  state.opt_state = placement.init_opt_state(state.tx, state.params)
  rcfg, roles = run_config(cfg), {Role.ACTOR: state}
  position = Position(len(train), cfg.seed, sft_dir(cfg))
  ck, start = checkpoint.open_run(rcfg, roles, position, resume=resume, log=log)
  writer = JsonlWriter(os.path.join(sft_dir(cfg), "metrics.jsonl"), jax.process_index() == 0)
  heldout_loss = sft.heldout_loss_fn(state, s.batch_size)
  verifiable = [i for i, p in enumerate(held.pairs) if extract_answer(p.completion) is not None]
  acc_batch = (_accuracy_batch(held, verifiable)
               if len(verifiable) >= jax.process_count() else None)
  evals: list[dict[str, float]] = []

  def evaluation() -> dict[str, float]:
    if not s.eval_every or not len(held):
      return {}
    m = {"eval/loss": heldout_loss(held.data)}
    if acc_batch is not None:
      m.update(evaluate.evaluate(ctx, acc_batch))
    evals.append(m)
    return m

  if start == 0:
    first = evaluation()
    if first:
      writer.write({"step": 0, **first})
      log(f"sft 0/{s.steps} " + _describe(first))

  def on_step(done: int, stats: dict) -> None:
    st = jax.device_get(stats)
    rec = {"step": done, "loss": sft.mean_loss(st), "grad_norm": float(st["grad_norm"]),
           "skipped": float(st["skipped"]), "tokens": float(st["count"])}
    if s.eval_every and (done % s.eval_every == 0 or done == s.steps):
      rec.update(evaluation())
    writer.write(rec)
    if done % 10 == 0 or done == s.steps or "eval/loss" in rec:
      log(f"sft {done}/{s.steps} " + _describe(rec))
    if ck.due(done, s.steps):
      ck.save(done, roles, position, rcfg, ctx.model_cfg, ctx.tokenizer)

  lo = cfg.model.lora
  sft.train(state, train.data, steps=s.steps, batch_size=s.batch_size, seed=cfg.seed,
            start=start, on_step=on_step, adapter_dropout=lo.enabled and lo.dropout > 0)
  ck.close()
  out = out_dir(cfg)
  # LoRA: the adapters merged into the base (a plain folder `train` loads); the adapters
  # alone: `export --checkpoint <run_dir>/sft --lora=adapter`.
  hf_io.save_pretrained(out, lora.merged_model(nnx.merge(state.graphdef, state.params)),
                        ctx.tokenizer)
  summary: dict[str, float] = {"wall_s": time.perf_counter() - t0}
  if evals:
    summary.update({f"first/{k}": v for k, v in evals[0].items()}, **evals[-1])
  log(f"sft: wrote {out} after {s.steps} steps in {summary['wall_s']:.0f}s "
      f"({_describe(evals[-1]) if evals else 'no evaluation'}); train from it with "
      f"--config.model.path={out}")
  return summary


def _describe(m: dict[str, float]) -> str:
  keys = (("loss", "loss {:.3f}"), ("eval/loss", "eval_loss {:.3f}"),
          ("eval/accuracy", "eval_acc {:.3f}"))
  return " ".join(fmt.format(m[k]) for k, fmt in keys if k in m)
