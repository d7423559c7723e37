"""Compile seconds and op counts of the rollout engine's full-size decode program at a
model shape, on abstract parameters (nothing allocated).

    PYTHONPATH=TREE python tools/decode_compile.py [--shape qwen2.5-0.5b|HF_DIR] [--batch 16]
        [--prompt 128] [--new 128] [--decode-steps 16]

It needs only ``Engine.programs`` and ``ModelConfig.from_hf_dict``, so it also runs against
an older tree (``git archive <commit> | tar -x -C /tmp/old``, then ``PYTHONPATH=/tmp/old``):
issue 32 compared the windowed decode with the one-program decode this way, in one sitting.
Prints one JSON line: the program, the decode programs a run has, lower and compile seconds,
StableHLO ops, ``case`` ops and compiled fusions.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

SHAPES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "model_shapes")


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--shape", default="qwen2.5-0.5b", help="a tools/model_shapes name or folder")
  p.add_argument("--batch", type=int, default=16)
  p.add_argument("--prompt", type=int, default=128)
  p.add_argument("--new", type=int, default=128)
  p.add_argument("--decode-steps", type=int, default=16)
  a = p.parse_args(argv)
  folder = a.shape if os.path.isdir(a.shape) else os.path.join(SHAPES, a.shape)
  if not os.path.isfile(os.path.join(folder, "config.json")):
    print(f"decode_compile: --shape={a.shape!r}: no config.json in {folder}", file=sys.stderr)
    return 2
  if min(a.batch, a.prompt, a.new, a.decode_steps) <= 0:
    print("decode_compile: --batch, --prompt, --new and --decode-steps must be positive",
          file=sys.stderr)
    return 2
  import jax

  from distflow_jax.models import ModelConfig
  from distflow_jax.rollout import Engine, EngineConfig, SamplingParams, replica_mesh
  with open(os.path.join(folder, "config.json")) as f:
    hf = json.load(f)
  cfg = ModelConfig.from_hf_dict(hf, hf.get("torch_dtype", "float32"))
  eng = Engine(cfg, EngineConfig(max_concurrent_decodes=a.batch, prefill_buckets=(a.prompt,),
                                 max_new_tokens=a.new, sampling=SamplingParams(1.0),
                                 decode_steps=a.decode_steps),
               replica_mesh(1, jax.devices()[:1]))
  sig = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                     eng._abstract_params, eng.param_shardings)
  decodes = [q for q in eng.programs(sig) if q.name.startswith("decode")]
  prog = decodes[-1]  # the full-size capacity's
  t0 = time.perf_counter()
  lowered = prog.fn.lower(*prog.args)
  lower_s = time.perf_counter() - t0
  text = lowered.as_text()
  t0 = time.perf_counter()
  compiled = lowered.compile().as_text()
  compile_s = time.perf_counter() - t0
  print(json.dumps(dict(
      program=prog.name, decode_programs=len(decodes), lower_s=round(lower_s, 2),
      compile_s=round(compile_s, 2),
      ops=sum(1 for line in text.splitlines() if " = " in line and "stablehlo." in line),
      case=text.count("stablehlo.case"),
      fusions=sum(1 for line in compiled.splitlines() if " fusion(" in line))), flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
