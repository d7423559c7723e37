"""Per-device memory of the run's real jitted steps, compiled ahead of time on abstract shapes.

The actor's train step (``train.steps.make_train_step`` with the train node's loss) and
the log-prob pass (``train.steps.response_logprobs``) are lowered and compiled with
``jax.ShapeDtypeStruct`` inputs that carry the run's shardings, on the plan's meshes
(simulated CPU devices are enough: XLA partitions the program per device before it
sizes buffers).  ``memory_analysis()`` then gives each device's argument, output, temp
and alias bytes.  Model state comes from ``nnx.eval_shape`` and optimizer state from
``jax.eval_shape``, so no parameter is ever allocated.  The rollout KV cache is the
abstract shape of ``rollout.decode.empty_state`` in the engine's shardings; the weight
sync is ``rollout.weight_sync.WeightSync``'s own steps, compiled the same way.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from distflow_jax.config.response import response_width
from distflow_jax.data.fields import PROMPT_MASK, PROMPT_TOKENS, RESPONSE_MASK, RESPONSE_TOKENS
from distflow_jax.models import lora, sharding
from distflow_jax.models.config import ModelConfig
from distflow_jax.models.transformer import Transformer
from distflow_jax.nodes import training
from distflow_jax.rollout.engine import decode
from distflow_jax.rollout.engine.config import decode_state_shardings
from distflow_jax.rollout.weight_sync import WeightSync
from distflow_jax.train import placement, steps as steps_lib


@dataclasses.dataclass(frozen=True)
class StepMemory:
  """``memory_analysis()`` of one compiled step, bytes per device."""
  argument: int
  output: int
  temp: int
  alias: int

  @property
  def peak(self) -> int:
    """Live at once: inputs, temporaries and the outputs not written over donated inputs."""
    return self.argument + self.temp + self.output - self.alias


def device_bytes(tree: Any) -> int:
  """Bytes one device holds of a tree of sharded ``ShapeDtypeStruct``s (the largest shard)."""
  total = 0
  for x in jax.tree.leaves(tree):
    shape = x.sharding.shard_shape(x.shape) if x.sharding is not None else x.shape
    total += math.prod(shape) * jnp.dtype(x.dtype).itemsize
  return total


def _sds(x: Any, sh: Any) -> jax.ShapeDtypeStruct:
  return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh)


def abstract_model(model_cfg: ModelConfig, mesh: Mesh) -> tuple[nnx.GraphDef, Any]:
  """``(graphdef, state)`` of the actor with every leaf a sharded ``ShapeDtypeStruct``."""
  abstract = nnx.eval_shape(lambda: Transformer(model_cfg, rngs=nnx.Rngs(0)))
  graphdef, state = nnx.split(abstract)
  shardings = sharding.state_shardings(state, mesh, sharding.fsdp_tp_rules())
  return graphdef, jax.tree.map(_sds, state, shardings)


def abstract_opt_state(tx: Any, params: Any, mesh: Mesh) -> Any:
  """``tx.init(params)`` abstractly, laid out as ``placement.init_opt_state`` leaves it: a
  leaf under a parameter's path (Adam's moments) in that parameter's sharding, the rest
  (step counts) replicated."""
  by_path = {sharding.path_str(kp): x.sharding
             for kp, x in jax.tree_util.tree_leaves_with_path(params)}
  rep = NamedSharding(mesh, P())

  def place(kp, x):
    path = sharding.path_str(kp)
    sh = next((s for p, s in by_path.items() if path.endswith("/" + p)), rep)
    return _sds(x, sh if sh.shard_shape(x.shape) is not None and len(sh.spec) <= x.ndim
                else rep)
  trainable = lora.split_trainable(params)[0]  # LoRA: the adapters' state only
  return jax.tree_util.tree_map_with_path(place, jax.eval_shape(tx.init, trainable))


def abstract_batch(rows: int, prompt_len: int, new_tokens: int, layout: NamedSharding,
                   extra: tuple[str, ...]) -> dict[str, jax.ShapeDtypeStruct]:
  """The sequence batch as the rollout node builds it (see ``train.steps``' docstring)."""
  spec = {PROMPT_TOKENS: ((rows, prompt_len), jnp.int32),
          PROMPT_MASK: ((rows, prompt_len), jnp.bool_),
          RESPONSE_TOKENS: ((rows, new_tokens), jnp.int32),
          RESPONSE_MASK: ((rows, new_tokens), jnp.bool_)}
  spec.update({k: ((rows, new_tokens), jnp.float32) for k in extra})
  return {k: jax.ShapeDtypeStruct(s, d, sharding=layout) for k, (s, d) in spec.items()}


def grad_bytes(params: Any) -> int:
  """One device's gradient buffers in the train step: the float32 accumulator (16-bit
  parameters accumulate in float32, train/steps.py) plus one micro-batch's gradients."""
  params = lora.split_trainable(params)[0]  # LoRA: the adapters' gradients only
  acc = jax.tree.map(lambda x: jax.ShapeDtypeStruct(
      x.shape, steps_lib.accumulator_dtype(x.dtype), sharding=x.sharding), params)
  return device_bytes(acc) + device_bytes(params)


def _stats(compiled: Any) -> StepMemory:
  m = compiled.memory_analysis()
  return StepMemory(argument=int(m.argument_size_in_bytes), output=int(m.output_size_in_bytes),
                    temp=int(m.temp_size_in_bytes), alias=int(m.alias_size_in_bytes))


def train_step_memory(cfg: ml_collections.ConfigDict, graphdef: nnx.GraphDef, params: Any,
                      opt_state: Any, tx: Any, batch: dict, micro: int, group_size: int
                      ) -> StepMemory:
  """The actor train node's step, compiled by the ``PinnedStep`` the node uses (state
  donated, outputs pinned to the inputs' shardings, rows split over data and fsdp)."""
  loss_cfg = steps_lib.ActorLoss.from_config(cfg.actor, response_width(cfg.rollout),
                                             group_size)
  loss_fn = functools.partial(training._actor_loss, cfg=loss_cfg)  # the node's own loss
  step = steps_lib.make_train_step(loss_fn, graphdef, tx, micro, loss_cfg.loss_agg, group_size)
  return _stats(step.jitted_for(params, opt_state).lower(params, opt_state, batch).compile())


def logprob_memory(graphdef: nnx.GraphDef, params: Any, batch: dict, group_size: int,
                   layout: NamedSharding) -> StepMemory:
  """The log-prob pass (``logprob`` / ``ref_logprob`` nodes) over the whole step's batch."""
  fn = lambda p, b: steps_lib.response_logprobs(graphdef, p, b, group_size=group_size)[0]  # noqa: E731
  fn = placement.rows_sharded_on(fn, placement.params_mesh(params))
  return _stats(jax.jit(fn, out_shardings=layout).lower(params, batch).compile())


def rollout_state_bytes(model_cfg: ModelConfig, mesh: Mesh, slots: int, cache_len: int
                        ) -> tuple[int, int]:
  """``(parameter bytes, decode-state bytes)`` per device of one rollout replica on ``mesh``
  (``data`` x ``tensor``): the engine's own shardings of the synced weights and the state
  ``rollout.decode.empty_state`` builds (KV cache, slot bookkeeping)."""
  _, params = abstract_model(model_cfg, mesh)
  state = jax.eval_shape(functools.partial(decode.empty_state, model_cfg, slots, cache_len))
  state = jax.tree.map(_sds, state, decode_state_shardings(mesh, model_cfg))
  return device_bytes(params), device_bytes(state)


def sync_memory(model_cfg: ModelConfig, train_mesh: Mesh, replica: Mesh,
                process_of: Any) -> Any:
  """The weight sync's ``SyncMemory`` per training device (rollout/weight_sync.py): the
  actor's parameters laid out on ``train_mesh`` (one array per layer, as the engine hands
  them over) into a replica on ``replica``, with each device's process from the plan's
  topology (``process_of``: the simulation runs in one process)."""
  loop = model_cfg.replace(scan_layers=False)
  _, train = abstract_model(loop, train_mesh)
  _, dst = abstract_model(loop, replica)
  return WeightSync(jax.tree.map(lambda x: x.sharding, dst), process_of).memory(train)
