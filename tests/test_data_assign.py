"""Length-balanced assignment: exact counts, per-pair block sizes, LPT-style bounds."""

import itertools

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from distflow_jax.data import assign


def _chunk_ranges(lengths, sender, num_senders, num_dst):
  """Independent re-derivation of the bound terms from the docstring."""
  full_ranges, partial_max = [0], 0
  for i in range(num_senders):
    mine = np.sort(lengths[sender == i])[::-1]
    full = len(mine) // num_dst
    for c in range(full):
      ch = mine[c * num_dst:(c + 1) * num_dst]
      full_ranges.append(ch[0] - ch[-1])
    if len(mine) % num_dst:
      partial_max = max(partial_max, mine[full * num_dst])
  return max(full_ranges), partial_max


def test_hand_example_one_sender():
  # One sender, 2 destinations, 6 rows: chunks (9,7) (5,4) (2,1).
  lengths = np.array([5, 9, 1, 7, 2, 4])
  dst = assign.assign_destinations(lengths, np.zeros(6, int), 1, 2)
  # chunk (9,7): loads 0,0 -> 9->d0, 7->d1; loads 9,7
  # chunk (5,4): d1 least -> 5->d1, 4->d0; loads 13,12
  # chunk (2,1): d1 least -> 2->d1, 1->d0; loads 14,14
  np.testing.assert_array_equal(dst, [1, 0, 0, 1, 1, 0])
  np.testing.assert_array_equal(assign.destination_loads(lengths, dst, 2), [14, 14])


def test_hand_example_partial_chunk():
  # 2 senders x 3 rows, 2 destinations: one full chunk and one partial each.
  lengths = np.array([10, 1, 6, 8, 3, 2])
  sender = np.array([0, 0, 0, 1, 1, 1])
  dst = assign.assign_destinations(lengths, sender, 2, 2)
  # full chunks: s0 (10,6) first, then s1 (8,3).
  #   (10,6): 10->d0, 6->d1 -> loads 10,6;  (8,3): 8->d1, 3->d0 -> 13,14
  # partials (1 row each; room 1,1): s1's 2 (longer) first -> d0 (load 13)
  #   -> 15,14; then s0's 1 -> d1 (only room left) -> 15,15
  np.testing.assert_array_equal(dst, [0, 1, 1, 1, 0, 0])
  np.testing.assert_array_equal(assign.destination_loads(lengths, dst, 2), [15, 15])


def test_deterministic_under_ties():
  lengths = np.full(16, 7)
  sender = np.repeat(np.arange(4), 4)
  a = assign.assign_destinations(lengths, sender, 4, 4)
  b = assign.assign_destinations(lengths.copy(), sender.copy(), 4, 4)
  np.testing.assert_array_equal(a, b)
  np.testing.assert_array_equal(assign.pair_counts(sender, a, 4, 4), np.ones((4, 4)))


@pytest.mark.parametrize("kwargs, match", [
    (dict(lengths=np.ones(6), sender=np.zeros(6, int), n=1, d=4), "multiple of 4"),
    (dict(lengths=np.ones(4), sender=np.array([0, 0, 0, 1]), n=2, d=2),
     "same number"),
    (dict(lengths=-np.ones(4), sender=np.zeros(4, int), n=1, d=2), ">= 0"),
    (dict(lengths=np.ones(4), sender=np.array([0, 0, 3, 3]), n=2, d=2),
     r"\[0, 2\)"),
    (dict(lengths=np.ones((2, 2)), sender=np.zeros(4, int), n=1, d=2), "1-D"),
])
def test_validation_names_the_problem(kwargs, match):
  with pytest.raises(ValueError, match=match):
    assign.assign_destinations(kwargs["lengths"], kwargs["sender"], kwargs["n"],
                               kwargs["d"])


@st.composite
def problems(draw):
  num_senders = draw(st.integers(1, 6))
  num_dst = draw(st.integers(1, 8))
  # R rows per sender with N*R divisible by D.
  mult = draw(st.integers(1, 6))
  rows_total_unit = np.lcm(num_senders, num_dst)
  num_rows = int(rows_total_unit * mult)
  if num_rows > 240:
    num_rows = int(rows_total_unit)
  lengths = np.array(draw(st.lists(st.integers(0, 1000), min_size=num_rows,
                                   max_size=num_rows)))
  rows_per_sender = num_rows // num_senders
  sender = np.repeat(np.arange(num_senders), rows_per_sender)
  sender = draw(st.permutations(sender.tolist()))
  return lengths, np.array(sender), num_senders, num_dst


@settings(max_examples=300, deadline=None)
@given(problems())
def test_property_counts_blocks_and_balance(problem):
  lengths, sender, n, d = problem
  num_rows = lengths.size
  r = num_rows // n
  dst = assign.assign_destinations(lengths, sender, n, d)
  # Every sample gets exactly one destination, every destination B/D samples.
  assert dst.min() >= 0 and dst.max() < d
  np.testing.assert_array_equal(np.bincount(dst, minlength=d), num_rows // d)
  # all_to_all blocks: ceil(R/D) rows at most per (sender, destination).
  pairs = assign.pair_counts(sender, dst, n, d)
  assert pairs.max() <= -(-r // d)
  if r % d == 0:
    assert np.all(pairs == r // d)
  # Balance: the spread bound of the docstring, then the LPT-style bound
  # max <= mean + max length (mean is a lower bound on the optimum).
  loads = assign.destination_loads(lengths, dst, d)
  full_range, partial_max = _chunk_ranges(lengths, sender, n, d)
  bound = full_range + (n * (r % d) // d) * partial_max
  assert loads.max() - loads.min() <= bound
  assert loads.max() <= lengths.sum() / d + lengths.max() + 1e-9


def _optimum(lengths, d):
  """Brute-force optimum of equal-count partitioning (tiny inputs)."""
  per = len(lengths) // d
  best = np.inf
  idx = list(range(len(lengths)))

  def rec(rest, loads):
    nonlocal best
    if not rest:
      best = min(best, max(loads))
      return
    first = rest[0]
    for others in itertools.combinations(rest[1:], per - 1):
      group = (first,) + others
      load = sum(lengths[g] for g in group)
      if max(loads + [load]) >= best:
        continue
      rec([x for x in rest if x not in group], loads + [load])
  rec(idx, [])
  return best


@settings(max_examples=60, deadline=None)
@given(st.integers(2, 3).flatmap(lambda d: st.tuples(
    st.just(d), st.lists(st.integers(1, 50), min_size=2 * d, max_size=3 * d)
    .filter(lambda xs: len(xs) % d == 0))))
def test_property_within_bound_of_exact_optimum(problem):
  d, lengths = problem
  lengths = np.array(lengths)
  dst = assign.assign_destinations(lengths, np.zeros(len(lengths), int), 1, d)
  got = assign.destination_loads(lengths, dst, d).max()
  opt = _optimum(lengths, d)
  assert opt <= got <= opt + lengths.max()


@settings(max_examples=100, deadline=None)
@given(st.integers(1, 4), st.integers(1, 4), st.integers(2, 4), st.integers(1, 3),
       st.randoms(use_true_random=False))
def test_property_groups_stay_together(num_senders, num_dst, g, mult, rnd):
  units = int(np.lcm(num_senders, num_dst)) * mult
  lengths = np.array([rnd.randint(0, 100) for _ in range(units * g)])
  sender = np.repeat(np.arange(num_senders), units * g // num_senders)
  dst = assign.assign_destinations(lengths, sender, num_senders, num_dst, group_size=g)
  dst_UxG = dst.reshape(-1, g)
  assert np.all(dst_UxG == dst_UxG[:, :1])
  np.testing.assert_array_equal(np.bincount(dst, minlength=num_dst),
                                units * g // num_dst)
  # Same answer as balancing the group totals directly.
  want = assign.assign_destinations(lengths.reshape(-1, g).sum(1), sender[::g],
                                    num_senders, num_dst)
  np.testing.assert_array_equal(dst_UxG[:, 0], want)


def test_group_spanning_two_senders_is_refused():
  with pytest.raises(ValueError, match=r"group 1 \(samples 2..3\) spans two senders"):
    assign.assign_destinations(np.ones(6), np.array([0, 0, 0, 1, 1, 1]), 2, 1,
                               group_size=2)
