"""PEFT adapter folders against real `peft` + `transformers` (the hf extra), both ways: peft
loads the adapter we write and gives the logits of the base merged by ``merge_into``; we read
the adapter peft saves as peft's own arrays and merge it as ``merge_and_unload`` does."""

import warnings

import numpy as np
import pytest

from distflow_jax.models.peft_files import (merge_into, peft_targets, read_adapter,
                                            write_adapter)
from test_peft_files import RANK, random_arrays

pytestmark = pytest.mark.timeout(120)

VOCAB = 96


@pytest.fixture(scope="module")
def hf_base(tmp_path_factory):
  """A tiny random Qwen2 folder (float32, tied embeddings, QKV bias)."""
  torch = pytest.importorskip("torch", reason="needs the hf extra")
  transformers = pytest.importorskip("transformers", reason="needs the hf extra")
  pytest.importorskip("peft", reason="needs the hf extra")
  config = transformers.Qwen2Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                                    num_hidden_layers=2, num_attention_heads=4,
                                    num_key_value_heads=2, rope_theta=1000.0,
                                    max_position_embeddings=64, tie_word_embeddings=True)
  config._attn_implementation = "eager"  # pylint: disable=protected-access
  torch.manual_seed(0)
  model = transformers.Qwen2ForCausalLM(config).eval()
  with torch.no_grad():
    for name, p in model.named_parameters():
      p.copy_(1.0 + 0.2 * torch.randn_like(p) if "norm" in name else 0.2 * torch.randn_like(p))
  path = tmp_path_factory.mktemp("qwen2")
  model.save_pretrained(str(path), safe_serialization=True)
  return path


def load_base(path):
  import torch
  import transformers
  return transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32,
                                                           attn_implementation="eager").eval()


def linear_shapes(model):
  import torch
  return {n: (m.in_features, m.out_features) for n, m in model.named_modules()
          if isinstance(m, torch.nn.Linear) and n != "lm_head"}


def logits(model, tokens):
  import torch
  with torch.no_grad():
    return model(input_ids=torch.tensor(tokens)).logits.numpy()


def state_numpy(model):
  return {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}


@pytest.mark.hf
@pytest.mark.timeout(300)
def test_peft_loads_our_adapter_and_gives_the_merged_logits(hf_base, tmp_path):
  import peft
  import torch
  base = load_base(hf_base)
  shapes = linear_shapes(base)
  # q, v and down in every layer; o_proj in layer 1 only (full names in target_modules).
  adapted = {m: s for m, s in shapes.items()
             if m.rsplit(".", 1)[-1] in ("q_proj", "v_proj", "down_proj")
             or m == "model.layers.1.self_attn.o_proj"}
  arrays = {m: (0.3 * a, 0.3 * b) for m, (a, b) in random_arrays(adapted, rank=RANK).items()}
  targets = peft_targets(arrays, shapes)
  assert "model.layers.1.self_attn.o_proj" in targets and "q_proj" in targets
  write_adapter(tmp_path / "adapter", arrays, rank=RANK, alpha=8.0, dropout=0.1,
                target_modules=targets, base_model_name_or_path=str(hf_base))
  tokens = np.random.default_rng(1).integers(0, VOCAB, (2, 10))
  plain = logits(base, tokens)
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    loaded = peft.PeftModel.from_pretrained(base, str(tmp_path / "adapter")).eval()
  assert not [w for w in caught if "peft" in w.filename], [str(w.message) for w in caught]
  lora_layers = [n for n, _ in loaded.named_modules() if n.endswith("lora_A")]
  assert len(lora_layers) == len(arrays)  # no adapter peft made up beyond the file's
  through_peft = logits(loaded, tokens)
  merged_model = load_base(hf_base)
  merged = merge_into(state_numpy(merged_model), arrays, 8.0 / RANK)
  merged_model.load_state_dict({k: torch.from_numpy(v) for k, v in merged.items()})
  np.testing.assert_allclose(through_peft, logits(merged_model, tokens), atol=1e-5, rtol=1e-5)
  assert np.abs(through_peft - plain).max() > 1e-2  # the adapter changes the logits


@pytest.mark.hf
@pytest.mark.timeout(300)
def test_we_read_peft_adapter_and_merge_like_merge_and_unload(hf_base, tmp_path):
  import peft
  import torch
  base = load_base(hf_base)
  shapes = linear_shapes(base)
  config = peft.LoraConfig(r=RANK, lora_alpha=16, lora_dropout=0.0, task_type="CAUSAL_LM",
                           target_modules=["q_proj", "k_proj", "v_proj", "o_proj",
                                           "gate_proj", "up_proj", "down_proj"])
  model = peft.get_peft_model(base, config)
  torch.manual_seed(3)
  with torch.no_grad():
    for name, p in model.named_parameters():
      if "lora_" in name:
        p.copy_(0.3 * torch.randn_like(p))  # lora_B non-zero: the adapter does something
  model.save_pretrained(str(tmp_path / "adapter"))
  arrays, meta = read_adapter(tmp_path / "adapter", shapes)
  assert set(arrays) == set(shapes) and (meta.rank, meta.scale) == (RANK, 16 / RANK)
  params = dict(model.named_parameters())
  for m, (a, b) in arrays.items():
    np.testing.assert_array_equal(
        a, params[f"base_model.model.{m}.lora_A.default.weight"].detach().numpy().T)
    np.testing.assert_array_equal(
        b, params[f"base_model.model.{m}.lora_B.default.weight"].detach().numpy().T)
  ours = merge_into(state_numpy(load_base(hf_base)), arrays, meta.scale)
  theirs = state_numpy(model.merge_and_unload())
  assert set(ours) == set(theirs)
  for k, v in theirs.items():
    np.testing.assert_allclose(ours[k], v, atol=1e-6, rtol=1e-6, err_msg=k)
  assert max(np.abs(ours[f"{m}.weight"] - w).max() for m in arrays
             for w in [state_numpy(load_base(hf_base))[f"{m}.weight"]]) > 1e-2
