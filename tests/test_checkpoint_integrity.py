"""Damaged checkpoints (issue 16): named in one line, set aside, the previous one restored.

A real two-step checkpoint is damaged on disk the way a bad disk or a cut
copy would: bytes flipped inside an OCDBT data file (same size, still
decodable), a data file cut short, an orbax metadata file cut short, the
OCDBT manifest gone.  An automatic resume names the step and the file or
array and falls back to the step before; ``--resume`` refuses.
"""

import glob
import json
import os

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from distflow_jax.dag.spec import Role
from distflow_jax.persist import checkpoint as ck
from distflow_jax.persist import checkpoint_files as files
from distflow_jax.persist import checksums
from test_checkpoint import data  # noqa: F401  (a fixture)
from test_checkpoint import cfg, host, loader, mesh, model_cfg, perturb, roles_on


@pytest.fixture
def run(tmp_path, data):
  """A run dir with checkpoints of steps 1 and 2 (different values); step 1's actor params."""
  c = cfg()
  c.run_dir = str(tmp_path / "run")
  c.trainer.save_every, c.trainer.keep = 1, 3
  mcfg = model_cfg()
  roles = roles_on(mesh(2, fsdp=2), mcfg)
  saver = ck.Checkpointer(ck.checkpoint_dir(c.run_dir), save_every=1, keep=3,
                          log=lambda m: None)
  perturb(roles, 0.5)
  saver.save(1, roles, loader(data), c, mcfg)
  want = host(roles[Role.ACTOR].params)
  perturb(roles, 1.0)
  saver.save(2, roles, loader(data), c, mcfg)
  saver.close()
  return c, mcfg, want


def step_dir(c, step):
  return os.path.join(ck.checkpoint_dir(c.run_dir), str(step))


def resume(c, mcfg, data, **kw):
  """``open_run`` into fresh roles: (start step, roles, log lines)."""
  fresh = roles_on(mesh(2, fsdp=2), mcfg, seed=1)
  msgs = []
  checkpointer, start = ck.open_run(c, fresh, loader(data), log=msgs.append, **kw)
  checkpointer.close()
  return start, fresh, msgs


def assert_fell_back(c, mcfg, data, want, *needles):
  start, fresh, msgs = resume(c, mcfg, data)
  assert start == 1
  line = next(m for m in msgs if "damaged" in m)
  assert "\n" not in line and "(step 2) is damaged" in line and "falling back to step 1" in line
  for needle in needles:
    assert needle in line, line
  for got, exp in zip(host(fresh[Role.ACTOR].params), want):
    np.testing.assert_array_equal(got, exp)
  # Set aside (kept for a look): the step is free for the resumed run's next save.
  assert os.path.isdir(step_dir(c, 2) + ".damaged") and not os.path.exists(step_dir(c, 2))
  roles = roles_on(mesh(2, fsdp=2), mcfg)
  again = ck.Checkpointer(ck.checkpoint_dir(c.run_dir), save_every=1, keep=3, log=lambda m: None)
  assert again.steps() == [1]
  again.save(2, roles, loader(data), c, mcfg)
  again.close()
  assert again.steps() == [1, 2]
  return line


def data_files(c, step):
  """The OCDBT data files of a step's arrays, largest first."""
  return sorted(glob.glob(os.path.join(step_dir(c, step), "state", "ocdbt.process_*", "d", "*")),
                key=os.path.getsize, reverse=True)


def raw_state(c, step):
  """The step's arrays as orbax decodes them, unverified."""
  mgr = ocp.CheckpointManager(ck.checkpoint_dir(c.run_dir),
                              item_handlers={"state": ocp.PyTreeCheckpointHandler()})
  try:
    md = mgr.item_metadata(step)["state"]
    args = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), md)
    out = mgr.restore(step, args=ocp.args.Composite(
        state=ocp.args.PyTreeRestore(restore_args=args)))
  finally:
    mgr.close()
  return {n: np.asarray(x) for n, x in checksums.flatten(out["state"]).items()}


def flip_silently(c, step):
  """Flips 16 bytes inside a data file where orbax still decodes them (into other numbers):
  the names of the arrays that changed, parameters first."""
  before = raw_state(c, step)
  for path in data_files(c, step)[:2]:
    with open(path, "rb") as f:
      original = f.read()
    for frac in (0.5, 0.3, 0.7, 0.2, 0.8, 0.4, 0.6, 0.1, 0.9):
      damaged = bytearray(original)
      at = int(len(damaged) * frac)
      damaged[at:at + 16] = bytes(b ^ 0xFF for b in damaged[at:at + 16])
      with open(path, "wb") as f:
        f.write(damaged)
      try:
        after = raw_state(c, step)
      except Exception:  # pylint: disable=broad-except
        continue  # the flip broke a compressed frame: orbax notices this one itself
      changed = [n for n in before if before[n].tobytes() != after[n].tobytes()]
      if changed:
        return sorted(changed, key=lambda n: (".opt_state." in n, n))
    with open(path, "wb") as f:
      f.write(original)
  pytest.fail("no flip of 16 bytes decoded silently")


def test_flipped_bytes_fall_back_naming_the_array(run, data):
  c, mcfg, want = run
  changed = flip_silently(c, 2)
  line = assert_fell_back(c, mcfg, data, want, f"array {changed[0]}",
                          "does not match the checksum")
  assert line.startswith(f"checkpoint: {step_dir(c, 2)} (step 2) is damaged")


def test_flipped_bytes_are_refused_under_resume(run, data):
  c, mcfg, _ = run
  changed = flip_silently(c, 2)
  with pytest.raises(ck.CheckpointError) as e:
    resume(c, mcfg, data, resume=True)
  msg = str(e.value)
  assert "\n" not in msg and msg.startswith(f"--resume: checkpoint {step_dir(c, 2)} (step 2)")
  assert f"array {changed[0]}" in msg and "without --resume the run falls back to step 1" in msg
  assert os.path.isdir(step_dir(c, 2))  # nothing was moved
  # Export verifies too.
  with pytest.raises(ck.CheckpointDamaged, match=r"\(step 2\) is damaged: array "):
    ck.read_arrays(ck.checkpoint_dir(c.run_dir))


def test_truncated_data_file_falls_back_naming_the_file(run, data):
  c, mcfg, want = run
  path = data_files(c, 2)[0]
  os.truncate(path, os.path.getsize(path) // 2)
  rel = os.path.relpath(path, step_dir(c, 2))
  assert_fell_back(c, mcfg, data, want, f"{rel} has {os.path.getsize(path)} bytes")


@pytest.mark.parametrize("record", [True, False], ids=["record", "no_record"])
@pytest.mark.parametrize("rel", ["state/_METADATA", "meta/metadata"])
def test_truncated_metadata_falls_back_naming_the_file(run, data, rel, record):
  c, mcfg, want = run
  if not record:  # as after a run killed right after the save committed
    os.remove(os.path.join(step_dir(c, 2), files.FILES))
  path = os.path.join(step_dir(c, 2), rel)
  os.truncate(path, os.path.getsize(path) // 2)
  assert_fell_back(c, mcfg, data, want, rel)


@pytest.mark.parametrize("record", [True, False], ids=["record", "no_record"])
def test_missing_manifest_falls_back_naming_the_file(run, data, record):
  c, mcfg, want = run
  if not record:
    os.remove(os.path.join(step_dir(c, 2), files.FILES))
  os.remove(os.path.join(step_dir(c, 2), "state", "manifest.ocdbt"))
  assert_fell_back(c, mcfg, data, want, "state/manifest.ocdbt is missing")


def test_nothing_to_fall_back_to_is_refused(run, data):
  c, mcfg, _ = run
  for step in (1, 2):
    os.remove(os.path.join(step_dir(c, step), "state", "manifest.ocdbt"))
  with pytest.raises(ck.CheckpointError, match=r"\(step 1\) is damaged: state/manifest.ocdbt is "
                                               r"missing; there is no earlier checkpoint"):
    resume(c, mcfg, data)


def test_damaged_reference_is_refused(run, data):
  c, mcfg, _ = run
  ref = os.path.join(ck.checkpoint_dir(c.run_dir), ck.STATIC, "reference")
  path = max(glob.glob(os.path.join(ref, "ocdbt.process_*", "d", "*")), key=os.path.getsize)
  os.truncate(path, os.path.getsize(path) - 1)
  with pytest.raises(ck.CheckpointError, match=r"saved reference model .* is damaged: "
                                               r"ocdbt.process_0/d/\w+ has \d+ bytes"):
    resume(c, mcfg, data)


def test_checkpoint_without_checksums_restores_with_a_message(run, data):
  c, mcfg, _ = run
  os.remove(os.path.join(step_dir(c, 2), files.FILES))
  path = os.path.join(step_dir(c, 2), "meta", "metadata")
  with open(path) as f:
    meta = json.load(f)
  del meta["checksums"]  # as an older version wrote it
  with open(path, "w") as f:
    json.dump(meta, f)
  start, _, msgs = resume(c, mcfg, data)
  assert start == 2 and any("(step 2) has no checksums" in m for m in msgs), msgs


def test_saved_record_and_checksums(run, data):
  c, _, _ = run
  with open(os.path.join(step_dir(c, 2), files.FILES)) as f:
    sizes = json.load(f)["files"]
  assert {"state/manifest.ocdbt", "state/_METADATA", "meta/metadata"} <= set(sizes)
  with open(os.path.join(step_dir(c, 2), "meta", "metadata")) as f:
    sums = json.load(f)["checksums"]
  _, arrays, _ = ck.read_arrays(ck.checkpoint_dir(c.run_dir), 2)  # verifies on the host
  assert set(sums) == set(arrays) and any(".opt_state." in n for n in sums)


def test_checksums_do_not_depend_on_the_mesh():
  rng = np.random.default_rng(0)
  arrays = {"w": rng.standard_normal((16, 24)).astype(np.float32),
            "b": rng.standard_normal((8,)).astype(jax.numpy.bfloat16),
            "n": np.arange(8, dtype=np.int32), "s": np.float32(3.0)}
  want = {n: checksums.host_figures(x) for n, x in arrays.items()}
  layouts = [({"fsdp": 8}, {"w": P("fsdp"), "b": P("fsdp"), "n": P(), "s": P()}),
             ({"fsdp": 2, "tensor": 2}, {"w": P("fsdp", "tensor"), "b": P("fsdp"),
                                         "n": P(("fsdp", "tensor")), "s": P()}),
             ({"fsdp": 2, "tensor": 2}, {"w": P(None, ("tensor", "fsdp")), "b": P("tensor"),
                                         "n": P(), "s": P()})]
  for axes, specs in layouts:
    m = mesh(int(np.prod(list(axes.values()))), **axes)
    tree = {k: jax.device_put(x, NamedSharding(m, specs[k])) for k, x in arrays.items()}
    assert checksums.all_figures(tree) == want, (axes, specs)
  one = {k: jax.device_put(x, jax.devices()[3]) for k, x in arrays.items()}
  assert checksums.all_figures(one) == want
  swapped = arrays["w"].copy()
  swapped[0, [0, 1]] = swapped[0, [1, 0]]
  assert checksums.host_figures(swapped)[:2] != want["w"][:2]
  assert checksums.host_figures(np.array([1.0, np.nan, np.inf], np.float32))[2] == 2
