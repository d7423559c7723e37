"""A folder (or .tar) of wheels that installs distflow-jax on a machine with no internet.

    python tools/offline_bundle.py --out DIR [--python 3.12] [--platform manylinux_2_28_x86_64]
        [--jax-version V] [--with-jax [--cuda 13|13-local|12|12-local|none]] [--extras test]
        [--have FREEZE.txt] [--no-constraints] [--plan] [--tar] [--index-url URL]

For GPU nodes that cannot reach PyPI: run this where the network is, carry DIR (or DIR.tar)
over, and run `sh DIR/install.sh` there (PYTHON=/path/to/python to pick the interpreter).
DIR holds wheels/ (this project's wheel, built from the working tree with `pip wheel
--no-deps`, and every dependency's wheel for the target), requirements.txt, bundle.json
(what was resolved, what was left out and why) and install.sh, which runs
`pip install --no-index --find-links DIR/wheels -r DIR/requirements.txt`.

The target is a Python version (`--python`, default this one) and a platform tag
(`--platform`, default manylinux_2_28_x86_64; a manylinux_2_Y tag also takes the older
manylinux wheels, as a glibc-2.Y machine does).  Only binary wheels are used (`pip download
--only-binary=:all:`), resolved in one go (`pip install --dry-run --report`, which reads
wheel metadata, not wheels) and then fetched with `pip download --no-deps` at the resolved
versions.

jax: by default the target is taken to have jax already (with its CUDA plugin, the usual
state of a GPU node): the resolution pins jax and jaxlib to `--jax-version` (default: the
version `--have` lists, else constraints.txt's pin) so that flax, optax, orbax and chex
fit it, and then leaves jax, jaxlib, the jax-cuda*/rocm plugins and the nvidia-* libraries
out of the bundle.  `--with-jax` bundles jax, jaxlib and the CUDA plugin too: by default
`jax[cuda13]` (the plugin and NVIDIA's CUDA/cuDNN wheels, several GB), `--cuda 13-local`
the plugin only (it uses the node's own CUDA), `--cuda 12` / `12-local` for CUDA 12,
`--cuda none` for CPU jax.  `--have FREEZE.txt` (`pip freeze` of the target)
pins what the target already has and leaves it out as well.

Pins: constraints.txt (the versions the test suite runs: jax 0.10.2, flax 0.12.8, ...) is
applied where it fits.  flax 0.12.8 does not import on jax 0.11 (and flax >= 0.12.9 needs
jax >= 0.11.1), so with a `--jax-version` other than the pinned one the jax, jaxlib and
flax pins are dropped (said on stderr), and from jax 0.11 on flax >= 0.12.9 is required.
If the other pins do not fit the target Python or jax, pip's resolution fails and the
message says to try `--no-constraints` (newest versions that fit, not the tested ones).

Never torch or TensorFlow: the `hf` extra (torch, transformers) and `jetstream`
(TensorFlow) are refused, and a resolution that pulls either in stops with exit 1.  A bad
flag (an unknown platform tag, Python, extra) is one line and exit 2; a pip failure (no
network, nothing fits) one line and exit 1.  pip evaluates environment markers (`;
python_version < "3.12"`) for the Python it runs on, and `pip install --dry-run` checks
Requires-Python there too: for another target this tool checks Requires-Python itself and
notes the markers; `--pip-python /path/to/python3.12` (any Python of the target's version
with pip) makes the resolution exact.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONSTRAINTS = ROOT / "constraints.txt"
PROJECT = "distflow-jax"
EXTRAS = ("test", "vision", "math", "wandb")
REFUSED_EXTRAS = {"hf": "torch", "jetstream": "TensorFlow"}
# Never in a bundle: torch and TensorFlow and what only they need.
FORBIDDEN = re.compile(r"(torch|torchvision|torchaudio|tensorflow.*|tf-keras|tf-nightly|keras)")
# What a node that "has jax" has: left out unless --with-jax.
JAX_STACK = re.compile(r"(jax|jaxlib|jax-(cuda|rocm)\d+-(plugin|pjrt)|nvidia-.*|libtpu.*)")
ARCHES = ("x86_64", "aarch64", "ppc64le", "s390x", "i686")
_LEGACY = {"manylinux1": 5, "manylinux2010": 12, "manylinux2014": 17}
_PLATFORM = re.compile(
    r"(?P<ml>manylinux_2_(?P<glibc>\d+)|manylinux1|manylinux2010|manylinux2014)_(?P<arch>"
    + "|".join(ARCHES) + r")|musllinux_1_\d+_(x86_64|aarch64)|macosx_\d+_\d+_(x86_64|arm64|"
    r"universal2)|win_amd64|win_arm64|linux_(x86_64|aarch64)")
DEFAULT_PLATFORM = "manylinux_2_28_x86_64"


class BundleError(Exception):
  """One line for the user; `code` is the exit status (2: the command, 1: the run)."""

  def __init__(self, message: str, code: int = 1):
    super().__init__(message)
    self.code = code


def _norm(name: str) -> str:
  return re.sub(r"[-_.]+", "-", name).lower()


def platform_tags(platform: str) -> list[str]:
  """The tags a machine of `platform` installs: a manylinux_2_Y tag (or its legacy alias)
  also takes every older glibc's wheels, newest first; other tags as they are."""
  m = _PLATFORM.fullmatch(platform)
  if not m:
    raise BundleError(f"--platform {platform!r} is not a wheel platform tag; write e.g. "
                      f"manylinux_2_28_x86_64, manylinux2014_aarch64, macosx_14_0_arm64 or "
                      f"win_amd64", 2)
  if not m["ml"]:
    return [platform]
  glibc = int(m["glibc"]) if m["glibc"] else _LEGACY[m["ml"]]
  arch = m["arch"]
  tags = [f"manylinux_2_{y}_{arch}" for y in range(glibc, 4, -1)]
  for alias, y in _LEGACY.items():
    if y <= glibc:
      tags.append(f"{alias}_{arch}")
  return tags


def python_tag(version: str) -> str:
  m = re.fullmatch(r"3\.(\d+)", version)
  if not m:
    raise BundleError(f"--python {version!r}: write the target's minor version, e.g. 3.12", 2)
  if int(m[1]) < 11:
    raise BundleError(f"--python {version}: distflow-jax needs Python >= 3.11", 2)
  return f"cp3{m[1]}"


def read_pins(path: Path) -> dict[str, str]:
  """`name==version` lines of a constraints or `pip freeze` file, by normalised name (other
  lines: comments, editable installs, `name @ url`, are skipped)."""
  pins = {}
  for line in path.read_text().splitlines():
    line = line.split("#")[0].strip()
    m = re.fullmatch(r"([A-Za-z0-9][A-Za-z0-9._-]*)\s*==\s*([^\s;,]+)", line)
    if m:
      pins[_norm(m[1])] = m[2]
  return pins


def _version_tuple(v: str) -> tuple[int, ...]:
  return tuple(int(x) for x in re.findall(r"\d+", v)[:3])


def plan_pins(args, have: dict[str, str]) -> tuple[dict[str, str], list[str], str | None]:
  """(pins to resolve under, lower bounds as requirement strings, jax version), with a note
  on stderr for every pin dropped."""
  pins = {} if args.no_constraints else read_pins(CONSTRAINTS)
  jax_version = args.jax_version or have.get("jax") or pins.get("jax")
  if jax_version and pins.get("jax") and jax_version != pins["jax"]:
    dropped = [f"{k}=={pins.pop(k)}" for k in ("jax", "jaxlib", "flax") if k in pins]
    _note(f"constraints.txt pins {', '.join(dropped)}, which do not fit jax {jax_version}: "
          f"those pins are dropped, pip picks a flax that accepts jax {jax_version}")
  pins.update(have)  # what the target has is a fact, not a choice
  if jax_version:
    pins["jax"] = pins["jaxlib"] = jax_version
  lower = []
  if jax_version and _version_tuple(jax_version) >= (0, 11):
    lower.append("flax>=0.12.9")  # flax 0.12.8 fails on jax 0.11 (hijax HiPrimitive missing)
  return pins, lower, jax_version


def _note(text: str) -> None:
  print(f"offline_bundle: note: {text}", file=sys.stderr, flush=True)


_NETWORK = re.compile(r"Failed to establish a new connection[^')\n]*|Temporary failure in name "
                      r"resolution|Name or service not known|Network is unreachable|"
                      r"Connection refused|ConnectTimeout|ReadTimeoutError|Max retries exceeded")


def _pip(python: str | None, cmd: list[str], what: str, timeout: int
         ) -> subprocess.CompletedProcess:
  """pip in a subprocess; a failure becomes one BundleError line (pip's own last error)."""
  try:
    r = subprocess.run([python or sys.executable, "-m", "pip", *cmd], capture_output=True,
                       text=True, timeout=timeout, check=False)
  except subprocess.TimeoutExpired:
    raise BundleError(f"{what}: pip took over {timeout} s (no network?)") from None
  if r.returncode:
    errors = [l.strip() for l in r.stderr.splitlines() if l.strip().startswith("ERROR:")]
    last = (errors[:1] or [l.strip() for l in r.stderr.splitlines() if l.strip()][-1:]
            or [f"exit {r.returncode}"])[0]
    net = _NETWORK.search(r.stderr)
    if net:
      raise BundleError(f"{what}: cannot reach the package index (no network? "
                        f"{net[0]}); build the bundle where PyPI or a mirror is reachable")
    hint = ""
    if "Could not find a version" in last or "No matching distribution" in last:
      hint = (" (no network or index, or no wheel for this Python/platform; a pin from "
              "constraints.txt may not fit it: try --no-constraints)")
    elif "ResolutionImpossible" in r.stderr or "conflict" in r.stderr.lower():
      hint = " (the pins conflict: try --no-constraints, or another --jax-version)"
    raise BundleError(f"{what}: {last}{hint}")
  return r


def _target_flags(args) -> list[str]:
  abi = python_tag(args.python)
  flags = ["--only-binary=:all:", "--python-version", args.python, "--implementation", "cp"]
  for a in (abi, "abi3", "none"):
    flags += ["--abi", a]
  for tag in platform_tags(args.platform):
    flags += ["--platform", tag]
  flags += ["--timeout", str(args.pip_timeout), "--retries", "1"]
  if args.index_url:
    flags += ["--index-url", args.index_url]
  return flags


def _source_copy(dest: Path) -> Path:
  """The working tree's files (git's tracked + untracked-not-ignored; else all but the usual
  build leftovers) copied to `dest`, so a wheel build leaves nothing in the repository."""
  r = subprocess.run(["git", "-C", str(ROOT), "ls-files", "-z", "--cached", "--others",
                      "--exclude-standard"], capture_output=True, check=False)
  if r.returncode == 0 and r.stdout:
    for rel in filter(None, r.stdout.decode().split("\0")):
      src = ROOT / rel
      if src.is_file():
        (dest / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src, dest / rel)
  else:
    shutil.copytree(ROOT, dest, dirs_exist_ok=True, ignore=shutil.ignore_patterns(
        ".git", ".venv", "venv", "build", "dist", "runs", "*.egg-info", "__pycache__"))
  return dest


def build_project_wheel(out: Path, tmp: Path) -> Path:
  """This project's wheel (pure Python) from the working tree, into `out`."""
  src = _source_copy(tmp / "src")
  cmd = ["wheel", "--no-deps", "--wheel-dir", str(out), str(src)]
  try:
    import setuptools  # noqa: F401  pylint: disable=import-outside-toplevel,unused-import
    import wheel  # noqa: F401  pylint: disable=import-outside-toplevel,unused-import
    cmd.insert(1, "--no-build-isolation")  # offline, with this environment's setuptools
  except ImportError:
    pass
  _pip(None, cmd, f"pip wheel --no-deps {ROOT}", 600)
  wheels = sorted(out.glob("distflow_jax-*.whl"))
  if not wheels:
    raise BundleError(f"pip wheel built no distflow_jax wheel in {out}")
  return wheels[-1]


def resolve(args, project_wheel: Path, pins: dict[str, str], lower: list[str],
            tmp: Path) -> list[dict]:
  """Everything the project (with its extras, and jax as asked) needs on the target:
  [{name, version, url}], from pip's dry-run report."""
  constraints = tmp / "constraints.txt"
  constraints.write_text("".join(f"{k}=={v}\n" for k, v in sorted(pins.items())))
  extras = f"[{','.join(args.extras)}]" if args.extras else ""
  reqs = [f"{project_wheel}{extras}", *lower]
  if args.cuda:
    reqs.append(f"jax[cuda{args.cuda}]")
  report = tmp / "report.json"
  # `pip install` checks Requires-Python against the Python pip runs on, --python-version or
  # not (pip download does not): for another target the check is done here instead.
  other = args.pip_python_version != args.python
  _pip(args.pip_python, [
      "install", "--dry-run", "--quiet", "--ignore-installed", "--target", str(tmp / "t"),
      "--report", str(report), "-c", str(constraints), *_target_flags(args),
      *(["--ignore-requires-python"] if other else []), *reqs],
      "pip could not resolve the bundle", args.pip_timeout * 20)
  items = json.loads(report.read_text())["install"]
  out = [dict(name=i["metadata"]["name"], version=i["metadata"]["version"],
              url=i["download_info"]["url"],
              requires_python=i["metadata"].get("requires_python") or "") for i in items]
  bad = [f"{r['name']}=={r['version']} (Python {r['requires_python']})" for r in out
         if not _python_fits(args.python, r["requires_python"])]
  if bad:
    raise BundleError(f"resolved for Python {args.python} from pip on Python "
                      f"{args.pip_python_version}, these do not support {args.python}: "
                      f"{', '.join(bad)}; rerun with --pip-python /path/to/python{args.python}")
  return out


def _python_fits(version: str, requires: str) -> bool:
  """Whether Python `version` (3.12) is in a Requires-Python specifier (">=3.10,<4")."""
  try:
    from packaging.specifiers import SpecifierSet  # pylint: disable=import-outside-toplevel
  except ImportError:
    from pip._vendor.packaging.specifiers import SpecifierSet  # pylint: disable=import-outside-toplevel
  try:
    return SpecifierSet(requires).contains(f"{version}.0", prereleases=True) if requires \
        else True
  except ValueError:
    return True  # an unreadable specifier: pip download checks it again


def split(resolved: list[dict], args, have: dict[str, str]) -> tuple[list[dict], list[dict]]:
  """(to download, left out with the reason) ; refuses torch and TensorFlow."""
  bad = sorted(r["name"] for r in resolved if FORBIDDEN.fullmatch(_norm(r["name"])))
  if bad:
    raise BundleError(f"the resolution pulls in {', '.join(bad)} (torch / TensorFlow are "
                      f"never bundled); drop the extra that brings it")
  take, left = [], []
  for r in sorted(resolved, key=lambda r: _norm(r["name"])):
    n = _norm(r["name"])
    if n == PROJECT:
      continue
    if n in have:
      left.append(dict(r, why="--have lists it"))
    elif JAX_STACK.fullmatch(n) and not args.with_jax:
      left.append(dict(r, why="jax stack, on the target (no --with-jax)"))
    else:
      take.append(r)
  return take, left


INSTALL_SH = """#!/bin/sh
# Installs {project} from this folder with no network: Python {python}, {platform}.
# {jax_line}
# Usage: sh install.sh [extra pip flags]   (PYTHON=/path/to/python sh install.sh)
set -e
HERE=$(cd "$(dirname "$0")" && pwd)
PYTHON=${{PYTHON:-python3}}
"$PYTHON" -c 'import sys; sys.exit(sys.version_info[:2] != ({major}, {minor}))' || {{
  echo "install.sh: this bundle is for Python {python}; $PYTHON is $("$PYTHON" -V 2>&1)" >&2
  exit 2
}}
{jax_check}"$PYTHON" -m pip install --no-index --find-links "$HERE/wheels" "$@" -r "$HERE/requirements.txt"
"""

JAX_CHECK = """"$PYTHON" -c 'import jax' 2>/dev/null || {{
  echo "install.sh: jax is not installed for $PYTHON; install jax {jax} (and its CUDA plugin) first, or build the bundle with --with-jax" >&2
  exit 2
}}
"""


def write_bundle(out: Path, args, project_wheel: Path, take: list[dict], left: list[dict],
                 jax_version: str | None) -> None:
  extras = f"[{','.join(args.extras)}]" if args.extras else ""
  version = project_wheel.name.split("-")[1]
  (out / "requirements.txt").write_text(f"{PROJECT}{extras}=={version}\n")
  major, minor = args.python.split(".")
  jax_line = (f"Bundles jax {jax_version} too." if args.with_jax else
              f"Expects jax {jax_version or '(any)'} installed already (jax, jaxlib, the "
              f"CUDA plugin are not in the bundle).")
  (out / "install.sh").write_text(INSTALL_SH.format(
      project=PROJECT, python=args.python, platform=args.platform, jax_line=jax_line,
      major=major, minor=minor,
      jax_check="" if args.with_jax else JAX_CHECK.format(jax=jax_version or "")))
  os.chmod(out / "install.sh", 0o755)
  (out / "bundle.json").write_text(json.dumps(dict(
      python=args.python, platform=args.platform, platform_tags=platform_tags(args.platform),
      extras=args.extras, with_jax=args.with_jax, cuda=args.cuda, jax_version=jax_version,
      constraints=None if args.no_constraints else str(CONSTRAINTS),
      project_wheel=project_wheel.name,
      wheels=sorted(p.name for p in (out / "wheels").glob("*.whl")),
      downloaded=[f"{r['name']}=={r['version']}" for r in take],
      left_out=[dict(package=f"{r['name']}=={r['version']}", why=r["why"]) for r in left],
      command=" ".join(["tools/offline_bundle.py", *args.argv])), indent=2) + "\n")


def _interpreter_version(python: str | None) -> str:
  """"3.12" of `python` (None: this interpreter)."""
  if python is None:
    return f"{sys.version_info[0]}.{sys.version_info[1]}"
  try:
    r = subprocess.run([python, "-c", "import sys, pip; print('%d.%d' % sys.version_info[:2])"],
                       capture_output=True, text=True, timeout=60, check=False)
  except (OSError, subprocess.TimeoutExpired) as e:
    raise BundleError(f"--pip-python {python}: cannot run it ({e})", 2) from None
  if r.returncode:
    raise BundleError(f"--pip-python {python}: not a Python with pip", 2)
  return r.stdout.strip()


class _Parser(argparse.ArgumentParser):
  def error(self, message):  # one line, exit 2
    raise BundleError(message, 2)


def _extras(text: str) -> list[str]:
  names = [s.strip() for s in text.split(",") if s.strip()]
  for n in names:
    if n in REFUSED_EXTRAS:
      raise argparse.ArgumentTypeError(f"extra {n!r} brings {REFUSED_EXTRAS[n]}, which is "
                                       f"never bundled; valid: {','.join(EXTRAS)}")
    if n not in EXTRAS:
      raise argparse.ArgumentTypeError(f"unknown extra {n!r}; valid: {','.join(EXTRAS)}")
  return names


def _args(argv: list[str]):
  p = _Parser(description=__doc__.split("\n\n")[0])
  p.add_argument("--out", required=True, help="the bundle folder (made; must be empty or new)")
  p.add_argument("--python", help="the target's Python, e.g. 3.12 (default: this one, or "
                                   "--pip-python's)")
  p.add_argument("--platform", default=DEFAULT_PLATFORM, help="the target's wheel platform "
                 f"tag (default {DEFAULT_PLATFORM})")
  p.add_argument("--extras", type=_extras, default=[], help=f"comma list of {','.join(EXTRAS)}")
  p.add_argument("--jax-version", help="the jax the target has (or gets, with --with-jax)")
  p.add_argument("--with-jax", action="store_true", help="bundle jax and jaxlib too")
  p.add_argument("--cuda", choices=("12", "13", "12-local", "13-local", "none"),
                 help="with --with-jax: jax[cudaN] (plugin + NVIDIA's CUDA wheels; default 13), "
                      "jax[cudaN-local] (plugin only, the node's CUDA) or none (CPU jax)")
  p.add_argument("--have", help="the target's `pip freeze`: pinned, and left out")
  p.add_argument("--no-constraints", action="store_true",
                 help="ignore constraints.txt (newest versions that fit)")
  p.add_argument("--plan", action="store_true", help="list what would be bundled; download "
                 "nothing but the project wheel's build")
  p.add_argument("--tar", action="store_true", help="also write OUT.tar")
  p.add_argument("--index-url", help="a package index other than pip's configured one")
  p.add_argument("--pip-timeout", type=int, default=30, help="pip's socket timeout (s)")
  p.add_argument("--pip-python", help="run pip with this interpreter (one of the target's "
                 "Python version makes the resolution exact; default: this one)")
  args = p.parse_args(argv)
  args.argv = list(argv)
  args.pip_python_version = _interpreter_version(args.pip_python)
  if args.python is None:
    args.python = args.pip_python_version
  if args.cuda and not args.with_jax:
    raise BundleError("--cuda goes with --with-jax (a node without --with-jax keeps its own "
                      "jax and CUDA plugin)", 2)
  if args.with_jax and args.cuda is None:
    args.cuda = "13"
  if args.cuda == "none":
    args.cuda = None
  python_tag(args.python)
  platform_tags(args.platform)
  if args.have and not os.path.isfile(args.have):
    raise BundleError(f"--have {args.have}: no such file", 2)
  out = Path(args.out)
  if out.exists() and (not out.is_dir() or any(out.iterdir())):
    raise BundleError(f"--out {out} exists and is not an empty folder", 2)
  return args


def run(argv: list[str]) -> int:
  args = _args(argv)
  if args.python != args.pip_python_version:
    _note(f"pip runs on Python {args.pip_python_version}: environment markers are evaluated "
          f"for it, not {args.python} (Requires-Python is checked for {args.python}); "
          f"--pip-python /path/to/python{args.python} makes the resolution exact")
  have = read_pins(Path(args.have)) if args.have else {}
  have.pop(PROJECT, None)
  pins, lower, jax_version = plan_pins(args, have)
  out = Path(args.out)
  made = not out.exists()
  try:
    return _build(args, out, have, pins, lower, jax_version)
  except BaseException:
    if made and not args.plan:  # no half bundle left behind
      shutil.rmtree(out, ignore_errors=True)
    raise


def _build(args, out: Path, have: dict[str, str], pins: dict[str, str], lower: list[str],
           jax_version: str | None) -> int:
  with tempfile.TemporaryDirectory(prefix="offline_bundle_") as t:
    tmp = Path(t)
    wheels = (tmp if args.plan else out) / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    project_wheel = build_project_wheel(wheels, tmp)
    resolved = resolve(args, project_wheel, pins, lower, tmp)
    jax_version = jax_version or next(
        (r["version"] for r in resolved if _norm(r["name"]) == "jax"), None)
    take, left = split(resolved, args, have)
    if args.plan:
      print(f"bundle for Python {args.python}, {args.platform}, jax {jax_version or '(any)'}"
            f"{' (bundled)' if args.with_jax else ' (on the target)'}: "
            f"{len(take) + 1} wheels")
      print(f"  {project_wheel.name} (built)")
      for r in take:
        print(f"  {r['name']}=={r['version']}")
      for r in left:
        print(f"  left out: {r['name']}=={r['version']} ({r['why']})")
      return 0
    if take:
      pinned = [f"{r['name']}=={r['version']}" for r in take]
      _pip(args.pip_python, ["download", "--no-deps", "--quiet", "--dest", str(wheels),
                             *_target_flags(args), *pinned],
           "pip download failed", args.pip_timeout * 20)
  write_bundle(out, args, project_wheel, take, left, jax_version)
  size = sum(p.stat().st_size for p in (out / "wheels").iterdir())
  print(f"{out}: {len(take) + 1} wheels, {size / 1e6:.1f} MB; on the target: "
        f"sh {out}/install.sh" + ("" if args.with_jax else
                                  f"  (expects jax {jax_version or '(any)'} there)"))
  if args.tar:
    with tarfile.open(f"{out}.tar", "w") as tar:
      tar.add(out, arcname=out.name)
    print(f"{out}.tar")
  return 0


def main(argv=None) -> int:
  try:
    return run(sys.argv[1:] if argv is None else list(argv))
  except BundleError as e:
    print(f"offline_bundle: error: {e}", file=sys.stderr)
    return e.code
  except OSError as e:
    print(f"offline_bundle: error: {e.strerror or e}: {e.filename or ''}", file=sys.stderr)
    return 1
  except KeyboardInterrupt:
    return 130


if __name__ == "__main__":
  sys.exit(main())
