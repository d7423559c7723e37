"""What the engine computes a 16-bit model in on CPU devices (``rollout.cpu_compute``,
rollout/engine/config.CpuCompute; issue 55).  XLA's CPU backend has no 16-bit matmul here:
a bfloat16 engine converted every weight to float32 at every decode call and its KV cache
at every step (the profile in docs/benchmarks.md).  By default the engine on a CPU now holds
float32 copies of a bfloat16 model's weights (exact: each bfloat16 value is a float32 one)
and a float32 cache, and computes in float32: the same numbers as a float32 engine given the
bfloat16-rounded weights, bitwise.  ``model`` keeps the model's dtype; a LoRA actor whose
adapters are synced alone keeps it too (their merge on the rollout devices keeps the
base's)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from test_rollout_engine import CFG, PROMPTS, peaky_model
from test_rollout_weight_sync import fsdp_state

from distflow_jax.models import Transformer
from distflow_jax.models.lora_layer import LoraSpec
from distflow_jax.rollout import Engine, EngineConfig, SamplingParams, generate, replica_mesh
from distflow_jax.rollout.engine.config import CpuCompute, LoraSync, compute_dtype

BF16 = CFG.replace(dtype="bfloat16")


def _engine(cfg, cpu=CpuCompute.FLOAT32, **kw):
  return Engine(cfg, EngineConfig(max_concurrent_decodes=4, prefill_buckets=(8, 16),
                                  max_new_tokens=8, sampling=SamplingParams(0.0),
                                  decode_steps=3, cpu_compute=cpu, **kw),
                replica_mesh(1, jax.devices()[:1]))


def _bf16_model(seed=0):
  """peaky_model's weights rounded to bfloat16, in a bfloat16 model."""
  src = peaky_model(seed)
  model = Transformer(BF16, rngs=nnx.Rngs(seed))
  nnx.update(model, jax.tree.map(lambda x: x.astype(jnp.bfloat16), nnx.state(src, nnx.Param)))
  return model


def _dtypes(tree):
  return {str(x.dtype) for x in jax.tree.leaves(tree) if jnp.issubdtype(x.dtype, jnp.floating)}


@pytest.mark.timeout(300)
def test_a_bf16_engine_on_cpu_computes_in_float32_exactly_as_a_float32_engine():
  model = _bf16_model()
  eng = _engine(BF16)
  assert eng.compute_dtype == "float32" and eng.model_cfg.dtype == "bfloat16"
  loaded = eng.load_params(model)
  synced = eng.update_params(fsdp_state(model))  # a bfloat16 trainer's layout
  assert _dtypes(loaded) == _dtypes(synced) == {"float32"}
  for params in (loaded, synced):  # the bfloat16 values, exactly
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a),
                                                            np.asarray(b, np.float32)),
                 params, nnx.state(model, nnx.Param))
  state = eng.init_decode_state()
  assert {str(k.dtype) for k in state.cache.k + state.cache.v} == {"float32"}
  out = generate(eng, synced, PROMPTS, n=2)
  # A float32 engine given the bfloat16-rounded weights: the same program, bitwise.
  f32 = _engine(CFG)
  ref = generate(f32, f32.load_params(jax.tree.map(lambda x: x.astype(jnp.float32),
                                                   nnx.state(model, nnx.Param))), PROMPTS, n=2)
  np.testing.assert_array_equal(out.tokens_RxN, ref.tokens_RxN)
  np.testing.assert_array_equal(out.logprobs_RxN, ref.logprobs_RxN)


@pytest.mark.timeout(300)
def test_cpu_compute_model_keeps_the_models_dtype():
  model = _bf16_model()
  eng = _engine(BF16, CpuCompute.MODEL)
  assert eng.compute_dtype == "bfloat16"
  params = eng.update_params(fsdp_state(model))
  assert _dtypes(params) == {"bfloat16"}
  state = eng.init_decode_state()
  assert {str(k.dtype) for k in state.cache.k + state.cache.v} == {"bfloat16"}
  out = generate(eng, params, PROMPTS, n=1)
  assert out.tokens_RxN.shape[0] == len(PROMPTS)


def test_the_compute_dtype_table():
  """float32 only for a 16-bit model on CPU devices under float32, and never with LoRA
  adapters synced alone; a float32 model, other devices and ``model`` keep the model's."""
  cfg = EngineConfig()
  model = EngineConfig(cpu_compute="model")
  assert compute_dtype(BF16, cfg, "cpu") == "float32"
  assert compute_dtype(CFG.replace(dtype="float16"), cfg, "cpu") == "float32"
  assert compute_dtype(CFG, cfg, "cpu") == "float32" == CFG.dtype
  for platform in ("gpu", "cuda", "tpu"):
    assert compute_dtype(BF16, cfg, platform) == "bfloat16"
  assert compute_dtype(BF16, model, "cpu") == "bfloat16"
  lora = BF16.replace(lora=LoraSpec(rank=2, alpha=4.0, targets=("q_proj",)))
  assert compute_dtype(lora, cfg, "cpu") == "float32"  # merged: the plain sync
  assert compute_dtype(lora, dataclasses.replace(cfg, lora_sync=LoraSync.ADAPTERS),
                       "cpu") == "bfloat16"
  with pytest.raises(ValueError, match="'half'"):
    EngineConfig(cpu_compute="half")


def test_the_run_config_picks_it_and_refuses_an_unknown_one():
  from distflow_jax.config import defaults
  from distflow_jax.config.loading import ConfigError
  from distflow_jax.config.values import check_values
  cfg = defaults.base()
  assert EngineConfig.from_config(cfg.rollout).cpu_compute is CpuCompute.FLOAT32
  cfg.rollout.cpu_compute = "model"
  assert EngineConfig.from_config(cfg.rollout).cpu_compute is CpuCompute.MODEL
  cfg.rollout.cpu_compute = "half"
  with pytest.raises(ConfigError, match=r"rollout.cpu_compute='half' is not valid; choose one "
                                        r"of \['float32', 'model'\]"):
    check_values(cfg)


def test_a_lowering_for_a_gpu_keeps_the_models_dtype():
  """`plan --lower` builds the engine on (simulated) CPU devices for a GPU target: the
  target's platform decides, so the lowered programs are the bfloat16 ones a GPU runs."""
  from distflow_jax.models import target
  with target.lowering_for(target.TARGETS["h100"]):
    assert _engine(BF16).compute_dtype == "bfloat16"
  with target.lowering_for(target.TARGETS["cpu"]):
    assert _engine(BF16).compute_dtype == "float32"


def test_a_runs_engine_takes_the_rollout_sections_engine_settings():
  """The run's engines (state/replicas.engine_config) read rollout.cpu_compute and
  rollout.fuse_projections; the latter was dropped there before (the key then did nothing
  in a run)."""
  from distflow_jax.config import defaults
  from distflow_jax.rollout.engine.config import FuseProjections
  from distflow_jax.state.replicas import engine_config
  cfg = defaults.base()
  conf = engine_config(cfg, cfg.rollout, (1,))
  assert conf.cpu_compute is CpuCompute.FLOAT32 and conf.fuse_projections is FuseProjections.NONE
  cfg.rollout.cpu_compute, cfg.rollout.fuse_projections = "model", "all"
  for greedy in (False, True):  # the rollout's engine and evaluation's
    conf = engine_config(cfg, cfg.rollout, (1,), greedy=greedy)
    assert conf.cpu_compute is CpuCompute.MODEL and conf.fuse_projections is FuseProjections.ALL
