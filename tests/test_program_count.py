"""Few programs (issue 32 item 3): a save's checksums compile one program per mesh, the
engine's prefill and insert are one program, and prefill row counts take few sizes.
plan's count against a real run's is tests/test_lowering.py's probe test."""

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from distflow_jax.persist import checksums
from distflow_jax.rollout import EngineConfig, generate, prefill_rows
from distflow_jax.run import compile_cache
from test_rollout_engine import engine, peaky_model


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
