"""Bad model folders and bad command lines: one line naming the culprit, never a traceback.

Each test builds its own tiny Hugging Face folder (config.json, model.safetensors,
tokenizer files) and breaks one thing in it.  CLI cases run `cli.main` in-process.
"""

import errno
import json
import os

import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file, save_file

from distflow_jax import cli
from distflow_jax.config.loading import ConfigError
from distflow_jax.models.config import ModelConfig
from distflow_jax.models.errors import ModelFileError, ModelFileNotFoundError
from distflow_jax.models.hf_io import export_state_dict, load_pretrained, read_config
from distflow_jax.models.hf_io import save_pretrained
from distflow_jax.models.tokenizer import Tokenizer
from distflow_jax.models.transformer import Transformer

INDEX = "model.safetensors.index.json"


def tiny_cfg(vocab=104):
  return ModelConfig(arch="llama", vocab_size=vocab, hidden_size=32, intermediate_size=48,
                     num_layers=1, num_heads=4, num_kv_heads=2, head_dim=8)


def hf_folder(path, tokenizer=True):
  """A loadable tiny llama folder (with the built-in tokenizer unless told otherwise)."""
  model = Transformer(tiny_cfg(), rngs=nnx.Rngs(0))
  save_pretrained(path, model, tokenizer=Tokenizer.builtin() if tokenizer else None)
  return model


def write_index(folder, weight_map):
  (folder / INDEX).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


# ---- A: an index must not reach outside the model folder -------------------------------------

def _folder_with_outside_shard(tmp_path):
  """model/ holds config.json and an index; every tensor sits in outside/w.safetensors."""
  folder, outside = tmp_path / "model", tmp_path / "outside"
  model = hf_folder(folder, tokenizer=False)
  outside.mkdir()
  os.replace(folder / "model.safetensors", outside / "w.safetensors")
  return folder, outside, sorted(export_state_dict(model))


@pytest.mark.parametrize("how", ["absolute", "dotdot", "dotdot_inside_name"])
def test_index_shard_outside_the_folder_is_refused(tmp_path, how):
  folder, outside, names = _folder_with_outside_shard(tmp_path)
  shard = {"absolute": str(outside / "w.safetensors"),
           "dotdot": "../outside/w.safetensors",
           "dotdot_inside_name": "sub/../../outside/w.safetensors"}[how]
  write_index(folder, {n: shard for n in names})
  with pytest.raises(ModelFileError) as e:
    load_pretrained(folder)
  msg = str(e.value)
  assert str(folder / INDEX) in msg and repr(shard) in msg and "\n" not in msg
  assert ("absolute path" if how == "absolute" else "outside the model folder") in msg


def test_index_shard_paths_inside_the_folder_still_load(tmp_path):
  # A normalised path that stays inside, and a symlink placed in the folder (Hugging Face's
  # cache links snapshot files to ../../blobs): the folder's owner put those there.
  folder, outside, names = _folder_with_outside_shard(tmp_path)
  tensors = load_file(str(outside / "w.safetensors"))
  half = len(names) // 2
  (folder / "sub").mkdir()
  save_file({n: tensors[n] for n in names[:half]}, str(folder / "a.safetensors"))
  save_file({n: tensors[n] for n in names[half:]}, str(outside / "b.safetensors"))
  os.symlink(outside / "b.safetensors", folder / "linked.safetensors")
  write_index(folder, {**{n: "sub/../a.safetensors" for n in names[:half]},
                       **{n: "linked.safetensors" for n in names[half:]}})
  loaded = load_pretrained(folder)
  np.testing.assert_array_equal(np.asarray(loaded.embed.embedding.get_value()),
                                tensors["model.embed_tokens.weight"])


def test_index_that_is_not_json_or_has_no_weight_map(tmp_path):
  hf_folder(tmp_path, tokenizer=False)
  (tmp_path / INDEX).write_text('{"weight_map": {"a": ')
  with pytest.raises(ModelFileError, match=rf"{INDEX}.*is not valid JSON"):
    load_pretrained(tmp_path)
  (tmp_path / INDEX).write_text('["model.safetensors"]')
  with pytest.raises(ModelFileError, match=rf"{INDEX}.*must hold a JSON object.*got a list"):
    load_pretrained(tmp_path)
  (tmp_path / INDEX).write_text('{"metadata": {}}')
  with pytest.raises(ModelFileError, match=rf"{INDEX}: needs a non-empty \"weight_map\""):
    load_pretrained(tmp_path)
  write_index(tmp_path, {"model.norm.weight": 7})
  with pytest.raises(ModelFileError, match=r"weight_map entry 'model.norm.weight': 7 is not a "
                                           r"file name"):
    load_pretrained(tmp_path)


# ---- B: config.json, safetensors and tokenizer files -----------------------------------------

@pytest.mark.parametrize("text, pattern", [
    ("[1, 2]", r"must hold a JSON object \(\{\.\.\.\}\), got a list"),
    ('"llama"', r"must hold a JSON object .*got a string"),
    ('{"architectures": ["LlamaForCausalLM"],', r"is not valid JSON: .* line 1"),
    ("", r"is not valid JSON"),
    (b"\xff\xfe\x00garbage", r"is not UTF-8 text"),
])
def test_config_json_that_is_not_an_object(tmp_path, text, pattern):
  hf_folder(tmp_path, tokenizer=False)
  f = tmp_path / "config.json"
  f.write_bytes(text if isinstance(text, bytes) else text.encode())
  for load in (read_config, load_pretrained):
    with pytest.raises(ModelFileError, match=pattern) as e:
      load(tmp_path)
    assert str(f) in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("key", ["hidden_size", "num_attention_heads", "vocab_size"])
def test_config_json_missing_a_required_key(tmp_path, key):
  hf_folder(tmp_path, tokenizer=False)
  f = tmp_path / "config.json"
  d = json.loads(f.read_text())
  del d[key]
  f.write_text(json.dumps(d))
  with pytest.raises(ModelFileError, match=rf"config\.json: missing required key '{key}'"):
    load_pretrained(tmp_path)


def test_config_json_with_a_wrongly_typed_value(tmp_path):
  hf_folder(tmp_path, tokenizer=False)
  f = tmp_path / "config.json"
  f.write_text(json.dumps(dict(json.loads(f.read_text()), num_attention_heads="four")))
  with pytest.raises(ModelFileError, match=r"config\.json: "):
    read_config(tmp_path)


@pytest.mark.parametrize("content", ["truncated", "text", "empty"])
def test_safetensors_that_is_truncated_or_not_safetensors(tmp_path, content):
  hf_folder(tmp_path, tokenizer=False)
  f = tmp_path / "model.safetensors"
  data = f.read_bytes()
  f.write_bytes({"truncated": data[: len(data) // 2], "text": b"version https://git-lfs...\n",
                 "empty": b""}[content])
  with pytest.raises(ModelFileError, match=r"is not a readable safetensors file") as e:
    load_pretrained(tmp_path)
  assert str(f) in str(e.value) and "\n" not in str(e.value)


def test_shape_mismatch_names_tensor_expected_and_found(tmp_path):
  hf_folder(tmp_path, tokenizer=False)
  f = tmp_path / "config.json"
  f.write_text(json.dumps(dict(json.loads(f.read_text()), intermediate_size=64)))
  with pytest.raises(ModelFileError, match=r"shape mismatch for tensor "
                                           r"'model\.layers\.0\.mlp\.down_proj\.weight' in .*"
                                           r"model\.safetensors: file has \(32, 48\), config .*"
                                           r"config\.json needs \(32, 64\)"):
    load_pretrained(tmp_path)


def test_missing_folder_and_files_are_still_file_not_found(tmp_path):
  with pytest.raises(ModelFileNotFoundError, match="does not exist"):
    load_pretrained(tmp_path / "nope")
  with pytest.raises(FileNotFoundError, match=r"missing .*tokenizer\.json"):
    Tokenizer.from_dir(tmp_path)
  assert issubclass(ModelFileNotFoundError, ConfigError)


@pytest.mark.parametrize("text, pattern", [
    ("garbage", r"tokenizer\.json is not a readable tokenizers file: expected value"),
    ("{}", r"tokenizer\.json is not a readable tokenizers file"),
    ("", r"tokenizer\.json is not a readable tokenizers file"),
])
def test_garbage_tokenizer_json(tmp_path, text, pattern):
  Tokenizer.builtin().save(tmp_path)
  (tmp_path / "tokenizer.json").write_text(text)
  with pytest.raises(ModelFileError, match=pattern) as e:
    Tokenizer.from_dir(tmp_path)
  assert str(tmp_path / "tokenizer.json") in str(e.value)


@pytest.mark.parametrize("text, pattern", [
    ("{not json", r"tokenizer_config\.json \(tokenizer config\) is not valid JSON"),
    ('["<|im_end|>"]', r"tokenizer_config\.json \(tokenizer config\) must hold a JSON object"),
    ('{"eos_token": 5}', r"tokenizer_config\.json: "),
    ('{"eos_token": "<|im_end|>", "chat_template": [{"name": "x"}]}',
     r"tokenizer_config\.json: chat_template must be a string"),
    ('{"pad_token": "<|pad|>"}', r"tokenizer_config\.json: tokenizer config has no eos_token"),
])
def test_garbage_tokenizer_config_json(tmp_path, text, pattern):
  Tokenizer.builtin().save(tmp_path)
  (tmp_path / "tokenizer_config.json").write_text(text)
  with pytest.raises(ModelFileError, match=pattern):
    Tokenizer.from_dir(tmp_path)


def test_garbage_generation_config_and_chat_template(tmp_path):
  Tokenizer.builtin().save(tmp_path)
  (tmp_path / "generation_config.json").write_text('{"eos_token_id": "<|im_end|>"}')
  with pytest.raises(ModelFileError, match=r"generation_config\.json: eos_token_id must be"):
    Tokenizer.from_dir(tmp_path)
  (tmp_path / "generation_config.json").write_text("[")
  with pytest.raises(ModelFileError, match=r"generation_config\.json .*is not valid JSON"):
    Tokenizer.from_dir(tmp_path)
  (tmp_path / "generation_config.json").unlink()
  cfg = json.loads((tmp_path / "tokenizer_config.json").read_text())
  (tmp_path / "tokenizer_config.json").write_text(json.dumps(dict(cfg, chat_template="{% if %}")))
  tok = Tokenizer.from_dir(tmp_path)
  with pytest.raises(ModelFileError, match=r"tokenizer_config\.json: the chat template does "
                                           r"not parse"):
    tok.apply_chat_template([{"role": "user", "content": "hi"}])


# ---- B/C: the same through the command line ------------------------------------------------

def run_main(capsys, *argv):
  code = cli.main(list(argv))
  out = capsys.readouterr()
  return code, out.out, out.err


def assert_one_line(err, *needles):
  lines = [l for l in err.splitlines() if l.strip()]
  assert "Traceback" not in err, err
  assert len(lines) == 1, err
  for n in needles:
    assert n in lines[0], err


def generate(capsys, tmp_path, model_dir):
  prompts = tmp_path / "prompts.jsonl"
  prompts.write_text(json.dumps({"prompt": "1 + 1 ="}) + "\n")
  return run_main(capsys, "generate", "--config=grpo:tiny", f"--config.model.path={model_dir}",
                  f"--prompts={prompts}", f"--out={tmp_path / 'out.jsonl'}", "--n=1",
                  "--max_new_tokens=2")


def _break(folder, how):
  """Breaks one thing in a good folder; returns the file the message must name."""
  if how == "no_tokenizer":
    (folder / "tokenizer.json").unlink()
    return folder / "tokenizer.json"
  if how == "config_list":
    (folder / "config.json").write_text("[]")
    return folder / "config.json"
  if how == "config_missing_key":
    d = json.loads((folder / "config.json").read_text())
    del d["num_hidden_layers"]
    (folder / "config.json").write_text(json.dumps(d))
    return folder / "config.json"
  if how == "truncated_weights":
    data = (folder / "model.safetensors").read_bytes()
    (folder / "model.safetensors").write_bytes(data[:100])
    return folder / "model.safetensors"
  if how == "bad_index":
    (folder / INDEX).write_text("{")
    return folder / INDEX
  if how == "index_escapes":
    write_index(folder, {"model.norm.weight": "/etc/passwd"})
    return folder / INDEX
  if how == "garbage_tokenizer":
    (folder / "tokenizer.json").write_text("garbage")
    return folder / "tokenizer.json"
  if how == "garbage_tokenizer_config":
    (folder / "tokenizer_config.json").write_text("{'single': 'quotes'}")
    return folder / "tokenizer_config.json"
  if how == "shape_mismatch":
    d = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(dict(d, hidden_size=40)))
    return folder / "config.json"
  raise AssertionError(how)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("how", ["no_tokenizer", "config_list", "config_missing_key",
                                 "truncated_weights", "bad_index", "index_escapes",
                                 "garbage_tokenizer", "garbage_tokenizer_config",
                                 "shape_mismatch"])
def test_generate_on_a_broken_folder_is_one_line_exit_2(tmp_path, capsys, how):
  folder = tmp_path / "model"
  hf_folder(folder)
  culprit = _break(folder, how)
  code, _, err = generate(capsys, tmp_path, folder)
  assert code == 2, err
  assert_one_line(err, "distflow-jax generate: error:", str(culprit))
  if how == "shape_mismatch":
    assert "shape mismatch for tensor 'model." in err and "file has (" in err


@pytest.mark.timeout(240)
def test_train_with_run_dir_under_a_regular_file_is_one_line(tmp_path, capsys):
  # Tests run as root, so chmod cannot make a read-only run_dir: a path below a regular
  # file fails for everyone (ENOTDIR).
  blocker = tmp_path / "a_file"
  blocker.write_text("not a directory")
  code, _, err = run_main(capsys, "train", "--config=grpo:tiny",
                          f"--config.run_dir={blocker}/run", "--config.trainer.total_steps=1")
  assert code == 2, err
  assert_one_line(err, "distflow-jax train: error:", str(blocker))


def _raising(exc):
  def command(argv):
    raise exc
  return command


@pytest.mark.parametrize("exc, code, needles", [
    (ValueError("deep inside\nsecond line of detail"), 1,
     ["failed: ValueError: deep inside", "--debug"]),
    (RuntimeError(), 1, ["failed: RuntimeError (run with --debug"]),
    (PermissionError(errno.EACCES, "Permission denied", "/ro/run"), 2,
     ["error: Permission denied: /ro/run"]),
    (OSError(errno.ENOSPC, "No space left on device", "/full/disk"), 1,
     ["error: no space left on device: /full/disk", "free space"]),
    (ConfigError("bad key"), 2, ["error: bad key"]),
    (ModelFileError("/m/config.json: nope"), 2, ["error: /m/config.json: nope"]),
])
def test_every_error_is_one_line_with_its_exit_code(monkeypatch, capsys, exc, code, needles):
  monkeypatch.setitem(cli.COMMANDS, "plan", _raising(exc))
  monkeypatch.delenv(cli.DEBUG_ENV, raising=False)
  got, _, err = run_main(capsys, "plan")
  assert got == code, err
  assert_one_line(err, *needles)


def test_debug_flag_and_env_show_the_traceback(monkeypatch, capsys):
  seen = []

  def command(argv):
    seen.append(list(argv))
    raise ValueError("deep inside")

  monkeypatch.setitem(cli.COMMANDS, "plan", command)
  monkeypatch.delenv(cli.DEBUG_ENV, raising=False)
  code, _, err = run_main(capsys, "--debug", "plan", "--x=1")
  assert code == 1 and "Traceback" in err and "ValueError: deep inside" in err
  assert "run with --debug" not in err
  code, _, err = run_main(capsys, "plan", "--debug", "--", "child", "--debug")
  assert code == 1 and "Traceback" in err
  assert seen == [["--x=1"], ["--", "child", "--debug"]]  # a child's own --debug is kept
  monkeypatch.setenv(cli.DEBUG_ENV, "1")
  monkeypatch.setitem(cli.COMMANDS, "plan", _raising(ConfigError("bad key")))
  code, _, err = run_main(capsys, "plan")
  assert code == 2 and "Traceback" in err and err.strip().endswith("error: bad key")
  monkeypatch.setenv(cli.DEBUG_ENV, "0")
  code, _, err = run_main(capsys, "plan")
  assert code == 2 and "Traceback" not in err


def test_generation_config_with_a_null_eos_is_accepted(tmp_path):
  Tokenizer.builtin().save(tmp_path)
  (tmp_path / "generation_config.json").write_text('{"eos_token_id": null}')
  assert Tokenizer.from_dir(tmp_path).eos_ids == (Tokenizer.builtin().eos_id,)
