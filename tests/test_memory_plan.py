"""``distflow-jax plan --memory`` (issue 15.2): its figures are the compiled steps' own,
the analytic model stays within a stated tolerance of them, a folder holding only
config.json is enough, and a too-small --device_memory is refused in one line.

Each check runs in a subprocess: the simulated device count must be set before jax
is imported.
"""

import json
import os
import subprocess
import sys
import textwrap

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The analytic model against the compiled figure on small sizes: parameters, optimizer
# state and KV cache are exact shape arithmetic (norms and biases aside); activations are
# a per-token model of what XLA keeps, stated within a factor of ACT_TOLERANCE on a
# data-parallel mesh.
EXACT_TOLERANCE = 0.03
ACT_TOLERANCE = 2.0

# A two-layer Qwen2 shape: compiles in seconds.
SMALL = dict(architectures=["Qwen2ForCausalLM"], model_type="qwen2", vocab_size=256,
             hidden_size=128, intermediate_size=256, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, head_dim=32, rope_theta=1e4,
             tie_word_embeddings=True, max_position_embeddings=128, torch_dtype="float32")
COMMON = ["--config=configs/grpo.py:tiny", "--config.model.warmstart.steps=0",
          "--config.data.prompts_per_step=8", "--config.actor.micro_batch_size=4",
          "--config.rollout.max_concurrent_decodes=16"]


@pytest.fixture
def config_only(tmp_path):
  """A model folder holding only config.json: no weights, no tokenizer."""
  d = tmp_path / "model"
  d.mkdir()
  (d / "config.json").write_text(json.dumps(SMALL))
  return str(d)


def _run(args, timeout=150):
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=REPO)
  env.pop("XLA_FLAGS", None)
  return subprocess.run(args, cwd=REPO, env=env, capture_output=True, text=True,
                        timeout=timeout)


SCRIPT = textwrap.dedent("""
    import json, sys
    from distflow_jax import distributed
    distributed.simulate_cpu_devices(8)
    import jax
    from absl import flags
    from distflow_jax.config import checks, loading
    from distflow_jax.dag import FUNCTIONS
    from distflow_jax.memory import report
    from distflow_jax.nodes.training import _actor_loss
    from distflow_jax.train import steps as steps_lib
    from distflow_jax.workflow import roles

    fv = flags.FlagValues()
    loading.parse(fv, sys.argv[1:])
    cfg = fv.config
    plan = checks.plan_from_config(cfg, checks.topology(cfg, 1, 8), FUNCTIONS)
    shape = report.model_shape(cfg)
    out, notes = {}, []
    for source in ("compiled", "analytic"):
      est = report.estimate(cfg, plan, shape, source)
      out[source] = {f"{i.where}/{i.what.split(' (')[0]}": i.nbytes for i in est.items}
      notes += est.notes
    # The same step on real (tiny) arrays from the run's own path (roles.build_roles), jitted
    # as PinnedStep jits it: its memory_analysis must be what plan --memory reports.
    state = roles.build_roles(cfg, plan, shape, "", roles.Tokenizer.builtin())[
        roles.Role.ACTOR]
    samples = cfg.data.prompts_per_step * cfg.rollout.n
    dp = plan.step("train_actor").layout.dp_size
    minis = cfg.actor.mini_batches
    micro = max(samples // dp // minis // cfg.actor.micro_batch_size, 1)
    from distflow_jax.workflow.context import shared_prompt_group
    gs = shared_prompt_group(cfg, samples, dp * minis * micro)
    loss_cfg = steps_lib.ActorLoss.from_config(cfg.actor, cfg.rollout.max_new_tokens, gs)
    import functools
    step = steps_lib.make_train_step(functools.partial(_actor_loss, cfg=loss_cfg),
                                     state.graphdef, state.tx, micro, loss_cfg.loss_agg, gs)
    note = [n for n in notes if n.startswith("train step")][0]
    from jax.sharding import NamedSharding, PartitionSpec as P
    from distflow_jax.memory import compiled as cp
    from distflow_jax.models import sharding
    lmesh = sharding.make_mesh({"data": dp, "tensor": 8 // dp}, roles.ordered_devices())
    batch = cp.abstract_batch(samples // minis, report._prompt_len(cfg),
                              cfg.rollout.max_new_tokens, NamedSharding(lmesh, P("data")),
                              ("old_logprobs", "advantages", "ref_logprobs"))
    jitted = step.jitted_for(state.params, state.opt_state)  # what the train node calls
    m = jitted.lower(state.params, state.opt_state, batch).compile().memory_analysis()
    out["real"] = dict(argument=m.argument_size_in_bytes, temp=m.temp_size_in_bytes,
                       output=m.output_size_in_bytes, alias=m.alias_size_in_bytes,
                       note=note)
    print("RESULT " + json.dumps(out))
""")


@pytest.mark.parametrize("mesh", ["fsdp", "data"])
def test_figures_are_the_compiled_steps_and_analytic_is_close(config_only, tmp_path, mesh):
  script = tmp_path / "probe.py"
  script.write_text(SCRIPT)
  args = [sys.executable, str(script), *COMMON, f"--config.model.path={config_only}"]
  if mesh == "data":
    args += ["--config.placement.actor.mesh={'data': 8}",
             "--config.placement.reference.mesh={'data': 8}"]
  r = _run(args)
  assert r.returncode == 0, r.stderr[-3000:]
  out = json.loads(r.stdout.split("RESULT ", 1)[1])
  comp, ana, real = out["compiled"], out["analytic"], out["real"]
  # plan --memory's train-step figures are memory_analysis() of the run's own jitted step.
  for key in ("argument", "temp", "output", "alias"):
    assert f"{key} " in real["note"]
  grads, act = comp["train_actor/gradients"], comp["train_actor/activations"]
  assert grads + act == pytest.approx(real["temp"], rel=1e-9)
  params, opt = comp["actor/parameters"], comp["actor/optimizer state"]
  assert params + opt + comp["train_actor/batch"] == pytest.approx(real["argument"], rel=1e-9)
  for key in ("actor/parameters", "actor/optimizer state", "reference/parameters",
              "generate/rollout weights", "generate/KV cache"):
    assert ana[key] == pytest.approx(comp[key], rel=EXACT_TOLERANCE), key
  # Activations sharded over the batch, as the analytic model assumes, on both meshes: on
  # the fsdp mesh XLA kept every row's activations on every device until the step split
  # them over data and fsdp itself (sharding.rows_sharded).
  for key in ("train_actor/activations", "old_logprob/activations"):
    ratio = ana[key] / comp[key]
    assert 1 / ACT_TOLERANCE <= ratio <= ACT_TOLERANCE, (key, ratio)


def test_cli_refuses_small_device_and_needs_only_config_json(config_only):
  base = [sys.executable, "-m", "distflow_jax.cli", "plan", *COMMON,
          f"--config.model.path={config_only}", "--num_processes=1",
          "--devices_per_process=8", "--memory"]
  ok = _run(base + ["--memory_source=analytic", "--device_memory=80GB"])
  assert ok.returncode == 0, ok.stderr
  assert "fits 80.00 GB: yes" in ok.stdout and "biggest consumers:" in ok.stdout
  small = _run(base + ["--memory_source=analytic", "--device_memory=1MB"])
  assert small.returncode == 2
  lines = small.stderr.strip().splitlines()
  assert len(lines) == 1, small.stderr
  assert "--device_memory=1MB" in lines[0] and "biggest consumer is" in lines[0]
  bad = _run(base + ["--memory_source=analytic", "--device_memory=lots"])
  assert bad.returncode == 2 and "--device_memory='lots'" in bad.stderr


def test_repartition_traffic_comes_from_the_data_plane_plan():
  r = _run([sys.executable, "-m", "distflow_jax.cli", "plan", *COMMON, "--num_processes=2",
            "--devices_per_process=4", "--config.placement.actor.mesh={'data': 2, 'fsdp': 4}",
            "--config.rollout.tensor_parallel=2", "--memory", "--memory_source=analytic"])
  assert r.returncode == 0, r.stderr
  assert "re-partitions per step: 1 (distributed" in r.stdout
  line = next(l for l in r.stdout.splitlines() if l.strip().startswith("into "))
  assert "process 0 sends" in line and "process 1 receives" not in line.split(",")[0]


PACKED = textwrap.dedent("""
    import json, sys
    from distflow_jax import distributed
    distributed.simulate_cpu_devices(8)
    from absl import flags
    from distflow_jax.config import checks, loading
    from distflow_jax.dag import FUNCTIONS
    from distflow_jax.memory import report
    out = {}
    for budget in (0, 96, 192):
      fv = flags.FlagValues()
      extra = ["--config.model.pack_sequences=True", "--config.model.pack_len=96",
               f"--config.actor.micro_batch_tokens={budget}"] if budget else []
      loading.parse(fv, sys.argv[1:] + extra)
      cfg = fv.config
      plan = checks.plan_from_config(cfg, checks.topology(cfg, 1, 8), FUNCTIONS)
      est = report.estimate(cfg, plan, report.model_shape(cfg), "analytic")
      act = [i for i in est.items if i.where == "train_actor" and i.what.startswith("activ")]
      out[budget] = [act[0].what, act[0].nbytes, est.notes]
    print("RESULT " + json.dumps(out))
""")


def test_packed_token_budget_train_step_is_sized_by_its_rows(config_only, tmp_path):
  # Issue 19: with model.pack_sequences and actor.micro_batch_tokens the train step's
  # micro-batch is ceil(budget / pack_len) packed rows, not micro_batch_size padded rows.
  script = tmp_path / "packed.py"
  script.write_text(PACKED)
  r = _run([sys.executable, str(script), *COMMON, f"--config.model.path={config_only}"])
  assert r.returncode == 0, r.stderr[-3000:]
  out = json.loads(r.stdout.split("RESULT ", 1)[1])
  padded, one, two = out["0"], out["96"], out["192"]
  assert "1 packed row(s) of 96" in one[0] and "2 packed row(s) of 96" in two[0]
  assert one[1] < two[1] < 2.2 * one[1]     # linear in the rows (plus one logits chunk)
  assert one[1] < padded[1]                 # 96 tokens against 4 padded rows of 32 + 32
  assert any("pack_sequences: analytic" in n for n in one[2])
