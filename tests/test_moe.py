"""Qwen3-MoE (models/moe.py): the dropless grouped-matmul dispatch against a dense
per-expert reference (values and gradients), parity with transformers' Qwen3MoeForCausalLM
on random weights (logits, left padding, greedy decoding with the KV cache, export that
transformers loads exactly), the scanned layout, and bad input in one line."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from distflow_jax.models import moe
from distflow_jax.models.config import ModelConfig
from distflow_jax.models.errors import ModelFileError
from distflow_jax.models.hf_io import export_state_dict, load_pretrained, save_pretrained
from distflow_jax.models.transformer import Transformer, forward, init_cache

pytestmark = pytest.mark.timeout(300)
FWD = jax.jit(forward)
VOCAB = 96


def _dense_reference(h, weights, experts, gate, up, down):
  """Every token through each of its experts, one at a time (float64 NumPy)."""
  h, weights, gate, up, down = (np.asarray(a, np.float64) for a in (h, weights, gate, up, down))
  out = np.zeros_like(h)
  for n in range(h.shape[0]):
    for k in range(experts.shape[1]):
      e = int(experts[n, k])
      g, u = h[n] @ gate[e], h[n] @ up[e]
      out[n] += weights[n, k] * ((g / (1 + np.exp(-g))) * u) @ down[e]
  return out


def _expert_weights(e=6, d=16, f=24, seed=0):
  ks = jax.random.split(jax.random.key(seed), 3)
  return (0.3 * jax.random.normal(ks[0], (e, d, f)), 0.3 * jax.random.normal(ks[1], (e, d, f)),
          0.3 * jax.random.normal(ks[2], (e, f, d)))


@pytest.mark.parametrize("impl", ["ragged_dot", "blocked"])
def test_dispatch_equals_a_dense_per_expert_reference(impl):
  gate, up, down = _expert_weights()
  h = jax.random.normal(jax.random.key(1), (40, 16))
  spec = moe.MoeSpec(num_experts=6, top_k=2, intermediate_size=24)
  # A router that sends most tokens to expert 2 and none to expert 5: unequal groups, one
  # empty, and nothing dropped (no capacity).
  # (feature 0 is a constant 1 that the router weighs per expert)
  h = h.at[:, 0].set(1.0)
  router = 0.5 * jax.random.normal(jax.random.key(2), (16, 6))
  router = router.at[0, 2].add(3.0).at[0, 5].add(-50.0)
  weights, experts, logits = moe.route(h, router, spec)
  counts = np.bincount(np.asarray(experts).ravel(), minlength=6)
  assert counts[5] == 0 and counts[2] >= 25 and counts.sum() == 80, counts
  np.testing.assert_allclose(np.asarray(weights).sum(-1), 1.0, rtol=1e-6)
  probs = jax.nn.softmax(logits, -1)
  assert (np.take_along_axis(np.asarray(probs), np.asarray(experts), -1)
          >= np.sort(np.asarray(probs), -1)[:, -2:-1] - 1e-7).all()  # the two largest
  got = moe.experts_ffn(h, weights, experts, gate, up, down, impl)
  np.testing.assert_allclose(got, _dense_reference(h, weights, np.asarray(experts), gate, up,
                                                   down), rtol=2e-5, atol=2e-5)
  # Every assignment to one expert, and fewer tokens than experts.
  for experts in (jnp.full((40, 2), 3, jnp.int32).at[:, 1].set(0),
                  jnp.asarray([[4, 1], [1, 2], [0, 5]], jnp.int32)):
    hh, ww = h[:experts.shape[0]], weights[:experts.shape[0]]
    got = moe.experts_ffn(hh, ww, experts, gate, up, down, impl)
    np.testing.assert_allclose(got, _dense_reference(hh, ww, np.asarray(experts), gate, up,
                                                     down), rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("impl", ["ragged_dot", "blocked"])
def test_dispatch_gradients_equal_the_dense_reference(impl):
  gate, up, down = _expert_weights(seed=3)
  h = jax.random.normal(jax.random.key(4), (24, 16))
  spec = moe.MoeSpec(num_experts=6, top_k=3, intermediate_size=24)
  router = 0.5 * jax.random.normal(jax.random.key(5), (16, 6))

  def dense(h, router, gate, up, down):  # every expert on every token, masked by routing
    weights, experts, _ = moe.route(h, router, spec)
    w_NxE = jnp.zeros((h.shape[0], 6)).at[jnp.arange(h.shape[0])[:, None], experts].add(weights)
    y = jnp.einsum("nei,eid->ned", jax.nn.silu(jnp.einsum("nd,edi->nei", h, gate))
                   * jnp.einsum("nd,edi->nei", h, up), down)
    return jnp.sum(jnp.einsum("ned,ne->nd", y, w_NxE) ** 2)

  def grouped(h, router, gate, up, down):
    weights, experts, _ = moe.route(h, router, spec)
    return jnp.sum(moe.experts_ffn(h, weights, experts, gate, up, down, impl) ** 2)

  args = (h, router, gate, up, down)
  want = jax.grad(dense, argnums=range(5))(*args)
  got = jax.grad(grouped, argnums=range(5))(*args)
  for name, g, w in zip(("h", "router", "gate", "up", "down"), got, want):
    np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5, err_msg=name)
    assert np.abs(np.asarray(w)).max() > 0, name


# --------------------------------------------------------------------------- transformers
torch = pytest.importorskip("torch", reason="HF parity needs torch (pip install '.[hf]')")
transformers = pytest.importorskip("transformers", reason="HF parity needs transformers")
from test_hf_parity import assert_logits_match, hf_logits, randomized  # noqa: E402


def hf_moe(seed=0, **kw):
  shape = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48,
               moe_intermediate_size=16, num_hidden_layers=3, num_attention_heads=4,
               num_key_value_heads=2, head_dim=8, num_experts=8, num_experts_per_tok=2,
               norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[1],
               rope_theta=1000.0, rms_norm_eps=1e-5, max_position_embeddings=128,
               tie_word_embeddings=False)
  shape.update(kw)
  config = transformers.Qwen3MoeConfig(**shape)
  config._attn_implementation = "eager"  # pylint: disable=protected-access
  torch.manual_seed(seed)
  return randomized(transformers.Qwen3MoeForCausalLM(config).eval())


@pytest.fixture(scope="module", params=[dict(), dict(norm_topk_prob=False, decoder_sparse_step=2,
                                                     mlp_only_layers=[], tie_word_embeddings=True)],
                ids=["mlp_only_layer", "sparse_step_2_unnormed_tied"])
def pair(request, tmp_path_factory):
  path = tmp_path_factory.mktemp("qwen3_moe")
  hf = hf_moe(**request.param)
  hf.save_pretrained(str(path), safe_serialization=True)
  ours = load_pretrained(path, dtype="float32")
  assert ours.cfg.arch == "qwen3_moe" and ours.cfg.qk_norm and ours.cfg.moe.num_experts == 8
  return hf, ours, path


@pytest.mark.hf
def test_logits_match_transformers(pair):
  hf, ours, _ = pair
  sparse = [type(b.mlp).__name__ for b in ours.layers]
  want = ["MoE" if hf.config.decoder_sparse_step == 1 and i != 1 or
          hf.config.decoder_sparse_step == 2 and i == 1 else "MLP" for i in range(3)]
  assert sparse == want, sparse
  assert_logits_match(hf, ours, VOCAB)


@pytest.mark.hf
def test_greedy_decoding_with_the_cache_matches_transformers(pair):
  hf, ours, _ = pair
  prompt = np.random.default_rng(1).integers(0, VOCAB, (2, 5))
  with torch.no_grad():
    ref = hf.generate(torch.tensor(prompt), attention_mask=torch.ones(2, 5, dtype=torch.long),
                      do_sample=False, max_new_tokens=10, min_new_tokens=10, pad_token_id=0,
                      eos_token_id=None).numpy()[:, 5:]
  g, p = nnx.split(ours)
  b, t = prompt.shape
  logits, cache = FWD(g, p, jnp.asarray(prompt), jnp.broadcast_to(jnp.arange(t), (b, t)), None,
                      init_cache(ours.cfg, b, t + 10), jnp.zeros(b, jnp.int32))
  out = [jnp.argmax(logits[:, -1], -1)]
  for i in range(9):
    idx = jnp.full((b,), t + i, jnp.int32)
    logits, cache = FWD(g, p, out[-1][:, None], idx[:, None], None, cache, idx)
    out.append(jnp.argmax(logits[:, 0], -1))
  np.testing.assert_array_equal(np.stack([np.asarray(x) for x in out], 1), ref)


@pytest.mark.hf
def test_export_loads_in_transformers_exactly(pair, tmp_path):
  _, ours, _ = pair
  save_pretrained(tmp_path, ours)
  hf, info = transformers.AutoModelForCausalLM.from_pretrained(
      str(tmp_path), output_loading_info=True, attn_implementation="eager")
  assert not info["missing_keys"] and not info["unexpected_keys"], info
  assert type(hf).__name__ == "Qwen3MoeForCausalLM"
  tok = np.random.default_rng(2).integers(0, VOCAB, (2, 9))
  g, p = nnx.split(ours)
  logits, _ = FWD(g, p, jnp.asarray(tok), jnp.broadcast_to(jnp.arange(9), (2, 9)))
  np.testing.assert_allclose(logits, hf_logits(hf.eval(), tok), atol=1e-4, rtol=1e-4)
  # Per-expert tensors, as the hub's checkpoints hold them.
  names = export_state_dict(ours)
  i = next(i for i in range(3) if ours.cfg.moe.sparse(i))
  assert names[f"model.layers.{i}.mlp.experts.7.down_proj.weight"].shape == (32, 16)
  assert names[f"model.layers.{i}.mlp.gate.weight"].shape == (8, 32)
  assert not any(f"layers.{i}.mlp.up_proj" in n for n in names)


@pytest.mark.hf
def test_scanned_layers_equal_the_loop(tmp_path):
  hf = hf_moe(mlp_only_layers=[])
  hf.save_pretrained(str(tmp_path), safe_serialization=True)
  loop = load_pretrained(tmp_path, dtype="float32")
  scan = load_pretrained(tmp_path, cfg=loop.cfg.replace(scan_layers=True))
  tok = jnp.asarray(np.random.default_rng(3).integers(0, VOCAB, (2, 7)))
  pos = jnp.broadcast_to(jnp.arange(7), (2, 7))
  a = FWD(*nnx.split(loop), tok, pos)[0]
  b = FWD(*nnx.split(scan), tok, pos)[0]
  np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-5)
  with pytest.raises(ValueError, match="scan_layers=True needs every layer alike"):
    loop.cfg.replace(moe=moe.MoeSpec(8, 2, 16, mlp_only_layers=(1,)), scan_layers=True)


def _config_json(path, **changes):
  cfg = json.loads((path / "config.json").read_text())
  cfg.update(changes)
  (path / "config.json").write_text(json.dumps(cfg))


@pytest.mark.hf
@pytest.mark.parametrize("change, needle", [
    (dict(num_experts_per_tok=9), "num_experts_per_tok=9 is above num_experts=8"),
    (dict(shared_expert_intermediate_size=64), "no shared expert"),
    (dict(moe_intermediate_size=None), "lacks 'moe_intermediate_size'"),
])
def test_a_bad_moe_config_is_one_line(pair, tmp_path, change, needle, capsys):
  import shutil
  from distflow_jax import cli
  _, _, src = pair
  folder = tmp_path / "m"
  shutil.copytree(src, folder)
  _config_json(folder, **change)
  assert cli.main(["plan", f"--config.model.path={folder}"]) == 2
  err = capsys.readouterr().err.strip()
  assert len(err.splitlines()) == 1 and needle in err, err


@pytest.mark.hf
def test_a_missing_expert_tensor_is_named(pair, tmp_path):
  from safetensors.numpy import load_file, save_file
  import shutil
  _, _, src = pair
  folder = tmp_path / "m"
  shutil.copytree(src, folder)
  tensors = load_file(str(folder / "model.safetensors"))
  i = 1 if "model.layers.1.mlp.gate.weight" in tensors else 2  # a sparse layer
  del tensors[f"model.layers.{i}.mlp.experts.5.up_proj.weight"]
  save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
  with pytest.raises(ModelFileError, match=rf"missing tensor 'model\.layers\.{i}\.mlp\.experts"
                                           r"\.5\.up_proj\.weight'"):
    load_pretrained(folder)


def test_parameter_count_counts_the_experts():
  cfg = ModelConfig(arch="qwen3_moe", vocab_size=VOCAB, hidden_size=32, intermediate_size=48,
                    num_layers=3, num_heads=4, num_kv_heads=2, head_dim=8, qk_norm=True,
                    tie_embeddings=False, moe=moe.MoeSpec(8, 2, 16, mlp_only_layers=(1,)))
  model = Transformer(cfg, rngs=nnx.Rngs(0))
  n = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
  assert cfg.num_params == n


@pytest.mark.parametrize("impl", ["ragged_dot", "blocked"])
def test_rows_split_over_devices_dispatch_where_they_are(impl, monkeypatch):
  """Under the train steps' row sharding (8 devices), each device's rows dispatch among
  themselves (ragged_dot: a shard_map; blocked: a row at a time): the same logits as one
  device, and no program-wide sort that would gather every row onto every device."""
  from distflow_jax.models import sharding
  monkeypatch.setattr(moe, "resolve_impl", lambda _: impl)
  cfg = ModelConfig(arch="qwen3_moe", vocab_size=VOCAB, hidden_size=32, intermediate_size=48,
                    num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, qk_norm=True,
                    moe=moe.MoeSpec(8, 2, 16))
  graphdef, params = nnx.split(Transformer(cfg, rngs=nnx.Rngs(0)))
  tok = jnp.asarray(np.random.default_rng(4).integers(0, VOCAB, (8, 6)))
  pos = jnp.broadcast_to(jnp.arange(6), (8, 6))
  want = jax.jit(forward)(graphdef, params, tok, pos)[0]
  mesh = sharding.make_mesh({"data": 8})

  def sharded(p, t, q):
    with sharding.rows_sharded(mesh):
      return forward(graphdef, p, t, q)[0]
  lowered = jax.jit(sharded).lower(params, tok, pos)
  if impl == "ragged_dot":
    assert "shard_map" in lowered.as_text() or "manual" in lowered.as_text()
  got = lowered.compile()(params, tok, pos)
  np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)


def test_a_request_decodes_the_same_whatever_decodes_beside_it():
  """Continuous batching with experts: a request's tokens alone and beside four others are
  the same, its log-probs within float32 rounding (as a dense model's: 2.4e-7 here for
  both, the decode batch's other rows change the matmuls' blocking)."""
  from distflow_jax.rollout import Engine, EngineConfig, SamplingParams, generate, replica_mesh
  cfg = ModelConfig(arch="qwen3_moe", vocab_size=64, hidden_size=64, intermediate_size=128,
                    num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, qk_norm=True,
                    tie_embeddings=False, moe=moe.MoeSpec(8, 2, 32))
  eng = Engine(cfg, EngineConfig(max_concurrent_decodes=4, prefill_buckets=(8, 16),
                                 max_new_tokens=8, sampling=SamplingParams(0.8),
                                 decode_steps=3), replica_mesh(1, jax.devices()[:1]))
  params = eng.load_params(Transformer(cfg, rngs=nnx.Rngs(1)))
  prompts = [[3, 1, 4, 1, 5], [9, 2, 6, 5, 3, 5, 8, 9, 7, 9], [2, 7], [1] * 16, [11, 12, 13]]
  alone = generate(eng, params, prompts[:1], n=1, rng=jax.random.key(5), request_ids=[0])
  beside = generate(eng, params, prompts, n=1, rng=jax.random.key(5),
                    request_ids=list(range(5)))
  np.testing.assert_array_equal(alone.tokens_RxN[0], beside.tokens_RxN[0])
  np.testing.assert_allclose(alone.logprobs_RxN[0], beside.logprobs_RxN[0], atol=1e-5)
