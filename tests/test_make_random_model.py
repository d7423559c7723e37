"""tools/make_random_model.py: the folder it writes loads in our loader and in transformers alike."""

import json
import os
import sys

import jax.numpy as jnp
import numpy as np
import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tools"))
import make_random_model as mrm  # noqa: E402

from distflow_jax.models.hf_io import load_pretrained, read_config  # noqa: E402
from distflow_jax.models.tokenizer import Tokenizer  # noqa: E402

# The presets' configs (RoPE, biases, tying) with small sizes; initializer_range 0.2 so the logits differ clearly.
SMALL = ["num_hidden_layers=2", "hidden_size=64", "intermediate_size=128",
         "num_attention_heads=4", "num_key_value_heads=2", "head_dim=16", "vocab_size=512",
         "max_position_embeddings=512", "initializer_range=0.2"]
MESSAGES = [{"role": "user", "content": "What is 12 + 7 * 3?  Ann has 14 apples.\n\nok"}]


@pytest.fixture(scope="module", params=["qwen2.5-0.5b", "llama-3.2-1b"])
def folder(request, tmp_path_factory):
  out = tmp_path_factory.mktemp(request.param)
  mrm.main(["--preset", request.param, "--out", str(out), "--override", *SMALL])
  return out


def test_presets_have_the_real_shapes(tmp_path):
  q = mrm.hf_config("qwen2.5-0.5b")
  assert (q["vocab_size"], q["hidden_size"], q["num_hidden_layers"], q["num_attention_heads"],
          q["num_key_value_heads"], q["head_dim"], q["intermediate_size"],
          q["tie_word_embeddings"], q["rope_theta"]) == (151936, 896, 24, 14, 2, 64, 4864,
                                                          True, 1e6)
  ll = mrm.hf_config("llama-3.2-1b")
  assert (ll["vocab_size"], ll["hidden_size"], ll["num_hidden_layers"], ll["num_attention_heads"],
          ll["num_key_value_heads"], ll["intermediate_size"]) == (128256, 2048, 16, 32, 8, 8192)
  cfg = read_config(_config_only(tmp_path / "llama", "llama-3.2-1b"))
  assert cfg.arch == "llama" and cfg.rope_llama3 == (32.0, 1.0, 4.0, 8192)
  q7 = tmp_path / "q7"
  mrm.main(["--preset", "qwen2.5-7b", "--out", str(q7)])  # config only: 15 GB of weights
  assert sorted(p.name for p in q7.iterdir()) == ["config.json"]
  cfg = read_config(q7)
  assert (cfg.vocab_size, cfg.hidden_size, cfg.num_layers, cfg.tie_embeddings) == (
      152064, 3584, 28, False)
  assert 7.0e9 < cfg.num_params < 7.8e9


def _config_only(out, preset):
  mrm.main(["--preset", preset, "--out", str(out), "--config-only"])
  return out


def test_folder_loads_with_our_loader(folder):
  index = json.loads((folder / "model.safetensors.index.json").read_text())
  assert len(set(index["weight_map"].values())) == 4  # embeddings, 2 layers, final norm
  tok = Tokenizer.from_dir(folder)
  assert tok.vocab_size == 512 and tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>"
  text = tok.apply_chat_template(MESSAGES)
  assert text.startswith("<|im_start|>system\n") and text.endswith("<|im_start|>assistant\n")
  assert tok.decode(tok.encode(text), skip_special_tokens=False) == text
  model = load_pretrained(folder)
  assert model.cfg.dtype == "bfloat16" and model.cfg.num_layers == 2
  emb = model.embed.embedding[...]
  assert emb.dtype == jnp.bfloat16 and 0.15 < float(jnp.std(emb.astype(jnp.float32))) < 0.25


@pytest.mark.hf
@pytest.mark.timeout(120)
def test_transformers_agrees_on_logits_and_ids(folder):
  torch = pytest.importorskip("torch")
  transformers = pytest.importorskip("transformers")
  hf_tok = transformers.AutoTokenizer.from_pretrained(str(folder))
  tok = Tokenizer.from_dir(folder)
  text = tok.apply_chat_template(MESSAGES)
  assert hf_tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False) == text
  ids = tok.encode(text)
  assert hf_tok(text)["input_ids"] == ids
  hf = transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
  with torch.no_grad():
    want = hf(input_ids=torch.tensor([ids])).logits.numpy()
  ours = load_pretrained(folder, dtype="float32")
  tokens = jnp.asarray([ids], jnp.int32)
  got, _ = ours(tokens, jnp.arange(len(ids), dtype=jnp.int32)[None])
  assert float(np.abs(want).max()) > 0.1  # logits far from zero: the comparison means something
  np.testing.assert_allclose(np.asarray(got), want, atol=1e-4, rtol=1e-4)
