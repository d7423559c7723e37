"""The bench harness every tool in tools/ shares (one module; the tools import it as ``bc``).

No jax import at module level: tests check the arithmetic fast, and the workers that run in
other venvs (Tunix, JetStream) import this module too.  What is here, by section:

* The bench model and FLOP counts: ``BENCH_MODEL``, ``Shape``, ``layer_matmul_params``,
  ``train_flops``, ``matmul_flops``, ``matmul_peak``, ``fmt_rate``.
* The actor train step the benches time: ``bench_tx``, ``sharded_actor``, ``actor_step``,
  ``actor_batch`` (jax imported inside).
* Timing: ``timed(fn) -> (value, s)``; a contender that times itself returns
  ``Measured(value, seconds)``.  ``alternate(contenders, rounds, rotate=, skip=, on_time=)``
  times each contender once per round in turn (so load drift hits all alike) and calls
  ``on_time`` the moment each time is had; ``median_time``, ``best_time``; ``spread(xs)`` is
  "median (min-max)".
* Machine state: ``flush_lines()`` (stdout line-buffered, so rows show as they come),
  ``load_average()`` (uptime's 1, 5, 15-minute figures), ``load_line()`` (the
  date, the load and the cpus; benches print it at the start and the end),
  ``mem_available_bytes``, ``peak_rss_bytes``.
* Output: ``Table(Col(...), "|", ...)`` prints its header, then each ``row(...)`` the moment
  it is given (plain or markdown; ``Span`` fills several columns); ``write_json`` (whole or
  not at all), ``read_json``, ``read_jsonl`` (whole lines only), ``JsonLines`` (appended and
  synced record by record); ``emit`` / ``tagged`` / ``commands``: tagged JSON lines between a
  worker and its parent.
* Child processes: ``child_env(devices=, unset=, defaults=, **set)`` (XLA_FLAGS' host device
  count replaced, other flags kept), ``default_host_devices`` (this process, before jax
  starts); ``run_with_deadline(cmd, timeout_s, log_path=, env=, die_with_parent=)`` runs a
  child in its own session and SIGKILLs it, its group and every process below it at the
  deadline (``Finished(returncode, output, timed_out, wall_s)``); ``kill_children()`` for a
  signal handler.
* Tunix in its own venv (``ensure_tunix``, ``tunix_env``, ``Worker``, ``CompileCount``,
  ``TunixTokenizer``, ``tunix_model``; Tunix's sampler as a contender is _tunix_side.py's)
  and JetStream in its own venv (``INSIDE_VENV``,
  ``inside_venv``; the serving loop is ``jetstream_adapter.serve_streams``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import json
import os
import resource
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterable
from typing import Any, NamedTuple

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


# ---------------------------------------------------------------- the actor train step

def bench_tx():
  """The benches' optimizer: adamw 1e-5 after a global-norm clip of 1."""
  import optax
  return optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-5))


def sharded_actor(cfg, seed: int = 0):
  """``(graphdef, params)`` of a ``Transformer(cfg)`` made sharded on a 1-device mesh."""
  import jax
  from flax import nnx

  from distflow_jax.models import Transformer, sharding
  mesh = sharding.make_mesh({"fsdp": 1, "tensor": 1}, jax.devices()[:1])
  model = sharding.create_sharded(lambda: Transformer(cfg, rngs=nnx.Rngs(seed)), mesh,
                                  sharding.fsdp_tp_rules())
  return nnx.split(model)


def actor_step(graphdef, tx, num_micro: int = 1, group_size: int = 1):
  """The ``train_actor`` node's step: ``train/steps.make_train_step`` on the GRPO actor loss
  (clipped ratio + k3 KL to the reference, coef 0.001), ``num_micro`` micro-batches
  accumulated in one jitted scan, each group of ``group_size`` rows' prompt run once."""
  from distflow_jax.config import defaults
  from distflow_jax.train import steps
  loss_cfg = dataclasses.replace(steps.ActorLoss.from_config(defaults.base().actor),
                                 kl_coef=0.001, group_size=group_size)
  loss = lambda g, p, mb: steps.actor_loss(g, p, mb, loss_cfg, 512)  # noqa: E731
  return steps.make_train_step(loss, graphdef, tx, num_micro, loss_cfg.loss_agg, group_size)


def actor_batch(vocab: int, batch: int, prompt: int, response: int, seed: int = 0,
                group_size: int = 1) -> dict:
  """A random GRPO actor batch (numpy): ``batch`` rows of ``prompt`` + ``response`` real
  tokens, each block of ``group_size`` rows with one prompt; old / reference log-probs
  uniform in [-7, -5], advantages standard normal."""
  import numpy as np
  rs = np.random.RandomState(seed)
  prompts = rs.randint(1, vocab, (batch // group_size, prompt)).astype(np.int32)
  return {
      "prompt_tokens": np.repeat(prompts, group_size, axis=0),
      "prompt_mask": np.ones((batch, prompt), bool),
      "response_tokens": rs.randint(1, vocab, (batch, response)).astype(np.int32),
      "response_mask": np.ones((batch, response), bool),
      "old_logprobs": rs.uniform(-7, -5, (batch, response)).astype(np.float32),
      "ref_logprobs": rs.uniform(-7, -5, (batch, response)).astype(np.float32),
      "advantages": rs.normal(size=(batch, response)).astype(np.float32),
  }


# ---------------------------------------------------------------- timing

class Measured(NamedTuple):
  """What a contender that times itself returns: its result and its own seconds (which
  then count instead of the wall time of the call)."""
  value: Any
  seconds: float


def timed(fn: Callable[[], Any]) -> tuple[Any, float]:
  """``(result, seconds)`` of one call of ``fn`` (which must block until done)."""
  t0 = time.perf_counter()
  out = fn()
  dt = time.perf_counter() - t0
  return (out.value, out.seconds) if isinstance(out, Measured) else (out, dt)


def median_time(fn: Callable[[], object], repeats: int) -> float:
  """Median wall time of ``repeats`` calls of ``fn`` (which must block until done)."""
  return statistics.median(timed(fn)[1] for _ in range(repeats))


def best_time(fn: Callable[[], object], repeats: int) -> float:
  """The fastest of ``repeats`` calls of ``fn``, after one untimed call (the compile)."""
  fn()
  return min(timed(fn)[1] for _ in range(repeats))


def alternate(contenders: dict[str, Callable[[], Any]], rounds: int, *, rotate: bool = False,
              skip: Callable[[int, str], bool] | None = None,
              on_time: Callable[[int, str, float, Any], None] | None = None
              ) -> dict[str, list[float]]:
  """Each contender's seconds, one call per round, the contenders in turn within a round so
  that machine load hits all alike (``rotate``: round i starts at contender i, and so on
  round the list).  ``skip(round, name)`` true leaves that call out; ``on_time(round, name,
  seconds, result)`` runs right after each call (print the row the moment it is had)."""
  names = list(contenders)
  times: dict[str, list[float]] = {n: [] for n in names}
  for i in range(rounds):
    first = i % len(names) if rotate and names else 0
    for name in names[first:] + names[:first]:
      if skip is not None and skip(i, name):
        continue
      value, secs = timed(contenders[name])
      times[name].append(secs)
      if on_time is not None:
        on_time(i, name, secs, value)
  return times


def spread(xs: Iterable[float], scale: float = 1.0, fmt: str = ".3g") -> str:
  """``median (min-max)`` of ``xs`` times ``scale``, each number as ``fmt``."""
  xs = [x * scale for x in xs]
  return (f"{statistics.median(xs):{fmt}} ({min(xs):{fmt}}-{max(xs):{fmt}})")


# ---------------------------------------------------------------- machine state

def flush_lines() -> None:
  """Makes stdout line-buffered: each printed row reaches a pipe or a log the moment it is
  printed, not when a buffer fills (a no-op where stdout is not a plain text stream)."""
  with contextlib.suppress(AttributeError, ValueError, OSError):
    sys.stdout.reconfigure(line_buffering=True)


def load_average() -> str:
  """The 1, 5 and 15-minute load averages as `uptime` prints them (``0.52, 0.61, 0.70``):
  times from a loaded machine are not speeds."""
  return ", ".join(f"{x:.2f}" for x in os.getloadavg())


def load_line() -> str:
  """``date, load average (1, 5, 15 min): a, b, c, N cpus``."""
  now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")
  return f"{now}, load average (1, 5, 15 min): {load_average()}, {os.cpu_count()} cpus"


def mem_available_bytes() -> int:
  with open("/proc/meminfo") as f:
    for line in f:
      if line.startswith("MemAvailable:"):
        return int(line.split()[1]) * 1024
  return 0


def peak_rss_bytes() -> int:
  """This process's peak resident set so far (Linux reports ``ru_maxrss`` in KiB)."""
  return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


# ---------------------------------------------------------------- output: tables, JSON

def _print_now(text: str) -> None:
  print(text, flush=True)


@dataclasses.dataclass(frozen=True)
class Col:
  """A table column: its title, width, alignment (``<`` or ``>``) and the format spec of a
  value that is not already a string."""
  title: str
  width: int = 0
  align: str = ">"
  fmt: str = ""


@dataclasses.dataclass(frozen=True)
class Span:
  """A row cell that fills the next ``cols`` columns (and the literals among them),
  left-aligned: a "not run" or "FAILED" in place of figures."""
  text: str
  cols: int


class Table:
  """A table printed as it goes: the header at creation, each ``row`` the moment it is
  given (flushed).  Columns are ``Col``s; a plain string among them (``"|"``) is a literal
  printed in the header and in every row that goes past it.  A row may give fewer values
  than there are columns, and a ``tail`` of free text after them.  ``markdown``: ``| a | b |``
  rows under a ``|---|`` rule; else cells joined by ``sep``, and ``rule`` draws dashes under
  the header."""

  def __init__(self, *columns: Col | str, sep: str = " ", markdown: bool = False,
               rule: bool = False, out: Callable[[str], None] | None = None,
               header: bool = True):
    self.columns, self.sep, self.markdown, self.rule = columns, sep, markdown, rule
    self.out = out or _print_now
    if header:
      self.header()

  def header(self) -> None:
    head = self._join([c if isinstance(c, str) else f"{c.title:{c.align}{c.width}}"
                       for c in self.columns])
    self.out(head)
    if self.markdown:
      self.out("|" + "|".join("-" * max(3, (len(c) if isinstance(c, str) else c.width) + 2)
                              for c in self.columns) + "|")
    elif self.rule:
      self.out("-" * len(head))

  def _join(self, cells: list[str], tail: str = "") -> str:
    if self.markdown:
      return "| " + " | ".join(cells) + " |"
    return self.sep.join(cells + ([tail] if tail else [])).rstrip()

  def format(self, *values, tail: str = "") -> str:
    cells, pending, ci, vals = [], [], 0, list(values)
    while ci < len(self.columns) and vals:
      col = self.columns[ci]
      if isinstance(col, str):
        pending.append(col)
        ci += 1
        continue
      value = vals.pop(0)
      cells += pending
      pending = []
      if isinstance(value, Span):
        width, taken = -len(self.sep), 0
        while ci < len(self.columns) and taken < value.cols:
          c = self.columns[ci]
          width += len(self.sep) + (len(c) if isinstance(c, str) else c.width)
          taken += not isinstance(c, str)
          ci += 1
        cells.append(f"{value.text:<{width}}")
        continue
      text = value if isinstance(value, str) else format(value, col.fmt)
      cells.append(f"{text:{col.align}{col.width}}")
      ci += 1
    return self._join(cells, tail)

  def row(self, *values, tail: str = "") -> str:
    line = self.format(*values, tail=tail)
    self.out(line)
    return line

  def note(self, text: str) -> None:
    """A free line among the rows."""
    self.out(text)


def write_json(path: str, obj, indent: int | None = None) -> None:
  """Whole or not at all: a kill mid-write leaves the previous file."""
  tmp = f"{path}.tmp"
  with open(tmp, "w") as f:
    json.dump(obj, f, indent=indent)
  os.replace(tmp, path)


def read_json(path: str):
  """The file's JSON, or None when it is missing or not JSON."""
  try:
    with open(path) as f:
      return json.load(f)
  except (OSError, ValueError):
    return None


def read_jsonl(path: str) -> list:
  """The records of a JSON-lines file ([] when missing); blank lines and a line cut by a
  kill are left out."""
  out = []
  with contextlib.suppress(OSError), open(path) as f:
    for line in f:
      with contextlib.suppress(ValueError):
        if line.strip():
          out.append(json.loads(line))
  return out


class JsonLines:
  """A JSON-lines file (emptied at creation) that each ``append`` writes to disk at once: a
  short loan or a kill keeps every record appended before it."""

  def __init__(self, path: str | None):
    self.path = path
    if path:
      open(path, "w").close()

  def append(self, rec: dict) -> None:
    if not self.path:
      return
    with open(self.path, "a") as f:
      f.write(json.dumps(rec, sort_keys=True) + "\n")
      f.flush()
      os.fsync(f.fileno())


TAG = "BENCH "


def emit(rec: dict) -> None:
  """A worker's answer to the parent: one tagged JSON line on stdout."""
  print(TAG + json.dumps(rec), flush=True)


def tagged(lines: Iterable[str]) -> list[dict]:
  """The records ``emit`` wrote among ``lines``."""
  return [json.loads(line[len(TAG):]) for line in lines if line.startswith(TAG)]


def commands():
  """A worker's loop: one iteration per 'go' line on stdin, until 'stop' or EOF; each
  yields the rest of its line ('go 16' -> '16', 'go' -> '')."""
  for line in sys.stdin:
    if line.strip() == "stop":
      return
    yield line.strip()[len("go"):].strip()


# ---------------------------------------------------------------- child processes

HOST_DEVICES = "--xla_force_host_platform_device_count"


def child_env(devices: int | None = None, *, unset: Iterable[str] = (),
              defaults: dict | None = None, **set_vars: str) -> dict:
  """This environment for a child: ``unset`` removed, XLA_FLAGS' host device count set to
  ``devices`` (its other flags kept), ``defaults`` where not set already, then ``set_vars``."""
  env = dict(os.environ)
  for key in unset:
    env.pop(key, None)
  if devices is not None:
    flags = [f for f in env.get("XLA_FLAGS", "").split() if not f.startswith(HOST_DEVICES)]
    env["XLA_FLAGS"] = " ".join(flags + [f"{HOST_DEVICES}={devices}"])
  for key, value in (defaults or {}).items():
    env.setdefault(key, value)
  env.update(set_vars)
  return env


def default_host_devices(n: int = 1) -> None:
  """This process sees ``n`` CPU devices unless XLA_FLAGS says otherwise (before jax starts)."""
  os.environ.setdefault("XLA_FLAGS", f"{HOST_DEVICES}={n}")


class Finished(NamedTuple):
  returncode: int
  output: str      # stdout + stderr when not logged to a file, else ""
  timed_out: bool
  wall_s: float


_LIVE: set = set()  # children of run_with_deadline still running, for kill_children


def descendants(pid: int) -> list[int]:
  """The ids of every live process below ``pid`` (children, grandchildren, ...), from
  /proc: a launcher may start each worker in its own session, so killing ``pid``'s process
  group alone would leave them running."""
  children: dict[int, list[int]] = {}
  for entry in os.listdir("/proc"):
    if not entry.isdigit():
      continue
    try:
      with open(f"/proc/{entry}/stat") as f:
        ppid = int(f.read().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
      continue
    children.setdefault(ppid, []).append(int(entry))
  found, todo = [], [pid]
  while todo:
    for child in children.get(todo.pop(), []):
      found.append(child)
      todo.append(child)
  return found


def kill_tree(proc: subprocess.Popen) -> None:
  """SIGKILL to ``proc``, its process group and every process below it."""
  below = descendants(proc.pid)
  with contextlib.suppress(ProcessLookupError, PermissionError):
    os.killpg(proc.pid, signal.SIGKILL)
  for pid in below:
    with contextlib.suppress(ProcessLookupError, PermissionError):
      os.kill(pid, signal.SIGKILL)
  with contextlib.suppress(ProcessLookupError):
    proc.kill()


def kill_children() -> None:
  """Kills every child of ``run_with_deadline`` still running (from a signal handler)."""
  for proc in list(_LIVE):
    kill_tree(proc)


def _die_with_parent(parent: int) -> None:
  """In the child before exec: SIGKILL when the parent dies (Linux prctl PR_SET_PDEATHSIG),
  so a run killed at a loan's end leaves nothing on the device."""
  with contextlib.suppress(Exception):
    import ctypes
    ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL))
  if os.getppid() != parent:  # the parent died before prctl took effect
    os._exit(1)


def run_with_deadline(cmd: list[str], timeout_s: float | None, *, env: dict | None = None,
                      log_path: str | None = None, die_with_parent: bool = False
                      ) -> Finished:
  """Runs ``cmd`` (stdin empty, stderr into stdout: captured, or written to ``log_path``) in
  its own session; after ``timeout_s`` (None: no deadline) it, its group and every process
  below it get SIGKILL (returncode -9, ``timed_out``, a note at the end of the output).
  ``die_with_parent``: the child is SIGKILLed if this process dies first."""
  parent = os.getpid()
  t0 = time.perf_counter()
  with contextlib.ExitStack() as stack:
    log = stack.enter_context(open(log_path, "w")) if log_path else None
    proc = subprocess.Popen(
        cmd, stdin=subprocess.DEVNULL, stdout=log or subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True, env=env, start_new_session=True,
        preexec_fn=(lambda: _die_with_parent(parent)) if die_with_parent else None)
    _LIVE.add(proc)
    try:
      try:
        out, _ = proc.communicate(timeout=timeout_s)
        timed_out = False
      except subprocess.TimeoutExpired:
        kill_tree(proc)
        out, _ = proc.communicate()
        timed_out = True
    finally:
      _LIVE.discard(proc)
  out = out or ""
  if timed_out:
    note = f"\n[killed after the {timeout_s:.0f} s deadline]"
    if log_path:
      with open(log_path, "a") as f:
        f.write(note + "\n")
    else:
      out += note
  return Finished(proc.returncode, out, timed_out, time.perf_counter() - t0)


# ---------------------------------------------------------------- Tunix in its own venv

TUNIX_SPEC = "google-tunix==0.1.7"
DEFAULT_TUNIX_VENV = os.path.join(os.path.expanduser("~"), ".cache", "distflow-bench",
                                  "tunix-venv")


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
  return child_env(devices=1, JAX_PLATFORMS="cpu")


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

  def step(self, arg: str = "") -> dict:
    """One 'go' (with ``arg`` on its line, for ``commands`` to yield) and its answer."""
    t0 = time.perf_counter()
    self.proc.stdin.write(f"go {arg}".strip() + "\n")
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


def _tunix_qwen2(model_dir: str, m: dict, dtype):
  from tunix.models.qwen2 import model as qwen2_model
  from tunix.models.qwen2 import params as qwen2_params
  mcfg = qwen2_model.ModelConfig(
      num_layers=m["num_layers"], vocab_size=m["vocab_size"], embed_dim=m["hidden_size"],
      hidden_dim=m["intermediate_size"], num_heads=m["num_heads"], head_dim=m["head_dim"],
      num_kv_heads=m["num_kv_heads"], rope_theta=m.get("rope_theta", 10000),
      norm_eps=m.get("rms_norm_eps", 1e-6), use_tied_embedding=m["tie_embeddings"],
      dtype=dtype, param_dtype=dtype)
  return qwen2_params, mcfg


def _tunix_llama3(model_dir: str, m: dict, dtype):
  # Tunix's llama3 model: plain RoPE (no Llama 3.1 frequency scaling), no q/k/v bias: what
  # Llama 2 / SmolLM2-shaped models are (model_dict refuses the rest).  It has no compute
  # dtype of its own: it computes in its parameters' dtype, which the loader casts to.
  import functools

  from tunix.models.llama3 import model as llama3_model
  from tunix.models.llama3 import params as llama3_params
  # Tunix 0.1.7's llama3 attention calls apply_rope without the config's rope_theta, so its
  # default (1,000,000) rotates every model; the model's own theta is passed here (the same
  # work, now the same function: SmolLM2's theta is 100,000).
  plain = getattr(llama3_model, "_distflow_plain_rope", llama3_model.apply_rope)
  llama3_model._distflow_plain_rope = plain
  llama3_model.apply_rope = functools.partial(plain, rope_theta=m.get("rope_theta", 10000))
  mcfg = llama3_model.ModelConfig(
      num_layers=m["num_layers"], vocab_size=m["vocab_size"], embed_dim=m["hidden_size"],
      hidden_dim=m["intermediate_size"], num_heads=m["num_heads"], head_dim=m["head_dim"],
      num_kv_heads=m["num_kv_heads"], rope_theta=m.get("rope_theta", 10000),
      norm_eps=m.get("rms_norm_eps", 1e-6), weight_tying=m["tie_embeddings"])
  return llama3_params, mcfg


# Our arch -> the Tunix model that holds it (its params module and config).
TUNIX_MODELS = {"qwen2": _tunix_qwen2, "llama": _tunix_llama3}


def tunix_model(model_dir: str, m: dict):
  """(Tunix's model of ``m["arch"]`` (qwen2 or llama; qwen2 where the key is absent) loaded
  from our exported model.safetensors, its 1x1 mesh); ``m`` is the model's config dict
  (BENCH_MODEL's keys; ``rope_theta``, ``rms_norm_eps`` and ``dtype``, of parameters and
  compute, where given).  Runs in the Tunix venv."""
  import jax
  import jax.numpy as jnp
  dtype = jnp.dtype(m.get("dtype", "float32"))
  params, mcfg = TUNIX_MODELS[m.get("arch", "qwen2")](model_dir, m, dtype)
  mesh = jax.make_mesh((1, 1), ("fsdp", "tp"), devices=jax.devices()[:1],
                       axis_types=(jax.sharding.AxisType.Auto,) * 2)
  return params.create_model_from_safe_tensors(model_dir, mcfg, mesh, dtype=dtype), mesh


# ---------------------------------------------------------------- JetStream in its own venv

INSIDE_VENV = "--inside-venv"  # the flag a JetStream tool re-runs itself in its venv with


def inside_venv(argv: list[str]) -> tuple[bool, list[str]]:
  """(whether this run is the one inside the venv, argv without the flag)."""
  return INSIDE_VENV in argv, [a for a in argv if a != INSIDE_VENV]
