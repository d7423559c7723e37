"""Weak-scaling benchmark: distributed all_to_all vs centralized (via process 0).

    python tools/bench_redistribute.py [--procs 1,2,4,8] [--rows-per-host 256]
        [--tokens 2048] [--iters 5]

Launches P local processes with 2 simulated CPU devices each, a fixed batch
per process (weak scaling), and moves the batch from one rollout replica per
host (sample axis sharded over hosts, replicated over the host's devices) to
FSDP over all devices, as the GRPO workflow does after generation.  Each mode
runs in its own launch so its peak memory is its own.  Printed per P and mode:
median wall time per re-partition (slowest process), bytes sent / received
across process boundaries by the busiest process (analytic, from the plan:
every all_to_all block between processes, padding included; centralized:
every row to process 0 and back), the bytes that process actually wrote to
its sockets per re-partition (``/proc/self/io`` wchar; gloo makes every CPU
device its own rank, so this also counts device-to-device traffic inside a
process), and peak RSS of the busiest process
(``ru_maxrss``, absolute and above the RSS after compiling, before the
first re-partition).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _bench_common as bc  # noqa: E402


def _rss_mb() -> float:
  return bc.peak_rss_bytes() / 2 ** 20


def _io_bytes() -> tuple[int, int]:
  """(wchar, rchar) of this process: includes its socket traffic (gloo)."""
  try:
    with open("/proc/self/io") as f:
      kv = dict(line.split(": ") for line in f.read().splitlines())
    return int(kv["wchar"]), int(kv["rchar"])
  except (OSError, KeyError, ValueError):
    return -1, -1


def child(mode: str, rows_per_host: int, tokens: int, iters: int) -> None:
  import numpy as np

  from distflow_jax import distributed
  info = distributed.initialize()
  import jax

  from distflow_jax.data import redistribute as rd
  from distflow_jax.data.layout import Layout, flat_mesh, host_major_mesh
  from distflow_jax.data.plan import make_repartition_plan

  src = Layout(host_major_mesh(), ("host",))
  dst = Layout(flat_mesh("fsdp"), ("fsdp",))
  num_rows = rows_per_host * info.process_count
  rng = np.random.default_rng(info.process_index)
  local = {  # a rollout's per-sample payload: 13 bytes per token
      "tokens": rng.integers(0, 32000, (rows_per_host, tokens), dtype=np.int32),
      "logp": rng.standard_normal((rows_per_host, tokens)).astype(np.float32),
      "adv": rng.standard_normal((rows_per_host, tokens)).astype(np.float32),
      "mask": rng.random((rows_per_host, tokens)) < 0.9,
  }
  batch = {k: jax.make_array_from_process_local_data(src.sharding, v)
           for k, v in local.items()}
  del local
  lengths = np.random.default_rng(0).integers(tokens // 8, tokens, num_rows)
  jax.block_until_ready(batch)
  # Compile once without running, so the peak measured below is data, not
  # compiler memory (a second compile of the same program peaks no higher).
  rd.compiled_text(batch, make_repartition_plan(lengths, src, dst), mode)
  rss_before = _rss_mb()
  times = []
  for i in range(iters + 1):  # the first call compiles
    if i == 1:
      io0 = _io_bytes()
    t0 = time.perf_counter()
    out, _ = rd.redistribute(batch, lengths, src, dst, mode=mode)
    jax.block_until_ready(out)
    if i:
      times.append(time.perf_counter() - t0)
    del out
  io1 = _io_bytes()
  plan = make_repartition_plan(lengths, src, dst)
  sent, recv = plan.traffic(rd.row_bytes(batch), centralized=mode == "centralized")[
      info.process_index]
  bc.emit({
      "process": info.process_index, "procs": info.process_count,
      "devices": info.global_device_count, "mode": mode,
      "time_s": statistics.median(times), "sent": sent, "recv": recv,
      "io_written": (io1[0] - io0[0]) // iters, "io_read": (io1[1] - io0[1]) // iters,
      "rss_before_mb": rss_before, "peak_rss_mb": _rss_mb(),
      "block": plan.block, "rows_per_sender": plan.rows_per_sender})


def main(argv: list[str] | None = None) -> int:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--procs", default="1,2,4,8")
  p.add_argument("--rows-per-host", type=int, default=256)
  p.add_argument("--tokens", type=int, default=2048)
  p.add_argument("--iters", type=int, default=5)
  p.add_argument("--devices-per-process", type=int, default=2)
  p.add_argument("--timeout-s", type=float, default=300)
  p.add_argument("--json", help="also write the results here")
  p.add_argument("--child", choices=["distributed", "centralized"],
                 help=argparse.SUPPRESS)
  args = p.parse_args(argv)
  if args.child:
    from distflow_jax import distributed
    distributed.run_main(lambda: child(args.child, args.rows_per_host, args.tokens,
                                       args.iters))
  from distflow_jax import launcher

  procs = [int(x) for x in args.procs.split(",")]
  row_kb = args.tokens * 13 / 1024
  bc.flush_lines()
  print(f"start: {bc.load_line()}")
  print(f"weak scaling: {args.rows_per_host} samples x {args.tokens} tokens "
        f"({row_kb:.0f} KiB/sample, {args.rows_per_host * row_kb / 1024:.1f} MiB) "
        f"per process, {args.devices_per_process} devices per process; "
        f"per-host replica -> FSDP over all devices")
  table = bc.Table(bc.Col("procs", 5), bc.Col("devs", 4), "|", bc.Col("mode", 11, "<"),
                   bc.Col("ms/op", 8, fmt=".1f"), bc.Col("busiest sent MiB", 16, fmt=".1f"),
                   bc.Col("recv MiB", 9, fmt=".1f"), bc.Col("gloo sent MiB", 13, fmt=".1f"),
                   bc.Col("peak RSS MiB", 12, fmt=".0f"), bc.Col("(+ over start)", 14, fmt="+.0f"),
                   rule=True)
  entries = []
  for n in procs:
    for mode in ("distributed", "centralized"):
      cmd = [sys.executable, os.path.abspath(__file__), "--child", mode,
             "--rows-per-host", str(args.rows_per_host), "--tokens", str(args.tokens),
             "--iters", str(args.iters)]
      res = launcher.launch(n, args.devices_per_process, cmd, timeout_s=args.timeout_s,
                            out=None)
      rows = bc.tagged(sum(res.outputs, []))
      if not res.ok or len(rows) != n:
        tail = "\n".join(sum(res.outputs, [])[-20:])
        table.row(n, "", mode, tail=f"FAILED: {res.describe()}\n{tail}")
        continue
      busiest = max(rows, key=lambda r: (r["sent"] + r["recv"], -r["process"]))
      heaviest = max(rows, key=lambda r: r["peak_rss_mb"])
      entry = {"procs": n, "devices": rows[0]["devices"], "mode": mode,
               "ms_per_op": 1e3 * max(r["time_s"] for r in rows),
               "busiest_sent_mib": busiest["sent"] / 2**20,
               "busiest_recv_mib": busiest["recv"] / 2**20,
               "busiest_process": busiest["process"],
               "busiest_gloo_sent_mib": busiest["io_written"] / 2**20,
               "peak_rss_mib": heaviest["peak_rss_mb"],
               "peak_rss_increase_mib": heaviest["peak_rss_mb"] - heaviest["rss_before_mb"],
               "peak_rss_process": heaviest["process"]}
      entries.append(entry)
      table.row(n, entry["devices"], mode, entry["ms_per_op"], entry["busiest_sent_mib"],
                entry["busiest_recv_mib"], entry["busiest_gloo_sent_mib"],
                entry["peak_rss_mib"], entry["peak_rss_increase_mib"])
  print(f"end: {bc.load_line()}")
  if args.json:
    bc.write_json(args.json, entries, indent=1)
  return 0


if __name__ == "__main__":
  sys.exit(main())
