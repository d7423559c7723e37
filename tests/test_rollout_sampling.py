"""Sampling maths against numpy: top-k / top-p masks, temperature, greedy, logprobs, PRNG
streams."""

import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from distflow_jax.rollout.engine.sampling import (SamplingParams, request_keys, sample,
                                                  sampling_logits)


def _np_log_softmax(x):
  x = x - x.max(-1, keepdims=True)
  return x - np.log(np.exp(x).sum(-1, keepdims=True))


def test_top_k_keeps_k_largest():
  x = np.array([[0.1, 3.0, -1.0, 2.0, 0.5]], np.float32)
  got = np.asarray(sampling_logits(jnp.asarray(x), SamplingParams(temperature=2.0, top_k=2)))
  want = np.array([[-np.inf, 1.5, -np.inf, 1.0, -np.inf]], np.float32)
  np.testing.assert_array_equal(got, want)


def test_top_p_keeps_smallest_prefix_reaching_p():
  # probs 0.5, 0.25, 0.125, 0.125 (sorted); p=0.6 keeps the first two (0.5 < 0.6, 0.75 >= 0.6)
  probs = np.array([0.125, 0.5, 0.125, 0.25])
  x = np.log(probs)[None].astype(np.float32)
  got = np.asarray(sampling_logits(jnp.asarray(x), SamplingParams(top_p=0.6)))
  keep = np.isfinite(got[0])
  np.testing.assert_array_equal(keep, [False, True, False, True])
  np.testing.assert_allclose(got[0, keep], x[0, keep], rtol=1e-6)
  # p=0.5 keeps only the top token: the mass before it (0) is < 0.5, before the next is 0.5
  got = np.asarray(sampling_logits(jnp.asarray(x), SamplingParams(top_p=0.5)))
  np.testing.assert_array_equal(np.isfinite(got[0]), [False, True, False, False])


def _np_top_p_keep(x, top_p):
  """The rule in float64: keep a token when the mass strictly above it is below top_p."""
  p = np.exp(x - x.max(-1, keepdims=True))
  p /= p.sum(-1, keepdims=True)
  above = np.array([[p[b][x[b] > x[b, j]].sum() for j in range(x.shape[1])]
                    for b in range(x.shape[0])])
  return above < top_p, above


@pytest.mark.parametrize("top_p", [0.05, 0.3, 0.9, 0.999])
def test_top_p_by_bisection_is_the_sort_rule_with_ties_and_masked_tokens(top_p):
  rs = np.random.RandomState(int(top_p * 1000))
  x = (rs.randn(16, 300) * rs.uniform(0.3, 4.0, (16, 1))).astype(np.float32)
  x[:, 5:40] = np.round(x[:, 5:40], 1)  # ties, some at the cut
  x[3, :] = x[3, 0]  # a row of one value: all tied, all kept
  x[4, 100:] = -np.inf  # top-k's masked tokens
  x[5, 7], x[5, 8] = 0.0, -0.0  # +0 and -0 are one logit
  got = np.isfinite(np.asarray(jax.jit(sampling_logits, static_argnums=1)(
      jnp.asarray(x), SamplingParams(top_p=top_p))))
  want, above = _np_top_p_keep(x.astype(np.float64), top_p)
  near = np.abs(above - top_p) < 1e-5  # float32 rounding may put these on either side
  assert near.mean() < 0.01
  np.testing.assert_array_equal(got[~near], want[~near])
  assert got[3].all() and not got[4, 100:].any() and got[5, 7] == got[5, 8]
  # Ties are kept together: every kept logit's equals are kept.
  for b in range(16):
    cut = x[b][got[b]].min()
    np.testing.assert_array_equal(got[b], x[b] >= cut)


def test_top_p_sorts_nothing():
  hlo = jax.jit(sampling_logits, static_argnums=1).lower(
      jnp.zeros((4, 1000), jnp.float32), SamplingParams(top_p=0.9)).as_text()
  assert "sort" not in hlo


def test_greedy_picks_argmax_and_returns_model_logprob():
  rs = np.random.RandomState(0)
  x = rs.randn(5, 11).astype(np.float32)
  keys = request_keys(jax.random.key(0), jnp.arange(5))
  tok, lp, slp = sample(jnp.asarray(x), keys, jnp.zeros(5, jnp.int32), SamplingParams(0.0))
  np.testing.assert_array_equal(np.asarray(tok), x.argmax(-1))
  np.testing.assert_allclose(np.asarray(lp), _np_log_softmax(x)[np.arange(5), x.argmax(-1)],
                             rtol=1e-6, atol=1e-6)
  np.testing.assert_array_equal(np.asarray(slp), 0.0)


def test_logprob_is_untruncated_at_the_temperature_and_sampling_logprob_is_truncated():
  rs = np.random.RandomState(1)
  x = rs.randn(64, 9).astype(np.float32)
  sp = SamplingParams(temperature=0.7, top_k=4, top_p=0.9)
  keys = request_keys(jax.random.key(3), jnp.arange(64))
  tok, lp, slp = (np.asarray(a) for a in sample(jnp.asarray(x), keys, jnp.zeros(64, jnp.int32), sp))
  rows = np.arange(64)
  np.testing.assert_allclose(lp, _np_log_softmax(x / 0.7)[rows, tok], rtol=1e-5, atol=1e-6)
  trunc = np.asarray(sampling_logits(jnp.asarray(x), sp))
  assert np.isfinite(trunc[rows, tok]).all(), "sampled a token outside top-k / top-p"
  np.testing.assert_allclose(slp, _np_log_softmax(trunc)[rows, tok], rtol=1e-5, atol=1e-6)
  assert (slp >= lp - 1e-6).mean() > 0.9  # truncation concentrates mass
  # Without truncation the two are the same distribution's.
  tok, lp, slp = (np.asarray(a) for a in sample(jnp.asarray(x), keys, jnp.zeros(64, jnp.int32),
                                                 SamplingParams(temperature=0.7)))
  np.testing.assert_allclose(lp, slp, rtol=1e-6, atol=1e-6)


def test_sample_frequencies_match_tempered_softmax():
  x = np.array([1.0, 0.0, -1.0, 0.5], np.float32)
  n = 4000
  sp = SamplingParams(temperature=1.5)
  keys = request_keys(jax.random.key(7), jnp.arange(n))
  tok, _, _ = sample(jnp.broadcast_to(jnp.asarray(x), (n, 4)), keys, jnp.zeros(n, jnp.int32), sp)
  freq = np.bincount(np.asarray(tok), minlength=4) / n
  want = np.exp(_np_log_softmax(x / 1.5))
  np.testing.assert_allclose(freq, want, atol=0.03)


def test_stream_depends_on_request_and_step_only():
  x = jnp.zeros((3, 50))
  sp = SamplingParams(temperature=1.0)
  keys = request_keys(jax.random.key(0), jnp.array([5, 6, 5]))
  tok, _, _ = sample(x, keys, jnp.array([2, 2, 2]), sp)
  assert tok[0] == tok[2]
  tok2, _, _ = sample(x, keys, jnp.array([2, 2, 3]), sp)
  np.testing.assert_array_equal(tok2[:2], tok[:2])
  draws = [int(sample(x, keys, jnp.full((3,), s), sp)[0][0]) for s in range(8)]
  assert len(set(draws)) > 1


@pytest.mark.parametrize("kw, word", [(dict(temperature=-1.0), "temperature"),
                                      (dict(top_p=0.0), "top_p"), (dict(top_k=-2), "top_k")])
def test_bad_params_name_the_field(kw, word):
  with pytest.raises(ValueError, match=word):
    SamplingParams(**kw)


@pytest.mark.timeout(120)
def test_bench_top_p_prints_both_contenders_and_their_agreement(capsys):
  sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                  "tools"))
  import bench_top_p

  assert bench_top_p.main(["--vocab", "512", "--batch", "2", "--rounds", "2"]) == 0
  out = capsys.readouterr().out
  (row,) = [l for l in out.splitlines() if l.strip().startswith("2 ")]
  assert row.split()[1] == "512" and row.split()[-1] == "1.000000", out
  assert out.count("load average") == 2
