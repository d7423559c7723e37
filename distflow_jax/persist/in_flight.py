"""In-flight batches of an asynchronous run (``trainer.max_staleness > 0``) as JSON.

A checkpoint after step s of an asynchronous run holds the batches s .. s+K-1 already
generated (their prompts drawn from the loader, whose saved position is past them) but
not trained yet.  Each is saved with the loader's state, as this process's rows:
numpy arrays in an ``.npz`` (base64), the host-side fields (prompt text, ground truth)
as JSON, the policy version that generated it and the metrics its generation recorded.
A resume puts them back exactly, so it loses no sample and trains none twice.
"""

from __future__ import annotations

import base64
import dataclasses
import io
import json
from typing import Any

import numpy as np

from distflow_jax.data.batch import Batch
from distflow_jax.state.metrics import Metrics


@dataclasses.dataclass
class Saved:
  """One in-flight batch: its index (the step that trains it), the policy version that
  generated it, this process's rows (numpy) and its generation's metrics."""
  index: int
  version: int
  batch: Batch
  metrics: Metrics


def _json_host(host: dict) -> dict[str, Any]:
  out = {}
  for gid, fields in host.items():
    try:
      json.dumps(fields)
    except (TypeError, ValueError):
      raise ValueError(f"in-flight sample {gid}: its host fields {sorted(fields)} are not "
                       f"JSON (an asynchronous run's checkpoint saves them as JSON)") from None
    out[str(int(gid))] = fields
  return out


def encode(saved: Saved) -> dict[str, Any]:
  """A JSON-able dict of ``saved`` (its batch's arrays must be numpy: ``to_local``)."""
  buf = io.BytesIO()
  np.savez(buf, **{k: np.asarray(v) for k, v in saved.batch.data.items()})
  m = saved.metrics
  return {"index": int(saved.index), "version": int(saved.version),
          "arrays": base64.b64encode(buf.getvalue()).decode("ascii"),
          "host": _json_host(dict(saved.batch.host)),
          "metrics": {"sums": m.sums, "counts": m.counts, "maxima": m.maxima}}


def decode(record: dict[str, Any]) -> Saved:
  """The inverse of ``encode``."""
  with np.load(io.BytesIO(base64.b64decode(record["arrays"])), allow_pickle=False) as z:
    data = {k: z[k] for k in z.files}
  host = {int(k): v for k, v in record["host"].items()}
  m = record["metrics"]
  metrics = Metrics(dict(m["sums"]), dict(m["counts"]), dict(m["maxima"]))
  return Saved(int(record["index"]), int(record["version"]), Batch(data, host), metrics)
