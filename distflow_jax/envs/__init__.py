"""Environments for multi-turn episodes: the protocol, the registry, tool-call
parsers and the guarded calls that turn an environment's failure into one line.

* ``base``: ``Environment`` (``reset(row) -> str``, ``step(action_text) -> (observation,
  reward, done)``), ``register_env`` / ``env_factory`` (``rollout.env=<name>`` or
  ``module:Class``);
* ``parsers``: ``TOOL_PARSERS``, the table ``rollout.tool_parser`` picks from (``tag``:
  ``<tool>name(args)</tool>``, ``hermes``: Qwen2.5's ``<tool_call>{json}</tool_call>``);
* ``guard``: each environment call run with a deadline (``rollout.env_timeout_s``) and
  its result checked; ``rollout.on_env_error`` says whether a failure ends the episode
  (counted) or stops the run.

The rollout's episode loop (rollout/episodes.py) drives them on the host that generates
the episode; nothing here imports jax.
"""
