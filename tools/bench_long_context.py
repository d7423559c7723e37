"""Long-context benchmarks (issue 19 item 4): packing vs padding, memory vs length, and the
re-partition cost of distributed vs centralized modes as the context grows.

    python tools/bench_long_context.py [--part packing|memory|redistribute|all] [--repeats 3]
        [--max-lengths 1024,4096] [--with-16k] [--samples 8] [--prompt 16]
        [--micro-batch-size 0] [--attention-impl auto] [--mem-limit-gib 0] [--compile-only]
        [--lengths 1024,2048,4096,8192,16384] [--impls auto,xla,...] [--own-memory]
        [--tokens 1024,2048,4096,8192,16384,32768] [--procs 4] [--rows-per-host 64]
        [--json out.json]

(a) ``--part packing``: the tiny built-in model (``model.preset=tiny``, vocab of the built-in
tokenizer), one GRPO actor train step (``train/steps.make_train_step`` with the actor loss:
clipped ratio + k3 KL, adamw, grad clipping, as bench_train) and the old-logprob pass
(``steps.response_logprobs``), on a batch of ``--samples`` rows with ``--prompt``-token
prompts and response lengths drawn (fixed seed) from a lognormal (sigma 1) scaled so the
mean is max/4 and clipped to [1, max]; the realised mean/max is printed.  The two sides run
the same rows from the same parameters; all that differs is the layout: *padded* runs
``[B, P + max - 1]`` (every response right-padded to the maximum, as the rollout hands it
over), *packed* runs the real tokens only, packed first-fit into rows of the same length
(``{"pack": packing.plan_parts(...)}``, as nodes/training.py does with
``model.pack_sequences=True``).  Each side is compiled once ahead of time
(``jit(...).lower(...).compile()``), then stepped once (its loss compared with the other
side's: no ratio is printed when they differ by more than 1e-4), then timed ``--repeats``
times, the sides alternated, with a compile counter checking nothing compiles while timed.
Reported: useful tokens (``PackStats.useful``: prompt + response - 1 per sample, the tokens
that predict something; the same count on both sides) per second of step time (median,
range), the packed/padded ratio, and the memory of each compiled program: ``temp +
argument bytes`` of XLA's ``memory_analysis()`` (buffers live during the program plus its
inputs; outputs are written over the donated parameters and optimizer state, so they add
only the few stats scalars).  A side whose compiled memory is over ``--mem-limit-gib``
(default: half this machine's MemAvailable) is not run: its row reads "does not fit
(N GiB)"; ``--compile-only`` compiles and prints the memory of both sides and runs
nothing.  The max-16K row is left out unless ``--with-16k``.  Both sides take the same
``--micro-batch-size`` (micro-batches accumulated in the step's scan; the packed side packs
each micro-batch's samples into its own rows, as the train node does) and the same
``--attention-impl`` (``auto`` resolves per shape, so at long rows it may pick a different
kernel than at short ones; name one to pin it).  The log-prob pass runs over the whole
batch (one plan), as the logprob node does.

(b) ``--part memory``: compiled memory of one actor train step on one row of L tokens (16
prompt + L - 16 response, so padded == packed) for L in ``--lengths``, for each
``model.attention_impl`` in ``models.config.ATTENTION_IMPLS`` (read at run time).  If
``tools/long_context_step.py`` defines ``train_step_memory(length, attention_impl)``, its
numbers are used (called with ``steps=0``: compile only) unless ``--own-memory``; else this
script compiles the step on abstract shapes (nothing allocated).  The number is XLA's
``temp_size_in_bytes`` (buffers live during the step; the inputs, mostly parameters and
optimizer state, add a near-constant amount), printed per length with its growth factor per
doubling of L (linear ~2x, quadratic ~4x).  An impl this backend lacks (cudnn on CPU) reads
n/a with its error.

(c) ``--part redistribute``: the DistFlow paper's Figure 8 on this machine: for each
``--tokens`` (tokens per sample) one run of tools/bench_redistribute.py (its own main and
child processes, ``--procs`` processes x 2 CPU devices, ``--rows-per-host`` samples each),
printing distributed vs centralized milliseconds per re-partition (median over its
iterations, slowest process), their ratio, and the peak RSS of the heaviest process times
the process count (an upper bound of the total).

Every subprocess has a SIGKILL deadline.  The load average and date are printed at the
start and the end.
"""

from __future__ import annotations

import argparse
import importlib
import os
import statistics
import sys
import tempfile

TOOLS = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, TOOLS)

import _bench_common as bc  # noqa: E402

LOSS_TOL = 1e-4
GiB = 2 ** 30


def _args(argv):
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                              formatter_class=argparse.RawDescriptionHelpFormatter,
                              epilog="See the module docstring for what each part measures.")
  p.add_argument("--part", choices=["packing", "memory", "redistribute", "all"], default="all")
  p.add_argument("--repeats", type=int, default=3, help="timed steps per side (alternated)")
  p.add_argument("--json", help="also write every row here")
  g = p.add_argument_group("(a) packing vs padding")
  g.add_argument("--max-lengths", default="1024,4096",
                 help="response maxima (rollout.max_new_tokens), comma-separated")
  g.add_argument("--with-16k", action="store_true", help="add the 16384 maximum")
  g.add_argument("--samples", type=int, default=8, help="rows in the batch")
  g.add_argument("--prompt", type=int, default=16, help="prompt tokens per row")
  g.add_argument("--seed", type=int, default=0)
  g.add_argument("--micro-batch-size", type=int, default=0,
                 help="rows per micro-batch (actor.micro_batch_size), both sides; 0 = whole")
  g.add_argument("--attention-impl", default="auto",
                 help="model.attention_impl of both sides (see models.config.ATTENTION_IMPLS)")
  g.add_argument("--compile-only", action="store_true",
                 help="compile both sides and print their memory; run nothing")
  g.add_argument("--mem-limit-gib", type=float, default=0.0,
                 help="run a side only if its compiled memory is under this; 0 = half of "
                      "MemAvailable")
  g = p.add_argument_group("(b) memory vs length")
  g.add_argument("--lengths", default="1024,2048,4096,8192,16384")
  g.add_argument("--impls", default="",
                 help="attention impls (default: every one in ATTENTION_IMPLS)")
  g.add_argument("--own-memory", action="store_true",
                 help="compute the memory here even if tools/long_context_step.py exists")
  g = p.add_argument_group("(c) re-partition cost vs context (bench_redistribute)")
  g.add_argument("--tokens", default="1024,2048,4096,8192,16384,32768",
                 help="tokens per sample")
  g.add_argument("--procs", type=int, default=4)
  g.add_argument("--devices-per-process", type=int, default=2)
  g.add_argument("--rows-per-host", type=int, default=64)
  g.add_argument("--iters", type=int, default=5, help="re-partitions timed per run")
  g.add_argument("--timeout-s", type=float, default=300,
                 help="SIGKILL deadline of each bench_redistribute launch")
  return p.parse_args(argv)


def _ints(text: str) -> list[int]:
  return [int(x) for x in text.split(",") if x.strip()]


# ---------------------------------------------------------------- (a) packing vs padding

def long_tailed_lengths(n: int, max_len: int, seed: int, sigma: float = 1.0):
  """``n`` response lengths in [1, max_len]: lognormal(0, sigma) draws, scaled so that the
  clipped lengths' mean is about max_len / 4 (the scale re-fitted a few times, since
  clipping at max_len lowers the mean)."""
  import numpy as np
  draws = np.random.default_rng(seed).lognormal(0.0, sigma, n)
  target, scale = max_len / 4, max_len / 4 / draws.mean()
  for _ in range(20):
    lengths = np.clip(np.round(draws * scale), 1, max_len).astype(np.int64)
    scale *= target / lengths.mean()
  return lengths


def tiny_config(max_tokens: int, attention_impl: str = "auto"):
  """``model.preset=tiny`` for the built-in tokenizer, positions up to ``max_tokens``."""
  from distflow_jax.models.config import preset
  from distflow_jax.models.tokenizer import Tokenizer
  cfg = preset("tiny", Tokenizer.builtin().vocab_size)
  return cfg.replace(max_position_embeddings=max(cfg.max_position_embeddings, max_tokens),
                     attention_impl=attention_impl)


def grpo_batch(vocab: int, lengths_B, prompt_len: int, max_new: int, seed: int) -> dict:
  """A GRPO actor batch (numpy): full prompts, responses of ``lengths_B`` tokens
  right-padded to ``max_new``, old / reference log-probs and advantages on every slot."""
  import numpy as np
  rs = np.random.RandomState(seed)
  b = len(lengths_B)
  resp_mask_BxN = np.arange(max_new)[None, :] < np.asarray(lengths_B)[:, None]
  return {
      "prompt_tokens": rs.randint(1, vocab, (b, prompt_len)).astype(np.int32),
      "prompt_mask": np.ones((b, prompt_len), bool),
      "response_tokens": (rs.randint(1, vocab, (b, max_new)) * resp_mask_BxN).astype(np.int32),
      "response_mask": resp_mask_BxN,
      "old_logprobs": rs.uniform(-6, -4, (b, max_new)).astype(np.float32),
      "ref_logprobs": rs.uniform(-6, -4, (b, max_new)).astype(np.float32),
      "advantages": np.repeat(rs.normal(size=(b, 1)), max_new, axis=1).astype(np.float32),
  }


def build_actor(cfg, seed: int, num_micro: int = 1):
  """``(train step, logprob fn, graphdef, params, tx)`` of the actor on one device, as
  bench_train builds it (the train_actor node's step, ``num_micro`` micro-batches)."""
  from distflow_jax.train import steps
  graphdef, params = bc.sharded_actor(cfg, seed)
  tx = bc.bench_tx()
  step = bc.actor_step(graphdef, tx, num_micro)
  logprob = lambda p, b: steps.response_logprobs(graphdef, p, b)[0]  # noqa: E731
  return step, logprob, graphdef, params, tx


def compiled_bytes(compiled) -> int:
  """``temp + argument`` bytes of a compiled program's ``memory_analysis()``."""
  m = compiled.memory_analysis()
  return int(m.temp_size_in_bytes) + int(m.argument_size_in_bytes)


def copy_tree(tree):
  import jax
  import jax.numpy as jnp
  return jax.tree.map(lambda x: jnp.array(x, copy=True), tree)


class Side:
  """One contender of a packing row: its batch, compiled step and pass, and own state."""

  def __init__(self, name: str, step, logprob, params, tx, batch: dict, pass_batch: dict):
    import jax

    from distflow_jax.train import placement
    self.name, self.batch, self.pass_batch = name, batch, pass_batch
    self.params = copy_tree(params)
    self.opt_state = placement.init_opt_state(tx, self.params)
    self.step = step.jitted_for(self.params, self.opt_state).lower(
        self.params, self.opt_state, batch).compile()
    self.logprob = jax.jit(logprob).lower(params, pass_batch).compile()
    self.step_bytes = compiled_bytes(self.step)
    self.logprob_bytes = compiled_bytes(self.logprob)

  def run_step(self) -> dict:
    import jax
    self.params, self.opt_state, stats = self.step(self.params, self.opt_state, self.batch)
    return jax.device_get(stats)

  def run_logprob(self, params):
    import jax
    return jax.block_until_ready(self.logprob(params, self.pass_batch))


def ratio_if_equal(abs_diff: float, rate_a: float, rate_b: float,
                   tol: float = LOSS_TOL) -> float | None:
  """``rate_b / rate_a`` when the two sides' results differ by at most ``tol`` (equal work),
  else None: a speed-up of a different computation is not reported (NaN differs too)."""
  if not abs_diff <= tol:
    return None
  return rate_b / rate_a


def packing_row(max_new: int, args, mem_limit: int, compiles: bc.CompileCount) -> dict:
  """Padded vs packed at one response maximum (see the module docstring, part (a))."""
  import jax.numpy as jnp
  import numpy as np

  from distflow_jax.train import packing, steps
  lengths_B = long_tailed_lengths(args.samples, max_new, args.seed)
  cfg = tiny_config(args.prompt + max_new, args.attention_impl)
  data = grpo_batch(cfg.vocab_size, lengths_B, args.prompt, max_new, args.seed)
  num_micro = args.samples // args.micro_batch_size if args.micro_batch_size else 1
  # The step takes one plan per micro-batch; the pass, over the whole batch, one plan.
  plan, stats = packing.plan_parts(data["prompt_mask"], data["response_mask"], 0, num_micro)
  pass_plan, _ = packing.plan(data["prompt_mask"], data["response_mask"])
  step, logprob, _, params, tx = build_actor(cfg, args.seed, num_micro)
  padded = {k: jnp.asarray(v) for k, v in data.items()}
  packed = {**padded, "pack": {k: jnp.asarray(v) for k, v in plan.items()}}
  packed_pass = {**padded, "pack": {k: jnp.asarray(v) for k, v in pass_plan.items()}}
  row = {"max_new_tokens": max_new, "samples": args.samples, "prompt": args.prompt,
         "micro_batches": num_micro, "attention_impl": args.attention_impl,
         "lengths": lengths_B.tolist(), "mean_len": float(lengths_B.mean()),
         "mean_over_max": float(lengths_B.mean()) / max_new,
         "useful_tokens": stats.useful, "padded_slots": stats.padded,
         "packed_slots": stats.packed,
         "packed_rows": int(plan["seg"].shape[0] * plan["seg"].shape[1]),
         "pack_len": int(plan["seg"].shape[2])}
  c0 = compiles.snapshot()
  sides = {"padded": Side("padded", step, logprob, params, tx, padded, padded),
           "packed": Side("packed", step, logprob, params, tx, packed, packed_pass)}
  row["compiles_ahead"] = compiles.snapshot()[0] - c0[0]
  for s in sides.values():
    row[f"{s.name}_step_bytes"] = s.step_bytes
    row[f"{s.name}_logprob_bytes"] = s.logprob_bytes
    row[f"{s.name}_fits"] = max(s.step_bytes, s.logprob_bytes) <= mem_limit
  runnable = [s for s in sides.values() if row[f"{s.name}_fits"] and not args.compile_only]
  losses, logps = {}, {}
  for s in runnable:  # one untimed call each, from the same parameters: equal work first
    logps[s.name] = np.asarray(s.run_logprob(params))
    losses[s.name] = steps.finalize_stats(s.run_step(), s.name)["loss"]
    row[f"{s.name}_loss"] = losses[s.name]
  if len(losses) == 2:
    row["loss_abs_diff"] = abs(losses["padded"] - losses["packed"])
    row["logprob_max_abs_diff"] = float(np.abs(logps["padded"] - logps["packed"]).max())
  c1 = compiles.snapshot()
  contenders = {}
  for s in runnable:  # alternated, so load drift hits both alike
    contenders[f"{s.name}_step_s"] = s.run_step
    contenders[f"{s.name}_logprob_s"] = lambda s=s: s.run_logprob(s.params)
  row.update(bc.alternate(contenders, args.repeats))
  row["compiles_while_timed"] = compiles.snapshot()[0] - c1[0]
  for s in runnable:
    row[f"{s.name}_tokens_per_s"] = stats.useful / statistics.median(row[f"{s.name}_step_s"])
    row[f"{s.name}_logprob_tokens_per_s"] = stats.useful / statistics.median(
        row[f"{s.name}_logprob_s"])
  if len(runnable) == 2:
    row["step_ratio"] = ratio_if_equal(row["loss_abs_diff"], row["padded_tokens_per_s"],
                                       row["packed_tokens_per_s"])
    row["logprob_ratio"] = ratio_if_equal(row["logprob_max_abs_diff"],
                                          row["padded_logprob_tokens_per_s"],
                                          row["packed_logprob_tokens_per_s"])
  return row


def _gib(x: float) -> str:
  return f"{x / GiB:.2f}"


def _times(xs: list[float]) -> str:
  return bc.spread(xs, 1e3, ".0f")


def _mib(x: float) -> str:
  return f"{x / 2 ** 20:.0f}"


def packing_table(repeats: int) -> bc.Table:
  print(f"\n(a) GRPO actor step and old-logprob pass, padded vs packed (same rows, same "
        f"parameters; only the layout differs): tok/s = useful tokens per second of the "
        f"median time over {repeats}; ms = median (range); MiB = XLA memory_analysis "
        f"temp + argument bytes of the compiled program")
  return bc.Table(bc.Col("max", 6), bc.Col("mean/max", 8, fmt=".3f"), bc.Col("useful", 7),
                  bc.Col("slots", 7), "|", bc.Col("side", 7, "<"), bc.Col("step ms", 18),
                  bc.Col("tok/s", 8, fmt=".0f"), bc.Col("pass ms", 18),
                  bc.Col("pass tok/s", 10, fmt=".0f"), bc.Col("step MiB", 8),
                  bc.Col("pass MiB", 8), bc.Col("loss", 10, fmt=".6f"), rule=True)


def print_packing(rows: list[dict], table: bc.Table) -> None:
  for r in rows:
    for name in ("padded", "packed"):
      lead = ((r["max_new_tokens"], r["mean_over_max"], r["useful_tokens"])
              if name == "padded" else ("", "", ""))
      lead += (r[f"{name}_slots"], name)
      mib = (_mib(r[f"{name}_step_bytes"]), _mib(r[f"{name}_logprob_bytes"]))
      if r["compile_only"]:
        table.row(*lead, bc.Span("not run (--compile-only)", 4), *mib)
      elif not r[f"{name}_fits"]:
        need = max(r[f"{name}_step_bytes"], r[f"{name}_logprob_bytes"])
        table.row(*lead, tail=f"does not fit ({_gib(need)} GiB compiled, over the "
                  f"{_gib(r['mem_limit'])} GiB limit): not run")
      else:
        table.row(*lead, _times(r[f"{name}_step_s"]), r[f"{name}_tokens_per_s"],
                  _times(r[f"{name}_logprob_s"]), r[f"{name}_logprob_tokens_per_s"], *mib,
                  r[f"{name}_loss"])
    if "step_ratio" not in r:
      table.note(f"{'':>6} packed/padded: not compared (a side did not run)")
    elif r["step_ratio"] is None:
      table.note(f"{'':>6} packed/padded: REFUSED, the sides computed different numbers (loss "
                 f"differs by {r['loss_abs_diff']:.2e}, log-probs by "
                 f"{r['logprob_max_abs_diff']:.2e}; tolerance {LOSS_TOL:g})")
    else:
      lp = "refused (log-probs differ)" if r["logprob_ratio"] is None else \
          f"{r['logprob_ratio']:.2f}x"
      table.note(f"{'':>6} packed/padded: step {r['step_ratio']:.2f}x tokens/s, pass {lp}, "
                 f"step memory {r['packed_step_bytes'] / r['padded_step_bytes']:.2f}x; loss "
                 f"diff {r['loss_abs_diff']:.1e}, log-prob diff "
                 f"{r['logprob_max_abs_diff']:.1e}; compiles while timed: "
                 f"{r['compiles_while_timed']}")
    table.note(f"{'':>6} lengths {r['lengths']}; {r['packed_rows']} packed rows of "
               f"{r['pack_len']} vs {r['samples']} padded rows; {r['micro_batches']} "
               f"micro-batch(es) per step; model.attention_impl={r['attention_impl']}")


def run_packing(args) -> list[dict]:
  compiles = bc.CompileCount()
  mem_limit = int(args.mem_limit_gib * GiB) or bc.mem_available_bytes() // 2
  maxima = _ints(args.max_lengths) + ([16384] if args.with_16k else [])
  table = packing_table(args.repeats)
  rows = []
  for max_new in maxima:
    row = packing_row(max_new, args, mem_limit, compiles)
    row["mem_limit"], row["compile_only"] = mem_limit, args.compile_only
    rows.append(row)
    print_packing([row], table)
  return rows


# ---------------------------------------------------------------- (b) memory vs length

def external_memory_fn():
  """``tools/long_context_step.train_step_memory`` if that module exists, else None; called
  with ``steps=0`` where it takes that (compile only: running the step at 16K on the
  quadratic impls would allocate what the memory analysis only counts)."""
  if not os.path.exists(os.path.join(TOOLS, "long_context_step.py")):
    return None
  fn = getattr(importlib.import_module("long_context_step"), "train_step_memory", None)
  if fn is None:
    return None
  import functools
  import inspect
  if "steps" in inspect.signature(fn).parameters:
    return functools.partial(fn, steps=0)
  return fn


def temp_bytes_of(rep) -> int:
  """The ``temp`` bytes (XLA's ``temp_size_in_bytes``) of a ``train_step_memory`` result,
  a dict or a ``StepMemory``-like object."""
  get = rep.get if isinstance(rep, dict) else lambda k, d=None: getattr(rep, k, d)
  for key in ("temp_bytes", "temp", "temp_size_in_bytes"):
    if get(key) is not None:
      return int(get(key))
  raise ValueError(f"train_step_memory gave {rep!r}: no temp bytes in it")


def own_train_step_memory(length: int, attention_impl: str, prompt: int = 16) -> dict:
  """``{temp_bytes, argument_bytes}`` of the actor train step compiled for one row of
  ``length`` tokens (``prompt`` + the rest response), on abstract shapes."""
  import jax

  from distflow_jax.memory import compiled as cm
  from distflow_jax.models import sharding
  cfg = tiny_config(length, attention_impl)
  mesh = sharding.make_mesh({"fsdp": 1, "tensor": 1}, jax.devices()[:1])
  graphdef, params = cm.abstract_model(cfg, mesh)
  tx = bc.bench_tx()
  opt = cm.abstract_opt_state(tx, params, mesh)
  batch = cm.abstract_batch(1, prompt, length - prompt,
                            jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()),
                            ("old_logprobs", "ref_logprobs", "advantages"))
  step = bc.actor_step(graphdef, tx)
  m = step.jitted_for(params, opt).lower(params, opt, batch).compile().memory_analysis()
  return {"temp_bytes": int(m.temp_size_in_bytes),
          "argument_bytes": int(m.argument_size_in_bytes)}


def growth_per_doubling(lengths: list[int], bytes_: list[int | None]) -> list[float | None]:
  """Per consecutive pair: (bytes ratio) ** (1 / log2(length ratio)), i.e. the factor per
  doubling of the length (None where a side is missing); 2 = linear, 4 = quadratic."""
  import math
  out = [None]
  for i in range(1, len(lengths)):
    a, b = bytes_[i - 1], bytes_[i]
    if not a or not b:
      out.append(None)
      continue
    out.append((b / a) ** (1.0 / math.log2(lengths[i] / lengths[i - 1])))
  return out


def run_memory(args) -> list[dict]:
  from distflow_jax.models.config import ATTENTION_IMPLS
  lengths = _ints(args.lengths)
  impls = [x for x in args.impls.split(",") if x] or list(ATTENTION_IMPLS)
  external = None if args.own_memory else external_memory_fn()
  source = ("tools/long_context_step.train_step_memory (compile only)" if external else
            "this script (abstract shapes, one row of L tokens, 16 of them prompt)")
  print(f"\n(b) actor train step memory vs length L: temp MiB = XLA memory_analysis "
        f"temp_size of the compiled step (buffers live during it, not its inputs: parameters, "
        f"optimizer state and batch add a near-constant amount); source: {source}; "
        f"x per doubling of L: 2 = linear, 4 = quadratic")
  rows = []
  for impl in impls:
    got: list[int | None] = []
    reports, errors = [], {}
    for length in lengths:
      try:
        rep = external(length, impl) if external else own_train_step_memory(length, impl)
        got.append(temp_bytes_of(rep))
        reports.append(rep if isinstance(rep, dict) else vars(rep))
      except Exception as e:  # noqa: BLE001 (an impl this backend lacks, e.g. cudnn on CPU)
        got.append(None)
        errors[length] = f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"
    growth = growth_per_doubling(lengths, got)
    rows.append({"attention_impl": impl, "lengths": lengths, "temp_bytes": got,
                 "growth_per_doubling": growth, "errors": errors, "source": source,
                 "reports": reports})
    cells = " ".join("n/a" if b is None else _mib(b) for b in got)
    print(f"{impl:<9} temp MiB at L={','.join(map(str, lengths))}: {cells}")
    print(f"{'':<9} x per doubling, L={lengths[0]}->{lengths[-1]}: " + " ".join(
        "n/a" if g is None else f"{g:.2f}x" for g in growth[1:]))
    for length, err in errors.items():
      print(f"{'':<9} L={length}: {err}")
  return rows


# ---------------------------------------------------------------- (c) re-partition vs context

def redistribute_row(tokens: int, args) -> dict:
  """One tools/bench_redistribute.py run at ``tokens`` per sample: both modes."""
  with tempfile.TemporaryDirectory() as tmp:
    out_json = os.path.join(tmp, "rd.json")
    cmd = [sys.executable, os.path.join(TOOLS, "bench_redistribute.py"),
           "--procs", str(args.procs), "--devices-per-process", str(args.devices_per_process),
           "--rows-per-host", str(args.rows_per_host), "--tokens", str(tokens),
           "--iters", str(args.iters), "--timeout-s", str(args.timeout_s), "--json", out_json]
    done = bc.run_with_deadline(cmd, 2 * args.timeout_s + 60)  # two launches, one per mode
    entries = bc.read_json(out_json) or []
  row = {"tokens": tokens, "procs": args.procs, "rows_per_host": args.rows_per_host,
         "rc": done.returncode, "wall_s": done.wall_s, "command": " ".join(cmd[1:])}
  for e in entries:
    row[f"{e['mode']}_ms"] = e["ms_per_op"]
    row[f"{e['mode']}_peak_rss_mib"] = e["peak_rss_mib"]
  if "distributed_ms" in row and "centralized_ms" in row:
    row["centralized_over_distributed"] = row["centralized_ms"] / row["distributed_ms"]
  else:
    row["error_tail"] = done.output[-2000:]
  return row


def run_redistribute(args) -> list[dict]:
  tokens = _ints(args.tokens)
  print(f"\n(c) re-partition per-host replica -> FSDP, tools/bench_redistribute.py at "
        f"{args.procs} processes x {args.devices_per_process} devices, {args.rows_per_host} "
        f"samples per process, 13 bytes per token; ms = median of {args.iters} "
        f"re-partitions, slowest process")
  table = bc.Table(bc.Col("tokens", 7), bc.Col("MiB/proc", 8, fmt=".1f"), "|",
                   bc.Col("distributed ms", 14, fmt=".1f"),
                   bc.Col("centralized ms", 14, fmt=".1f"), bc.Col("cent/dist", 9), "|",
                   bc.Col("peak RSS x procs GiB (dist, cent)", 34), rule=True)
  rows = []
  for t in tokens:
    r = redistribute_row(t, args)
    rows.append(r)
    mib = args.rows_per_host * t * 13 / 2 ** 20
    if "centralized_over_distributed" not in r:
      table.row(t, mib, bc.Span(f"FAILED (rc {r['rc']}):\n{r['error_tail']}", 1))
      continue
    rss = [r[f"{m}_peak_rss_mib"] * args.procs / 1024 for m in ("distributed", "centralized")]
    table.row(t, mib, r["distributed_ms"], r["centralized_ms"],
              f"{r['centralized_over_distributed']:.2f}x", f"{rss[0]:>16.2f} {rss[1]:>16.2f}")
  return rows


# ---------------------------------------------------------------- main

def main(argv=None) -> int:
  args = _args(argv)
  bc.default_host_devices(1)
  bc.flush_lines()
  import jax
  start = bc.load_line()
  print(f"start: {start}")
  print(f"jax {jax.__version__} on {jax.devices()[0].device_kind} "
        f"({jax.default_backend()}); argv: {' '.join(argv if argv is not None else sys.argv[1:])}")
  result = {"start": start, "argv": argv if argv is not None else sys.argv[1:]}
  rc = 0
  if args.part in ("packing", "all"):
    result["packing"] = run_packing(args)
    if any(r.get("step_ratio", 1.0) is None for r in result["packing"]):
      rc = 1  # packed and padded disagreed: a correctness failure, not a speed figure
  if args.part in ("memory", "all"):
    result["memory"] = run_memory(args)
  if args.part in ("redistribute", "all"):
    result["redistribute"] = run_redistribute(args)
    if any("centralized_over_distributed" not in r for r in result["redistribute"]):
      rc = rc or 2
  result["end"] = bc.load_line()
  print(f"\nend: {result['end']}")
  if args.json:
    bc.write_json(args.json, result, indent=1)
  return rc


if __name__ == "__main__":
  sys.exit(main())
