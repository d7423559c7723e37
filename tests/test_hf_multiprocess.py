"""Checkpoint load into / export from a mesh that spans 2 processes (2 x 2 CPU devices).

The child program is this file run as a script: each process reads only the
slices of its own devices, runs the sharded model, and export gathers across
processes with only process 0 writing.
"""

import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.multiprocess


def _child(ckpt: str, out: str) -> None:
  from distflow_jax import distributed  # pylint: disable=import-outside-toplevel
  info = distributed.initialize()
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  import numpy as np  # pylint: disable=import-outside-toplevel
  from flax import nnx  # pylint: disable=import-outside-toplevel
  from jax.sharding import NamedSharding, PartitionSpec as P  # pylint: disable=import-outside-toplevel

  from distflow_jax.models import (fsdp_tp_rules, forward, load_pretrained,  # pylint: disable=import-outside-toplevel
                                   make_mesh, save_pretrained)

  mesh = make_mesh({"fsdp": 2, "tensor": 2})
  model = load_pretrained(ckpt, mesh=mesh, rules=fsdp_tp_rules())
  q = model.layers[0].attn.q_proj.kernel.get_value()
  assert not q.is_fully_addressable and q.sharding.spec == P("fsdp", "tensor")
  tokens = np.load(Path(ckpt) / "tokens.npy")
  b, t = tokens.shape
  g, p = nnx.split(model)
  replicated = NamedSharding(mesh, P())
  run = jax.jit(forward, out_shardings=(replicated, None))
  logits, _ = run(g, p, jnp.asarray(tokens), jnp.broadcast_to(jnp.arange(t), (b, t)))
  want = np.load(Path(ckpt) / "logits.npy")
  got = np.asarray(logits.addressable_shards[0].data)
  assert np.allclose(got, want, atol=1e-5), np.abs(got - want).max()
  save_pretrained(out, model)
  print(f"OK process {info.process_index}", flush=True)


@pytest.mark.timeout(240)
def test_load_and_export_across_two_processes(tmp_path):
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  import numpy as np  # pylint: disable=import-outside-toplevel
  from flax import nnx  # pylint: disable=import-outside-toplevel
  from safetensors.numpy import load_file  # pylint: disable=import-outside-toplevel

  from distflow_jax import launcher  # pylint: disable=import-outside-toplevel
  from distflow_jax.models import ModelConfig, Transformer, forward, save_pretrained  # pylint: disable=import-outside-toplevel

  cfg = ModelConfig(arch="qwen2", vocab_size=64, hidden_size=32, intermediate_size=48,
                    num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, qkv_bias=True)
  model = Transformer(cfg, rngs=nnx.Rngs(0))
  ckpt, out = tmp_path / "ckpt", tmp_path / "out"
  save_pretrained(ckpt, model)
  tokens = np.random.default_rng(0).integers(0, 64, (4, 6))
  logits, _ = jax.jit(forward)(*nnx.split(model), jnp.asarray(tokens),
                               jnp.broadcast_to(jnp.arange(6), (4, 6)))
  np.save(ckpt / "tokens.npy", tokens)
  np.save(ckpt / "logits.npy", np.asarray(logits))
  result = launcher.launch(2, 2, [sys.executable, __file__, str(ckpt), str(out)], timeout_s=200,
                           out=None)
  lines = "\n".join(sum(result.outputs, []))
  assert result.ok, result.describe() + "\n" + lines
  for i in range(2):
    assert any(f"OK process {i}" in line for line in result.outputs[i]), lines
  exported = load_file(str(out / "model.safetensors"))
  original = load_file(str(ckpt / "model.safetensors"))
  assert exported.keys() == original.keys()
  for k, v in original.items():
    np.testing.assert_array_equal(exported[k], v, err_msg=k)


if __name__ == "__main__":
  _child(sys.argv[1], sys.argv[2])
