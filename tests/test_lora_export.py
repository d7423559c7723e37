"""`export --lora` (persist/lora_export.py): what a run exports (merged by default for a LoRA
run, the PEFT adapter folder on request, refused for a run without LoRA) and the adapter
folder's settings; the folder format itself is test_peft_files.py's."""

import json

import pytest

from distflow_jax.models.peft_files import CONFIG, read_adapter
from distflow_jax.persist import lora_export
from distflow_jax.persist.checkpoint_contents import CheckpointError
from distflow_jax.persist.lora_export import LoraExport
from test_peft_files import RANK, SHAPES, random_arrays

pytestmark = pytest.mark.timeout(120)

LORA_RUN = {"model": {"path": "/models/base", "lora": {"enabled": True, "rank": RANK,
                                                       "alpha": 8.0, "dropout": 0.0}}}
FULL_RUN = {"model": {"path": "/models/base"}}
# The default config's section: a rank is set whether LoRA is on or not.
OFF_RUN = {"model": {"path": "/models/base", "lora": {"enabled": False, "rank": 8,
                                                      "alpha": 16.0, "dropout": 0.0}}}


def test_export_mode_follows_the_run():
  assert lora_export.export_mode(None, LORA_RUN, "ck") is LoraExport.MERGED
  assert lora_export.export_mode(LoraExport.ADAPTER, LORA_RUN, "ck") is LoraExport.ADAPTER
  assert lora_export.export_mode(None, FULL_RUN, "ck") is None
  assert lora_export.export_mode(LoraExport.MERGED, FULL_RUN, "ck") is None
  assert lora_export.export_mode(None, OFF_RUN, "ck") is None  # model.lora.enabled decides
  assert lora_export.export_mode(LoraExport.MERGED, OFF_RUN, "ck") is None
  for off in (OFF_RUN, {"model": {"lora": {"rank": 0, "alpha": 8.0, "dropout": 0.0}}}):
    with pytest.raises(CheckpointError, match="checkpoint /r/3: --lora=adapter needs a run"):
      lora_export.export_mode(LoraExport.ADAPTER, off, "checkpoint /r/3")


def test_a_bad_lora_flag_is_one_line_before_anything_is_read(tmp_path, capsys):
  from test_bad_inputs_corpus import assert_one_line
  from distflow_jax import cli
  code = cli.main(["export", f"--checkpoint={tmp_path}/no_such", f"--out={tmp_path}/hf",
                   "--lora=both"])
  _, err = capsys.readouterr()
  assert code == 2, err
  assert_one_line(err, "--lora='both'", "adapter, merged")
  assert lora_export.parse_flag("adapter") is LoraExport.ADAPTER
  assert lora_export.parse_flag(None) is None


def test_save_adapter_writes_the_runs_settings(tmp_path):
  arrays = random_arrays({m: s for m, s in SHAPES.items() if "layers.0." in m or "q_proj" in m})
  lora_export.save_adapter(tmp_path, arrays, LORA_RUN, SHAPES)
  cfg = json.loads((tmp_path / CONFIG).read_text())
  assert cfg["target_modules"] == ["model.layers.0.mlp.down_proj",
                                   "model.layers.0.self_attn.v_proj", "q_proj"]
  assert cfg["base_model_name_or_path"] == "/models/base"
  assert read_adapter(tmp_path, SHAPES)[1].scale == 2.0


@pytest.mark.timeout(300)
def test_export_lora_adapter_on_a_run_without_lora_is_one_line(tmp_path, capsys):
  from test_checkpoint import one_saved_run
  from test_bad_inputs_corpus import assert_one_line
  from distflow_jax import cli
  one_saved_run(tmp_path)
  code = cli.main(["export", f"--checkpoint={tmp_path}/run", f"--out={tmp_path}/hf",
                   "--lora=adapter"])
  _, err = capsys.readouterr()
  assert code == 2, err
  assert_one_line(err, f"{tmp_path}/run/checkpoints/1", "--lora=adapter needs a run")
  assert not (tmp_path / "hf").exists() or not list((tmp_path / "hf").iterdir())
  code = cli.main(["export", f"--checkpoint={tmp_path}/run", f"--out={tmp_path}/hf",
                   "--lora=merged"])
  out, err = capsys.readouterr()
  assert code == 0 and "exported the actor of step 1" in out, err
