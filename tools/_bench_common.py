"""Shared pieces of the benchmark tools: the bench model, FLOP counts, the matmul peak.

Pure helpers (no jax import at module level) so tests can check the arithmetic fast.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable

# The ~3 M-param Qwen2 shape every bench uses (DESIGN.md's reference numbers are on it).
BENCH_MODEL = dict(arch="qwen2", vocab_size=512, hidden_size=256, intermediate_size=688,
                   num_layers=4, num_heads=4, num_kv_heads=2, head_dim=64, qkv_bias=True,
                   tie_embeddings=True)


@dataclasses.dataclass(frozen=True)
class Shape:
  """The numbers of a decoder that FLOP counts need (a subset of ModelConfig)."""
  vocab_size: int
  hidden_size: int
  intermediate_size: int
  num_layers: int
  num_heads: int
  num_kv_heads: int
  head_dim: int

  @classmethod
  def of(cls, cfg) -> "Shape":
    return cls(**{f.name: getattr(cfg, f.name) for f in dataclasses.fields(cls)})


def layer_matmul_params(s: Shape) -> int:
  """Weights of one block that take part in a matmul (q, k, v, o, gate, up, down)."""
  q, kv = s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim
  return s.hidden_size * (2 * q + 2 * kv) + 3 * s.hidden_size * s.intermediate_size


def train_flops(s: Shape, batch: int, prompt_len: int, response_len: int) -> dict[str, float]:
  """FLOPs of one actor train step (forward + backward = 3 x forward) on ``batch`` rows.

  The actor step runs the blocks over ``prompt_len + response_len - 1`` positions (the last
  token predicts nothing) and the unembedding only over the ``response_len`` positions whose
  log-probs the loss needs.  Per token, a matmul with W weights costs 2W FLOPs forward and 4W
  backward (6W); attention adds QK^T and AV, 2 x 2 x T x q_dim forward per token and layer,
  counted over the full (masked) T x T square because that is what is computed.  The
  embedding lookup, norms, biases, softmax and optimizer are not counted (they are not
  matmuls).  ``simple_6nt`` is the textbook 6 x params x tokens with every parameter and
  every token, for comparison.
  """
  t = prompt_len + response_len - 1
  q = s.num_heads * s.head_dim
  blocks = 6.0 * s.num_layers * layer_matmul_params(s) * batch * t
  unembed = 6.0 * s.vocab_size * s.hidden_size * batch * response_len
  attention = 3.0 * 4.0 * s.num_layers * batch * t * t * q
  total_params = s.num_layers * layer_matmul_params(s) + s.vocab_size * s.hidden_size
  return {"blocks": blocks, "unembed": unembed, "attention": attention,
          "total": blocks + unembed + attention,
          "simple_6nt": 6.0 * total_params * batch * (prompt_len + response_len)}


def matmul_flops(n: int) -> float:
  """FLOPs of an n x n by n x n matmul (n^2 outputs, n multiply-adds each)."""
  return 2.0 * n ** 3


def median_time(fn: Callable[[], object], repeats: int) -> float:
  """Median wall time of ``repeats`` calls of ``fn`` (which must block until done)."""
  times = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    fn()
    times.append(time.perf_counter() - t0)
  return statistics.median(times)


def matmul_peak(n: int = 2048, repeats: int = 5, dtype: str = "float32") -> float:
  """This CPU's achieved FLOP/s on one large jitted ``jnp.dot`` (the bench's "peak")."""
  import jax
  import jax.numpy as jnp
  key = jax.random.key(0)
  a = jax.random.normal(key, (n, n), dtype)
  b = jax.random.normal(jax.random.fold_in(key, 1), (n, n), dtype)
  dot = jax.jit(jnp.dot)
  dot(a, b).block_until_ready()
  return matmul_flops(n) / median_time(lambda: dot(a, b).block_until_ready(), repeats)


def fmt_rate(x: float) -> str:
  return f"{x / 1e9:.1f} GFLOP/s"
