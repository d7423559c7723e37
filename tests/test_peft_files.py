"""PEFT LoRA adapter folders (models/peft_files.py): write / read round trips, merging, and
every refusal of a bad folder (one line naming the file and the culprit).  Parity with real
`peft` + `transformers` is test_peft_parity.py's; `export --lora`'s, test_lora_export.py's.
"""

import json

import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from distflow_jax.models import peft_files
from distflow_jax.models.errors import ModelFileError, ModelFileNotFoundError
from distflow_jax.models.peft_files import (CONFIG, PREFIX, UNSUPPORTED, WEIGHTS, merge_into,
                                            peft_targets, read_adapter, write_adapter)

pytestmark = pytest.mark.timeout(120)
RANK = 4
# {module: (d_in, d_out)} of a made-up two-layer model: GQA (v_proj 32 -> 16), an MLP.
SHAPES = {f"model.layers.{i}.{m}": s for i in range(2)
          for m, s in (("self_attn.q_proj", (32, 32)), ("self_attn.v_proj", (32, 16)),
                       ("mlp.down_proj", (64, 32)))}


def random_arrays(shapes=SHAPES, rank=RANK, seed=0):
  rng = np.random.default_rng(seed)
  return {m: (rng.normal(size=(d_in, rank)).astype(np.float32),
              rng.normal(size=(rank, d_out)).astype(np.float32))
          for m, (d_in, d_out) in shapes.items()}


def write(folder, arrays=None, **kw):
  args = dict(rank=RANK, alpha=8.0, dropout=0.05, target_modules=["q_proj", "v_proj",
                                                                   "down_proj"],
              base_model_name_or_path="/models/base", dtype="float32")
  args.update(kw)
  arrays = random_arrays() if arrays is None else arrays
  write_adapter(folder, arrays, **args)
  return arrays


def assert_refused(folder, *needles, expected=SHAPES, error=ModelFileError):
  with pytest.raises(error) as e:
    read_adapter(folder, expected)
  msg = str(e.value)
  assert "\n" not in msg, msg
  for needle in needles:
    assert needle in msg, msg
  return msg


def edit_config(folder, **changes):
  cfg = json.loads((folder / CONFIG).read_text())
  cfg.update(changes)
  (folder / CONFIG).write_text(json.dumps(cfg))


def edit_tensors(folder, fn):
  tensors = load_file(str(folder / WEIGHTS))
  save_file(fn(dict(tensors)), str(folder / WEIGHTS), metadata={"format": "pt"})


# ---- round trips ---------------------------------------------------------------------------------

def test_write_then_read_gives_the_same_arrays_and_peft_layout(tmp_path):
  arrays = write(tmp_path)
  tensors = load_file(str(tmp_path / WEIGHTS))
  key = f"{PREFIX}model.layers.1.self_attn.v_proj"
  assert tensors[f"{key}.lora_A.weight"].shape == (RANK, 32)
  assert tensors[f"{key}.lora_B.weight"].shape == (16, RANK)
  np.testing.assert_array_equal(tensors[f"{key}.lora_A.weight"],
                                arrays["model.layers.1.self_attn.v_proj"][0].T)
  assert len(tensors) == 2 * len(SHAPES)
  cfg = json.loads((tmp_path / CONFIG).read_text())
  assert (cfg["peft_type"], cfg["task_type"], cfg["r"], cfg["lora_alpha"], cfg["bias"]) == (
      "LORA", "CAUSAL_LM", RANK, 8.0, "none")
  assert cfg["target_modules"] == ["down_proj", "q_proj", "v_proj"]
  assert cfg["use_rslora"] is cfg["fan_in_fan_out"] is cfg["use_dora"] is False
  got, meta = read_adapter(tmp_path, SHAPES)
  assert set(got) == set(arrays)
  for m, (a, b) in arrays.items():
    np.testing.assert_array_equal(got[m][0], a)
    np.testing.assert_array_equal(got[m][1], b)
    assert got[m][0].dtype == np.float32
  assert (meta.rank, meta.alpha, meta.dropout, meta.scale) == (RANK, 8.0, 0.05, 2.0)
  assert meta.base_model_name_or_path == "/models/base"
  assert read_adapter(tmp_path)[0].keys() == arrays.keys()  # without a model to check against


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_files_read_back_as_float32(tmp_path, dtype):
  arrays = write(tmp_path, dtype=dtype)
  stored = load_file(str(tmp_path / WEIGHTS))
  assert {str(t.dtype) for t in stored.values()} == {dtype}
  got, _ = read_adapter(tmp_path, SHAPES)
  for m, (a, _b) in arrays.items():
    np.testing.assert_allclose(got[m][0], a, rtol=1e-2, atol=1e-2)
    assert got[m][0].dtype == np.float32


@pytest.mark.parametrize("variant", ["default_name", "no_prefix", "both"])
def test_key_variants_peft_writes_are_read(tmp_path, variant):
  arrays = write(tmp_path)

  def rename(tensors):
    out = {}
    for k, v in tensors.items():
      if variant in ("default_name", "both"):
        k = k.replace(".weight", ".default.weight")
      if variant in ("no_prefix", "both"):
        k = k.removeprefix(PREFIX)
      out[k] = v
    return out
  edit_tensors(tmp_path, rename)
  got, _ = read_adapter(tmp_path, SHAPES)
  np.testing.assert_array_equal(got["model.layers.0.mlp.down_proj"][1],
                                arrays["model.layers.0.mlp.down_proj"][1])


def test_an_adapter_on_some_modules_only_reads_those(tmp_path):
  some = {m: s for m, s in SHAPES.items() if m.endswith("q_proj")}
  write(tmp_path, random_arrays(some), target_modules=["q_proj"])
  got, _ = read_adapter(tmp_path, SHAPES)
  assert set(got) == set(some)


def test_peft_targets_uses_short_names_only_where_every_module_is_adapted():
  modules = list(SHAPES) + [f"model.layers.{i}.self_attn.o_proj" for i in range(2)]
  adapted = list(SHAPES) + ["model.layers.0.self_attn.o_proj"]
  assert peft_targets(adapted, modules) == ["down_proj", "model.layers.0.self_attn.o_proj",
                                            "q_proj", "v_proj"]
  assert all(peft_files.targets_module(peft_targets(adapted, modules), m) for m in adapted)
  assert not peft_files.targets_module(peft_targets(adapted, modules),
                                       "model.layers.1.self_attn.o_proj")


# ---- merging -------------------------------------------------------------------------------------

def test_merge_into_adds_the_scaled_product_transposed_and_keeps_dtypes():
  a = np.array([[1.0], [2.0]], np.float32)        # d_in 2, r 1
  b = np.array([[1.0, 0.0, -1.0]], np.float32)    # d_out 3
  w = np.arange(6, dtype=np.float32).reshape(3, 2)  # HF (out, in)
  hf = {"m.weight": w, "m.bias": np.ones(3, np.float32),
        "n.weight": w.astype(ml_dtypes.bfloat16)}
  out = merge_into(hf, {"m": (a, b), "n": (a, b)}, 0.5)
  # delta[o, i] = a[i] * b[o] * 0.5
  np.testing.assert_array_equal(out["m.weight"], w + np.array([[0.5, 1], [0, 0], [-0.5, -1]]))
  assert out["n.weight"].dtype == ml_dtypes.bfloat16
  np.testing.assert_array_equal(out["n.weight"].astype(np.float32), out["m.weight"])
  assert out["m.bias"] is hf["m.bias"] and hf["m.weight"] is w and w[0, 0] == 0  # a copy
  with pytest.raises(KeyError, match="'x.weight'"):
    merge_into(hf, {"x": (a, b)}, 1.0)
  with pytest.raises(ValueError, match="'m.weight'"):
    merge_into(hf, {"m": (b.T, a.T)}, 1.0)


# ---- bad folders: one line naming the file and the culprit ---------------------------------------

def test_missing_folder_and_files(tmp_path):
  assert_refused(tmp_path / "nope", str(tmp_path / "nope"), "does not exist",
                 error=ModelFileNotFoundError)
  write(tmp_path)
  (tmp_path / WEIGHTS).unlink()
  assert_refused(tmp_path, str(tmp_path / WEIGHTS), error=ModelFileNotFoundError)
  (tmp_path / "adapter_model.bin").write_bytes(b"pickle")
  assert_refused(tmp_path, "adapter_model.bin", "pickle")
  (tmp_path / CONFIG).unlink()
  assert_refused(tmp_path, str(tmp_path / CONFIG), error=ModelFileNotFoundError)


@pytest.mark.parametrize("text,needle", [("{not json", "not valid JSON"),
                                         ("[1, 2]", "JSON object")])
def test_unreadable_config(tmp_path, text, needle):
  write(tmp_path)
  (tmp_path / CONFIG).write_text(text)
  assert_refused(tmp_path, str(tmp_path / CONFIG), needle)


def test_weights_that_are_not_safetensors(tmp_path):
  write(tmp_path)
  (tmp_path / WEIGHTS).write_bytes(b"\x00garbage")
  assert_refused(tmp_path, str(tmp_path / WEIGHTS), "safetensors")


@pytest.mark.parametrize("change,needles", [
    ({"peft_type": "IA3"}, ["peft_type='IA3'", "only LORA"]),
    ({"r": 0}, ["r=0", "positive integer"]),
    ({"r": "4"}, ["r='4'"]),
    ({"lora_alpha": None}, ["lora_alpha=None"]),
    ({"lora_dropout": 1.5}, ["lora_dropout=1.5"]),
    ({"target_modules": [1]}, ["target_modules=[1]"]),
])
def test_bad_config_values(tmp_path, change, needles):
  write(tmp_path)
  edit_config(tmp_path, **change)
  assert_refused(tmp_path, str(tmp_path / CONFIG), *needles)


# The brief's list first, then every entry of the table (a new entry is tested too).
VARIANTS = {"use_rslora": True, "use_dora": True, "bias": "all", "fan_in_fan_out": True,
            "layers_to_transform": [0], "rank_pattern": {"q_proj": 8},
            "alpha_pattern": {"q_proj": 32}, "modules_to_save": ["lm_head"]}
VARIANTS.update({u.key: ["x"] for u in UNSUPPORTED if u.key not in VARIANTS})


@pytest.mark.parametrize("key", sorted(VARIANTS))
def test_unsupported_lora_variants_say_so(tmp_path, key):
  write(tmp_path)
  edit_config(tmp_path, **{key: VARIANTS[key]})
  assert_refused(tmp_path, str(tmp_path / CONFIG), f"{key}={VARIANTS[key]!r}", "not supported")
  edit_config(tmp_path, **{key: dict(bias="none").get(key)})  # its plain value reads again
  read_adapter(tmp_path, SHAPES)


def test_a_module_the_model_does_not_have(tmp_path):
  arrays = random_arrays()
  arrays["model.layers.7.self_attn.q_proj"] = arrays["model.layers.0.self_attn.q_proj"]
  write(tmp_path, arrays)
  msg = assert_refused(tmp_path, str(tmp_path / WEIGHTS), "'model.layers.7.self_attn.q_proj'",
                       "down_proj, q_proj, v_proj")
  assert "lora_A.weight" in msg
  assert_refused(tmp_path, "no LoRA targets", expected={})


def test_a_shape_that_does_not_match_names_key_and_shapes(tmp_path):
  write(tmp_path)
  shapes = dict(SHAPES, **{"model.layers.1.self_attn.v_proj": (32, 8)})  # a smaller kv width
  assert_refused(tmp_path, "model.layers.1.self_attn.v_proj.lora_B.weight", "(16, 4)", "(8, 4)",
                 expected=shapes)


def test_a_rank_other_than_the_configs(tmp_path):
  write(tmp_path)
  edit_config(tmp_path, r=8)
  assert_refused(tmp_path, "lora_A.weight", f"({RANK}, ", "(8, ", "r=8")


@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_non_finite_values(tmp_path, bad):
  write(tmp_path)
  key = f"{PREFIX}model.layers.0.mlp.down_proj.lora_B.weight"

  def spoil(t):
    t[key] = t[key].copy()
    t[key][3, 1] = bad
    return t
  edit_tensors(tmp_path, spoil)
  assert_refused(tmp_path, str(tmp_path / WEIGHTS), repr(key), "non-finite")


@pytest.mark.parametrize("how,needle", [
    ("drop_b", "no lora_B partner"),
    ("embedding", "lora_embedding_A"),
    ("two_names", "several adapters"),
    ("duplicate", "same weight"),
    ("integer", "dtype int32"),
    ("empty", "no LoRA weights"),
])
def test_bad_tensors(tmp_path, how, needle):
  write(tmp_path)
  q = f"{PREFIX}model.layers.0.self_attn.q_proj"

  def spoil(t):
    if how == "drop_b":
      del t[f"{q}.lora_B.weight"]
    elif how == "embedding":
      t[f"{PREFIX}model.embed_tokens.lora_embedding_A"] = np.zeros((4, 8), np.float32)
    elif how == "two_names":
      t[f"{q}.lora_A.other.weight"] = t.pop(f"{q}.lora_A.weight")
      t[f"{q}.lora_B.other.weight"] = t.pop(f"{q}.lora_B.weight")
      t = {k if k.startswith(q) else k.replace(".weight", ".default.weight"): v
           for k, v in t.items()}
    elif how == "duplicate":
      t[f"{q}.lora_A.default.weight"] = t[f"{q}.lora_A.weight"]
    elif how == "integer":
      t[f"{q}.lora_A.weight"] = t[f"{q}.lora_A.weight"].astype(np.int32)
    elif how == "empty":
      t = {}
    return t
  edit_tensors(tmp_path, spoil)
  assert_refused(tmp_path, str(tmp_path / WEIGHTS), needle)


def test_writer_refuses_what_peft_would_not_load(tmp_path):
  arrays = random_arrays()
  with pytest.raises(ValueError, match="match no target_modules"):
    write(tmp_path, arrays, target_modules=["q_proj"])
  with pytest.raises(ValueError, match="must be"):
    write(tmp_path, arrays, rank=RANK + 1)
  with pytest.raises(ValueError, match="dtype 'int8'"):
    write(tmp_path, arrays, dtype="int8")
  bad = dict(arrays)
  bad["model.layers.0.mlp.down_proj"] = (np.full((64, RANK), np.nan, np.float32),
                                         arrays["model.layers.0.mlp.down_proj"][1])
  with pytest.raises(ValueError, match="NaN"):
    write(tmp_path, bad)
  assert not (tmp_path / CONFIG).exists()


@pytest.mark.timeout(30)
def test_model_name_reads_paths_hub_ids_and_cache_snapshots():
  from distflow_jax.models.peft_files import model_name
  assert model_name("Qwen/Qwen2.5-0.5B-Instruct") == "qwen2.5-0.5b-instruct"
  assert model_name("/data/models/Qwen2.5-0.5B-Instruct/") == "qwen2.5-0.5b-instruct"
  assert model_name("/root/.cache/huggingface/hub/models--Qwen--Qwen2.5-0.5B-Instruct/"
                    "snapshots/7ae557604adf67be50417f59c2c2f167def9a775") == "qwen2.5-0.5b-instruct"
  assert model_name("Qwen/Qwen2.5-0.5B") != model_name("Qwen/Qwen2.5-0.5B-Instruct")
