"""The bottom-k sketch that counts a fleet's distinct hot blocks: exact while small, mergeable, and
within a few percent of the truth on sets far larger than it keeps."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cache.hot_sketch import SKETCH_SIZE, BottomK, union_estimate

hashes = st.integers(0, (1 << 64) - 1)


def sketch(values, k: int = SKETCH_SIZE) -> list[int]:
    s = BottomK(k)
    s.update(values)
    return s.values()


@settings(max_examples=200, deadline=None)
@given(sets=st.lists(st.lists(st.one_of(hashes, st.integers(0, 40)), max_size=30), max_size=6),
       k=st.integers(2, 12))
def test_merged_sketches_are_the_sketch_of_the_union(sets, k):
    union = {h for s in sets for h in s}
    parts = [sketch(s, k) for s in sets]
    assert all(len(p) <= k for p in parts)
    assert sorted(set().union(*parts, set()))[:k] == sketch(union, k) == sorted(union)[:k]
    if len(union) < k:  # exact while the union keeps fewer than k
        assert union_estimate(parts, k) == len(union)
    else:
        assert union_estimate(parts, k) > 0


def test_overlapping_sets_count_their_shared_blocks_once_within_a_few_percent():
    rng = random.Random(7)
    shared = [rng.getrandbits(64) for _ in range(6_500)]
    own = [[rng.getrandbits(64) for _ in range(n)] for n in (0, 1_000, 3_000, 20_000)]
    sets = [shared + o for o in own]  # 4 replicas that all hold the hot prefixes, and some of their own
    truth = len({h for s in sets for h in s})
    estimate = union_estimate([sketch(s) for s in sets])
    assert abs(estimate / truth - 1) < 0.1, (estimate, truth)  # k=1024: ~3% standard error
    assert abs(union_estimate([sketch(shared)] * 4) / 6_500 - 1) < 0.1  # the same set four times: once


def test_a_sketch_needs_two_values_to_estimate_from():
    with pytest.raises(ValueError):
        BottomK(1)
    assert union_estimate([]) == 0.0
