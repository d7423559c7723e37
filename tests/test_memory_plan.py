"""``distflow-jax plan --memory`` (issue 15.2): its figures are the compiled steps' own,
the analytic model stays within a stated tolerance of them, a folder holding only
config.json is enough, and a too-small --device_memory is refused in one line.  Issue 31
item 3: the fit is against what jax can use of the device (a GPU's allocator fraction
less a reserve; TPU, CPU), the weight sync's transient is counted (the synced weights
once, its buffers, the per-layer copy), and advice never names a value already set.

Each check runs in a subprocess: the simulated device count must be set before jax
is imported.
"""

import json
import re
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
# The same with 8 experts of 64, top 2 (Qwen3-MoE): experts, router and dispatch buffers.
SMALL_MOE = dict(SMALL, architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe",
                 num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64,
                 norm_topk_prob=True)
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
    from distflow_jax.state import roles

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
    from distflow_jax.state.context import shared_prompt_group
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


@pytest.mark.parametrize("mesh,shape", [("fsdp", "dense"), ("data", "dense"), ("fsdp", "moe")])
def test_figures_are_the_compiled_steps_and_analytic_is_close(config_only, tmp_path, mesh,
                                                              shape):
  script = tmp_path / "probe.py"
  script.write_text(SCRIPT)
  if shape == "moe":
    with open(os.path.join(config_only, "config.json"), "w") as f:
      json.dump(SMALL_MOE, f)
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
  assert "fits 80.00 GB (58.93 GB usable): yes" in ok.stdout, ok.stdout
  assert "biggest consumers:" in ok.stdout
  small = _run(base + ["--memory_source=analytic", "--device_memory=1MB", "--target=cpu"])
  assert small.returncode == 2
  lines = small.stderr.strip().splitlines()
  assert len(lines) == 1, small.stderr
  assert "--device_memory=1MB (cpu: 1.0 MB usable)" in lines[0], lines[0]
  assert "biggest consumer is" in lines[0]
  for extra, words in ((["--device_memory=lots"], "--device_memory='lots'"),
                       (["--device_memory=80GB", "--target=h900"], "unknown target 'h900'"),
                       (["--target=h100"], "add --device_memory")):
    bad = _run(base + ["--memory_source=analytic", *extra])
    assert bad.returncode == 2 and words in bad.stderr, (extra, bad.stderr)
    assert len(bad.stderr.strip().splitlines()) == 1, bad.stderr


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


def _lines(text: str, start: str) -> list[str]:
  return [line for line in text.splitlines() if line.strip().startswith(start)]


# Issue 31's case: Qwen2.5-72B on 8 x 8, remat=full, rollout.tensor_parallel=8.
QWEN72 = [sys.executable, "-m", "distflow_jax.cli", "plan", "--memory",
          "--memory_source=analytic", "--config=configs/grpo.py:qwen0.5b",
          "--config.model.path=tools/model_shapes/qwen2.5-72b",
          "--config.actor.micro_batch_size=2", "--num_processes=8", "--devices_per_process=8",
          "--config.model.remat=full", "--config.rollout.tensor_parallel=8",
          "--device_memory=80GB"]


@pytest.mark.timeout(120)
def test_72b_plan_counts_the_sync_and_the_gpu_budget():
  r = _run(QWEN72, timeout=100)
  assert r.returncode == 0, r.stderr
  out = r.stdout
  # The synced weights count once, in both phases of the rollout node; the sync's own
  # transient (its largest step's buffers, the per-layer copy of stacked weights) beside.
  weights = _lines(out, "generate       rollout weights")
  assert len(weights) == 1 and "18.18 GB" in weights[0], weights
  assert "while generate / generate/weight_sync runs" in weights[0]
  assert "weight sync buffers" in out and "weight sync input: per-layer copy" in out
  assert "straight into the rollout layout" in out and "all-gather" not in out
  # What jax can use of an 80 GB GPU: 0.75 of it less the 1 GiB reserve.
  assert "usable by jax 58.93 GB = 80.00 GB x 0.75 - 1.07 GB reserve" in out, out
  peak = float(_lines(out, "peak:")[0].split()[1])
  assert 40 < peak < 58.93
  assert "fits 80.00 GB (58.93 GB usable): yes" in out
  # tensor_parallel is already the host's 8 devices: no advice to raise it.
  assert "raise rollout.tensor_parallel" not in out
  assert "rollout.tensor_parallel is already every device of a host" in out
  # A smaller share for jax (XLA_CLIENT_MEM_FRACTION=.5) does not fit: one line.
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=REPO, XLA_CLIENT_MEM_FRACTION=".5")
  env.pop("XLA_FLAGS", None)
  half = subprocess.run(QWEN72, cwd=REPO, env=env, capture_output=True, text=True, timeout=100)
  assert half.returncode == 2
  line = half.stderr.strip()
  assert "\n" not in line and "--device_memory=80GB (h100: 38.93 GB usable)" in line, line
  assert "while generate runs" in line


def test_budget_reads_the_environment_as_jax_does():
  from distflow_jax.config.loading import ConfigError
  from distflow_jax.memory import report
  gb = 80 * 10**9
  b = report.budget(gb, None, {})
  assert (b.platform, b.fraction, b.reserve) == ("gpu", 0.75, 1 << 30)
  assert b.usable == int(0.75 * gb) - (1 << 30)
  assert report.budget(gb, "a100", {"XLA_CLIENT_MEM_FRACTION": ".9"}).fraction == 0.9
  old = report.budget(gb, "h100", {"XLA_PYTHON_CLIENT_MEM_FRACTION": "0.8"})
  assert old.fraction == 0.8 and "XLA_PYTHON_CLIENT_MEM_FRACTION=0.8" in old.why[0]
  lazy = report.budget(gb, "h100", {"XLA_PYTHON_CLIENT_PREALLOCATE": "false"})
  assert lazy.fraction == 0.75 and any("capped" in w for w in lazy.why)
  assert report.budget(gb, "h100", {"XLA_PYTHON_CLIENT_ALLOCATOR": "platform"}).fraction == 1
  tight = report.budget(gb, "h100", {"XLA_CLIENT_MEM_FRACTION": ".99"})
  assert any("out-of-memory at start-up" in w for w in tight.why)
  tpu = report.budget(32 * 2**30, "tpu", {"XLA_CLIENT_MEM_FRACTION": ".5"})
  assert (tpu.fraction, tpu.reserve) == (1.0, 1 << 29)  # no allocator fraction on TPU
  cpu = report.budget(gb, "cpu", {})
  assert cpu.usable == gb
  for env, words in (({"XLA_CLIENT_MEM_FRACTION": "x"}, "not a fraction"),
                     ({"XLA_CLIENT_MEM_FRACTION": "1.5"}, "not a fraction"),
                     ({"XLA_CLIENT_MEM_FRACTION": ".5",
                       "XLA_PYTHON_CLIENT_MEM_FRACTION": ".5"}, "both set")):
    with pytest.raises(ConfigError, match=words):
      report.budget(gb, None, env)
  with pytest.raises(ConfigError, match="unknown target"):
    report.budget(gb, "gpu9000", {})


SYNC = textwrap.dedent("""
    import json, sys
    from distflow_jax import distributed
    distributed.simulate_cpu_devices(8)
    from absl import flags
    from distflow_jax.config import checks, loading
    from distflow_jax.dag import FUNCTIONS
    from distflow_jax.memory import analytic as an, report
    fv = flags.FlagValues()
    loading.parse(fv, sys.argv[1:])
    cfg = fv.config
    plan = checks.plan_from_config(cfg, checks.topology(cfg, 2, 4), FUNCTIONS)
    shape = report.model_shape(cfg)
    out = {}
    for source in ("compiled", "analytic"):
      est = report.estimate(cfg, plan, shape, source)
      out[source] = {i.what.split(" (")[0]: [i.nbytes, list(i.phases)] for i in est.items
                     if i.where == "generate"}
      out[source + "/traffic"] = est.traffic[0]
      out[source + "/worst"] = est.worst(8)
    out["whole"] = an.param_bytes(shape)
    print("RESULT " + json.dumps(out))
""")


@pytest.mark.timeout(300)
def test_sync_transient_compiled_and_analytic(config_only, tmp_path):
  """2 processes x 4 devices, tensor_parallel 2: the compiled sync (rollout/weight_sync.py's
  own steps) gives each device its rollout shard, half the model, and buffers of one
  step, not a whole-model gather; the analytic figures agree on the shard."""
  script = tmp_path / "sync.py"
  script.write_text(SYNC)
  r = _run([sys.executable, str(script), *COMMON, f"--config.model.path={config_only}",
            "--config.rollout.tensor_parallel=2"])
  assert r.returncode == 0, r.stderr[-3000:]
  out = json.loads(r.stdout.split("RESULT ", 1)[1])
  whole = out["whole"]
  for source in ("compiled", "analytic"):
    gen = out[source]
    weights, phases = gen["rollout weights"]
    assert weights == pytest.approx(whole / 2, rel=EXACT_TOLERANCE), source
    assert phases == ["generate", "generate/weight_sync"]
    buffers, phases = gen["weight sync buffers"]
    assert phases == ["generate/weight_sync"] and 0 < buffers < whole / 2, (source, buffers)
    assert "weight sync fallback" not in gen
    assert "each device receives at most its" in out[source + "/traffic"]
  # The analytic buffers (SYNC_TEMP x the largest step's shard, calibrated on 72B and 7B
  # shapes, where XLA:CPU keeps 1.7-2.0x) bound this tiny model's compiled ones.
  assert out["compiled"]["weight sync buffers"][0] <= out["analytic"]["weight sync buffers"][0]


def test_a_cpu_engine_of_a_16_bit_model_is_counted_in_float32(config_only):
  """rollout.cpu_compute=float32 (the default): on a CPU target the engine holds a bfloat16
  model's weights and KV cache in float32, twice a GPU's bytes; =model keeps them 16-bit."""
  base = [sys.executable, "-m", "distflow_jax.cli", "plan", *COMMON,
          f"--config.model.path={config_only}", "--config.model.dtype=bfloat16",
          "--memory", "--memory_source=analytic", "--device_memory=80GB"]

  def rollout_bytes(*extra):
    r = _run(base + list(extra))
    assert r.returncode == 0, r.stderr[-2000:]
    unit = {"B": 1, "kB": 1e3, "MB": 1e6, "GB": 1e9}
    rows = [re.match(r"^  generate\s+(.+?)\s{2,}([\d.]+) (GB|MB|kB|B)\s", l)
            for l in r.stdout.splitlines()]
    got = {m[1]: float(m[2]) * unit[m[3]] for m in rows
           if m and ("rollout weights" in m[1] or "KV cache (" in m[1])}
    assert len(got) == 2, r.stdout
    return got, r.stdout
  gpu, _ = rollout_bytes("--target=h100")
  cpu, out = rollout_bytes("--target=cpu")
  kept, _ = rollout_bytes("--target=cpu", "--config.rollout.cpu_compute=model")
  assert "holds the bfloat16 model's weights and KV cache in float32" in out
  for key in gpu:
    assert cpu[key] == pytest.approx(2 * gpu[key], rel=0.1), (key, gpu, cpu)  # 0.1 MB shown
    assert kept[key] == pytest.approx(gpu[key], rel=0.1), key
