"""The backlog of replica reports: folded in slices, it ends where folding each report whole would."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from routing.report_backlog import SLICE, ReportBacklog

reports = st.lists(st.tuples(st.sampled_from("AB"), st.lists(st.integers(0, 40), max_size=600),
                             st.lists(st.integers(0, 40), max_size=600)), max_size=6)


def _recorder(held: dict[str, set[int]], calls: list[int]):
    def forget(rid, hashes):
        calls.append(len(hashes))
        held.setdefault(rid, set()).difference_update(hashes)

    def learn(rid, hashes):
        calls.append(len(hashes))
        held.setdefault(rid, set()).update(hashes)
    return forget, learn


@settings(max_examples=200, deadline=None)
@given(reports)
def test_slices_end_where_whole_reports_do(reps):
    whole: dict[str, set[int]] = {}
    for rid, removed, stored in reps:  # the reference: each report folded at once, evictions first
        whole.setdefault(rid, set()).difference_update(removed)
        whole[rid].update(stored)
    backlog, held, calls = ReportBacklog(per_replica_limit=10**6), {}, []
    for report in reps:
        assert backlog.push(*report)
    forget, learn = _recorder(held, calls)
    folds = 0
    while backlog.fold(forget, learn, budget_s=0.0):  # no budget: one slice per call
        folds += 1
    assert len(backlog) == 0
    assert all(n <= SLICE for n in calls)
    assert {k: v for k, v in held.items() if v} == {k: v for k, v in whole.items() if v}
    assert folds == max(0, len(calls) - 1)


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
