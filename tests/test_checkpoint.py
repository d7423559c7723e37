"""Run checkpoints in one process: round trip, resharding, keep-N, clear errors, export."""

import json
import os
import shutil

import jax
import numpy as np
import optax
import pytest
from flax import nnx

from distflow_jax.config import defaults
from distflow_jax.dag.spec import Role
from distflow_jax.data.loader import PromptLoader
from distflow_jax.models import hf_io, sharding
from distflow_jax.models.config import ModelConfig
from distflow_jax.models.tokenizer import Tokenizer
from distflow_jax.models.transformer import Transformer
from distflow_jax.train import placement
from distflow_jax.persist import checkpoint as ck
from distflow_jax.commands import export as export_cmd
from distflow_jax.state.roles import ModelState

TOK = Tokenizer.builtin()


def model_cfg(hidden=32):
  return ModelConfig(arch="qwen2", vocab_size=TOK.vocab_size, hidden_size=hidden,
                     intermediate_size=64, num_layers=1, num_heads=2, num_kv_heads=1,
                     head_dim=16, qkv_bias=True)


def roles_on(mesh, mcfg, seed=0):
  rules = sharding.fsdp_tp_rules()
  g, p = nnx.split(sharding.create_sharded(lambda: Transformer(mcfg, rngs=nnx.Rngs(seed)),
                                           mesh, rules))
  tx = optax.adam(1e-3)
  opt = placement.init_opt_state(tx, p)
  ref = jax.tree.map(lambda x: x.copy(), p)
  return {Role.ACTOR: ModelState(Role.ACTOR, mesh, g, p, tx, opt),
          Role.REFERENCE: ModelState(Role.REFERENCE, mesh, g, ref)}


def perturb(roles, k):
  """Distinct, known values in params and optimizer moments (shardings kept)."""
  a = roles[Role.ACTOR]
  a.params = jax.tree.map(lambda x: x + k, a.params)
  a.opt_state = jax.tree.map(lambda x: x + k if x.dtype == np.float32 else x + int(k),
                             a.opt_state)


def host(tree):
  return [np.asarray(x) for x in jax.tree.leaves(tree)]


@pytest.fixture
def data(tmp_path):
  path = tmp_path / "train.jsonl"
  with open(path, "w") as f:
    for i in range(40):
      f.write(json.dumps({"prompt": f"{i}+1=", "answer": str(i + 1)}) + "\n")
  return str(path)


def loader(path):
  return PromptLoader(path, TOK, batch_size=3, max_prompt_len=16, seed=0, process_index=0,
                      process_count=1)


def cfg(seed=0):
  c = defaults.base()
  c.seed = seed
  return c


def mesh(n, **axes):
  return sharding.make_mesh(axes, jax.devices()[:n])


def one_saved_run(tmp_path) -> str:
  """A run folder ``tmp_path/run`` with one checkpoint (step 1) of a plain (no LoRA) tiny
  actor, for the commands that read runs (export, eval); returns the folder."""
  data = tmp_path / "train.jsonl"
  data.write_text("".join(json.dumps({"prompt": f"{i}+1=", "answer": str(i + 1)}) + "\n"
                          for i in range(12)))
  c = ck.Checkpointer(str(tmp_path / "run" / "checkpoints"), save_every=1, keep=1,
                      log=lambda m: None)
  mcfg = model_cfg()
  c.save(1, roles_on(mesh(1), mcfg), loader(str(data)), cfg(), mcfg, TOK)
  c.close()
  return str(tmp_path / "run")


def test_round_trip_reshards_and_restores_loader(tmp_path, data):
  mcfg = model_cfg()
  roles = roles_on(mesh(8, fsdp=8), mcfg)
  perturb(roles, 0.5)
  ld = loader(data)
  for _ in range(5):
    next(ld)
  expected_batch = next(loader_at(data, ld.get_state()))
  saved = host(roles[Role.ACTOR].params), host(roles[Role.ACTOR].opt_state)
  ref_saved = host(roles[Role.REFERENCE].params)
  c = ck.Checkpointer(str(tmp_path / "ck"), save_every=1, keep=3, log=lambda m: None)
  c.save(7, roles, ld, cfg(), mcfg, TOK)
  c.close()

  # A different mesh (4 devices, fsdp x tensor) and fresh values: restore must reshard.
  other = roles_on(mesh(4, fsdp=2, tensor=2), mcfg, seed=1)
  live_shardings = jax.tree.map(lambda x: x.sharding, other[Role.ACTOR].params)
  ld2 = loader(data)
  c2 = ck.Checkpointer(str(tmp_path / "ck"), save_every=1, keep=3, log=lambda m: None)
  assert c2.latest_step() == 7
  meta = c2.restore(7, other, ld2, cfg())
  assert meta["step"] == 7 and meta["process_count"] == 1
  a = other[Role.ACTOR]
  for got, want in zip(host(a.params) + host(a.opt_state), saved[0] + saved[1]):
    np.testing.assert_array_equal(got, want)
  for got, want in zip(host(other[Role.REFERENCE].params), ref_saved):
    np.testing.assert_array_equal(got, want)
  assert jax.tree.map(lambda x: x.sharding, a.params) == live_shardings
  np.testing.assert_array_equal(next(ld2).data["prompt_ids"], expected_batch.data["prompt_ids"])


def loader_at(path, state):
  ld = loader(path)
  ld.set_state(state)
  return ld


def test_keeps_last_n_and_due(tmp_path, data):
  mcfg = model_cfg()
  roles = roles_on(mesh(2, fsdp=2), mcfg)
  c = ck.Checkpointer(str(tmp_path / "ck"), save_every=2, keep=2, log=lambda m: None)
  assert [s for s in range(1, 8) if c.due(s, 7)] == [2, 4, 6, 7]
  ld = loader(data)
  for step in (2, 4, 6, 7):
    c.save(step, roles, ld, cfg(), mcfg)
  c.close()
  assert c.steps() == [6, 7]
  assert ck.Checkpointer(str(tmp_path / "ck"), save_every=0, keep=0).due(3, 7) is False


def save_step_1(tmp_path, data, hidden=32):
  """Roles of a `model_cfg(hidden)` model on 2 devices, saved as step 1 under tmp_path/ck."""
  mcfg = model_cfg(hidden)
  roles = roles_on(mesh(2, fsdp=2), mcfg)
  c = ck.Checkpointer(str(tmp_path / "ck"), save_every=1, keep=3, log=lambda m: None)
  c.save(1, roles, loader(data), cfg(), mcfg)
  c.close()
  return roles


def test_incomplete_save_is_ignored_with_a_message(tmp_path, data):
  save_step_1(tmp_path, data)
  # What a save killed before its commit leaves behind (the real kill: test_checkpoint_mp).
  shutil.copytree(tmp_path / "ck" / "1", tmp_path / "ck" / "2.orbax-checkpoint-tmp")
  msgs = []
  c2 = ck.Checkpointer(str(tmp_path / "ck"), save_every=1, keep=3, log=msgs.append)
  assert c2.latest_step() == 1
  assert any("incomplete save" in m and "2.orbax-checkpoint-tmp" in m for m in msgs), msgs


def test_wrong_model_shape_names_the_arrays(tmp_path, data):
  roles = save_step_1(tmp_path, data, hidden=32)
  other = roles_on(mesh(2, fsdp=2), model_cfg(48))
  c2 = ck.Checkpointer(str(tmp_path / "ck"), save_every=1, keep=3, log=lambda m: None)
  with pytest.raises(ck.CheckpointError,
                     match=r"actor\.params\.embed\.embedding\.value: checkpoint has shape "
                           r"\(\d+, 32\) float32, this run has \(\d+, 48\)"):
    c2.restore(1, other, loader(data), cfg())
  with pytest.raises(ck.CheckpointError, match="seed=0 but this run has seed=3"):
    c2.restore(1, roles, loader(data), cfg(seed=3))
  no_opt = {Role.ACTOR: ModelState(Role.ACTOR, roles[Role.ACTOR].mesh, roles[Role.ACTOR].graphdef,
                                   roles[Role.ACTOR].params, optax.sgd(0.1), ())}
  with pytest.raises(ck.CheckpointError, match=r"actor\.opt_state\.0\.mu.*in the checkpoint "
                                               r"but not in this run"):
    c2.restore(1, no_opt, loader(data), cfg())


def test_missing_item_is_named(tmp_path, data):
  roles = save_step_1(tmp_path, data)
  shutil.rmtree(tmp_path / "ck" / "1" / "loader")
  c2 = ck.Checkpointer(str(tmp_path / "ck"), save_every=1, keep=3, log=lambda m: None)
  with pytest.raises(ck.CheckpointError, match=r"missing item\(s\) \['loader'\]"):
    c2.restore(1, roles, loader(data), cfg())


def test_loader_on_a_different_process_count_starts_the_next_epoch(data):
  ld = loader(data)
  saved = [dict(ld.get_state(), epoch=e, process_index=i, process_count=2)
           for i, e in enumerate((3, 4))]
  msgs = []
  ck.restore_loader(ld, saved, msgs.append)
  assert ld.get_state()["epoch"] == 5 and ld.get_state()["position"] == 0
  assert "2 process(es)" in msgs[0]
  assert ck.gather_json({"a": 1}) == [{"a": 1}]


def test_trim_metrics_drops_steps_after_the_checkpoint(tmp_path):
  path = tmp_path / "metrics.jsonl"
  path.write_text("".join(json.dumps({"step": s}) + "\n" for s in range(5)) + '{"step": 5, "x')
  ck.trim_metrics(str(path), 2)
  assert [json.loads(l)["step"] for l in path.read_text().splitlines()] == [0, 1, 2]


def test_export_writes_a_loadable_hf_dir(tmp_path, data):
  mcfg = model_cfg()
  roles = roles_on(mesh(4, fsdp=4), mcfg)
  perturb(roles, 0.25)
  c = ck.Checkpointer(str(tmp_path / "run" / "checkpoints"), save_every=1, keep=3,
                      log=lambda m: None)
  c.save(3, roles, loader(data), cfg(), mcfg, TOK)
  c.close()
  out = tmp_path / "hf"
  assert export_cmd.export(str(tmp_path / "run"), str(out)) == 3
  assert {"config.json", "model.safetensors", "tokenizer.json"} <= set(os.listdir(out))
  back = nnx.state(hf_io.load_pretrained(str(out)), nnx.Param)
  want = nnx.state(nnx.merge(roles[Role.ACTOR].graphdef, roles[Role.ACTOR].params), nnx.Param)
  for got, exp in zip(host(back), host(want)):
    np.testing.assert_array_equal(got, exp)
  assert Tokenizer.from_dir(str(out)).encode("12+3=") == TOK.encode("12+3=")
  with pytest.raises(ck.CheckpointError, match="no checkpoint of step 9; it has \\[3\\]"):
    export_cmd.export(str(tmp_path / "run" / "checkpoints"), str(out), step=9, overwrite=True)



def test_export_prints_no_orbax_warning_about_the_loader_item(tmp_path, data, caplog):
  """`distflow-jax export` of a train checkpoint printed orbax's 'Item "loader" was found in
  the checkpoint, but could not be restored' twice (eval and generate already hid it)."""
  mcfg = model_cfg()
  roles = roles_on(mesh(1), mcfg)
  c = ck.Checkpointer(str(tmp_path / "run" / "checkpoints"), save_every=1, keep=3,
                      log=lambda m: None)
  c.save(1, roles, loader(data), cfg(), mcfg, TOK)
  c.close()
  caplog.clear()
  with caplog.at_level("WARNING"):
    assert export_cmd.export(str(tmp_path / "run"), str(tmp_path / "hf")) == 1
  assert not [r.getMessage() for r in caplog.records if "could not be restored" in r.getMessage()]

def test_open_run_resume_modes(tmp_path, data):
  c = cfg()
  c.run_dir = str(tmp_path / "run")
  c.trainer.save_every, c.trainer.keep = 1, 2
  mcfg = model_cfg()
  roles = roles_on(mesh(2, fsdp=2), mcfg)
  with pytest.raises(ck.CheckpointError, match="--resume: there is no complete checkpoint"):
    ck.open_run(c, roles, loader(data), resume=True, log=lambda m: None)
  checkpointer, start = ck.open_run(c, roles, loader(data), log=lambda m: None)
  assert start == 0
  perturb(roles, 1.0)
  want = host(roles[Role.ACTOR].params)
  checkpointer.save(2, roles, loader(data), c, mcfg)
  checkpointer.close()
  with pytest.raises(ck.CheckpointError, match=r"holds checkpoints of steps \[2\]; continue"):
    ck.open_run(c, roles, loader(data), resume=False, log=lambda m: None)
  fresh = roles_on(mesh(2, fsdp=2), mcfg)
  msgs = []
  _, start = ck.open_run(c, fresh, loader(data), log=msgs.append)
  assert start == 2 and "resumed from" in msgs[-1]
  for got, exp in zip(host(fresh[Role.ACTOR].params), want):
    np.testing.assert_array_equal(got, exp)
