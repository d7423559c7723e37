"""Gradients accumulate across micro-batches in float32 whatever the parameters' dtype
(train/steps.make_train_step).  With bfloat16 parameters, the gradient of 8 micro-batches
is closer to the one-big-batch gradient than a bfloat16 running sum makes it (the old
accumulator, reproduced here by forcing ``steps.accumulator_dtype`` to the parameters'
dtype); it reaches an optimizer with float32 master weights unrounded, and one without
them in the parameters' dtype (its state keeps its dtypes: no recompile)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from distflow_jax.models import Transformer
from distflow_jax.train import optim, steps
from loss_settings import actor_loss_settings
from test_train_steps import CFG, make_batch

M = 8


def _recording_tx() -> optax.GradientTransformation:
  """An optimizer that changes nothing and keeps, in float32, the gradient it was given
  (and its dtype, in ``dtype_is_f32``)."""
  def init(params):
    return {"g": jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params),
            "dtype_is_f32": jnp.bool_(False)}

  def update(grads, state, params=None):
    del state, params
    f32 = all(g.dtype == jnp.float32 for g in jax.tree.leaves(grads))
    return (jax.tree.map(jnp.zeros_like, grads),
            {"g": jax.tree.map(lambda g: g.astype(jnp.float32), grads),
             "dtype_is_f32": jnp.bool_(f32)})
  return optax.GradientTransformation(init, update)


def _setup():
  cfg = CFG.replace(dtype="bfloat16", hidden_size=128, intermediate_size=256)
  graphdef, params = nnx.split(Transformer(cfg, rngs=nnx.Rngs(0)))
  batch = make_batch(1)
  lp, _ = jax.jit(steps.response_logprobs, static_argnums=0)(graphdef, params, batch)
  batch = {**batch, "old_logprobs": np.asarray(lp) - 0.05}  # ratios off 1: unclipped terms
  loss_cfg = actor_loss_settings()
  loss_fn = lambda g, p, mb: steps.actor_loss(g, p, mb, loss_cfg, 512)  # noqa: E731
  return graphdef, params, batch, loss_fn


def _step_grad(setup, m, master):
  """The gradient the optimizer receives from a step of ``m`` micro-batches."""
  graphdef, params, batch, loss_fn = setup
  tx = optim.with_master_weights(_recording_tx()) if master else _recording_tx()
  step = steps.make_train_step(loss_fn, graphdef, tx, m, "token-mean")
  p = jax.tree.map(jnp.copy, params)
  _, opt, _ = step(p, tx.init(p), batch)
  state = opt.inner if master else opt
  return jax.tree.map(np.asarray, state["g"]), bool(state["dtype_is_f32"])


def _dist(a, b):
  return float(np.sqrt(sum(np.sum((np.asarray(x, np.float64) - np.asarray(y, np.float64))
                                  ** 2) for x, y in zip(jax.tree.leaves(a),
                                                        jax.tree.leaves(b)))))


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_bf16_micro_batches_accumulate_in_float32(monkeypatch):
  setup = _setup()
  assert {x.dtype for x in jax.tree.leaves(setup[1])} == {jnp.dtype(jnp.bfloat16)}
  big, _ = _step_grad(setup, 1, master=True)
  new_master, f32_in = _step_grad(setup, M, master=True)
  new_plain, plain_f32_in = _step_grad(setup, M, master=False)
  assert f32_in and not plain_f32_in  # the float32 sum, or cast once for a bf16 optimizer
  with monkeypatch.context() as mp:  # the old accumulator: a bfloat16 running sum
    mp.setattr(steps, "accumulator_dtype", jnp.dtype, raising=False)
    old, _ = _step_grad(setup, M, master=True)
  err_new, err_plain, err_old = (_dist(g, big) for g in (new_master, new_plain, old))
  print(f"|8 micro-batches - 1 batch|: float32 sum {err_new:.3e} (cast to bf16 "
        f"{err_plain:.3e}), bfloat16 sum {err_old:.3e}; |grad| "
        f"{_dist(big, jax.tree.map(np.zeros_like, big)):.3e}")
  assert err_old > 1.4 * err_new
  assert err_old > 1.2 * err_plain
