"""The benchmark tools' arithmetic: FLOP counts by hand and against XLA's own count."""

import os
import sys

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tools"))
import _bench_common as bc  # noqa: E402

from distflow_jax.models import ModelConfig, Transformer  # noqa: E402
from distflow_jax.train import steps  # noqa: E402


def _xla_flops(fn, *args) -> float:
  cost = jax.jit(fn).lower(*args).compile().cost_analysis()
  return float((cost[0] if isinstance(cost, list) else cost)["flops"])


def test_train_flops_by_hand():
  # d 4, ffn 6, 1 layer, 2 heads x 2 dims (q 4), 1 kv head (kv 2), vocab 10.
  s = bc.Shape(vocab_size=10, hidden_size=4, intermediate_size=6, num_layers=1, num_heads=2,
               num_kv_heads=1, head_dim=2)
  # q 4x4 + k 4x2 + v 4x2 + o 4x4 = 48; gate/up/down 3 x 4x6 = 72.
  assert bc.layer_matmul_params(s) == 120
  f = bc.train_flops(s, batch=3, prompt_len=2, response_len=3)  # T = 2 + 3 - 1 = 4
  assert f["blocks"] == 6 * 120 * 3 * 4
  assert f["unembed"] == 6 * 10 * 4 * 3 * 3
  assert f["attention"] == 3 * 4 * 1 * 3 * 4 * 4 * 4
  assert f["total"] == f["blocks"] + f["unembed"] + f["attention"]
  assert f["simple_6nt"] == 6 * (120 + 40) * 3 * 5


def test_matmul_flops_matches_xla():
  a = jnp.ones((64, 64), jnp.float32)
  assert bc.matmul_flops(64) == 2 * 64 ** 3
  assert _xla_flops(jnp.dot, a, a) == pytest.approx(bc.matmul_flops(64), rel=1e-6)


def test_forward_flops_match_xla_count_of_the_actor_forward():
  """One third of train_flops is the forward the actor loss runs; XLA counts the same
  matmuls plus elementwise work (norms, softmax, RoPE), so ours is a bit below XLA's."""
  cfg = ModelConfig(arch="qwen2", vocab_size=256, hidden_size=64, intermediate_size=256,
                    num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, qkv_bias=True)
  graphdef, params = nnx.split(Transformer(cfg, rngs=nnx.Rngs(0)))
  b, p, n = 4, 8, 8
  batch = dict(prompt_tokens=jnp.ones((b, p), jnp.int32), prompt_mask=jnp.ones((b, p), bool),
               response_tokens=jnp.ones((b, n), jnp.int32),
               response_mask=jnp.ones((b, n), bool))
  xla = _xla_flops(lambda w, x: steps.response_logprobs(graphdef, w, x)[0], params, batch)
  ours = bc.train_flops(bc.Shape.of(cfg), b, p, n)["total"] / 3
  assert 0.9 * xla <= ours <= xla


def test_median_time_counts_every_call():
  calls = []
  t = bc.median_time(lambda: calls.append(1), repeats=5)
  assert len(calls) == 5 and t >= 0


def test_compiles_per_step_reads_a_jax_log(tmp_path):
  import bench_e2e
  log = tmp_path / "ours.log"
  log.write_text(
      "INFO Finished XLA compilation of jit(copy) in 0.01 sec\n"
      "--- step 0\n"
      "INFO Finished XLA compilation of jit(step) in 1.5 sec\n"
      "INFO Finished XLA compilation of jit(decode_chunk) in 2.0 sec\n"
      "--- step 1\n"
      "unrelated line\n")
  assert bench_e2e.compiles_per_step(str(log)) == {
      "setup": ["jit(copy)"], "0": ["jit(step)", "jit(decode_chunk)"], "1": []}


@pytest.mark.timeout(600)
def test_compare_algorithms_smoke(tmp_path):
  """tools/compare_algorithms.py end to end at a toy budget: one warm start shared by the
  runs of a task, one process per run, the table and the plot."""
  import json

  import compare_algorithms as ca
  pytest.importorskip("matplotlib")
  out = tmp_path / "cmp"
  tiny = ["model.preset=micro", "model.warmstart.steps=2", "model.warmstart.examples=64",
          "model.warmstart.batch_size=16", "rollout.n=2", "rollout.max_new_tokens=8",
          "rollout.prefill_buckets=(32,)", "rollout.max_concurrent_decodes=8",
          "data.eval_size=8", "actor.micro_batch_size=4", "critic.micro_batch_size=4",
          "cluster.devices_per_process=1"]
  rc = ca.main(["--steps", "2", "--tasks", "letters", "--algorithms", "grpo,rloo",
                "--samples-per-step", "8", "--out", str(out),
                *[f"--set={o}" for o in tiny]])
  assert rc == 0
  md = (out / "compare.md").read_text()
  assert "Load average (1, 5, 15 min) at start:" in md and "at end:" in md
  rows = [l for l in md.splitlines() if l.startswith("| letters |")]
  assert [r.split(" | ")[1] for r in rows] == ["grpo", "rloo"]
  for r in rows:
    cells = r.split(" | ")
    assert cells[6] == "8" and cells[7] == "16" and cells[8] == "16"  # n_eval, samples
    assert cells[2].endswith("%") and cells[4].endswith("%")
  assert (out / "compare.png").stat().st_size > 0
  for algo in ("grpo", "rloo"):  # the task's warm start, copied, not redone per run
    log = (out / "letters" / f"{algo}.log").read_text()
    assert "using the cached model" in log, log[-2000:]
    steps = [json.loads(l)["step"] for l in open(out / "letters" / algo / "metrics.jsonl")]
    assert steps == [0, 1, 2]
