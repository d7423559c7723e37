"""Conformance of the JetStream adapter: JetStream's own orchestrator over our engine.

    python3 tools/jetstream_conformance.py                       # both versions
    python3 tools/jetstream_conformance.py --versions 0.2.2
    python3 tools/jetstream_conformance.py --main-src /path/to/JetStream.git   # offline

Not CI: each JetStream environment pulls TensorFlow (about 1 GB).  For each
version the script makes (first use) or reuses a virtual environment, makes
sure it imports this checkout's `distflow_jax` (`pip install -e . --no-deps`
otherwise), and re-runs itself there:

* `0.2.2`: `pip install google-jetstream==0.2.2` (PyPI) in /tmp/jetstream-venv;
* `main`: JetStream's last main, commit `MAIN_COMMIT` (the repository was
  archived in 2026-01), in /tmp/jetstream-main-venv: from GitHub, or, where
  only PyPI is reachable, from a local clone (`--main-src`, a git directory
  holding that commit): `git archive` of the commit, then `pip install` of it.

Inside, on a tiny random model (vocab 64, greedy, stop id 2, engine limit 8
new tokens, buckets 16/32, 4 slots) it sends 9 token requests through
`jetstream.core.orchestrator.Driver` and compares every stream with
`distflow_jax.rollout.generate` on the prompt JetStream actually prefilled:

* prompt lengths 1, 7, 15, 16, 31 (BOS makes 32 = max_prefill_length),
  32 and 40 (one and nine tokens over after BOS: JetStream keeps the last
  32), and 1 and 32 tokens sent with `has_bos` (no BOS prepended);
* `max_tokens` alternating 12 (the engine's own limit, 8, ends the stream:
  no filler token may follow) and 5 (JetStream's limit ends it);
* 9 requests on 4 slots, so slots are reused;
* interleaved mode (one engine prefills and generates) and disaggregated
  mode (a prefill engine on host device 0 hands prefixes to a generate
  engine on device 1 through JetStream's transfer thread).

JetStream 0.2.2 ends a stream before a stop token; main streams the stop
token too; the expected stream follows the installed version.  Each mode runs
the requests twice (the first run compiles) and reports the second run's
streamed tokens per second beside `generate`'s on the same prompts (warm).
A third row per version runs `rollout.backend=jetstream` against the native
`engine` backend (2 samples per prompt at temperature 1, the same request
keys): rows must match in tokens, lengths, stops and log-probs (1e-5), and
the table gives both backends' rollout tokens per second (warm).  Prints one
table row per (version, mode); exits 1 if any stream or row differs.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _bench_common as bc  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MAIN_COMMIT = "acd4f5ad50ed2fb38e0e5bd7defd81e34a62706c"  # JetStream main, 2026-01-05
MAIN_URL = f"git+https://github.com/AI-Hypercomputer/JetStream@{MAIN_COMMIT}"
VENVS = {"0.2.2": "/tmp/jetstream-venv", "main": "/tmp/jetstream-main-venv"}
BOS, STOP, MAX_NEW, SLOTS = 1, 2, 8, 4
# (prompt length, max_tokens, has_bos); see the module doc.
REQUESTS = [(1, 12, False), (7, 5, False), (15, 12, False), (16, 5, False), (31, 12, False),
            (32, 5, False), (40, 12, False), (1, 12, True), (32, 12, True)]


def _install_main(py: str, args: argparse.Namespace) -> None:
  pip = [py, "-m", "pip", "install", "-q"]
  if not args.main_src:
    subprocess.run(pip + [f"google-jetstream @ {MAIN_URL}"], check=True)
    return
  tar = os.path.join(tempfile.gettempdir(), f"jetstream-{MAIN_COMMIT}.tar.gz")
  subprocess.run(["git", "--git-dir", args.main_src, "archive", "--format=tar.gz",
                  f"--prefix=JetStream-{MAIN_COMMIT}/", "-o", tar, MAIN_COMMIT], check=True)
  subprocess.run(pip + [tar], check=True)


def ensure_venv(version: str, args: argparse.Namespace) -> str:
  """The version's venv: created and installed when missing, this checkout's code in it."""
  venv = VENVS[version]
  py = os.path.join(venv, "bin", "python")
  stamp = os.path.join(venv, "jetstream-source.txt")
  want = "google-jetstream==0.2.2" if version == "0.2.2" else MAIN_COMMIT
  if not os.path.exists(py):
    print(f"creating {venv}", flush=True)
    subprocess.run([sys.executable, "-m", "venv", venv], check=True)
  have = open(stamp).read().strip() if os.path.exists(stamp) else None
  if have is None and version == "0.2.2":  # a venv made by tools/jetstream_orchestrator.py
    ver = subprocess.run([py, "-c", "import importlib.metadata as m; "
                          "print(m.version('google-jetstream'))"], capture_output=True, text=True)
    have = want if ver.stdout.strip() == "0.2.2" else None
  if have != want:
    print(f"installing JetStream {version} into {venv} (pulls TensorFlow: minutes)", flush=True)
    if version == "0.2.2":
      subprocess.run([py, "-m", "pip", "install", "-q", "google-jetstream==0.2.2"], check=True)
    else:
      _install_main(py, args)
    with open(stamp, "w") as f:
      f.write(want + "\n")
  where = subprocess.run([py, "-c", "import distflow_jax; print(distflow_jax.__file__)"],
                         capture_output=True, text=True).stdout.strip()
  if not where.startswith(os.path.join(REPO, "")):
    print(f"installing this checkout (editable) into {venv}", flush=True)
    subprocess.run([py, "-m", "pip", "install", "-q", "-e", REPO, "--no-deps"], check=True)
  return py


def run_inside(args: argparse.Namespace) -> int:
  """In a JetStream venv: both modes through the orchestrator, compared with `generate`."""
  import logging

  import jax
  import numpy as np

  from flax import nnx

  from distflow_jax.models import ModelConfig
  from distflow_jax.models.transformer import Transformer
  from distflow_jax.rollout import Engine, EngineConfig, SamplingParams, generate
  from distflow_jax.rollout.engine.config import replica_mesh
  from distflow_jax.rollout import jetstream_adapter as ja
  from jetstream.core import orchestrator

  logging.getLogger().setLevel(logging.WARNING)
  gen = ja.api_generation()
  cfg = ModelConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_layers=2,
                    num_heads=4, num_kv_heads=2, head_dim=16)
  ecfg = EngineConfig(max_concurrent_decodes=SLOTS, prefill_buckets=(16, 32),
                      max_new_tokens=MAX_NEW, stop_ids=(STOP,),
                      sampling=SamplingParams(temperature=0.0), decode_steps=4, seed=0)
  devs = jax.devices()
  eng_a = Engine(cfg, ecfg, replica_mesh(devices=devs[:1]))
  eng_b = Engine(cfg, ecfg, replica_mesh(devices=devs[-1:]))
  # Random weights scaled up: greedy streams then vary instead of repeating one token, so a
  # token out of place (a lag, a filler, a lost first token) shows.
  model = Transformer(cfg, rngs=nnx.Rngs(0))
  nnx.update(model, jax.tree.map(lambda x: x * 10.0 if x.ndim == 2 else x,
                                 nnx.state(model, nnx.Param)))
  params_a = eng_a.load_params(model)
  params_b = eng_b.load_params(model)
  rng = np.random.default_rng(0)
  prompts = [rng.integers(3, cfg.vocab_size, size=n).tolist() for n, _, _ in REQUESTS]
  limit = eng_a.max_prefill_length
  # What JetStream prefills: BOS first unless has_bos, then the last max_prefill_length.
  seen = [(p if hb else [BOS] + p)[-limit:] for p, (_, _, hb) in zip(prompts, REQUESTS)]
  keep_stop = gen == "main"
  ends: list[str] = []  # how each expected stream ends: stop token, engine limit, max_tokens

  def expected(engine, params) -> tuple[list[list[int]], float]:
    out, tokens, start = [None] * len(seen), 0, time.perf_counter()
    ends.clear()
    for mt in sorted({m for _, m, _ in REQUESTS}):
      idx = [i for i, (_, m, _) in enumerate(REQUESTS) if m == mt]
      roll = generate(engine, params, [seen[i] for i in idx], max_new_tokens=min(mt, MAX_NEW))
      for row, i in enumerate(idx):
        toks = roll.tokens_RxN[row, :roll.lengths_R[row]].tolist()
        tokens += len(toks)
        out[i] = toks if keep_stop or not roll.stopped_R[row] else toks[:-1]
        ends.append("stop" if roll.stopped_R[row] else "engine" if mt > MAX_NEW else "max")
    return out, tokens / (time.perf_counter() - start)

  def through_jetstream(mode: str) -> tuple[list[list[int]], float]:
    pre = ja.as_jetstream(eng_a, bos_id=BOS)
    post = pre if mode == "interleaved" else ja.as_jetstream(eng_b, bos_id=BOS)
    driver = orchestrator.Driver(prefill_engines=[pre], generate_engines=[post],
                                 prefill_params=[params_a],
                                 generate_params=[params_a if post is pre else params_b],
                                 interleaved_mode=mode == "interleaved")
    try:
      streams, elapsed = None, 0.0
      for _ in range(2):  # the first run compiles
        reqs = lambda: [ja.token_request(p, mt, has_bos=hb, orchestrator=orchestrator)  # noqa
                        for p, (_, mt, hb) in zip(prompts, REQUESTS)]
        start = time.perf_counter()
        streams = asyncio.run(ja.serve_streams(driver, reqs))
        elapsed = time.perf_counter() - start
    finally:
      driver.stop()
    return streams, sum(map(len, streams)) / elapsed

  rows = []
  for mode in ("interleaved", "disaggregated"):
    engine, params = (eng_a, params_a) if mode == "interleaved" else (eng_b, params_b)
    expected(engine, params)  # compiles
    want, native_tps = expected(engine, params)
    got, js_tps = through_jetstream(mode)
    same = [g == w for g, w in zip(got, want)]
    for i, ok in enumerate(same):
      if not ok or args.verbose:
        print(f"  {mode} request {i} {REQUESTS[i]}: jetstream {got[i]} generate {want[i]}",
              flush=True)
    ends_by = "/".join(str(ends.count(e)) for e in ("stop", "engine", "max"))
    rows.append(dict(mode=mode, api=gen, equal=sum(same), requests=len(same), ends=ends_by,
                     js_tps=js_tps, native_tps=native_tps, devices=len(devs)))
  rows.append(_backend_row(cfg, ecfg, model, seen, gen, len(devs)))
  with open(args.json, "w") as f:
    json.dump(rows, f)
  return 0 if all(r["equal"] == r["requests"] for r in rows) else 1


def _backend_row(cfg, ecfg, model, prompts, gen: str, devices: int) -> dict:
  """rollout.backend=jetstream against engine: 2 samples per prompt at temperature 1, the
  same request keys; rows equal when tokens, lengths, stops agree and log-probs are close."""
  import dataclasses

  import numpy as np

  from distflow_jax.rollout import SamplingParams, backend

  conf = dataclasses.replace(ecfg, sampling=SamplingParams(temperature=1.0))
  native = backend.make_backend("engine", cfg, conf)
  js = backend.make_backend("jetstream", cfg, conf)
  params = native.load_params(model)
  outs, tps = [], []
  for b in (js, native):
    b.generate(params, prompts, n=2)  # compiles
    start = time.perf_counter()
    out = b.generate(params, prompts, n=2)
    tps.append(out.num_tokens / (time.perf_counter() - start))
    outs.append(out)
  a, c = outs
  same = [bool(np.array_equal(a.tokens_RxN[r], c.tokens_RxN[r]) and a.lengths_R[r] == c.lengths_R[r]
               and a.stopped_R[r] == c.stopped_R[r]
               and np.allclose(a.logprobs_RxN[r], c.logprobs_RxN[r], atol=1e-5))
          for r in range(len(a.lengths_R))]
  ends = "/".join(str(n) for n in (int(c.stopped_R.sum()), int((~c.stopped_R).sum()), 0))
  return dict(mode="backend n=2 T=1", api=gen, equal=sum(same), requests=len(same), ends=ends,
              js_tps=tps[0], native_tps=tps[1], devices=devices)


def print_table(table: list[dict]) -> None:
  """One row per (version, mode), or a FAILED row for a version with no result."""
  out = bc.Table(*[bc.Col(t, w, "<") for t, w in (
      ("jetstream", 10), ("interface", 11), ("mode", 18), ("requests", 10), ("ends*", 8),
      ("equal", 7), ("jetstream tok/s", 17), ("native tok/s", 15))], sep="")
  for r in table:
    if "failed" in r:
      out.row(r["version"], "-", "-", f"FAILED (exit {r['failed']})")
      continue
    out.row(r["version"], r["api"], r["mode"], r["requests"], r["ends"],
            f"{r['equal']}/{r['requests']}", f"{r['js_tps']:.1f}", f"{r['native_tps']:.1f}")


def main(argv: list[str]) -> int:
  inner, argv = bc.inside_venv(argv)
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--versions", default="0.2.2,main", help="comma list of 0.2.2, main")
  ap.add_argument("--main-src", default="", help="a git directory holding MAIN_COMMIT "
                  "(else pip fetches it from GitHub)")
  ap.add_argument("--json", default="", help=argparse.SUPPRESS)
  ap.add_argument("--verbose", action="store_true", help="print every stream")
  args = ap.parse_args(argv)
  if inner:
    return run_inside(args)
  table = []
  for version in args.versions.split(","):
    py = ensure_venv(version, args)
    env = bc.child_env(devices=2, JAX_PLATFORMS="cpu", TF_CPP_MIN_LOG_LEVEL="3")
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
      cmd = [py, os.path.abspath(__file__), bc.INSIDE_VENV, "--json", out.name]
      code = subprocess.run(cmd + (["--verbose"] if args.verbose else []), env=env).returncode
      rows = bc.read_json(out.name) or []
    if not rows:
      # JetStream's threads SIGKILL the process when one of them raises (JetThread).
      print(f"JetStream {version}: no result (exit {code}); see the traceback above")
    table += [dict(version=version, **r) for r in rows] or [dict(version=version, mode="-",
                                                                 api="-", failed=code)]
  print()
  print_table(table)
  ok = table and all(r.get("equal", -1) == r.get("requests") for r in table)
  print(f"* streams ending at a stop token / the engine's {MAX_NEW}-token limit / max_tokens; "
        f"tok/s: orchestrator vs generate, or backend jetstream vs engine\n"
        f"(tiny random model on CPU, {len(REQUESTS)} token requests on {SLOTS} slots, greedy; "
        f"tok/s of the second, warm run; main = JetStream {MAIN_COMMIT[:12]})")
  return 0 if ok else 1


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
