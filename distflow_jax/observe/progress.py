"""Console progress of a run: a step bar with ETA, named phases, and an end summary.

    log = Logger(process_index == 0)
    log("a message")                      # [  12.3s] a message
    phase(log, "evaluation")              # names what runs now (a no-op on plain callables)
    log.step(metrics, total_steps)        # step 3/20 [##....] 2.10s/step ETA 0:36 reward ...
    log.summary(summary_lines(...))       # where things are, and what to run next

Step lines fit ``width`` (80) columns: the least useful fields are dropped
first (tok/s, kl, length, the bar), never the step, the ETA, skipped updates
(``SKIPPED(actor)``), holding health alarms (``!kl_high``) or the compile seconds of
a step after the first that compiled (``compiled 4.2s``: a mid-run recompile).  The per-node
times go on a second line every ``times_every`` steps, in the plan's run
order.  On a terminal the step line is redrawn in place (carriage return)
and kept every ``times_every`` steps and whenever it carries an evaluation,
a skipped update, an alarm or a compile; anywhere else (a file, a pipe, a CI log) every
step and phase is a plain line of its own.
"""

from __future__ import annotations

import json
import os
import shlex
import sys
import time
from collections.abc import Callable, Sequence
from typing import IO

from distflow_jax.observe import invocation
from distflow_jax.observe.heartbeat import Sink

# (metric, format, drop priority: higher goes first when the line is too long)
_KEYS = (("reward", "reward {:.3f}", 2), ("accuracy", "acc {:.3f}", 3),
         ("eval/accuracy", "eval {:.3f}", 1), ("response_length", "len {:.1f}", 5),
         ("actor/kl", "kl {:.4f}", 5), ("tokens_per_s", "{:.0f} tok/s", 6))
_BAR_WIDTH = 12
# The phases a run names as they start (``phase``).
PHASES = ("warm start", "compile/first step", "evaluation", "checkpoint save")


def bar(done: int, total: int, width: int = _BAR_WIDTH) -> str:
  filled = min(int(width * done / max(total, 1)), width)
  return "[" + "#" * filled + "." * (width - filled) + "]"


def clock(seconds: float) -> str:
  """``m:ss`` or ``h:mm:ss``."""
  s = int(round(max(seconds, 0.0)))
  h, m = divmod(s // 60, 60)
  return f"{h}:{m:02d}:{s % 60:02d}" if h else f"{m}:{s % 60:02d}"


def fit(parts: Sequence[tuple[str, int]], width: int) -> str:
  """Joins ``(text, priority)`` parts, dropping the highest priority (the last of equals)
  until the line fits; priority 0 is never dropped (the line is cut as a last resort)."""
  parts = [p for p in parts if p[0]]
  while len(" ".join(t for t, _ in parts)) > width:
    droppable = [i for i, (_, pr) in enumerate(parts) if pr > 0]
    if not droppable:
      break
    parts.pop(max(droppable, key=lambda i: (parts[i][1], i)))
  line = " ".join(t for t, _ in parts)
  return line if len(line) <= width else line[:width - 3] + "..."


def phase(log: Callable[[str], None] | None, name: str) -> None:
  """Names the phase starting now on a ``Logger``; a plain callable (``print``) gets nothing:
  callers of the library that did not ask for progress get no extra lines."""
  if isinstance(log, Logger):
    log.phase(name)


class Logger:
  """Prints on process 0 only; ``step`` renders one training step's line."""

  def __init__(self, enabled: bool, out: IO[str] | None = None, *, tty: bool | None = None,
               width: int = 80, times_every: int = 10):
    self.enabled = enabled
    self.out = out if out is not None else sys.stdout  # now, not at import time
    self.tty = bool(tty if tty is not None else getattr(self.out, "isatty", lambda: False)())
    self.width = width
    self.times_every = max(times_every, 1)
    self.start = time.perf_counter()
    self.nodes: list[str] = []   # the plan's node ids in run order (for the times line)
    self._live = ""              # the line drawn in place on a terminal (not yet kept)
    self._last: tuple[int | None, float] | None = None  # (step, time) of the last step seen
    self._warm: list[tuple[int, float]] = []  # (steps, seconds) of the steps that compiled nothing
    self._t0 = self.start        # when training (the first step) started
    self._where = ""             # "step 3/20 [##..]" of the last step, for phase lines
    self._step_line = ""         # the step line drawn in place now (a terminal; not kept)
    self.first_step: int | None = None

  # -- output --

  def _write(self, text: str) -> None:
    if self.enabled:
      self.out.write(text)
      self.out.flush()

  def _clear(self) -> None:
    if self.tty and self._live:
      self._write("\r\033[K")

  def _draw(self, line: str) -> None:
    """On a terminal: ``line`` redrawn in place; it stays until the next line replaces it."""
    self._live = line
    self._write("\r" + line + "\033[K")

  def heartbeat_sink(self):
    """Where a heartbeat's child process prints for this log (observe/heartbeat.py): its
    stream's descriptor, flushed; None when it has none (a StringIO, a capture) or prints
    nothing (not process 0)."""
    if not self.enabled:
      return None
    try:
      self.out.flush()
      fd = self.out.fileno()
    except (AttributeError, OSError, ValueError):
      return None
    return Sink(fd, self.start, self.tty)

  def __call__(self, message: str) -> None:
    self._clear()
    self._write(f"[{time.perf_counter() - self.start:7.1f}s] {message}\n")
    if self.tty and self._live:
      self._write(self._live)

  def end_line(self) -> None:
    """Ends a line drawn in place (before something else writes to the terminal)."""
    if self.tty and self._live:
      self._write("\n")
    self._live = ""
    self._step_line = ""

  # -- phases --

  def phase(self, name: str) -> None:
    if name == "compile/first step":
      self._t0 = time.perf_counter()
      name = "compile and first step (later steps are faster)"
    if self.tty:
      # Behind the step line still drawn when it fits, else in place of its numbers.
      text = f"{self._step_line} | {name}..."
      if not self._step_line or len(text) > self.width:
        text = f"{self._where} {name}...".strip()
      self._draw(fit([(text, 0)], self.width))
    else:
      self(f"{name}...")

  def progress(self, label: str, done: int, total: int, extra: str = "") -> None:
    """A sub-task's bar (the warm start): redrawn on a terminal, a line elsewhere."""
    line = fit([(f"{label} {done}/{total}", 0), (bar(done, total), 3), (extra, 1)], self.width)
    if self.tty:
      self._draw(line)
      if done >= total:
        self.end_line()
    else:
      self(line)

  # -- steps --

  def rate(self) -> float | None:
    """Seconds per step over the last (up to) 20 warm steps: a step that compiled (the first
    of every process start, a mid-run recompile) says nothing about the steps to come, so it
    never counts; None until a warm step has been seen."""
    warm = self._warm[-20:]
    if not warm:
      return None
    return sum(t for _, t in warm) / max(sum(n for n, _ in warm), 1)

  def _mark(self, step: int, compiled: bool, now: float) -> None:
    """Records a finished step; its seconds count toward the rate only when it compiled
    nothing."""
    prev_step, prev_t = self._last if self._last is not None else (None, self._t0)
    if not compiled and prev_step is not None and step > prev_step:
      self._warm.append((step - prev_step, now - prev_t))
    self._last = (step, now)

  def step(self, m: dict[str, float], total: int) -> None:
    step = int(m["step"])
    now = time.perf_counter()
    if step > 0:
      first = self.first_step is None
      if first:
        self.first_step = step
      self._mark(step, first or m.get("compile/count", 0) > 0, now)
    self._where = f"step {step}/{total} {bar(step, total)}"
    parts: list[tuple[str, int]] = [(f"step {step}/{total}", 0), (bar(step, total), 4)]
    rate = self.rate()
    if step > 0 and rate is not None:
      parts += [(f"{rate:.2f}s/step", 2), (f"ETA {clock(rate * (total - step))}", 0)]
    elif 0 < step < total:  # only compiling steps so far: their time predicts nothing
      parts.append((f"ETA after step {step + 1}", 0))
    parts += [(fmt.format(m[k]), pr) for k, fmt, pr in _KEYS if k in m]
    # A step whose update was refused (non-finite loss, gradient or new parameters) and
    # the health signals holding now: visible here, not only in metrics.jsonl.
    skipped = [k.split("/")[0] for k in m if k.endswith("/skipped") and m[k]]
    if skipped:
      parts.append(("SKIPPED(" + ",".join(sorted(skipped)) + ")", 0))
    alarms = [k[len("health/"):] for k in m if k.startswith("health/") and m[k]]
    if alarms:
      parts.append(("!" + ",".join(sorted(alarms)), 0))
    # The first step compiles every node; a later one compiling is worth seeing.
    recompiled = (step > (self.first_step or 0) and m.get("compile/count", 0) > 0)
    if recompiled:
      parts.append((f"compiled {m.get('time/compile', 0.0):.1f}s", 0))
    line = fit(parts, self.width)
    times = self.times_lines(m) if step % self.times_every == 0 or step == total else []
    keep = bool(times or skipped or alarms or recompiled or "eval/accuracy" in m
                or step in (0, total))
    if self.tty:
      self._draw(line)
      self._step_line = "" if keep else line
      if keep:
        self.end_line()
    else:
      self._write(line + "\n")
    for t in times:
      self._write(t + "\n")

  def times_lines(self, m: dict[str, float]) -> list[str]:
    """``  times: generate 0.52s reward 0.01s ...`` in run order, wrapped to the width."""
    # time/compile is not a node: its seconds are inside the nodes' own.
    names = [k[5:] for k in m if k.startswith("time/") and k not in ("time/step", "time/compile")
             and "/move_to/" not in k]
    if not names:
      return []
    order = {n: i for i, n in enumerate(self.nodes)}
    names.sort(key=lambda n: order.get(n, len(order)))  # unknown ones after, as they came
    words = [f"{n} {m['time/' + n]:.2f}s" for n in names]
    if "time/step" in m:
      words.append(f"(step {m['time/step']:.2f}s)")
    lines, line = [], "  times:"
    for w in words:
      if len(line) + 1 + len(w) > self.width and line.strip() != "times:":
        lines.append(line)
        line = "        "
      line += " " + w
    return lines + [line]

  # -- the end --

  def summary(self, lines: Sequence[str]) -> None:
    self.end_line()
    for line in lines:
      self._write(line + "\n")


def _first_last_eval(metrics_path: str) -> tuple[tuple[int, float] | None, tuple[int, float] | None]:
  first = last = None
  try:
    with open(metrics_path) as f:
      for raw in f:
        try:
          rec = json.loads(raw)
        except ValueError:
          continue
        if isinstance(rec, dict) and "eval/accuracy" in rec:
          point = (int(rec.get("step", 0)), float(rec["eval/accuracy"]))
          first = first or point
          last = point
  except OSError:
    pass
  return first, last


def summary_lines(run_dir: str, *, checkpoint_dir: str, last_checkpoint: int | None,
                  steps: int, seconds: float, eval_data: str | None,
                  rate: float | None = None, config_args: Sequence[str] = ()) -> list[str]:
  """The end of a run: held-out accuracy at the start and the end (when evaluated), where
  the checkpoint and metrics are, and the commands to look at or use the result.
  ``rate``: seconds per step after the first (``Logger.rate``; the first compiles).
  ``config_args``: the run's command-line flags; the eval command repeats its ``--config``
  ones that shape prompts, answers and the plan (``eval_config_args``)."""
  run_dir = os.path.normpath(run_dir)
  out = [f"done: {steps} step(s) in {clock(seconds)}"
         + (f", {rate:.2f}s/step after the first (it compiles)" if rate and steps > 1 else "")]
  first, last = _first_last_eval(os.path.join(run_dir, "metrics.jsonl"))
  if first is not None and last is not None:
    out.append(f"held-out accuracy: {first[1]:.3f} at step {first[0]} -> {last[1]:.3f} at "
               f"step {last[0]}")
  if last_checkpoint is not None:
    out.append(f"checkpoint: {os.path.join(checkpoint_dir, str(last_checkpoint))}")
  out.append(f"metrics:    {os.path.join(run_dir, 'metrics.jsonl')}")
  hf = os.path.join(run_dir, "hf")
  cmd = invocation.command()  # the venv's script by its full path where PATH lacks it
  out += ["next:", f"  {cmd} report {run_dir}"]
  if last_checkpoint is None:  # eval and export read a checkpoint: none was written
    return out + ["  (no checkpoint was written, so there is nothing to eval or export)"]
  out += [f"  {cmd} eval " + "".join(f"{shlex.quote(a)} " for a in
                                     eval_config_args(config_args))
          + f"--model={run_dir} --data={eval_data or 'FILE.jsonl'}",
          f"  {cmd} export --checkpoint {run_dir} --out {hf}   (for transformers)"]
  return out


def eval_config_args(config_args: Sequence[str]) -> list[str]:
  """Of a run's ``--config`` flags, those ``distflow-jax eval`` repeats so that it reads the
  run's prompts, decodes its answers and plans its nodes as the run did: all but the ones
  about where and how long the run went (``run_dir``, ``trainer.*``, ``logging.*``), on
  which processes and devices (``cluster.*``, ``placement.*``, ``rollout.tensor_parallel``:
  eval runs on this machine's devices, where a launched run's ``cluster.num_processes=2``
  is refused) and ``model.path`` (``--model`` sets it)."""
  drop = ("--config.run_dir=", "--config.trainer.", "--config.logging.", "--config.model.path=",
          "--config.cluster.", "--config.placement.", "--config.rollout.tensor_parallel=")
  joined, args = [], list(config_args)
  for i, a in enumerate(args):  # "--config X" as "--config=X"
    if i and "=" not in args[i - 1] and args[i - 1].startswith("--config") \
        and not a.startswith("--"):
      joined[-1] = f"{args[i - 1]}={a}"
    else:
      joined.append(a)
  return [a for a in joined if a.startswith("--config") and not a.startswith(drop)]


def interrupted_line(last_checkpoint: int | None, checkpoint_dir: str,
                     how: str = "interrupted (Ctrl-C)") -> str:
  """What Ctrl-C (or SIGTERM: ``how``) leaves behind, in one line."""
  if last_checkpoint is None:
    return f"{how}; no checkpoint was saved: the next run starts over"
  return (f"{how}; the last complete checkpoint is step {last_checkpoint} in "
          f"{checkpoint_dir}: run the same command to resume from it")
