"""``model.lora``'s value checks (the ones that need no model; its fit to the model's shape is
``models.lora.check``, run where the model's config is built: ``state.roles.levers``).

Each failure is one ``ConfigError`` line naming the key.  Imported when a check runs, so
importing it does not import jax.
"""

from __future__ import annotations

import math

from distflow_jax.config.errors import ConfigError


CRITIC = ("", "full")  # model.lora.critic


def check(cfg) -> None:
  lo = cfg.model.lora
  if not isinstance(lo.enabled, bool):
    raise ConfigError(f"model.lora.enabled={lo.enabled!r} must be true or false")
  if not lo.enabled:
    if lo.path:
      raise ConfigError(f"model.lora.path={lo.path!r} is set but model.lora.enabled=False; "
                        f"add --config.model.lora.enabled=True or clear the path")
    return
  if not isinstance(lo.base_check, bool):
    raise ConfigError(f"model.lora.base_check={lo.base_check!r} must be true or false")
  from distflow_jax.models.lora_layer import INITS  # noqa: PLC0415 (jax-free module)
  if isinstance(lo.rank, bool) or not isinstance(lo.rank, int) or lo.rank <= 0:
    raise ConfigError(f"model.lora.rank={lo.rank!r} must be a whole number > 0 (or set "
                      f"model.lora.enabled=False)")
  if (isinstance(lo.alpha, bool) or not isinstance(lo.alpha, (int, float))
      or not math.isfinite(lo.alpha) or lo.alpha <= 0):
    raise ConfigError(f"model.lora.alpha={lo.alpha!r} must be a finite number > 0 (the "
                      f"update is scaled by alpha / rank; 2 x rank is usual)")
  if (isinstance(lo.dropout, bool) or not isinstance(lo.dropout, (int, float))
      or not 0.0 <= lo.dropout < 1.0):
    raise ConfigError(f"model.lora.dropout={lo.dropout!r} must be in [0, 1)")
  if lo.critic not in CRITIC:
    raise ConfigError(f"model.lora.critic={lo.critic!r} is not valid; choose one of "
                      f"{list(CRITIC)} ('' refuses a critic, 'full' trains it whole)")
  if lo.init not in INITS:
    raise ConfigError(f"model.lora.init={lo.init!r} is not valid; choose one of {list(INITS)}")
  targets = lo.targets
  if (isinstance(targets, str) or not isinstance(targets, (tuple, list)) or not targets
      or not all(isinstance(t, str) and t for t in targets)):
    raise ConfigError(f"model.lora.targets={targets!r} must be a non-empty tuple of module "
                      f"name patterns, e.g. ('q_proj', 'v_proj')")
  rollout = cfg.rollout
  fuse = rollout.fuse_projections
  if rollout.lora_sync == "adapters" and fuse != "none":
    raise ConfigError(f"rollout.fuse_projections={fuse!r} cannot go with "
                      "rollout.lora_sync='adapters' (that route merges the adapters into the "
                      "engine's kernels by name, unfused); set rollout.fuse_projections=none "
                      "or rollout.lora_sync=merged")
  if any(n.get("fn") == "ref_logprob" for n in cfg.dag or ()) and (
      cfg.placement.reference.to_dict() != cfg.placement.actor.to_dict()):
    raise ConfigError("model.lora: the reference pass runs on the actor's own weights with "
                      "the adapters off, so placement.reference must equal placement.actor "
                      f"({cfg.placement.actor.to_dict()})")


def check_critic(cfg, trains_critic: bool) -> None:
  """A LoRA run whose DAG trains a critic: the critic gets no adapters, so it is trained
  whole only where ``model.lora.critic=full`` says so (else one line)."""
  lo = cfg.model.lora
  if lo.enabled and trains_critic and lo.critic != "full":
    raise ConfigError("model.lora.enabled=True trains adapters for the actor only, and this "
                      "DAG trains a critic (train.critic), which has none; set "
                      "model.lora.critic=full to train the critic's whole weights (they count "
                      "in plan --memory) or use a critic-free algorithm (grpo, rloo, ...)")
