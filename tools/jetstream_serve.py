"""Serving our engine behind JetStream's orchestrator and gRPC server.

    python3 tools/jetstream_serve.py                   # one request, checked, then exit
    python3 tools/jetstream_serve.py --venv /tmp/jetstream-main-venv
    python3 tools/jetstream_serve.py --serve --port 9000   # keep serving until Ctrl-C

Runs in a JetStream virtual environment (made by tools/jetstream_conformance.py:
/tmp/jetstream-venv for 0.2.2, /tmp/jetstream-main-venv for JetStream's last
main), re-executing itself there.  It builds an `Engine` over a tiny random
model (greedy; scaled-up weights so the tokens vary), wraps it with
`jetstream_adapter.as_jetstream`, starts `jetstream.core.orchestrator.Driver`
(interleaved) and `jetstream.core.server_lib.JetStreamServer` (JetStream's
gRPC `Orchestrator` service) on `--port`, then sends one token request with
JetStream's own client (the generated `jetstream_pb2_grpc.OrchestratorStub`,
`Decode`, streamed) and compares the streamed token ids with
`distflow_jax.rollout.generate` on the prompt JetStream prefilled (BOS first).
With `--serve` it keeps serving instead; any JetStream client can then send
`DecodeRequest(token_content=..., max_tokens=...)` to the port.

A real model: replace the random `Transformer` with your weights
(`engine.load_params(model)`) and pass a text tokenizer to `as_jetstream`.
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _bench_common as bc  # noqa: E402

BOS, STOP = 1, 2


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("localhost", 0))
    return s.getsockname()[1]


def run(args: argparse.Namespace) -> int:
  """Inside the venv: the server, one client request, the comparison."""
  import logging

  import grpc
  import jax
  from flax import nnx
  from jetstream.core import orchestrator, server_lib
  from jetstream.core.proto import jetstream_pb2, jetstream_pb2_grpc

  from distflow_jax.models import ModelConfig
  from distflow_jax.models.transformer import Transformer
  from distflow_jax.rollout import Engine, EngineConfig, SamplingParams, generate
  from distflow_jax.rollout import jetstream_adapter as ja

  logging.getLogger().setLevel(logging.WARNING)
  cfg = ModelConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_layers=2,
                    num_heads=4, num_kv_heads=2, head_dim=16)
  engine = Engine(cfg, EngineConfig(max_concurrent_decodes=4, prefill_buckets=(16, 32),
                                    max_new_tokens=args.max_tokens, stop_ids=(STOP,),
                                    sampling=SamplingParams(temperature=0.0), seed=0))
  model = Transformer(cfg, rngs=nnx.Rngs(0))
  nnx.update(model, jax.tree.map(lambda x: x * 10.0 if x.ndim == 2 else x,
                                 nnx.state(model, nnx.Param)))
  params = engine.load_params(model)
  js = ja.as_jetstream(engine, bos_id=BOS)
  driver = orchestrator.Driver(prefill_engines=[js], generate_engines=[js],
                               prefill_params=[params], generate_params=[params],
                               interleaved_mode=True)
  port = args.port or _free_port()
  server = server_lib.JetStreamServer(driver, 8, port, grpc.insecure_server_credentials())
  server.start()
  print(f"JetStream {ja.api_generation()} gRPC server on localhost:{port} serving "
        f"distflow_jax's engine", flush=True)
  try:
    if args.serve:
      server.wait_for_termination()
      return 0
    prompt = [int(t) for t in args.prompt.split(",")]
    with grpc.insecure_channel(f"localhost:{port}") as channel:
      stub = jetstream_pb2_grpc.OrchestratorStub(channel)
      request = jetstream_pb2.DecodeRequest(
          token_content=jetstream_pb2.DecodeRequest.TokenContent(token_ids=prompt),
          max_tokens=args.max_tokens)
      served = []
      for response in stub.Decode(request):
        for sample in response.stream_content.samples[:1]:
          served.extend(sample.token_ids)
  finally:
    if not args.serve:
      server.stop()
  ours = generate(engine, params, [[BOS] + prompt])
  mine = ours.tokens_RxN[0, :ours.lengths_R[0]].tolist()
  if ours.stopped_R[0] and ja.api_generation() != "main":
    mine = mine[:-1]  # 0.2.2 ends a stream before its stop token; main streams it
  same = served == mine
  print(f"prompt {prompt}\n  JetStream client (gRPC Decode): {served}\n"
        f"  distflow_jax.rollout.generate:  {mine}\n{'same' if same else 'DIFFERENT'}")
  return 0 if same else 1


def main(argv: list[str]) -> int:
  inner, argv = bc.inside_venv(argv)
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--venv", default="/tmp/jetstream-venv",
                  help="a JetStream venv (tools/jetstream_conformance.py makes them)")
  ap.add_argument("--port", type=int, default=0, help="0: a free one")
  ap.add_argument("--prompt", default="5,17,33,8,41,9", help="token ids, comma-separated")
  ap.add_argument("--max_tokens", type=int, default=8)
  ap.add_argument("--serve", action="store_true", help="keep serving until interrupted")
  args = ap.parse_args(argv)
  if inner:
    return run(args)
  py = os.path.join(args.venv, "bin", "python")
  if not os.path.exists(py):
    print(f"no venv at {args.venv}: run tools/jetstream_conformance.py first", file=sys.stderr)
    return 2
  env = bc.child_env(defaults=dict(JAX_PLATFORMS="cpu"), TF_CPP_MIN_LOG_LEVEL="3")
  return subprocess.run([py, os.path.abspath(__file__), bc.INSIDE_VENV] + argv,
                        env=env).returncode


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
