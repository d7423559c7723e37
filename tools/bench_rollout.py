"""Decode throughput: our engine vs a no-cache baseline vs `transformers.generate` (torch CPU)
vs Tunix's sampler (google-tunix, its own venv).

    python tools/bench_rollout.py [--batch 16] [--prompt 32] [--new 64] [--rounds 3]
                                  [--no-hf] [--no-tunix] [--tunix-venv DIR] [--model HF_DIR]

All decode the same prompts (random token ids, all --prompt long, so nobody pads) greedily
for the same number of new tokens (no stop token) with the same weights: the bench model
(tools/_bench_common.BENCH_MODEL, ~3 M-param Qwen2 shape: vocab 512, d 256, 4 layers, GQA
4:2), exported with models/hf_io and loaded by transformers and by Tunix's qwen2 model
(`qwen2.params.create_model_from_safe_tensors`, float32), or with --model an HF folder's own
weights (a Llama one goes to Tunix's llama3 model).  They are measured side by side
in one run: rounds interleave them so that machine load hits them alike; the median round
counts (runners over 5x slower than the engine are timed once; Tunix is timed every round).
Tokens/s = new tokens / wall time of the whole generate call (prefill included).

transformers runs at torch's default thread count and at 1 thread (the default thrashes on
a loaded machine); the faster is the reference.  It is skipped, with a note, when the `hf`
extra is not installed (or with --no-hf).

Tunix's `generate.sampler.Sampler` (google-tunix 0.1.7, temperature 0 = greedy, KV cache of
prompt + new tokens) runs in a worker process in the venv tools/bench_e2e.py uses (created
on first use, about a minute); its time is that of the sampler call inside the worker, and
it sees exactly our token ids (tools/_tunix_side.py, shared with bench_decode).  Skipped,
with a note, with --no-tunix or when the venv cannot be made.  The report gives every
runner's greedy-token agreement with the no-cache baseline and Tunix's with the engine.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _bench_common as bc  # noqa: E402
import _tunix_side as ts  # noqa: E402


def _args(argv):
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--batch", type=int, default=16)
  p.add_argument("--prompt", type=int, default=32)
  p.add_argument("--new", type=int, default=64)
  p.add_argument("--rounds", type=int, default=3)
  p.add_argument("--decode-steps", type=int, default=64, help="tokens per compiled decode call")
  p.add_argument("--no-hf", action="store_true", help="skip transformers")
  p.add_argument("--no-tunix", action="store_true", help="skip Tunix's sampler")
  p.add_argument("--tunix-venv", default=bc.DEFAULT_TUNIX_VENV)
  p.add_argument("--model", default="",
                 help="an HF folder (config.json, model.safetensors) every runner decodes with "
                      "its own weights, float32, instead of the bench model")
  return p.parse_args(argv)


def main(argv=None) -> int:
  args = _args(argv)
  tunix_py, tunix_note = ts.tunix_python(args.no_tunix, args.tunix_venv)
  bc.default_host_devices(1)
  bc.flush_lines()
  import jax
  import jax.numpy as jnp
  from flax import nnx

  from distflow_jax.models import ModelConfig, Transformer, forward
  from distflow_jax.models import hf_io
  from distflow_jax.rollout import Engine, EngineConfig, SamplingParams, generate, replica_mesh

  if args.model:
    try:
      model = hf_io.load_pretrained(args.model, dtype="float32")
    except (OSError, ValueError) as e:
      raise SystemExit(f"bench_rollout: --model {args.model}: {ts.one_line(e)}") from None
    cfg = model.cfg
  else:
    cfg = ModelConfig(**bc.BENCH_MODEL)
    model = Transformer(cfg, rngs=nnx.Rngs(0))
  b, tp, tn = args.batch, args.prompt, args.new
  rs = np.random.RandomState(0)
  prompts = rs.randint(1, cfg.vocab_size, size=(b, tp)).astype(np.int32)
  print(f"start: {bc.load_line()}")
  print(f"model: {cfg.num_params / 1e6:.2f} M params; batch {b}, prompt {tp}, new {tn}; "
        f"jax {jax.__version__} on {jax.devices()[0].platform}")

  engine = Engine(cfg, EngineConfig(max_concurrent_decodes=b, prefill_buckets=(tp,),
                                    max_new_tokens=tn, sampling=SamplingParams(temperature=0.0),
                                    decode_steps=min(args.decode_steps, tn)),
                  mesh=replica_mesh(1, jax.local_devices()[:1]))
  params = engine.load_params(model)

  def ours():
    out = generate(engine, params, prompts.tolist())
    return out.tokens_RxN

  graphdef, state = nnx.split(model)
  total = tp + tn

  @jax.jit
  def full_step(state, buf_BxS, t):
    # No cache: the whole (fixed-size, masked) sequence is re-run for every new token.
    mask = jnp.arange(total)[None, :] < t
    pos = jnp.broadcast_to(jnp.arange(total), (b, total))
    logits, _ = forward(graphdef, state, buf_BxS, pos, jnp.broadcast_to(mask, (b, total)))
    nxt = jnp.argmax(logits[:, t - 1], axis=-1).astype(jnp.int32)
    return buf_BxS.at[:, t].set(nxt)

  def no_cache():
    buf = jnp.zeros((b, total), jnp.int32).at[:, :tp].set(prompts)
    for t in range(tp, total):
      buf = full_step(state, buf, t)
      if (t - tp) % 8 == 7:
        buf.block_until_ready()
    return np.asarray(buf[:, tp:])

  runners = {"engine": ours, "no-cache": no_cache}
  tmp = tempfile.mkdtemp(prefix="bench_rollout_")
  model_dir = os.path.abspath(args.model) if args.model else os.path.join(tmp, "model")
  if not args.model:
    hf_io.save_pretrained(model_dir, model)
  hf_note = ""
  if not args.no_hf:
    try:
      import torch
      import transformers
    except ImportError as e:
      hf_note = f"transformers.generate skipped: {e} (pip install '.[hf]')"
    else:
      hf_model = transformers.AutoModelForCausalLM.from_pretrained(model_dir,
                                                                   dtype=torch.float32)
      hf_model.eval()
      ids = torch.tensor(prompts, dtype=torch.long)

      def hf_runner(threads):
        def hf():
          torch.set_num_threads(threads)
          with torch.no_grad():
            out = hf_model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=tn,
                                    min_new_tokens=tn, do_sample=False, pad_token_id=0)
          return out[:, tp:].numpy()
        return hf

      # torch's default (all cores) can thrash on a loaded machine; 1 thread is also
      # measured and the faster of the two is the reference.
      default_threads = torch.get_num_threads()
      for threads in dict.fromkeys((default_threads, 1)):
        runners[f"transformers.generate/{threads}t"] = hf_runner(threads)
      hf_note = f"transformers {transformers.__version__}, torch {torch.__version__}"

  tunix = None
  if tunix_py:
    tunix = ts.Sampler(tunix_py, model_dir, ts.model_dict(cfg), {"all": prompts}, tn, tmp)
  try:
    if tunix is not None:
      try:
        tunix_note = tunix.ready()
        runners["tunix sampler"] = lambda: tunix.run("all")  # the sampler call's own time
      except RuntimeError as e:
        tunix_note = f"Tunix's sampler skipped: {ts.one_line(e)}"
    results, warm = {}, {}
    for name, fn in runners.items():  # warm-up / compile
      results[name], warm[name] = bc.timed(fn)
      print(f"  warm-up {name:28s} {warm[name]:8.3f} s")
    # Runners 5x slower than the engine's warm-up (compile included) get one timed round:
    # their ratio is not in doubt and extra rounds would take minutes.  Tunix's sampler,
    # whose compile may be slow but whose ratio is the point, is timed every round.
    times = bc.alternate(
        runners, args.rounds,
        skip=lambda i, name: (i and name != "tunix sampler"
                              and warm[name] > 5 * warm["engine"]),
        on_time=lambda i, name, secs, _: print(f"  round {i} {name:28s} {secs:8.3f} s"))
  finally:
    if tunix is not None:
      tunix.close()
  rate = {name: b * tn / statistics.median(ts) for name, ts in times.items()}
  table = bc.Table(bc.Col("runner", 28, "<"), bc.Col("tok/s", 10, fmt=".0f"),
                   bc.Col("median s", 9, fmt=".3f"), bc.Col("range s", 13),
                   bc.Col("engine speed-up", 17))
  for name, r in rate.items():
    table.row(name, r, b * tn / r, f"{min(times[name]):.3f}-{max(times[name]):.3f}",
              f"{rate['engine'] / r:.2f}x")
  hf_rates = [r for name, r in rate.items() if name.startswith("transformers")]
  if hf_rates:
    print(f"engine vs best transformers.generate: {rate['engine'] / max(hf_rates):.2f}x")
  if "tunix sampler" in rate:
    print(f"engine vs Tunix sampler: {rate['engine'] / rate['tunix sampler']:.2f}x")
  for note in (hf_note, tunix_note):
    if note:
      print(note)
  ref = results["no-cache"]
  for name, toks in results.items():
    print(f"greedy tokens equal to no-cache: {name}: {ts.agreement(toks, ref)[0]:.3f}")
  if "tunix sampler" in results:
    frac, rows = ts.agreement(results["tunix sampler"], results["engine"])
    print(f"Tunix sampler vs engine, token for token: {frac:.3f} of tokens, {rows}/{b} rows "
          f"equal")
  print(f"engine compiles: {engine.compile_counts()}")
  print(f"end: {bc.load_line()}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
