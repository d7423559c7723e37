"""Shared pieces of the benchmark tools: the bench model, FLOP counts, the matmul peak, and
the plumbing that runs Tunix (google-tunix) in its own venv as a worker subprocess.

No jax import at module level: tests check the arithmetic fast, and the Tunix workers
(which run in the Tunix venv, without distflow_jax) import this module too.
"""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
import subprocess
import sys
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


def mean_median(xs) -> tuple[float, float]:
  xs = list(xs)
  return statistics.fmean(xs), statistics.median(xs)


# ---------------------------------------------------------------- Tunix in its own venv

TUNIX_SPEC = "google-tunix==0.1.7"
DEFAULT_TUNIX_VENV = os.path.join(os.path.expanduser("~"), ".cache", "distflow-bench",
                                  "tunix-venv")
TAG = "BENCH "


def ensure_tunix(venv: str, log=print) -> str:
  """The python of a venv with google-tunix, created on first use; raises with pip's output."""
  py = os.path.join(venv, "bin", "python")
  probe = [py, "-c", "import tunix.rl.grpo.grpo_learner, tunix.generate.sampler"]
  if os.path.exists(py) and subprocess.run(probe, capture_output=True).returncode == 0:
    return py
  log(f"creating {venv} with {TUNIX_SPEC} (about a minute, ~1.6 GB)...")
  base = getattr(sys, "_base_executable", sys.executable)
  subprocess.run([base, "-m", "venv", venv], check=True)
  r = subprocess.run([py, "-m", "pip", "install", "-q", TUNIX_SPEC], capture_output=True,
                     text=True)
  if r.returncode:
    raise RuntimeError(f"pip install {TUNIX_SPEC} failed:\n{r.stderr[-3000:]}")
  return py


def tunix_env() -> dict:
  """The environment of a Tunix worker: one CPU device."""
  return dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=1",
              JAX_PLATFORMS="cpu")


def emit(rec: dict) -> None:
  """A worker's answer to the parent: one tagged JSON line on stdout."""
  print(TAG + json.dumps(rec), flush=True)


def commands():
  """A worker's loop: one iteration per 'go' line on stdin, until 'stop' or EOF."""
  for line in sys.stdin:
    if line.strip() == "stop":
      return
    yield


class Worker:
  """A subprocess that answers each 'go' with one tagged JSON record (its stderr, and any
  untagged stdout, go to ``log_path``)."""

  def __init__(self, name: str, argv: list[str], log_path: str, env: dict):
    self.name = name
    self.log = open(log_path, "w")
    self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                 stderr=self.log, text=True, env=env)

  def _read(self) -> dict:
    while True:
      line = self.proc.stdout.readline()
      if not line:
        self.proc.wait()
        raise RuntimeError(f"{self.name} worker exited ({self.proc.returncode}); see "
                           f"{self.log.name}")
      if line.startswith(TAG):
        return json.loads(line[len(TAG):])
      self.log.write(line)

  def ready(self) -> dict:
    return self._read()

  def step(self) -> dict:
    t0 = time.perf_counter()
    self.proc.stdin.write("go\n")
    self.proc.stdin.flush()
    rec = self._read()
    rec["wall_s"] = time.perf_counter() - t0
    return rec

  def close(self) -> None:
    if self.proc.poll() is None:
      try:
        self.proc.stdin.write("stop\n")
        self.proc.stdin.flush()
        self.proc.wait(timeout=60)
      except (BrokenPipeError, subprocess.TimeoutExpired):
        self.proc.kill()
    self.log.close()


class CompileCount:
  """This process's backend compiles (count, seconds) from creation on, via jax.monitoring
  (the event distflow_jax.run.compile_cache counts; for a process without distflow)."""

  EVENT = "/jax/core/compile/backend_compile_duration"

  def __init__(self):
    from jax import monitoring
    self.count, self.seconds = 0, 0.0
    monitoring.register_event_duration_secs_listener(self._on)

  def _on(self, event: str, duration: float, **_) -> None:
    if event == self.EVENT:
      self.count += 1
      self.seconds += duration

  def snapshot(self) -> tuple[int, float]:
    return self.count, self.seconds


class TunixTokenizer:
  """Our exported tokenizer.json behind the encode/decode/bos/eos/pad interface Tunix takes."""

  def __init__(self, path: str, eos_id: int, pad_id: int):
    import tokenizers
    self.tok = tokenizers.Tokenizer.from_file(path)
    self._eos, self._pad = eos_id, pad_id

  def encode(self, text, **_):
    return self.tok.encode(text, add_special_tokens=False).ids

  def decode(self, ids, **_):
    return self.tok.decode([int(i) for i in ids], skip_special_tokens=True)

  def bos_id(self):
    return None  # our prompts carry no BOS; Tunix then prepends none

  def eos_id(self):
    return self._eos

  def pad_id(self):
    return self._pad


def tunix_qwen2(model_dir: str, m: dict):
  """(Tunix's qwen2 model loaded from our exported model.safetensors, its 1x1 mesh);
  ``m`` is the model's config dict (BENCH_MODEL's keys).  Runs in the Tunix venv."""
  import jax
  from tunix.models.qwen2 import model as qwen2_model
  from tunix.models.qwen2 import params as qwen2_params
  mcfg = qwen2_model.ModelConfig(
      num_layers=m["num_layers"], vocab_size=m["vocab_size"], embed_dim=m["hidden_size"],
      hidden_dim=m["intermediate_size"], num_heads=m["num_heads"], head_dim=m["head_dim"],
      num_kv_heads=m["num_kv_heads"], rope_theta=10000, norm_eps=1e-6,
      use_tied_embedding=m["tie_embeddings"])
  mesh = jax.make_mesh((1, 1), ("fsdp", "tp"), devices=jax.devices()[:1],
                       axis_types=(jax.sharding.AxisType.Auto,) * 2)
  return qwen2_params.create_model_from_safe_tensors(model_dir, mcfg, mesh), mesh
