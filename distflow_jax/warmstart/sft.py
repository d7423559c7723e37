"""The supervised fine-tuning loop: token cross-entropy on completions, prompts masked.

One loop serves both the built-in warm start (warmstart.py) and ``distflow-jax sft``
(sft_run.py).  Examples are the RL batch's layout (``encode_examples`` /
sft_data.py): left-padded prompts, right-padded completion + EOS; the loss is the
mean NLL of the completion tokens.  Batches are drawn from a seeded permutation
(a new one per pass), the same on every process, so step ``k``'s batch follows
from (seed, k) alone and a resumed run replays the order up to its step.  Each
batch is placed on the model's mesh sharded over its data-parallel axes.

    state.tx = sft.optimizer(lr=1e-4, steps=200, warmup_steps=20)
    state.opt_state = placement.init_opt_state(state.tx, state.params)
    sft.train(state, data, steps=200, batch_size=16, seed=0, on_step=hook)
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from distflow_jax.algos import losses
from distflow_jax.train import steps as steps_lib
from distflow_jax.state.roles import ModelState
from distflow_jax.data.fields import RESPONSE_MASK

Data = Mapping[str, np.ndarray]


def sft_loss(graphdef, params, mb) -> losses.LossOutput:
  """Summed NLL of the completion tokens (``response_mask``); the step divides by their count."""
  logp, _ = steps_lib.response_logprobs(graphdef, params, mb)
  m = mb[RESPONSE_MASK].astype(jnp.float32)
  return losses.LossOutput(-jnp.sum(logp * m), jnp.sum(m), jnp.sum(m), {})


def optimizer(*, lr: float, steps: int, warmup_steps: int, weight_decay: float = 0.0,
              grad_clip: float = 1.0) -> optax.GradientTransformation:
  """AdamW with a linear warm-up from 0 to ``lr`` over ``warmup_steps``, then cosine decay to
  0 at ``steps``, after a global-norm clip (0 = none)."""
  sched = (optax.warmup_cosine_decay_schedule(0.0, lr, warmup_steps, steps) if warmup_steps > 0
           else optax.cosine_decay_schedule(lr, steps))
  opt = optax.adamw(sched, weight_decay=weight_decay)
  return optax.chain(optax.clip_by_global_norm(grad_clip), opt) if grad_clip > 0 else opt


def data_parallel(mesh: Mesh) -> tuple[NamedSharding, int]:
  """Rows sharded over the mesh's data-parallel axes, and how many shards that makes."""
  dp = tuple(a for a in ("data", "fsdp") if a in mesh.axis_names)
  return NamedSharding(mesh, P(dp)), int(np.prod([mesh.shape[a] for a in dp]))


def batch_order(n: int, batch_size: int, seed: int) -> Iterator[np.ndarray]:
  """The row indices of every step's batch: consecutive slices of a seeded permutation,
  a new permutation when the rest would not fill a batch."""
  if batch_size > n:
    raise ValueError(f"SFT batch_size={batch_size} exceeds the {n} examples")
  rng = np.random.default_rng(seed)
  order, pos = rng.permutation(n), 0
  while True:
    if pos + batch_size > n:
      order, pos = rng.permutation(n), 0
    yield np.sort(order[pos:pos + batch_size])
    pos += batch_size


def make_step(graphdef, tx):
  """The SFT train step: the completion tokens' mean NLL, one micro-batch (``plan --lower``
  lowers this same step)."""
  return steps_lib.make_train_step(sft_loss, graphdef, tx, 1, "token-mean")


def train(state: ModelState, data: Data, *, steps: int, batch_size: int, seed: int,
          start: int = 0, on_step: Callable[[int, dict], None] | None = None,
          adapter_dropout: bool = False) -> None:
  """Trains ``state`` (its ``tx`` and ``opt_state`` set) in place from step ``start`` to
  ``steps`` on ``data`` (global rows, the same on every process).

  ``on_step(done, stats)`` runs after each step with the step's device stats (sums, see
  ``steps.make_train_step``); the state then holds the weights after ``done`` steps.
  ``adapter_dropout``: the model's LoRA adapters drop their inputs (``model.lora.dropout``
  > 0), step ``i`` drawing from ``dropout_key(seed, i)``, so a resumed run draws the same.
  """
  if state.tx is None or state.opt_state is None:
    raise ValueError("sft.train: the state needs an optimizer (tx) and its opt_state")
  n = len(data[RESPONSE_MASK])
  order = batch_order(n, batch_size, seed)
  for _ in range(start):  # the batches the checkpointed steps already took
    next(order)
  step_fn = make_step(state.graphdef, state.tx)
  sharding, _ = data_parallel(state.mesh)
  for i in range(start, steps):
    idx = next(order)
    mb = {k: jax.device_put(v[idx], sharding) for k, v in data.items()}
    rng = steps_lib.replicated_key(dropout_key(seed, i), state.mesh) if adapter_dropout else None
    state.params, state.opt_state, stats = step_fn(state.params, state.opt_state, mb, rng)
    if on_step is not None:
      on_step(i + 1, stats)


def dropout_key(seed: int, step: int) -> jax.Array:
  """The PRNG key of SFT step ``step``'s adapter dropout (apart from RL's keys)."""
  return jax.random.fold_in(jax.random.fold_in(jax.random.key(seed), 0x5F7), step)


def mean_loss(stats: Mapping[str, jax.Array]) -> float:
  """The mean token NLL of a step's (or an evaluation's) stats."""
  stats = jax.device_get(stats)
  return float(stats["total"]) / max(float(stats["count"]), 1.0)


def heldout_loss_fn(state: ModelState, batch_size: int) -> Callable[[Data], float]:
  """``fn(data) -> mean completion-token NLL`` of the current ``state.params`` over every row
  of ``data``, in chunks of ``batch_size`` (the last one padded with masked rows)."""
  sharding, _ = data_parallel(state.mesh)
  nll = jax.jit(lambda params, mb: sft_loss(state.graphdef, params, mb))

  def fn(data: Data) -> float:
    n = len(data[RESPONSE_MASK])
    total = count = 0.0
    for s in range(0, n, batch_size):
      idx = np.arange(s, s + batch_size) % n
      mb = {k: v[idx] for k, v in data.items()}
      mb[RESPONSE_MASK] = mb[RESPONSE_MASK] & (np.arange(s, s + batch_size) < n)[:, None]
      out = jax.device_get(nll(state.params, {k: jax.device_put(v, sharding)
                                              for k, v in mb.items()}))
      total, count = total + float(out.total), count + float(out.count)
    return total / max(count, 1.0)
  return fn
