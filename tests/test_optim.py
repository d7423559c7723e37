"""Optimizers and schedules built from config."""

import numpy as np
import optax
import pytest

from distflow_jax.config import defaults
from distflow_jax.train import optim


def test_warmup_then_cosine_schedule_values():
  s = optim.learning_rate(1.0, "cosine", warmup_steps=4, total_steps=14)
  assert [float(s(i)) for i in (0, 2, 4)] == pytest.approx([0.0, 0.5, 1.0])
  # Half way through the 10 decay steps a cosine is at half the peak.
  assert float(s(9)) == pytest.approx(0.5, abs=1e-6)
  assert float(s(14)) == pytest.approx(0.0, abs=1e-6)


def test_linear_and_constant():
  lin = optim.learning_rate(2.0, "linear", warmup_steps=0, total_steps=10)
  assert float(lin(5)) == pytest.approx(1.0)
  const = optim.learning_rate(2.0, "constant", warmup_steps=0, total_steps=10)
  assert float(const(7)) == 2.0


def test_from_config_clips_gradients():
  section = defaults.optimizer(0.1)
  section.name = "sgd"
  section.grad_clip = 1.0
  tx = optim.from_config(section, total_steps=10)
  params = {"w": np.zeros(2, np.float32)}
  state = tx.init(params)
  updates, _ = tx.update({"w": np.array([30.0, 40.0], np.float32)}, state, params)
  # Global norm 50 clipped to 1, then SGD with lr 0.1.
  np.testing.assert_allclose(updates["w"], [-0.06, -0.08], rtol=1e-6)


@pytest.mark.parametrize("kw, pattern", [
    (dict(name="lion"), r"optimizer.name='lion'"),
    (dict(schedule="step"), r"optimizer.schedule='step'"),
])
def test_bad_optimizer_settings(kw, pattern):
  section = dict(defaults.optimizer(0.1))
  section.update(kw)
  with pytest.raises(ValueError, match=pattern):
    optim.from_config(section, total_steps=10)


def test_adamw_is_an_optax_transformation():
  tx = optim.from_config(defaults.optimizer(1e-3), total_steps=5)
  assert isinstance(tx, optax.GradientTransformation)
