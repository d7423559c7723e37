"""Tunix's sampler as a bench contender (bench_rollout, bench_decode): one module for both.

The parent side (this venv): ``tunix_python`` (the Tunix venv's python, or why not),
``Sampler`` (a worker process that holds Tunix's qwen2 or llama3 model, loaded from the
folder our ``hf_io.save_pretrained`` wrote, and answers each ``run(key)`` with the tokens
and the seconds of one sampler call on the prompt set ``key``), ``agreement`` (token for token).

The worker side runs this file as a script in the Tunix venv (google-tunix 0.1.7,
``python _tunix_side.py INPUTS.json``): ``tunix.generate.sampler.Sampler``, greedy
(temperature 0), a KV cache of prompt + new tokens, timed around the sampler call.  The
prompts go to it as text of space-separated ids through ``IdsTokenizer``, which parses them
back, so it sees exactly our token ids; its EOS is one past the vocabulary, never generated,
so every row decodes all the new tokens.  A sampler call that fails (a batch or a cache
Tunix cannot hold) answers ``{"error": ...}`` and the worker goes on with the next.

Imports only numpy and _bench_common at module level: both venvs have them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _bench_common as bc  # noqa: E402


def agreement(a, b) -> tuple[float, int]:
  """(Fraction of equal tokens, rows equal in full) of two [rows, new] token arrays."""
  a, b = np.asarray(a), np.asarray(b)
  if a.shape != b.shape:
    return 0.0, 0
  return float(np.mean(a == b)), int(np.all(a == b, axis=1).sum())


def one_line(e: BaseException) -> str:
  """An error's message on one line: its first line and, where there are more, its last
  (pip's or XLA's verdict), or the error's type when it says nothing."""
  lines = [line.strip() for line in str(e).splitlines() if line.strip()]
  if not lines:
    return type(e).__name__
  return lines[0] if len(lines) == 1 else f"{lines[0]} ... {lines[-1]}"


class IdsTokenizer:
  """Text of space-separated token ids <-> the ids: Tunix's sampler takes strings and we
  want it to see our exact prompt ids.  No BOS; the EOS (one past the vocabulary) is never
  generated, so every row runs the full new tokens as ours do."""

  def __init__(self, vocab_size: int):
    self.vocab_size = vocab_size

  def encode(self, text, **_):
    return [int(t) for t in text.split()]

  def decode(self, ids, **_):
    return " ".join(str(int(i)) for i in ids)

  def bos_id(self):
    return None

  def eos_id(self):
    return self.vocab_size

  def pad_id(self):
    return 0


# ---------------------------------------------------------------- the parent's side

def tunix_python(skip: bool, venv: str) -> tuple[str | None, str]:
  """(The Tunix venv's python, ""), the venv made on first use; or (None, the one-line
  note why Tunix's sampler is skipped: ``skip`` is --no-tunix, or the venv cannot be had)."""
  if skip:
    return None, "Tunix's sampler skipped (--no-tunix)"
  try:
    return bc.ensure_tunix(venv), ""
  except (RuntimeError, subprocess.CalledProcessError, OSError) as e:
    return None, f"Tunix's sampler skipped: {one_line(e)}"


def model_dict(cfg) -> dict:
  """What the worker needs of a ModelConfig (``bc.tunix_model``'s keys), or raises
  ValueError when no Tunix model can take it: Tunix's qwen2 for qwen2, its llama3 for llama
  without Llama 3's RoPE scaling (Tunix 0.1.7's llama3 rotates with plain RoPE)."""
  if cfg.arch not in bc.TUNIX_MODELS:
    raise ValueError(f"no Tunix model takes arch {cfg.arch!r}; it has {sorted(bc.TUNIX_MODELS)}")
  if cfg.arch == "llama" and (cfg.rope_llama3 or cfg.qkv_bias):
    raise ValueError("Tunix's llama3 model takes no Llama 3 RoPE scaling and no q/k/v bias")
  keys = ("arch", "vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
          "num_kv_heads", "head_dim", "tie_embeddings", "rope_theta", "rms_norm_eps", "dtype")
  return {k: getattr(cfg, k) for k in keys}


class SamplerError(RuntimeError):
  """One sampler call failed in the worker (which goes on); the message is Tunix's."""


class Sampler:
  """Tunix's sampler in a worker process over ``prompt_sets`` (key -> [rows, prompt] ids,
  every row of a set one length), ``new`` tokens a row, the exported model in
  ``model_dir`` (``model``: ``model_dict``'s keys).  ``ready()`` is its one-line about (or
  RuntimeError), ``run(key)`` a ``bc.Measured(tokens [rows, new], seconds of the sampler
  call)`` (or SamplerError), ``close()`` ends it; the worker's log is ``tmp``/tunix.log."""

  def __init__(self, python: str, model_dir: str, model: dict, prompt_sets: dict, new: int,
               tmp: str):
    self.keys = list(prompt_sets)
    path = os.path.join(tmp, "tunix_inputs.json")
    sets = {str(k): np.asarray(v).tolist() for k, v in prompt_sets.items()}
    with open(path, "w") as f:
      json.dump(dict(model_dir=model_dir, model=model, prompt_sets=sets, new=new), f)
    self.log = os.path.join(tmp, "tunix.log")
    self.worker = bc.Worker("tunix", [python, os.path.abspath(__file__), path], self.log,
                            bc.tunix_env())

  def ready(self) -> str:
    return self.worker.ready()["about"]

  def run(self, key) -> bc.Measured:
    rec = self.worker.step(str(key))
    if "error" in rec:
      raise SamplerError(rec["error"])
    return bc.Measured(np.asarray(rec["tokens"]), rec["gen_s"])

  def close(self) -> None:
    self.worker.close()


# ---------------------------------------------------------------- the worker (Tunix venv)

def worker(inputs_path: str) -> int:
  with open(inputs_path) as f:
    inp = json.load(f)
  import jax
  from tunix.generate import sampler as sampler_lib

  m, tn = inp["model"], inp["new"]
  model, mesh = bc.tunix_model(inp["model_dir"], m)
  tok = IdsTokenizer(m["vocab_size"])
  sets = inp["prompt_sets"]
  cache = max(len(p[0]) for p in sets.values()) + tn
  sampler = sampler_lib.Sampler(
      model, tok, sampler_lib.CacheConfig(cache_size=cache, num_layers=m["num_layers"],
                                          num_kv_heads=m["num_kv_heads"],
                                          head_dim=m["head_dim"]))
  texts = {k: [tok.decode(p) for p in prompts] for k, prompts in sets.items()}
  bc.emit({"about": f"Tunix sampler (google-tunix {bc.TUNIX_SPEC.split('==')[1]}, greedy) on "
                    f"{jax.devices()[0]}"})
  for key in bc.commands():
    if key not in texts:
      bc.emit({"error": f"no prompt set {key!r}; valid: {sorted(texts)}"})
      continue
    tp = len(sets[key][0])
    try:
      t0 = time.perf_counter()
      with mesh:
        out = sampler(texts[key], max_generation_steps=tn, max_prompt_length=tp,
                      eos_tokens=[tok.eos_id()], temperature=0.0)
      dt = time.perf_counter() - t0
    except Exception as e:  # pylint: disable=broad-except  (reported, the worker goes on)
      bc.emit({"error": f"{type(e).__name__}: {one_line(e)}"})
      continue
    bc.emit({"tokens": [[int(t) for t in row] for row in out.tokens], "gen_s": dt})
  return 0


if __name__ == "__main__":
  sys.exit(worker(sys.argv[1]))
