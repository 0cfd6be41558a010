"""The ``priority`` scheduling policy (vLLM's): waiting requests are admitted lowest ``priority`` first
(then first come), and when the pool runs dry the running request that ranks last gives way, even
when it is older than the one that needs the block. Under ``fcfs`` a priority is refused."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.kv_manager import KVManager
from engine.llm_engine import RequestError
from engine.scheduler import Scheduler
from engine.sequence import SamplingParams, Sequence, Status
from tests.engine.test_scheduler_preemption import apply, run_to_end

BS = 4


def seq(name: str, prompt: list[int], priority: int, max_new: int = 1) -> Sequence:
    return Sequence(name, prompt, SamplingParams(max_new_tokens=max_new, priority=priority))


def admitted_order(sch: Scheduler, kv: KVManager, seqs: list[Sequence]) -> list[str]:
    """Names in the order of their first admission, stepping until every request is done in full."""
    order: list[str] = []
    done: list[Sequence] = []
    for _ in range(400):
        if not sch.has_work():
            break
        plan = sch.schedule()
        order += [c.seq.request_id for c in plan.chunks if c.seq.request_id not in order]
        done += apply(sch, kv, plan)
    assert sorted(s.request_id for s in done) == sorted(s.request_id for s in seqs)
    assert all(len(s.output_ids) == s.params.max_new_tokens for s in seqs)
    return order


@pytest.mark.parametrize("policy, expected", [("priority", ["D", "B", "A", "C"]), ("fcfs", ["A", "B", "C", "D"])])
def test_waiting_requests_are_admitted_by_priority_then_arrival(policy, expected):
    kv = KVManager(32, BS, prefix_caching=True)
    sch = Scheduler(kv, max_batch_prefill_tokens=64, max_num_seqs=1, policy=policy)
    seqs = [seq("A", [1] * 8, 1), seq("B", [2] * 8, 0), seq("C", [3] * 8, 1), seq("D", [4] * 8, -1)]
    for s in seqs:
        sch.add(s)
    assert admitted_order(sch, kv, seqs) == expected


@pytest.mark.parametrize("policy", ["priority", "fcfs"])
def test_dry_pool_preempts_the_lowest_priority_not_the_newest(policy):
    """L (priority 5) runs first, H (priority 0) joins; both decode until the pool is dry. Under
    ``priority`` L gives way although it is older, and M (priority 1, arriving after L was preempted)
    runs before L comes back; under ``fcfs`` H, the newest, gives way, and L keeps running."""
    kv = KVManager(5, BS, prefix_caching=False)
    sch = Scheduler(kv, max_batch_prefill_tokens=64, max_num_seqs=2, policy=policy)
    low = seq("L", [1] * 4, 5, max_new=8)
    sch.add(low)
    apply(sch, kv, sch.schedule())
    high = seq("H", [2] * 4, 0, max_new=8)
    sch.add(high)
    preempted: list[str] = []
    for _ in range(8):  # 5 blocks for two sequences of up to 12 tokens (3 blocks each): one must give way
        plan = sch.schedule()
        preempted += [s.request_id for s in plan.preempted]
        apply(sch, kv, plan)
        if preempted:
            break
    assert preempted == (["L"] if policy == "priority" else ["H"])
    rest = [s for s in (low, high) if s.status is not Status.FINISHED]
    if policy == "priority":
        assert low.status is Status.WAITING and high.status is Status.RUNNING
        mid = seq("M", [3] * 4, 1)
        sch.add(mid)
        assert [s.request_id for s in sch.waiting] == ["M", "L"]  # M outranks L although it came later
        rest.append(mid)
    run_to_end(sch, kv, rest, [])


@settings(max_examples=60, deadline=None)
@given(priorities=st.lists(st.integers(-3, 3), min_size=1, max_size=12), num_blocks=st.integers(4, 24),
       max_num_seqs=st.integers(1, 4), max_new=st.integers(1, 6))
def test_first_admissions_follow_priority_and_nothing_is_lost(priorities, num_blocks, max_num_seqs, max_new):
    """Whatever the pool and batch, every request finishes in full, every block comes back, and
    requests are first admitted in (priority, arrival) order (a preempted one may come back later).
    (Prompts share no block: one that waits for another's prefill of a shared block lets the next pass.)"""
    kv = KVManager(num_blocks, BS, prefix_caching=True)
    sch = Scheduler(kv, max_batch_prefill_tokens=16, max_num_seqs=max_num_seqs, max_prefill_chunk_tokens=8,
                    policy="priority")
    seqs = [seq(f"r{i}", [i + 1] * 6, p, max_new) for i, p in enumerate(priorities)]
    for s in seqs:
        sch.add(s)
    order = admitted_order(sch, kv, seqs)
    assert order == [s.request_id for s in sorted(seqs, key=lambda s: (s.params.priority, s.queue_order))]
    assert kv.allocator.num_in_use == 0


def test_engine_refuses_a_priority_under_fcfs_and_orders_by_it_under_priority(make_engine):
    fcfs = make_engine()
    with pytest.raises(RequestError, match="scheduling-policy priority"):
        fcfs.add_request([1, 2, 3], SamplingParams(max_new_tokens=2, priority=1))
    fcfs.add_request([1, 2, 3], SamplingParams(max_new_tokens=2, priority=0))  # 0 is everyone's default
    with pytest.raises(RequestError, match="priority must be an integer"):
        fcfs.add_request([1, 2, 3], SamplingParams(max_new_tokens=2, priority=1.5))
    eng = make_engine(scheduling_policy="priority", max_num_seqs=1)
    for name, p in (("late-low", 3), ("urgent", -1), ("normal", 0)):
        eng.add_request([5, 6, 7, 8], SamplingParams(max_new_tokens=3, priority=p), request_id=name)
    finished = []
    while eng.has_work():
        finished += [ev.request_id for ev in eng.step() if ev.finished]
    assert finished == ["urgent", "normal", "late-low"]


@pytest.mark.parametrize("policy, steps", [("priority", 4), ("fcfs", 13)])
def test_a_trickle_of_short_low_priority_prompts_does_not_slow_an_urgent_long_one(policy, steps):
    # each short prompt's first token cut every other prompt's chunk to a quarter, whatever their ranks:
    # under priority an urgent long prompt then crawled behind requests it outranks (fcfs keeps the cut)
    kv = KVManager(512, BS, prefix_caching=False)
    sch = Scheduler(kv, max_batch_prefill_tokens=128, max_num_seqs=64, max_prefill_chunk_tokens=64, policy=policy)
    urgent = seq("U", [1] * 256, 0)
    sch.add(urgent)
    done: list[Sequence] = []
    for step in range(1, 40):
        sch.add(seq(f"s{step}", [2 + step] * 4, 5 if policy == "priority" else 0))
        done += apply(sch, kv, sch.schedule())
        if urgent.output_ids:  # its prompt is computed: its first token
            break
    assert step == steps
