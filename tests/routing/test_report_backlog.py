"""The backlog of replica reports: folded in slices, it ends where folding each report whole would."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cache.hashing import PackedHashes, pack_hashes
from routing.report_backlog import SLICE, ReportBacklog

reports = st.lists(st.tuples(st.sampled_from("AB"), st.lists(st.integers(0, 40), max_size=600),
                             st.lists(st.integers(0, 40), max_size=600), st.none() | st.integers(0, 50)), max_size=6)


def _recorder(held: dict[str, set[int]], calls: list[int], bounds: list | None = None):
    def forget(rid, hashes):
        calls.append(len(hashes))
        held.setdefault(rid, set()).difference_update(hashes)

    def learn(rid, hashes):
        calls.append(len(hashes))
        held.setdefault(rid, set()).update(hashes)

    def bound(rid, cached_blocks):  # what the replica's index held when its count bounded it
        (bounds if bounds is not None else []).append((rid, cached_blocks, frozenset(held.get(rid, ()))))
    return forget, learn, bound


@settings(max_examples=200, deadline=None)
@given(reports)
def test_slices_end_where_whole_reports_do_and_bounds_come_after_their_hashes(reps):
    whole: dict[str, set[int]] = {}
    whole_bounds = []
    for rid, removed, stored, cached in reps:  # the reference: each report folded at once, evictions first
        whole.setdefault(rid, set()).difference_update(removed)
        whole[rid].update(stored)
        if cached is not None:
            whole_bounds.append((rid, cached, frozenset(whole[rid])))
    backlog, held, calls, bounds = ReportBacklog(per_replica_limit=10**6), {}, [], []
    forget, learn, bound = _recorder(held, calls, bounds)
    for rid, removed, stored, cached in reps:
        assert backlog.push(rid, removed, stored)
        if cached is not None:
            backlog.push_bound(rid, cached, bound)
    folds, at_once = 0, len(bounds)  # (a bound with nothing of its replica waiting applies at once)
    while backlog.fold(forget, learn, bound, budget_s=0.0):  # no budget: one slice per call
        folds += 1
    assert len(backlog) == 0 and not backlog
    assert all(n <= SLICE for n in calls)
    assert {k: v for k, v in held.items() if v} == {k: v for k, v in whole.items() if v}
    for rid in "AB":  # each replica's bounds in its order, each after its own hashes before it
        assert [b for b in bounds if b[0] == rid] == [b for b in whole_bounds if b[0] == rid]
    assert folds == max(0, len(calls) + len(bounds) - at_once - 1)  # one slice or bound per call


def test_an_overflowing_replica_lets_go_of_its_own_backlog_only():
    backlog = ReportBacklog(per_replica_limit=1000)
    assert backlog.push("A", [], list(range(600)))
    assert backlog.push("B", [1], [2])
    assert not backlog.push("A", list(range(300)), list(range(300)))  # 1,200 would wait for A
    assert backlog.dropped == 1200 and len(backlog) == 2
    held, calls = {}, []
    assert not backlog.fold(*_recorder(held, calls), budget_s=1.0)
    assert held == {"B": {2}}
    assert backlog.push("A", [], [7])  # room again once let go


def test_a_replica_that_leaves_takes_its_backlog_with_it():
    backlog = ReportBacklog(per_replica_limit=1000)
    backlog.push("A", [1, 2], [3])
    backlog.push("B", [], [4])
    backlog.drop("A")
    held, calls = {}, []
    backlog.fold(*_recorder(held, calls), budget_s=1.0)
    assert held == {"B": {4}} and len(backlog) == 0


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 2**64 - 1), max_size=300), st.integers(-320, 320), st.integers(-320, 320),
       st.sampled_from([1, 1, 2, 3, -1]))
def test_packed_hashes_read_as_the_list_they_pack(hashes, start, stop, step):
    packed = PackedHashes(pack_hashes(hashes))
    assert len(packed) == len(hashes) and packed[start:stop:step] == hashes[start:stop:step]
    if hashes:
        assert packed[start % len(hashes)] == hashes[start % len(hashes)] and packed[-1] == hashes[-1]


@pytest.mark.parametrize("junk", ["zz" * 8 * 3, " " * 16 * 3, "0x" + "0" * 46, "_" * 48])
def test_hashes_that_are_not_hex_are_let_go_not_folded_forever(junk):
    with pytest.raises(ValueError):  # (bytes.fromhex skipped whitespace: a slice of spaces was no hashes)
        PackedHashes(junk)[0:2]
    with pytest.raises(ValueError):  # (and int() took 0x, + and _)
        PackedHashes(junk)[0]
    backlog, held, calls = ReportBacklog(per_replica_limit=1000), {}, []
    backlog.push("A", PackedHashes(junk), PackedHashes(pack_hashes([5, 6])))
    assert not backlog.fold(*_recorder(held, calls), budget_s=float("inf"))  # (it never returned)
    assert held == {"A": {5, 6}} and backlog.dropped == 3 and len(backlog) == 0


def test_a_bound_waiting_in_an_overflowing_backlog_is_no_dropped_hash():
    backlog, bounds = ReportBacklog(per_replica_limit=10), []
    backlog.push("A", [], [1, 2, 3])
    backlog.push_bound("A", 2, lambda rid, n: bounds.append(n))
    assert not backlog.push("A", [], list(range(9)))
    assert backlog.dropped == 12 and not backlog and bounds == []  # the hashes let go; the bound with them
    backlog.push_bound("A", 5, lambda rid, n: bounds.append(n))
    assert bounds == [5]  # nothing of A waits: at once
