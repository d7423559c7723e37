"""Decode speed of the rollout engine against the memory-bandwidth roofline, per batch size.

    python tools/bench_decode.py [--shape tiny|qwen2.5-0.5b|HF_DIR] [--batch 16,64,128]
        [--prompt 128] [--new 128] [--decode-steps 16] [--rounds 3] [--dtype float32]
        [--fuse none,gate_up,all] [--cpu-compute float32|model] [--no-tunix]
        [--tunix-venv DIR] [--json out.json]

For each batch size B (B slots, B prompts of --prompt random tokens, random weights, no
stop token, so every row decodes --new tokens; the first comes from the prefill):

* decode-only tokens/s (sampled at temperature 1): decoded tokens / wall time of the
  decode calls, prefill excluded; the median of --rounds rounds, every contender alternated within a round so that machine
  load hits them alike (``bc.alternate``), each row printed as soon as it is had;
* bytes per step: the parameters plus the keys and values a step must read (the prompt
  and, on average, half the response); the engine itself reads its whole cache, masked
  (`kv whole`), which the roofline does not credit;
* roofline share: tokens/s against B x bandwidth / bytes per step, with the bandwidth
  measured on the spot on a CPU (a jitted sum over a 512 MiB array) or the device table's
  (`models/target.py`) on a GPU;
* compile seconds of the decode program, its StableHLO ops, its compiled fusions,
  conditionals and `while` loops without a known trip count (each a host round trip per
  call or iteration on a GPU; `lowering.gate.compiled_counts`).

``--fuse`` (comma-separated ``rollout.fuse_projections`` values): each batch size once per
fusion of the engine's projections (models/fused.py), all alternated in one round.

Equal work, side by side with Tunix's sampler (google-tunix 0.1.7 in its own venv, made on
first use, about a minute and ~1.6 GB; tools/_tunix_side.py): both decode the batch's B
prompts greedily, --new tokens a row, and are timed over the whole generate, prefill
included: the engine's ``rollout.generate`` (an engine like the decode-only one, the first
--fuse value, but greedy, on the same parameters) and Tunix's ``Sampler`` call inside its
worker, on the same weights (exported with ``hf_io.save_pretrained``, loaded into Tunix's
qwen2 or llama3 model, same dtype), in the same rounds.  Printed per batch: both
tokens/s, the ratio engine / Tunix, and their greedy tokens' agreement (1.000: the same
work).  Tunix runs only where this process runs on the CPU (its venv has no accelerator)
and for qwen2 and llama shapes (no Llama 3 RoPE scaling; `_tunix_side.model_dict`); it is
skipped with a one-line note there, with --no-tunix, or when its venv cannot be made, and a
batch it cannot run gets one line; the engine's rows come all the same.  A folder's
weights are not read: every row decodes --new tokens, so the work does not depend on them.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _bench_common as bc  # noqa: E402
import _tunix_side as ts  # noqa: E402

SHAPES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "model_shapes")


class BadInput(ValueError):
  """A setting of this tool that cannot run (exit 2, one line)."""


def _args(argv):
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--shape", default="tiny",
                 help="tiny (the benches' 3 M model), a folder name under tools/model_shapes, "
                      "or a folder holding a Hugging Face config.json")
  p.add_argument("--batch", default="16,64,128", help="comma-separated batch sizes (slots)")
  p.add_argument("--prompt", type=int, default=128)
  p.add_argument("--new", type=int, default=128, help="tokens per row (the first: prefill)")
  p.add_argument("--decode-steps", type=int, default=16, help="tokens per decode call")
  p.add_argument("--rounds", type=int, default=3)
  p.add_argument("--dtype", default=None, help="float32 or bfloat16 (default: the shape's)")
  p.add_argument("--fuse", default="none",
                 help="comma-separated rollout.fuse_projections values: none, gate_up, all")
  p.add_argument("--no-tunix", action="store_true", help="skip Tunix's sampler")
  p.add_argument("--tunix-venv", default=bc.DEFAULT_TUNIX_VENV)
  p.add_argument("--json", default=None, help="write the rows here")
  p.add_argument("--cpu-compute", default="float32",
                 help="the engine's rollout.cpu_compute: float32 (a 16-bit model held and "
                      "computed in float32 on a CPU) or model (its own dtype)")
  a = p.parse_args(argv)
  from distflow_jax.rollout.engine.config import CpuCompute, FuseProjections
  if a.cpu_compute not in [c.value for c in CpuCompute]:
    raise BadInput(f"--cpu-compute={a.cpu_compute!r}: valid are "
                   f"{[c.value for c in CpuCompute]}")
  valid = [f.value for f in FuseProjections]
  a.fusions = [x.strip() for x in a.fuse.split(",") if x.strip()]
  if not a.fusions or any(f not in valid for f in a.fusions):
    raise BadInput(f"--fuse={a.fuse!r}: give comma-separated values of {valid}")
  try:
    a.batches = [int(x) for x in a.batch.split(",") if x.strip()]
  except ValueError:
    raise BadInput(f"--batch={a.batch!r}: give comma-separated positive ints, e.g. 16,64")
  for name, v in (("--prompt", a.prompt), ("--new", a.new), ("--decode-steps", a.decode_steps),
                  ("--rounds", a.rounds)):
    if v <= 0:
      raise BadInput(f"{name}={v} must be a positive int")
  if a.new < 2:
    raise BadInput(f"--new={a.new}: at least 2 (the first token comes from the prefill)")
  if not a.batches or min(a.batches) <= 0:
    raise BadInput(f"--batch={a.batch!r}: give comma-separated positive ints, e.g. 16,64")
  if a.dtype not in (None, "float32", "bfloat16"):
    raise BadInput(f"--dtype={a.dtype!r}: valid are float32, bfloat16")
  return a


def model_config(shape: str, dtype: str | None):
  """The ModelConfig of ``shape`` (see --shape) in ``dtype``."""
  from distflow_jax.models import ModelConfig
  if shape == "tiny":
    return ModelConfig(**bc.BENCH_MODEL, dtype=dtype or "float32")
  folder = shape if os.path.isdir(shape) else os.path.join(SHAPES, shape)
  path = os.path.join(folder, "config.json")
  if not os.path.isfile(path):
    valid = ", ".join(["tiny"] + sorted(os.listdir(SHAPES)))
    raise BadInput(f"--shape={shape!r}: no {path}; valid: {valid}, or a folder with a "
                   "config.json")
  with open(path) as f:
    hf = json.load(f)
  return ModelConfig.from_hf_dict(hf, dtype or hf.get("torch_dtype", "float32"))


def measured_bandwidth() -> tuple[float, str]:
  """Bytes/s: the device table's on a GPU, else a jitted sum over 512 MiB measured now."""
  import jax
  import jax.numpy as jnp

  from distflow_jax.models import target
  dev = jax.devices()[0]
  if dev.platform != "cpu":
    table = target.memory_bandwidth(dev.device_kind)
    if table:
      return table, f"{dev.device_kind}: table"
  x = jnp.ones((128 * 2 ** 20,), jnp.float32)
  total = jax.jit(jnp.sum)
  total(x).block_until_ready()
  secs = bc.median_time(lambda: total(x).block_until_ready(), 5)
  return x.nbytes / secs, f"{dev.platform}: measured (sum over 512 MiB)"


def program_counts(engine, params) -> dict:
  """Compile seconds and op counts of the engine's decode program."""
  import jax

  from distflow_jax.lowering.gate import compiled_counts, hlo_counts
  sig = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
                     params)
  decodes = [p for p in engine.programs(sig) if p.name.startswith("decode")]
  prog = decodes[-1]  # the full-size capacity's
  t0 = time.perf_counter()
  lowered = prog.fn.lower(*prog.args)
  lower_s = time.perf_counter() - t0
  ops, cases, whiles = hlo_counts(lowered.as_text())
  t0 = time.perf_counter()
  text = lowered.compile().as_text()
  compile_s = time.perf_counter() - t0
  conditionals, _, unknown = compiled_counts(text)
  fusions = sum(1 for line in text.splitlines() if " fusion(" in line)
  return dict(decode_programs=len(decodes), lower_s=lower_s, compile_s=compile_s,
              stablehlo_ops=ops, cases=cases, whiles=whiles, fusions=fusions,
              conditionals=conditionals, data_dependent_whiles=unknown)


def make_engine(cfg, batch: int, a, fuse: str, temperature: float):
  """A one-device engine of ``batch`` slots for --prompt + --new tokens."""
  import jax

  from distflow_jax.rollout import Engine, EngineConfig, SamplingParams, replica_mesh
  return Engine(cfg, EngineConfig(
      max_concurrent_decodes=batch, prefill_buckets=(a.prompt,), max_new_tokens=a.new,
      sampling=SamplingParams(temperature), decode_steps=a.decode_steps,
      fuse_projections=fuse, cpu_compute=a.cpu_compute),
      mesh=replica_mesh(1, jax.devices()[:1]))


class Contender:
  """One batch size: its engine (sampling at temperature 1), parameters (``model``'s, else
  random from seed 0) and prompts, and one timed decode round."""

  def __init__(self, cfg, batch: int, a, fuse: str = "none", model=None):
    self.batch, self.cfg = batch, cfg
    self.engine = make_engine(cfg, batch, a, fuse, 1.0)
    self.params = self.engine.load_params(model, seed=0)
    self.prompts = np.random.RandomState(batch).randint(
        1, cfg.vocab_size, (batch, a.prompt)).tolist()

  def round(self) -> bc.Measured:
    """Prefill every slot (untimed), then decode until no row is active (timed)."""
    import jax
    eng, b = self.engine, self.batch
    state = eng.init_decode_state()
    keys = np.asarray(eng.new_request_keys(b))
    state, tok, _, _ = eng.prefill_insert(self.params, state, self.prompts, list(range(b)),
                                          list(range(b)), keys)
    jax.block_until_ready((state, tok))
    tokens, t0 = 0, time.perf_counter()
    while True:
      state, out = eng.generate_steps(self.params, state)
      out = jax.device_get(out)
      tokens += int(np.asarray(out.valid_BxK).sum())
      if not np.asarray(out.active_B).any():
        return bc.Measured(tokens, time.perf_counter() - t0)


class Generate:
  """A contender's whole generate, greedy: its prompts and parameters on a greedy engine of
  its shape; one call is prefill + decode of every row (timed whole, as Tunix's sampler)."""

  def __init__(self, c: Contender, a):
    self.batch, self.params, self.prompts = c.batch, c.params, c.prompts
    self.engine = make_engine(c.cfg, c.batch, a, c.engine.config.fuse_projections.value, 0.0)

  def round(self) -> np.ndarray:
    from distflow_jax.rollout import generate
    return np.asarray(generate(self.engine, self.params, self.prompts).tokens_RxN)


def step_bytes(cfg, params, batch: int, prompt: int, new: int) -> dict:
  """Bytes a decode step reads at the least (parameters + the live keys and values, the
  response half written on average), and the whole cache the engine reads."""
  import jax
  param_bytes = sum(x.nbytes for x in jax.tree.leaves(params))
  per_slot = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * np.dtype(
      cfg.jnp_dtype).itemsize
  return dict(param_bytes=param_bytes, kv_bytes=per_slot * batch * (prompt + new / 2),
              kv_whole_bytes=per_slot * batch * (prompt + new))


def tunix_model(cfg, a):
  """(Tunix's python, the model both sides load, "") where Tunix's sampler can run here,
  else (None, None, the one-line note why not)."""
  import jax
  platform = jax.devices()[0].platform
  if not a.no_tunix:  # checked before the venv is made: no 1.6 GB for nothing
    if platform != "cpu":
      return None, None, (f"Tunix's sampler skipped: its venv runs on the CPU, the engine "
                          f"here on {platform}, not the same device")
    try:
      ts.model_dict(cfg)
    except ValueError as e:
      return None, None, f"Tunix's sampler skipped: {e}"
  py, note = ts.tunix_python(a.no_tunix, a.tunix_venv)
  if py is None:
    return None, None, note
  from flax import nnx

  from distflow_jax.models import Transformer
  return py, Transformer(cfg, rngs=nnx.Rngs(0)), ""


class TunixRounds:
  """Tunix's sampler over the batch sizes' prompt sets: a batch it cannot run (or every
  batch, once its worker has died) is noted in one line and left out from then on."""

  def __init__(self, sampler):
    self.sampler, self.failed = sampler, {}

  def call(self, b: int) -> bc.Measured:
    try:
      return self.sampler.run(b)
    except ts.SamplerError as e:
      self.fail([b], f"Tunix's sampler cannot run batch {b}: {e}")
    except (RuntimeError, OSError) as e:  # the worker is gone: no batch runs any more
      self.fail([k for k in self.sampler.keys if k not in self.failed],
                f"Tunix's sampler stopped: {ts.one_line(e)}")
    return bc.Measured(None, float("nan"))

  def fail(self, batches, note: str) -> None:
    print(f"# {note}", flush=True)
    self.failed.update(dict.fromkeys(batches, note))


def run(a) -> list[dict]:
  cfg = model_config(a.shape, a.dtype)
  bw, bw_note = measured_bandwidth()
  print(f"# {bc.load_line()}", flush=True)
  print(f"# shape {a.shape} ({cfg.dtype}; engine cpu_compute={a.cpu_compute}), prompt "
        f"{a.prompt}, new {a.new}, decode_steps {a.decode_steps}, rounds {a.rounds}; "
        f"bandwidth {bw / 1e9:.1f} GB/s ({bw_note})",
        flush=True)
  tunix_py, model, tunix_note = tunix_model(cfg, a)
  if tunix_note:
    print(f"# {tunix_note}", flush=True)
  # One contender per batch size (and fusion, where --fuse names several): "16", "16/all".
  label = (lambda b, f: str(b)) if len(a.fusions) == 1 else (lambda b, f: f"{b}/{f}")
  contenders = {label(b, f): Contender(cfg, b, a, f, model) for b in a.batches
                for f in a.fusions}
  gens = {b: Generate(contenders[label(b, a.fusions[0])], a) for b in a.batches}
  rows = {}
  table = bc.Table(bc.Col("batch", 11), bc.Col("compile s", 9), bc.Col("hlo ops", 7),
                   bc.Col("fusions", 7), bc.Col("cond", 4), bc.Col("dd while", 8),
                   bc.Col("MB/step", 8), bc.Col("kv whole MB", 11))
  for b, c in contenders.items():
    counts = program_counts(c.engine, c.params)
    sizes = step_bytes(cfg.replace(dtype=c.engine.compute_dtype), c.params, c.batch, a.prompt,
                       a.new)
    rows[b] = dict(batch=c.batch, fuse=c.engine.config.fuse_projections.value, **counts,
                   **sizes, bandwidth=bw, bandwidth_source=bw_note)
    table.row(b, f"{counts['compile_s']:.2f}", counts["stablehlo_ops"], counts["fusions"],
              counts["conditionals"], counts["data_dependent_whiles"],
              f"{(sizes['param_bytes'] + sizes['kv_bytes']) / 1e6:.1f}",
              f"{sizes['kv_whole_bytes'] / 1e6:.1f}")
  tunix, model_dir = None, None
  if model is not None:
    from distflow_jax.models import hf_io
    tmp = tempfile.mkdtemp(prefix="bench_decode_")
    model_dir = os.path.join(tmp, "model")
    hf_io.save_pretrained(model_dir, model)
    del model  # the engines hold their own placed copies
    tunix = ts.Sampler(tunix_py, model_dir, ts.model_dict(cfg),
                       {b: g.prompts for b, g in gens.items()}, a.new, tmp)
  try:
    return measure(a, cfg, bw, contenders, gens, rows, label, tunix, tunix_note)
  finally:
    if tunix is not None:
      tunix.close()
      shutil.rmtree(model_dir, ignore_errors=True)  # the worker's log stays


def measure(a, cfg, bw, contenders, gens, rows, label, tunix, tunix_note) -> list[dict]:
  """The rounds: decode-only per contender, then the equal-work side by side."""
  tunix_rounds = None
  if tunix is not None:
    try:
      tunix_note = tunix.ready()
      print(f"# {tunix_note}", flush=True)
      tunix_rounds = TunixRounds(tunix)
    except RuntimeError as e:
      tunix_note = f"Tunix's sampler skipped: {ts.one_line(e)}"
      print(f"# {tunix_note}", flush=True)
  for c in contenders.values():
    c.round()  # compiles prefill and insert, warms the decode program
  agree = {}
  for b, g in gens.items():  # warm-up (compiles), and the tokens the two sides agree on
    engine_tokens = g.round()
    if tunix_rounds is not None and b not in tunix_rounds.failed:
      tokens = tunix_rounds.call(b).value
      if tokens is not None:
        agree[b] = ts.agreement(tokens, engine_tokens)
        print(f"# batch {b}: Tunix's sampler vs the engine's generate, greedy, token for "
              f"token: {agree[b][0]:.3f} of tokens, {agree[b][1]}/{b} rows equal", flush=True)
  runs = {(b, "engine decode-only"): c.round for b, c in contenders.items()}
  for b, g in gens.items():
    runs[(label(b, a.fusions[0]), "engine generate")] = g.round
    if tunix_rounds is not None:
      runs[(label(b, a.fusions[0]), "Tunix generate")] = (
          lambda b=b: tunix_rounds.call(b))
  first_label = {label(b, a.fusions[0]): b for b in a.batches}
  speed = bc.Table(bc.Col("round", 5), bc.Col("batch", 11), bc.Col("what", 18, "<"),
                   bc.Col("tok/s", 10), bc.Col("roofline tok/s", 14), bc.Col("share", 7))
  tokens = {name: [] for name in runs}

  def on_time(i, name, secs, value):
    b, what = name
    if what == "engine decode-only":
      r = rows[b]
      roof = r["batch"] * bw / (r["param_bytes"] + r["kv_bytes"])
      tokens[name].append(value / secs)
      speed.row(i, b, what, f"{value / secs:,.0f}", f"{roof:,.0f}", f"{value / secs / roof:.1%}")
    elif secs == secs:  # not NaN: a Tunix call that failed is left out
      rate = first_label[b] * a.new / secs
      tokens[name].append(rate)
      speed.row(i, b, what, f"{rate:,.0f}")
  failed = tunix_rounds.failed if tunix_rounds is not None else {}
  bc.alternate(runs, a.rounds, rotate=True, on_time=on_time,
               skip=lambda i, name: name[1] == "Tunix generate" and first_label[name[0]]
               in failed)
  first = next(iter(contenders))
  print("# medians", flush=True)
  summary = bc.Table(bc.Col("batch", 11), bc.Col("decode-only tok/s", 17),
                     bc.Col(f"x batch {first}", 10), bc.Col("roofline share", 14))
  base = statistics.median(tokens[(first, "engine decode-only")])
  for b, r in rows.items():
    r["tokens_per_s_rounds"] = tokens[(b, "engine decode-only")]
    r["tokens_per_s"] = statistics.median(r["tokens_per_s_rounds"])
    r["roofline_tokens_per_s"] = r["batch"] * bw / (r["param_bytes"] + r["kv_bytes"])
    r["roofline_share"] = r["tokens_per_s"] / r["roofline_tokens_per_s"]
    summary.row(b, f"{r['tokens_per_s']:,.0f}", f"{r['tokens_per_s'] / base:.2f}",
                f"{r['roofline_share']:.1%}")
  equal_work(a, rows, tokens, first_label, agree, failed, tunix_note)
  print(f"# {bc.load_line()}", flush=True)
  return list(rows.values())


def equal_work(a, rows, tokens, first_label, agree, failed, tunix_note) -> None:
  """The side-by-side table (and the rows' JSON fields): the engine's whole generate and
  Tunix's sampler call, both prefill + decode of the same prompts and tokens."""
  print(f"# equal work: B prompts of {a.prompt} tokens, {a.new} new tokens a row, greedy, the "
        f"whole generate timed (prefill included); medians", flush=True)
  table = bc.Table(bc.Col("batch", 11), bc.Col("engine tok/s", 12), bc.Col("Tunix tok/s", 11),
                   bc.Col("engine/Tunix", 12), bc.Col("tokens equal", 12),
                   bc.Col("rows equal", 10))
  for lab, b in first_label.items():
    r = rows[lab]
    r["generate_tokens_per_s_rounds"] = tokens[(lab, "engine generate")]
    r["generate_tokens_per_s"] = statistics.median(r["generate_tokens_per_s_rounds"])
    tunix = tokens.get((lab, "Tunix generate"), [])
    r["tunix_tokens_per_s_rounds"] = tunix
    r["tunix_note"] = failed.get(b) or (tunix_note if not tunix else "")
    if b in agree:
      r["tunix_token_agreement"], r["tunix_rows_equal"] = agree[b]
    if not tunix or b in failed:
      table.row(lab, f"{r['generate_tokens_per_s']:,.0f}",
                bc.Span(failed.get(b, "Tunix not run"), 4))
      continue
    r["tunix_tokens_per_s"] = statistics.median(tunix)
    r["engine_over_tunix"] = r["generate_tokens_per_s"] / r["tunix_tokens_per_s"]
    frac, equal = agree.get(b, (float("nan"), 0))
    table.row(lab, f"{r['generate_tokens_per_s']:,.0f}", f"{r['tunix_tokens_per_s']:,.0f}",
              f"{r['engine_over_tunix']:.2f}x", f"{frac:.3f}", f"{equal}/{b}")


def main(argv=None) -> int:
  bc.flush_lines()
  try:
    a = _args(argv)
    rows = run(a)
  except BadInput as e:
    print(f"bench_decode: {e}", file=sys.stderr)
    return 2
  if a.json:
    bc.write_json(a.json, rows, indent=1)
  return 0


if __name__ == "__main__":
  sys.exit(main())
