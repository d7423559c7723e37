"""The actor loss's settings for tests that build a train step by hand: the declared config's
(``defaults.base().actor``, so no default is restated here) with the test's changes."""

import dataclasses

from distflow_jax.config import defaults
from distflow_jax.train import steps


def actor_loss_settings(**changes) -> steps.ActorLoss:
  return dataclasses.replace(steps.ActorLoss.from_config(defaults.base().actor), **changes)
