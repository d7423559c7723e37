"""``plan --lower`` (issue 31 item 1): every program of every shipped config lowers for an
emulated H100 on this CPU, and the gate's catalogue is what a real run compiles.

In-process checks run on the suite's 8 simulated CPU devices; a plan uses the first
``processes x devices`` of them.  jax's own cuDNN checks are the judge (models/target.py).
"""

import json
import os
import subprocess
import sys
from collections import Counter

import jax
import pytest
from absl import flags

from distflow_jax.config import checks, loading
from distflow_jax.dag import FUNCTIONS
from distflow_jax.lowering import abstract, catalogue, gate
from distflow_jax.memory import report
from distflow_jax.models import target as target_lib
from conftest import suite_flags

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHAPES = os.path.join(REPO, "tools", "model_shapes")
H100 = target_lib.TARGETS["h100"]


def _plan(spec: str, overrides=(), processes=1, devices=2):
  fv = flags.FlagValues()
  loading.parse(fv, [f"--config={spec}", *[f"--config.{o}" for o in overrides]])
  cfg = fv.config
  topo = checks.topology(cfg, processes, devices)
  return cfg, checks.plan_from_config(cfg, topo, FUNCTIONS)


def lower(spec: str, overrides=(), processes=1, devices=2, target=H100):
  cfg, plan = _plan(spec, overrides, processes, devices)
  return gate.lower_all(lambda: catalogue.programs(
      cfg, plan, abstract.abstract_context(cfg, plan, abstract.model_shape(cfg))), target)


def _assert_all_lower(rows):
  failed = [f"{r.node}/{r.name}: {r.error}" for r in rows if not r.ok]
  assert not failed, failed[:5]


# algorithms:grpo is grpo:tiny under another name (test_algorithm_variants_share_the_
# default_run_s_rollout checks it), so grpo:tiny's lowering covers it.
TINY = [("grpo:tiny", ()), ("ppo:tiny", ()), ("reinforce_pp_two_rewards:tiny", ()),
        ("grpo_vl:tiny", ()), ("grpo:tiny_lora", ("model.lora.dropout=0.05",)),
        ("grpo:tiny_lora", ("rollout.lora_sync=adapters",)), ("grpo:tiny_moe", ())] + [
    (f"algorithms:{v}", ()) for v in ("ppo", "drgrpo", "rloo", "reinforce_pp_baseline",
                                      "dapo", "gspo")]
# The sections a run's set-up, warm start and rollout programs are built from: a variant
# equal to grpo:tiny in all of them has grpo:tiny's programs there (lowered by its own case),
# and only its later nodes' programs are its own.
ROLLOUT_SECTIONS = ("model", "rollout", "data", "placement", "cluster", "seed")
SHARED_NODES = ("setup", "warm start", "generate", "generate/eval")


def _same_rollout_as_default(cfg) -> bool:
  base, _ = _plan("grpo:tiny")
  return all(cfg.get(k) == base.get(k) for k in ROLLOUT_SECTIONS)


# The tiny model in bfloat16 (head dim 48: cuDNN serves it) under each lever that changes
# the sequence passes' shapes.  Two prompt widths (shipped: 3) and 4 decode slots (prefill
# rows 1 and 4; shipped: 1, 4, 16): each program kind at fewer shapes (the shipped shapes
# are test_shipped_tiny_configs_lower_for_h100's).
BF16 = ("model.dtype=bfloat16", "model.warmstart.steps=0", "rollout.prefill_buckets=(16, 32)",
        "rollout.max_concurrent_decodes=4")
LEVERS = {
    "packing": BF16 + ("model.pack_sequences=True",),
    "packing_len": BF16 + ("model.pack_sequences=True", "model.pack_len=128"),
    "token_budget": BF16 + ("model.pack_sequences=True", "actor.micro_batch_tokens=256"),
    "shared_prompts": BF16 + ("model.share_prompt_prefix=True",),
    "unshared": BF16 + ("model.share_prompt_prefix=False",),
    "deterministic": BF16 + ("trainer.deterministic=True",),
    "remat_scan": BF16 + ("model.remat=full", "model.scan_layers=True"),
    "minibatches": BF16 + ("actor.mini_batches=2",),
}


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("spec,overrides", TINY,
                         ids=[t[0] + "".join(f"+{o}" for o in t[1]) for t in TINY])
def test_shipped_tiny_configs_lower_for_h100(spec, overrides):
  cfg, plan = _plan(spec, overrides)
  shared = spec.startswith("algorithms:") and _same_rollout_as_default(cfg)

  def build():
    cat = catalogue.programs(cfg, plan, abstract.abstract_context(cfg, plan,
                                                                  abstract.model_shape(cfg)))
    if shared:  # grpo:tiny's case lowers these very programs
      cat.programs[:] = [p for p in cat.programs if p.node not in SHARED_NODES]
    return cat

  cat, rows = gate.lower_all(build, H100)
  _assert_all_lower(rows)
  names = {r.name.split("[")[0] for r in rows}
  rollout = ({"next_token", "vision_tower"} if spec.startswith("grpo_vl")
             else {"decode", "prefill_insert"})
  assert (set() if shared else rollout) | {"train_step", "checksum"} <= names, names
  if spec == "grpo:tiny_moe":  # the experts' grouped matmul is XLA's ragged dot on a GPU
    train = [p for p in cat.programs if p.name.startswith("train_step")][0]
    with target_lib.lowering_for(H100):
      text = train.trace().lower(lowering_platforms=("cuda",)).as_text()
    assert "ragged_dot" in text, "the experts' matmuls are not XLA's ragged dot"


def test_algorithm_variants_share_the_default_run_s_rollout():
  """What lets the case above skip a variant's set-up and rollout programs: every
  algorithm variant but PPO has grpo:tiny's model, rollout, data and placement, and
  algorithms:grpo is grpo:tiny in all but its name and run folder."""
  base, _ = _plan("grpo:tiny")
  variants = {v: _plan(f"algorithms:{v}")[0]
              for v in ("grpo", "drgrpo", "rloo", "reinforce_pp_baseline", "dapo", "gspo")}
  assert all(_same_rollout_as_default(c) for c in variants.values())
  grpo = variants["grpo"].to_dict()
  want = base.to_dict()
  for key in ("name", "run_dir"):
    del grpo[key], want[key]
  assert grpo == want
  assert not _same_rollout_as_default(_plan("algorithms:ppo")[0])  # 128 prompts x 1


@pytest.mark.timeout(600)
@pytest.mark.parametrize("lever", sorted(LEVERS))
def test_levers_lower_for_h100_through_cudnn(lever):
  cat, rows = lower("grpo:tiny", LEVERS[lever], devices=4)
  _assert_all_lower(rows)
  train = [r for r in rows if r.name.startswith("train_step")]
  assert train and all("cudnn" in r.attention for r in train), [(r.name, r.attention)
                                                               for r in train]


@pytest.mark.timeout(600)
def test_two_hosts_with_tensor_parallel_rollout_lower():
  """2 processes x 4 devices, rollout.tensor_parallel=2: per-host replicas, a re-partition
  into the training layout."""
  cat, rows = lower("grpo:tiny", BF16 + ("rollout.tensor_parallel=2",), processes=2,
                    devices=4)
  _assert_all_lower(rows)
  assert any(r.name.startswith("move") for r in rows)


@pytest.mark.timeout(600)
def test_rollout_replicas_spanning_hosts_lower():
  """4 processes x 1 device, rollout.tensor_parallel=2: two replicas, each over two
  processes (dag/replicas.py); process 0's replica (processes 0 and 1) lowers its weight
  sync and its engine's programs, and no batch moves (a process keeps its own rows)."""
  cat, rows = lower("grpo:tiny", BF16 + ("rollout.tensor_parallel=2",), processes=4,
                    devices=1)
  _assert_all_lower(rows)
  names = [r.name for r in rows if r.node == "generate"]
  assert any(n.startswith("sync/reshard") for n in names), names
  assert any(n.startswith("decode") for n in names), names
  assert not any(r.name.startswith("move") for r in rows)
  # The decode program's weights lie on the replica's 2 devices, one of each process.
  decode = next(p for p in cat.programs if p.node == "generate" and p.name.startswith("decode"))
  mesh = jax.tree.leaves(decode.args[0])[0].sharding.mesh
  assert [d.id for d in mesh.devices.flat] == [0, 1], mesh


# grpo:qwen0.5b lowers as shipped (every prefill row count and width); the others lower
# every program kind at fewer shapes: the smallest and largest prompt width (the largest is
# where the first GPU run crashed) and one replica's data axis of decode slots (8 here), so
# prefill and insert rows are 4 row counts x 2 widths instead of up to 8 x 3 (about half
# the CPU time: llama1b 38.6 -> 21.6 s measured).
FEWER_SHAPES = ("rollout.prefill_buckets=(128, 512)", "rollout.max_concurrent_decodes=8")
REAL = {
    "grpo_qwen0.5b": ("grpo:qwen0.5b", "qwen2.5-0.5b", ()),
    "grpo_llama1b": ("grpo:llama1b", "llama-3.2-1b", FEWER_SHAPES),
    "ppo_qwen0.5b": ("ppo:qwen0.5b", "qwen2.5-0.5b", FEWER_SHAPES),
    "grpo_vl_qwen2.5-vl-3b": ("grpo_vl:qwen2.5-vl-3b", "qwen2.5-vl-3b", ()),
}


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("name", sorted(REAL))
def test_real_model_configs_lower_for_h100(name):
  spec, shape, extra = REAL[name]
  cat, rows = lower(spec, (f"model.path={os.path.join(SHAPES, shape)}", *extra), devices=8)
  _assert_all_lower(rows)
  train = [r for r in rows if r.name.startswith("train_step")]
  assert train and all("cudnn" in r.attention for r in train)
  prefill = [r for r in rows if r.name.startswith("prefill")]
  assert "vl" in name or (prefill and all("cudnn" in r.attention for r in prefill)), prefill
  # the first GPU run crashed at T = P + N - 1 = 511 (odd, a mask, in training)
  assert any(r.name == "train_step[w=512]" for r in train) or "vl" in name


@pytest.mark.timeout(600)
def test_a_kernel_the_target_cannot_serve_is_refused_in_one_line():
  """attention_impl=cudnn on a float32 model (or on a CPU run): refused before anything
  is built, naming the setting; a program that fails to lower is named with its node."""
  for target in (H100, target_lib.TARGETS["cpu"]):
    with pytest.raises(loading.ConfigError) as e:
      lower("grpo:tiny", ("model.attention_impl=cudnn", "model.warmstart.steps=0"),
            target=target)
    msg = str(e.value)
    assert "\n" not in msg and f"plan --lower={target.name}" in msg, msg
    assert "model.attention_impl=cudnn" in msg and "auto" in msg, msg
  rows = [gate.Row("train_actor", "train_step[w=511]", "cudnn x2", 0, 0, 0, 0.1,
                   "NotImplementedError: Unsupported sequence length Q 511, KV 511."),
          gate.Row("save", "checksum", "-", 5, 0, 0, 0.1)]
  with pytest.raises(loading.ConfigError) as e:
    gate.check(rows, H100)
  msg = str(e.value)
  assert "\n" not in msg and "train_step[w=511] of node 'train_actor'" in msg, msg
  assert "model.attention_impl" in msg, msg


def _cli(args, timeout=300):
  env = suite_flags(dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=REPO))
  return subprocess.run([sys.executable, "-m", "distflow_jax.cli", "plan", *args], cwd=REPO,
                        env=env, capture_output=True, text=True, timeout=timeout)


@pytest.mark.timeout(300)
def test_plan_lower_cli_table_and_bad_target():
  out = _cli(["--config=grpo:tiny", "--lower=a100", "--num_processes=1",
              "--devices_per_process=2", "--config.model.warmstart.steps=0"])
  assert out.returncode == 0, out.stderr[-2000:]
  assert "programs of a run, lowered for a100" in out.stdout
  assert "failed: 0" in out.stdout and "train_step[w=32]" in out.stdout
  bad = _cli(["--config=grpo:tiny", "--lower=h1000", "--num_processes=1",
              "--devices_per_process=2"])
  assert bad.returncode == 2
  line = bad.stderr.strip().splitlines()
  assert len(line) == 1 and "unknown target 'h1000'" in line[0] and "h100" in line[0], line



@pytest.mark.timeout(300)
def test_episodes_on_a_folder_without_a_tokenizer_are_one_line():
  """A tool parser's closing tag shapes the decode program and needs the tokenizer; a
  folder with config.json only (tools/model_shapes) says so in one line (it was an
  AttributeError of the stand-in tokenizer)."""
  for what in ("--programs", "--lower=h100"):
    bad = _cli(["--config=grpo:calc", f"--config.model.path={SHAPES}/qwen2.5-0.5b", what,
                "--num_processes=1", "--devices_per_process=8"])
    line = bad.stderr.strip().splitlines()
    assert bad.returncode == 2 and len(line) == 1, (what, bad.stderr[-2000:])
    assert "rollout.env: the tool parser's closing tag" in line[0], line
    assert "tokenizer files" in line[0] and "Error:" not in line[0], line

# Eager operations (one jax primitive each, no model) a run also compiles; every other
# program it compiles must be in the catalogue.
EAGER = {"add", "broadcast_in_dim", "convert_element_type", "copy", "greater", "maximum",
         "multiply", "ravel", "reshape", "slice", "sqrt", "square", "stage", "subtract",
         "true_divide", "_mean", "_reduce_sum", "_where", "_threefry_fold_in",
         "_threefry_seed", "_threefry_split", "_threefry_random_bits", "concatenate",
         "dynamic_slice", "gather", "_reduce_max", "_reduce_min", "less", "equal",
         "_multi_slice", "select_n", "iota", "reduce_precision", "clamp", "_argmax",
         "_cumulative_reduction", "_var", "minimum", "negative", "exp", "log", "abs",
         "reshard", "clip", "expm1", "log1p", "sign", "where", "sum", "mean", "cumsum",
         "argmax", "max", "min", "tanh", "logistic", "_take", "take", "pad", "tile",
         "repeat", "isfinite", "not", "and", "bitwise_and", "or", "ne", "eq", "lt", "le", "ge",
         "gt"}


# A run on multi-turn episodes with tests/plugin_envs.py's scripted environment.
# Turns of at most 24 tokens, episodes of 48 (the passes' response width).
EPISODES = ("--config.rollout.env=plugin_envs:Scripted", "--config.rollout.max_new_tokens=24",
            "--config.rollout.max_episode_tokens=48",
            "--config.rollout.prefill_buckets=(16,32,80)")


def _covered(compiled, cat):
  """Programs a run compiled that the catalogue does not hold with the same inputs (the
  compile log drops unused arguments, so the run's input list is a sub-multiset)."""
  by_name = {}
  for name, sig, *_ in cat:
    by_name.setdefault(name, []).append(Counter(sig.split(";")))
  missing = []
  for name, sig in compiled:
    if name in EAGER:
      continue
    want = Counter(sig.split(";")) if sig else Counter()
    if not any(not (want - have) for have in by_name.get(name, [])):
      missing.append((name, sig[:200]))
  return missing


# Two real runs carry the claims of the four configs this test ran one by one (grpo:tiny,
# ppo:tiny, grpo:tiny with actor.off_policy.correction=tis, grpo:tiny on episodes):
#   ppo:tiny at its shipped two prompt widths: the catalogue's widths against the run's, a
#     single-turn rollout, and old log-probs taken from the rollout (on-policy: no pass);
#   grpo:tiny with tis and multi-turn episodes: GRPO's DAG and warm start, old log-probs
#     recomputed and the off-policy weights' stats (tis), and the engine's append programs
#     (episodes, rollout/engine/extend.py); one prompt width (32; 80 is the re-prefill bucket).
# 4 decode slots (prefill rows 1 and 4) in both.
PROBES = {
    "ppo:tiny": ("--config=ppo:tiny",),
    "grpo:tiny+tis+episodes": ("--config=grpo:tiny_env", "--config.actor.off_policy.correction=tis",
                               *EPISODES, "--config.rollout.prefill_buckets=(32,80)"),
}


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("probe", sorted(PROBES))
def test_catalogue_holds_every_program_a_real_run_compiles(tmp_path, probe):
  """A real 1-step run on 1 process x 2 devices with every shape compiled ahead, jax's
  compile log read back: each program it compiled (eager single operations aside) is one
  ``plan --lower`` lowers, with the same input shapes and dtypes, and the number of
  programs it logged (``compile/programs``) is ``plan --programs``' count."""
  out = tmp_path / "probe.json"
  env = suite_flags(dict(os.environ, JAX_PLATFORMS="cpu", DISTFLOW_JAX_COMPILE_CACHE="",
                         PYTHONPATH=os.pathsep.join([REPO, os.path.join(REPO, "tests")])))
  args = [*PROBES[probe], "--config.trainer.total_steps=1",
          "--config.model.warmstart.steps=2", "--config.trainer.eval_every=0",
          f"--config.run_dir={tmp_path / 'run'}", "--config.cluster.num_processes=1",
          "--config.cluster.devices_per_process=2", "--config.data.prompts_per_step=4",
          "--config.rollout.max_concurrent_decodes=4", "--config.trainer.compile_ahead=always"]
  proc = subprocess.run([sys.executable, os.path.join(REPO, "tests", "lowering_probe.py"),
                         str(out), "2", "--", *args], cwd=tmp_path, env=env,
                        capture_output=True, text=True, timeout=800)
  assert proc.returncode == 0, proc.stderr[-3000:]
  data = json.loads(out.read_text())
  ours = [c for c in data["compiled"] if c[0] not in EAGER]
  assert len(ours) >= 10, data["compiled"]
  missing = _covered(data["compiled"], data["catalogue"])
  assert not missing, missing
  if "episodes" in probe:  # the run compiled the engine's append programs
    append = {c[0] for c in data["catalogue"] if c[3].startswith("append[")}
    assert append and append <= {c[0] for c in ours}, (append, data["catalogue"])
  with open(tmp_path / "run" / "metrics.jsonl") as f:
    first = json.loads(f.readline())
  assert first["step"] == 1 and first["compile/programs"] == data["count"], (
      first.get("compile/programs"), data["count"], len(ours))
  # tis recomputes the old log-probs (ppo takes the rollout's)
  assert ("old_logprob_from_rollout" in first) == ("tis" not in probe), first


@pytest.mark.timeout(300)
def test_episode_catalogue_holds_the_append_programs_and_the_loss_mask():
  """With rollout.env the catalogue holds the engine's append programs (rollout/engine/extend.py:
  one per appended-length bucket up to the episode's response, at the cache's capacity),
  plan --programs counts them, and the train step reads the episodes' loss mask."""
  from distflow_jax.lowering import count
  cfg, plan = _plan("grpo:tiny_env", [o.removeprefix("--config.") for o in EPISODES])
  cat = catalogue.programs(cfg, plan, abstract.abstract_context(cfg, plan,
                                                                abstract.model_shape(cfg)))
  progs = {p.name: p for p in cat.programs}
  cap = 80 + 48  # the largest prompt bucket + the episode's response
  assert sorted(n for n in progs if n.startswith("append[")) == sorted(
      f"append[len={m},cap={cap}]" for m in (8, 16, 32, 64)), sorted(progs)
  assert count.count(cat).by_node["generate"]["append"] == 4
  train = next(p for n, p in progs.items() if n.startswith("train_step["))
  assert train.args[2]["loss_mask"].shape == train.args[2]["response_mask"].shape
  assert train.args[2]["response_mask"].shape[1] == 48  # rollout.max_episode_tokens


@pytest.mark.timeout(300)
def test_lora_catalogue_holds_the_base_warm_start_and_the_base_fingerprint():
  """A LoRA run warm-starts its whole base (no adapters) and checksums its frozen base at
  each save (its fingerprint): both programs are in the catalogue, on the base's arrays.
  The fresh adapters are one program (lora.adapter_init), in the catalogue too.  (A real
  1-step grpo:tiny_lora run, probed as above, compiles nothing else the catalogue lacks,
  with rollout.lora_sync=adapters too; its count of programs still differs by two: 34
  logged against plan --programs' 32, 2026-11-27.)"""
  import jax
  for extra in ((), ("rollout.lora_sync=adapters",)):
    cfg, plan = _plan("grpo:tiny_lora", extra)
    cat = catalogue.programs(cfg, plan, abstract.abstract_context(cfg, plan,
                                                                  abstract.model_shape(cfg)))
    progs = {p.name: p for p in cat.programs}
    warm = progs["sft_step"]
    names = {str(getattr(k, "key", k)) for path, _ in
             jax.tree_util.tree_flatten_with_path(warm.args[0])[0] for k in path}
    assert "kernel" in names and not names & {"lora_a", "lora_b"}, names
    assert any(n.startswith("checksum[lora base,") for n in progs), sorted(progs)
    assert "init_adapters[actor]" in progs, sorted(progs)
    sync = [n for n in progs if "sync" in n]
    want = "lora_sync/merge" if extra else "sync/reshard[layers/0]"
    assert want in sync, sync


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", ["tpu", "a100"])
def test_other_targets_lower(name):
  """TPU lowers from a CPU with no help (XLA's attention there); an A100's cuDNN rules
  (head dim up to 128) are jax's own under the emulation."""
  cat, rows = lower("grpo:tiny", BF16, devices=4, target=target_lib.TARGETS[name])
  _assert_all_lower(rows)
  train = [r for r in rows if r.name.startswith("train_step")]
  assert all(("cudnn" in r.attention) == (name == "a100") for r in train), train


@pytest.mark.timeout(300)
def test_deterministic_catalogue_holds_the_row_order_of_each_train_node():
  """Deterministic mode sorts each train step's rows by sample id first (nodes/training.
  row_order): one program per train node and prompt width, in the catalogue and counted by
  plan --programs; a run without the mode has none."""
  from distflow_jax.lowering import count
  for det, want in ((True, True), (False, False)):
    cfg, plan = _plan("ppo:tiny", (f"trainer.deterministic={det}",))
    cat = catalogue.programs(cfg, plan, abstract.abstract_context(cfg, plan,
                                                                  abstract.model_shape(cfg)))
    names = [(p.node, p.name) for p in cat.programs if p.name.startswith("canonical_rows[")]
    nodes = {n for n, _ in names}
    assert (nodes == {"train_actor", "train_critic"}) if want else not names, names
    if want:
      assert count.count(cat).by_node["train_actor"]["canonical_rows"] >= 1
      lowered = next(p for p in cat.programs if p.name.startswith("canonical_rows["))
      lowered.fn.lower(*lowered.args)  # it lowers on the abstract arrays
