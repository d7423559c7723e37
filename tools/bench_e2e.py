"""GRPO step throughput: distflow-jax vs Tunix (google-tunix) on the same model and batch, CPU.

    python tools/bench_e2e.py [--prompts 8] [--n 4] [--prompt-len 32] [--new 32] [--steps 5]
                              [--devices 1] [--variants equal,share,lean,config] [--no-tunix]
                              [--count-compiles] [--tunix-venv DIR] [--model HF_DIR] [--chat]

Both sides train the same exported ~3 M-param Qwen2-shaped model (vocab 512, d 256, 4
layers, GQA 4:2; our `hf_io.save_pretrained` -> model.safetensors -> Tunix's
`qwen2.params.create_model_from_safe_tensors`), or with --model the HF folder given (its
weights and tokenizer: a real model such as `distflow-jax convert`'s SmolLM2-135M-Instruct,
which Tunix loads as its llama3 model; Llama without RoPE scaling, or Qwen2), with GRPO: 8
prompts x 4 samples (the same arithmetic prompts, 14-21 tokens), prompts of at most 32 tokens, 32 new tokens,
temperature 1, stop at EOS, KL to the reference (coef 0.001, so the reference pass runs on
both sides), one PPO epoch, adamw lr 1e-4 with global-norm clip 1.0, token-mean loss, one
optimizer update per step (ours accumulates micro-batches of grpo:tiny's
actor.micro_batch_size, 16 rows, in one jitted scan; Tunix takes the 32 rows at once).
Neither side uses a persistent compile cache: both compile from scratch.  Ours runs with
trainer.compile_ahead=always (what `train` does by default with its compile cache on):
its step 0 also compiles every other prompt width and prefill shape a later step can
meet, so no timed step compiles; that cost is in step 0, reported apart.

Tunix's work per step (google-tunix 0.1.7, read in its source): every prompt left-padded
to max_prompt_length (32; vanilla rollout passes it to the sampler), each of a group's n
rows carries its own copy of the prompt through the reference pass and the actor step,
and no old-log-prob pass: at num_iterations=1 `grpo_learner.py` sets
old_per_token_logps = None (it calls get_old_per_token_logps only when num_iterations > 1)
and the loss uses the current policy's (stop-gradient) log-probs.

Our side runs in variants, the headline first; each adds one of our savings to the one it
names (`--variants` picks and orders them):

  equal   Tunix's work: prompts padded to 32 (one prefill bucket, (32,)), no prompt
          sharing, no old_logprob pass.  The equal-work comparison.
  share   equal + prompt sharing (model.share_prompt_prefix=True): the reference pass and
          the actor step run each prompt once per group of n instead of once per row.
  lean    share + length buckets: each step pads its prompts to the smallest of 8/16/24/32
          that holds its longest (16 or 24 here) instead of 32.  What a user gets with the
          old_logprob pass dropped.
  config  lean + the old_logprob node of configs/grpo.py's DAG as shipped: one more
          forward than Tunix (the skipped old-log-prob pass is no saving over Tunix, which
          skips it too; this row shows what the shipped DAG pays for it).
  plain   equal + length buckets (no prompt sharing); not in the default list.
  whole   equal with all the step's rows in one micro-batch, as Tunix trains them, instead
          of the config's micro-batches (grpo:tiny: 16 rows); not in the default list.

The parent runs single steps in rotating order (equal, share, lean, config, Tunix; share,
lean, config, Tunix, equal; ...) so machine load hits all alike.  Step 0 (compiles) is
reported apart; of the timed steps after it the table gives the median and the MEAN wall
time (recompiles included) and the compiles counted in them (jax.monitoring's
backend-compile events in each worker), and tokens/s both ways: median of the per-step
rates, and all timed tokens / all timed seconds.  Tokens = prompt + response tokens,
padding excluded.  Ratios are ours / Tunix's tokens/s, median beside mean, and Tunix's
median step seconds / ours (`xTunix step`): the two sides sample their responses apart, so
their token counts differ a little on random weights and much on a real model, whose
responses end at EOS; the steps' padded shapes are the same on both sides at `equal`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _bench_common as bc  # noqa: E402
import _tunix_side as ts  # noqa: E402

TUNIX_SPEC = bc.TUNIX_SPEC
DEFAULT_VENV = bc.DEFAULT_TUNIX_VENV
ensure_tunix = bc.ensure_tunix


@dataclasses.dataclass(frozen=True)
class Variant:
  buckets: bool      # length buckets (8/16/24/...); else one prefill bucket = --prompt-len
  share: bool        # model.share_prompt_prefix
  old_logprob: bool  # the shipped DAG's old_logprob node
  what: str          # what differs from the variant it names
  whole: bool = False  # the whole step's rows in one micro-batch, as Tunix takes them


VARIANTS = {
    "equal": Variant(False, False, False,
                     "Tunix's work: prompts padded to --prompt-len, no prompt sharing, no "
                     "old_logprob pass"),
    "share": Variant(False, True, False, "equal + prompt sharing"),
    "lean": Variant(True, True, False, "share + length buckets"),
    "config": Variant(True, True, True, "lean + the shipped DAG's old_logprob pass"),
    "plain": Variant(True, False, False, "equal + length buckets"),
    "whole": Variant(False, False, False, "equal with the step's rows in one micro-batch (as "
                     "Tunix takes them) instead of the config's micro-batches", whole=True),
}
DEFAULT_VARIANTS = "equal,share,lean,config"


def _args(argv):
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--prompts", type=int, default=8, help="prompts per step")
  p.add_argument("--n", type=int, default=4, help="samples per prompt (group size)")
  p.add_argument("--prompt-len", type=int, default=32,
                 help="max prompt tokens (left-padded); Tunix's max_prompt_length")
  p.add_argument("--new", type=int, default=32, help="max new tokens")
  p.add_argument("--steps", type=int, default=5, help="timed steps per side (after 1 warm-up)")
  p.add_argument("--micro-batch-size", type=int, default=0,
                 help="our actor.micro_batch_size (rows per device per micro-batch); 0 = the "
                      "config's (grpo:tiny: 16)")
  p.add_argument("--devices", type=int, default=1, help="CPU devices for our side")
  p.add_argument("--variants", default=DEFAULT_VARIANTS,
                 help="our sides, in order: " + "; ".join(f"'{k}' = {v.what}"
                                                          for k, v in VARIANTS.items()))
  p.add_argument("--count-compiles", action="store_true",
                 help="also log our side's XLA compiles (JAX_LOG_COMPILES) and list them per "
                      "step")
  p.add_argument("--no-tunix", action="store_true")
  p.add_argument("--tunix-venv", default=DEFAULT_VENV)
  p.add_argument("--workdir", default="", help="default: a fresh temporary directory")
  p.add_argument("--model", default="",
                 help="an HF folder (config.json, model.safetensors, tokenizer.json) both sides "
                      "train instead of the ~3 M-param bench model; prompts go in as raw text "
                      "(no chat template, unless --chat) on both sides")
  p.add_argument("--chat", action="store_true",
                 help="render each prompt with the tokenizer's chat template first (both sides "
                      "read the rendered text): an instruct model then answers at length, "
                      "where a raw prompt mostly meets EOS within a few tokens")
  p.add_argument("--worker", choices=(*VARIANTS, "tunix"), help=argparse.SUPPRESS)
  p.add_argument("--inputs", help=argparse.SUPPRESS)
  return p.parse_args(argv)


def _buckets(prompt_len: int) -> tuple[int, ...]:
  """Our prompt-width buckets: each step pads prompts to the smallest one that holds the
  longest (length bucketing); Tunix pads every prompt to max_prompt_length."""
  return tuple(b for b in (8, 16, 24) if b < prompt_len) + (prompt_len,)


# ---------------------------------------------------------------- the parent

def write_inputs(workdir: str, args) -> dict:
  """Exports the bench model + tokenizer (or takes --model's folder) and writes the prompt
  file both sides read."""
  from flax import nnx

  from distflow_jax.models import ModelConfig, Transformer, hf_io
  from distflow_jax.models.tokenizer import Tokenizer
  from distflow_jax.tasks import arithmetic

  if args.model:
    model_dir = os.path.abspath(args.model)
    with open(os.path.join(model_dir, "config.json")) as f:
      cfg = ModelConfig.from_hf_dict(json.load(f))
    tok = Tokenizer.from_dir(model_dir)
    model = ts.model_dict(cfg)  # raises where no Tunix model takes it
    about = (f"{os.path.basename(model_dir.rstrip('/'))} ({cfg.arch}, {cfg.num_layers} layers, "
             f"hidden {cfg.hidden_size}, vocab {cfg.vocab_size}, {cfg.dtype}, its own weights)")
  else:
    model_dir = os.path.join(workdir, "model")
    tok = Tokenizer.builtin()
    hf_io.save_pretrained(model_dir, Transformer(ModelConfig(**bc.BENCH_MODEL),
                                                 rngs=nnx.Rngs(0)), tok)
    model, about = bc.BENCH_MODEL, "~3.04 M-param Qwen2 shape, random weights"
  count = args.prompts * (args.steps + 2)
  rows = arithmetic.make_examples(arithmetic.preset("medium"), "train", count, seed=0)
  prompts = os.path.join(workdir, "prompts.jsonl")
  if args.chat:  # the templated text itself is the prompt both sides read
    rows = [dict(r, prompt=tok.apply_chat_template([{"role": "user", "content": r["prompt"]}]))
            for r in rows]
  arithmetic.write_jsonl(rows, prompts)
  lens = [len(tok.encode(r["prompt"])) for r in rows]
  if max(lens) > args.prompt_len:
    raise ValueError(f"--prompt-len {args.prompt_len} is shorter than a prompt of "
                     f"{max(lens)} tokens")
  inputs = dict(model_dir=model_dir, prompts=prompts, prompts_per_step=args.prompts, n=args.n,
                prompt_len=args.prompt_len, new=args.new, steps=args.steps + 1,
                devices=args.devices, micro=args.micro_batch_size, workdir=workdir,
                eos_id=tok.eos_id, pad_id=tok.pad_id, prompt_tokens=[min(lens), max(lens)],
                model=model, about=about, lr=1e-4, kl_coef=0.001, seed=0)
  path = os.path.join(workdir, "inputs.json")
  with open(path, "w") as f:
    json.dump(inputs, f)
  return inputs | {"path": path}


def Worker(name: str, python: str, inputs_path: str, env: dict) -> bc.Worker:
  """A side's process: send 'go', read one BENCH line back (the step's record)."""
  return bc.Worker(name, [python, os.path.abspath(__file__), "--worker", name, "--inputs",
                          inputs_path],
                   os.path.join(os.path.dirname(inputs_path), f"{name}.log"), env)


def summarize(records: dict[str, list[dict]]) -> dict[str, dict]:
  """Per side: step 0 apart; over the timed steps after it the median and mean wall time,
  the compiles in them, tokens/s as the median of per-step rates and as sum / sum."""
  out = {}
  for name, recs in records.items():
    timed = recs[1:]
    if not timed:
      continue
    walls = [r["wall_s"] for r in timed]
    out[name] = dict(
        first_s=recs[0]["wall_s"], first_compiles=recs[0].get("compiles"),
        median_s=statistics.median(walls), mean_s=statistics.fmean(walls),
        recompiles=(sum(r["compiles"] for r in timed) if all("compiles" in r for r in timed)
                    else None),
        recompile_s=sum(r.get("compile_s", 0.0) for r in timed),
        rate_median=statistics.median(r["tokens"] / r["wall_s"] for r in timed),
        rate_mean=sum(r["tokens"] for r in timed) / sum(walls), steps=len(timed))
  return out


def _fmt_count(x) -> str:
  return "?" if x is None else f"{x:d}"


def print_table(stats: dict[str, dict], tunix: str = "tunix", out=None) -> None:
  t = stats.get(tunix)
  ratios = ((bc.Col("xTunix med", 10), bc.Col("xTunix mean", 11), bc.Col("xTunix step", 11))
            if t else ())
  table = bc.Table(bc.Col("side", 7, "<"), bc.Col("step0 s", 8, fmt=".1f"), bc.Col("comp0", 5),
                   bc.Col("median s", 9, fmt=".2f"), bc.Col("mean s", 7, fmt=".2f"),
                   bc.Col("recomp", 6), bc.Col("tok/s med", 9, fmt=".0f"),
                   bc.Col("tok/s mean", 10, fmt=".0f"), *ratios, out=out)
  for name, s in stats.items():
    cells = [name, s["first_s"], _fmt_count(s["first_compiles"]), s["median_s"], s["mean_s"],
             _fmt_count(s["recompiles"]), s["rate_median"], s["rate_mean"]]
    if t:
      cells += [f"{s['rate_median'] / t['rate_median']:.2f}x",
                f"{s['rate_mean'] / t['rate_mean']:.2f}x",
                f"{t['median_s'] / s['median_s']:.2f}x"]
    table.row(*cells)


def main(argv=None) -> int:
  args = _args(argv)
  if args.worker in VARIANTS:
    return ours_worker(args.inputs, VARIANTS[args.worker])
  if args.worker == "tunix":
    return tunix_worker(args.inputs)
  variants = [v for v in args.variants.split(",") if v]
  bad = [v for v in variants if v not in VARIANTS]
  if bad:
    raise SystemExit(f"--variants: unknown {bad}; valid: {list(VARIANTS)}")
  workdir = args.workdir or tempfile.mkdtemp(prefix="bench_e2e_")
  os.makedirs(workdir, exist_ok=True)
  t0 = time.perf_counter()
  tunix_py, note = None, ""
  if args.no_tunix:
    note = "Tunix not run (--no-tunix)"
  else:
    try:
      tunix_py = ensure_tunix(args.tunix_venv)
    except (RuntimeError, subprocess.CalledProcessError, OSError) as e:
      note = f"Tunix not run: {e}"
  bc.default_host_devices(1)
  bc.flush_lines()
  print(f"start: {bc.load_line()}")
  try:
    inputs = write_inputs(workdir, args)
  except (OSError, ValueError) as e:  # a --model folder that is not one both sides can load
    raise SystemExit(f"bench_e2e: --model {args.model}: {ts.one_line(e)}") from None
  lo, hi = inputs["prompt_tokens"]
  print(f"GRPO {args.prompts} prompts x {args.n} samples, prompts of {lo}-{hi} tokens "
        f"(<= {args.prompt_len}) + {args.new} new tokens, {inputs['about']}; "
        f"workdir {workdir}")
  for v in variants:
    print(f"  {v:7s} {VARIANTS[v].what}")
  if tunix_py:
    print(f"  {'tunix':7s} google-tunix 0.1.7 GRPOLearner, num_iterations=1 (no old-log-prob "
          f"pass), prompts padded to {args.prompt_len}")
  env = bc.child_env(devices=args.devices,
                     **({"JAX_LOG_COMPILES": "1"} if args.count_compiles else {}))
  workers = [Worker(v, sys.executable, inputs["path"], env) for v in variants]
  if tunix_py:
    workers.append(Worker("tunix", tunix_py, inputs["path"], bc.tunix_env()))
  records = {w.name: [] for w in workers}
  try:
    for w in workers:
      info = w.ready()
      print(f"{w.name}: {info.get('about', '')}")

    def on_step(i, name, _, rec):
      records[name].append(rec)
      extra = "".join(f" {k}={rec[k]:g}" for k in ("prompt_width", "compiles") if k in rec)
      print(f"  step {i} {name:6s} {rec['wall_s']:7.2f} s  {rec['tokens']:6.0f} tokens "
            + extra + "  "
            + " ".join(f"{k}={v:.2f}" for k, v in sorted(rec.get('nodes', {}).items())),
            flush=True)

    # Step 0 compiles; the order rotates every step, so load drift hits every side alike.
    bc.alternate({w.name: w.step for w in workers}, args.steps + 1, rotate=True,
                 on_time=on_step)
  except RuntimeError as e:
    note = (note + "\n" if note else "") + str(e)
  finally:
    for w in workers:
      w.close()
  if args.count_compiles:
    for v in variants:
      per = compiles_per_step(os.path.join(workdir, f"{v}.log"))
      print(f"{v}: XLA compiles per step: " + ", ".join(f"{k} {len(c)}" for k, c in per.items())
            + "".join(f"; step {k}: {c}" for k, c in per.items() if k not in ("setup", "0") and c))
  stats = summarize(records)
  print("timed steps after step 0: median and mean wall s (mean includes recompiles), "
        "comp0/recomp = backend compiles in step 0 / in the timed steps")
  print_table(stats)
  if "tunix" in stats:
    for v in variants:
      if v in stats:
        print(f"distflow-jax ({v}) / Tunix GRPO tokens/s: median "
              f"{stats[v]['rate_median'] / stats['tunix']['rate_median']:.2f}x, mean "
              f"{stats[v]['rate_mean'] / stats['tunix']['rate_mean']:.2f}x; Tunix's median "
              f"step s / ours: {stats['tunix']['median_s'] / stats[v]['median_s']:.2f}x")
  if note:
    print(note)
  print(f"total {time.perf_counter() - t0:.0f} s")
  print(f"end: {bc.load_line()}")
  return 0 if stats else 1


def compiles_per_step(log_path: str) -> dict[str, list[str]]:
  """Names of the functions jax compiled during each step, from a JAX_LOG_COMPILES log."""
  out, current = {"setup": []}, "setup"
  with open(log_path) as f:
    for line in f:
      if line.startswith("--- step "):
        current = line.split()[2]
        out[current] = []
      elif "Finished XLA compilation of " in line:
        out[current].append(line.split("Finished XLA compilation of ")[1].split(" in ")[0])
  return out


# ---------------------------------------------------------------- our side

def ours_worker(inputs_path: str, variant: Variant) -> int:
  with open(inputs_path) as f:
    inp = json.load(f)
  import jax

  from distflow_jax.config.loading import load
  from distflow_jax.run import compile_cache, executor, trainer

  buckets = _buckets(inp["prompt_len"]) if variant.buckets else (inp["prompt_len"],)
  overrides = [
      f"model.path={inp['model_dir']}", f"cluster.devices_per_process={jax.local_device_count()}",
      f"run_dir={os.path.join(inp['workdir'], 'run')}", f"data.train={inp['prompts']}",
      f"data.eval={inp['prompts']}", "trainer.eval_every=0",
      f"data.prompts_per_step={inp['prompts_per_step']}", f"rollout.n={inp['n']}",
      f"data.max_prompt_len={inp['prompt_len']}", f"rollout.prefill_buckets={buckets}",
      f"rollout.max_new_tokens={inp['new']}",
      f"model.max_seq_len={inp['prompt_len'] + inp['new']}",
      f"rollout.max_concurrent_decodes={inp['prompts_per_step'] * inp['n']}",
      f"actor.optimizer.lr={inp['lr']}", f"actor.kl.coef={inp['kl_coef']}",
      f"trainer.total_steps={inp['steps']}", f"seed={inp['seed']}",
      f"model.share_prompt_prefix={variant.share}", "trainer.compile_ahead=always",
  ]
  micro = inp["prompts_per_step"] * inp["n"] // jax.local_device_count() if variant.whole else (
      inp["micro"])
  overrides += [f"actor.micro_batch_size={micro}"] if micro else []
  cfg = load("grpo:tiny", overrides)
  if not variant.old_logprob:
    cfg.dag = [dict(n, deps=[d for d in n.get("deps", []) if d != "old_logprob"])
               for n in cfg.dag if n["id"] != "old_logprob"]
  counter = compile_cache.CompileCounter()  # the count the trainer writes as compile/count
  ctx, loaders = trainer.setup(cfg, log=lambda s: print(s, file=sys.stderr))
  bc.emit({"about": f"distflow-jax on {jax.local_device_count()} CPU device(s), buckets "
                    f"{buckets}, share_prompt_prefix={variant.share}, DAG "
                    f"{[s.node.id for s in ctx.plan.steps]}"})
  it = iter(loaders.train)
  after_step = trainer.compile_ahead(cfg, ctx)  # as `train` does: no compile after step 0
  for step, _ in enumerate(bc.commands()):
    ctx.step = step
    print(f"--- step {step}", file=sys.stderr, flush=True)
    before = counter.snapshot()
    m = executor.run_step(ctx, next(it))
    t0 = time.perf_counter()
    after_step(step == 0)
    m["time/step"] += time.perf_counter() - t0  # step 0's compile-ahead counts in step 0
    c = counter.since(before).metrics()
    nodes = {k[5:]: v for k, v in m.items() if k.startswith("time/") and k.count("/") == 1
             and k not in ("time/step", "time/compile")}
    bc.emit({"tokens": m["tokens"], "step_s": m["time/step"], "nodes": nodes,
             "prompt_width": m.get("prompt_width", 0.0),
             "compiles": int(c["compile/count"]), "compile_s": c["time/compile"]})
  return 0


# ---------------------------------------------------------------- Tunix's side

def tunix_worker(inputs_path: str) -> int:
  with open(inputs_path) as f:
    inp = json.load(f)
  import jax
  import numpy as np
  import optax
  from flax import nnx
  from tunix.rl import rl_cluster as rlc
  from tunix.rl.grpo import grpo_learner
  from tunix.rl.rollout import base_rollout

  counter = bc.CompileCount()
  actor, mesh = bc.tunix_model(inp["model_dir"], inp["model"])
  ref, _ = bc.tunix_model(inp["model_dir"], inp["model"])
  tok = bc.TunixTokenizer(os.path.join(inp["model_dir"], "tokenizer.json"), inp["eos_id"],
                          inp["pad_id"])
  total = inp["prompt_len"] + inp["new"]
  cluster = rlc.ClusterConfig(
      role_to_mesh={rlc.Role.ACTOR: mesh, rlc.Role.REFERENCE: mesh, rlc.Role.ROLLOUT: mesh},
      rollout_engine="vanilla", offload_to_cpu=False,
      training_config=rlc.RLTrainingConfig(
          actor_optimizer=optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(inp["lr"])),
          eval_every_n_steps=10 ** 9, max_steps=10 ** 6),
      rollout_config=base_rollout.RolloutConfig(
          max_tokens_to_generate=inp["new"], max_prompt_length=inp["prompt_len"],
          kv_cache_size=total, temperature=1.0, top_p=1.0, top_k=None,
          eos_tokens=[inp["eos_id"]]))
  cluster_obj = rlc.RLCluster(actor=actor, reference=ref, tokenizer=tok, cluster_config=cluster)
  algo = grpo_learner.GRPOConfig(num_generations=inp["n"], num_iterations=1,
                                 beta=inp["kl_coef"], epsilon=0.2, loss_agg_mode="token-mean")

  def reward(prompts, completions, answer, **_):  # exact-match of the last number, as ours
    import re
    out = []
    for c, a in zip(completions, answer):
      nums = re.findall(r"-?\d+", c)
      out.append(1.0 if nums and nums[-1] == str(a).strip() else 0.0)
    return out

  learner = grpo_learner.GRPOLearner(rl_cluster=cluster_obj, reward_fns=reward,
                                     algo_config=algo)
  # Completion lengths, read from the metrics Tunix already records (observation only).
  seen = {}
  orig = cluster_obj.buffer_metrics

  def buffer_metrics(metrics, *a, **k):
    if "completions/mean_length" in metrics:
      seen["mean_len"] = float(metrics["completions/mean_length"][0])
    return orig(metrics, *a, **k)
  cluster_obj.buffer_metrics = buffer_metrics
  # Per-phase wall times (observation only: each wrapped call is timed to completion).
  nodes = {}

  def timed(name, fn, block=None):
    def wrapper(*a, **k):
      t0 = time.perf_counter()
      out = fn(*a, **k)
      jax.block_until_ready(out if block is None else block())
      nodes[name] = nodes.get(name, 0.0) + time.perf_counter() - t0
      return out
    return wrapper
  cluster_obj.generate = timed("rollout", cluster_obj.generate)
  cluster_obj.get_ref_per_token_logps = timed("ref_logprob", cluster_obj.get_ref_per_token_logps)
  # Shows in a step's record only if Tunix runs it (it does not at num_iterations=1).
  cluster_obj.get_old_per_token_logps = timed("old_logprob",
                                              cluster_obj.get_old_per_token_logps)
  cluster_obj.update_actor = timed("update", cluster_obj.update_actor,
                                   block=lambda: nnx.state(actor))

  with open(inp["prompts"]) as f:
    rows = [json.loads(line) for line in f]
  per = inp["prompts_per_step"]
  bc.emit({"about": f"Tunix (google-tunix, vanilla rollout) on {jax.devices()[0]}"})
  commands = bc.commands()

  def batches():
    state = {"prompt_tokens": 0}
    for i in range(len(rows) // per):
      if i:  # the previous step has been handed out: wait for its update, report it
        jax.block_until_ready(nnx.state(actor))
        tokens = state["prompt_tokens"] + seen.get("mean_len", 0.0) * per * inp["n"]
        count, secs = counter.snapshot()
        bc.emit({"tokens": tokens, "step_s": time.perf_counter() - state["t0"],
                 "nodes": dict(nodes), "compiles": count - state["compiles"][0],
                 "compile_s": secs - state["compiles"][1]})
        nodes.clear()
      if next(commands, "stop") == "stop":
        return
      chunk = rows[i * per:(i + 1) * per]
      state["prompt_tokens"] = sum(len(tok.encode(r["prompt"])) for r in chunk) * inp["n"]
      state["t0"] = time.perf_counter()
      state["compiles"] = counter.snapshot()
      yield {"prompts": np.array([r["prompt"] for r in chunk]),
             "answer": np.array([str(r["answer"]) for r in chunk])}

  with mesh:
    learner.train(batches())
  return 0


if __name__ == "__main__":
  sys.exit(main())
