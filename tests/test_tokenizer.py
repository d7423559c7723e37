"""Tokenizer wrapper, built-in tiny tokenizer, chat template, EOS handling."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import tokenizers

from distflow_jax.models.tokenizer import Tokenizer

ROOT = Path(__file__).resolve().parents[1]


def test_builtin_is_character_level_with_single_digit_tokens():
  tok = Tokenizer.builtin()
  assert tok.vocab_size == 104
  assert (tok.pad_id, tok.eos_id) == (0, 2) and tok.bos_id is None
  digits = [tok.encode(str(d)) for d in range(10)]
  assert all(len(d) == 1 for d in digits) and len({d[0] for d in digits}) == 10
  assert tok.encode("12 + 7") == [tok.encode(c)[0] for c in "12 + 7"]
  text = "What is 12 + 7?\nAnswer:\t#### 19 ~{}|`"
  assert tok.decode(tok.encode(text)) == text
  assert tok.decode(tok.encode("é")) == ""  # unknown -> <|unk|> (special, skipped)
  assert tok.decode(tok.encode("é"), skip_special_tokens=False) == "<|unk|>"


def test_builtin_chat_template_and_eos():
  tok = Tokenizer.builtin()
  msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2 + 3?"}]
  text = tok.apply_chat_template(msgs)
  assert text == "<|system|>Be brief.<|im_end|><|user|>What is 2 + 3?<|im_end|><|assistant|>"
  ids = tok.apply_chat_template(msgs, tokenize=True)
  assert ids[0] == tok.encode("<|system|>")[0] and ids[-1] == tok.encode("<|assistant|>")[0]
  assert len(ids) == 2 + len("Be brief.") + 2 + len("What is 2 + 3?") + 1
  assert ids.count(tok.eos_id) == 2
  full = msgs + [{"role": "assistant", "content": "#### 5"}]
  assert tok.apply_chat_template(full, add_generation_prompt=False).endswith(
      "<|assistant|>#### 5<|im_end|>")
  with pytest.raises(Exception, match="unknown role tool"):
    tok.apply_chat_template([{"role": "tool", "content": "x"}])


def test_shipped_assets_match_the_generator(tmp_path):
  subprocess.run([sys.executable, str(ROOT / "tools" / "make_tiny_tokenizer.py"), str(tmp_path)],
                 check=True, timeout=120)
  assets = ROOT / "distflow_jax" / "assets"
  for name in ("tiny_tokenizer.json", "tiny_tokenizer_config.json"):
    assert (tmp_path / name).read_bytes() == (assets / name).read_bytes(), name


def _write_dir(path, config, generation=None, with_template=None):
  tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(
      {"<unk>": 0, "<s>": 1, "</s>": 2, "<eot>": 3, "hello": 4, "world": 5}, unk_token="<unk>"))
  tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
  tok.add_special_tokens(["<s>", "</s>", "<eot>"])
  path.mkdir(parents=True, exist_ok=True)
  tok.save(str(path / "tokenizer.json"))
  (path / "tokenizer_config.json").write_text(json.dumps(config))
  if generation is not None:
    (path / "generation_config.json").write_text(json.dumps(generation))
  if with_template is not None:
    (path / "chat_template.jinja").write_text(with_template)


def test_from_dir_special_ids_generation_eos_and_save_roundtrip(tmp_path):
  _write_dir(tmp_path / "a", {"eos_token": {"content": "</s>"}, "bos_token": "<s>"},
             generation={"eos_token_id": [2, 3]},
             with_template="{% for m in messages %}{{ bos_token + m['content'] | tojson }}"
                           "{% endfor %}")
  tok = Tokenizer.from_dir(tmp_path / "a")
  assert (tok.eos_id, tok.pad_id, tok.bos_id, tok.eos_ids) == (2, 2, 1, (2, 3))
  assert tok.encode("hello world") == [4, 5]
  assert tok.apply_chat_template([{"role": "user", "content": "hi"}]) == '<s>"hi"'  # filters bind tighter than +
  tok.save(tmp_path / "b")
  again = Tokenizer.from_dir(tmp_path / "b")
  assert (again.eos_ids, again.encode("world hello")) == ((2, 3), [5, 4])
  assert again.chat_template == tok.chat_template


def test_from_dir_errors_name_the_problem(tmp_path):
  with pytest.raises(FileNotFoundError, match="tokenizer.json"):
    Tokenizer.from_dir(tmp_path)
  _write_dir(tmp_path / "c", {"eos_token": "<nope>"})
  with pytest.raises(ValueError, match="eos_token '<nope>'"):
    Tokenizer.from_dir(tmp_path / "c")
  _write_dir(tmp_path / "d", {"eos_token": "</s>"})
  with pytest.raises(ValueError, match="no chat_template"):
    Tokenizer.from_dir(tmp_path / "d").apply_chat_template([{"role": "user", "content": "x"}])


@pytest.mark.hf
def test_saved_builtin_loads_in_transformers(tmp_path):
  transformers = pytest.importorskip("transformers", reason="needs the hf extra")
  tok = Tokenizer.builtin()
  tok.save(tmp_path)
  hf = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
  text = "What is 40 + 2? #### 42"
  assert hf.encode(text, add_special_tokens=False) == tok.encode(text)
  msgs = [{"role": "user", "content": "What is 1 + 1?"}]
  assert hf.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True) == \
      tok.apply_chat_template(msgs)
  assert hf.eos_token_id == tok.eos_id and hf.pad_token_id == tok.pad_id


def test_same_ids_sees_through_the_byte_level_form_the_builtin_is_saved_in(tmp_path):
  from distflow_jax.models.tokenizer import Tokenizer
  tok = Tokenizer.builtin()
  tok.save(str(tmp_path))
  saved = Tokenizer.from_dir(str(tmp_path))
  assert tok.same_ids(saved) and saved.same_ids(tok)
  text = "What is 7 + 5?\n#### 12"
  assert saved.encode(text) == tok.encode(text)
  # The same tokens with two ids swapped: not the same tokenizer.
  data = json.loads(tok.tok.to_str())
  vocab = data["model"]["vocab"]
  a, b = "a", "b"
  vocab[a], vocab[b] = vocab[b], vocab[a]
  data["model"]["merges"] = []
  swapped = Tokenizer.from_dir(str(tmp_path))
  swapped.tok = tokenizers.Tokenizer.from_str(json.dumps(data))
  assert not tok.same_ids(swapped)
