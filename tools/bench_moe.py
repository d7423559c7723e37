"""The experts' dispatch (models/moe.py) side by side on this machine's default jax device:
``blocked`` (what a CPU target uses), ``ragged_dot`` (a GPU's and TPU's: XLA:CPU runs it as
every expert on every row, masked) and, as the floor, one dense MLP of an expert's width
run top_k times (the routed FLOPs with no dispatch at all).

    python tools/bench_moe.py [--tokens 2560] [--hidden 192] [--width 128] [--experts 8]
                              [--top-k 2] [--rounds 7]

Each contender is a jitted function of the same tokens, router and expert weights (random
normal): ``fwd`` the layer's output, ``fwd+bwd`` the gradient of its squared sum with
respect to the tokens and the three expert weights.  Compiling is done before timing; the
contenders alternate within each round.  Each row: milliseconds per call, median (min-max)
over the rounds, and the median's ratio to the floor.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import _bench_common as bc  # noqa: E402


def contenders(n: int, d: int, f: int, e: int, k: int):
  """``{(name, mode): jitted call}`` over one set of random inputs."""
  import jax
  import jax.numpy as jnp
  from distflow_jax.models import moe
  ks = jax.random.split(jax.random.key(0), 5)
  h = jax.random.normal(ks[0], (n, d))
  router = jax.random.normal(ks[1], (d, e))
  gate, up = jax.random.normal(ks[2], (e, d, f)), jax.random.normal(ks[3], (e, d, f))
  down = jax.random.normal(ks[4], (e, f, d))
  spec = moe.MoeSpec(e, k, f)

  def dispatch(impl):
    def fn(h, gate, up, down):
      w, idx, _ = moe.route(h, router, spec)
      return moe.experts_ffn(h, w, idx, gate, up, down, impl)
    return fn

  def floor(h, gate, up, down):  # top_k dense MLPs of one expert's width: no dispatch
    return sum((jax.nn.silu(h @ gate[i]) * (h @ up[i])) @ down[i] for i in range(k))

  out = {}
  for name, fn in (("blocked", dispatch("blocked")), ("ragged_dot", dispatch("ragged_dot")),
                   ("floor", floor)):
    grad = jax.grad(lambda *a, fn=fn: jnp.sum(fn(*a) ** 2), argnums=(0, 1, 2, 3))
    for mode, f_ in (("fwd", jax.jit(fn)), ("fwd+bwd", jax.jit(grad))):
      call = (lambda f_=f_: jax.block_until_ready(f_(h, gate, up, down)))
      call()  # compile
      out[(name, mode)] = call
  return out


def main(argv: list[str] | None = None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--tokens", type=int, default=2560)
  ap.add_argument("--hidden", type=int, default=192)
  ap.add_argument("--width", type=int, default=128, help="an expert's intermediate size")
  ap.add_argument("--experts", type=int, default=8)
  ap.add_argument("--top-k", type=int, default=2)
  ap.add_argument("--rounds", type=int, default=7)
  args = ap.parse_args(argv)
  bc.flush_lines()
  print(bc.load_line())
  print(f"tokens {args.tokens}, hidden {args.hidden}, {args.experts} experts of width "
        f"{args.width}, top {args.top_k}")
  calls = contenders(args.tokens, args.hidden, args.width, args.experts, args.top_k)
  times = bc.alternate({f"{a} {b}": c for (a, b), c in calls.items()}, args.rounds,
                       rotate=True)
  table = bc.Table(bc.Col("dispatch", 12), bc.Col("pass", 8), "|", bc.Col("ms per call", 22),
                   bc.Col("x floor", 8))
  for mode in ("fwd", "fwd+bwd"):
    base = statistics.median(times[f"floor {mode}"])
    for name in ("blocked", "ragged_dot", "floor"):
      xs = times[f"{name} {mode}"]
      table.row(name, mode, bc.spread(xs, 1e3), f"{statistics.median(xs) / base:.2f}")
  print(bc.load_line())
  return 0


if __name__ == "__main__":
  sys.exit(main())
