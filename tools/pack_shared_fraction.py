"""Padding of packed rows with and without shared prompts on a GRPO-like batch (host only).

    python tools/pack_shared_fraction.py [--prompts 64] [--n 8] [--prompt-len 200]
                                         [--max-new 1024] [--pack-len 0] [--shards 8]

Prompt lengths vary around --prompt-len (uniform 0.5x .. 1.5x, one per group), response
lengths are long-tailed (log-normal, median max_new / 8, clipped to max_new).  Prints, per
layout, the slots the pass runs, the real tokens laid and the pad fraction: padded rows,
packed per sample (packing.plan) and packed with each group's prompt laid once
(packing.plan with group_size=n, train/packing_shared.py).
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np

from distflow_jax.train import packing

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _bench_common as bc  # noqa: E402


def batch_masks(prompts: int, n: int, prompt_len: int, max_new: int, seed: int = 0):
  """Left-padded prompt masks (one length per group) and right-padded response masks."""
  rng = np.random.default_rng(seed)
  p_width = int(prompt_len * 1.5)
  lp = rng.integers(prompt_len // 2, p_width + 1, size=prompts).repeat(n)
  lr = np.clip(rng.lognormal(np.log(max_new / 8), 1.0, size=prompts * n), 1, max_new)
  prompt_mask = np.arange(p_width)[None] >= (p_width - lp)[:, None]
  response_mask = np.arange(max_new)[None] < lr.astype(int)[:, None]
  return prompt_mask, response_mask


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--prompts", type=int, default=64)
  ap.add_argument("--n", type=int, default=8)
  ap.add_argument("--prompt-len", type=int, default=200)
  ap.add_argument("--max-new", type=int, default=1024)
  ap.add_argument("--pack-len", type=int, default=0, help="0: the padded row's length")
  ap.add_argument("--shards", type=int, default=8)
  args = ap.parse_args()
  pm, rm = batch_masks(args.prompts, args.n, args.prompt_len, args.max_new)
  _, plain = packing.plan(pm, rm, args.pack_len, args.shards)
  _, shared = packing.plan(pm, rm, args.pack_len, args.shards, args.n)
  print(f"B={pm.shape[0]} rows, P={pm.shape[1]}, N={rm.shape[1]}, pack_len="
        f"{args.pack_len or pm.shape[1] + rm.shape[1] - 1}, shards={args.shards}")
  table = bc.Table(bc.Col("layout", 22, "<"), bc.Col("slots", 10), bc.Col("real tokens", 13),
                   bc.Col("pad fraction", 14, fmt=".3f"), sep="")
  table.row("padded", plain.padded, plain.useful, plain.padded_pad_fraction)
  for name, st in (("packed per sample", plain), ("packed, shared prompt", shared)):
    table.row(name, st.packed, st.useful, st.pad_fraction)
  print(f"shared / per-sample slots: {shared.packed / plain.packed:.3f}")


if __name__ == "__main__":
  main()
