"""Deterministic mode: the same step on 8, 4 and 2 data-parallel devices is bitwise equal."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from distflow_jax.models import sharding
from distflow_jax.train import deterministic, placement, steps
from loss_settings import actor_loss_settings
from test_train_steps import CFG, make_batch, model_and_params, with_old_logprobs

B = 8


def _place(graphdef, params, batch, d):
  devs = jax.devices()[:d]
  pmesh = sharding.make_mesh({"fsdp": d}, devs)
  bmesh = sharding.make_mesh({"data": d}, devs)
  p = jax.device_put(params, sharding.state_shardings(params, pmesh, sharding.fsdp_tp_rules()))
  b = jax.device_put(batch, NamedSharding(bmesh, P("data")))
  return p, b, bmesh


def _run(d, *, steps_n=2, agg="token-mean", clip=1.0, unit_rows=1, lr=0.5):
  graphdef, params = model_and_params()
  batch = with_old_logprobs(graphdef, params, make_batch())
  loss_cfg = actor_loss_settings(loss_agg=agg, kl_coef=0.1)
  loss_fn = lambda g, p, mb: steps.actor_loss(g, p, mb, loss_cfg, 512)  # noqa: E731
  tx = optax.adamw(lr)
  p, b, bmesh = _place(graphdef, params, batch, d)
  opt = placement.init_opt_state(tx, p)
  step = deterministic.make_train_step(loss_fn, graphdef, tx, bmesh, unit_rows, agg, clip)
  stats = []
  for _ in range(steps_n):
    p, opt, s = step(p, opt, b)
    stats.append(jax.device_get(s))
  return [np.asarray(x) for x in jax.tree.leaves(p)], stats


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean"])
@pytest.mark.llvm_level1  # bitwise; at LLVM level 0 it differs by an ulp
def test_deterministic_step_is_bitwise_equal_on_8_4_2_devices(agg):
  # One device is not in the set: XLA compiles a single-device program without SPMD
  # partitioning and its per-unit gradient differs in the last bits (README).
  runs = {d: _run(d, agg=agg) for d in (8, 4, 2)}
  ref_params, ref_stats = runs[8]
  for d, (params, stats) in runs.items():
    for a, b in zip(ref_params, params):
      np.testing.assert_array_equal(a, b, err_msg=f"{d} devices")
    for s0, s in zip(ref_stats, stats):
      for key in s0:
        np.testing.assert_array_equal(s0[key], s[key], err_msg=f"{d} devices: {key}")
  assert ref_stats[0]["skipped"] == 0 and ref_stats[1]["skipped"] == 0


@pytest.mark.timeout(300)
def test_deterministic_step_agrees_with_the_default_step():
  """Same maths as the default step, only the order of the sums differs."""
  graphdef, params = model_and_params()
  batch = with_old_logprobs(graphdef, params, make_batch())
  loss_cfg = actor_loss_settings(kl_coef=0.1)
  loss_fn = lambda g, p, mb: steps.actor_loss(g, p, mb, loss_cfg, 512)  # noqa: E731
  p, b, bmesh = _place(graphdef, params, batch, 4)
  tx = optax.sgd(1.0)
  clipped = optax.chain(optax.clip_by_global_norm(0.5), tx)
  plain = steps.make_train_step(loss_fn, graphdef, clipped, 2, "token-mean")
  det = deterministic.make_train_step(loss_fn, graphdef, tx, bmesh, 1, "token-mean", 0.5)
  p1, _, s1 = plain(jax.tree.map(jnp.copy, p), clipped.init(p), b)
  p2, _, s2 = det(jax.tree.map(jnp.copy, p), tx.init(p), b)
  np.testing.assert_allclose(float(s1["grad_norm"]), float(s2["grad_norm"]), rtol=1e-5)
  np.testing.assert_allclose(float(s1["total"]), float(s2["total"]), rtol=1e-5)
  for x, y in zip(jax.tree.leaves(p1), jax.tree.leaves(p2)):
    np.testing.assert_allclose(x, y, atol=1e-6)


def test_units_must_be_a_power_of_two_per_device():
  assert deterministic.units_per_device(16, 4, 1) == 4
  with pytest.raises(deterministic.LayoutError, match="power of two"):
    deterministic.units_per_device(24, 4, 2)
  with pytest.raises(deterministic.LayoutError, match="do not split"):
    deterministic.units_per_device(10, 4, 1)


@pytest.mark.timeout(300)
def test_per_unit_logprobs_are_bitwise_equal_on_any_layout():
  graphdef, params = model_and_params()
  batch = make_batch()
  fn = lambda g, p, b: steps.response_logprobs(g, p, b)[0]  # noqa: E731
  outs = []
  for d in (8, 4, 2):
    p, b, bmesh = _place(graphdef, params, batch, d)
    outs.append(np.asarray(deterministic.per_unit(fn, bmesh, 1)(graphdef, p, b)))
  want = np.asarray(jax.jit(fn, static_argnums=0)(graphdef, params, batch))
  np.testing.assert_allclose(outs[0], want, atol=1e-5)
  for o in outs[1:]:
    np.testing.assert_array_equal(outs[0], o)


@pytest.mark.timeout(300)
def test_infinite_learning_rate_is_a_skipped_step_not_nan_weights():
  """A finite gradient times lr=inf is not finite: the step is refused (issue 16)."""
  graphdef, params = model_and_params()
  batch = with_old_logprobs(graphdef, params, make_batch())
  loss_cfg = actor_loss_settings()
  loss_fn = lambda g, p, mb: steps.actor_loss(g, p, mb, loss_cfg, 512)  # noqa: E731
  for lr in (float("inf"), float("nan")):
    tx = optax.sgd(lr)
    before = [np.asarray(x) for x in jax.tree.leaves(params)]
    step = steps.make_train_step(loss_fn, graphdef, tx, 1, "token-mean")
    new_p, _, stats = step(jax.tree.map(jnp.copy, params), tx.init(params), batch)
    assert int(stats["skipped"]) == 1, lr
    for a, b in zip(before, jax.tree.leaves(new_p)):
      np.testing.assert_array_equal(a, b)


@pytest.mark.timeout(120)
def test_train_rows_go_in_sample_id_order_whatever_the_layout_loaded():
  """A process loads every process_count-th prompt and its rows come as a block, so 2
  processes give the rows of prompts 0 2 4 6 1 3 5 7; the canonical tree sums units by row
  position, so the deterministic train node sorts the rows by sample id first."""
  from types import SimpleNamespace

  from distflow_jax.data import layout as dlayout
  from distflow_jax.nodes import training
  ctx = SimpleNamespace(jitted=lambda key, make: make())
  lay = dlayout.Layout(sharding.make_mesh({"data": 4}, jax.devices()[:4]), ("data",))
  ids = np.array([0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15], np.int32)
  rows = np.arange(16 * 3, dtype=np.float32).reshape(16, 3)
  data = {"x": jax.device_put(rows, lay.sharding)}
  out = training.row_order(ctx, lay)(data, jax.device_put(ids, lay.sharding))
  np.testing.assert_array_equal(np.asarray(out["x"]), rows[np.argsort(ids)])
  assert out["x"].sharding.is_equivalent_to(lay.sharding, 2)
