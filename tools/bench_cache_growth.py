"""Peak decode-cache bytes and decode tokens/s: growing cache (rollout/engine/cache_growth.py) vs
one full-size cache per slot, side by side on the same requests.

    python tools/bench_cache_growth.py [--new 2048] [--slots 16] [--prompts 16] [--n 4]
                                       [--vocab 256] [--rounds 3]

The tiny model (`ModelConfig.tiny`, random weights) samples at temperature 1 with one stop
token, so response lengths are geometric with mean about the vocabulary size: most rows
are short, a few run to several times that (the long tail), some may hit --new.  Both
engines decode the same requests with the same keys (their tokens are checked equal).
Peak cache bytes = slots x the largest capacity the driver decoded with (over the rounds)
x the per-slot bytes (k and v of every layer + key positions); the mean is over the
decode chunks.  Tokens/s = generated
tokens / wall time of a `generate` call (prefill included), median of the rounds (each
round its own keys), engines interleaved so
machine load hits them alike; everything is compiled first (`precompile`).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

import jax
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _bench_common as bc  # noqa: E402


def _args(argv):
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--new", type=int, default=2048, help="max_new_tokens")
  p.add_argument("--slots", type=int, default=16)
  p.add_argument("--prompts", type=int, default=16)
  p.add_argument("--n", type=int, default=4, help="samples per prompt")
  p.add_argument("--vocab", type=int, default=256, help="tiny model vocabulary (mean length)")
  p.add_argument("--decode-steps", type=int, default=64)
  p.add_argument("--rounds", type=int, default=3)
  return p.parse_args(argv)


def main(argv=None) -> int:
  from distflow_jax.models.config import ModelConfig
  from distflow_jax.rollout import Engine, EngineConfig, SamplingParams, generate

  a = _args(argv)
  cfg = ModelConfig.tiny(vocab_size=a.vocab).replace(
      max_position_embeddings=max(1024, 64 + a.new))
  engines = {name: Engine(cfg, EngineConfig(
      max_concurrent_decodes=a.slots, prefill_buckets=(32, 64), max_new_tokens=a.new,
      sampling=SamplingParams(1.0), decode_steps=a.decode_steps, stop_ids=(1,),
      grow_cache=grow)) for name, grow in (("growing", True), ("full-size", False))}
  rs = np.random.RandomState(0)
  prompts = [rs.randint(2, a.vocab, size=rs.randint(8, 65)).tolist() for _ in range(a.prompts)]
  params, peaks, times, outs = {}, {}, {k: [] for k in engines}, {}
  for name, eng in engines.items():
    params[name] = eng.load_params(seed=0)
    generate(eng, params[name], prompts, n=a.n, max_new_tokens=2)  # signatures
    eng.precompile()
    fit, seen = eng.fit, []

    def spy(state, end, fit=fit, seen=seen):
      state = fit(state, end)
      seen.append(state.cache.max_len)
      return state
    eng.fit, peaks[name] = spy, seen
  bc.flush_lines()
  print(f"start: {bc.load_line()}")

  def contender(name, eng):  # round r decodes with key r
    rounds = iter(range(a.rounds))
    return lambda: generate(eng, params[name], prompts, n=a.n, rng=jax.random.key(next(rounds)))

  def on_time(r, name, secs, out):  # each round's times as they come, the outputs compared
    outs[name] = out
    times[name].append((secs, int(out.lengths_R.sum())))
    print(f"  round {r} {name:10s} {secs:6.2f} s  {times[name][-1][1]:6d} tokens")
    if name == "full-size":
      np.testing.assert_array_equal(outs["growing"].tokens_RxN, outs["full-size"].tokens_RxN)
      np.testing.assert_array_equal(outs["growing"].logprobs_RxN,
                                    outs["full-size"].logprobs_RxN)

  bc.alternate({name: contender(name, eng) for name, eng in engines.items()}, a.rounds,
               on_time=on_time)
  lengths = outs["growing"].lengths_R
  per_slot = cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * 4 + 4  # float32 k, v; pos
  print(f"tiny model vocab {a.vocab}, {a.slots} slots, {len(prompts)} prompts x n={a.n}, "
        f"max_new_tokens {a.new}, decode_steps {a.decode_steps}; last round's lengths: "
        f"median {int(np.median(lengths))}, p90 {int(np.percentile(lengths, 90))}, "
        f"max {lengths.max()}, total {lengths.sum()}")
  print(f"capacities (growing): {engines['growing'].capacities}")
  for name in engines:
    cap, mean = max(peaks[name]), statistics.mean(peaks[name])
    tok_s = statistics.median(n / t for t, n in times[name])
    print(f"{name:10s} peak cache {cap:5d} slots/row = {a.slots * cap * per_slot / 2**20:7.2f} "
          f"MiB (mean over chunks {a.slots * mean * per_slot / 2**20:6.2f} MiB)   decode {tok_s:6.0f} tok/s (median of {a.rounds}: "
          f"{', '.join(f'{t:.2f}' for t, _ in times[name])} s), "
          f"{engines[name].compile_counts()['decode_steps']} decode variants called")
  print("tokens and log-probs: identical")
  print(f"end: {bc.load_line()}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
