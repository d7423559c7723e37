"""Held-out sample completions at each evaluation: what the model actually writes.

A few rows of the evaluation batch (``trainer.log_samples``, 0 = off) go, with the
step, to ``run_dir/samples.jsonl`` (one JSON object a line: ``step``, ``index``,
``prompt``, ``response``, ``reward``, ``correct``, ``answer`` = the ground truth), to
TensorBoard as text (tag ``eval/samples``, one markdown entry per evaluation) and, with
``logging.wandb`` on, to Weights & Biases as a table (observe/wandb_log.py).  Only
process 0 writes; under several processes it logs rows of its own shard (each process
evaluates its own prompts, and gathering text across hosts is not worth a collective).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

SAMPLES_FILE = "samples.jsonl"
TEXT_TAG = "eval/samples"


def sample_records(tokenizer: Any, fields: Sequence[Mapping[str, Any] | None],
                   prompt_ids: Sequence[np.ndarray], texts: Sequence[str],
                   truths: Sequence[str], scores: np.ndarray, k: int, n: int
                   ) -> list[dict[str, Any]]:
  """The first ``n`` prompts' first completion (of ``k`` per prompt) as sample records."""
  out = []
  for i in range(min(n, len(prompt_ids))):
    host = fields[i] or {}
    # The rendered prompt (chat template included) is what the model saw; decode the ids
    # when the loader kept no text (token-list templates).
    prompt = host.get("prompt_text")
    if not isinstance(prompt, str):
      prompt = tokenizer.decode(np.asarray(prompt_ids[i]).tolist())
    r = i * k
    out.append({"index": i, "prompt": prompt, "response": texts[r],
                "reward": float(scores[r]), "correct": bool(scores[r] > 0),
                "answer": str(truths[r])})
  return out


def to_markdown(step: int, samples: Sequence[Mapping[str, Any]]) -> str:
  """One TensorBoard text entry: each sample's verdict, then its prompt and response."""
  parts = []
  for s in samples:
    verdict = "correct" if s["correct"] else "wrong"
    parts.append(f"**sample {s['index']}** (step {step}): {verdict}, reward "
                 f"{s['reward']:.4g}, ground truth `{s['answer']}`\n\n"
                 f"prompt:\n\n```\n{s['prompt']}\n```\n\nresponse:\n\n```\n{s['response']}\n```")
  return "\n\n---\n\n".join(parts)


class SampleWriter:
  """``write(step, samples)``: appends to samples.jsonl, adds a TensorBoard text entry and
  (given a ``wandb`` writer, observe/wandb_log.py) a W&B table."""

  def __init__(self, run_dir: str, tensorboard: Any, num_samples: int, enabled: bool,
               wandb: Any = None):
    self.path = os.path.join(run_dir, SAMPLES_FILE)
    self.tensorboard = tensorboard
    self.wandb = wandb
    self.num_samples = num_samples if enabled else 0

  @property
  def enabled(self) -> bool:
    return self.num_samples > 0

  def write(self, step: int, samples: Sequence[Mapping[str, Any]]) -> None:
    if not self.enabled or not samples:
      return
    os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
    with open(self.path, "a") as f:
      for s in samples:
        f.write(json.dumps({"step": int(step), **s}, sort_keys=True) + "\n")
    if self.tensorboard is not None:
      self.tensorboard.add_text(TEXT_TAG, to_markdown(step, samples), step)
    if self.wandb is not None:
      self.wandb.add_samples(step, samples)
