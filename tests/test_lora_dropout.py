"""LoRA adapter dropout (``model.lora.dropout``): PEFT's dropout on the adapter's input,
in the train step only, its masks from a key the step is given.

p = 0 leaves the step as it was (no random op); p > 0 changes the adapters' update, the
same for the same key and differently for another (step, call); the log-prob passes
(and anything outside a train step) compute as with p = 0; deterministic mode stays
bitwise equal across layouts."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from distflow_jax.config import loading
from distflow_jax.dag.spec import Node, NodeType, Role
from distflow_jax.models import Transformer, lora, lora_layer, sharding
from distflow_jax.models.lora_layer import LoraSpec
from distflow_jax.nodes import training
from distflow_jax.state.context import RunContext
from distflow_jax.train import deterministic, placement, steps
from loss_settings import actor_loss_settings
from test_bad_inputs_corpus import run
from test_lora import ALL, cfg, randomize_b
from test_train_steps import make_batch

P_DROP = 0.3


@functools.cache
def _params(dropout: float, scan: bool = False):
  """A LoRA model (B random, so A has a gradient too) with this dropout rate: the same
  weights for every rate.  Built once per (rate, layout) in this module; callers never
  change it (the steps below take a copy, as they donate their parameters)."""
  base = Transformer(cfg(scan=scan), rngs=nnx.Rngs(0))
  model = randomize_b(lora.attach(base, LoraSpec(4, 8.0, ALL, dropout=dropout), seed=3))
  return nnx.split(model)


@functools.cache
def _base_batch(scan: bool):
  """The batch with the dropout-free model's log-probs, once per layout."""
  return _batch(*_params(0.0, scan))


def _batch(graphdef, params):
  batch = make_batch()
  lp, _ = jax.jit(steps.response_logprobs, static_argnums=0)(graphdef, params, batch)
  return {**batch, "old_logprobs": np.asarray(lp), "ref_logprobs": np.asarray(lp)}


def _loss(g, p, mb):
  return steps.actor_loss(g, p, mb, actor_loss_settings(kl_coef=0.1), 512)


def _key(*fold) -> jax.Array:
  key = jax.random.key(7)
  for f in fold:
    key = jax.random.fold_in(key, f)
  return jax.random.key_data(key)


TX = optax.sgd(1.0)


@functools.cache
def _step(dropout: float, scan: bool, micro: int):
  """One jitted sgd(1) step per (rate, layout, micro-batches), shared by this module's
  calls: a call with another key runs the same program on other masks."""
  return steps.make_train_step(_loss, _params(dropout, scan)[0], TX, micro, "token-mean")


def _update(dropout: float, rng, *, scan: bool = False, micro: int = 2):
  """The adapters' update (new - old) of one sgd(1) step: minus their gradient."""
  _, params = _params(dropout, scan)
  batch = _base_batch(scan)
  step = _step(dropout, scan, micro)
  before = lora.split_trainable(params)
  new, _, stats = step(jax.tree.map(jnp.copy, params), placement.init_opt_state(TX, params),
                       batch, rng)
  after = lora.split_trainable(new)
  assert int(stats["skipped"]) == 0
  for x, y in zip(jax.tree.leaves(before[1]), jax.tree.leaves(after[1])):
    assert np.asarray(x).tobytes() == np.asarray(y).tobytes()  # the base never moves
  return [np.asarray(b) - np.asarray(a)
          for a, b in zip(jax.tree.leaves(before[0]), jax.tree.leaves(after[0]))]


def _same(xs, ys) -> bool:
  return all(x.tobytes() == y.tobytes() for x, y in zip(xs, ys))


@pytest.mark.timeout(300)
def test_layer_drops_the_adapter_input_only():
  """y = x @ W + dropout(x) @ a @ b * alpha / r with W = a = b = I and alpha / r = 1: the
  adapter's share is 0 or x / (1 - p) per entry, the base's is x, masks differ per layer
  and per projection, and without a key nothing is dropped."""
  d = 16
  spec = LoraSpec(d, float(d), ("q_proj",), dropout=0.5)
  layer = lora_layer.LoRALinear(d, d, spec=spec, rngs=nnx.Rngs(0), name="q_proj",
                                use_bias=False)
  other = lora_layer.LoRALinear(d, d, spec=spec, rngs=nnx.Rngs(0), name="k_proj",
                                use_bias=False)
  for m in (layer, other):
    m.kernel[...] = jnp.eye(d)
    m.lora_a[...] = jnp.eye(d)
    m.lora_b[...] = jnp.eye(d)
  x = jax.random.normal(jax.random.key(0), (64, d)) + 3.0  # no zero entries
  np.testing.assert_array_equal(layer(x), 2 * x)  # outside a train step: no dropout
  key = jax.random.key(1)
  with lora_layer.adapter_dropout(key):
    with lora_layer.dropout_layer(0):
      share0, other0 = np.asarray(layer(x) - x), np.asarray(other(x) - x)
    with lora_layer.dropout_layer(1):
      share1 = np.asarray(layer(x) - x)
  xs = np.asarray(x)
  for share in (share0, other0, share1):
    dropped = share == 0
    np.testing.assert_allclose(share[~dropped], 2 * xs[~dropped], rtol=1e-6)
    assert 0.4 < dropped.mean() < 0.6, dropped.mean()
  assert (share0 == 0).tolist() != (other0 == 0).tolist()  # per projection
  assert (share0 == 0).tolist() != (share1 == 0).tolist()  # per layer


@pytest.mark.timeout(300)
def test_zero_dropout_step_has_no_random_op_and_is_bitwise_unchanged():
  _, params = _params(0.0)
  batch = _base_batch(False)
  step = _step(0.0, False, 2)
  text = step.lower(params, TX.init(lora.split_trainable(params)[0]), batch).as_text()
  assert "threefry" not in text and "rng" not in text.lower()
  # p = 0 given a key, or p > 0 given none (a caller without dropout): the plain step.
  plain = _update(0.0, None)
  assert _same(plain, _update(0.0, _key(0)))
  assert _same(plain, _update(P_DROP, None))
  dropped = _step(P_DROP, False, 2)
  assert "threefry" in dropped.lower(params, TX.init(lora.split_trainable(params)[0]), batch,
                                     _key(0)).as_text()


@pytest.mark.timeout(300)
@pytest.mark.parametrize("scan", [False, True])
def test_dropout_changes_the_update_reproducibly_per_key(scan):
  plain = _update(0.0, None, scan=scan)
  one = _update(P_DROP, _key(1), scan=scan)
  assert not any(np.array_equal(a, b) for a, b in zip(plain, one) if np.any(a))
  assert _same(one, _update(P_DROP, _key(1), scan=scan))       # same key: same masks
  assert not _same(one, _update(P_DROP, _key(2), scan=scan))   # another step: others


@pytest.mark.timeout(300)
def test_logprob_passes_ignore_dropout():
  g0, p0 = _params(0.0)
  g1, p1 = _params(P_DROP)
  batch = make_batch()
  fn = jax.jit(steps.response_logprobs, static_argnums=0)
  for a, b in zip(fn(g0, p0, batch), fn(g1, p1, batch)):
    assert np.asarray(a).tobytes() == np.asarray(b).tobytes()


def _ctx(step: int, dropout: float) -> RunContext:
  """A context with only what the train node's key reads: the config and the step."""
  c = loading.load("grpo:tiny", ["model.lora.enabled=True", f"model.lora.dropout={dropout}"])
  return RunContext(cfg=c, plan=None, topo=None, process_index=0, tokenizer=None,
                    model_cfg=None, roles={}, step=step)


@pytest.mark.timeout(300)
def test_node_keys_follow_seed_step_and_call():
  mesh = sharding.make_mesh({"data": 2}, jax.devices()[:2])
  lay = type("Lay", (), {"mesh": mesh})()
  node = Node(id="train_actor", role=Role.ACTOR, type=NodeType.MODEL_TRAIN, fn="train.actor")
  key = lambda step, call, p=P_DROP, role=Role.ACTOR: training.dropout_rng(  # noqa: E731
      _ctx(step, p), node, role, lay, call)
  k = np.asarray(key(3, 0))
  assert key(3, 0).sharding == NamedSharding(mesh, P())
  assert k.tobytes() == np.asarray(key(3, 0)).tobytes()      # a resumed step: the same
  assert k.tobytes() != np.asarray(key(4, 0)).tobytes()      # the next step: another
  assert k.tobytes() != np.asarray(key(3, 1)).tobytes()      # the next mini-batch: another
  assert key(3, 0, p=0.0) is None and key(3, 0, role=Role.CRITIC) is None
  # plan --lower lowers the step with this key's abstract twin
  spec = training.dropout_rng_spec(_ctx(3, P_DROP), Role.ACTOR, lay)
  real = key(3, 0)
  assert (spec.shape, spec.dtype, spec.sharding) == (real.shape, real.dtype, real.sharding)
  assert training.dropout_rng_spec(_ctx(3, 0.0), Role.ACTOR, lay) is None


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.llvm_level1  # bitwise; at LLVM level 0 it differs by an ulp
def test_deterministic_dropout_step_is_bitwise_equal_on_8_and_2_devices():
  graphdef, params = _params(P_DROP)
  batch = _base_batch(False)
  tx = optax.adamw(0.1)

  def adapters_after(d, *rngs):
    """The adapters after one deterministic step on d devices, per key: one program."""
    devs = jax.devices()[:d]
    pmesh = sharding.make_mesh({"fsdp": d}, devs)
    bmesh = sharding.make_mesh({"data": d}, devs)
    where = sharding.state_shardings(params, pmesh, sharding.fsdp_tp_rules())
    b = jax.device_put(batch, NamedSharding(bmesh, P("data")))
    step = deterministic.make_train_step(_loss, graphdef, tx, bmesh, 1, "token-mean", 1.0)
    out = []
    for rng in rngs:
      p = jax.device_put(jax.tree.map(jnp.copy, params), where)  # the step donates it
      new, _, stats = step(p, placement.init_opt_state(tx, p), b, rng)
      assert int(stats["skipped"]) == 0
      out.append([np.asarray(x) for x in jax.tree.leaves(lora.split_trainable(new)[0])])
    return out

  eight, other_key = adapters_after(8, _key(5), _key(6))
  (two,) = adapters_after(2, _key(5))
  assert _same(eight, two)
  # The masks are drawn (another key: another update), so the equality above is dropout's.
  assert not _same(eight, other_key)


@pytest.mark.timeout(120)
def test_plan_accepts_dropout_and_refuses_out_of_range(capsys):
  code, err = run(capsys, "plan", "--config=grpo:tiny", "--config.model.lora.enabled=True",
                  "--config.model.lora.dropout=0.05")
  assert code == 0, err
  code, err = run(capsys, "plan", "--config=grpo:tiny", "--config.model.lora.enabled=True",
                  "--config.model.lora.dropout=1.0")
  assert code == 2 and "model.lora.dropout=1.0 must be in [0, 1)" in err


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_one_grpo_step_with_dropout_trains_only_the_adapters(tmp_path):
  """Through the trainer: the node hands the step its key (placed on the actor's mesh)."""
  from test_lora_steps import _one_step
  ctx, m = _one_step("grpo:tiny", tmp_path, "model.lora.dropout=0.1", "actor.mini_batches=2")
  actor = ctx.roles[Role.ACTOR]
  model = nnx.merge(actor.graphdef, actor.params)
  rates = {x.lora_dropout for _, x in nnx.iter_graph(model)
           if isinstance(x, lora_layer.LoRALinear)}
  assert rates == {0.1}
  assert m["actor/kl"] == pytest.approx(0.0, abs=1e-6)  # B starts at zero: no change yet
