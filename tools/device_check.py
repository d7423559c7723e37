"""One table of what this accelerator does with distflow-jax, kept row by row: a short loan of a
device may end at any moment, so every section's row is printed, and its JSON record appended
to --out, the moment that section ends.

    python tools/device_check.py [--shape tiny|small|qwen0.5b] [--model HF_DIR] [--out FILE.jsonl]
        [--limit SECTION=S,...] [--timeout S] [--skip train,decode,grpo,memory]
        [--train-batch B] [--prompt P] [--response R] [--decode-batch 16] [--decode-prompt P]
        [--decode-new N] [--grpo-prompts K] [--grpo-n N] [--grpo-new N] [--repeats R]
        [--plan-source analytic|compiled] [--workdir DIR]

Runs on whatever backend JAX finds (one chip: `jax.devices()[0]`), with no network: the
model is random-init of a real shape (`--shape qwen0.5b` is Qwen2.5-0.5B, tools/model_shapes;
default on GPU/TPU) or a small one (`small` ~3 M params, default on CPU; `tiny` ~0.1 M), in
bfloat16 parameters and activations; `--model HF_DIR` (a real folder, such as the SmolLM2 that
`distflow-jax convert` writes: docs/real_model.md) takes that folder's shape for every section
and its real weights for the GRPO and memory sections, --shape then naming only the batch
and length defaults.  Everything runs with the run config's defaults (configs/grpo.py and
config/defaults.py: layers under scan, float32 master weights, adamw, grad clip 1).

Sections, in this order, each in its own child process with its own time limit (`--limit`,
defaults in LIMITS; `--timeout S` sets every one): the child is SIGKILLed (with its process
group) at its deadline, the table says "timed out" on that section's row and the next section
runs.  A child also dies with this script (PR_SET_PDEATHSIG), and SIGINT/SIGTERM kill the
running child first, so an interrupted check leaves no process holding the device.

* versions: python, jax, jaxlib, flax (and whether flax imports on this jax), the CUDA/ROCm/
  TPU plugin packages installed (importlib.metadata), cuDNN (jax's `cuda_versions`, else
  "n/a"), the device kind and count.
* device: bf16 dense FLOP/s and memory bandwidth of the device, from `PEAKS` (matched on
  `jax.devices()[0].device_kind`); for a CPU or an unknown device both are measured on
  the spot and marked "measured": the best of a few large jitted matmuls (bf16 and f32,
  the faster counts) and of a large array `x + 1` (bytes read + written / time).  The
  measured matmul and copy are shown on every device, as a check of the table.
* train step MFU: the actor train step of the `train_actor` node (`train/steps.py`'s
  `make_train_step` on `actor_loss`: clipped ratio + k3 KL, as GRPO), compiled once, median
  of `--repeats` steps, every row its own prompt (no prompt sharing, so the count holds).
  Model FLOPs per step, T = P + R - 1 positions (the last token predicts nothing):
      6 * N_nonemb * B * T          the blocks' matmul weights (q, k, v, o, gate, up, down)
    + 6 * V * d * B * R             the unembedding, which the step runs on the R response
                                    positions only (tied to the embedding on Qwen2.5)
    + 12 * L * B * T^2 * d_q        attention QK^T and AV, forward + backward, over the full
                                    (masked) T x T square, which is what is computed
  (`_bench_common.train_flops`; norms, softmax, the embedding lookup and the optimizer are
  not counted).  MFU = FLOPs / step time / peak.
* decode: tokens/s of our engine (`rollout.Engine`: prefill all slots, then its compiled
  multi-step decode to the end; no stop token, so every slot decodes `--decode-new`
  tokens) at `--decode-batch` slots, timing the decode only (median of `--repeats`).  A
  decode step must read the weights once and each slot's filled KV cache, so
      bytes/step = param bytes + 2 * L * B * H_kv * D_h * 2 bytes * (P + N / 2)
  (the cache's mean filled length over the decode), roofline tokens/s =
  B * bandwidth / bytes/step, and the share is measured / roofline.
* GRPO step: the real `distflow-jax train` (configs/grpo.py:qwen0.5b's DAG, its Python entry
  point `distflow_jax.cli.main` run in the child) on a random model folder of the shape
  (tools/make_random_model.py, with its byte-level BPE tokenizer), built-in arithmetic
  prompts, 2 steps; the table shows `time/step` and the compile count of both from the run's
  metrics.jsonl (step 1 compiles, step 2 is warm).  Cold on purpose: the persistent compile
  cache is off for it (DISTFLOW_JAX_COMPILE_CACHE="", unless that variable is set), so step 1
  always compiles everything and no ahead-of-time widths are added.  The child ends as soon
  as step 2 is in metrics.jsonl, before the run's final checkpoint save (6.2 GB at qwen0.5b:
  80 s on this CPU, no part of a step); if the limit cuts the run earlier, the steps already
  in metrics.jsonl still count.
  Sized for a short loan: at `qwen0.5b` it is 4 prompts x 4 samples, <= 64 prompt + 32 new
  tokens (was 8 x 4, 64 + 128: on one H100 that run had not finished step 1 after 160 s
  cold).  The engine compiles one decode program for the run (a full-size cache; before
  issue 32 one per cache window passed: 64 + 32 tokens needed 2, 64 + 128 needed 5).  The goal is
  step 2 inside a 3-minute cold run on one H100 (`--limit grpo=210` by default); not yet
  verified on a GPU.
* peak memory: `jax.devices()[0].memory_stats()["peak_bytes_in_use"]` of the GRPO child
  (polled every second once the backend is up, and read at the end: the peak over model
  load, both steps and the final save), beside the peak per device that `distflow-jax plan
  --memory` (`--plan-source`, analytic by default; on CPU, one simulated device) gives for
  the same config flags.  Where `memory_stats()` is None (a CPU) the row says "n/a on this
  platform" and still shows the plan's figure.

`--out` is JSON lines: one record per section as it ends ({"section": ..., "status": "ok" |
"error" | "timeout" | "skipped", "wall_s", "limit_s", figures...}), a "settings" record after
"versions", and a "summary" record (errors, total_s) at the end; `read_out(path)` gives
them by section.  Exit 0 when every section ran clean, 1 otherwise, 2 on a bad flag.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import math
import os
import re
import shutil
import signal
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _bench_common as bc  # noqa: E402

SECTIONS = ("versions", "device", "train", "decode", "grpo", "memory")
SKIPPABLE = ("train", "decode", "grpo", "memory")
# Seconds each section may take by default: sized for qwen0.5b on one H100 inside a 15-minute
# loan (at most 12 minutes in all; each usually ends well before its limit).
LIMITS = dict(versions=60, device=90, train=150, decode=150, grpo=210, memory=60)
# Overrides of tools/model_shapes/qwen2.5-0.5b/config.json (make_random_model's HF keys).
SHAPES = {
    "tiny": ["num_hidden_layers=2", "hidden_size=64", "intermediate_size=128",
             "num_attention_heads=4", "num_key_value_heads=2", "head_dim=16", "vocab_size=512",
             "max_position_embeddings=512"],
    "small": ["num_hidden_layers=4", "hidden_size=256", "intermediate_size=688",
              "num_attention_heads=4", "num_key_value_heads=2", "head_dim=64",
              "vocab_size=512", "max_position_embeddings=1024"],
    "qwen0.5b": [],
}
# Per shape: train rows, prompt, response; decode prompt, new; GRPO prompts, n, new; repeats.
DEFAULTS = {
    "tiny": dict(train_batch=8, prompt=32, response=32, decode_prompt=32, decode_new=32,
                 grpo_prompts=2, grpo_n=2, grpo_new=16, repeats=3),
    "small": dict(train_batch=16, prompt=64, response=64, decode_prompt=64, decode_new=64,
                  grpo_prompts=4, grpo_n=4, grpo_new=32, repeats=3),
    "qwen0.5b": dict(train_batch=16, prompt=256, response=256, decode_prompt=128,
                     decode_new=128, grpo_prompts=4, grpo_n=4, grpo_new=32, repeats=5),
}
GRPO_PROMPT_LEN = 64  # the arithmetic prompts in the chat template are ~50 tokens
COMPILE_CACHE_ENV = "DISTFLOW_JAX_COMPILE_CACHE"

# bf16 dense FLOP/s and memory bandwidth (bytes/s) by device kind: the first entry whose
# words all occur in the lower-cased `device_kind` wins (vendor data sheets, no sparsity).
PEAKS = (
    (("h100", "pcie"), "H100 PCIe", 756e12, 2.0e12),
    (("h100", "nvl"), "H100 NVL", 835e12, 3.9e12),
    (("h100",), "H100 SXM", 989e12, 3.35e12),
    (("h200",), "H200", 989e12, 4.8e12),
    (("a100", "80gb"), "A100 80GB", 312e12, 2.04e12),
    (("a100", "40gb"), "A100 40GB", 312e12, 1.555e12),
    (("a100",), "A100", 312e12, 2.0e12),
    (("v5 lite",), "TPU v5e", 197e12, 0.82e12),
    (("v5e",), "TPU v5e", 197e12, 0.82e12),
    (("v5p",), "TPU v5p", 459e12, 2.77e12),
    (("tpu v5",), "TPU v5p", 459e12, 2.77e12),  # a v5p calls itself "TPU v5"
    (("v6 lite",), "TPU v6e", 918e12, 1.64e12),
    (("v6e",), "TPU v6e", 918e12, 1.64e12),
    (("tpu v4",), "TPU v4", 275e12, 1.23e12),
)


def peak_for(device_kind: str) -> tuple[str, float, float] | None:
  """(name, bf16 FLOP/s, bytes/s) of a known device kind, else None (then: measure)."""
  kind = device_kind.lower()
  for words, name, flops, bw in PEAKS:
    if all(w in kind for w in words):
      return name, flops, bw
  return None


# ---------------------------------------------------------------- flags

class _Parser(argparse.ArgumentParser):
  def error(self, message):  # one line, exit 2 (argparse prints usage too)
    print(f"device_check: error: {message}", file=sys.stderr)
    sys.exit(2)


def _positive(text: str) -> int:
  try:
    value = int(text)
  except ValueError:
    raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
  if value <= 0:
    raise argparse.ArgumentTypeError(f"{text} must be > 0")
  return value


def _skip(text: str) -> tuple[str, ...]:
  names = tuple(s for s in text.split(",") if s)
  bad = [s for s in names if s not in SKIPPABLE]
  if bad:
    raise argparse.ArgumentTypeError(f"unknown {bad}; valid: {','.join(SKIPPABLE)}")
  return names


def _limits(text: str) -> dict[str, int]:
  """`grpo=300,train=60` -> {"grpo": 300, "train": 60}."""
  out = {}
  for item in (s for s in text.split(",") if s):
    name, eq, secs = item.partition("=")
    if not eq or name not in SECTIONS:
      raise argparse.ArgumentTypeError(f"{item!r}: write SECTION=SECONDS, SECTION one of "
                                       f"{','.join(SECTIONS)}")
    out[name] = _positive(secs)
  return out


def _args(argv):
  p = _Parser(description=__doc__.split("\n\n")[0])
  p.add_argument("--shape", choices=sorted(SHAPES),
                 help="model shape (default: qwen0.5b on GPU/TPU, small on CPU)")
  p.add_argument("--model", help="a real Hugging Face folder (its shape; its weights in the "
                                 "GRPO and memory sections) instead of a random one")
  p.add_argument("--out", help="also append every section's figures to this JSON-lines file "
                               "(emptied first)")
  for name, what in (("train-batch", "train step rows"), ("prompt", "train prompt tokens"),
                     ("response", "train response tokens"),
                     ("decode-prompt", "decode prompt tokens"),
                     ("decode-new", "decode new tokens per slot"),
                     ("grpo-prompts", "GRPO prompts per step"),
                     ("grpo-n", "GRPO samples per prompt"),
                     ("grpo-new", "GRPO max new tokens"),
                     ("repeats", "timed repeats (median counts)")):
    p.add_argument(f"--{name}", type=_positive, help=f"{what} (default: by shape)")
  p.add_argument("--decode-batch", type=_positive, default=16, help="decode slots")
  p.add_argument("--skip", type=_skip, default=(), help=f"comma list of {','.join(SKIPPABLE)}")
  p.add_argument("--limit", type=_limits, default={},
                 help="seconds per section, e.g. grpo=300,train=60 (default: "
                      + ",".join(f"{k}={v}" for k, v in LIMITS.items()) + ")")
  p.add_argument("--timeout", type=_positive,
                 help="seconds allowed to every section that --limit does not name")
  p.add_argument("--plan-source", choices=("analytic", "compiled"), default="analytic",
                 help="plan --memory's --memory_source for the memory row")
  p.add_argument("--workdir", help="keep the model folder, runs and logs here (default: a "
                                   "temporary directory, removed at the end unless a section "
                                   "failed)")
  p.add_argument("--child", choices=SECTIONS, help=argparse.SUPPRESS)
  p.add_argument("--child-out", help=argparse.SUPPRESS)
  args = p.parse_args(argv)
  if args.out and os.path.isdir(args.out):
    p.error(f"--out {args.out} is a directory; give a file name")
  if args.child and not (args.child_out and args.workdir and args.shape):
    p.error("--child needs --child-out, --workdir and --shape")
  return args


def section_limit(args, name: str) -> int:
  return args.limit.get(name) or args.timeout or LIMITS[name]


def resolve(args, shape: str) -> dict:
  """The run's settings: flags given, the rest from DEFAULTS[shape]."""
  out = dict(DEFAULTS[shape], shape=shape, decode_batch=args.decode_batch)
  for k in DEFAULTS[shape]:
    if getattr(args, k) is not None:
      out[k] = getattr(args, k)
  return out


# --model: a real folder in place of the random one of the shape (set by main and child).
MODEL_DIR = ""


def _hf_config(shape: str) -> dict:
  if MODEL_DIR:
    with open(os.path.join(MODEL_DIR, "config.json")) as f:
      return json.load(f)
  import make_random_model as mrm  # pylint: disable=import-outside-toplevel
  return mrm.hf_config("qwen2.5-0.5b", SHAPES[shape])


def grpo_flags(s: dict, model_dir: str, run_dir: str) -> list[str]:
  """The config flags of the GRPO section's run (plan --memory takes the same)."""
  rows = s["grpo_prompts"] * s["grpo_n"]
  return [
      "--config=grpo:qwen0.5b", f"--config.model.path={model_dir}",
      "--config.data.train=builtin:arithmetic", "--config.data.eval=",
      "--config.data.prompt_key=prompt", f"--config.data.prompts_per_step={s['grpo_prompts']}",
      f"--config.rollout.n={s['grpo_n']}", f"--config.data.max_prompt_len={GRPO_PROMPT_LEN}",
      f"--config.rollout.max_new_tokens={s['grpo_new']}",
      f"--config.rollout.prefill_buckets=({GRPO_PROMPT_LEN},)",
      f"--config.actor.micro_batch_size={math.gcd(rows, 16)}", "--config.actor.mini_batches=1",
      f"--config.rollout.max_concurrent_decodes={rows}", "--config.trainer.total_steps=2",
      "--config.trainer.eval_every=0", "--config.trainer.save_every=0",
      f"--config.model.max_seq_len={GRPO_PROMPT_LEN + s['grpo_new']}",
      f"--config.run_dir={run_dir}"]


# ---------------------------------------------------------------- the children: measurements

def _say(text: str) -> None:
  print(f"[device_check] {text}", file=sys.stderr, flush=True)


def _dist_versions() -> dict[str, str]:
  """Installed jax platform plugins (CUDA, ROCm, TPU) by distribution name."""
  import importlib.metadata as md
  out = {}
  for dist in md.distributions():
    name = (dist.metadata["Name"] or "").lower().replace("_", "-")
    if (re.fullmatch(r"jax-(cuda|rocm)\d+-(plugin|pjrt)", name)
        or name in ("libtpu", "libtpu-nightly")):
      out[name] = dist.version
  return dict(sorted(out.items()))


def _cudnn_version() -> str:
  """cuDNN as jax's CUDA plugin reports it (90800 -> "9.8.0"), else "n/a"."""
  try:
    from jax._src.lib import cuda_versions  # pylint: disable=import-outside-toplevel
    v = int(cuda_versions.cudnn_get_version())
  except Exception:  # pylint: disable=broad-except  - no plugin, no cuDNN, another jax layout
    return "n/a"
  return f"{v // 10000}.{v % 10000 // 100}.{v % 100}" if v >= 10000 else str(v)


def measure_versions() -> dict:
  """Software versions and the devices; nothing here may fail on a CPU."""
  import importlib.metadata as md
  import platform as pf

  def ver(name):
    try:
      return md.version(name)
    except md.PackageNotFoundError:
      return None

  rec = dict(python=pf.python_version(), jax=ver("jax"), jaxlib=ver("jaxlib"),
             flax=ver("flax"), plugins=_dist_versions())
  import jax
  rec["jax_imported"] = jax.__version__
  try:
    import flax.nnx  # noqa: F401  pylint: disable=import-outside-toplevel,unused-import
    rec["flax_imports"] = True
  except Exception as e:  # pylint: disable=broad-except  - flax 0.12.8 on jax 0.11 fails here
    rec["flax_imports"] = False
    rec["flax_error"] = _one_line(e)
  rec["cudnn"] = _cudnn_version()
  devs = jax.devices()
  rec.update(platform=jax.default_backend(), device_kind=devs[0].device_kind,
             num_devices=len(devs))
  with contextlib.suppress(Exception):
    rec["platform_version"] = str(devs[0].client.platform_version)
  return rec


def measure_device(platform: str) -> dict:
  """The peak (table or measured) and a measured matmul and copy."""
  import jax
  import jax.numpy as jnp
  dev = jax.devices()[0]
  n = 2048 if platform == "cpu" else 8192
  key = jax.random.key(0)
  dot = jax.jit(jnp.dot)
  matmul = {}
  for dtype in ("bfloat16", "float32") if platform == "cpu" or not peak_for(dev.device_kind) \
      else ("bfloat16",):
    a = jax.random.normal(key, (n, n), dtype)
    b = jax.random.normal(jax.random.fold_in(key, 1), (n, n), dtype)
    matmul[dtype] = bc.matmul_flops(n) / bc.best_time(lambda: dot(a, b).block_until_ready(), 3)
    del a, b
  elems = (64 << 20) if platform == "cpu" else (256 << 20)  # 256 MiB / 1 GiB of float32
  x = jnp.zeros((elems,), jnp.float32)
  add = jax.jit(lambda x: x + 1)
  copy_bw = 2 * x.nbytes / bc.best_time(lambda: add(x).block_until_ready(), 5)
  del x
  known = peak_for(dev.device_kind)
  if known:
    name, flops, bw = known
    source = f"table: {name}"
  else:
    flops, bw, source = max(matmul.values()), copy_bw, "measured"
  return dict(device_kind=dev.device_kind, platform=platform, num_devices=jax.device_count(),
              jax=jax.__version__, peak_flops=flops, peak_bw=bw, peak_source=source,
              matmul_n=n, matmul_flops=matmul, copy_bytes=2 * elems * 4, copy_bw=copy_bw)
def _run_cfg():
  """The run config's defaults (config/defaults.py + configs/grpo.py's KL)."""
  from distflow_jax.config.loading import load
  return load("grpo:qwen0.5b", [])


def _model_cfg(shape: str):
  from distflow_jax.models import ModelConfig
  from distflow_jax.state import roles
  return roles.levers(_run_cfg(), ModelConfig.from_hf_dict(_hf_config(shape), "bfloat16"))


def measure_train(s: dict) -> dict:
  """Median step time of the actor train step; FLOPs and MFU are filled in by the caller."""
  import jax
  import jax.numpy as jnp
  from flax import nnx

  from distflow_jax.models import sharding
  from distflow_jax.train import placement, steps
  from distflow_jax.state import roles

  run = _run_cfg()
  cfg = _model_cfg(s["shape"])
  b, p, r = s["train_batch"], s["prompt"], s["response"]
  mesh = sharding.make_mesh({"fsdp": 1, "tensor": 1}, jax.devices()[:1])
  model = roles.build_actor(cfg, mesh, "", 0)
  graphdef, params = nnx.split(model)
  del model
  tx = roles.optimizer(run, run.actor.optimizer, 100)
  opt_state = placement.init_opt_state(tx, params)
  loss_cfg = steps.ActorLoss.from_config(run.actor, r, group_size=1)
  loss = lambda g, w, mb: steps.actor_loss(g, w, mb, loss_cfg, 512)  # noqa: E731  as the node
  step = steps.make_train_step(loss, graphdef, tx, 1, loss_cfg.loss_agg, 1)
  data = {k: jnp.asarray(v) for k, v in bc.actor_batch(cfg.vocab_size, b, p, r).items()}
  state = {"p": params, "o": opt_state}
  del params, opt_state

  def run_step():
    state["p"], state["o"], stats = step(state["p"], state["o"], data)
    jax.block_until_ready(stats)
    return stats

  t0 = time.perf_counter()
  stats = run_step()
  compile_s = time.perf_counter() - t0
  t_step = bc.median_time(run_step, s["repeats"])
  stats = jax.device_get(run_step())
  return dict(rows=b, prompt=p, response=r, compile_s=compile_s, step_s=t_step,
              tokens_per_s=b * (p + r) / t_step, skipped=int(stats["skipped"]),
              params=cfg.num_params, dtype=cfg.dtype, scan_layers=cfg.scan_layers,
              remat=cfg.remat, attention_impl=cfg.attention_impl,
              compiles=step._cache_size())


def measure_decode(s: dict) -> dict:
  """Decode tokens/s at `decode_batch` slots (prefill excluded) and the bytes a step reads."""
  import jax
  import numpy as np

  from distflow_jax.rollout import Engine, EngineConfig, SamplingParams, replica_mesh

  run = _run_cfg()
  cfg = _model_cfg(s["shape"])
  b, p, n = s["decode_batch"], s["decode_prompt"], s["decode_new"]
  engine = Engine(cfg, EngineConfig(
      max_concurrent_decodes=b, prefill_buckets=(p,), max_new_tokens=n,
      sampling=SamplingParams(temperature=run.rollout.temperature, top_p=run.rollout.top_p,
                              top_k=run.rollout.top_k),
      decode_steps=min(EngineConfig.decode_steps, n)),
                  mesh=replica_mesh(1, jax.devices()[:1]))
  params = engine.load_params(None, seed=0)
  prompts = np.random.RandomState(0).randint(1, cfg.vocab_size, (b, p)).tolist()

  def one_round() -> tuple[int, float]:
    state = engine.init_decode_state()
    keys = np.asarray(engine.new_request_keys(b))
    state, tok, _, _ = engine.prefill_insert(params, state, prompts, list(range(b)),
                                             list(range(b)), keys)
    jax.block_until_ready((state, tok))
    tokens, t0 = 0, time.perf_counter()
    while True:
      state, out = engine.generate_steps(params, state)
      out = jax.device_get(out)
      tokens += int(np.asarray(out.valid_BxK).sum())
      if not np.asarray(out.active_B).any():
        return tokens, time.perf_counter() - t0

  t0 = time.perf_counter()
  one_round()
  compile_s = time.perf_counter() - t0
  rounds = [one_round() for _ in range(s["repeats"])]
  tokens = rounds[0][0]
  secs = statistics.median(t for _, t in rounds)
  param_bytes = sum(x.nbytes for x in jax.tree.leaves(params))
  itemsize = np.dtype(cfg.jnp_dtype).itemsize
  kv_bytes = 2 * cfg.num_layers * b * cfg.num_kv_heads * cfg.head_dim * itemsize * (p + n / 2)
  return dict(batch=b, prompt=p, new=n, decode_steps=engine.config.decode_steps,
              compile_s=compile_s, decode_tokens=tokens, decode_s=secs,
              tokens_per_s=tokens / secs, param_bytes=param_bytes, kv_bytes_per_step=kv_bytes,
              bytes_per_step=param_bytes + kv_bytes, compiles=engine.compile_counts())


MEMORY_FILE = "grpo_memory.json"


def _one_line(e) -> str:
  lines = [l.strip() for l in str(e).splitlines() if l.strip()]
  return lines[0][:300] if lines else ""


class MemoryWatch:
  """Keeps `path` holding the first device's `memory_stats()` (so a run killed at its limit
  still leaves the peak so far), polled every `every` s once jax's backends are up: never
  before, since the train command sets the device count and joins its group first."""

  def __init__(self, path: str, every: float = 1.0, then=None):
    self.path, self.every, self.polls, self.then = path, every, 0, then
    self._stop = threading.Event()
    self._thread = threading.Thread(target=self._run, name="device_check-memory", daemon=True)

  def start(self) -> "MemoryWatch":
    self._thread.start()
    return self

  def stop(self) -> None:
    self._stop.set()
    self._thread.join()
    self.poll()

  def _run(self) -> None:
    while not self._stop.wait(self.every):
      with contextlib.suppress(Exception):  # a poll that fails is retried; never kill the run
        self.poll()
        if self.then is not None:
          self.then()

  def poll(self) -> None:
    bridge = sys.modules.get("jax._src.xla_bridge")
    if bridge is None or not bridge.backends_are_initialized():
      return
    import jax
    stats = jax.devices()[0].memory_stats()
    self.polls += 1
    keys = ("peak_bytes_in_use", "bytes_in_use", "bytes_limit", "largest_alloc_size")
    bc.write_json(self.path, dict(platform=jax.default_backend(), polls=self.polls,
                                stats={k: int(stats[k]) for k in keys if k in stats}
                                if stats else None))


def grpo_record(s: dict, workdir: str) -> dict:
  """What the GRPO run left in `workdir`: its steps from metrics.jsonl (whole lines only) and
  the memory file.  The child reports it; after a kill the parent reads the same files."""
  run_dir = os.path.join(workdir, "run")
  metrics = sorted(bc.read_jsonl(os.path.join(run_dir, "metrics.jsonl")),
                   key=lambda m: m["step"])
  nodes = ("generate", "ref_logprob", "old_logprob", "train_actor")
  flags = grpo_flags(s, MODEL_DIR or os.path.join(workdir, "model"), run_dir)
  return dict(prompts=s["grpo_prompts"], n=s["grpo_n"], prompt_len=GRPO_PROMPT_LEN,
              new=s["grpo_new"], step_s=[m["time/step"] for m in metrics],
              compiles=[m.get("compile/count") for m in metrics],
              compile_s=[m.get("time/compile") for m in metrics],
              tokens=[m.get("tokens") for m in metrics],
              nodes_s=[{k: m.get(f"time/{k}") for k in nodes} for m in metrics],
              memory=bc.read_json(os.path.join(workdir, MEMORY_FILE)),
              command="distflow-jax train " + " ".join(flags))


def run_grpo(s: dict, workdir: str, child_out: str) -> dict:
  """Two steps of `distflow-jax train` (its entry point, in this process) on a random model
  folder of the shape, with the device's memory watched.  Once step 2 is in metrics.jsonl the
  record is written and the process ends: the run's final checkpoint save (6.2 GB at
  qwen0.5b, 80 s on this CPU) is no part of a step and would only eat the loan."""
  import make_random_model as mrm  # pylint: disable=import-outside-toplevel
  model_dir, run_dir = os.path.join(workdir, "model"), os.path.join(workdir, "run")
  for d in (model_dir, run_dir):
    shutil.rmtree(d, ignore_errors=True)
  with contextlib.suppress(FileNotFoundError):
    os.remove(os.path.join(workdir, MEMORY_FILE))
  t0 = time.perf_counter()
  if MODEL_DIR:
    model_dir = MODEL_DIR
  else:
    mrm.write(Path(model_dir), _hf_config(s["shape"]))
  write_s = time.perf_counter() - t0
  t0 = time.perf_counter()

  def end_after_last_step():
    if len(grpo_record(s, workdir)["step_s"]) < 2:
      return
    watch.poll()
    bc.write_json(child_out, dict(grpo_record(s, workdir), folder_write_s=write_s,
                                process_wall_s=time.perf_counter() - t0,
                                ended="after step 2, before the final checkpoint save"))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)

  watch = MemoryWatch(os.path.join(workdir, MEMORY_FILE), then=end_after_last_step).start()
  from distflow_jax import cli  # pylint: disable=import-outside-toplevel
  rc = cli.main(["train", *grpo_flags(s, model_dir, run_dir), "--noresume"])
  wall = time.perf_counter() - t0
  watch.stop()
  rec = dict(grpo_record(s, workdir), folder_write_s=write_s, process_wall_s=wall)
  if rc:
    rec["error"] = f"distflow-jax train exit {rc}"
  return rec


_PEAK_LINE = re.compile(r"^peak: ([0-9.]+) (GB|MB) on device \d+ \(process \d+\), "
                        r"while (.+?) runs\s*$", re.M)


def run_plan(s: dict, workdir: str, source: str) -> dict:
  """`distflow-jax plan --memory` (its entry point, in this CPU-only process) for the GRPO
  section's config, on a config-only folder of the shape; its peak per device."""
  import make_random_model as mrm  # pylint: disable=import-outside-toplevel
  model_dir = MODEL_DIR or os.path.join(workdir, "plan_model")
  if not MODEL_DIR:
    mrm.write(Path(model_dir), _hf_config(s["shape"]), config_only=True)
  argv = ["plan", "--memory", f"--memory_source={source}", "--num_processes=1",
          "--devices_per_process=1",
          *grpo_flags(s, os.path.join(workdir, "model"), os.path.join(workdir, "run"))]
  argv[argv.index(f"--config.model.path={os.path.join(workdir, 'model')}")] = \
      f"--config.model.path={model_dir}"
  from distflow_jax import cli  # pylint: disable=import-outside-toplevel
  buf = io.StringIO()
  with contextlib.redirect_stdout(buf):
    rc = cli.main(argv)
  text = buf.getvalue()
  print(text, flush=True)  # the section's log keeps the whole plan
  rec = dict(plan_source=source, plan_command="distflow-jax " + " ".join(argv))
  m = _PEAK_LINE.search(text)
  if rc or not m:
    rec["error"] = (f"distflow-jax plan exit {rc}" if rc else
                    "plan --memory printed no 'peak: ...' line")
    return rec
  start = text.find("memory per device")
  return dict(rec, plan_peak_bytes=float(m[1]) * {"GB": 1e9, "MB": 1e6}[m[2]],
              plan_node=m[3], plan_memory=text[start:].splitlines() if start >= 0 else [])


def child(args) -> int:
  """One section in this process; its record goes to --child-out (JSON), whatever happens."""
  s = resolve(args, args.shape)
  try:
    if args.child == "versions":
      rec = measure_versions()
      if not rec["flax_imports"]:  # every later section fails the same way: say why once
        rec["error"] = (f"flax {rec['flax']} does not import with jax {rec['jax_imported']}: "
                        f"{rec['flax_error']}")
    elif args.child == "device":
      import jax
      rec = dict(measure_device(jax.default_backend()), params=_model_cfg(s["shape"]).num_params)
    elif args.child == "train":
      rec = measure_train(s)
    elif args.child == "decode":
      rec = measure_decode(s)
    elif args.child == "grpo":
      rec = run_grpo(s, args.workdir, args.child_out)
    else:
      rec = run_plan(s, args.workdir, args.plan_source)
  except Exception as e:  # pylint: disable=broad-except  - reported in the table, not raised
    import traceback
    traceback.print_exc()  # into the section's log
    rec = {"error": f"{type(e).__name__}: {_one_line(e)}"[:300]}
  bc.write_json(args.child_out, rec)
  sys.stdout.flush()
  sys.stderr.flush()
  os._exit(0)  # no interpreter teardown: the device is released now, nothing else to wait for


# ---------------------------------------------------------------- the parent

def _on_signal(signum, _frame) -> None:
  bc.kill_children()
  print(f"device_check: stopped by signal {signum}; the rows above (and --out) hold every "
        f"section that ended", file=sys.stderr, flush=True)
  os._exit(128 + signum)


def _last_line(path: str) -> str:
  with contextlib.suppress(OSError), open(path, errors="replace") as f:
    lines = [l.strip() for l in f if l.strip()]
    return lines[-1][:200] if lines else ""
  return ""


def run_section(name: str, argv: list[str], workdir: str, limit: int, env: dict) -> dict:
  """Runs one section's child under a SIGKILL deadline; its record, with status and times."""
  out_file = os.path.join(workdir, f"{name}.json")
  log_path = os.path.join(workdir, f"{name}.log")
  with contextlib.suppress(FileNotFoundError):
    os.remove(out_file)
  cmd = [sys.executable, os.path.abspath(__file__), *argv, "--child", name,
         "--child-out", out_file]
  # A child dies with this script (PDEATHSIG): a check killed at a loan's end leaves nothing
  # on the device.
  done = bc.run_with_deadline(cmd, limit, env=env, log_path=log_path, die_with_parent=True)
  rc, timed_out = done.returncode, done.timed_out
  rec = bc.read_json(out_file)
  if not isinstance(rec, dict):
    rec = {}
  if timed_out:
    rec["error"] = f"timed out: killed at its {limit} s limit"
  elif rc or not os.path.exists(out_file):
    rec.setdefault("error", f"child exit {rc}: {_last_line(log_path)}")
  status = "timeout" if timed_out else "error" if "error" in rec else "ok"
  return {"section": name, "status": status, **rec, "wall_s": done.wall_s,
          "limit_s": limit, "log": log_path}


def derive(name: str, rec: dict, dev: dict, s: dict) -> None:
  """Adds the derived figures: FLOPs and MFU, the decode roofline and its share."""
  if name == "train" and "step_s" in rec:
    shape = _model_cfg_light(s["shape"])
    flops = bc.train_flops(shape, rec["rows"], rec["prompt"], rec["response"])
    rec.update(flops=flops, achieved_flops=flops["total"] / rec["step_s"])
    if "peak_flops" in dev:
      rec["mfu"] = rec["achieved_flops"] / dev["peak_flops"]
  if name == "decode" and "tokens_per_s" in rec and "peak_bw" in dev:
    rec["roofline_tokens_per_s"] = rec["batch"] * dev["peak_bw"] / rec["bytes_per_step"]
    rec["roofline_share"] = rec["tokens_per_s"] / rec["roofline_tokens_per_s"]


def _model_cfg_light(shape: str):
  """The shape's numbers for the FLOP count (no jax needed)."""
  d = _hf_config(shape)
  return bc.Shape(vocab_size=d["vocab_size"], hidden_size=d["hidden_size"],
                  intermediate_size=d["intermediate_size"], num_layers=d["num_hidden_layers"],
                  num_heads=d["num_attention_heads"], num_kv_heads=d["num_key_value_heads"],
                  head_dim=d["head_dim"])


def _rate(x: float, unit: str) -> str:
  for scale, prefix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
    if x >= scale:
      return f"{x / scale:.3g} {prefix}{unit}"
  return f"{x:.3g} {unit}"


def _gb(n: float) -> str:
  return f"{n / 1e9:.2f} GB" if n >= 1e9 else f"{n / 1e6:.1f} MB"


def _failed(label: str, rec: dict) -> list[tuple]:
  return [(label, rec.get("error") or rec.get("status", "not run"), "", "")]


SKIPPED_LABELS = dict(train="train step MFU", decode="decode tok/s", grpo="GRPO step",
                      memory="peak memory of the GRPO run")


def rows(name: str, rec: dict, dev: dict, s: dict) -> list[tuple]:
  """The table rows of one section's record (one row saying why when it did not run)."""
  if rec["status"] == "skipped":
    return [(SKIPPED_LABELS[name], "skipped", "", "")]
  if name == "versions":
    if "platform" not in rec:
      return _failed("versions", rec)
    flax = f"flax {rec['flax']}" + ("" if rec.get("flax_imports") else
                                    f" (import FAILED: {rec.get('flax_error', '')})")
    jax = rec["jax"] or rec.get("jax_imported")
    plugins = ", ".join(f"{k} {v}" for k, v in rec["plugins"].items()) or "no plugin"
    return [(f"versions: {rec['device_kind']} x {rec['num_devices']} ({rec['platform']})",
             f"python {rec['python']}, jax {jax}, jaxlib {rec['jaxlib']}, {flax}",
             f"{plugins}; cuDNN {rec['cudnn']}", "")]
  if name == "device":
    if "peak_flops" not in rec:
      return _failed("device peak (matmul, copy)", rec)
    src, out = rec["peak_source"], []
    for dtype, f in rec["matmul_flops"].items():
      out.append((f"{dtype} matmul {rec['matmul_n']}^2 (measured)", _rate(f, "FLOP/s"),
                  f"peak {_rate(rec['peak_flops'], 'FLOP/s')} ({src})",
                  f"{f / rec['peak_flops']:.1%}"))
    out.append((f"copy x + 1, {rec['copy_bytes'] / 2 ** 20:.0f} MiB moved (measured)",
                _rate(rec["copy_bw"], "B/s"), f"peak {_rate(rec['peak_bw'], 'B/s')} ({src})",
                f"{rec['copy_bw'] / rec['peak_bw']:.1%}"))
    return out
  peak = (f"peak {_rate(dev['peak_flops'], 'FLOP/s')} ({dev['peak_source']})"
          if "peak_flops" in dev else "peak unknown (device section failed)")
  if name == "train":
    label = (f"train step MFU, bf16, {s['train_batch']} x ({s['prompt']} + {s['response']}) "
             f"tokens")
    if "achieved_flops" not in rec:
      return _failed(label, rec)
    return [(label, f"{_rate(rec['achieved_flops'], 'FLOP/s')}, {rec['step_s'] * 1e3:.1f} "
             f"ms/step", peak, f"{rec['mfu']:.1%}" if "mfu" in rec else "")]
  if name == "decode":
    label = (f"decode tok/s, batch {s['decode_batch']}, {s['decode_prompt']} + "
             f"{s['decode_new']} tokens")
    if "tokens_per_s" not in rec:
      return _failed(label, rec)
    if "roofline_share" not in rec:
      return [(label, f"{rec['tokens_per_s']:.0f} tok/s", "roofline unknown (device section "
               "failed)", "")]
    return [(label, f"{rec['tokens_per_s']:.0f} tok/s",
             f"roofline {rec['roofline_tokens_per_s']:.0f} tok/s "
             f"({rec['bytes_per_step'] / 2 ** 20:.1f} MiB/step at {_rate(dev['peak_bw'], 'B/s')})",
             f"{rec['roofline_share']:.1%}")]
  if name == "grpo":
    about = (f"{s['grpo_prompts']} prompts x {s['grpo_n']}, <= {GRPO_PROMPT_LEN} + "
             f"{s['grpo_new']} tokens")
    steps = rec.get("step_s", [])
    out = []
    for i, what in ((0, "1 (compiles)"), (1, "2 (warm)")):
      if i < len(steps):
        n = (rec.get("compiles") or [None] * 2)[i]
        out.append((f"GRPO step {what}, {about}", f"{steps[i]:.2f} s",
                    (f"{n:.0f} compiles" if n is not None else "") +
                    (f", distflow-jax train {rec['process_wall_s']:.0f} s "
                     + ("to step 2's end" if rec.get("ended") else "in all")
                     if i == 0 and "process_wall_s" in rec else ""), ""))
    if len(steps) < 2 or "error" in rec:
      out += _failed(f"GRPO {'run' if len(steps) >= 2 else f'step {len(steps) + 1}'}, {about}",
                     dict(rec, error=rec.get("error") or f"{len(steps)} step(s) recorded"))
    return out
  # memory
  label = "peak memory of the GRPO run (peak_bytes_in_use)"
  plan = (f"plan --memory ({rec['plan_source']}): {_gb(rec['plan_peak_bytes'])}, while "
          f"{rec['plan_node']} runs" if "plan_peak_bytes" in rec else
          f"plan --memory: {rec.get('error') or rec['status']}")
  measured, share = rec.get("measured_peak_bytes"), ""
  if measured:
    value = _gb(measured)
    if "plan_peak_bytes" in rec:
      share = f"{measured / rec['plan_peak_bytes']:.0%}"
  else:
    value = rec.get("measured_note", "n/a")
  return [(label, value, plan, share)]


def merge_memory(rec: dict, grpo: dict | None) -> None:
  """The GRPO child's measured peak beside the plan's figure in the memory record."""
  mem = (grpo or {}).get("memory")
  stats = (mem or {}).get("stats")
  rec["measured"] = mem
  if grpo is None or grpo.get("status") == "skipped":
    rec["measured_note"] = "n/a: grpo section skipped"
  elif mem is None:
    rec["measured_note"] = "n/a: the GRPO run reported no memory"
  elif not stats or "peak_bytes_in_use" not in stats:
    rec["measured_note"] = f"n/a on this platform ({mem.get('platform')}: memory_stats() is None)"
  else:
    rec["measured_peak_bytes"] = stats["peak_bytes_in_use"]
    if grpo.get("status") == "timeout":
      rec["measured_note"] = "at the GRPO run's kill"


class Report:
  """Prints each section's rows and appends its record to --out the moment it ends."""

  def __init__(self, out: str | None):
    self.records = bc.JsonLines(out)
    self.table = bc.Table(bc.Col("measure", 58, "<"), bc.Col("value", 30, "<"),
                          bc.Col("against", 50, "<"), bc.Col("share", 7, "<"), markdown=True)

  def record(self, rec: dict) -> None:
    self.records.append(rec)

  def section(self, rec: dict, table_rows: list[tuple]) -> None:
    for r in table_rows:
      self.table.row(*r)
    self.record(rec)


def read_out(path: str) -> dict[str, dict]:
  """An --out file's records by section (a line cut by a kill is left out)."""
  return {rec["section"]: rec for rec in bc.read_jsonl(path)}


def main(argv=None) -> int:
  argv = sys.argv[1:] if argv is None else list(argv)
  args = _args(argv)
  global MODEL_DIR  # pylint: disable=global-statement
  MODEL_DIR = os.path.abspath(args.model) if args.model else ""
  if MODEL_DIR and not os.path.isfile(os.path.join(MODEL_DIR, "config.json")):
    print(f"device_check: --model {args.model} has no config.json", file=sys.stderr)
    return 2
  if args.child:
    return child(args)
  t_start = time.perf_counter()
  workdir = os.path.abspath(args.workdir or tempfile.mkdtemp(prefix="device_check_"))
  os.makedirs(workdir, exist_ok=True)
  for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
    signal.signal(sig, _on_signal)
  limits = {name: section_limit(args, name) for name in SECTIONS}
  print(f"device_check: each section in its own process, limits (s) "
        + ", ".join(f"{k} {v}" for k, v in limits.items()) + f"; work dir {workdir}; "
        f"start: {bc.load_line()}", flush=True)
  report = Report(args.out)
  env = bc.child_env(devices=1)  # one host device (else the CPU splits as XLA_FLAGS says)
  grpo_env = env if COMPILE_CACHE_ENV in os.environ else dict(env, **{COMPILE_CACHE_ENV: ""})
  done: dict[str, dict] = {}

  def run(name: str, shape: str) -> dict:
    _say(f"{name} (limit {limits[name]} s)...")
    sub_env = (dict(env, JAX_PLATFORMS="cpu") if name == "memory" else
               grpo_env if name == "grpo" else env)
    child_argv = [*argv, "--shape", shape, "--workdir", workdir]
    return run_section(name, child_argv, workdir, limits[name], sub_env)

  ver = run("versions", args.shape or "small")
  platform = ver.get("platform")
  shape = args.shape or ("small" if platform in (None, "cpu") else "qwen0.5b")
  s = resolve(args, shape)
  report.section(ver, rows("versions", ver, {}, s))
  done["versions"] = ver
  report.record({"section": "settings", **s, "limits": limits, "workdir": workdir,
                 "grpo_compile_cache": grpo_env.get(COMPILE_CACHE_ENV)})
  for name in SECTIONS[1:]:
    if name in args.skip:
      rec = {"section": name, "status": "skipped"}
    else:
      rec = run(name, shape)
      if name == "grpo" and rec["status"] == "timeout":  # the steps it finished still count
        rec = {**grpo_record(s, workdir), **rec}
      if name == "memory":
        merge_memory(rec, done.get("grpo"))
      derive(name, rec, done.get("device", {}), s)
    done[name] = rec
    report.section(rec, rows(name, rec, done.get("device", {}), s))

  errors = [f"{n}: {r.get('error', r['status'])}" for n, r in done.items()
            if r["status"] in ("error", "timeout")]
  grpo = done.get("grpo", {})
  if grpo.get("status") == "ok" and len(grpo.get("step_s", [])) < 2:
    errors.append(f"grpo: {len(grpo['step_s'])} step(s) in metrics.jsonl, 2 expected")
  total = time.perf_counter() - t_start
  report.record({"section": "summary", "errors": errors, "total_s": total})
  if errors and not args.workdir:
    print(f"logs kept in {workdir}", flush=True)
  elif not args.workdir:
    shutil.rmtree(workdir, ignore_errors=True)
  print(f"total {total:.0f} s; end: {bc.load_line()}"
        + "".join(f"\nerror: {e}" for e in errors), flush=True)
  return 1 if errors else 0


if __name__ == "__main__":
  sys.exit(main())
