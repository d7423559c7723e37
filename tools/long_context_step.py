"""One actor train step on one long sample: does a long row fit, and what does it cost?

    python tools/long_context_step.py --length 16384 [--attention_impl blockwise]
                                      [--block 512] [--steps 2]

Builds the built-in tiny model (`model.preset=tiny`, the default run's model, with the
default config's levers: layers scanned, no remat), makes one sample of `--length` tokens
(half prompt, half response; the model pass runs `length - 1` tokens) and runs
`train/steps.make_train_step` with the actor loss (clipped ratio, adamw) on it, compiled
ahead of time.  Prints the compiled step's temp bytes (`memory_analysis`), the compile
time, the time of each step and this process's peak RSS (`ru_maxrss`).

Peak RSS is the whole process's high-water mark, so one process measures one setting;
`train_step_memory` is the same measurement as a function (tools/bench_long_context.py
may call it, one setting per process).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _bench_common as bc  # noqa: E402

VOCAB = 128  # ModelConfig.tiny's default vocabulary; the tokens are random


def _batch(length: int, vocab: int):
  """One sample of `length` tokens: a prompt of length // 2, the rest response."""
  import numpy as np
  rng = np.random.default_rng(0)
  p = max(length // 2, 1)
  n = max(length - p, 1)
  return {
      "prompt_tokens": rng.integers(0, vocab, (1, p), dtype=np.int32),
      "prompt_mask": np.ones((1, p), bool),
      "response_tokens": rng.integers(0, vocab, (1, n), dtype=np.int32),
      "response_mask": np.ones((1, n), bool),
      "old_logprobs": np.full((1, n), -np.log(vocab), np.float32),
      "ref_logprobs": np.full((1, n), -np.log(vocab), np.float32),
      "advantages": rng.standard_normal((1, n)).astype(np.float32),
  }


def train_step_memory(length: int, attention_impl: str, block: int = 512,
                      steps: int = 2) -> dict:
  """Compiles and runs `steps` actor train steps of the tiny model on one `length`-token
  sample; returns {length, attention_impl, block, temp_bytes, compile_s, step_s (list),
  loss, grad_norm, peak_rss_bytes}.  `peak_rss_bytes` is the process's high-water mark so
  far (Linux reports ru_maxrss in KiB)."""
  import jax
  import jax.numpy as jnp
  import optax
  from flax import nnx

  from distflow_jax.config import defaults
  from distflow_jax.models.config import preset
  from distflow_jax.models.transformer import Transformer
  from distflow_jax.train import steps as steps_lib

  if length < 2:
    raise ValueError(f"--length={length} must be >= 2 (a prompt and a response token)")
  cfg = preset("tiny", VOCAB).replace(scan_layers=True, remat="none",
                                      attention_impl=attention_impl, attention_block=block)
  graphdef, params = nnx.split(Transformer(cfg, rngs=nnx.Rngs(0)))
  tx = optax.adamw(1e-4)
  opt_state = tx.init(params)
  loss_cfg = steps_lib.ActorLoss.from_config(defaults.base().actor)
  step = steps_lib.make_train_step(
      lambda g, p, mb: steps_lib.actor_loss(g, p, mb, loss_cfg, 512), graphdef, tx, 1,
      loss_cfg.loss_agg)
  batch = jax.tree.map(jnp.asarray, _batch(length, VOCAB))
  compiled, compile_s = bc.timed(
      lambda: step.jitted_for(params, opt_state).lower(params, opt_state, batch).compile())
  temp = compiled.memory_analysis().temp_size_in_bytes
  state = {"params": params, "opt_state": opt_state, "stats": {}}

  def one_step():
    state["params"], state["opt_state"], state["stats"] = compiled(
        state["params"], state["opt_state"], batch)
    jax.block_until_ready(state["stats"])

  times = bc.alternate({"step": one_step}, steps)["step"]
  stats = state["stats"]
  done = steps_lib.finalize_stats(stats, "long_context_step") if stats else {}
  return {"length": length, "attention_impl": attention_impl, "block": block,
          "temp_bytes": int(temp), "compile_s": round(compile_s, 2),
          "step_s": [round(t, 2) for t in times], "loss": done.get("loss"),
          "grad_norm": done.get("grad_norm"),
          "peak_rss_bytes": bc.peak_rss_bytes()}


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                               formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--length", type=int, default=16384,
                  help="tokens in the sample (prompt + response); default 16384")
  ap.add_argument("--attention_impl", default="blockwise",
                  help="model.attention_impl: auto | xla | cudnn | einsum | blockwise")
  ap.add_argument("--block", type=int, default=512,
                  help="model.attention_block (blockwise's query/key block); default 512")
  ap.add_argument("--steps", type=int, default=2, help="train steps to time; default 2")
  args = ap.parse_args(argv)
  from distflow_jax.models.config import ATTENTION_IMPLS
  if args.attention_impl not in ATTENTION_IMPLS:
    ap.error(f"--attention_impl={args.attention_impl!r} is not one of {list(ATTENTION_IMPLS)}")
  if args.length < 2 or args.block < 1 or args.steps < 1:
    ap.error("--length must be >= 2, --block and --steps >= 1")
  r = train_step_memory(args.length, args.attention_impl, args.block, args.steps)
  print(f"length {r['length']}  attention_impl {r['attention_impl']}  block {r['block']}  "
        f"temp {r['temp_bytes'] / 2**20:.1f} MiB  compile {r['compile_s']:.1f} s  "
        f"steps {', '.join(f'{t:.2f}' for t in r['step_s'])} s  "
        f"peak RSS {r['peak_rss_bytes'] / 2**30:.2f} GiB  loss {r['loss']}")
  print(json.dumps(r))
  return 0


if __name__ == "__main__":
  sys.exit(main())
