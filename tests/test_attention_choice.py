"""Attention that never crashes on a device (issue 31 item 2), checked on this CPU.

The kernel is chosen in Python (models/attention_choice.py) for the target device;
cuDNN's lengths are padded to a multiple of 64.  jax's own cuDNN checks are the judge:
``target.lowering_for(H100)`` lowers programs for CUDA here with jax's GPU probes
answering as an H100 would, so an odd length that crashed the first GPU train step
(``Unsupported sequence length Q 511, KV 511``) fails here too on the old code.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from distflow_jax.models import ModelConfig, Transformer, attention, attention_choice as ac
from distflow_jax.models import target as target_lib
from distflow_jax.train import steps
from loss_settings import actor_loss_settings

pytestmark = pytest.mark.timeout(240)

H100, A100, CPU = (target_lib.TARGETS[k] for k in ("h100", "a100", "cpu"))


def _jax_accepts(head_dim, t, s, cc, training=True, has_bias=True) -> bool:
  """jax's own rule (check_is_flash_attention) for a bf16 call, GPU probes answering as
  compute capability ``cc``."""
  from jax._src.cudnn import fused_attention_stablehlo as fa
  q = jax.ShapeDtypeStruct((1, t, 2, head_dim), jnp.bfloat16)
  k = jax.ShapeDtypeStruct((1, s, 2, head_dim), jnp.bfloat16)
  tgt = target_lib.Target("x", target_lib.Platform.CUDA, cc, 90800)
  with target_lib.lowering_for(tgt):
    try:
      fa.check_is_flash_attention(q, k, k, fa.AttentionLayout.BTNH.value, 90800, has_bias,
                                  training)
      return True
    except NotImplementedError:
      return False


@pytest.mark.parametrize("cc", [(8, 0), (9, 0)])
@pytest.mark.parametrize("head_dim", [8, 60, 64, 128, 136, 256, 264])
def test_cudnn_rule_mirrors_the_installed_jax(cc, head_dim):
  tgt = target_lib.Target("x", target_lib.Platform.CUDA, cc, 90800)
  ours = ac.cudnn_refusal(jnp.bfloat16, head_dim, tgt) is None
  for t, s in ((511, 511), (33, 95), (64, 128)):
    choice = ac.choose("auto", jnp.bfloat16, head_dim, t, s, tgt)
    assert (choice.impl is ac.Impl.CUDNN) == ours
    if ours:  # the padded call is one jax takes in training with a mask
      assert _jax_accepts(head_dim, *choice.padded, cc)
    else:
      assert not _jax_accepts(head_dim, 64, 64, cc)
  if ours:  # and the unpadded odd one is one it refuses: padding is what makes it serve
    assert not _jax_accepts(head_dim, 511, 511, cc)


def test_choose_rules():
  assert ac.choose("auto", jnp.bfloat16, 64, 511, 511, H100).padded == (512, 512)
  assert ac.choose("auto", jnp.float32, 64, 511, 511, H100).impl is ac.Impl.XLA
  long = ac.BLOCKWISE_AUTO_PAIRS
  # head dim 256 on an A100 is beyond cuDNN: a long row goes blockwise, never quadratic
  assert ac.choose("auto", jnp.bfloat16, 256, long, 1, A100).impl is ac.Impl.BLOCKWISE
  assert ac.choose("auto", jnp.bfloat16, 256, long, 1, H100).impl is ac.Impl.CUDNN
  assert ac.choose("auto", jnp.bfloat16, 64, 8, 8, CPU).impl is ac.Impl.XLA
  for tgt in (CPU, A100):
    with pytest.raises(ac.AttentionUnservable) as e:
      ac.choose("cudnn", jnp.bfloat16 if tgt is CPU else jnp.float32, 64, 9, 9, tgt)
    msg = str(e.value)
    assert "\n" not in msg and "model.attention_impl=cudnn" in msg and "auto" in msg, msg


def test_padding_is_exact():
  """The padded call (padding keys masked, padding queries sliced off) gives the unpadded
  call's outputs and gradients: checked through XLA's kernel, which runs here."""
  rng = np.random.default_rng(0)
  b, t, s, h, k, d = 2, 37, 45, 4, 2, 16
  q = jnp.asarray(rng.normal(size=(b, t, h, d)), jnp.float32)
  kk = jnp.asarray(rng.normal(size=(b, k, s, d)), jnp.float32)
  vv = jnp.asarray(rng.normal(size=(b, k, s, d)), jnp.float32)
  vis = jnp.asarray(rng.random((b, t, s)) < 0.7)
  vis = vis.at[0, 3].set(False)  # a query with no visible key: uniform softmax either way

  mask = np.asarray(vis.any(-1))[..., None, None]  # rows with a visible key

  def loss(pad, q, kk, vv):
    # A row with no visible key is a padding position in the model: its output feeds
    # nothing (no later query sees its key), so the loss ignores it here too.
    out = attention._dot_product_attention(q, kk, vv, vis, ac.Impl.XLA, pad) * mask
    return jnp.sum(out * jnp.cos(out)), out
  (_, o1), g1 = jax.value_and_grad(loss, argnums=(1, 2, 3), has_aux=True)(1, q, kk, vv)
  (_, o64), g64 = jax.value_and_grad(loss, argnums=(1, 2, 3), has_aux=True)(64, q, kk, vv)
  assert o64.shape == o1.shape
  np.testing.assert_allclose(o64, o1, atol=1e-5)
  for a, b_ in zip(g64, g1):
    np.testing.assert_allclose(a, b_, atol=1e-5)


CFG = ModelConfig(arch="qwen2", vocab_size=64, hidden_size=128, intermediate_size=128,
                  num_layers=2, num_heads=2, num_kv_heads=1, head_dim=64, qkv_bias=True,
                  dtype="bfloat16", scan_layers=True, remat="full")


def _train_step_lowered(p: int, n: int, tgt) -> str:
  """The actor's train step (scan over layers, remat: the custom-VJP rule is traced when the
  layer scan is differentiated) lowered for ``tgt``; T = p + n - 1."""
  abstract = nnx.eval_shape(lambda: Transformer(CFG, rngs=nnx.Rngs(0)))
  graphdef, params = nnx.split(abstract)
  tx = optax.adamw(1e-4)
  opt = jax.eval_shape(tx.init, params)
  rows = 2
  batch = {"prompt_tokens": ((rows, p), jnp.int32), "prompt_mask": ((rows, p), jnp.bool_),
           "response_tokens": ((rows, n), jnp.int32), "response_mask": ((rows, n), jnp.bool_),
           "old_logprobs": ((rows, n), jnp.float32), "advantages": ((rows, n), jnp.float32)}
  batch = {k: jax.ShapeDtypeStruct(*v) for k, v in batch.items()}
  loss_cfg = actor_loss_settings()
  step = steps.make_train_step(lambda g, pp, mb: steps.actor_loss(g, pp, mb, loss_cfg, 512),
                               graphdef, tx, 1, loss_cfg.loss_agg)
  with target_lib.lowering_for(tgt), ac.recording() as seen:
    lowered = step.jitted_for(params, opt).trace(params, opt, batch).lower(
        lowering_platforms=(tgt.platform.value,))
  assert seen and all(c.impl is ac.Impl.CUDNN for c in seen), seen
  return lowered.as_text()


def test_train_step_at_odd_length_lowers_for_h100():
  """T = 256 + 256 - 1 = 511: the length the first GPU train step crashed at."""
  text = _train_step_lowered(256, 256, H100)
  assert "__cudnn$fmha" in text


def test_jax_refuses_the_unpadded_odd_call_it_is_the_judge():
  """Without our padding, jax itself refuses T = 511 in training under the same emulation
  (so the test above would fail on code that calls cuDNN unpadded)."""
  def loss(q, k, v, m):
    return jax.nn.dot_product_attention(q, k, v, mask=m, implementation="cudnn").astype(
        jnp.float32).sum()
  q = jax.ShapeDtypeStruct((1, 511, 2, 64), jnp.bfloat16)
  m = jax.ShapeDtypeStruct((1, 1, 511, 511), jnp.bool_)
  with target_lib.lowering_for(H100):
    with pytest.raises(NotImplementedError, match="511"):
      jax.jit(jax.grad(loss, argnums=(0, 1, 2))).trace(q, q, q, m).lower(
          lowering_platforms=("cuda",))
  # outside the emulation this machine has no cuDNN at all
  assert target_lib.current().platform is target_lib.Platform.CPU


def test_lowering_for_restores_jax():
  from jax._src.cudnn import fused_attention_stablehlo as fa
  before = fa.check_cudnn_version
  with target_lib.lowering_for(H100):
    assert fa.check_cudnn_version() == 90800
    assert target_lib.current() is H100
  assert fa.check_cudnn_version is before
  assert target_lib.current().platform is target_lib.Platform.CPU


def test_a_run_refuses_cudnn_it_cannot_have_before_compiling():
  """model.attention_impl=cudnn where cuDNN cannot serve the model (this CPU; float32 on
  an H100) is one line at set-up, not a crash in the first step's compile."""
  from distflow_jax.config import loading
  from distflow_jax.state import roles
  cfg = loading.load("grpo:tiny", ["model.attention_impl=cudnn"])
  with pytest.raises(loading.ConfigError) as e:
    roles.levers(cfg, CFG)
  assert "\n" not in str(e.value) and "model.attention_impl=auto" in str(e.value)
  with target_lib.lowering_for(H100):
    assert roles.levers(cfg, CFG).attention_impl == "cudnn"  # bf16, head dim 64: served
    with pytest.raises(loading.ConfigError, match="float32"):
      roles.levers(cfg, CFG.replace(dtype="float32"))
