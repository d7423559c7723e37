"""The exported tokenizer loads in `transformers.AutoTokenizer` with our ids (issue 17.3).

transformers 5 rebuilds a `qwen2` model's tokenizer as byte-level BPE from the vocab and
merges alone; the built-in character tokenizer is therefore saved as the equivalent
byte-level BPE, and an exported model answers the same in transformers as in ours.
"""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import tokenizers
from flax import nnx

from distflow_jax.models import hf_io
from distflow_jax.models.config import ModelConfig
from distflow_jax.models.tokenizer import Tokenizer, byte_level_json
from distflow_jax.models.transformer import Transformer, forward, init_cache

transformers = pytest.importorskip("transformers",
                                   reason="needs the hf extra (pip install '.[hf]')")
torch = pytest.importorskip("torch", reason="needs the hf extra (pip install '.[hf]')")

pytestmark = [pytest.mark.hf, pytest.mark.timeout(300)]
ARCHS = ["qwen2", "llama", "qwen3"]
TEXTS = ["What is 12 + 7?", "  two  spaces\tand a tab\n\nnew lines\n", "#### 019",
         "a=1, b=-2.50; (x*y)/z ~{}|`!\"'", "1234567890 0987654321", " leading", "trailing "]


def tiny_model(arch, vocab, seed=0):
  cfg = ModelConfig(arch=arch, vocab_size=vocab, hidden_size=64, intermediate_size=128,
                    num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                    qkv_bias=arch == "qwen2", qk_norm=arch == "qwen3",
                    tie_embeddings=arch != "llama", max_position_embeddings=256)
  return Transformer(cfg, rngs=nnx.Rngs(seed))


def export(tmp_path, arch, tok, seed=0):
  model = tiny_model(arch, tok.vocab_size, seed)
  path = tmp_path / arch
  hf_io.save_pretrained(path, model, tok)
  return model, str(path)


def chat(tok):
  return tok.apply_chat_template([{"role": "system", "content": "Be brief."},
                                  {"role": "user", "content": "What is 2 + 3?\nThink."}])


@pytest.mark.parametrize("arch", ARCHS)
def test_builtin_tokenizer_round_trips_through_auto_tokenizer(tmp_path, arch):
  tok = Tokenizer.builtin()
  _, path = export(tmp_path, arch, tok)
  hf = transformers.AutoTokenizer.from_pretrained(path)
  again = Tokenizer.from_dir(path)
  for text in TEXTS + [chat(tok)]:
    ids = tok.encode(text)
    assert hf.encode(text, add_special_tokens=False) == ids, (type(hf).__name__, text)
    assert again.encode(text) == ids, text
    assert hf.decode(ids, skip_special_tokens=False) == text
    assert again.decode(ids, skip_special_tokens=False) == text
  assert hf.eos_token_id == tok.eos_id and hf.pad_token_id == tok.pad_id
  assert hf.apply_chat_template([{"role": "user", "content": "Hi  there"}], tokenize=False,
                                add_generation_prompt=True) == \
      tok.apply_chat_template([{"role": "user", "content": "Hi  there"}])


def test_byte_level_conversion_only_for_character_level_bpe():
  tok = Tokenizer.builtin()
  d = json.loads(byte_level_json(tok.tok))
  assert d["model"]["vocab"]["\u0120"] == tok.encode(" ")[0]  # 'Ġ' is the space byte
  assert d["model"]["vocab"]["\u010a"] == tok.encode("\n")[0]
  assert d["pre_tokenizer"]["type"] == d["decoder"]["type"] == "ByteLevel"
  word = tokenizers.Tokenizer(tokenizers.models.WordLevel({"<unk>": 0, "a": 1}, unk_token="<unk>"))
  assert byte_level_json(word) is None
  assert byte_level_json(qwen_like_bpe()) is None


def qwen_like_bpe():
  """A small byte-level BPE with Qwen2's normalizer, pre-tokenizer and decoder."""
  from tokenizers import Regex, decoders, models, normalizers, pre_tokenizers, trainers
  regex = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+"""
           r"""[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+""")
  tok = tokenizers.Tokenizer(models.BPE())
  tok.normalizer = normalizers.NFC()
  tok.pre_tokenizer = pre_tokenizers.Sequence([
      pre_tokenizers.Split(Regex(regex), behavior="isolated"),
      pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
  tok.decoder = decoders.ByteLevel()
  specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
  trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=specials,
                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
  corpus = ["What is the answer? The answer is 42.\n", "  spaces and\ttabs\n",
            "Natalia sold clips to 48 of her friends in April."] * 20
  tok.train_from_iterator(corpus, trainer)
  return tok


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_byte_level_bpe_tokenizer_is_exported_as_it_is(tmp_path, arch):
  template = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + "
              "'<|im_end|>\n' }}{% endfor %}{% if add_generation_prompt %}"
              "{{ '<|im_start|>assistant\n' }}{% endif %}")
  tok = Tokenizer(qwen_like_bpe(), {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
                                    "chat_template": template})
  _, path = export(tmp_path, arch, tok)
  hf = transformers.AutoTokenizer.from_pretrained(path)
  for text in TEXTS + [chat(tok), "The answer is 42. Natalia sold clips"]:
    ids = tok.encode(text)
    assert hf.encode(text, add_special_tokens=False) == ids, (type(hf).__name__, text)
    assert hf.decode(ids, skip_special_tokens=False) == text


def our_greedy(model, prompt, n_new):
  g, p = nnx.split(model)
  t = len(prompt)
  logits, cache = forward(g, p, jnp.asarray([prompt]), jnp.arange(t)[None], None,
                          init_cache(model.cfg, 1, t + n_new), jnp.zeros(1, jnp.int32))
  out = [int(jnp.argmax(logits[0, -1]))]
  for i in range(n_new - 1):
    idx = jnp.full((1,), t + i, jnp.int32)
    logits, cache = forward(g, p, jnp.asarray([[out[-1]]]), idx[:, None], None, cache, idx)
    out.append(int(jnp.argmax(logits[0, 0])))
  return out


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_transformers_greedy_generation_through_the_exported_tokenizer_equals_ours(tmp_path,
                                                                                   arch):
  tok = Tokenizer.builtin()
  model = tiny_model(arch, tok.vocab_size, seed=3)
  # Larger weights: argmax continuations that vary from token to token.
  nnx.update(model, jax.tree.map(lambda x: x * 8.0 if x.ndim == 2 else x,
                                 nnx.state(model, nnx.Param)))
  path = tmp_path / arch
  hf_io.save_pretrained(path, model, tok)
  hf_tok = transformers.AutoTokenizer.from_pretrained(str(path))
  hf_model = transformers.AutoModelForCausalLM.from_pretrained(
      str(path), attn_implementation="eager", dtype=torch.float32).eval()
  for text in ["What is 12 + 7?\nAnswer: ", chat(tok)]:
    enc = hf_tok(text, return_tensors="pt", add_special_tokens=False)
    assert enc["input_ids"][0].tolist() == tok.encode(text)
    with torch.no_grad():
      out = hf_model.generate(**enc, do_sample=False, max_new_tokens=12, min_new_tokens=12,
                              eos_token_id=None, pad_token_id=tok.pad_id)
    theirs = out[0, enc["input_ids"].shape[1]:].tolist()
    ours = our_greedy(model, tok.encode(text), 12)
    assert theirs == ours, text
    assert hf_tok.decode(theirs, skip_special_tokens=True) == tok.decode(ours)
    assert len(set(ours)) > 1
