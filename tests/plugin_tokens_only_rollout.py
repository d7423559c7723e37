"""A user plugin (loaded through config.plugins): a rollout that records its tokens but not
their log-probs (as an external sampler might), ``generate.tokens_only``."""

import dataclasses

from distflow_jax.dag.registry import FUNCTIONS
from distflow_jax.nodes.rollout import generate_node


def tokens_only(ctx, node, lay, prompts):
  out = generate_node(ctx, node, lay, prompts)
  batch = out.batch
  return dataclasses.replace(out, batch=type(batch)(
      {k: v for k, v in batch.data.items() if k != "rollout_logprobs"}, batch.host))


FUNCTIONS.register(dataclasses.replace(FUNCTIONS.spec("generate"), name="generate.tokens_only",
                                       produces=frozenset({"prompt_tokens", "prompt_mask",
                                                           "response_tokens", "response_mask"}),
                                       doc="test plugin: a rollout without log-probs"),
                   tokens_only)
