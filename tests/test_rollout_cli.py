"""`distflow-jax generate` (commands/generate.py): JSONL in, JSONL out."""

import json
import os
import subprocess
import sys

import jax
import pytest
from flax import nnx

from distflow_jax.config import loading
from distflow_jax.models import ModelConfig, Transformer, hf_io
from distflow_jax.models.tokenizer import Tokenizer
from distflow_jax.commands import generate as generate_cmd
from conftest import suite_flags

PROMPTS = ["12 + 7 =", "What is 3 * 4?", "hello"]


def run_cli(*args):
  env = suite_flags(os.environ, devices=1)
  code = ("import sys; from distflow_jax.commands.generate import run; "
          "sys.exit(run(sys.argv[1:]))")
  return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True,
                        timeout=240, env=env)


def write_prompts(tmp_path):
  path = tmp_path / "prompts.jsonl"
  path.write_text("".join(json.dumps({"prompt": p, "id": i}) + "\n" for i, p in enumerate(PROMPTS)))
  return str(path)


@pytest.mark.timeout(240)
def test_generate_builtin_tiny_model_writes_jsonl(tmp_path):
  out = tmp_path / "out.jsonl"
  r = run_cli("--config=configs/grpo.py:tiny", f"--prompts={write_prompts(tmp_path)}",
              f"--out={out}", "--n=2", "--max_new_tokens=8", "--config.rollout.temperature=0",
              "--random_init")
  assert r.returncode == 0, r.stderr
  rows = [json.loads(l) for l in out.read_text().splitlines()]
  assert [(x["index"], x["sample"]) for x in rows] == [(i, j) for i in range(3) for j in range(2)]
  tok = Tokenizer.builtin()
  for x in rows:
    assert x["prompt"] == PROMPTS[x["index"]]
    assert 1 <= len(x["tokens"]) <= 8 and len(x["logprobs"]) == len(x["tokens"])
    assert all(lp <= 0 for lp in x["logprobs"])
    assert x["completion"] == tok.decode(x["tokens"])
    assert x["finish_reason"] == ("stop" if x["tokens"][-1] in tok.eos_ids else "length")
  for i in range(3):  # greedy: both samples agree
    assert rows[2 * i]["tokens"] == rows[2 * i + 1]["tokens"]
  assert "6 completions" in r.stderr


@pytest.mark.timeout(240)
def test_generate_from_local_hf_dir_matches_the_engine(tmp_path):
  from distflow_jax.rollout import Engine, EngineConfig, SamplingParams, generate, replica_mesh
  tok = Tokenizer.builtin()
  cfg = ModelConfig(arch="llama", vocab_size=tok.vocab_size, hidden_size=64, intermediate_size=128,
                    num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16)
  model = Transformer(cfg, rngs=nnx.Rngs(3))
  nnx.update(model, jax.tree.map(lambda x: x * 10.0 if x.ndim == 2 else x,
                                 nnx.state(model, nnx.Param)))
  ckpt = tmp_path / "ckpt"
  hf_io.save_pretrained(ckpt, model, tokenizer=tok)
  out = tmp_path / "out.jsonl"
  r = run_cli("--config=configs/grpo.py:tiny", f"--prompts={write_prompts(tmp_path)}",
              f"--out={out}", "--n=1", "--max_new_tokens=6", f"--config.model.path={ckpt}",
              "--config.rollout.temperature=0")
  assert r.returncode == 0, r.stderr
  rows = [json.loads(l) for l in out.read_text().splitlines()]
  eng = Engine(cfg, EngineConfig(max_concurrent_decodes=4, prefill_buckets=(32, 64),
                                 max_new_tokens=6, stop_ids=tok.eos_ids,
                                 sampling=SamplingParams(0.0)),
               replica_mesh(1, jax.devices()[:1]))
  want = generate(eng, eng.load_params(model), [tok.encode(p) for p in PROMPTS])
  for i, x in enumerate(rows):
    assert x["tokens"] == want.tokens_RxN[i, :want.lengths_R[i]].tolist()


def test_bad_inputs_are_named(tmp_path):
  bad = tmp_path / "bad.jsonl"
  bad.write_text('{"text": "no prompt key"}\n')
  with pytest.raises(loading.ConfigError, match="'prompt'"):
    generate_cmd.run(["--config=configs/grpo.py:tiny", f"--prompts={bad}"])
  with pytest.raises(loading.ConfigError, match="--prompts"):
    generate_cmd.run(["--config=configs/grpo.py:tiny"])
  with pytest.raises(loading.ConfigError, match="not found|No such file"):
    generate_cmd.run(["--config=configs/grpo.py:tiny", f"--prompts={tmp_path / 'missing'}"])


def _model_dir_without_tokenizer(tmp_path):
  tok = Tokenizer.builtin()
  cfg = ModelConfig(arch="llama", vocab_size=tok.vocab_size, hidden_size=32,
                    intermediate_size=64, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=16)
  ckpt = tmp_path / "no_tok"
  hf_io.save_pretrained(ckpt, Transformer(cfg, rngs=nnx.Rngs(0)))  # no tokenizer saved
  assert not any("token" in f for f in os.listdir(ckpt))
  return ckpt


def test_model_folder_without_a_tokenizer_is_named_before_any_weight_is_read(tmp_path,
                                                                             monkeypatch):
  """Issue 16: the tokenizer files are checked first, not after loading (maybe GBs of)
  weights."""
  ckpt = _model_dir_without_tokenizer(tmp_path)
  loads = []
  monkeypatch.setattr(hf_io, "load_pretrained", lambda *a, **k: loads.append(a))
  with pytest.raises(loading.ConfigError, match=r"^model\.path=.* has no tokenizer\.json"):
    generate_cmd.run(["--config=configs/grpo.py:tiny", f"--prompts={write_prompts(tmp_path)}",
                      f"--config.model.path={ckpt}"])
  assert loads == []


@pytest.mark.timeout(240)
def test_model_folder_without_a_tokenizer_is_one_line_exit_2(tmp_path):
  ckpt = _model_dir_without_tokenizer(tmp_path)
  r = subprocess.run([sys.executable, "-m", "distflow_jax.cli", "generate",
                      "--config=configs/grpo.py:tiny", f"--prompts={write_prompts(tmp_path)}",
                      f"--config.model.path={ckpt}"], capture_output=True, text=True,
                     timeout=240)
  assert r.returncode == 2, r.stderr
  lines = r.stderr.strip().splitlines()
  assert len(lines) == 1 and "has no tokenizer.json" in lines[0], r.stderr


def _launched(tmp_path, procs, devs, *flags):
  from distflow_jax import launcher
  out = tmp_path / f"out_{procs}x{devs}.jsonl"
  result = launcher.launch(procs, devs, [
      sys.executable, "-m", "distflow_jax.cli", "generate", "--random_init",
      f"--prompts={write_prompts(tmp_path)}", f"--out={out}", *flags],
      timeout_s=200, env=suite_flags(os.environ, devices=devs), out=None)
  assert result.ok, result.describe() + "\n" + "\n".join(sum(result.outputs, [])[-20:])
  files = [out] if procs == 1 else [f"{out}.{p}" for p in range(procs)]
  rows = [json.loads(l) for f in files for l in open(f).read().splitlines()]
  return sorted((r["index"], r["sample"], r["tokens"]) for r in rows), result.outputs


@pytest.mark.timeout(300)
@pytest.mark.multiprocess
def test_generate_on_a_replica_spanning_two_processes_equals_one_process(tmp_path):
  """rollout.tensor_parallel=2 on 2 processes x 1 device: one replica over both, their
  prompts pooled (rollout/spanning.py); sampled, n=2, the same completions as 1 process x 2
  devices (request i * n + s draws alike wherever line i lands)."""
  flags = ["--n=2", "--max_new_tokens=6", "--config.rollout.temperature=1.0",
           "--config.rollout.tensor_parallel=2"]
  spanning, _ = _launched(tmp_path, 2, 1, *flags)
  single, _ = _launched(tmp_path, 1, 2, *flags)
  assert [(i, s) for i, s, _ in spanning] == [(i, s) for i in range(3) for s in range(2)]
  assert spanning == single
  assert len({tuple(t) for _, _, t in single}) > 1  # sampled: not one answer everywhere
