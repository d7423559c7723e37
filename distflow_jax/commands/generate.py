"""``distflow-jax generate``: completions for a JSONL file of prompts, written as JSONL.

  distflow-jax generate --model=runs/grpo_tiny --prompts=prompts.jsonl --out=completions.jsonl \\
      [--n=4] [--max_new_tokens=64] [--config.rollout.temperature=0]

Each input line is a JSON object whose ``data.prompt_key`` field (default
"prompt"; a dotted key reads nested objects) is the prompt: text, wrapped as a
user turn with ``data.chat_template``, or a list of ``{"role", "content"}``
messages, always rendered with the chat template.  Each output line is
``{"index", "sample", "prompt", "completion", "tokens", "logprobs",
"finish_reason"}`` ("stop" on an EOS token, else "length"; ``logprobs`` are each token's
under the softmax at the sampling temperature, untruncated), in input order, samples
together.

The model is ``--model``: a local Hugging Face dir (config.json, safetensors,
tokenizer.json; checked before any weight is read), a run directory (its
latest checkpoint's actor) or ``RUN_DIR/checkpoints/<step>``; else
``model.path``.  Without either it refuses, unless ``--random_init`` asks for
the built-in ``model.preset`` with random weights seeded by ``seed`` and the
built-in tokenizer.  The config defaults to ``grpo:tiny``, as for ``train``.
Sampling, slots and prefill buckets come from ``rollout.*``, and
``rollout.backend`` picks the generator; the devices are this machine's
unless ``--config.cluster.*`` says otherwise.  Under several
processes each host generates lines ``process_index::process_count`` on its
own replica (or on the one it shares where ``rollout.tensor_parallel`` makes
replicas span hosts) and writes ``<out>.<process_index>``.  Sample s of line i
draws with request id ``i * n + s`` and the seed's key on every process, so the
completions do not depend on how the lines are spread.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
from collections.abc import Sequence

from absl import flags

from distflow_jax import distributed
from distflow_jax.commands import use_local_devices, with_default_config
from distflow_jax.config import loading
from distflow_jax.dag.spec import Role
from distflow_jax.data.sources import BadRow, field_value, messages_of
from distflow_jax.observe import hints
from distflow_jax.observe.heartbeat import heartbeat, interval
from distflow_jax.persist import destination
from distflow_jax.run import model_source

DEFAULT_CONFIG = "grpo:tiny"
Prompt = str | list[dict[str, str]]


def _read_prompts(path: str, key: str) -> list[Prompt]:
  prompts = []
  try:
    with open(path) as f:
      for i, line in enumerate(f, 1):
        if not line.strip():
          continue
        try:
          row = json.loads(line)
        except json.JSONDecodeError as e:
          raise loading.ConfigError(f"--prompts {path}:{i}: not JSON ({e.msg})") from None
        value = field_value(row, key) if isinstance(row, dict) else None
        if value is None or isinstance(messages_of(value, key), BadRow):
          raise loading.ConfigError(f"--prompts {path}:{i}: needs a field {key!r} "
                                    f"(data.prompt_key) holding text or chat messages; got "
                                    f"{str(row)[:80]}")
        prompts.append(value)
  except OSError as e:
    raise loading.ConfigError(f"--prompts: {e}") from None
  if not prompts:
    raise loading.ConfigError(f"--prompts {path}: no prompts")
  return prompts


def _render(tok, prompt: Prompt, chat_template: bool) -> str:
  """Plain text as it is (a user turn with data.chat_template); messages with the template."""
  if isinstance(prompt, str) and not chat_template:
    return prompt
  messages = messages_of(prompt, "prompt")
  if tok.chat_template is None:  # a tokenizer without one: the contents, as the loader does
    return "\n".join(m["content"] for m in messages)
  return tok.apply_chat_template(messages)


def _out_path(out: str, index: int, count: int) -> str:
  """Where this process writes: ``out`` alone, ``<out>.<process_index>`` under several."""
  return out if count == 1 or out == "-" else f"{out}.{index}"


def _log(message: str) -> None:
  print(message, file=sys.stderr)  # stdout may be the output JSONL


def run(argv: Sequence[str]) -> int:
  """Entry point of ``distflow-jax generate``; returns the exit code."""
  fv = flags.FlagValues()
  flags.DEFINE_string("prompts", None, "JSONL file of prompts", flag_values=fv)
  flags.DEFINE_string("out", "-", "output JSONL file ('-' = stdout; checked first: an "
                      "existing file needs --overwrite; never a run's own files)",
                      flag_values=fv)
  flags.DEFINE_boolean("overwrite", False, "replace an existing --out file", flag_values=fv)
  flags.DEFINE_integer("n", None, "samples per prompt (default rollout.n)", flag_values=fv)
  flags.DEFINE_integer("max_new_tokens", None, "default rollout.max_new_tokens", flag_values=fv)
  flags.DEFINE_string("model", None, "Hugging Face folder, run directory or RUN_DIR/checkpoints/"
                      "<step> (default: model.path)", flag_values=fv)
  flags.DEFINE_boolean("random_init", False, "with no model: the built-in model.preset with "
                       "random weights (for trying the pipeline)", flag_values=fv)
  argv = with_default_config(argv, DEFAULT_CONFIG)
  rest = loading.parse(fv, argv)
  if rest:
    raise loading.ConfigError(f"generate takes no positional arguments, got {rest}")
  if not fv.prompts:
    raise loading.ConfigError("generate needs --prompts=file.jsonl")
  if fv.out != "-":  # before any model is read or any token generated (launcher's env: its file)
    env = os.environ
    count = int(env.get(distributed.ENV_NUM_PROCESSES, "1") or 1)
    destination.check_file(_out_path(fv.out, int(env.get(distributed.ENV_PROCESS_ID, "0") or 0),
                                     count), overwrite=fv.overwrite)
  cfg = fv.config
  n = cfg.rollout.n if fv.n is None else fv.n
  new = cfg.rollout.max_new_tokens if fv.max_new_tokens is None else fv.max_new_tokens
  if n <= 0 or new <= 0:
    raise loading.ConfigError(f"--n={n} and --max_new_tokens={new} must be positive")
  texts = _read_prompts(fv.prompts, cfg.data.prompt_key)
  source = model_source.kind(fv.model) if fv.model else None
  if source == "hf":
    cfg = loading.with_values(cfg, {"model.path": fv.model})
  if not fv.model and not cfg.model.path and not fv.random_init:
    raise loading.ConfigError(
        "generate has no model: give --model=HF_DIR (or a run directory, or RUN_DIR/checkpoints/"
        "<step>) or --config.model.path=HF_DIR; --random_init generates from the built-in "
        "model.preset with random weights")
  cfg = use_local_devices(cfg, list(argv))
  if cfg.model.path:
    # A folder without tokenizer files (or config, or weights) fails here in one line,
    # before jax starts and any weight is read.
    hints.check_model_dir(cfg.model.path)

  import jax

  from distflow_jax.run.setup import prepare_run

  info = distributed.initialize()
  path = _out_path(fv.out, info.process_index, info.process_count)
  if path != fv.out:  # a group found without the launcher's env (--distributed=auto)
    destination.check_file(path, overwrite=fv.overwrite)
  if source == "checkpoint":
    folder, step = model_source.checkpoint_as_hf(fv.model)
    _log(f"--model={fv.model}: the actor of step {step}")
    cfg = loading.with_values(cfg, {"model.path": folder})
  ctx = prepare_run(cfg, roles="actor", log=_log).ctx
  cfg = ctx.cfg
  tok = ctx.tokenizer
  texts_in = [_render(tok, t, cfg.data.chat_template) for t in texts]
  mine = list(range(info.process_index, len(texts), info.process_count))
  ids = [tok.encode(texts_in[i]) for i in mine]
  buckets = tuple(cfg.rollout.prefill_buckets)
  for i, p in zip(mine, ids):
    if not p or len(p) > max(buckets):
      raise loading.ConfigError(
          f"prompt {i} has {len(p)} tokens; it must be 1..{max(buckets)} (the largest of "
          f"rollout.prefill_buckets={buckets})")
  rollout = dataclasses.replace(cfg.rollout, max_new_tokens=new)
  try:
    backend = ctx.replicas.backend(rollout)  # rollout.backend's kind, as the trainer's generate node
  except loading.ConfigError:
    raise
  except ValueError as e:
    raise loading.ConfigError(f"rollout config: {e}") from None
  params = backend.update_weights(ctx.roles[Role.ACTOR].params)
  # One key for every process and global request ids (prompt i's sample s is request
  # i * n + s): the completions do not depend on how the prompts are spread over
  # processes, and the processes of a replica spanning hosts draw alike.
  rng = jax.random.key(cfg.seed)
  request_ids = [i * n + s for i in mine for s in range(n)]
  start = time.perf_counter()
  # One call compiles the rollout and decodes every prompt: say it is alive meanwhile.
  with heartbeat(_log, f"generate: compiling the rollout and decoding {len(ids)} prompt(s)",
                 interval(cfg), compiles=True):
    # A process with no prompt still calls: a replica spanning hosts pools every process's.
    out = backend.generate(params, ids, n=n, rng=rng, pad_id=tok.pad_id,
                           request_ids=request_ids)
  elapsed = time.perf_counter() - start

  f = sys.stdout if path == "-" else open(path, "w")
  try:
    for r in range(len(out.lengths_R)):
      k = int(out.lengths_R[r])
      toks = out.tokens_RxN[r, :k].tolist()
      i = mine[r // n]
      f.write(json.dumps({
          "index": i, "sample": r % n, "prompt": texts[i], "completion": tok.decode(toks),
          "tokens": toks, "logprobs": [round(float(x), 6) for x in out.logprobs_RxN[r, :k]],
          "finish_reason": "stop" if out.stopped_R[r] else "length"}) + "\n")
  finally:
    if f is not sys.stdout:
      f.close()
  total = out.num_tokens
  print(f"generate: {len(ids) * n} completions, {total} tokens in {elapsed:.2f}s "
        f"({total / max(elapsed, 1e-9):.0f} tok/s, compiles included) -> {path}", file=sys.stderr)
  return 0
