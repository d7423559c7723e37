"""JetStream's own orchestrator driving our rollout engine, on a tiny random model.

README note.  `distflow_jax.rollout.jetstream_adapter.as_jetstream(engine)`
registers our engine as a `jetstream.engine.engine_api.Engine`; this script
shows that JetStream's serving loop (`jetstream.core.orchestrator.Driver`:
its prefill, generate and detokenize threads, slot queue and return
channels) runs it unchanged, and that its completions equal
`distflow_jax.rollout.generate` on the same requests.

    python3 tools/jetstream_orchestrator.py            # venv at /tmp/jetstream-venv
    python3 tools/jetstream_orchestrator.py --venv DIR --prompts 6 --max_new_tokens 10

It makes its own virtual environment (created on first use, reused after),
installs `google-jetstream` from PyPI and this repository (editable) into it,
and re-runs itself there.  google-jetstream 0.2.2 pulls TensorFlow (about
1 GB, several minutes), so this never runs in CI or in the test suite, and
nothing it downloads belongs in the repository.

What the run does: builds an `Engine` over a random `ModelConfig` (vocab
64), sends each prompt to the orchestrator as a token request (JetStream
prepends BOS = `--bos`), collects the streamed token ids of each request,
then generates the same requests with our driver and prints both.  Request
i draws from the engine's request key i in both (JetStream prefills in queue
order and our engine numbers its prefills), so sampled completions match too.
JetStream 0.2.2 ends a completion at a stop token without emitting it (the
driver's stop tokens are stripped for the comparison); its last main streams
the stop token too.

The orchestrator's DEBUG logging to stdout is turned down unless
`--verbose`.  (JetStream 0.2.2's use of the removed `jax.tree_map` is shimmed
inside the adapter, when it imports JetStream.)  For both JetStream versions,
more prompt lengths, slot reuse and disaggregated serving, see
tools/jetstream_conformance.py.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _bench_common as bc  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def bootstrap(args: argparse.Namespace, argv: list[str]) -> int:
  """Creates the venv when missing, installs JetStream and this package, re-runs in it."""
  py = os.path.join(args.venv, "bin", "python")
  if not os.path.exists(py):
    print(f"creating {args.venv}", flush=True)
    subprocess.run([sys.executable, "-m", "venv", args.venv], check=True)
  have = subprocess.run([py, "-c", "import jetstream.core.orchestrator, distflow_jax"],
                        capture_output=True).returncode == 0
  if not have or args.reinstall:
    pip = [py, "-m", "pip", "install", "-q"]
    print("installing google-jetstream (pulls TensorFlow: minutes) and this package", flush=True)
    subprocess.run(pip + ["--upgrade", "pip"], check=True)
    subprocess.run(pip + ["google-jetstream"], check=True)
    subprocess.run(pip + ["-e", REPO], check=True)
  env = bc.child_env(defaults=dict(JAX_PLATFORMS="cpu", TF_CPP_MIN_LOG_LEVEL="3"))
  code = subprocess.run([py, os.path.abspath(__file__), bc.INSIDE_VENV] + argv,
                        env=env).returncode
  if code < 0 or code == 137:
    # JetStream's threads SIGKILL the process when one of them raises (JetThread).
    print(f"the run was killed (exit {code}): a JetStream thread raised; see its traceback "
          "above", file=sys.stderr)
  return code


def serve(driver, orchestrator, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
  """Sends every prompt as a token request and collects each one's streamed token ids."""
  from distflow_jax.rollout.jetstream_adapter import serve_streams, token_request
  return asyncio.run(serve_streams(driver, lambda: [
      token_request(p, max_tokens, orchestrator=orchestrator) for p in prompts]))


def run(args: argparse.Namespace) -> int:
  """Inside the venv: JetStream's Driver over our engine, then our driver, compared."""
  import logging

  import jax
  import numpy as np

  from distflow_jax.models import ModelConfig
  from distflow_jax.rollout import Engine, EngineConfig, SamplingParams, generate
  from distflow_jax.rollout.jetstream_adapter import (api_generation, as_jetstream,
                                                      prefill_returns_first_token)
  # as_jetstream (below, before the Driver starts) applies the adapter's jax.tree_map shim.
  from jetstream.core import orchestrator
  from jetstream.engine import engine_api

  if not args.verbose:
    logging.getLogger().setLevel(logging.WARNING)
  import importlib.metadata as md
  print(f"google-jetstream {md.version('google-jetstream')}, jax {jax.__version__}, devices "
        f"{jax.devices()}; prefill returns the first token: "
        f"{prefill_returns_first_token(engine_api)}", flush=True)

  cfg = ModelConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_layers=2,
                    num_heads=4, num_kv_heads=2, head_dim=16)
  stop = 2
  engine = Engine(cfg, EngineConfig(
      max_concurrent_decodes=4, prefill_buckets=(16, 32), max_new_tokens=args.max_new_tokens,
      stop_ids=(stop,), sampling=SamplingParams(temperature=args.temperature), decode_steps=4,
      seed=args.seed))
  params = engine.load_params()  # random init from the seed
  js = as_jetstream(engine, bos_id=args.bos)
  print(f"adapter: {type(js).__name__} is an engine_api.Engine: "
        f"{isinstance(js, engine_api.Engine)}", flush=True)
  rng = np.random.default_rng(args.seed)
  prompts = [rng.integers(3, cfg.vocab_size, size=int(rng.integers(2, 12))).tolist()
             for _ in range(args.prompts)]

  # One engine does prefill and generate (interleaved mode: no transfer between slices).
  driver = orchestrator.Driver(prefill_engines=[js], generate_engines=[js],
                               prefill_params=[params], generate_params=[params],
                               interleaved_mode=True)
  start = time.perf_counter()
  try:
    served = serve(driver, orchestrator, prompts, args.max_new_tokens)
  finally:
    driver.stop()
  elapsed = time.perf_counter() - start

  ours = generate(engine, params, [[args.bos] + p for p in prompts])
  same = 0
  keep_stop = api_generation(engine_api) == "main"  # main streams the stop token too
  for i, p in enumerate(prompts):
    mine = ours.tokens_RxN[i, :ours.lengths_R[i]].tolist()
    if ours.stopped_R[i] and not keep_stop:
      mine = mine[:-1]
    same += served[i] == mine
    end = f"then stop id {stop}" if ours.stopped_R[i] else "length"
    print(f"prompt {i} {p}\n  jetstream orchestrator: {served[i]}\n"
          f"  distflow driver:        {mine} ({end})  "
          f"{'same' if served[i] == mine else 'DIFFERENT'}", flush=True)
  print(f"{len(prompts)} requests through jetstream.core.orchestrator.Driver in {elapsed:.1f}s "
        f"(compiles included); {same}/{len(prompts)} equal to distflow_jax.rollout.generate")
  return 0 if same == len(prompts) else 1


def main(argv: list[str]) -> int:
  inner, argv = bc.inside_venv(argv)
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--venv", default="/tmp/jetstream-venv")
  ap.add_argument("--reinstall", action="store_true", help="pip install again")
  ap.add_argument("--prompts", type=int, default=6)
  ap.add_argument("--max_new_tokens", type=int, default=10)
  ap.add_argument("--temperature", type=float, default=1.0, help="0 = greedy")
  ap.add_argument("--bos", type=int, default=1)
  ap.add_argument("--seed", type=int, default=0)
  ap.add_argument("--verbose", action="store_true", help="keep JetStream's DEBUG log")
  args = ap.parse_args(argv)
  return run(args) if inner else bootstrap(args, argv)


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
