"""Value checks of `plan`: ranges, finiteness, option names, and per-node overrides.

Each bad value is refused with one ConfigError (or DagError) line naming the key,
the value and what is valid, before anything compiles.
"""

import io
import re
from contextlib import redirect_stderr

import pytest

from distflow_jax import cli
from distflow_jax.algos.losses import LossAggMode
from distflow_jax.config import loading
from distflow_jax.config.checks import plan_from_config
from distflow_jax.dag import FUNCTIONS, DagError, Topology
from distflow_jax.models.config import DTYPES
from distflow_jax.train.optim import OPTIMIZERS, SCHEDULES


def plan(overrides=(), name="grpo:tiny", node_config=None):
  cfg = loading.load(name, list(overrides))
  if node_config:
    with cfg.unlocked():
      for node_id, conf in node_config.items():
        next(n for n in cfg.dag if n["id"] == node_id)["config"] = conf
  return plan_from_config(cfg, Topology(1, 8), FUNCTIONS)


def refused(message: str, match: str) -> None:
  assert "\n" not in message
  assert re.search(match, message), message


# ---- item 7: values plan used to accept -----------------------------------------------------

@pytest.mark.parametrize("override, pattern", [
    ("trainer.keep=-2", r"^trainer\.keep=-2 must be >= 0 \(0 = keep every checkpoint\)$"),
    ("trainer.save_every=-1", r"^trainer\.save_every=-1 must be >= 0"),
    ("trainer.eval_every=-1", r"^trainer\.eval_every=-1 must be >= 0 \(0 = no evaluation\)"),
    ("trainer.total_steps=-5", r"^trainer\.total_steps=-5 must be > 0$"),
    ("trainer.total_steps=0", r"^trainer\.total_steps=0 must be > 0$"),
    ("algo.gamma=5", r"^algo\.gamma=5\.0 must be in \[0, 1\]$"),
    ("algo.lam=-1", r"^algo\.lam=-1\.0 must be in \[0, 1\]$"),
    ("algo.lam=nan", r"^algo\.lam=nan must be finite and in \[0, 1\]$"),
    ("actor.optimizer.grad_clip=-1", r"^actor\.optimizer\.grad_clip=-1\.0 must be >= 0 "
                                     r"\(0 = no clipping\)$"),
    ("critic.optimizer.grad_clip=-1", r"^critic\.optimizer\.grad_clip=-1\.0 must be >= 0"),
    ("actor.optimizer.weight_decay=-0.1", r"^actor\.optimizer\.weight_decay=-0\.1 must be >= 0$"),
    ("actor.optimizer.lr=inf", r"^actor\.optimizer\.lr=inf must be finite and in \(0, 1\]"),
    ("actor.optimizer.lr=nan", r"^actor\.optimizer\.lr=nan must be finite and in \(0, 1\]"),
    ("actor.optimizer.lr=1e30", r"^actor\.optimizer\.lr=1e\+30 must be in \(0, 1\] \(a step "
                                r"above 1 diverges with adamw\)$"),
    ("actor.optimizer.lr=0", r"^actor\.optimizer\.lr=0\.0 must be in \(0, 1\]$"),
    ("actor.optimizer.lr=-1e-5", r"^actor\.optimizer\.lr=-1e-05 must be in \(0, 1\]"),
    ("critic.optimizer.lr=inf", r"^critic\.optimizer\.lr=inf must be finite"),
    ("model.warmstart.lr=2", r"^model\.warmstart\.lr=2\.0 must be in \(0, 1\] \(a step above 1 "
                             r"diverges with adamw\)$"),
    ("actor.optimizer.b2=1", r"^actor\.optimizer\.b2=1\.0 must be in \[0, 1\)$"),
    ("actor.optimizer.eps=0", r"^actor\.optimizer\.eps=0\.0 must be > 0$"),
    ("actor.optimizer.warmup_steps=-1", r"^actor\.optimizer\.warmup_steps=-1 must be >= 0$"),
    ("actor.optimizer.name=lion",
     rf"^actor\.optimizer\.name='lion' is not valid; choose one of "
     rf"{re.escape(str(list(OPTIMIZERS)))}$"),
    ("critic.optimizer.schedule=step",
     rf"^critic\.optimizer\.schedule='step' is not valid; choose one of "
     rf"{re.escape(str(list(SCHEDULES)))}$"),
    ("model.dtype=float8",
     rf"^model\.dtype='float8' is not valid; choose one of {re.escape(str(list(DTYPES)))}$"),
    ("actor.loss_agg=mean", rf"^actor\.loss_agg='mean' is not valid; choose one of "
                            rf"{re.escape(str([m.value for m in LossAggMode]))}$"),
    ("data.redistribute=p2p", r"^data\.redistribute='p2p' is not valid; choose one of "
                              r"\['distributed', 'centralized'\]$"),
    ("data.eval_size=0", r"^data\.eval_size=0 must be > 0$"),
    ("rollout.temperature=-1", r"^rollout\.temperature=-1\.0 must be >= 0 \(0 = greedy\)$"),
    ("rollout.temperature=inf", r"^rollout\.temperature=inf must be finite and >= 0"),
    ("actor.kl.coef=-0.1", r"^actor\.kl\.coef=-0\.1 must be >= 0$"),
    ("actor.dual_clip=inf", r"^actor\.dual_clip=inf must be 0 \(off\) or > 1$"),
    ("reward.weight=nan", r"^reward\.weight=nan must be a finite number$"),
])
def test_bad_value_is_refused_naming_key_value_and_valid(override, pattern):
  with pytest.raises(loading.ConfigError) as e:
    plan([override])
  refused(str(e.value), pattern)


def test_option_lists_are_the_code_s_own():
  from distflow_jax.config import validators
  opts = validators.options()
  assert opts["optimizer"] == tuple(OPTIMIZERS)
  assert opts["schedule"] == tuple(SCHEDULES)
  assert opts["dtype"] == tuple(DTYPES)
  assert opts["loss_agg"] == tuple(m.value for m in LossAggMode)


@pytest.mark.parametrize("overrides", [
    (), ["actor.optimizer.name=sgd", "actor.optimizer.schedule=cosine",
         "actor.optimizer.lr=1.0", "algo.gamma=0", "algo.lam=1", "trainer.keep=0",
         "trainer.save_every=0", "trainer.eval_every=0", "model.dtype=bfloat16"],
])
def test_edge_values_are_accepted(overrides):
  plan(overrides)


def test_cli_plan_prints_the_value_error_as_one_line():
  err = io.StringIO()
  with redirect_stderr(err):
    rc = cli.main(["plan", "--config=grpo:tiny", "--config.trainer.keep=-2"])
  assert rc == 2
  assert err.getvalue() == ("distflow-jax plan: error: trainer.keep=-2 must be >= 0 "
                            "(0 = keep every checkpoint)\n")


# ---- item 5: each node's effective config --------------------------------------------------

@pytest.mark.parametrize("node, conf, pattern", [
    ("generate", dict(top_p=2), r"^DAG node 'generate' \(config=\{'top_p': 2\}\): "
                                r"rollout\.top_p=2\.0 must be in \(0, 1\]$"),
    ("generate", dict(temperature=-1), r"^DAG node 'generate' .*: rollout\.temperature=-1\.0 "
                                       r"must be >= 0"),
    ("generate", dict(n=0), r"^DAG node 'generate' .*: rollout\.n=0 must be > 0$"),
    ("generate", dict(n=2), r"^DAG node 'generate' .*: rollout\.n=2 differs from the global "
                            r"rollout\.n=8"),
    ("generate", dict(max_new_tokens=60), r"^DAG node 'generate' .*: data\.max_prompt_len \+ "
                                          r"rollout\.max_new_tokens = 92 exceeds"),
    ("generate", dict(prefill_buckets=(16, 8)), r"^DAG node 'generate' .*: "
                                                r"rollout\.prefill_buckets=\[16, 8\] must be"),
    ("train_actor", dict(micro_batch_size=7), r"actor\.micro_batch_size=7 does not divide the "
                                              r"16 samples .* of node 'train_actor'"),
    ("train_actor", dict(micro_batch_size=0), r"^DAG node 'train_actor' .*: "
                                              r"actor\.micro_batch_size=0 must be > 0$"),
    ("train_actor", dict(loss_agg="mean"), r"^DAG node 'train_actor' .*: actor\.loss_agg="
                                           r"'mean' is not valid; choose one of \['token-mean'"),
    ("train_actor", dict(kl=dict(estimator="k9")), r"^DAG node 'train_actor' .*: "
                                                   r"actor\.kl\.estimator='k9' is not valid"),
    ("train_actor", dict(optimizer=dict(lr=float("inf"))),
     r"^DAG node 'train_actor' .*: actor\.optimizer\.lr=inf must be finite"),
    ("advantage", dict(gamma=5), r"^DAG node 'advantage' .*: algo\.gamma=5\.0 must be in "
                                 r"\[0, 1\]$"),
    ("reward", dict(weight=float("nan")), r"^DAG node 'reward' .*: reward\.weight=nan must "
                                          r"be a finite number$"),
])
def test_node_override_value_is_checked(node, conf, pattern):
  with pytest.raises(loading.ConfigError) as e:
    plan(node_config={node: conf})
  refused(str(e.value), pattern)


@pytest.mark.parametrize("node, conf, pattern", [
    ("train_actor", dict(loss_agg=5), r"^DAG node 'train_actor': config override 'loss_agg': "
                                      r"5 has the wrong type for config\.actor\.loss_agg"),
    ("generate", dict(n=2.5), r"^DAG node 'generate': config overrides \{'n': 2\.5\} do not "
                              r"apply to config\.rollout: .*cannot be casted"),
    ("train_actor", dict(kl=dict(cof=1.0)), r"^DAG node 'train_actor': config overrides .* do "
                                            r"not apply to config\.actor"),
])
def test_node_override_of_the_wrong_type_is_refused(node, conf, pattern):
  with pytest.raises(DagError) as e:
    plan(node_config={node: conf})
  refused(str(e.value), pattern)


def test_good_node_overrides_pass():
  plan(name="reinforce_pp_two_rewards")  # reward_format: config=dict(weight=0.2)
  plan(node_config={"generate": dict(top_p=0.9, temperature=0.7, n=8),
                    "train_actor": dict(micro_batch_size=8, kl=dict(coef=0.1))})
