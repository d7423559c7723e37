"""The batch's fields: every key a node reads or makes, named once, with its shape and doc.

A step's batch (``data/batch.Batch.data``) is a dict of arrays whose leading axis is the
sample.  Its keys are the names below; a node function's ``FunctionSpec`` names the fields
it ``requires`` and ``produces`` from this catalogue, and ``dag/validate.py`` refuses a
spec that names a field the catalogue lacks (with the nearest name), so a wrong key fails
in ``plan``, not in step 3.  ``plan --lower`` builds each field's abstract array from its
``trail`` and ``dtype`` (lowering/abstract.py).  A plugin that makes a field of its own
registers it first: ``fields.register(Field("my_score", (), np.float32, "..."))``.

This module imports no jax: the planner reads it.
"""

from __future__ import annotations

import dataclasses
import difflib

import numpy as np


@dataclasses.dataclass(frozen=True)
class Field:
  """One batch field: ``trail`` the dimensions after the sample axis (``P`` the prompt
  columns, ``N`` the response columns, ``PN`` both, ``I`` / ``D`` image tokens and their
  width, ``3`` the three M-RoPE axes), its dtype and what it holds."""
  name: str
  trail: tuple[str, ...]
  dtype: type
  doc: str


SAMPLE_ID = "sample_id"
GROUP_ID = "group_id"
PROMPT_TOKENS = "prompt_tokens"
PROMPT_MASK = "prompt_mask"
RESPONSE_TOKENS = "response_tokens"
RESPONSE_MASK = "response_mask"
ROLLOUT_LOGPROBS = "rollout_logprobs"
OLD_LOGPROBS = "old_logprobs"
REF_LOGPROBS = "ref_logprobs"
SUM_PI_SQUARED = "sum_pi_squared"
VALUES = "values"
REWARDS = "rewards"
PLACED_REWARDS = "placed_rewards"
ADVANTAGES = "advantages"
RETURNS = "returns"
LOSS_MASK = "loss_mask"
ENV_REWARDS = "env_rewards"
ENV_TURN_REWARDS = "env_turn_rewards"
BASELINE_TOKENS = "baseline_tokens"
BASELINE_MASK = "baseline_mask"
BASELINE_REWARDS = "baseline_rewards"
IMAGE_EMBEDS = "image_embeds"
IMAGE_SLOTS = "image_slots"
ROPE_POSITIONS = "rope_positions"
POLICY_VERSION = "policy_version"

_BUILTIN = (
    Field(SAMPLE_ID, (), np.int32, "the sample's global id (prompt id x rollout.n + j)"),
    Field(GROUP_ID, (), np.int32, "the prompt the sample came from (its group)"),
    Field(PROMPT_TOKENS, ("P",), np.int32, "the prompt, left-padded"),
    Field(PROMPT_MASK, ("P",), np.bool_, "the prompt's real tokens"),
    Field(RESPONSE_TOKENS, ("N",), np.int32, "the response, right-padded"),
    Field(RESPONSE_MASK, ("N",), np.bool_, "the response's real tokens"),
    Field(ROLLOUT_LOGPROBS, ("N",), np.float32,
          "each response token's log-prob under the rollout's policy at its temperature"),
    Field(OLD_LOGPROBS, ("N",), np.float32, "the same under the trainer's policy before "
          "the update (logprob: the rollout's own when on-policy)"),
    Field(REF_LOGPROBS, ("N",), np.float32, "the same under the frozen reference"),
    Field(SUM_PI_SQUARED, ("N",), np.float32,
          "sum over the vocabulary of pi^2 at each response position (logprob.stats)"),
    Field(VALUES, ("N",), np.float32, "the critic's value of each response position"),
    Field(REWARDS, (), np.float32, "the sample's reward; every reward node adds to it"),
    Field(PLACED_REWARDS, ("N",), np.float32,
          "the part of the reward earned at given tokens (multi-turn: per turn)"),
    Field(ADVANTAGES, ("N",), np.float32, "each response token's advantage"),
    Field(RETURNS, ("N",), np.float32, "each response token's return (the critic's target)"),
    Field(LOSS_MASK, ("N",), np.bool_,
          "the generated tokens of a multi-turn episode (observations are not trained on)"),
    Field(ENV_REWARDS, (), np.float32, "the environment's reward of the episode"),
    Field(ENV_TURN_REWARDS, ("N",), np.float32,
          "the environment's reward of each turn, on the turn's last generated token"),
    Field(BASELINE_TOKENS, ("N",), np.int32, "the prompt's greedy response (ReMax)"),
    Field(BASELINE_MASK, ("N",), np.bool_, "its real tokens"),
    Field(BASELINE_REWARDS, (), np.float32, "its reward (the rule rewards score it)"),
    Field(IMAGE_EMBEDS, ("I", "D"), np.float32, "a vision-language prompt's image features"),
    Field(IMAGE_SLOTS, ("P",), np.bool_, "the prompt positions the features fill"),
    Field(ROPE_POSITIONS, ("3", "PN"), np.int32, "M-RoPE's positions of prompt + response"),
    Field(POLICY_VERSION, (), np.int32,
          "asynchronous RL: the policy version that generated the sample"),
)

FIELDS: dict[str, Field] = {f.name: f for f in _BUILTIN}

# The rollout's token fields: every model pass and train step reads them.
SEQ = (PROMPT_TOKENS, PROMPT_MASK, RESPONSE_TOKENS, RESPONSE_MASK)
# A vision-language sample's image fields (train/image_inputs.py).
IMAGES = (IMAGE_EMBEDS, IMAGE_SLOTS, ROPE_POSITIONS)
# What multi-turn episodes add (nodes/rollout.py).
EPISODE = (LOSS_MASK, ENV_REWARDS, ENV_TURN_REWARDS)
# What the response-side reward nodes read.
RESPONSE = (RESPONSE_TOKENS, RESPONSE_MASK)
# Fields several nodes may produce: consumers see their sum.
SUMMED = frozenset({REWARDS})


def register(field: Field) -> str:
  """Adds a plugin's field to the catalogue; a taken name is refused unless it is the same
  field (a plugin imported twice).  Returns the name."""
  if not isinstance(field, Field) or not field.name or not isinstance(field.name, str):
    raise ValueError(f"fields.register takes a Field with a non-empty name, got {field!r}")
  have = FIELDS.get(field.name)
  if have is not None and have != field:
    raise ValueError(f"batch field {field.name!r} is registered already as {have}; pick "
                     f"another name")
  FIELDS[field.name] = field
  return field.name


def unregister(name: str) -> None:
  """Removes a plugin's field (a test's); built-in fields stay."""
  if name in {f.name for f in _BUILTIN}:
    raise ValueError(f"{name!r} is a built-in batch field")
  FIELDS.pop(name, None)


def unknown_message(name: str, where: str) -> str | None:
  """Why ``name`` is not a batch field (None when it is one), for ``where``."""
  if name in FIELDS:
    return None
  close = difflib.get_close_matches(name, list(FIELDS), n=2)
  hint = f"; did you mean {' or '.join(map(repr, close))}?" if close else ""
  if name == "tokens":  # the old name of the rollout's four token fields
    hint = f"; the rollout's tokens are the fields {', '.join(SEQ)} (fields.SEQ)"
  return (f"{where} {name!r}, which is not a batch field{hint} (the fields: "
          f"data/fields.py; a plugin's own field: fields.register(fields.Field(...)))")
