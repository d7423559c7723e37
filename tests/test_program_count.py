"""Few programs (issue 32 item 3): a save's checksums compile one program per mesh, the
engine's prefill and insert are one program, and prefill row counts take few sizes.
plan's count against a real run's is tests/test_lowering.py's probe test."""

import os

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from distflow_jax.persist import checksums
from distflow_jax.rollout import EngineConfig, generate
from distflow_jax.rollout.engine import prefill_rows
from distflow_jax.run import compile_cache
from test_rollout_engine import engine, peaky_model

SHAPES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                      "tools", "model_shapes")


@pytest.mark.timeout(120)
def test_a_save_checksums_in_one_program_per_mesh():
  mesh = jax.make_mesh((2, 2), ("data", "fsdp"), devices=jax.devices()[:4])
  rs = np.random.RandomState(0)
  shapes = [((8, 6), P("fsdp")), ((4,), P()), ((6, 8), P(None, "data")), ((2, 4, 4), P("data")),
            ((), P())]
  tree = {f"a{i}": jax.device_put(np.asarray(rs.randn(*s), np.float32), NamedSharding(mesh, spec))
          for i, (s, spec) in enumerate(shapes)}
  tree["b"] = jax.device_put(np.arange(12, dtype=np.int32), NamedSharding(mesh, P("fsdp")))
  counter = compile_cache.CompileCounter()
  before = counter.snapshot()
  sums = checksums.checksums(tree)
  assert counter.since(before).programs == 1
  # The same figures as a host array's, whatever the layout.
  for name, x in tree.items():
    assert sums[name] == checksums.checksum(checksums.host_figures(np.asarray(x))), name


@pytest.mark.timeout(120)
def test_a_save_checksums_the_state_and_the_reference_in_one_program():
  """checkpoint_contents.save_sums: the trained state and the reference model's parameters
  on one mesh are one program (it was one each), with each tree's own figures."""
  mesh = jax.make_mesh((2,), ("fsdp",), devices=jax.devices()[:2])
  rs = np.random.RandomState(1)
  put = lambda *s: jax.device_put(np.asarray(rs.randn(*s), np.float32),
                                  NamedSharding(mesh, P("fsdp")))
  state = {"actor": {"params": {"w": put(8, 4), "b": put(6)}}}
  reference = {"w": put(10, 4), "b": put(4)}
  counter = compile_cache.CompileCounter()
  before = counter.snapshot()
  got = checksums.sections({"state": state, "reference": reference})
  assert counter.since(before).programs == 1
  assert got == {"state": checksums.checksums(state),
                 "reference": checksums.checksums(reference)}


@pytest.mark.timeout(300)
def test_grpo_qwen05b_compiles_at_most_40_programs_before_step_2():
  """plan --programs for grpo:qwen0.5b at its defaults on 1 x 8 (issue 32's target): a
  save's checksums are one program, the weight sync's final norm rides with the embedding."""
  from absl import flags
  from distflow_jax.config import checks, loading
  from distflow_jax.dag import FUNCTIONS
  from distflow_jax.lowering import abstract, catalogue, count
  fv = flags.FlagValues()
  loading.parse(fv, ["--config=grpo:qwen0.5b",
                     f"--config.model.path={os.path.join(SHAPES, 'qwen2.5-0.5b')}"])
  cfg = fv.config
  plan = checks.plan_from_config(cfg, checks.topology(cfg, 1, 8), FUNCTIONS)
  ctx = abstract.abstract_context(cfg, plan, abstract.model_shape(cfg))
  c = count.count(catalogue.programs(cfg, plan, ctx))
  assert c.by_node["save"] == {"checksum": 1}, c.by_node
  assert c.by_node["generate"]["sync/reshard"] == 2, c.by_node
  assert c.total <= 40, count.render(c)


def test_prefill_rows_take_powers_of_four():
  cfg = EngineConfig(max_concurrent_decodes=128, prefill_buckets=(128, 256, 512),
                     max_new_tokens=8)
  shapes = prefill_rows.prefill_shapes(cfg)
  assert sorted({p for p, _ in shapes}) == [1, 4, 16, 64, 128]
  assert len(shapes) == 15
  assert [prefill_rows.prompt_rows(n, 8) for n in range(1, 9)] == [1, 4, 4, 4, 8, 8, 8, 8]


@pytest.mark.timeout(300)
def test_prefill_and_insert_are_one_program():
  eng = engine(slots=4, new=4, decode_steps=2)
  params = eng.load_params(peaky_model())
  generate(eng, params, [[1, 2, 3], [4, 5]], n=2)
  counts = eng.compile_counts()
  assert counts["prefill_insert"] >= 1 and counts["insert"] == 0, counts
  names = {p.name.split("[")[0] for p in eng.programs(eng._params_sig)}
  assert "insert" not in names and "prefill" not in names, names


@pytest.mark.timeout(120)
def test_plan_programs_takes_one_by_one_without_a_topology_and_says_so():
  """`plan --programs` with neither the flags nor cluster.* plans for 1 x 1 (it refused),
  saying which topology and where it came from; the flags and the config's block win."""
  import subprocess
  import sys
  def plan(*args):
    proc = subprocess.run([sys.executable, "-m", "distflow_jax.cli", "plan", "--programs",
                           *args], capture_output=True, text=True, timeout=100,
                          env=dict(os.environ, JAX_PLATFORMS="cpu"))
    assert proc.returncode == 0, proc.stderr[-1500:]
    return proc.stdout
  out = plan()
  assert "topology: 1 process(es) x 1 device(s) (the default;" in out
  assert "train_actor" in out and "on [0]" in out
  assert "(the config's cluster block;" in plan("--config.cluster.devices_per_process=2")
  assert "topology: 1 process(es) x 2 device(s) (the flags;" in plan("--devices_per_process=2")
