"""``distflow-jax sft``: supervised fine-tuning on a JSONL/Parquet file, resumable.

  distflow-jax sft --config.data.train=FILE.jsonl [--eval_data=FILE.jsonl]
      [--config=grpo:tiny] [--config.model.path=HF_DIR] [--config.sft.steps=200 ...]
      [--resume|--noresume] [--distributed=env|auto|none]

Rows are prompt/answer (``data.prompt_key`` / ``data.answer_key``; the answer is the
completion to learn) or chat ``messages`` (every assistant turn is learned).  It
writes a Hugging Face folder (``sft.out``, default ``<run_dir>/sft/model``) that
``train --config.model.path=`` loads; see workflow/sft_run.py.
"""

from __future__ import annotations

from collections.abc import Sequence

from absl import flags

from distflow_jax.commands import define_run_flags, with_default_config
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
  from distflow_jax import distributed
  distributed.simulate_cpu_devices(cfg.cluster.devices_per_process)  # before jax is imported
  from distflow_jax.workflow import progress, sft_run
  info = distributed.initialize(auto=fv.distributed == "auto")
  log = progress.Logger(info.process_index == 0)
  log(f"sft {cfg.name}: {info.process_count} process(es) x {info.local_device_count} "
      f"device(s); run dir {sft_run.sft_dir(cfg)}")
  sft_run.run(cfg, eval_data=fv.eval_data, resume=fv.resume, log=log)
  return 0
