"""Child program: one rollout replica per host (tensor-parallel over its 2 devices).

The actor's weights live FSDP-sharded over all 4 devices of both processes;
each host syncs them into its replica, generates for its own prompts (a
different number per host, no cross-host synchronisation while decoding),
and the gathered results must equal single-device generation of all prompts.
"""

import numpy as np

from distflow_jax import distributed

info = distributed.initialize()

import jax  # noqa: E402  (after initialize)
from flax import nnx  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402

from distflow_jax.models import ModelConfig, Transformer, sharding  # noqa: E402
from distflow_jax.rollout import (Engine, EngineConfig, SamplingParams, generate,  # noqa: E402
                                  replica_mesh)

CFG = ModelConfig(arch="qwen2", vocab_size=64, hidden_size=64, intermediate_size=128,
                  num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, qkv_bias=True,
                  tie_embeddings=False)
PROMPTS = [[3, 1, 4, 1, 5], [9, 2, 6, 5, 3, 5, 8, 9, 7, 9], [2, 7], [1] * 16, [11, 12, 13]]
NEW, ROWS = 6, 3

model = Transformer(CFG, rngs=nnx.Rngs(0))  # same seed on every process
nnx.update(model, jax.tree.map(lambda x: x * 10.0 if x.ndim == 2 else x,
                               nnx.state(model, nnx.Param)))
model.lm_head.kernel[...] = model.lm_head.kernel[...] * 5.0
host_state = jax.tree.map(np.asarray, nnx.state(model))

# The training layout: FSDP over every device of every process.
train_mesh = sharding.make_mesh({"fsdp": jax.device_count()})
shardings = sharding.state_shardings(nnx.state(model), train_mesh, sharding.fsdp_tp_rules())
train_state = jax.tree.map(
    lambda x, s: jax.make_array_from_callback(x.shape, s, lambda idx, x=x: x[idx]),
    host_state, shardings)

ecfg = EngineConfig(max_concurrent_decodes=2, prefill_buckets=(8, 16), max_new_tokens=NEW,
                    sampling=SamplingParams(0.0), decode_steps=3)
engine = Engine(CFG, ecfg, replica_mesh(2))  # this host's 2 devices, tensor-parallel
assert set(engine.mesh.devices.flat) == set(jax.local_devices())
params = engine.update_params(train_state)  # the one cross-host step

mine = PROMPTS[info.process_index::info.process_count]
out = generate(engine, params, mine)
tokens = np.zeros((ROWS, NEW), np.int32)
logprobs = np.zeros((ROWS, NEW), np.float32)
tokens[:len(mine)], logprobs[:len(mine)] = out.tokens_RxN, out.logprobs_RxN
all_tokens = multihost_utils.process_allgather(tokens)      # [processes, ROWS, NEW]
all_logprobs = multihost_utils.process_allgather(logprobs)

# Reference: one device, all prompts, from the host copy of the weights.
ref_engine = Engine(CFG, ecfg, replica_mesh(1, jax.local_devices()[:1]))
ref = generate(ref_engine, ref_engine.load_params(model), PROMPTS)
for i, _ in enumerate(PROMPTS):
  p, row = i % info.process_count, i // info.process_count
  np.testing.assert_array_equal(all_tokens[p, row], ref.tokens_RxN[i], err_msg=f"prompt {i}")
  np.testing.assert_allclose(all_logprobs[p, row], ref.logprobs_RxN[i], atol=1e-5)
assert len({tuple(t) for t in ref.tokens_RxN.tolist()}) == len(PROMPTS)
print(f"OK process {info.process_index}/{info.process_count} generated {len(mine)} prompts")
