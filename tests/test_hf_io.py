"""Safetensors import/export without torch: round trips, sharded loads, clear errors."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P
from safetensors.numpy import load_file, save_file

from distflow_jax.models.config import ModelConfig
from distflow_jax.models.hf_io import export_state_dict, hf_name, load_pretrained, save_pretrained
from distflow_jax.models.sharding import fsdp_tp_rules, make_mesh
from distflow_jax.models.tokenizer import Tokenizer
from distflow_jax.models.transformer import Transformer


def cfg_for(arch, **kw):
  return ModelConfig(arch=arch, vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=2,
                     num_heads=4, num_kv_heads=2, head_dim=8, qkv_bias=arch == "qwen2",
                     qk_norm=arch == "qwen3", tie_embeddings=arch == "qwen2", **kw)


def params_of(model):
  return {k: np.asarray(v.get_value()) for k, v in nnx.to_flat_state(nnx.state(model))}


def test_hf_names():
  assert hf_name("layers/3/attn/q_norm/scale") == ("model.layers.3.self_attn.q_norm.weight", False)
  assert hf_name("layers/0/attn/k_proj/bias") == ("model.layers.0.self_attn.k_proj.bias", False)
  assert hf_name("layers/1/mlp/down_proj/kernel") == ("model.layers.1.mlp.down_proj.weight", True)
  assert hf_name("layers/1/post_attn_norm/scale") == (
      "model.layers.1.post_attention_layernorm.weight", False)
  assert hf_name("embed/embedding") == ("model.embed_tokens.weight", False)
  assert hf_name("lm_head/kernel") == ("lm_head.weight", True)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_save_load_roundtrip_is_exact(tmp_path, arch):
  model = Transformer(cfg_for(arch), rngs=nnx.Rngs(0))
  save_pretrained(tmp_path, model, tokenizer=Tokenizer.builtin())
  hf_cfg = json.loads((tmp_path / "config.json").read_text())
  assert hf_cfg["model_type"] == arch and hf_cfg["eos_token_id"] == 2
  names = set(load_file(str(tmp_path / "model.safetensors")))
  assert ("lm_head.weight" in names) == (arch != "qwen2")
  loaded = load_pretrained(tmp_path)
  assert loaded.cfg == model.cfg
  a, b = params_of(model), params_of(loaded)
  assert a.keys() == b.keys()
  for k in a:
    np.testing.assert_array_equal(a[k], b[k], err_msg=str(k))
  assert Tokenizer.from_dir(tmp_path).encode("1+1") == Tokenizer.builtin().encode("1+1")
  gen = json.loads((tmp_path / "generation_config.json").read_text())
  assert gen["eos_token_id"] == [2] and gen["pad_token_id"] == 0


@pytest.mark.timeout(240)
def test_sharded_index_load_into_mesh_and_bf16(tmp_path):
  cfg = cfg_for("qwen3")
  model = Transformer(cfg, rngs=nnx.Rngs(1))
  state = export_state_dict(model)
  names = sorted(state)
  shards = {"a.safetensors": names[: len(names) // 2], "b.safetensors": names[len(names) // 2:]}
  for fname, keys in shards.items():
    save_file({k: state[k] for k in keys}, str(tmp_path / fname), metadata={"format": "pt"})
  (tmp_path / "model.safetensors.index.json").write_text(json.dumps(
      {"metadata": {}, "weight_map": {k: f for f, ks in shards.items() for k in ks}}))
  (tmp_path / "config.json").write_text(json.dumps(cfg.to_hf_dict()))
  mesh = make_mesh({"fsdp": 2, "tensor": 4})
  loaded = load_pretrained(tmp_path, mesh=mesh, rules=fsdp_tp_rules())
  q = loaded.layers[0].attn.q_proj.kernel.get_value()
  assert q.sharding.spec == P("fsdp", "tensor") and q.addressable_shards[0].data.shape == (16, 8)
  a, b = params_of(model), params_of(loaded)
  for k in a:
    np.testing.assert_array_equal(a[k], b[k], err_msg=str(k))
  half = load_pretrained(tmp_path, dtype="bfloat16")
  assert half.cfg.dtype == "bfloat16"
  assert half.embed.embedding.get_value().dtype == jnp.bfloat16
  np.testing.assert_allclose(np.asarray(half.embed.embedding.get_value(), np.float32),
                             a[("embed", "embedding")], rtol=1e-2)


def _saved(tmp_path, arch="llama"):
  model = Transformer(cfg_for(arch), rngs=nnx.Rngs(0))
  save_pretrained(tmp_path, model)
  return load_file(str(tmp_path / "model.safetensors"))


def test_missing_tensor_names_it(tmp_path):
  tensors = _saved(tmp_path)
  del tensors["model.layers.1.mlp.up_proj.weight"]
  save_file(tensors, str(tmp_path / "model.safetensors"))
  with pytest.raises(ValueError, match=r"missing tensor 'model\.layers\.1\.mlp\.up_proj\.weight'"):
    load_pretrained(tmp_path)


def test_shape_mismatch_names_tensor_and_file(tmp_path):
  tensors = _saved(tmp_path)
  tensors["model.layers.0.self_attn.k_proj.weight"] = np.zeros((8, 32), np.float32)
  save_file(tensors, str(tmp_path / "model.safetensors"))
  with pytest.raises(ValueError, match=r"shape mismatch for tensor 'model\.layers\.0\.self_attn"
                                       r"\.k_proj\.weight' in .*model\.safetensors.*\(8, 32\)"):
    load_pretrained(tmp_path)


def test_unexpected_tensor_is_refused(tmp_path):
  tensors = _saved(tmp_path)
  tensors["model.layers.2.mlp.up_proj.weight"] = np.zeros((48, 32), np.float32)
  save_file(tensors, str(tmp_path / "model.safetensors"))
  with pytest.raises(ValueError, match=r"unexpected tensor\(s\) \['model\.layers\.2"):
    load_pretrained(tmp_path)


def test_unknown_architecture_and_unsupported_options(tmp_path):
  _saved(tmp_path)
  cfg = json.loads((tmp_path / "config.json").read_text())
  (tmp_path / "config.json").write_text(json.dumps(
      dict(cfg, architectures=["GPT2LMHeadModel"], model_type="gpt2")))
  with pytest.raises(ValueError, match=r"config\.json.*unknown architecture.*GPT2LMHeadModel"):
    load_pretrained(tmp_path)
  (tmp_path / "config.json").write_text(json.dumps(
      dict(cfg, rope_scaling={"rope_type": "yarn", "factor": 8.0})))
  with pytest.raises(ValueError, match="RoPE scaling 'yarn' is not supported"):
    load_pretrained(tmp_path)
  (tmp_path / "config.json").write_text(json.dumps(
      dict(cfg, rope_scaling={"rope_type": "llama3", "factor": 8.0})))
  with pytest.raises(ValueError, match="rope_scaling 'llama3' lacks 'low_freq_factor'"):
    load_pretrained(tmp_path)


def test_pickle_checkpoints_are_refused(tmp_path):
  _saved(tmp_path)
  (tmp_path / "model.safetensors").unlink()
  (tmp_path / "pytorch_model.bin").write_bytes(b"not unpickled")
  with pytest.raises(ValueError, match=r"refusing pickle.*pytorch_model\.bin"):
    load_pretrained(tmp_path)
  with pytest.raises(ValueError, match=r"refusing pickle.*pytorch_model\.bin"):
    load_pretrained(tmp_path / "pytorch_model.bin")
  (tmp_path / "pytorch_model.bin.index.json").write_text("{}")
  (tmp_path / "model.safetensors.index.json").write_text(json.dumps(
      {"weight_map": {"model.norm.weight": "model-00001.pt"}}))
  with pytest.raises(ValueError, match=r"refusing pickle.*model-00001\.pt"):
    load_pretrained(tmp_path)
  with pytest.raises(FileNotFoundError, match="does not exist"):
    load_pretrained(tmp_path / "nope")


def test_bfloat16_checkpoint_roundtrip(tmp_path):
  model = Transformer(cfg_for("qwen2", dtype="bfloat16"), rngs=nnx.Rngs(2))
  save_pretrained(tmp_path, model)
  assert json.loads((tmp_path / "config.json").read_text())["torch_dtype"] == "bfloat16"
  loaded = load_pretrained(tmp_path)
  assert loaded.cfg.dtype == "bfloat16"
  a, b = params_of(model), params_of(loaded)
  for k in a:
    assert b[k].dtype == jnp.bfloat16
    np.testing.assert_array_equal(a[k].view(np.uint16), b[k].view(np.uint16), err_msg=str(k))
