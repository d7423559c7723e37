"""Other prompt widths compiled ahead (state/warm_shapes.py, trainer.compile_ahead).

A function first called at one prompt width has its other widths compiled by
`Recorder.compile_widths`; the later call at such a width then compiles nothing (and it does
compile without that: the check is live).  The same for the train step (`PinnedStep`) and a
re-partition between layouts.  A tiny run whose prompts take several widths compiles nothing
after step 1 with compile_ahead=always, nor do a save's checksums."""


import jax
import jax.numpy as jnp
import numpy as np
import pytest

from workflow_util import smoke_overrides

from distflow_jax.data import layout as dlayout
from distflow_jax.data import redistribute as rd
from distflow_jax.models import sharding
from distflow_jax.train import placement
from distflow_jax.run import compile_cache
from distflow_jax.state import warm_shapes

B = 8


def _batch(width, rows=B, sharding_=None):
  """Host arrays put on the devices (no compile of its own)."""
  data = {"prompt_tokens": np.ones((rows, width), np.int32),
          "prompt_mask": np.ones((rows, width), bool),
          "response_mask": np.ones((rows, 4), bool)}
  return jax.device_put(data, sharding_ or jax.devices()[0])


def _compiles(fn) -> int:
  counter = compile_cache.CompileCounter()
  before = counter.snapshot()
  jax.block_until_ready(fn())
  return int(counter.since(before).compiles)


def _recorded(fn, widths=(16, 40)):
  recorder = warm_shapes.Recorder(widths=widths)
  return warm_shapes.Recorded(fn, "f", recorder), recorder


def test_other_widths_compile_ahead_and_the_later_call_compiles_nothing():
  body = lambda scale, d: (d["prompt_tokens"] * scale).sum() + d["response_mask"].sum()  # noqa: E731
  f, recorder = _recorded(jax.jit(body))
  b16, b40 = _batch(16), _batch(40)
  assert _compiles(lambda: f(2, b16)) == 1
  assert recorder.compile_widths() == 1   # width 40 (16 is the one just compiled)
  assert recorder.compile_widths() == 0   # nothing new
  assert _compiles(lambda: f(2, b40)) == 0
  f(2, b40)
  assert recorder.compile_widths() == 0   # 40's signature counted as seen
  # Control: a function nobody compiled ahead does compile at the new width.
  g, _ = _recorded(jax.jit(lambda scale, d: (d["prompt_mask"] * scale).sum()))
  g(3, b16)
  assert _compiles(lambda: g(3, b40)) == 1


def test_train_step_widths_compile_ahead():
  step = placement.PinnedStep(lambda p, o, d: (p + d["prompt_tokens"].sum(), o + 1, p * 2))
  f, recorder = _recorded(step, widths=(16, 24, 40))
  p, o = jax.device_put((np.float32(0), np.float32(0)))
  b16, b24, b40 = _batch(16), _batch(24), _batch(40)
  state = f(p, o, b24)[:2]  # the step donates its state: thread it through
  assert recorder.compile_widths() == 2
  for b in (b16, b40):
    out = []
    assert _compiles(lambda: out.append(f(*state, b)) or out[0]) == 0
    state = out[0][:2]


def test_packed_calls_and_single_width_runs_are_not_varied():
  f, recorder = _recorded(jax.jit(lambda d: d["prompt_tokens"].sum()))
  f({**_batch(16), "pack": {"src": jnp.zeros((2, 8), jnp.int32)}})
  assert recorder.compile_widths() == 0
  f1, one = _recorded(jax.jit(lambda d: d["prompt_tokens"].sum()), widths=(16,))
  f1(_batch(16))
  assert one.compile_widths() == 0


def test_repartition_widths_compile_ahead():
  devices = jax.devices()[:8]
  src = dlayout.Layout(sharding.make_mesh({"data": 2, "tensor": 4}, devices), ("data",))
  dst = dlayout.Layout(sharding.make_mesh({"data": 8, "tensor": 1}, devices), ("data",))
  recorder = warm_shapes.Recorder(widths=(16, 40))

  def move(width):
    lengths = np.arange(1, 17)
    on_plan = lambda tree, plan: recorder.record(  # noqa: E731
        "move", lambda tree: rd.rehearse(tree, plan, dst), (tree,))
    out, _ = rd.redistribute(_batch(width, 16, src.sharding), lengths, src, dst,
                             on_plan=on_plan)
    return out

  first = move(16)
  move(16)  # the index arrays' own small programs, compiled once
  assert recorder.compile_widths() == 1
  assert _compiles(lambda: move(40)) == 0
  np.testing.assert_array_equal(np.asarray(first["prompt_tokens"]), np.ones((16, 16)))


def test_compile_ahead_is_validated():
  from distflow_jax.config.loading import ConfigError, load
  from distflow_jax.config.values import check_values
  check_values(load("grpo:tiny", ["trainer.compile_ahead=never"]))
  with pytest.raises(ConfigError, match="trainer.compile_ahead='sometimes' is not valid"):
    check_values(load("grpo:tiny", ["trainer.compile_ahead=sometimes"]))


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_run_with_several_prompt_widths_compiles_nothing_after_step_1(tmp_path):
  from distflow_jax.config.loading import load
  from distflow_jax.persist import checkpoint
  from distflow_jax.run import trainer
  cfg = load("grpo:tiny", [o for o in smoke_overrides(str(tmp_path / "run")) if "buckets" not in o] + [
      "rollout.prefill_buckets=(16,20,40)", "data.train=builtin:arithmetic",
      "data.eval=", "data.chat_template=False", "data.prompts_per_step=8", "rollout.n=2",
      "actor.micro_batch_size=2",
      "trainer.total_steps=6", "trainer.compile_ahead=always", "trainer.save_every=0", "trainer.async_save=False"])
  ctx, loaders = trainer.setup(cfg, log=lambda s: None)
  ck, _ = checkpoint.open_run(cfg, ctx.roles, loaders.train, log=lambda s: None, ctx=ctx)
  rows = []
  for row in trainer.train(ctx, loaders, checkpointer=ck):
    rows.append(row)
    if row["step"] == 5:
      break  # before the end-of-run save: no save has run
  # The checksums a save computes (save_sums: one program per mesh) were compiled at the
  # end of step 1: a first save mid-run compiles none of them (orbax's own per-device
  # slices of replicated leaves still compile there, a fraction of a second; not covered).
  assert _compiles(lambda: checkpoint.save_sums(ctx.roles) and 0) == 0
  widths = [r["prompt_width"] for r in rows]
  assert len(set(widths)) == 2, widths  # both widths met (the seed makes it so)
  later = {r["step"]: r["compile/count"] for r in rows if r["step"] >= 2}
  assert not any(later.values()), (later, widths)
