"""Child program: one cross-process copy, then a long program on the sender's device.

  python tests/mp/transfer_ack.py OUT MODE      (MODE: ack | noack)

Process 0 copies an array from its device to process 1's (``transfer.copy``), then (with
``ack``) waits for process 1's acknowledgement (``transfer.await_acks``), then runs a long
program on the device it sent from.  Process 1 receives the copy, sleeps 1 s and
acknowledges.  Each writes OUT.<process> with the wall-clock times it saw: process 0 when
it dispatched the long program and when that ended, process 1 when the copy arrived and
when it acknowledged.  (The test reads the order: with ``ack`` the long program starts
only after the acknowledgement; ``noack`` shows what a sender's copy does without it.)
"""

import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

from distflow_jax import distributed  # noqa: E402

N = 1 << 20


def main() -> int:
  out, mode = sys.argv[1:]
  info = distributed.initialize()
  import jax
  import jax.numpy as jnp
  import numpy as np
  from jax.sharding import Mesh, NamedSharding, PartitionSpec

  from distflow_jax.run import transfer
  devs = sorted(jax.devices(), key=lambda d: d.id)
  src = NamedSharding(Mesh(np.array([devs[0]]), ("x",)), PartitionSpec())
  dst = transfer.mirror(src, [devs[1]])
  seen = {}
  if info.process_index == 0:
    x = jax.device_put(jnp.arange(N, dtype=jnp.float32), src)
    long = jax.jit(lambda a: jax.lax.fori_loop(0, 400, lambda i, v: jnp.sin(v) + 1.0, a))
    long.lower(x).compile()
    snap = jax.jit(lambda a: a.copy())(x)
    transfer.copy(snap, dst)
    if mode == "ack":
      transfer.await_acks("t", transfer.Kind.WEIGHTS, 0, [1])
    seen["dispatch"] = time.time()
    jax.block_until_ready(long(x))
    seen["end"] = time.time()
  else:
    got = transfer.copy(transfer.placeholder((N,), np.float32, src), dst)
    seen["got"] = time.time()
    assert np.array_equal(np.asarray(got.addressable_shards[0].data),
                          np.arange(N, dtype=np.float32))
    time.sleep(1.0)
    seen["ack"] = time.time()
    if mode == "ack":
      transfer.acknowledge("t", transfer.Kind.WEIGHTS, 0, [0])
  with open(f"{out}.{info.process_index}", "w") as f:
    json.dump(seen, f)
  return 0


if __name__ == "__main__":
  distributed.run_main(main)
