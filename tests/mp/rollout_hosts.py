"""Child program: one rollout replica per host (tensor-parallel over its 2 devices).

The actor's weights live FSDP-sharded over all 4 devices of both processes;
each host syncs them into its replica, generates for its own prompts (a
different number per host, no cross-host synchronisation while decoding),
and the gathered results must equal the same replica generating every prompt, bitwise
(greedy and sampled with global request ids); a single-device replica agrees to
float32 rounding.
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

# Reference: this host's replica (the same shape: TP over its 2 devices) generating every
# prompt itself.  Which prompts a replica holds, and next to which others they are batched,
# must not change a token: bitwise, greedy and sampled.
ref = generate(engine, params, PROMPTS)
for i, _ in enumerate(PROMPTS):
  p, row = i % info.process_count, i // info.process_count
  np.testing.assert_array_equal(all_tokens[p, row], ref.tokens_RxN[i], err_msg=f"prompt {i}")
  np.testing.assert_allclose(all_logprobs[p, row], ref.logprobs_RxN[i], atol=1e-5)
assert len({tuple(t) for t in ref.tokens_RxN.tolist()}) == len(PROMPTS)

# Sampled, with global request ids: host p's samples of its prompts equal the samples of
# the same requests when one replica generates all of them.
N_SAMPLES = 2
sampled = Engine(CFG, EngineConfig(max_concurrent_decodes=4, prefill_buckets=(8, 16),
                                   max_new_tokens=NEW, sampling=SamplingParams(1.0),
                                   decode_steps=3), replica_mesh(2))
sp = sampled.update_params(train_state)
key = jax.random.key(7)
ids = [np.arange(N_SAMPLES) + N_SAMPLES * i for i in range(len(PROMPTS))]
mine_ids = np.concatenate(ids[info.process_index::info.process_count])
got = generate(sampled, sp, mine, N_SAMPLES, rng=key, request_ids=mine_ids)
every = generate(sampled, sp, PROMPTS, N_SAMPLES, rng=key)
for j, i in enumerate(range(info.process_index, len(PROMPTS), info.process_count)):
  for s in range(N_SAMPLES):
    np.testing.assert_array_equal(got.tokens_RxN[j * N_SAMPLES + s],
                                  every.tokens_RxN[i * N_SAMPLES + s], err_msg=f"{i}/{s}")
    np.testing.assert_allclose(got.logprobs_RxN[j * N_SAMPLES + s],
                               every.logprobs_RxN[i * N_SAMPLES + s], atol=1e-5)

# One device (another replica shape): the same policy, to float32 rounding.  Tokens may
# differ at a near-tie, so only the log-probs of the tokens both chose are compared.
one = Engine(CFG, ecfg, replica_mesh(1, jax.local_devices()[:1]))
single = generate(one, one.load_params(model), PROMPTS)
same = single.tokens_RxN == ref.tokens_RxN
assert same.mean() > 0.8, same
first_diff = np.where(same.all(1), NEW, np.argmin(same, axis=1))
for i in range(len(PROMPTS)):
  k = first_diff[i]
  np.testing.assert_allclose(single.logprobs_RxN[i, :k], ref.logprobs_RxN[i, :k], atol=1e-4)
print(f"OK process {info.process_index}/{info.process_count} generated {len(mine)} prompts")
