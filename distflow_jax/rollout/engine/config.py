"""The engine's static settings and placement: `EngineConfig`, `replica_mesh`, `place_params`,
and the shardings of its decode state and prefixes (`decode_state_shardings`,
`prefix_shardings`).

Split from `engine` so that other rollout backends (`backend`, `reference`) and the
memory planner read the same settings and layouts without pulling in the engine.
`EngineConfig` and `replica_mesh` are re-exported by `distflow_jax.rollout.engine`.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Any, Sequence

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from distflow_jax.models import fused, sharding as msharding
from distflow_jax.models.config import ModelConfig
from distflow_jax.models.transformer import KVCache, Transformer
from distflow_jax.rollout.engine.decode import DecodeState, Prefix
from distflow_jax.rollout.engine.sampling import SamplingParams


class LoraSync(enum.Enum):
  """How a LoRA actor's weights reach the engine (``rollout.lora_sync``; rollout/lora_sync.py):
  ``merged`` merges ``W + a @ b * alpha / r`` on the training mesh and syncs every weight;
  ``adapters`` syncs the frozen base once into the engine's own copy, then only the adapters,
  and merges on the rollout devices."""
  MERGED = "merged"
  ADAPTERS = "adapters"


class FuseProjections(enum.Enum):
  """Which projections of each layer the engine's weights fuse (``rollout.fuse_projections``;
  models/fused.py): one matmul for gate/up, and with ``all`` one for q/k/v too.  On XLA:CPU
  in float32 (2026-11-27, tests/test_fused_projections.py) ``gate_up`` gives the unfused
  engine's tokens and log-probs bitwise; ``all`` the same tokens, log-probs within 2e-5."""
  NONE = "none"
  GATE_UP = "gate_up"
  ALL = "all"


FUSED_NAMES = {FuseProjections.NONE: (), FuseProjections.GATE_UP: ("gate_up_proj",),
               FuseProjections.ALL: ("qkv_proj", "gate_up_proj")}


class CpuCompute(enum.Enum):
  """What an engine on CPU devices computes a bfloat16 / float16 model in
  (``rollout.cpu_compute``).  ``float32``: it holds float32 copies of the weights (exact:
  every 16-bit value is a float32 one) and a float32 KV cache, and computes in float32.
  XLA's CPU backend has no 16-bit matmul here: it converts each 16-bit weight to float32
  at every decode call and the cache at every step (tools/bench_decode.py's profile,
  docs/benchmarks.md), so float32 does less work; it costs the engine's copy twice the
  bytes, and its log-probs carry no 16-bit rounding of the activations.  ``model``: the
  model's own dtype, as on an accelerator.  Other devices always compute in the model's."""
  FLOAT32 = "float32"
  MODEL = "model"


def compute_dtype(model_cfg: ModelConfig, config: "EngineConfig", platform: str) -> str:
  """The dtype an engine of ``config`` holds and computes ``model_cfg`` in, on ``platform``
  (``models.target.current()``'s: the target `plan --lower` lowers for, else the device jax
  runs on): float32 for a 16-bit model on CPU devices under CpuCompute.FLOAT32
  (not with LoRA adapters synced alone: their merge on the rollout devices keeps the
  base's dtype), else the model's."""
  adapters = config.lora_sync is LoraSync.ADAPTERS and model_cfg.lora is not None
  if (platform == "cpu" and config.cpu_compute is CpuCompute.FLOAT32 and not adapters
      and model_cfg.dtype in ("bfloat16", "float16")):
    return "float32"
  return model_cfg.dtype


def cast_floats(tree: Any, dtype: str | None) -> Any:
  """``tree`` with its floating-point leaves in ``dtype`` (None: as it is)."""
  if dtype is None:
    return tree
  return jax.tree.map(lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating)
                      else x, tree)


@dataclasses.dataclass(frozen=True)
class EngineConfig:
  """Static shape of the engine: changing any field means new compiles."""
  max_concurrent_decodes: int = 16
  prefill_buckets: tuple[int, ...] = (32, 64)
  max_new_tokens: int = 32
  stop_ids: tuple[int, ...] = ()
  # Token sequences that end a request like a stop id when its generated tokens end with
  # one (a tool call's closing tag of several tokens: rollout/episodes.call_stops); matched
  # in the decode loop against each slot's last tokens (decode.ends_sequence).  A sequence
  # of one token joins stop_ids.
  stop_sequences: tuple[tuple[int, ...], ...] = ()
  sampling: SamplingParams = SamplingParams()
  decode_steps: int = 16      # tokens per compiled decode call (K)
  seed: int = 0
  # Every prefill has all slots' rows and the largest bucket (decode attention always reads
  # the whole cache): a request's numbers then never depend on which other requests share
  # the replica (trainer.deterministic); costs padded prefill.
  fixed_shapes: bool = False
  # One full-size decode cache for the run (one decode program).  True: the driver's cache
  # starts at the smallest capacity that holds the longest prompt bucket plus one chunk and
  # grows (rollout/engine/cache_growth.py; bitwise the same results, less memory early on, one
  # decode program per capacity).  fixed_shapes keeps one full-size cache.
  grow_cache: bool = False
  lora_sync: LoraSync = LoraSync.MERGED
  # Multi-turn episodes (rollout.env; rollout/episode_engine.py): the longest response an
  # episode's slot holds across its turns (generated + observation tokens).  The cache holds
  # it after the longest prompt bucket, and the engine's programs include the append
  # programs (rollout/engine/extend.py, one per appended-length bucket).  0: single turns.
  episode_tokens: int = 0

  # The engine's weights with gate/up (and q/k/v) fused into one projection each (one
  # matmul apiece per layer and token; models/fused.py), concatenated as they enter the
  # engine; the trained model keeps them apart.  With lora_sync=adapters a run refuses it
  # (config/lora_checks.py); the engine itself then leaves its weights unfused.
  fuse_projections: FuseProjections = FuseProjections.NONE
  # What the engine computes a 16-bit model in on CPU devices (CpuCompute).
  cpu_compute: CpuCompute = CpuCompute.FLOAT32

  def __post_init__(self):
    object.__setattr__(self, "lora_sync", LoraSync(self.lora_sync))
    object.__setattr__(self, "cpu_compute", CpuCompute(self.cpu_compute))
    object.__setattr__(self, "fuse_projections", FuseProjections(self.fuse_projections))
    object.__setattr__(self, "prefill_buckets", tuple(sorted(set(self.prefill_buckets))))
    seqs = tuple(dict.fromkeys(tuple(int(i) for i in q) for q in self.stop_sequences))
    if any(not q for q in seqs):
      raise ValueError("EngineConfig.stop_sequences must not hold an empty sequence")
    ones = tuple(q[0] for q in seqs if len(q) == 1)
    object.__setattr__(self, "stop_ids",
                       tuple(dict.fromkeys(int(i) for i in (*self.stop_ids, *ones))))
    object.__setattr__(self, "stop_sequences", tuple(q for q in seqs if len(q) > 1))
    for name in ("max_concurrent_decodes", "max_new_tokens", "decode_steps"):
      value = getattr(self, name)
      if not isinstance(value, int) or value <= 0:
        raise ValueError(f"EngineConfig.{name}={value!r} must be a positive int")
    if not isinstance(self.episode_tokens, int) or self.episode_tokens < 0:
      raise ValueError(f"EngineConfig.episode_tokens={self.episode_tokens!r} must be an int "
                       ">= 0")
    if not self.prefill_buckets or any(not isinstance(b, int) or b <= 0
                                       for b in self.prefill_buckets):
      raise ValueError(f"EngineConfig.prefill_buckets={self.prefill_buckets!r} must be "
                       "positive ints")

  @classmethod
  def from_config(cls, rollout: Any, *, stop_ids: Sequence[int] = (), seed: int = 0,
                  max_new_tokens: int | None = None,
                  stop_sequences: Sequence[Sequence[int]] = ()) -> "EngineConfig":
    """From the `rollout` block of the run config (see config/defaults.py)."""
    return cls(max_concurrent_decodes=int(rollout.max_concurrent_decodes),
               prefill_buckets=tuple(int(b) for b in rollout.prefill_buckets),
               max_new_tokens=int(rollout.max_new_tokens if max_new_tokens is None
                                  else max_new_tokens),
               stop_ids=tuple(stop_ids), decode_steps=int(rollout.decode_chunk),
               stop_sequences=tuple(map(tuple, stop_sequences)),
               sampling=SamplingParams(temperature=float(rollout.temperature),
                                       top_p=float(rollout.top_p), top_k=int(rollout.top_k)),
               seed=int(seed), lora_sync=LoraSync(rollout.lora_sync),
               fuse_projections=FuseProjections(rollout.fuse_projections),
               cpu_compute=CpuCompute(rollout.cpu_compute))

  @property
  def history(self) -> int:
    """Generated tokens each slot keeps for the stop sequences' match (at least 1)."""
    return max([len(q) - 1 for q in self.stop_sequences], default=1) or 1

  def ends_on_stop(self, tokens: Sequence[int]) -> bool:
    """Whether a request's generated ``tokens`` end on a stop id or a stop sequence (the
    host's reading of what the decode loop stops on)."""
    toks = list(tokens)
    return bool(toks) and (toks[-1] in self.stop_ids or any(
        toks[-len(q):] == list(q) for q in self.stop_sequences))

  @property
  def cache_len(self) -> int:
    return self.prefill_buckets[-1] + max(self.max_new_tokens, self.episode_tokens)

  def bucket_for(self, length: int) -> int:
    """The smallest prefill bucket that holds `length` tokens."""
    for b in self.prefill_buckets:
      if length <= b:
        return b
    raise ValueError(f"prompt of {length} tokens is longer than the largest prefill bucket; "
                     f"buckets: {self.prefill_buckets}")


def replica_mesh(tensor_parallel: int = 1, devices: Sequence[jax.Device] | None = None) -> Mesh:
  """One rollout replica over `devices` (default: this host's): `data` x `tensor` axes."""
  devices = list(jax.local_devices() if devices is None else devices)
  if tensor_parallel <= 0 or len(devices) % tensor_parallel:
    raise ValueError(f"rollout tensor_parallel={tensor_parallel} must divide the replica's "
                     f"{len(devices)} devices")
  return msharding.make_mesh({"data": len(devices) // tensor_parallel,
                              "tensor": tensor_parallel}, devices)


def place_params(model_cfg: ModelConfig, params: nnx.State | nnx.Module | None, mesh: Mesh,
                 rules: msharding.Rules, shardings: Any, seed: int) -> nnx.State:
  """`params` (a model or its state) placed in a replica's layout; random init when None
  (the unfused model's values, fused where `model_cfg` fuses: models/fused.py)."""
  if params is None:
    model = msharding.create_sharded(lambda: Transformer(
        model_cfg.replace(fused_projections=()), rngs=nnx.Rngs(seed)), mesh, rules)
    params = nnx.state(model)
    if not model_cfg.fused_projections:
      return params
  if isinstance(params, nnx.Module):
    params = nnx.state(params)
  if model_cfg.fused_projections:
    params = fused.fuse(params, model_cfg.fused_projections)
  return jax.device_put(params, shardings)


def _kv_shardings(mesh: Mesh, model_cfg: ModelConfig, rows: str | None
                  ) -> tuple[NamedSharding, ...]:
  """Each layer's ``[B, Hkv, S, Dh]`` cache: rows over `rows`, KV heads over `tensor`
  where they divide."""
  tp = mesh.shape.get("tensor", 1)
  heads = "tensor" if tp > 1 and model_cfg.num_kv_heads % tp == 0 else None
  return (NamedSharding(mesh, P(rows, heads, None, None)),) * model_cfg.num_layers


def decode_state_shardings(mesh: Mesh, model_cfg: ModelConfig) -> DecodeState:
  """Shardings of a replica's `DecodeState`: slots over `data`, KV heads over `tensor`."""
  rows = NamedSharding(mesh, P("data"))
  return DecodeState(
      cache=KVCache(k=_kv_shardings(mesh, model_cfg, "data"),
                    v=_kv_shardings(mesh, model_cfg, "data"),
                    pos=NamedSharding(mesh, P("data", None))),
      tokens_B=rows, index_B=rows, generated_B=rows, limit_B=rows, active_B=rows,
      keys_Bx2=NamedSharding(mesh, P("data", None)),
      recent_BxJ=NamedSharding(mesh, P("data", None)))


def prefix_shardings(mesh: Mesh, model_cfg: ModelConfig) -> Prefix:
  """Shardings of a `Prefix` on a replica: rows replicated, KV heads over `tensor`."""
  rep = NamedSharding(mesh, P())
  kv = _kv_shardings(mesh, model_cfg, None)
  return Prefix(cache=KVCache(k=kv, v=kv, pos=rep), logits_PxV=rep, lengths_P=rep,
                tokens_P=rep, logprobs_P=rep, keys_Px2=rep)
