"""Compile seconds of the train pass (loss + gradient) by depth: layers looped vs scanned.

    python tools/compile_depth.py                      # 4, 24, 48 layers, tiny width
    python tools/compile_depth.py --layers 4 24 48 --hidden 512 --remat full

Parameters are abstract (shapes only), so nothing is initialised or run: the
numbers are `jax.jit(...).lower(...)` plus `.compile()` on the default backend.
`model.scan_layers=True` should give a flat column; the loop grows with depth.
"""

from __future__ import annotations

import argparse
import os
import sys

import jax
import jax.numpy as jnp
from flax import nnx

from distflow_jax.models.config import ModelConfig
from distflow_jax.models.transformer import Transformer, forward

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _bench_common as bc  # noqa: E402


def compile_seconds(cfg: ModelConfig, batch: int, seq: int) -> float:
  """Seconds to lower and compile `grad(loss)(params)` of `cfg` for one [batch, seq] batch."""
  graphdef, params = nnx.split(nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0))))
  tokens = jax.ShapeDtypeStruct((batch, seq), jnp.int32)

  def loss(params, tokens):
    pos = jnp.broadcast_to(jnp.arange(seq), tokens.shape)
    hidden, _ = forward(graphdef, params, tokens, pos, return_hidden=True)
    return jnp.mean(hidden.astype(jnp.float32) ** 2)

  return bc.timed(lambda: jax.jit(jax.value_and_grad(loss)).lower(params, tokens).compile())[1]


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--layers", type=int, nargs="+", default=[4, 24, 48])
  ap.add_argument("--hidden", type=int, default=256)
  ap.add_argument("--batch", type=int, default=2)
  ap.add_argument("--seq", type=int, default=128)
  ap.add_argument("--remat", default="none", choices=("none", "full", "dots_saveable"))
  ap.add_argument("--dtype", default="float32")
  args = ap.parse_args()
  base = ModelConfig(arch="qwen2", vocab_size=1024, hidden_size=args.hidden,
                     intermediate_size=args.hidden * 3, num_heads=8, num_kv_heads=2,
                     head_dim=args.hidden // 8, qkv_bias=True, dtype=args.dtype,
                     remat=args.remat)
  print(f"start: {bc.load_line()}")
  print(f"backend {jax.default_backend()}, d={args.hidden}, batch {args.batch}x{args.seq}, "
        f"remat={args.remat}, dtype={args.dtype}")
  table = bc.Table(bc.Col("layers", 6), "|", bc.Col("loop (s)", 9, fmt=".2f"), "|",
                   bc.Col("scan (s)", 9, fmt=".2f"))
  for n in args.layers:
    cfg = base.replace(num_layers=n)
    loop = compile_seconds(cfg, args.batch, args.seq)
    scan = compile_seconds(cfg.replace(scan_layers=True), args.batch, args.seq)
    table.row(n, loop, scan)
  print(f"end: {bc.load_line()}")


if __name__ == "__main__":
  main()
