"""One table of what this accelerator does with distflow-jax: train MFU, decode roofline, GRPO step.

    python tools/device_check.py [--shape tiny|small|qwen0.5b] [--out FILE.json]
        [--train-batch B] [--prompt P] [--response R] [--decode-batch 16] [--decode-prompt P]
        [--decode-new N] [--grpo-prompts K] [--grpo-n N] [--grpo-new N] [--repeats R]
        [--skip train,decode,grpo] [--timeout S] [--workdir DIR]

Runs on whatever backend JAX finds (one chip: `jax.devices()[0]`), with no network: the
model is random-init of a real shape (`--shape qwen0.5b` is Qwen2.5-0.5B, tools/model_shapes;
default on GPU/TPU) or a small one (`small` ~3 M params, default on CPU; `tiny` ~0.1 M), in
bfloat16 parameters and activations, with the run config's defaults (configs/grpo.py and
config/defaults.py: layers under scan, float32 master weights, adamw, grad clip 1).

Rows of the table (all figures also go to `--out` as JSON):

* peak: bf16 dense FLOP/s and memory bandwidth of the device, from `PEAKS` (matched on
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
* GRPO step: the real `distflow-jax train` (configs/grpo.py:qwen0.5b's DAG) in a
  subprocess on a random model folder of the shape (tools/make_random_model.py, with its
  byte-level BPE tokenizer), built-in arithmetic prompts, tiny batch, 2 steps; the table
  shows `time/step` of both from the run's metrics.jsonl (step 1 compiles, step 2 is warm).

The three measurements run in a child process and the GRPO run in another, one after the
other, so each owns the device (a TPU admits one process; GPU memory is freed between).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _bench_common as bc  # noqa: E402

TAG = "DEVICE_CHECK "
SECTIONS = ("train", "decode", "grpo")
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
                     decode_new=128, grpo_prompts=8, grpo_n=4, grpo_new=128, repeats=5),
}
GRPO_PROMPT_LEN = 64  # the arithmetic prompts in the chat template are ~50 tokens

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
  bad = [s for s in names if s not in SECTIONS]
  if bad:
    raise argparse.ArgumentTypeError(f"unknown {bad}; valid: {','.join(SECTIONS)}")
  return names


def _args(argv):
  p = _Parser(description=__doc__.split("\n\n")[0])
  p.add_argument("--shape", choices=sorted(SHAPES),
                 help="model shape (default: qwen0.5b on GPU/TPU, small on CPU)")
  p.add_argument("--out", help="also write every figure to this JSON file")
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
  p.add_argument("--skip", type=_skip, default=(), help="comma list of train,decode,grpo")
  p.add_argument("--timeout", type=_positive, default=420,
                 help="seconds allowed to each of the two child processes")
  p.add_argument("--workdir", help="keep the model folder and run here (default: a temporary "
                                   "directory, removed at the end)")
  p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
  args = p.parse_args(argv)
  if args.out and os.path.isdir(args.out):
    p.error(f"--out {args.out} is a directory; give a file name")
  return args


def resolve(args, shape: str) -> dict:
  """The run's settings: flags given, the rest from DEFAULTS[shape]."""
  out = dict(DEFAULTS[shape], shape=shape, decode_batch=args.decode_batch)
  for k in DEFAULTS[shape]:
    if getattr(args, k) is not None:
      out[k] = getattr(args, k)
  return out


def _hf_config(shape: str) -> dict:
  import make_random_model as mrm  # pylint: disable=import-outside-toplevel
  return mrm.hf_config("qwen2.5-0.5b", SHAPES[shape])


def _cpu_env() -> dict:
  """This environment with one host device (the CPU would otherwise split as XLA_FLAGS says)."""
  flags = [f for f in os.environ.get("XLA_FLAGS", "").split()
           if not f.startswith("--xla_force_host_platform_device_count")]
  return dict(os.environ, XLA_FLAGS=" ".join(flags + ["--xla_force_host_platform_device_count=1"]))


# ---------------------------------------------------------------- the child: measurements

def _emit(rec: dict) -> None:
  print(TAG + json.dumps(rec), flush=True)


def _say(text: str) -> None:
  print(f"[device_check] {text}", file=sys.stderr, flush=True)


def _best(fn, repeats: int) -> float:
  fn()
  return min(bc.median_time(fn, 1) for _ in range(repeats))


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
    matmul[dtype] = bc.matmul_flops(n) / _best(lambda: dot(a, b).block_until_ready(), 3)
    del a, b
  elems = (64 << 20) if platform == "cpu" else (256 << 20)  # 256 MiB / 1 GiB of float32
  x = jnp.zeros((elems,), jnp.float32)
  add = jax.jit(lambda x: x + 1)
  copy_bw = 2 * x.nbytes / _best(lambda: add(x).block_until_ready(), 5)
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
  from distflow_jax.workflow import roles
  return roles.levers(_run_cfg(), ModelConfig.from_hf_dict(_hf_config(shape), "bfloat16"))


def measure_train(s: dict) -> dict:
  """Median step time of the actor train step; FLOPs and MFU are filled in by the caller."""
  import jax
  import jax.numpy as jnp
  import numpy as np
  from flax import nnx

  from distflow_jax.models import Transformer, sharding
  from distflow_jax.train import steps
  from distflow_jax.workflow import roles

  run = _run_cfg()
  cfg = _model_cfg(s["shape"])
  b, p, r = s["train_batch"], s["prompt"], s["response"]
  mesh = sharding.make_mesh({"fsdp": 1, "tensor": 1}, jax.devices()[:1])
  model = roles.build_actor(cfg, mesh, "", 0)
  graphdef, params = nnx.split(model)
  del model
  tx = roles.optimizer(run, run.actor.optimizer, 100)
  opt_state = steps.init_opt_state(tx, params)
  loss_cfg = steps.ActorLoss.from_config(run.actor, r, group_size=1)
  loss = lambda g, w, mb: steps.actor_loss(g, w, mb, loss_cfg, 512)  # noqa: E731  as the node
  step = steps.make_train_step(loss, graphdef, tx, 1, loss_cfg.loss_agg, 1)
  rs = np.random.RandomState(0)
  data = {
      "prompt_tokens": rs.randint(1, cfg.vocab_size, (b, p)).astype(np.int32),
      "prompt_mask": np.ones((b, p), bool),
      "response_tokens": rs.randint(1, cfg.vocab_size, (b, r)).astype(np.int32),
      "response_mask": np.ones((b, r), bool),
      "old_logprobs": rs.uniform(-7, -5, (b, r)).astype(np.float32),
      "ref_logprobs": rs.uniform(-7, -5, (b, r)).astype(np.float32),
      "advantages": rs.normal(size=(b, r)).astype(np.float32),
  }
  data = {k: jnp.asarray(v) for k, v in data.items()}
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


def child(args) -> int:
  import jax
  platform = jax.default_backend()
  shape = args.shape or ("small" if platform == "cpu" else "qwen0.5b")
  s = resolve(args, shape)
  _say(f"{jax.devices()[0].device_kind} ({platform}); shape {shape}: peak and bandwidth...")
  dev = measure_device(platform)
  _emit({"section": "device", "settings": s, "params": _model_cfg(shape).num_params, **dev})
  for name, fn in (("train", measure_train), ("decode", measure_decode)):
    if name in args.skip:
      continue
    _say(f"{name}...")
    try:
      rec = fn(s)
    except Exception as e:  # pylint: disable=broad-except  - reported in the table, not raised
      rec = {"error": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]}
    _emit({"section": name, **rec})
  return 0


# ---------------------------------------------------------------- the parent

def _tagged(text) -> dict:
  if isinstance(text, bytes):
    text = text.decode(errors="replace")
  out = {}
  for line in (text or "").splitlines():
    if line.startswith(TAG):
      rec = json.loads(line[len(TAG):])
      out[rec.pop("section")] = rec
  return out


def run_measurements(argv, timeout: int) -> tuple[dict, str]:
  """The child's records by section, and an error line ('' when it exited 0)."""
  cmd = [sys.executable, os.path.abspath(__file__), "--child", *argv]
  try:
    r = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, env=_cpu_env(), timeout=timeout,
                       check=False)
  except subprocess.TimeoutExpired as e:
    return _tagged(e.stdout), f"measurements: killed after {timeout} s"
  return _tagged(r.stdout), "" if r.returncode == 0 else f"measurements: exit {r.returncode}"


def run_grpo(s: dict, workdir: str, timeout: int) -> dict:
  """Two steps of `distflow-jax train` on a random model folder of the shape."""
  import make_random_model as mrm  # pylint: disable=import-outside-toplevel
  model_dir = os.path.join(workdir, "model")
  t0 = time.perf_counter()
  mrm.write(Path(model_dir), _hf_config(s["shape"]))
  write_s = time.perf_counter() - t0
  rows = s["grpo_prompts"] * s["grpo_n"]
  run_dir = os.path.join(workdir, "run")
  flags = [
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
      f"--config.run_dir={run_dir}", "--noresume"]
  cmd = [sys.executable, "-m", "distflow_jax.cli", "train", *flags]
  log_path = os.path.join(workdir, "train.log")
  t0 = time.perf_counter()
  with open(log_path, "w") as log:
    try:
      r = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=_cpu_env(),
                         timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
      return {"error": f"distflow-jax train killed after {timeout} s (log {log_path})"}
  wall = time.perf_counter() - t0
  if r.returncode:
    with open(log_path) as f:
      last = [line.strip() for line in f if line.strip()][-1:] or [""]
    return {"error": f"distflow-jax train exit {r.returncode}: {last[0][:200]}"}
  with open(os.path.join(run_dir, "metrics.jsonl")) as f:
    metrics = [json.loads(line) for line in f if line.strip()]
  metrics.sort(key=lambda m: m["step"])
  nodes = ("generate", "ref_logprob", "old_logprob", "train_actor")
  return dict(prompts=s["grpo_prompts"], n=s["grpo_n"], prompt_len=GRPO_PROMPT_LEN,
              new=s["grpo_new"], folder_write_s=write_s, process_wall_s=wall,
              step_s=[m["time/step"] for m in metrics],
              tokens=[m.get("tokens") for m in metrics],
              nodes_s=[{k: m.get(f"time/{k}") for k in nodes} for m in metrics],
              command="distflow-jax train " + " ".join(flags))


def _rate(x: float, unit: str) -> str:
  for scale, prefix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
    if x >= scale:
      return f"{x / scale:.3g} {prefix}{unit}"
  return f"{x:.3g} {unit}"


def fill(res: dict) -> None:
  """Adds the derived figures: FLOPs and MFU, the decode roofline and its share."""
  dev, s = res["device"], res["settings"]
  train = res.get("train", {})
  if "step_s" in train:
    shape = bc.Shape.of(_model_cfg_light(s["shape"]))
    flops = bc.train_flops(shape, train["rows"], train["prompt"], train["response"])
    train.update(flops=flops, achieved_flops=flops["total"] / train["step_s"])
    train["mfu"] = train["achieved_flops"] / dev["peak_flops"]
  dec = res.get("decode", {})
  if "tokens_per_s" in dec:
    dec["roofline_tokens_per_s"] = dec["batch"] * dev["peak_bw"] / dec["bytes_per_step"]
    dec["roofline_share"] = dec["tokens_per_s"] / dec["roofline_tokens_per_s"]


def _model_cfg_light(shape: str):
  """The shape's numbers for the FLOP count (no jax needed)."""
  d = _hf_config(shape)
  return bc.Shape(vocab_size=d["vocab_size"], hidden_size=d["hidden_size"],
                  intermediate_size=d["intermediate_size"], num_layers=d["num_hidden_layers"],
                  num_heads=d["num_attention_heads"], num_kv_heads=d["num_key_value_heads"],
                  head_dim=d["head_dim"])


def table(res: dict) -> list[str]:
  dev, s = res["device"], res["settings"]
  src = dev["peak_source"]
  rows = [("measure", "value", "against", "share")]
  for dtype, f in dev["matmul_flops"].items():
    rows.append((f"{dtype} matmul {dev['matmul_n']}^2 (measured)", _rate(f, "FLOP/s"),
                 f"peak {_rate(dev['peak_flops'], 'FLOP/s')} ({src})",
                 f"{f / dev['peak_flops']:.1%}"))
  rows.append((f"copy x + 1, {dev['copy_bytes'] / 2 ** 20:.0f} MiB moved (measured)",
               _rate(dev["copy_bw"], "B/s"), f"peak {_rate(dev['peak_bw'], 'B/s')} ({src})",
               f"{dev['copy_bw'] / dev['peak_bw']:.1%}"))
  t = res.get("train", {})
  label = (f"train step MFU, bf16, {s['train_batch']} x ({s['prompt']} + {s['response']}) "
           f"tokens")
  if "mfu" in t:
    rows.append((label, f"{_rate(t['achieved_flops'], 'FLOP/s')}, {t['step_s'] * 1e3:.1f} ms/step",
                 f"peak {_rate(dev['peak_flops'], 'FLOP/s')} ({src})", f"{t['mfu']:.1%}"))
  else:
    rows.append((label, t.get("error", "skipped"), "", ""))
  d = res.get("decode", {})
  label = (f"decode tok/s, batch {s['decode_batch']}, {s['decode_prompt']} + {s['decode_new']}"
           f" tokens")
  if "roofline_share" in d:
    mib = d["bytes_per_step"] / 2 ** 20
    rows.append((label, f"{d['tokens_per_s']:.0f} tok/s",
                 f"roofline {d['roofline_tokens_per_s']:.0f} tok/s "
                 f"({mib:.1f} MiB/step at {_rate(dev['peak_bw'], 'B/s')})",
                 f"{d['roofline_share']:.1%}"))
  else:
    rows.append((label, d.get("error", "skipped"), "", ""))
  g = res.get("grpo", {})
  about = (f"{s['grpo_prompts']} prompts x {s['grpo_n']}, <= {GRPO_PROMPT_LEN} + "
           f"{s['grpo_new']} tokens")
  if len(g.get("step_s", ())) >= 2:
    rows.append((f"GRPO step 1 (compiles), {about}", f"{g['step_s'][0]:.2f} s",
                 f"distflow-jax train, {g['process_wall_s']:.0f} s in all", ""))
    rows.append((f"GRPO step 2 (warm), {about}", f"{g['step_s'][1]:.2f} s", "", ""))
  else:
    rows.append((f"GRPO step, {about}", g.get("error", "skipped" if not g else
                                               f"{len(g['step_s'])} step(s) recorded"), "", ""))
  widths = [max(len(r[i]) for r in rows) for i in range(4)]
  fmt = lambda r: "| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |"  # noqa: E731
  return [fmt(rows[0]), "|" + "|".join("-" * (w + 2) for w in widths) + "|",
          *map(fmt, rows[1:])]


def main(argv=None) -> int:
  argv = sys.argv[1:] if argv is None else list(argv)
  args = _args(argv)
  if args.child:
    return child(args)
  t_start = time.perf_counter()
  res, err = run_measurements([a for a in argv if a != "--child"], args.timeout)
  errors = [err] if err else []
  if "device" not in res:
    print(f"device_check: the measurements reported nothing ({err or 'no output'})",
          file=sys.stderr)
    return 1
  dev = res["device"]
  res["settings"] = dev.pop("settings")
  s = res["settings"]
  if "grpo" not in args.skip:
    workdir = args.workdir or tempfile.mkdtemp(prefix="device_check_")
    os.makedirs(workdir, exist_ok=True)
    _say(f"GRPO: 2 steps of distflow-jax train in {workdir}...")
    try:
      res["grpo"] = run_grpo(s, workdir, args.timeout)
    finally:
      if not args.workdir:
        shutil.rmtree(workdir, ignore_errors=True)
  fill(res)
  for name in SECTIONS:
    if name not in args.skip and "error" in res.get(name, {"error": "not reported"}):
      errors.append(f"{name}: {res.get(name, {}).get('error', 'not reported')}")
  if "grpo" in res and "error" not in res["grpo"] and len(res["grpo"]["step_s"]) < 2:
    errors.append(f"grpo: {len(res['grpo']['step_s'])} step(s) in metrics.jsonl, 2 expected")
  res["errors"] = errors
  res["total_s"] = time.perf_counter() - t_start
  print(f"device_check: {dev['device_kind']} ({dev['platform']}, {dev['num_devices']} device(s),"
        f" using 1), jax {dev['jax']}; shape {s['shape']} "
        f"({dev['params'] / 1e6:.2f} M params), bf16")
  print("\n".join(table(res)))
  print(f"total {res['total_s']:.0f} s" + "".join(f"\nerror: {e}" for e in errors))
  if args.out:
    with open(args.out, "w") as f:
      json.dump(res, f, indent=2, sort_keys=True)
  return 1 if errors else 0


if __name__ == "__main__":
  sys.exit(main())
