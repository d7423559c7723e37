"""The `jetstream` rollout backend: JetStream's own orchestrator serving our engine.

    rollout: {backend: jetstream}      # needs google-jetstream (the `jetstream` extra)

Each `generate` call starts `jetstream.core.orchestrator.Driver` (interleaved:
one engine prefills and generates) over `jetstream_adapter.as_jetstream`,
sends the R = prompts x n requests as token requests (prompts as given, no
BOS added), waits for every stream, and stops the driver.  Importing this
module imports JetStream; `backend.BACKENDS["jetstream"]` imports it only when
the backend is chosen and refuses in one line when the package is missing.

Same samples as the `engine` backend: request r's key (`fold_in(rng,
request_ids[r])`) is handed to the r-th prefill (JetStream prefills in queue
order and passes no key itself).  JetStream streams token ids only, so the
tokens, log-probs and lengths of the returned `Rollout` are read from the
adapter's log of inserts and raw generate results (insert k is request k:
one prefill engine, FIFO queues), cut at the first stop token or the call's
`max_new_tokens`, and checked against the streamed ids.  Sampling log-probs
are the temperature-1 ones (plain sampling) or 0 (greedy); truncated or
tempered sampling is refused, since the engine's single-step API does not
report them.  A host sync per token: a serving path for conformance and
comparison, slower than `engine` (see tools/jetstream_conformance.py).
"""

from __future__ import annotations

import asyncio
from typing import Any, Callable, Sequence

import jax
import numpy as np
from jax.sharding import Mesh

from distflow_jax.config.errors import ConfigError
from distflow_jax.models import sharding as msharding
from distflow_jax.models.config import ModelConfig
from distflow_jax.rollout import driver, jetstream_adapter
from distflow_jax.rollout.engine_backend import EngineBackend
from distflow_jax.rollout.engine import Engine
from distflow_jax.rollout.engine.config import EngineConfig

jetstream_adapter.api_generation()  # JetStream importable (+ the adapter's shim), or ImportError
from jetstream.core import orchestrator  # noqa: E402  pylint: disable=wrong-import-position


class JetStreamBackend(EngineBackend):
  """The `jetstream` backend (see module doc): the engine backend's weights and settings,
  generation through JetStream's orchestrator."""

  name = "jetstream"

  def __init__(self, model_cfg: ModelConfig, config: EngineConfig, mesh: Mesh | None = None,
               rules: msharding.Rules | None = None, *, engine: Engine | None = None):
    sp = config.sampling
    if not sp.greedy and (sp.temperature != 1.0 or sp.top_k or sp.top_p < 1.0):
      raise ConfigError(f"rollout.backend=jetstream samples at temperature 1 without top_k/"
                        f"top_p, or greedily (its API reports no truncated log-probs); got "
                        f"{sp}")
    super().__init__(model_cfg, config, mesh, rules, engine=engine)

  def generate(self, params: Any, prompts: Sequence[Sequence[int]], n: int = 1, *,
               rng: jax.Array | None = None, request_ids: Sequence[int] | None = None,
               pad_id: int = 0, max_new_tokens: int | None = None) -> driver.RolloutResult:
    req = driver.prepare_requests(self.config, prompts, n, max_new_tokens=max_new_tokens,
                                  rng=rng, request_ids=request_ids)
    num = len(req.ids_R)
    js = jetstream_adapter.as_jetstream(self.engine)
    js.request_keys.extend(np.asarray(req.keys_Rx2))
    js.trace = []
    drv = orchestrator.Driver(prefill_engines=[js], generate_engines=[js],
                              prefill_params=[params], generate_params=[params],
                              interleaved_mode=True)
    try:
      streams = asyncio.run(_serve(drv, [req.prompts[r // n] for r in range(num)],
                                   req.max_new_tokens))
    finally:
      drv.stop()
    toks, lps = _replay_trace(js.trace, num, req.max_new_tokens, self.config.ends_on_stop)
    keep_stop = jetstream_adapter.api_generation() == "main"  # main streams the stop token
    for r in range(num):
      want = toks[r] if keep_stop or toks[r][-1] not in self.config.stop_ids else toks[r][:-1]
      if streams[r] != want:
        raise RuntimeError(f"jetstream backend: request {r} streamed {streams[r]}, the "
                           f"engine produced {toks[r]}")
    slps = [[0.0] * len(t) for t in toks] if self.config.sampling.greedy else lps
    return driver.assemble(toks, lps, slps, n, req.max_new_tokens, self.config.ends_on_stop,
                           pad_id)


async def _serve(drv: Any, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
  """Every prompt as a token request (no BOS added); each one's streamed ids."""
  return await jetstream_adapter.serve_streams(drv, lambda: [
      jetstream_adapter.token_request(p, max_tokens, has_bos=True, orchestrator=orchestrator)
      for p in prompts])


def _replay_trace(trace: list, num: int, n_max: int,
                  ends_on_stop: Callable[[Sequence[int]], bool]
                  ) -> tuple[list[list[int]], list[list[float]]]:
  """Each request's tokens and temperature-1 log-probs from the adapter's log."""
  toks: list[list[int]] = [[] for _ in range(num)]
  lps: list[list[float]] = [[] for _ in range(num)]
  live: dict[int, int] = {}  # slot -> request
  inserted = 0

  def add(r: int, token: int, lp: float) -> None:
    if len(toks[r]) < n_max and not ends_on_stop(toks[r]):
      toks[r].append(token)
      lps[r].append(lp)

  for event in trace:
    if event[0] == "insert":
      _, slot, first, first_lp = event
      live[slot] = inserted
      add(inserted, first, first_lp)
      inserted += 1
    else:
      tokens, valid, logprobs = (np.asarray(x) for x in event[1:])
      for slot, r in live.items():
        if valid[slot, 0]:
          add(r, int(tokens[slot, 0]), float(logprobs[slot, 0]))
  if inserted != num:
    raise RuntimeError(f"jetstream backend: {inserted} inserts for {num} requests")
  return toks, lps
