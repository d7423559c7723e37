"""GRPO step throughput: distflow-jax vs Tunix (google-tunix) on the same model and batch, CPU.

    python tools/bench_e2e.py [--prompts 8] [--n 4] [--prompt-len 32] [--new 32] [--steps 5]
                              [--devices 1] [--variants config,lean,plain] [--no-tunix]
                              [--count-compiles] [--tunix-venv DIR]

Both sides train the same exported ~3 M-param Qwen2-shaped model (vocab 512, d 256, 4
layers, GQA 4:2; our `hf_io.save_pretrained` -> model.safetensors -> Tunix's
`qwen2.params.create_model_from_safe_tensors`) with GRPO: 8 prompts x 4 samples (the
same arithmetic prompts), prompts of at most 32 tokens (Tunix pads them to 32; we pad each
step to the smallest of 8/16/24/32 that holds its longest: length bucketing), 32 new
tokens, temperature 1,
stop at EOS, KL to the reference (coef 0.001, so the reference pass runs on both sides),
one PPO epoch, adamw lr 1e-4 with global-norm clip 1.0, token-mean loss, one optimizer
update per step (ours accumulates micro-batches of grpo:tiny's actor.micro_batch_size, 16
rows, in one jitted scan; Tunix takes the 32 rows at once).
Tunix runs in its own virtual environment (created here on first use, google-tunix
0.1.7, about a minute) as a subprocess; ours runs as a subprocess too, so each side
owns the CPU while it steps.  Our side runs in three variants: `config` (configs/grpo.py's
DAG as shipped, with its old_logprob pass), `lean` (without it: with one PPO epoch the
rollout's log-probs serve, which is what Tunix does at num_iterations=1) and `plain` (`lean`
with `model.share_prompt_prefix=False`: the reference pass and the actor step run every
row's prompt, as Tunix does, instead of once per group of n; `plain` is the equal-work
comparison, `lean` is what a user gets).  The parent runs single steps in rotating order
(config, lean, plain, Tunix; lean, plain, Tunix, config; ...) so machine load hits all
alike; the first step of each (compiles) is reported apart.
Tokens/s = (prompt + response tokens, padding excluded) / step wall time; medians count.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

TUNIX_SPEC = "google-tunix==0.1.7"
DEFAULT_VENV = os.path.join(os.path.expanduser("~"), ".cache", "distflow-bench", "tunix-venv")
TAG = "BENCH "
VARIANTS = ("config", "lean", "plain")


def _args(argv):
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--prompts", type=int, default=8, help="prompts per step")
  p.add_argument("--n", type=int, default=4, help="samples per prompt (group size)")
  p.add_argument("--prompt-len", type=int, default=32, help="max prompt tokens (left-padded)")
  p.add_argument("--new", type=int, default=32, help="max new tokens")
  p.add_argument("--steps", type=int, default=5, help="timed steps per side (after 1 warm-up)")
  p.add_argument("--micro-batch-size", type=int, default=0,
                 help="our actor.micro_batch_size (rows per device per micro-batch); 0 = the "
                      "config's (grpo:tiny: 16)")
  p.add_argument("--devices", type=int, default=1, help="CPU devices for our side")
  p.add_argument("--variants", default="config,lean,plain",
                 help="our sides: 'config' = configs/grpo.py's DAG as shipped; 'lean' = the same "
                      "without the old_logprob node (one PPO epoch: the rollout's log-probs "
                      "serve, as in Tunix with num_iterations=1); 'plain' = 'lean' without "
                      "prompt sharing (model.share_prompt_prefix=False)")
  p.add_argument("--count-compiles", action="store_true",
                 help="log our side's XLA compiles (JAX_LOG_COMPILES) and count them per step")
  p.add_argument("--no-tunix", action="store_true")
  p.add_argument("--tunix-venv", default=DEFAULT_VENV)
  p.add_argument("--workdir", default="", help="default: a fresh temporary directory")
  p.add_argument("--worker", choices=(*VARIANTS, "tunix"), help=argparse.SUPPRESS)
  p.add_argument("--inputs", help=argparse.SUPPRESS)
  return p.parse_args(argv)


def _buckets(prompt_len: int) -> tuple[int, ...]:
  """Our prompt-width buckets: each step pads prompts to the smallest one that holds the
  longest (length bucketing); Tunix pads every prompt to max_prompt_length."""
  return tuple(b for b in (8, 16, 24) if b < prompt_len) + (prompt_len,)


# ---------------------------------------------------------------- the parent

def ensure_tunix(venv: str, log=print) -> str:
  """The python of a venv with google-tunix, created on first use; raises with pip's output."""
  py = os.path.join(venv, "bin", "python")
  probe = [py, "-c", "import tunix.rl.grpo.grpo_learner"]
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


def write_inputs(workdir: str, args) -> dict:
  """Exports the bench model + tokenizer and writes the prompt file both sides read."""
  sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
  import _bench_common as bc
  from flax import nnx

  from distflow_jax.models import ModelConfig, Transformer, hf_io
  from distflow_jax.models.tokenizer import Tokenizer
  from distflow_jax.tasks import arithmetic

  model_dir = os.path.join(workdir, "model")
  tok = Tokenizer.builtin()
  hf_io.save_pretrained(model_dir, Transformer(ModelConfig(**bc.BENCH_MODEL),
                                               rngs=nnx.Rngs(0)), tok)
  count = args.prompts * (args.steps + 2)
  rows = arithmetic.make_examples(arithmetic.preset("medium"), "train", count, seed=0)
  prompts = os.path.join(workdir, "prompts.jsonl")
  arithmetic.write_jsonl(rows, prompts)
  too_long = [r["prompt"] for r in rows if len(tok.encode(r["prompt"])) > args.prompt_len]
  if too_long:
    raise ValueError(f"--prompt-len {args.prompt_len} is shorter than prompt {too_long[0]!r}")
  inputs = dict(model_dir=model_dir, prompts=prompts, prompts_per_step=args.prompts, n=args.n,
                prompt_len=args.prompt_len, new=args.new, steps=args.steps + 1,
                devices=args.devices, micro=args.micro_batch_size, workdir=workdir,
                eos_id=tok.eos_id, pad_id=tok.pad_id,
                model=bc.BENCH_MODEL, lr=1e-4, kl_coef=0.001, seed=0)
  path = os.path.join(workdir, "inputs.json")
  with open(path, "w") as f:
    json.dump(inputs, f)
  return inputs | {"path": path}


class Worker:
  """A side's process: send 'go', read one BENCH line back (the step's record)."""

  def __init__(self, name: str, python: str, inputs_path: str, env: dict):
    self.name = name
    self.log = open(os.path.join(os.path.dirname(inputs_path), f"{name}.log"), "w")
    self.proc = subprocess.Popen(
        [python, os.path.abspath(__file__), "--worker", name, "--inputs", inputs_path],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, text=True, env=env)

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


def main(argv=None) -> int:
  args = _args(argv)
  if args.worker in VARIANTS:
    return ours_worker(args.inputs, lean=args.worker != "config",
                       share=args.worker != "plain")
  if args.worker == "tunix":
    return tunix_worker(args.inputs)
  workdir = args.workdir or tempfile.mkdtemp(prefix="bench_e2e_")
  os.makedirs(workdir, exist_ok=True)
  t0 = time.perf_counter()
  tunix_py, note = None, ""
  if not args.no_tunix:
    try:
      tunix_py = ensure_tunix(args.tunix_venv)
    except (RuntimeError, subprocess.CalledProcessError) as e:
      note = f"Tunix not run: {e}"
  os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=1")
  inputs = write_inputs(workdir, args)
  print(f"GRPO {args.prompts} prompts x {args.n} samples, prompt <= {args.prompt_len} + "
        f"{args.new} new tokens, ~3.04 M-param Qwen2 shape; workdir {workdir}")
  env = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={args.devices}")
  if args.count_compiles:
    env["JAX_LOG_COMPILES"] = "1"
  variants = [v for v in args.variants.split(",") if v]
  bad = [v for v in variants if v not in VARIANTS]
  if bad:
    raise SystemExit(f"--variants: unknown {bad}; valid: {list(VARIANTS)}")
  workers = [Worker(v, sys.executable, inputs["path"], env) for v in variants]
  if tunix_py:
    tenv = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=1",
                JAX_PLATFORMS="cpu")
    workers.append(Worker("tunix", tunix_py, inputs["path"], tenv))
  records = {w.name: [] for w in workers}
  try:
    for w in workers:
      info = w.ready()
      print(f"{w.name}: {info.get('about', '')}")
    for i in range(args.steps + 1):  # step 0 compiles; the order rotates every step
      first = i % len(workers)
      for w in workers[first:] + workers[:first]:
        rec = w.step()
        records[w.name].append(rec)
        print(f"  step {i} {w.name:5s} {rec['wall_s']:7.2f} s  {rec['tokens']:6.0f} tokens  "
              + " ".join(f"{k}={v:.2f}" for k, v in sorted(rec.get('nodes', {}).items())),
              flush=True)
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
  rates = {}
  print(f"{'side':8s} {'first step s':>12s} {'median s':>9s} {'tok/s':>8s}")
  for name, recs in records.items():
    timed = recs[1:]
    if not timed:
      continue
    med = statistics.median(r["wall_s"] for r in timed)
    rates[name] = statistics.median(r["tokens"] / r["wall_s"] for r in timed)
    print(f"{name:8s} {recs[0]['wall_s']:12.1f} {med:9.2f} {rates[name]:8.0f}")
  for v in variants:
    if v in rates and "tunix" in rates:
      print(f"distflow-jax ({v}) / Tunix GRPO tokens/s: {rates[v] / rates['tunix']:.2f}x "
            f"(target >= 2x)")
  if note:
    print(note)
  print(f"total {time.perf_counter() - t0:.0f} s")
  return 0 if rates else 1


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

def _emit(rec: dict) -> None:
  print(TAG + json.dumps(rec), flush=True)


def _commands():
  for line in sys.stdin:
    if line.strip() == "stop":
      return
    yield


def ours_worker(inputs_path: str, lean: bool, share: bool = True) -> int:
  with open(inputs_path) as f:
    inp = json.load(f)
  import jax

  from distflow_jax.config.loading import load
  from distflow_jax.workflow import executor, trainer

  overrides = [
      f"model.path={inp['model_dir']}", f"cluster.devices_per_process={jax.local_device_count()}",
      f"run_dir={os.path.join(inp['workdir'], 'run')}", f"data.train={inp['prompts']}",
      f"data.eval={inp['prompts']}", "trainer.eval_every=0",
      f"data.prompts_per_step={inp['prompts_per_step']}", f"rollout.n={inp['n']}",
      f"data.max_prompt_len={inp['prompt_len']}", f"rollout.prefill_buckets={_buckets(inp['prompt_len'])}",
      f"rollout.max_new_tokens={inp['new']}",
      f"rollout.max_concurrent_decodes={inp['prompts_per_step'] * inp['n']}",
      f"actor.optimizer.lr={inp['lr']}", f"actor.kl.coef={inp['kl_coef']}",
      f"trainer.total_steps={inp['steps']}", f"seed={inp['seed']}",
      f"model.share_prompt_prefix={share}",
  ] + ([f"actor.micro_batch_size={inp['micro']}"] if inp["micro"] else [])
  cfg = load("grpo:tiny", overrides)
  if lean:
    cfg.dag = [dict(n, deps=[d for d in n.get("deps", []) if d != "old_logprob"])
               for n in cfg.dag if n["id"] != "old_logprob"]
  ctx, loaders = trainer.setup(cfg, log=lambda s: print(s, file=sys.stderr))
  _emit({"about": f"distflow-jax on {jax.local_device_count()} CPU device(s), DAG "
                  f"{[s.node.id for s in ctx.plan.steps]}"})
  it = iter(loaders.train)
  for step, _ in enumerate(_commands()):
    ctx.step = step
    print(f"--- step {step}", file=sys.stderr, flush=True)
    m = executor.run_step(ctx, next(it))
    nodes = {k[5:]: v for k, v in m.items() if k.startswith("time/") and k.count("/") == 1
             and k != "time/step"}
    _emit({"tokens": m["tokens"], "step_s": m["time/step"], "nodes": nodes})
  return 0


# ---------------------------------------------------------------- Tunix's side

class _TunixTokenizer:
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


def tunix_worker(inputs_path: str) -> int:
  with open(inputs_path) as f:
    inp = json.load(f)
  import jax
  import numpy as np
  import optax
  from flax import nnx
  from tunix.models.qwen2 import model as qwen2_model
  from tunix.models.qwen2 import params as qwen2_params
  from tunix.rl import rl_cluster as rlc
  from tunix.rl.grpo import grpo_learner
  from tunix.rl.rollout import base_rollout

  m = inp["model"]
  mcfg = qwen2_model.ModelConfig(
      num_layers=m["num_layers"], vocab_size=m["vocab_size"], embed_dim=m["hidden_size"],
      hidden_dim=m["intermediate_size"], num_heads=m["num_heads"], head_dim=m["head_dim"],
      num_kv_heads=m["num_kv_heads"], rope_theta=10000, norm_eps=1e-6,
      use_tied_embedding=m["tie_embeddings"])
  mesh = jax.make_mesh((1, 1), ("fsdp", "tp"), devices=jax.devices()[:1],
                       axis_types=(jax.sharding.AxisType.Auto,) * 2)
  actor = qwen2_params.create_model_from_safe_tensors(inp["model_dir"], mcfg, mesh)
  ref = qwen2_params.create_model_from_safe_tensors(inp["model_dir"], mcfg, mesh)
  tok = _TunixTokenizer(os.path.join(inp["model_dir"], "tokenizer.json"), inp["eos_id"],
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
  cluster_obj.update_actor = timed("update", cluster_obj.update_actor,
                                   block=lambda: nnx.state(actor))

  with open(inp["prompts"]) as f:
    rows = [json.loads(line) for line in f]
  per = inp["prompts_per_step"]
  _emit({"about": f"Tunix (google-tunix, vanilla rollout) on {jax.devices()[0]}"})
  commands = _commands()

  def batches():
    state = {"prompt_tokens": 0}
    for i in range(len(rows) // per):
      if i:  # the previous step has been handed out: wait for its update, report it
        jax.block_until_ready(nnx.state(actor))
        tokens = state["prompt_tokens"] + seen.get("mean_len", 0.0) * per * inp["n"]
        _emit({"tokens": tokens, "step_s": time.perf_counter() - state["t0"],
               "nodes": dict(nodes)})
        nodes.clear()
      if next(commands, "stop") == "stop":
        return
      chunk = rows[i * per:(i + 1) * per]
      state["prompt_tokens"] = sum(len(tok.encode(r["prompt"])) for r in chunk) * inp["n"]
      state["t0"] = time.perf_counter()
      yield {"prompts": np.array([r["prompt"] for r in chunk]),
             "answer": np.array([str(r["answer"]) for r in chunk])}

  with mesh:
    learner.train(batches())
  return 0


if __name__ == "__main__":
  sys.exit(main())
