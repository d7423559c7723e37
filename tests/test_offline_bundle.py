"""tools/offline_bundle.py: a real bundle installed with no index into a fresh venv, the plan
for Python 3.12 and jax 0.11 with the CUDA plugin, and one line (exit 2 / 1) for bad input and
for no network.  Network-light: the real bundle downloads two small pure-Python wheels (the
target is told it has everything else with --have), the plan reads wheel metadata only."""

import importlib.metadata as md
import json
import os
import re
import socket
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tools" / "offline_bundle.py"
sys.path.insert(0, str(ROOT / "tools"))
import offline_bundle as ob  # noqa: E402

# What the target lacks in the real-bundle test: small, pure Python, needed at import.
MISSING = ("absl-py", "ml-collections")


@pytest.fixture
def index():
  """Skips where no package index can be reached (an offline CI runner)."""
  if os.environ.get("PIP_INDEX_URL"):
    return
  try:
    socket.create_connection(("pypi.org", 443), timeout=5).close()
  except OSError as e:
    pytest.skip(f"pypi.org unreachable ({e}): the bundle needs a package index")


def _run(args, timeout, env=None):
  return subprocess.run([sys.executable, str(SCRIPT), *map(str, args)], capture_output=True,
                        text=True, timeout=timeout, env=env, cwd=ROOT, check=False)


def _offline_env():
  """No pip configuration: no index, no find-links but the ones on the command line; no
  PYTHONPATH (a checkout on it would shadow the bundle's installed package)."""
  env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_") and k != "PYTHONPATH"}
  env.update(PIP_CONFIG_FILE=os.devnull, PIP_DISABLE_PIP_VERSION_CHECK="1")
  return env


def _target_site(tmp: Path) -> Path:
  """This venv's site-packages as links, without MISSING and without this project: what a
  GPU node that has jax and the rest, but not those, would import from."""
  site = tmp / "target_site"
  site.mkdir()
  skip = set()
  for name in MISSING:
    skip |= {Path(str(f)).parts[0] for f in md.distribution(name).files or ()}
  src = Path(md.distribution("jax").locate_file(""))
  for entry in src.iterdir():
    if (entry.name in skip or entry.suffix == ".pth" or entry.name.startswith(
        ("distflow_jax", "__editable__", "pip", "setuptools", "_distutils_hack",
         "pkg_resources"))):
      continue
    (site / entry.name).symlink_to(entry)
  return site


@pytest.mark.timeout(600)
@pytest.mark.usefixtures("index")
def test_real_bundle_installs_with_no_index(tmp_path):
  freeze = subprocess.run([sys.executable, "-m", "pip", "list", "--format=freeze",
                           "--exclude-editable"], capture_output=True, text=True, timeout=120,
                          check=True).stdout
  norm = lambda n: re.sub(r"[-_.]+", "-", n).lower()  # noqa: E731
  have = tmp_path / "have.txt"
  have.write_text("".join(f"{l}\n" for l in freeze.splitlines()
                          if norm(l.split("==")[0]) not in MISSING))
  out = tmp_path / "bundle"
  r = _run(["--out", out, "--have", have, "--tar"], 360)
  assert r.returncode == 0, r.stderr
  wheels = sorted(p.name for p in (out / "wheels").iterdir())
  assert [w.split("-")[0] for w in wheels] == ["absl_py", "distflow_jax", "ml_collections"]
  info = json.loads((out / "bundle.json").read_text())
  assert sorted(info["wheels"]) == wheels and info["with_jax"] is False
  left = {p["package"].split("==")[0].lower() for p in info["left_out"]}
  assert {"jax", "jaxlib", "flax", "numpy"} <= left
  assert not any(ob.FORBIDDEN.fullmatch(ob._norm(n)) for n in left)  # pylint: disable=protected-access
  assert (out / "requirements.txt").read_text() == "distflow-jax==0.1.0\n"
  script = (out / "install.sh").read_text()
  assert '-m pip install --no-index --find-links "$HERE/wheels"' in script
  with tarfile.open(f"{out}.tar") as tar:
    assert {"bundle/install.sh", "bundle/requirements.txt"} <= set(tar.getnames())

  # The target: a fresh venv that sees this venv's packages (jax, flax, ...) but MISSING.
  venv = tmp_path / "target"
  base = getattr(sys, "_base_executable", sys.executable)
  subprocess.run([base, "-m", "venv", venv], check=True, timeout=120, capture_output=True)
  py = venv / "bin" / "python"
  purelib = subprocess.run([py, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                           capture_output=True, text=True, timeout=60, check=True).stdout.strip()
  Path(purelib, "target_site.pth").write_text(f"{_target_site(tmp_path)}\n")
  env = dict(_offline_env(), PYTHON=str(py))
  r = subprocess.run(["sh", out / "install.sh"], capture_output=True, text=True, timeout=180,
                     env=env, cwd=tmp_path, check=False)
  assert r.returncode == 0, r.stdout + r.stderr
  assert re.search(r"Successfully installed .*distflow-jax-0\.1\.0", r.stdout), r.stdout
  probe = ("import absl, distflow_jax, jax, ml_collections\n"
           "from distflow_jax.config import loading\n"
           "print(distflow_jax.__file__, ml_collections.__file__, absl.__file__)\n"
           "print(loading.load('grpo:tiny', []).name)")
  r = subprocess.run([py, "-c", probe], capture_output=True, text=True, timeout=120,
                     env=dict(env, JAX_PLATFORMS="cpu"), cwd=tmp_path, check=False)
  assert r.returncode == 0, r.stderr
  paths, name = r.stdout.split("\n")[:2]
  assert all(p.startswith(str(venv)) for p in paths.split()), paths  # from the bundle
  assert name


@pytest.mark.timeout(600)
@pytest.mark.usefixtures("index")
def test_plan_for_python_312_jax_011_with_the_cuda_plugin(tmp_path):
  """Metadata only: flax fits jax 0.11 (>= 0.12.9), the plugin comes with --with-jax, and
  neither torch nor TensorFlow is anywhere, with the test extra."""
  r = _run(["--out", tmp_path / "b", "--plan", "--python", "3.12", "--jax-version", "0.11.2",
            "--with-jax", "--cuda", "13-local", "--extras", "test"], 540)
  assert r.returncode == 0, r.stderr
  pins = dict(re.findall(r"^  ([A-Za-z0-9_.-]+)==(\S+)$", r.stdout, re.M))
  pins = {ob._norm(k): v for k, v in pins.items()}  # pylint: disable=protected-access
  assert pins["jax"] == pins["jaxlib"] == "0.11.2"
  assert pins["jax-cuda13-plugin"] == pins["jax-cuda13-pjrt"] == "0.11.2"
  assert ob._version_tuple(pins["flax"]) >= (0, 12, 9)  # pylint: disable=protected-access
  assert {"pytest", "chex", "optax", "orbax-checkpoint"} <= set(pins)
  assert not [n for n in pins if ob.FORBIDDEN.fullmatch(n)]
  assert "distflow_jax-0.1.0-py3-none-any.whl (built)" in r.stdout
  assert "pins jax==0.10.2, jaxlib==0.10.2, flax==0.12.8, which do not fit jax 0.11.2" in r.stderr
  assert not (tmp_path / "b").exists()  # a plan writes nothing


@pytest.mark.timeout(120)
def test_no_network_is_one_line_and_exit_1(tmp_path):
  r = _run(["--out", tmp_path / "b", "--index-url", "http://127.0.0.1:9/simple"], 100,
           env=_offline_env())
  assert r.returncode == 1, r.stderr
  lines = r.stderr.strip().splitlines()
  assert len(lines) == 1 and lines[0].startswith(
      "offline_bundle: error: pip could not resolve the bundle: cannot reach the package "
      "index (no network?"), r.stderr
  assert not (tmp_path / "b").exists()  # no half bundle left behind


@pytest.mark.timeout(60)
@pytest.mark.parametrize("args, says", [
    (["--platform", "manylinux_x86_64"], "is not a wheel platform tag"),
    (["--platform", "linux-gpu"], "is not a wheel platform tag"),
    (["--python", "3.9"], "distflow-jax needs Python >= 3.11"),
    (["--python", "2.7"], "write the target's minor version"),
    (["--python", "3.12.1"], "write the target's minor version"),
    (["--extras", "hf"], "brings torch, which is never bundled"),
    (["--extras", "jetstream"], "brings TensorFlow"),
    (["--extras", "test,bogus"], "unknown extra 'bogus'"),
    (["--with-jax", "--cuda", "14"], "invalid choice"),
    (["--cuda", "13"], "--cuda goes with --with-jax"),
    (["--have", "/no/such/freeze.txt"], "no such file"),
    (["--pip-python", "/no/such/python"], "--pip-python /no/such/python: cannot run it"),
    (["--no-such-flag"], "unrecognized arguments"),
])
def test_bad_input_is_one_line_and_exit_2(tmp_path, args, says):
  r = _run(["--out", tmp_path / "b", *args], 50)
  assert r.returncode == 2, r.stderr
  lines = r.stderr.strip().splitlines()
  assert len(lines) == 1 and lines[0].startswith("offline_bundle: error: "), r.stderr
  assert says in lines[0]
  assert r.stdout == "" and not (tmp_path / "b").exists()


def test_out_must_be_new_or_empty(tmp_path):
  (tmp_path / "b").mkdir()
  (tmp_path / "b" / "x").write_text("")
  r = _run(["--out", tmp_path / "b"], 50)
  assert r.returncode == 2 and "exists and is not an empty folder" in r.stderr


def test_platform_tags():
  tags = ob.platform_tags("manylinux_2_28_x86_64")
  assert tags[:3] == ["manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_26_x86_64"]
  assert {"manylinux_2_17_x86_64", "manylinux2014_x86_64", "manylinux1_x86_64"} <= set(tags)
  assert "manylinux_2_29_x86_64" not in tags
  assert ob.platform_tags("manylinux2014_aarch64")[0] == "manylinux_2_17_aarch64"
  assert "manylinux_2_28_aarch64" not in ob.platform_tags("manylinux2014_aarch64")
  assert ob.platform_tags("macosx_14_0_arm64") == ["macosx_14_0_arm64"]
  assert ob.platform_tags("win_amd64") == ["win_amd64"]


def test_pins_follow_the_jax_version(tmp_path):
  args = ob._args(["--out", str(tmp_path / "b")])  # pylint: disable=protected-access
  pins, lower, jax = ob.plan_pins(args, {})
  assert jax == pins["jax"] == pins["jaxlib"] == "0.10.2" and pins["flax"] == "0.12.8"
  assert lower == []
  args = ob._args(["--out", str(tmp_path / "b"), "--jax-version", "0.11.2"])  # pylint: disable=protected-access
  pins, lower, jax = ob.plan_pins(args, {"numpy": "2.1.0"})
  assert jax == pins["jax"] == pins["jaxlib"] == "0.11.2" and "flax" not in pins
  assert lower == ["flax>=0.12.9"] and pins["numpy"] == "2.1.0"  # --have wins over the pins
  args = ob._args(["--out", str(tmp_path / "b"), "--no-constraints"])  # pylint: disable=protected-access
  assert ob.plan_pins(args, {"jax": "0.12.0"}) == ({"jax": "0.12.0", "jaxlib": "0.12.0"},
                                                   ["flax>=0.12.9"], "0.12.0")


def test_split_leaves_the_jax_stack_out_and_refuses_torch(tmp_path):
  args = ob._args(["--out", str(tmp_path / "b")])  # pylint: disable=protected-access
  res = [dict(name=n, version="1", url="") for n in
         ("distflow-jax", "jax", "jaxlib", "jax-cuda13-plugin", "nvidia-cudnn-cu13", "flax",
          "numpy")]
  take, left = ob.split(res, args, {"numpy": "1"})
  assert [r["name"] for r in take] == ["flax"]
  assert {r["name"]: r["why"].split(",")[0] for r in left} == {
      "jax": "jax stack", "jaxlib": "jax stack", "jax-cuda13-plugin": "jax stack",
      "nvidia-cudnn-cu13": "jax stack", "numpy": "--have lists it"}
  args.with_jax = True
  assert len(ob.split(res, args, {})[0]) == 6
  with pytest.raises(ob.BundleError, match="pulls in tensorflow, torch"):
    ob.split(res + [dict(name="torch", version="2", url=""),
                    dict(name="tensorflow", version="2", url="")], args, {})
  assert ob._python_fits("3.12", ">=3.10") and not ob._python_fits("3.11", ">=3.12")  # pylint: disable=protected-access
  assert ob._python_fits("3.12", "")  # pylint: disable=protected-access
