"""The benchmark tools: the shared harness (timing, tables, JSON, children with a deadline),
FLOP counts by hand and against XLA's own count, and bench_e2e / bench_rollout end to end
without Tunix (one check against Tunix where its venv exists); the Tunix side they share."""

import dataclasses
import json
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tools"))
import _bench_common as bc  # noqa: E402

from distflow_jax.models import ModelConfig, Transformer  # noqa: E402
from distflow_jax.train import steps  # noqa: E402


def _xla_flops(fn, *args) -> float:
  cost = jax.jit(fn).lower(*args).compile().cost_analysis()
  return float((cost[0] if isinstance(cost, list) else cost)["flops"])


def test_train_flops_by_hand():
  # d 4, ffn 6, 1 layer, 2 heads x 2 dims (q 4), 1 kv head (kv 2), vocab 10.
  s = bc.Shape(vocab_size=10, hidden_size=4, intermediate_size=6, num_layers=1, num_heads=2,
               num_kv_heads=1, head_dim=2)
  # q 4x4 + k 4x2 + v 4x2 + o 4x4 = 48; gate/up/down 3 x 4x6 = 72.
  assert bc.layer_matmul_params(s) == 120
  f = bc.train_flops(s, batch=3, prompt_len=2, response_len=3)  # T = 2 + 3 - 1 = 4
  assert f["blocks"] == 6 * 120 * 3 * 4
  assert f["unembed"] == 6 * 10 * 4 * 3 * 3
  assert f["attention"] == 3 * 4 * 1 * 3 * 4 * 4 * 4
  assert f["total"] == f["blocks"] + f["unembed"] + f["attention"]
  assert f["simple_6nt"] == 6 * (120 + 40) * 3 * 5


def test_matmul_flops_matches_xla():
  a = jnp.ones((64, 64), jnp.float32)
  assert bc.matmul_flops(64) == 2 * 64 ** 3
  assert _xla_flops(jnp.dot, a, a) == pytest.approx(bc.matmul_flops(64), rel=1e-6)


def test_forward_flops_match_xla_count_of_the_actor_forward():
  """One third of train_flops is the forward the actor loss runs; XLA counts the same
  matmuls plus elementwise work (norms, softmax, RoPE), so ours is a bit below XLA's."""
  cfg = ModelConfig(arch="qwen2", vocab_size=256, hidden_size=64, intermediate_size=256,
                    num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, qkv_bias=True)
  graphdef, params = nnx.split(Transformer(cfg, rngs=nnx.Rngs(0)))
  b, p, n = 4, 8, 8
  batch = dict(prompt_tokens=jnp.ones((b, p), jnp.int32), prompt_mask=jnp.ones((b, p), bool),
               response_tokens=jnp.ones((b, n), jnp.int32),
               response_mask=jnp.ones((b, n), bool))
  xla = _xla_flops(lambda w, x: steps.response_logprobs(graphdef, w, x)[0], params, batch)
  ours = bc.train_flops(bc.Shape.of(cfg), b, p, n)["total"] / 3
  assert 0.9 * xla <= ours <= xla


def test_median_time_counts_every_call():
  calls = []
  t = bc.median_time(lambda: calls.append(1), repeats=5)
  assert len(calls) == 5 and t >= 0
  assert bc.best_time(lambda: calls.append(1), repeats=3) >= 0 and len(calls) == 9  # + warm-up


def test_alternate_takes_turns_rotates_skips_and_reports_each_time():
  calls, seen = [], []
  contenders = {n: (lambda n=n: calls.append(n) or n) for n in ("a", "b", "c")}
  times = bc.alternate(contenders, 3, on_time=lambda i, n, s, v: seen.append((i, n, v)))
  assert calls == list("abcabcabc") and [x[1] for x in seen] == calls
  assert [x[2] for x in seen] == calls and [x[0] for x in seen] == [0] * 3 + [1] * 3 + [2] * 3
  assert {n: len(t) for n, t in times.items()} == {"a": 3, "b": 3, "c": 3}
  calls.clear()
  bc.alternate(contenders, 3, rotate=True, skip=lambda i, n: i == 1 and n == "a")
  assert calls == list("abc") + list("bc") + list("cab")
  # A contender that times itself: its own seconds count, its value is passed on.
  times = bc.alternate({"self": lambda: bc.Measured("v", 7.5)}, 2)
  assert times == {"self": [7.5, 7.5]} and bc.timed(lambda: bc.Measured(1, 2.0)) == (1, 2.0)
  assert bc.spread([0.3, 0.1, 0.2], 1e3, ".0f") == "200 (100-300)"


def test_table_plain_markdown_spans_and_tails():
  lines = []
  t = bc.Table(bc.Col("n", 3), bc.Col("mode", 6, "<"), "|", bc.Col("ms", 6, fmt=".1f"),
               bc.Col("x", 5), rule=True, out=lines.append)
  t.row(1, "dist", 2.345, "1.5x")
  t.row(2, "cent", tail="FAILED: rc 1")
  t.row(3, "none", bc.Span("not run", 2))
  t.note("free text")
  assert lines == ["  n mode   |     ms     x", "-" * 25, "  1 dist   |    2.3  1.5x",
                   "  2 cent   FAILED: rc 1", "  3 none   | not run", "free text"]
  md = []
  m = bc.Table(bc.Col("measure", 8, "<"), bc.Col("share", 0), markdown=True, out=md.append)
  m.row("train", "40.0%")
  assert md == ["| measure  | share |", "|----------|---|", "| train    | 40.0% |"]


def test_json_files_whole_or_not_at_all(tmp_path):
  path = str(tmp_path / "r.json")
  bc.write_json(path, {"a": [1, 2]}, indent=1)
  assert bc.read_json(path) == {"a": [1, 2]} and not os.path.exists(path + ".tmp")
  assert bc.read_json(str(tmp_path / "missing.json")) is None
  lines = str(tmp_path / "r.jsonl")
  out = bc.JsonLines(lines)
  out.append({"section": "a"})
  out.append({"section": "b"})
  with open(lines, "a") as f:
    f.write('\n{"section": "c", "cut by a ki')  # a blank line, then a line cut by a kill
  assert bc.read_jsonl(lines) == [{"section": "a"}, {"section": "b"}]
  assert bc.read_jsonl(str(tmp_path / "none.jsonl")) == []
  assert bc.tagged(["x", bc.TAG + json.dumps({"k": 1}), "BENCHMARK"]) == [{"k": 1}]


def test_child_env_sets_the_device_count_and_keeps_other_flags(monkeypatch):
  monkeypatch.setenv("XLA_FLAGS", "--xla_foo=1 --xla_force_host_platform_device_count=8")
  monkeypatch.setenv("DROP_ME", "1")
  monkeypatch.setenv("KEEP_ME", "mine")
  env = bc.child_env(devices=2, unset=["DROP_ME"], defaults={"KEEP_ME": "x", "NEW": "y"},
                     JAX_PLATFORMS="cpu")
  assert env["XLA_FLAGS"] == "--xla_foo=1 --xla_force_host_platform_device_count=2"
  assert "DROP_ME" not in env and env["KEEP_ME"] == "mine" and env["NEW"] == "y"
  assert env["JAX_PLATFORMS"] == "cpu" and os.environ["XLA_FLAGS"].endswith("=8")
  assert bc.tunix_env()["XLA_FLAGS"].endswith("device_count=1")
  assert "load average (1, 5, 15 min): " in bc.load_line()
  assert len(bc.load_average().split(", ")) == 3


def _alive(pid: int) -> bool:
  try:
    with open(f"/proc/{pid}/stat") as f:
      return f.read().rsplit(")", 1)[1].split()[0] != "Z"
  except OSError:
    return False


def test_deadline_kills_the_child_and_a_grandchild_in_its_own_session():
  """As the launcher starts its workers (start_new_session), so a group kill misses them."""
  code = ("import subprocess, sys, time\n"
          "g = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'], "
          "start_new_session=True)\n"
          "print('grandchild', g.pid, flush=True)\n"
          "time.sleep(60)\n")
  done = bc.run_with_deadline([sys.executable, "-c", code], 2)
  assert done.returncode == -9 and done.timed_out and "deadline" in done.output
  assert 2 <= done.wall_s < 30
  pid = int(done.output.split("grandchild ")[1].split()[0])
  for _ in range(50):
    if not _alive(pid):
      break
    time.sleep(0.1)
  assert not _alive(pid)


def test_run_with_deadline_logs_to_a_file_and_passes_the_exit_status(tmp_path):
  log = tmp_path / "child.log"
  done = bc.run_with_deadline([sys.executable, "-c", "print('hello'); raise SystemExit(3)"],
                              60, log_path=str(log))
  assert (done.returncode, done.timed_out, done.output) == (3, False, "")
  assert log.read_text() == "hello\n"
  done = bc.run_with_deadline([sys.executable, "-c", "print('a', flush=True); "
                               "import time; time.sleep(60)"], 1, log_path=str(log))
  assert done.timed_out and log.read_text().startswith("a\n")
  assert log.read_text().rstrip().endswith("[killed after the 1 s deadline]")
  assert not bc._LIVE  # pylint: disable=protected-access


def test_kill_children_ends_a_running_child():
  """What a signal handler calls: the child run_with_deadline is waiting on dies now."""
  import threading
  result = {}
  th = threading.Thread(target=lambda: result.update(done=bc.run_with_deadline(
      [sys.executable, "-c", "import time; time.sleep(60)"], 120)))
  th.start()
  for _ in range(100):
    if bc._LIVE:  # pylint: disable=protected-access
      break
    time.sleep(0.05)
  bc.kill_children()
  th.join(30)
  assert result["done"].returncode == -9 and not result["done"].timed_out
  assert result["done"].wall_s < 30


def test_compiles_per_step_reads_a_jax_log(tmp_path):
  import bench_e2e
  log = tmp_path / "ours.log"
  log.write_text(
      "INFO Finished XLA compilation of jit(copy) in 0.01 sec\n"
      "--- step 0\n"
      "INFO Finished XLA compilation of jit(step) in 1.5 sec\n"
      "INFO Finished XLA compilation of jit(decode_chunk) in 2.0 sec\n"
      "--- step 1\n"
      "unrelated line\n")
  assert bench_e2e.compiles_per_step(str(log)) == {
      "setup": ["jit(copy)"], "0": ["jit(step)", "jit(decode_chunk)"], "1": []}


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_compare_algorithms_smoke(tmp_path):
  """tools/compare_algorithms.py end to end at a toy budget: one warm start shared by the
  runs of a task, one process per run, the table and the plot."""
  import json

  import compare_algorithms as ca
  pytest.importorskip("matplotlib")
  out = tmp_path / "cmp"
  # rollout.max_new_tokens fits letters:basic's demonstrations (a shorter one leaves them out).
  tiny = ["model.preset=micro", "model.warmstart.steps=2", "model.warmstart.examples=64",
          "model.warmstart.batch_size=16", "rollout.n=2", "rollout.max_new_tokens=32",
          "rollout.prefill_buckets=(32,)", "rollout.max_concurrent_decodes=8",
          "data.eval_size=8", "actor.micro_batch_size=4", "critic.micro_batch_size=4",
          "cluster.devices_per_process=1"]
  rc = ca.main(["--steps", "2", "--tasks", "letters", "--algorithms", "grpo,rloo",
                "--samples-per-step", "8", "--out", str(out),
                *[f"--set={o}" for o in tiny]])
  assert rc == 0
  md = (out / "compare.md").read_text()
  assert "Load average (1, 5, 15 min) at start:" in md and "at end:" in md
  rows = [l for l in md.splitlines() if l.startswith("| letters |")]
  assert [r.split(" | ")[1] for r in rows] == ["grpo", "rloo"]
  for r in rows:
    cells = r.split(" | ")
    assert cells[2] == "0"  # the seed
    assert cells[7] == "8" and cells[8] == "16" and cells[9] == "16"  # n_eval, samples
    assert cells[3].endswith("%") and cells[5].endswith("%")
    assert float(cells[13]) > 0 and 0 <= float(cells[14]) <= 1  # entropy, clip fraction
  assert (out / "compare.png").stat().st_size > 0
  for algo in ("grpo", "rloo"):  # the task's warm start, copied, not redone per run
    log = (out / "letters" / f"{algo}.log").read_text()
    assert "using the cached model" in log, log[-2000:]
    steps = [json.loads(l)["step"] for l in open(out / "letters" / algo / "metrics.jsonl")]
    assert steps == [0, 1, 2]


def test_compare_algorithms_seeds_give_a_mean_spread_and_range():
  """--seeds: one run per seed (its own run dir, warm start and seed override) and a row of
  the seeds' mean curve, final mean, sample std and range."""
  import compare_algorithms as ca
  args = ca.parse_args(["--tasks", "arithmetic", "--algorithms", "grpo", "--seeds", "0,1,2",
                        "--steps", "20"])
  runs = ca.plan_runs(args)
  assert [r.seed for r in runs] == [0, 1, 2]
  assert all(r.run_dir.endswith(f"grpo/seed{r.seed}") and f"seed={r.seed}" in r.overrides
             for r in runs)
  for r, curve in zip(runs, ([(0, 0.0), (10, 0.2), (20, 0.30)],
                             [(0, 0.0), (10, 0.1), (20, 0.20)],
                             [(0, 0.0), (10, 0.3), (20, 0.25)])):
    r.curve = curve
  s = ca.seed_summary(runs)
  assert s["final"] == pytest.approx(0.25) and s["std"] == pytest.approx(0.05)
  assert (s["low"], s["high"]) == (0.2, 0.3)
  assert s["curve"] == [(0, 0.0), (10, pytest.approx(0.2)), (20, pytest.approx(0.25))]
  md = ca.table(runs, args, "1.0", "1.0")
  row = next(l for l in md.splitlines() if l.startswith("| arithmetic | grpo | 3 |"))
  assert "25.0%" in row and "5.0%" in row and "20.0%-30.0%" in row and "10:20.0%" in row
  runs[1].curve = []
  assert ca.seed_summary(runs) is None
  with pytest.raises(SystemExit):
    ca.parse_args(["--seeds", "0,0"])


def test_summarize_gives_mean_with_recompiles_beside_median_and_ratios_to_tunix():
  """bench_e2e's table: step 0 apart; the mean counts a recompiling step the median hides;
  ratios to Tunix both ways."""
  import bench_e2e
  rec = lambda s, tok, c: {"wall_s": s, "tokens": tok, "compiles": c, "compile_s": 0.5 * c}
  stats = bench_e2e.summarize({
      "equal": [rec(9.0, 100, 40), rec(1.0, 100, 0), rec(1.0, 100, 0), rec(4.0, 100, 3)],
      "tunix": [rec(20.0, 100, 50), rec(2.0, 100, 0), rec(2.0, 100, 0), rec(2.0, 100, 0)]})
  e, t = stats["equal"], stats["tunix"]
  assert e["first_s"] == 9.0 and e["first_compiles"] == 40 and e["steps"] == 3
  assert e["median_s"] == 1.0 and e["mean_s"] == 2.0
  assert e["recompiles"] == 3 and e["recompile_s"] == 1.5
  assert e["rate_median"] == 100.0 and e["rate_mean"] == 50.0
  assert t["rate_median"] == 50.0 and t["rate_mean"] == 50.0
  lines = []
  bench_e2e.print_table(stats, out=lines.append)
  assert "xTunix med" in lines[0] and "xTunix mean" in lines[0] and "xTunix step" in lines[0]
  assert lines[1].split()[-3:] == ["2.00x", "1.00x", "2.00x"]  # Tunix's median 2 s, ours 1 s
  no_tunix = []
  bench_e2e.print_table({"equal": e}, out=no_tunix.append)
  assert "xTunix" not in no_tunix[0]


def test_bench_e2e_variants_add_one_saving_each():
  """Each variant differs from the one it names in exactly one switch; 'equal' does
  Tunix's work (no bucketing, no sharing, no old_logprob pass)."""
  import dataclasses

  import bench_e2e
  v = bench_e2e.VARIANTS
  assert v["equal"] == bench_e2e.Variant(False, False, False, v["equal"].what)
  for name, base in (("share", "equal"), ("lean", "share"), ("config", "lean"),
                     ("plain", "equal")):
    assert v[name].what.startswith(base + " + ")
    a, b = dataclasses.astuple(v[name])[:3], dataclasses.astuple(v[base])[:3]
    assert sum(x != y for x, y in zip(a, b)) == 1, name
  assert bench_e2e.DEFAULT_VARIANTS.split(",")[0] == "equal"
  assert bench_e2e._buckets(32) == (8, 16, 24, 32)
  # 'whole' is equal with the step's rows in one micro-batch, nothing else.
  assert dataclasses.replace(v["whole"], whole=False, what="") == dataclasses.replace(
      v["equal"], what="")
  assert v["whole"].whole and "whole" not in bench_e2e.DEFAULT_VARIANTS


def _bench_args(**kw):
  import bench_e2e
  return bench_e2e._args([f"--{k.replace('_', '-')}={v}" if v is not True else
                          f"--{k.replace('_', '-')}" for k, v in kw.items()])


def test_bench_e2e_takes_a_model_folder_and_renders_chat_prompts(tmp_path):
  """--model: both sides train the folder's own weights with its tokenizer (its arch handed
  to Tunix's loader: llama here); --chat renders each prompt with the chat template first.
  A folder that is no model is one line naming it."""
  import bench_e2e
  from distflow_jax.models import hf_io
  from distflow_jax.models.tokenizer import Tokenizer
  tok = Tokenizer.builtin()
  folder = tmp_path / "llama"
  cfg = ModelConfig.tiny(vocab_size=tok.vocab_size, arch="llama")
  hf_io.save_pretrained(str(folder), Transformer(cfg, rngs=nnx.Rngs(0)), tok)
  work = tmp_path / "w"
  work.mkdir()
  inp = bench_e2e.write_inputs(str(work), _bench_args(model=str(folder), prompt_len=32))
  assert inp["model_dir"] == str(folder) and inp["model"]["arch"] == "llama"
  assert inp["model"]["num_layers"] == cfg.num_layers and "its own weights" in inp["about"]
  raw = [json.loads(l)["prompt"] for l in open(inp["prompts"])]
  assert tok.chat_template is not None  # the built-in tokenizer has one
  chat = bench_e2e.write_inputs(str(work), _bench_args(model=str(folder), prompt_len=256,
                                                       chat=True))
  rendered = [json.loads(l)["prompt"] for l in open(chat["prompts"])]
  assert rendered[0] == tok.apply_chat_template([{"role": "user", "content": raw[0]}])
  assert chat["prompt_tokens"][1] > inp["prompt_tokens"][1]
  with pytest.raises(SystemExit, match=r"^bench_e2e: --model .*nothing.*config\.json"):
    bench_e2e.main(["--no-tunix", "--model", str(tmp_path / "nothing"), "--workdir", str(work)])


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_bench_e2e_smoke_no_tunix(tmp_path, capsys):
  """tools/bench_e2e.py end to end without Tunix: the equal-work variant pads every step's
  prompts to --prompt-len, the bucketed one to less; the table has mean, median and
  recompiles.  Smoke size: --prompt-len 24 (buckets 8/16/24, the prompts are 14-21 tokens)
  and the bucketed variant without prompt sharing ('plain'): the share variants' train
  steps are the costliest compiles, and sharing has its own tests (test_shared_prompts)."""
  import bench_e2e
  rc = bench_e2e.main(["--no-tunix", "--prompts", "2", "--n", "2", "--new", "4", "--steps",
                       "1", "--micro-batch-size", "4", "--variants", "equal,plain",
                       "--prompt-len", "24", "--workdir", str(tmp_path)])
  out = capsys.readouterr().out
  assert rc == 0, out
  steps = [l.split() for l in out.splitlines() if l.startswith("  step ")]
  assert len(steps) == 4
  widths = {(s[1], s[2]): int(s[7].removeprefix("prompt_width=")) for s in steps}
  assert widths["0", "equal"] == widths["1", "equal"] == 24
  assert {widths["0", "plain"], widths["1", "plain"]} <= {16, 24}
  assert min(widths["0", "plain"], widths["1", "plain"]) == 16
  assert all(s[8].startswith("compiles=") for s in steps)
  assert [s for s in steps if s[1] == "0"][0][8] != "compiles=0"  # step 0 compiles
  head = [l for l in out.splitlines() if l.startswith("side ")][0].split()
  assert head == ["side", "step0", "s", "comp0", "median", "s", "mean", "s", "recomp",
                  "tok/s", "med", "tok/s", "mean"]
  rows = {l.split()[0]: l.split() for l in out.splitlines() if l.split()[:1] in
          (["equal"], ["plain"]) and len(l.split()) == 8}
  assert set(rows) == {"equal", "plain"}
  assert "Tunix not run (--no-tunix)" in out


def test_tunix_side_agreement_and_ids_tokenizer():
  """The pieces bench_rollout and bench_decode share to set Tunix's sampler beside the
  engine: token-for-token agreement, and the tokenizer that hands Tunix our exact ids."""
  import _tunix_side as ts
  a = np.array([[1, 2, 3], [4, 5, 6]])
  assert ts.agreement(a, a) == (1.0, 2)
  assert ts.agreement(a, np.array([[1, 2, 3], [4, 5, 0]])) == (5 / 6, 1)
  assert ts.agreement(a, a[:, :2]) == (0.0, 0)
  tok = ts.IdsTokenizer(512)
  assert tok.decode(np.array([5, 0, 511])) == "5 0 511"
  assert tok.encode(tok.decode([5, 0, 511])) == [5, 0, 511] and tok.encode("") == []
  assert tok.eos_id() == 512 and tok.bos_id() is None and tok.pad_id() == 0


@pytest.mark.timeout(120)
def test_tunix_side_notes_are_one_line(tmp_path):
  """Why Tunix's sampler is skipped comes in one line: --no-tunix, a venv that cannot be
  made (a real failed `python -m venv`), a shape its qwen2 model does not take, a worker
  that dies before it is ready (here: this venv's python, which has no tunix)."""
  import _tunix_side as ts
  assert ts.tunix_python(True, str(tmp_path / "v")) == (None,
                                                        "Tunix's sampler skipped (--no-tunix)")
  (tmp_path / "file").write_text("")
  py, note = ts.tunix_python(False, str(tmp_path / "file" / "venv"))
  assert py is None and note.startswith("Tunix's sampler skipped: ") and "\n" not in note, note
  assert ts.one_line(RuntimeError("pip failed:\n\n  ...\nERROR: no such version\n")) == (
      "pip failed: ... ERROR: no such version")
  assert ts.one_line(ValueError()) == "ValueError"
  cfg = ModelConfig(**bc.BENCH_MODEL)
  m = ts.model_dict(cfg)
  assert m["rope_theta"] == cfg.rope_theta and m["dtype"] == "float32"
  assert json.loads(json.dumps(m)) == m
  assert m["arch"] == "qwen2"
  assert ts.model_dict(ModelConfig.tiny(arch="llama"))["arch"] == "llama"  # Tunix's llama3
  with pytest.raises(ValueError, match="arch 'qwen3'"):
    ts.model_dict(ModelConfig.tiny(arch="qwen3"))
  with pytest.raises(ValueError, match="RoPE scaling"):
    ts.model_dict(dataclasses.replace(ModelConfig.tiny(arch="llama"),
                                      rope_llama3=(8.0, 1.0, 4.0, 8192)))
  sampler = ts.Sampler(sys.executable, str(tmp_path), m, {2: [[1, 2], [3, 4]]}, 4,
                       str(tmp_path))
  try:
    with pytest.raises(RuntimeError, match="tunix worker exited"):
      sampler.ready()
  finally:
    sampler.close()
  assert "tunix" in (tmp_path / "tunix.log").read_text()


@pytest.mark.timeout(600)
def test_bench_rollout_smoke_no_tunix(capsys):
  import bench_rollout
  rc = bench_rollout.main(["--batch", "2", "--prompt", "8", "--new", "8", "--rounds", "1",
                           "--decode-steps", "8", "--no-hf", "--no-tunix"])
  out = capsys.readouterr().out
  assert rc == 0, out
  assert "Tunix's sampler skipped (--no-tunix)" in out
  assert "greedy tokens equal to no-cache: engine: 1.000" in out


def test_bench_moe_smoke(capsys):
  import bench_moe
  assert bench_moe.main(["--tokens", "64", "--hidden", "32", "--width", "16", "--experts", "4",
                         "--rounds", "1"]) == 0
  rows = [l.split() for l in capsys.readouterr().out.splitlines() if "|" in l][1:]
  assert [(r[0], r[1]) for r in rows] == [(d, p) for p in ("fwd", "fwd+bwd")
                                           for d in ("blocked", "ragged_dot", "floor")]
  assert all(r[-1] == "1.00" for r in rows if r[0] == "floor")


def _tunix_python():
  import _bench_common
  py = os.path.join(_bench_common.DEFAULT_TUNIX_VENV, "bin", "python")
  return py if os.path.exists(py) else None


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.skipif(_tunix_python() is None, reason="no Tunix venv (tools/bench_e2e.py makes "
                    "one on first use); CI does not install Tunix")
def test_bench_rollout_against_tunix_sampler(capsys):
  """With the Tunix venv on this machine: Tunix's sampler decodes the same greedy tokens."""
  import bench_rollout
  rc = bench_rollout.main(["--batch", "2", "--prompt", "8", "--new", "8", "--rounds", "1",
                           "--decode-steps", "8", "--no-hf"])
  out = capsys.readouterr().out
  assert rc == 0, out
  assert "Tunix sampler vs engine, token for token: 1.000 of tokens, 2/2 rows equal" in out
  assert "engine vs Tunix sampler: " in out


@pytest.mark.timeout(900)
@pytest.mark.skipif(_tunix_python() is None, reason="no Tunix venv (tools/bench_e2e.py makes "
                    "one on first use); CI does not install Tunix")
def test_bench_rollout_a_llama_folder_against_tunix_llama3(tmp_path, capsys):
  """--model with a Llama folder (its own weights, RoPE theta 100,000 as SmolLM2's): Tunix's
  llama3, handed the model's theta (Tunix 0.1.7 drops it and rotates at 1,000,000), decodes
  the greedy tokens of the engine and the no-cache loop."""
  import bench_rollout
  from distflow_jax.models import hf_io
  cfg = dataclasses.replace(ModelConfig.tiny(arch="llama"), rope_theta=100000.0)
  model = Transformer(cfg, rngs=nnx.Rngs(0))
  state = jax.tree.map(lambda x: x * 10.0 if x.ndim == 2 else x, nnx.state(model, nnx.Param))
  nnx.update(model, state)  # peaked logits: greedy tokens without near-ties
  hf_io.save_pretrained(str(tmp_path / "llama"), model)
  rc = bench_rollout.main(["--model", str(tmp_path / "llama"), "--batch", "4", "--prompt",
                           "24", "--new", "16", "--rounds", "1", "--decode-steps", "8",
                           "--no-hf"])
  out = capsys.readouterr().out
  assert rc == 0, out
  assert "greedy tokens equal to no-cache: engine: 1.000" in out
  assert "Tunix sampler vs engine, token for token: 1.000 of tokens, 4/4 rows equal" in out
  with pytest.raises(SystemExit, match=r"^bench_rollout: --model .*nothing"):
    bench_rollout.main(["--model", str(tmp_path / "nothing"), "--no-hf", "--no-tunix"])
