"""Warm-start demonstrations are never cut (issue 36): every shipped preset that warm-starts
on a built-in task fits its demonstrations in its own ``rollout.max_new_tokens``, and the
warm-start data builder leaves a longer demonstration out (said once) instead of cutting it
and giving it an EOS, which taught the default run's model to stop at "...The answe"."""

from __future__ import annotations

import importlib.util
import os

import numpy as np
import pytest

from distflow_jax import cli
from distflow_jax.config import loading
from distflow_jax.models.tokenizer import Tokenizer
from distflow_jax.tasks import registry as tasks
from distflow_jax.warmstart import text as warmstart
from distflow_jax.warmstart import vl as vl_warmstart
from test_bad_inputs_corpus import assert_one_line


def _algorithm_variants() -> tuple[str, ...]:
  path = os.path.join(loading.configs_dir(), "algorithms.py")
  spec = importlib.util.spec_from_file_location("_shipped_algorithms", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.VARIANTS


# Every shipped preset: (config file, variant).
PRESETS = ([("grpo", v) for v in ("tiny", "qwen0.5b", "llama1b", "calc", "calc_notool")]
           + [("ppo", v) for v in ("tiny", "qwen0.5b")]
           + [("algorithms", v) for v in _algorithm_variants()]
           + [("reinforce_pp_two_rewards", "tiny")]
           + [("grpo_vl", v) for v in ("tiny", "qwen2.5-vl-3b")])
# The presets on a built-in task (qwen2.5-vl-3b's model.path is the user's, empty as shipped).
WARM_STARTED = {"grpo:tiny", "grpo:calc", "grpo:calc_notool", "ppo:tiny", "reinforce_pp_two_rewards:tiny", "grpo_vl:tiny",
                "grpo_vl:qwen2.5-vl-3b"} | {
    f"algorithms:{v}" for v in _algorithm_variants()}


def test_the_preset_list_covers_every_shipped_config_file():
  shipped = {f[:-3] for f in os.listdir(loading.configs_dir())
             if f.endswith(".py") and not f.startswith("_")}
  assert {f for f, _ in PRESETS} == shipped


@pytest.mark.timeout(300)
def test_every_shipped_preset_fits_its_demonstrations():
  checked = set()
  for file, variant in PRESETS:
    cfg = loading.load(f"{file}:{variant}")
    ws = cfg.model.warmstart
    if (cfg.model.path not in ("", vl_warmstart.BUILTIN) or ws.steps == 0
        or not tasks.is_builtin(cfg.data.train)):
      continue  # no built-in warm start: the user's model
    task, level = tasks.parse(cfg.data.train)
    tok = vl_warmstart.tokenizer() if cfg.model.path else Tokenizer.builtin()
    records = task.demonstrations(level, ws.examples, seed=cfg.seed,
                                  plain_answer_prob=ws.plain_answer_prob)
    logs = []
    kept, ids = warmstart.fitting_demonstrations(records, tok, cfg.rollout.max_new_tokens,
                                                 logs.append)
    longest = max(len(i) for i in ids)
    assert len(kept) == len(records) and not logs, (
        f"{file}:{variant}: rollout.max_new_tokens={cfg.rollout.max_new_tokens} leaves out "
        f"{len(records) - len(kept)} of {len(records)} demonstrations: {logs}")
    assert longest <= cfg.rollout.max_new_tokens
    checked.add(f"{file}:{variant}")
  assert checked == WARM_STARTED


@pytest.mark.timeout(120)
def test_the_builder_leaves_long_demonstrations_out_and_never_cuts_one():
  tok = Tokenizer.builtin()
  task, level = tasks.parse("builtin:arithmetic:basic")
  records = task.demonstrations(level, 300, seed=0, plain_answer_prob=0.7)
  full = [tok.encode(r["completion"]) + [tok.eos_id] for r in records]
  budget = 32  # the default run's old budget: 3-operand "The answer is N." answers are longer
  fits = [f for f in full if len(f) <= budget]
  assert 0 < len(fits) < len(records)
  logs = []
  data = warmstart.encode_examples(records, tok, max_prompt_len=32, max_new_tokens=budget,
                                   use_chat_template=False, log=logs.append)
  rows = [list(t[m]) for t, m in zip(data["response_tokens"], data["response_mask"])]
  assert rows == fits  # whole demonstrations, in order; none cut short
  assert all(r.count(tok.eos_id) == 1 and r[-1] == tok.eos_id for r in rows)
  assert len(logs) == 1 and "\n" not in logs[0], logs
  assert f"{len(records) - len(fits)} of {len(records)}" in logs[0] and "left out" in logs[0]
  assert f"raise rollout.max_new_tokens to {max(len(f) for f in full)}" in logs[0]
  assert data["prompt_tokens"].shape == (len(fits), 32)
  assert np.all(data["prompt_mask"].any(axis=1))


SMALL = ["--config.model.preset=micro", "--config.model.warmstart.steps=2",
         "--config.model.warmstart.examples=64", "--config.data.eval_size=8",
         "--config.data.prompts_per_step=8", "--config.actor.micro_batch_size=8",
         "--config.trainer.total_steps=1"]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("extra, needles", [
    # No demonstration fits: nothing to warm-start on.
    (["--config.rollout.max_new_tokens=8"], ["rollout.max_new_tokens=8", "none of the 64"]),
    # Fewer fit than a warm-start batch.
    (["--config.rollout.max_new_tokens=32", "--config.model.warmstart.batch_size=64",
      "--config.model.warmstart.plain_answer_prob=1.0"],
     ["model.warmstart.batch_size=64", "fit rollout.max_new_tokens"]),
])
def test_train_refuses_a_warm_start_the_budget_leaves_too_few_demonstrations(
    tmp_path, capsys, extra, needles):
  code = cli.main(["train", "--config=grpo:tiny", f"--config.run_dir={tmp_path}", *SMALL,
                   *extra])
  err = capsys.readouterr().err
  assert code == 2, err[-2000:]
  assert_one_line(err, *needles)
