"""Top-p's cut by bisection (rollout/engine/sampling.py) against the full-vocabulary sort it
replaced, side by side on this machine's default jax device.

    python tools/bench_top_p.py [--vocab 152064] [--batch 8,64] [--top-p 0.9] [--rounds 7]

Both contenders are jitted functions of the same tempered logits ``[B, V]`` (random normal
times 3) that return them with every token outside top-p set to -inf; compiling is done
before timing.  ``sort`` is the rule as sampling.py computed it until issue 32: sort each
row, cumulative softmax mass, the smallest logit whose mass before it is below top-p.
``bisect`` is ``sampling.sampling_logits`` now: 32 masked sums over the vocabulary.  The
contenders alternate within each round; each row gives milliseconds per call, median (min-
max) over the rounds, the ratio of the medians, and the share of tokens both keep or both
drop (1 unless a token's mass above lies within float32 rounding of top-p).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import _bench_common as bc  # noqa: E402


def sort_rule(x, top_p: float):
  import jax
  import jax.numpy as jnp
  sorted_x = jnp.flip(jnp.sort(x, axis=-1), axis=-1)
  probs = jax.nn.softmax(sorted_x, axis=-1)
  keep = jnp.cumsum(probs, axis=-1) - probs < top_p
  cut = jnp.min(jnp.where(keep, sorted_x, jnp.inf), axis=-1, keepdims=True)
  return jnp.where(x >= cut, x, -jnp.inf)


def main(argv: list[str] | None = None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--vocab", type=int, default=152064)
  ap.add_argument("--batch", default="8,64", help="rows per call, comma-separated")
  ap.add_argument("--top-p", type=float, default=0.9)
  ap.add_argument("--rounds", type=int, default=7)
  args = ap.parse_args(argv)
  import jax
  import jax.numpy as jnp

  from distflow_jax.rollout.engine.sampling import SamplingParams, sampling_logits
  bc.flush_lines()
  print(f"start: {bc.load_line()}  device: {jax.devices()[0].device_kind}")
  fns = {"sort": jax.jit(lambda x: sort_rule(x, args.top_p)),
         "bisect": jax.jit(lambda x: sampling_logits(x, SamplingParams(top_p=args.top_p)))}
  table = bc.Table(bc.Col("batch", 5), bc.Col("vocab", 7), "|", bc.Col("sort ms", 22, "<"),
                   bc.Col("bisect ms", 22, "<"), bc.Col("sort/bisect", 11, fmt=".1f"),
                   bc.Col("same keep", 9, fmt=".6f"))
  for b in (int(v) for v in args.batch.split(",")):
    x = jax.random.normal(jax.random.key(0), (b, args.vocab), jnp.float32) * 3
    kept = {n: jnp.isfinite(f(x).block_until_ready()) for n, f in fns.items()}  # compiled
    same = float(jnp.mean(kept["sort"] == kept["bisect"]))
    times = bc.alternate({n: (lambda f=f: f(x).block_until_ready()) for n, f in fns.items()},
                         args.rounds, rotate=True)
    table.row(b, args.vocab, bc.spread(times["sort"], 1e3), bc.spread(times["bisect"], 1e3),
              statistics.median(times["sort"]) / statistics.median(times["bisect"]), same)
  print(f"end: {bc.load_line()}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
