"""The engine's decode program: one per run, no conditional and no loop whose predicate
reads data (on a GPU each copies a predicate to the host and blocks), a fixed number of
tokens per call with the early exit decided by the host between calls."""

import jax
import numpy as np
import pytest

from test_rollout_engine import CFG, SAMPLED, peaky_model

from distflow_jax.lowering.gate import compiled_counts
from distflow_jax.rollout import Engine, EngineConfig, generate, replica_mesh


def _engine(**kw):
  return Engine(CFG, EngineConfig(max_concurrent_decodes=4, prefill_buckets=(8, 16),
                                  max_new_tokens=20, sampling=SAMPLED, decode_steps=4,
                                  stop_ids=(0,), **kw), replica_mesh(1, jax.devices()[:1]))


@pytest.mark.timeout(120)
def test_one_decode_program_without_conditionals_or_data_dependent_loops():
  eng = _engine()
  params = eng.load_params(peaky_model())
  sig = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
                     params)
  decodes = [p for p in eng.programs(sig) if p.name.startswith("decode")]
  assert len(decodes) == 1, [p.name for p in decodes]  # one cache capacity for the run
  lowered = decodes[0].fn.lower(*decodes[0].args)
  assert "stablehlo.case" not in lowered.as_text()
  conditionals, whiles, unknown = compiled_counts(lowered.compile().as_text())
  assert whiles >= 1  # the decode loop itself (and the PRNG's), each of a known trip count
  assert (conditionals, unknown) == (0, 0), (conditionals, whiles, unknown)


@pytest.mark.timeout(120)
def test_each_call_decodes_k_tokens_and_the_host_stops_when_every_row_is_done():
  eng = _engine()
  params = eng.load_params(peaky_model(1, sharpness=1.0))
  calls = []
  chunk = eng.generate_steps

  def counted(p, state):
    state, out = chunk(p, state)
    calls.append(np.asarray(out.valid_BxK))
    return state, out
  eng.generate_steps = counted
  out = generate(eng, params, [[3, 1, 4], [2, 7], [5]], n=2, rng=jax.random.key(0))
  assert all(v.shape == (4, 4) for v in calls)  # slots x decode_steps, every call
  # 6 requests on 4 slots: the last call still had a row decoding, and no call was made
  # after every row had finished (the first token comes from the prefill).
  assert calls[-1].any() and len(calls) <= 2 * -(-(20 - 1) // 4)
  assert int(sum(v.sum() for v in calls)) == int(out.lengths_R.sum()) - 6


@pytest.mark.timeout(120)
def test_rope_tables_are_made_once_per_call_not_per_layer():
  """Issue 32 item 2: one cos and one sin per forward (the RoPE table every layer's q and k
  share), in the decode program and in a plain, a prefix and a multimodal-RoPE forward."""
  import jax.numpy as jnp
  from flax import nnx

  from distflow_jax.models.transformer import forward
  assert CFG.num_layers >= 2
  eng = _engine()
  params = eng.load_params(peaky_model())
  sig = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
                     params)
  decode = next(p for p in eng.programs(sig) if p.name.startswith("decode"))
  text = decode.fn.lower(*decode.args).as_text()
  assert (text.count("stablehlo.cosine"), text.count("stablehlo.sine")) == (1, 1)

  def trig(fn, *args):
    eqns = str(jax.make_jaxpr(fn)(*args))
    return eqns.count(" cos "), eqns.count(" sin ")
  g, p = nnx.split(peaky_model())
  tok = jnp.ones((2, 5), jnp.int32)
  pos = jnp.broadcast_to(jnp.arange(5), (2, 5))
  assert trig(lambda p: forward(g, p, tok, pos)[0], p) == (1, 1)
  assert trig(lambda p: forward(g, p, tok, pos, return_kv=True)[1], p) == (1, 1)
  vl_cfg = CFG.replace(mrope_section=(CFG.head_dim // 4, CFG.head_dim // 8, CFG.head_dim // 8))
  from distflow_jax.models.transformer import Transformer
  g3, p3 = nnx.split(Transformer(vl_cfg, rngs=nnx.Rngs(0)))
  assert trig(lambda p: forward(g3, p, tok, pos, rope_positions_3xBxT=jnp.stack([pos] * 3))[0],
              p3) == (1, 1)
