"""A LoRA actor's weight sync into the rollout engine: ``rollout.lora_sync=merged`` against
``adapters`` (rollout/lora_sync.py), side by side on the same actor, alternating.

    python tools/bench_lora_sync.py [--devices 8] [--tp 2] [--rounds 10] [--rank 8]

The tiny model of ``configs/grpo.py:tiny_lora`` (d 192, 3 layers, vocab 104, ``scan_layers``,
rank 8 on q/k/v/o/gate/up/down) is trained FSDP over ``--devices`` simulated CPU devices
and rolled out on one replica over the same devices (``tensor`` = ``--tp``, as a run's
per-host replica).  Before each round the adapters change (as a train step changes them;
the base stays); each route's ``update_params`` is then timed to the last byte ready, the
routes in turn (the first of each round rotating).  Per sync: the wall time, the bytes the
sync resharded (``Engine.sync_bytes``, whole arrays) and what the engine keeps on a device
between syncs (the adapters route's base copy).  The first sync (compiles, and the
adapters route's base) is reported apart.  Then the same bytes for Qwen2.5-7B's shape
(tools/model_shapes/qwen2.5-7b, bf16, rank ``--rank`` float32 adapters on the seven
projections), from the shapes.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _bench_common as bc  # noqa: E402

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
SHAPES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "model_shapes")


def _args(argv):
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--devices", type=int, default=8, help="simulated CPU devices")
  p.add_argument("--tp", type=int, default=2, help="the replica's tensor axis")
  p.add_argument("--rounds", type=int, default=10)
  p.add_argument("--rank", type=int, default=8)
  p.add_argument("--json", default="", help="also write the figures here")
  return p.parse_args(argv)


def _mb(n: float) -> str:
  return f"{n / 1e6:.2f} MB"


def real_shape_bytes(rank: int, name: str = "qwen2.5-7b") -> dict[str, float]:
  """Bytes a sync moves for a real model's shape: the whole model in its dtype (merged)
  and its float32 rank-``rank`` adapters on the seven projections (adapters)."""
  from distflow_jax.memory import analytic as an
  from distflow_jax.models.config import ModelConfig
  from distflow_jax.models.lora_layer import LoraSpec
  with open(os.path.join(SHAPES, name, "config.json")) as f:
    cfg = ModelConfig.from_hf_dict(json.load(f)).replace(lora=LoraSpec(rank, 2.0 * rank,
                                                                       TARGETS))
  return {"merged": an.param_bytes(cfg.replace(lora=None)),
          "adapters": 4.0 * an.adapter_params(cfg)}


def main(argv=None) -> int:
  a = _args(argv)
  from distflow_jax import distributed
  distributed.simulate_cpu_devices(a.devices)
  import jax
  import numpy as np
  from flax import nnx

  from distflow_jax.models import lora, sharding
  from distflow_jax.models.config import ModelConfig
  from distflow_jax.models.lora_layer import LoraSpec
  from distflow_jax.models.transformer import Transformer
  from distflow_jax.rollout.engine import Engine
  from distflow_jax.rollout.engine.config import EngineConfig, LoraSync, replica_mesh

  bc.flush_lines()
  print(bc.load_line())
  spec = LoraSpec(a.rank, 2.0 * a.rank, TARGETS)
  cfg = ModelConfig.tiny(vocab_size=104).replace(scan_layers=True)
  mesh = sharding.make_mesh({"fsdp": a.devices})
  base = sharding.create_sharded(lambda: Transformer(cfg, rngs=nnx.Rngs(0)), mesh,
                                 sharding.fsdp_tp_rules())
  params = nnx.split(lora.attach(base, spec, 0, mesh))[1]
  adapters, frozen = lora.split_trainable(params)
  step = jax.jit(lambda ad, k: jax.tree.map(
      lambda x: x + 0.01 * jax.random.normal(k, x.shape, x.dtype), ad))
  engines = {r.value: Engine(cfg.replace(lora=spec), EngineConfig(
      max_concurrent_decodes=8, prefill_buckets=(32,), lora_sync=r),
      replica_mesh(a.tp, jax.devices())) for r in LoraSync}
  print(f"tiny LoRA model: {a.devices} devices fsdp -> replica data {a.devices // a.tp} x "
        f"tensor {a.tp}; base {_mb(sum(x.nbytes for x in jax.tree.leaves(frozen)))}, "
        f"adapters {_mb(sum(x.nbytes for x in jax.tree.leaves(adapters)))}")

  def sync(name):
    out = engines[name].update_params(lora.merge_trainable(adapters, frozen))
    jax.block_until_ready(out)
    return engines[name].sync_bytes

  first = {}
  for name in engines:
    value, secs = bc.timed(lambda n=name: sync(n))
    first[name] = (secs, value)
    print(f"first sync {name:>8}: {secs * 1e3:8.1f} ms (compiles), {_mb(value)} moved")
  held = sum(s.data.nbytes for x in engines["adapters"]._adapter_sync._base.values()
             for s in x.addressable_shards if s.device == jax.devices()[0])
  counts = {n: e.compile_counts() for n, e in engines.items()}
  table = bc.Table(bc.Col("round", 5), bc.Col("route", 8), bc.Col("sync ms", 9),
                   bc.Col("moved", 10))
  moved: dict[str, int] = {}

  def on_time(i, name, secs, value):
    moved[name] = value
    table.row(i, name, f"{secs * 1e3:.2f}", _mb(value))

  times: dict[str, list[float]] = {n: [] for n in engines}
  for i in range(a.rounds):
    adapters = step(adapters, jax.random.key(i))  # a "train step": new adapters, same base
    order = list(engines)[i % 2:] + list(engines)[:i % 2]  # who goes first alternates
    got = bc.alternate({n: (lambda n=n: sync(n)) for n in order}, 1,
                       on_time=lambda _, n, s, v, i=i: on_time(i, n, s, v))
    for n, t in got.items():
      times[n] += t
  want = [np.asarray(x) for x in jax.tree.leaves(engines["merged"].update_params(params))]
  have = [np.asarray(x) for x in jax.tree.leaves(engines["adapters"].update_params(params))]
  diff = max(float(np.abs(w - h).max()) for w, h in zip(want, have))
  assert {n: e.compile_counts() for n, e in engines.items()} == counts, "recompiled"
  real = real_shape_bytes(a.rank)
  print()
  for n in engines:
    print(f"{n:>8}: sync {bc.spread(times[n], 1e3)} ms over {a.rounds} rounds, "
          f"{_mb(moved[n])} moved a sync; kept between syncs on a device: "
          f"{_mb(held if n == 'adapters' else 0)}")
  print(f"weights: max |merged - adapters| = {diff:.2g}; nothing recompiled after the first "
        f"sync")
  print(f"Qwen2.5-7B shape (bf16, rank {a.rank} float32 adapters on 7 projections x 28 "
        f"layers): merged {real['merged'] / 1e9:.2f} GB a sync, adapters "
        f"{_mb(real['adapters'])} a sync ({real['merged'] / real['adapters']:.0f}x less)")
  print(bc.load_line())
  if a.json:
    bc.write_json(a.json, {"times_s": times, "moved": moved, "first": first, "held": held,
                           "max_diff": diff, "qwen2.5-7b": real})
  return 0


if __name__ == "__main__":
  sys.exit(main())
