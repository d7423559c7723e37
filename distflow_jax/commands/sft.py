"""``distflow-jax sft``: supervised fine-tuning on a JSONL/Parquet file, resumable.

  distflow-jax sft --config.data.train=FILE.jsonl [--eval_data=FILE.jsonl]
      [--config=grpo:tiny] [--config.model.path=HF_DIR] [--config.sft.steps=200 ...]
      [--resume|--noresume] [--distributed=env|auto|none]

Rows are prompt/answer (``data.prompt_key`` / ``data.answer_key``; the answer is the
completion to learn) or chat ``messages`` (every assistant turn is learned).  It
writes a Hugging Face folder (``sft.out``, default ``<run_dir>/sft/model``) that
``train --config.model.path=`` loads.
"""

from __future__ import annotations

from collections.abc import Sequence

from absl import flags

from distflow_jax.commands import define_run_flags, start_job, with_default_config
from distflow_jax.config import loading

DEFAULT_CONFIG = "grpo:tiny"


def run(argv: Sequence[str]) -> int:
  fv = flags.FlagValues()
  flags.DEFINE_string("eval_data", "", "held-out JSONL/Parquet rows (its first sft.eval_size; "
                      "default: sft.eval_size rows split off data.train)", flag_values=fv)
  define_run_flags(fv, "sft checkpoint")
  rest = loading.parse(fv, with_default_config(argv, DEFAULT_CONFIG))
  if rest:
    raise loading.ConfigError(f"sft takes no positional arguments, got {rest}")
  cfg = fv.config
  _, log = start_job(fv, "sft", cfg.run_dir)  # before sft_run: it imports jax
  from distflow_jax.run import sft_run
  sft_run.run(cfg, eval_data=fv.eval_data, resume=fv.resume, log=log)
  return 0
