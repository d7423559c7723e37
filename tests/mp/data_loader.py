"""Child program: per-process loader shards across real processes; groups stay on host."""

import sys

import numpy as np

from distflow_jax import distributed

info = distributed.initialize()

import jax  # noqa: E402  (after initialize)
from jax.experimental import multihost_utils  # noqa: E402

from distflow_jax.data.batch import expand_groups, to_global  # noqa: E402
from distflow_jax.data.layout import Layout, host_major_mesh  # noqa: E402
from distflow_jax.data.loader import PromptLoader  # noqa: E402


class CharTokenizer:
  def encode(self, text):
    return [ord(c) + 1 for c in text]


path, num_records = sys.argv[1], int(sys.argv[2])
batch_size = 2
loader = PromptLoader(path, CharTokenizer(), batch_size=batch_size, max_prompt_len=16,
                      seed=11)  # shards by jax.process_index()/process_count()
assert (loader.process_index, loader.process_count) == (info.process_index,
                                                        info.process_count)
steps = loader.steps_per_epoch()
records = []
batches = []
for _ in range(steps):
  b = next(loader)
  batches.append(b)
  records.extend(b.host[int(s)]["record"] for s in b.data["sample_id"])
state = loader.get_state()

# Across processes: one epoch's shards are disjoint and cover the dataset.
every = np.asarray(multihost_utils.process_allgather(np.array(records, np.int32)))
flat = every.reshape(-1).tolist()
assert len(flat) == len(set(flat)) == num_records, sorted(flat)

# Restoring the saved state reproduces the next batches exactly.
want = [next(loader) for _ in range(3)]
again = PromptLoader(path, CharTokenizer(), batch_size=batch_size, max_prompt_len=16,
                     seed=11)
again.set_state(state)
for w in want:
  g = next(again)
  for k in w.data:
    np.testing.assert_array_equal(w.data[k], g.data[k])
  assert w.host == g.host

# GRPO: n samples per prompt, generated where the prompt was loaded.  Placed
# per host, every device holds only groups whose host fields are local.
grouped = expand_groups(batches[0], 4)
glob = to_global(grouped, Layout(host_major_mesh(), ("host",)))
for s in glob.data["group_id"].addressable_shards:
  assert set(np.asarray(s.data).tolist()) <= set(grouped.host), "group left its host"
print(f"OK process {info.process_index}/{info.process_count} records={len(records)}")
