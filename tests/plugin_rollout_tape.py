"""Test plugin (config.plugins): ``generate.tape`` records one run's rollouts and replays them
in another, so two layouts can be compared on the same samples (teacher-forced).

DISTFLOW_TEST_TAPE=DIR and DISTFLOW_TEST_TAPE_MODE=record|replay.  Recording runs the
built-in ``generate`` and saves each process's rows per step; replaying looks every row of
this process's prompts up by global sample id, whatever process recorded it.
"""

import dataclasses
import glob
import os

import numpy as np

from distflow_jax.dag.registry import FUNCTIONS
from distflow_jax.data.batch import GROUP_ID, SAMPLE_ID, Batch, expand_groups, to_global, to_local
from distflow_jax.nodes.common import NodeOut
from distflow_jax.nodes.rollout import generate_node
from distflow_jax.state.metrics import Metrics

FIELDS = ("prompt_tokens", "prompt_mask", "response_tokens", "response_mask",
          "rollout_logprobs")
# A vision-language run's samples also carry their image features (train/image_inputs.py).
OPTIONAL = ("image_embeds", "image_slots", "rope_positions")


def _path(ctx, process):
  return os.path.join(os.environ["DISTFLOW_TEST_TAPE"], f"step{ctx.step}_p{process}.npz")


def tape(ctx, node, lay, prompts):
  if os.environ["DISTFLOW_TEST_TAPE_MODE"] == "record":
    out = generate_node(ctx, node, lay, prompts)
    batch = out.batch
    keys = (*FIELDS, *(k for k in OPTIONAL if k in batch.data), SAMPLE_ID, GROUP_ID)
    loc = to_local(Batch({k: batch.data[k] for k in keys}))
    os.makedirs(os.environ["DISTFLOW_TEST_TAPE"], exist_ok=True)
    np.savez(_path(ctx, ctx.process_index), **loc.data)
    return out
  rows = {}
  for f in glob.glob(_path(ctx, "*")):
    with np.load(f) as z:
      for i, sid in enumerate(z[SAMPLE_ID]):
        rows[int(sid)] = {k: z[k][i] for k in (*FIELDS, *OPTIONAL) if k in z.files}
  n = ctx.section(node, "rollout").n
  groups = expand_groups(Batch({SAMPLE_ID: prompts.data[SAMPLE_ID],
                                GROUP_ID: prompts.data[GROUP_ID]}, prompts.host), n)
  picked = [rows[int(s)] for s in groups.data[SAMPLE_ID]]
  local = Batch({**groups.data, **{k: np.stack([r[k] for r in picked]) for k in picked[0]}},
                prompts.host)
  metrics = Metrics()
  metrics.add_mean("response_length", local.data["response_mask"].sum(axis=1))
  return NodeOut(to_global(local, lay), metrics)


FUNCTIONS.register(dataclasses.replace(FUNCTIONS.spec("generate"), name="generate.tape",
                                       doc="test plugin: record / replay rollouts"), tape)
