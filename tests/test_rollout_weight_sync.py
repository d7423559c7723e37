"""Weight sync: FSDP training layout over all devices -> a tensor-parallel rollout replica,
values exact, generation from the new weights, and no recompilation after the first sync."""

import jax
import numpy as np
import pytest
from flax import nnx

from distflow_jax.models import sharding
from distflow_jax.rollout import generate, replica_mesh
from test_rollout_engine import engine, full_forward_greedy, peaky_model

PROMPTS = [[3, 1, 4, 1, 5], [9, 2, 6, 5, 3, 5, 8, 9, 7, 9], [2, 7]]


def fsdp_state(model):
  mesh = sharding.make_mesh({"fsdp": len(jax.devices())})
  return sharding.shard_state(nnx.state(model), mesh, sharding.fsdp_tp_rules())


@pytest.mark.timeout(300)
def test_update_params_reshards_and_reuses_compiles():
  eng = engine(mesh=replica_mesh(2, jax.devices()[:4]))
  model_a, model_b = peaky_model(0), peaky_model(7)
  train_a = fsdp_state(model_a)
  q = train_a["layers"][0]["attn"]["q_proj"]["kernel"][...]
  assert q.sharding.spec[0] == "fsdp" and len(q.sharding.device_set) == 8

  params = eng.update_params(train_a)
  for (path, got), (_, want), (_, sh) in zip(nnx.to_flat_state(params),
                                            nnx.to_flat_state(nnx.state(model_a)),
                                            nnx.to_flat_state(eng.param_shardings)):
    np.testing.assert_array_equal(np.asarray(got[...]), np.asarray(want[...]), err_msg=str(path))
    assert got[...].sharding == sh.get_value(), path
  out = generate(eng, params, PROMPTS)
  for r, p in enumerate(PROMPTS):
    assert out.tokens_RxN[r].tolist() == full_forward_greedy(model_a, p, 8)
  counts = eng.compile_counts()
  assert counts["weight_sync"] == 2  # one all-gather, one local reshard

  params = eng.update_params(fsdp_state(model_b))
  out_b = generate(eng, params, PROMPTS)
  for r, p in enumerate(PROMPTS):
    assert out_b.tokens_RxN[r].tolist() == full_forward_greedy(model_b, p, 8)
  assert (out_b.tokens_RxN != out.tokens_RxN).any()
  assert eng.compile_counts() == counts  # nothing recompiled


def test_mismatched_model_is_refused():
  eng = engine()
  state = nnx.state(peaky_model())
  leaves = jax.tree.leaves(state)[:-1]
  with pytest.raises(ValueError, match="same model"):
    eng.update_params(leaves)
