"""Console progress: a bar per phase with live reward / accuracy and node timings."""

from __future__ import annotations

import sys
import time
from typing import IO

_KEYS = (("reward", "reward {:.3f}"), ("accuracy", "acc {:.3f}"),
         ("eval/accuracy", "eval_acc {:.3f}"), ("response_length", "len {:.1f}"),
         ("actor/kl", "kl {:.4f}"), ("tokens_per_s", "{:.0f} tok/s"))


def bar(done: int, total: int, width: int = 24) -> str:
  filled = int(width * done / max(total, 1))
  return "[" + "#" * filled + "." * (width - filled) + f"] {done}/{total}"


class Logger:
  """Prints on process 0 only; ``step`` renders one training step's line."""

  def __init__(self, enabled: bool, out: IO[str] | None = None):
    self.enabled = enabled
    self.out = out if out is not None else sys.stdout  # now, not at import time
    self.start = time.perf_counter()

  def __call__(self, message: str) -> None:
    if self.enabled:
      self.out.write(f"[{time.perf_counter() - self.start:7.1f}s] {message}\n")
      self.out.flush()

  def step(self, m: dict[str, float], total: int) -> None:
    parts = [bar(int(m["step"]), total)]
    parts += [fmt.format(m[k]) for k, fmt in _KEYS if k in m]
    # A step whose update was refused (non-finite loss, gradient or new parameters) and
    # the health signals holding now: visible here, not only in metrics.jsonl.
    skipped = [k.split("/")[0] for k in m if k.endswith("/skipped") and m[k]]
    if skipped:
      parts.append("SKIPPED(" + ",".join(sorted(skipped)) + ")")
    alarms = [k[len("health/"):] for k in m if k.startswith("health/") and m[k]]
    if alarms:
      parts.append("!" + ",".join(sorted(alarms)))
    times = sorted((k[5:], v) for k, v in m.items()
                   if k.startswith("time/") and k != "time/step" and "/move_to/" not in k)
    if times:
      parts.append("| " + " ".join(f"{name} {v:.2f}s" for name, v in times))
    self(" ".join(parts))
