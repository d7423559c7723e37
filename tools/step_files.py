"""The reading list of one RL step, measured: which files and functions of ``distflow_jax/``
run while a step runs, and which while the command starts.

    python tools/step_files.py [--config grpo:tiny] [--override KEY=VALUE ...] [--list]

Runs ``distflow-jax train`` for one step in this process (no evaluation, a fresh run dir)
with a profile hook in every thread that records each call of a function defined under
``distflow_jax/``.  A call made inside ``run/trainer.StepLoop.one_step`` (the step: its nodes,
the jitted programs' tracing on a first step, the executor, the metrics) counts for the
step; any other for the start (the command, config checks, planning, model loading,
saving).  Prints, for each part, the files, their lines and the lines of the functions that
ran (a function's lines: from its ``def`` to its end), and with ``--list`` the files of the
step one per line with their functions.  The first step includes tracing the programs it
compiles, so it reads the loss and the model's code too: that is what a reader of one step
reads.
"""

from __future__ import annotations

import argparse
import ast
import collections
import os
import sys
import tempfile
import threading

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PKG_DIR = os.path.join(REPO, "distflow_jax") + os.sep


def _args(argv):
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--config", default="grpo:tiny")
  p.add_argument("--override", action="append", default=[],
                 help="extra --config.KEY=VALUE (repeatable)")
  p.add_argument("--list", action="store_true", help="the step's files and functions")
  return p.parse_args(argv)


class Recorder:
  """(file, first line, name) of every package function called, by part."""

  def __init__(self):
    self.in_step = False
    self.calls = {"start": set(), "step": set()}

  def hook(self, frame, event, arg):  # noqa: ARG002 - the profile hook's signature
    if event == "call":
      code = frame.f_code
      if code.co_filename.startswith(PKG_DIR):
        self.calls["step" if self.in_step else "start"].add(
            (code.co_filename, code.co_firstlineno, code.co_qualname))


def _function_lines(path: str, first: int) -> int:
  """Lines of the function starting at ``first`` (its def to its last line)."""
  tree = _TREES.get(path)
  if tree is None:
    tree = _TREES[path] = ast.parse(open(path).read())
  for node in ast.walk(tree):
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
      start = min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])])
      if first in (node.lineno, start):
        return node.end_lineno - node.lineno + 1
  return 1  # a module body, a comprehension, a class body


_TREES: dict = {}


def _summary(calls) -> tuple[dict, int, int]:
  by_file = collections.defaultdict(set)
  for path, first, name in calls:
    by_file[path].add((first, name))
  file_lines = sum(len(open(p).read().splitlines()) for p in by_file)
  fn_lines = sum(_function_lines(p, first) for p, fs in by_file.items() for first, _ in fs)
  return by_file, file_lines, fn_lines


def main(argv=None) -> int:
  a = _args(argv)
  sys.path.insert(0, REPO)
  from distflow_jax import cli
  from distflow_jax.run import trainer

  rec = Recorder()
  inner = trainer.StepLoop.one_step

  def one_step(self, step):
    rec.in_step = True
    try:
      return inner(self, step)
    finally:
      rec.in_step = False

  trainer.StepLoop.one_step = one_step
  run_dir = tempfile.mkdtemp(prefix="step_files_")
  args = ["train", f"--config={a.config}", f"--config.run_dir={run_dir}",
          "--config.trainer.total_steps=1", "--config.trainer.eval_every=0",
          *[f"--config.{o}" for o in a.override]]
  threading.setprofile(rec.hook)
  sys.setprofile(rec.hook)
  try:
    code = cli.main(args)
  finally:
    sys.setprofile(None)
    threading.setprofile(None)
  if code != 0:
    print(f"step_files: the run failed (exit {code})", file=sys.stderr)
    return code
  step_only = rec.calls["step"]
  for part in ("start", "step"):
    files, file_lines, fn_lines = _summary(rec.calls[part])
    print(f"{part}: {len(files)} files ({file_lines} lines), {len(rec.calls[part])} functions "
          f"({fn_lines} lines)")
  files, _, _ = _summary(step_only)
  only = [p for p in files if p not in _summary(rec.calls["start"])[0]]
  print(f"step, files not run at the start: {len(only)}")
  if a.list:
    for path in sorted(files):
      fns = sorted(files[path])
      rel = os.path.relpath(path, REPO)
      print(f"  {rel} ({len(open(path).read().splitlines())} lines): "
            + ", ".join(n for _, n in fns))
  return 0


if __name__ == "__main__":
  sys.exit(main())
