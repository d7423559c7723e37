"""Bad ``model.lora`` settings through the real command line (``cli.main``): one line on
stderr naming the key, exit 2, no traceback (the corpus style of test_bad_inputs_corpus.py).

Value checks need no model (plain ``plan``); the fit to the model's layers is checked where
the model's config is built (``plan --memory`` here, as ``train`` does)."""

from __future__ import annotations

import pytest

from test_bad_inputs_corpus import assert_one_line, run

ON = "--config.model.lora.enabled=True"
SHAPE = ["--memory", "--memory_source=analytic", "--num_processes=1", "--devices_per_process=8"]

CASES = {
    "rank_zero": ([ON, "--config.model.lora.rank=0"], "model.lora.rank=0"),
    "rank_negative": ([ON, "--config.model.lora.rank=-4"], "model.lora.rank=-4"),
    "alpha_zero": ([ON, "--config.model.lora.alpha=0"], "model.lora.alpha=0"),
    "alpha_nan": ([ON, "--config.model.lora.alpha=nan"], "model.lora.alpha=nan"),
    "dropout_one": ([ON, "--config.model.lora.dropout=1.0"], "model.lora.dropout=1.0"),
    "dropout_negative": ([ON, "--config.model.lora.dropout=-0.1"], "model.lora.dropout=-0.1"),
    "init_unknown": ([ON, "--config.model.lora.init=xavier"], "model.lora.init='xavier'"),
    "targets_empty": ([ON, "--config.model.lora.targets=()"], "model.lora.targets"),
    "path_without_lora": (["--config.model.lora.path=/some/adapter"], "model.lora.enabled=False"),
    "reference_elsewhere": ([ON, "--config.placement.reference.devices=0:1"],
                            "placement.reference must equal placement.actor"),
    "target_matches_nothing": ([ON, "--config.model.lora.targets=('qproj',)", *SHAPE],
                               "pattern 'qproj' matches no module"),
    "rank_above_layer": ([ON, "--config.model.lora.rank=100", *SHAPE],
                         "model.lora.rank=100 is larger than k_proj's"),
    "some_layers_only": ([ON, "--config.model.lora.targets=('model.layers.0.*',)", *SHAPE],
                         "every layer must carry the same adapters"),
    "vision_language": (["--config=grpo_vl:tiny", ON], "LoRA on a vision-language model"),
    "critic_unknown": ([ON, "--config.model.lora.critic=half"], "model.lora.critic='half'"),
    "critic_undeclared": (["--config=ppo:tiny", ON], "model.lora.critic=full"),
    "base_check_not_bool": ([ON, "--config.model.lora.base_check=maybe"],
                            "model.lora.base_check"),
    "fused_adapters_sync": ([ON, "--config.rollout.lora_sync=adapters",
                             "--config.rollout.fuse_projections=gate_up"],
                            "rollout.fuse_projections='gate_up' cannot go with "
                            "rollout.lora_sync='adapters'"),
    "lora_sync_unknown": ([ON, "--config.rollout.lora_sync=both"],
                          "rollout.lora_sync='both' is not valid; choose one of ['merged', "
                          "'adapters']"),
}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_lora_settings_are_one_line(capsys, case):
  argv, needle = CASES[case]
  config = [] if any(a.startswith("--config=") for a in argv) else ["--config=grpo:tiny"]
  code, err = run(capsys, "plan", *config, *argv)
  assert code == 2, err
  assert_one_line(err, "distflow-jax plan: error:", needle)


# ---- model.lora.path: a PEFT adapter folder that does not fit the model (train, sft) ----------

# tiny_model_folder's llama: d 32, q 32, kv 16 (GQA 4:2), MLP 48, one layer.
TINY = {"self_attn.q_proj": (32, 32), "self_attn.k_proj": (32, 16),
        "self_attn.v_proj": (32, 16), "self_attn.o_proj": (32, 32), "mlp.gate_proj": (32, 48),
        "mlp.up_proj": (32, 48), "mlp.down_proj": (48, 32)}


def adapter(folder, rank=8, alpha=16.0, shapes=None, layers=(0,), base="/models/model"):
  """A PEFT folder for the tiny model (every projection unless ``shapes`` says otherwise),
  trained on ``base`` (by default a model of tiny_model_folder's name, "model")."""
  import numpy as np
  from distflow_jax.models.peft_files import write_adapter
  shapes = TINY if shapes is None else shapes
  arrays = {f"model.layers.{i}.{m}": (np.full((d_in, rank), 0.01, np.float32),
                                      np.full((rank, d_out), 0.01, np.float32))
            for i in layers for m, (d_in, d_out) in shapes.items()}
  write_adapter(folder, arrays, rank=rank, alpha=alpha, dropout=0.0,
                target_modules=sorted({m.rsplit(".", 1)[-1] for m in shapes}),
                base_model_name_or_path=base)
  return folder


def _train_from(capsys, tmp_path, path, command="train", *extra):
  from workflow_util import tiny_model_folder
  args = [command, f"--config.run_dir={tmp_path}/run", f"--config.model.path="
          f"{tiny_model_folder(tmp_path)}", ON, f"--config.model.lora.path={path}", *extra]
  if command == "sft":
    data = tmp_path / "sft.jsonl"
    data.write_text("".join('{"prompt": "%d+1=", "answer": "%d"}\n' % (i, i + 1)
                            for i in range(24)))
    args += [f"--config.data.train={data}", "--config.sft.eval_size=4",
             "--config.sft.batch_size=8"]
  else:
    args += ["--config.trainer.total_steps=1", "--config.data.eval="]
  return run(capsys, *args)


ADAPTER_CASES = {
    # A model of another width: q_proj is 64 -> 64 there.
    "other_shapes": (lambda f: adapter(f, shapes={m: (2 * a, 2 * b) for m, (a, b) in
                                                  TINY.items()}),
                     ["adapter_model.safetensors", "has shape (8, 96), expected (8, 48)"]),
    "other_depth": (lambda f: adapter(f, layers=(0, 1)),
                    ["adapter_model.safetensors", "model.layers.1.mlp.down_proj",
                     "which the model does not have"]),
    "other_rank": (lambda f: adapter(f, rank=4, alpha=8.0),
                   ["adapter_config.json has r=4, lora_alpha=8", "model.lora.rank=8",
                    "model.lora.alpha=16"]),
    "other_alpha": (lambda f: adapter(f, alpha=32.0),
                    ["lora_alpha=32", "model.lora.alpha=16", "--config.model.lora.alpha=32"]),
    "fewer_targets": (lambda f: adapter(f, shapes={"self_attn.q_proj": (32, 32)}),
                      ["adapter_model.safetensors has no adapter for 6 module(s)",
                       "model.lora.targets", "target_modules ('q_proj',)"]),
    "missing_folder": (lambda f: f, ["adapter folder", "does not exist"]),
    # The right shapes, another base (an instruct model's adapter on its base model, say).
    "other_base": (lambda f: adapter(f, base="Qwen/Other-Instruct"),
                   ["adapter_config.json was trained on base_model_name_or_path="
                    "'Qwen/Other-Instruct'", "'other-instruct' vs 'model'",
                    "--config.model.lora.base_check=False"]),
}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", sorted(ADAPTER_CASES))
def test_an_adapter_folder_that_does_not_fit_the_model_is_one_line(tmp_path, capsys, case):
  make, needles = ADAPTER_CASES[case]
  path = make(tmp_path / "adapter")
  code, err = _train_from(capsys, tmp_path, path)
  assert code == 2, err
  assert_one_line(err, "distflow-jax train: error:", str(path), *needles)


@pytest.mark.timeout(300)
def test_sft_checks_model_lora_path_too(tmp_path, capsys):
  path = adapter(tmp_path / "adapter", rank=4, alpha=8.0)
  code, err = _train_from(capsys, tmp_path, path, "sft")
  assert code == 2, err
  assert_one_line(err, "distflow-jax sft: error:", "r=4", "model.lora.rank=8")


# ---- export / generate of a LoRA run whose base model changed or is gone -------------------------

@pytest.mark.timeout(600)
def test_a_lora_run_whose_base_changed_or_went_is_one_line(tmp_path, capsys):
  import shutil

  from flax import nnx
  from workflow_util import tiny_model_folder
  from distflow_jax.models.hf_io import read_config, save_pretrained
  from distflow_jax.models.transformer import Transformer
  data = tmp_path / "sft.jsonl"
  data.write_text("".join('{"prompt": "%d+1=", "answer": "%d"}\n' % (i, i + 1)
                          for i in range(24)))
  base = tiny_model_folder(tmp_path)
  code, err = run(capsys, "sft", f"--config.run_dir={tmp_path}/run", f"--config.model.path={base}",
                  ON, f"--config.data.train={data}", "--config.sft.eval_size=4",
                  "--config.sft.batch_size=8", "--config.sft.steps=2", "--config.sft.eval_every=0",
                  "--config.sft.warmup_steps=1")
  assert code == 0, err
  run_ck = f"{tmp_path}/run/sft"
  # sft's output is a plain model (the adapters merged in), which the loader accepts whole.
  from safetensors.numpy import load_file
  from distflow_jax.models.hf_io import load_pretrained
  assert not [k for k in load_file(f"{run_ck}/model/model.safetensors") if "lora" in k]
  assert load_pretrained(f"{run_ck}/model").cfg.lora is None
  # Another model of the same shape at the same path: the fingerprint tells them apart.
  save_pretrained(base, Transformer(read_config(base), rngs=nnx.Rngs(7)))
  for argv in (["export", f"--checkpoint={run_ck}", f"--out={tmp_path}/out", "--lora=adapter"],
               ["export", f"--checkpoint={run_ck}", f"--out={tmp_path}/out"]):
    code, err = run(capsys, *argv)
    assert code == 2, err
    assert_one_line(err, "distflow-jax export: error:", f"{run_ck}/checkpoints/2",
                    "trained on a base with fingerprint", base, "put the run's starting model")
  assert not (tmp_path / "out").exists() or not list((tmp_path / "out").iterdir())
  prompts = tmp_path / "p.jsonl"
  prompts.write_text('{"prompt": "What is 2+3?"}\n')
  code, err = run(capsys, "generate", f"--model={run_ck}", f"--prompts={prompts}",
                  f"--out={tmp_path}/gen.jsonl", "--n=1", "--max_new_tokens=4")
  assert code == 2, err
  assert_one_line(err, "distflow-jax generate: error:", "trained on a base with fingerprint")
  shutil.rmtree(base)
  code, err = run(capsys, "export", f"--checkpoint={run_ck}", f"--out={tmp_path}/out")
  assert code == 2, err
  assert_one_line(err, f"model.path={base!r}, which holds no config.json now", "put that folder")


@pytest.mark.timeout(60)
def test_base_check_false_accepts_an_adapter_of_another_name():
  from distflow_jax.config import loading
  from distflow_jax.config.loading import ConfigError
  from distflow_jax.state import roles
  cfg = loading.load("grpo:tiny", ["model.path=/data/my-copy", "model.lora.enabled=True"])
  with pytest.raises(ConfigError, match="'qwen2.5-0.5b' vs 'my-copy'"):
    roles._check_base(cfg, "/a", "Qwen/Qwen2.5-0.5B")
  roles._check_base(cfg, "/a", "/elsewhere/My-Copy/")  # the same name: accepted
  cfg.model.lora.base_check = False
  roles._check_base(cfg, "/a", "Qwen/Qwen2.5-0.5B")
