"""Preemption order: when a running sequence needs a block and the pool is dry, the victim is the
newest running sequence admitted after it, or the sequence itself; never an older one, not even a
prefill the token budget left without tokens this step. No model: steps are simulated."""

from __future__ import annotations

import pytest

from engine.kv_manager import KVManager
from engine.scheduler import Scheduler
from engine.sequence import SamplingParams, Sequence, Status

BS = 4
MAX_STEPS = 200


def running(sch: Scheduler, kv: KVManager, name: str, prompt: list[int], out: list[int], computed: int,
            nblocks: int, max_new: int) -> Sequence:
    """A sequence already admitted and part-way through, holding ``nblocks`` private blocks."""
    s = Sequence(name, prompt, SamplingParams(max_new_tokens=max_new))
    s.output_ids = list(out)
    s.block_table = kv.allocator.allocate(nblocks)
    s.num_computed = computed
    s.status = Status.RUNNING
    s.admitted_once = True
    sch.running.append(s)
    return s


def apply(sch: Scheduler, kv: KVManager, plan) -> list[Sequence]:
    """What LLMEngine.step does with a plan, with a fixed token in place of the model's."""
    done = []
    for c in plan.chunks:
        seq = c.seq
        seq.num_computed += c.num_tokens
        kv.publish(seq)
        if seq.num_computed == seq.num_tokens:
            seq.output_ids.append(7)
            if len(seq.output_ids) >= seq.params.max_new_tokens:
                sch.remove(seq)
                done.append(seq)
    return done


def check_books(sch: Scheduler, kv: KVManager) -> None:
    kv.check(list(sch.running) + [s for s in sch.waiting if s.block_table])


def run_to_end(sch: Scheduler, kv: KVManager, seqs: list[Sequence], finished: list[Sequence]) -> None:
    """Step until nothing is left; every request finishes in full and no block is lost."""
    for _ in range(MAX_STEPS):
        if not sch.has_work():
            break
        finished += apply(sch, kv, sch.schedule())
        check_books(sch, kv)
    assert not sch.has_work(), "requests still queued after the step limit"
    assert sorted(s.request_id for s in finished) == sorted(s.request_id for s in seqs)
    assert all(s.status is Status.FINISHED and len(s.output_ids) == s.params.max_new_tokens for s in seqs)
    # nothing leaked: every block is free, or cached and evictable (published blocks stay cached)
    a = kv.allocator
    assert a.num_in_use == 0
    assert a.num_free + a.num_evictable == a.num_blocks
    if kv.cache is None:
        assert a.num_free == a.num_blocks


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_needy_newest_preempts_itself_not_an_idle_older_prefill(prefix_caching):
    """The reviewer's case: X's prefill takes the whole budget, A (older than B) is a prefill that gets
    0 tokens this step, B is a decode that needs a second block. B gives way, not A."""
    kv = KVManager(6, BS, prefix_caching=prefix_caching)
    sch = Scheduler(kv, max_batch_prefill_tokens=8, max_num_seqs=8, max_prefill_chunk_tokens=8)
    x = running(sch, kv, "X-oldest", list(range(100, 120)), [], 0, 2, max_new=2)
    a = running(sch, kv, "A-middle", list(range(200, 220)), [], 12, 3, max_new=2)
    b = running(sch, kv, "B-newest", [1, 2, 3, 4], [5], 4, 1, max_new=3)
    late = Sequence("late", [9] * 4, SamplingParams(max_new_tokens=2))
    sch.add(late)
    a_blocks = list(a.block_table)
    assert kv.allocator.num_free == 0

    plan = sch.schedule()

    assert [s.request_id for s in plan.preempted] == ["B-newest"]
    assert [(c.seq.request_id, c.num_tokens) for c in plan.chunks] == [("X-oldest", 8)]
    assert sch.running == [x, a]
    assert a.status is Status.RUNNING and a.block_table == a_blocks and a.num_computed == 12
    assert a.preemptions == 0
    # B waits first in line, with nothing held; nothing new was admitted in a tight step
    assert list(sch.waiting) == [b, late]
    assert b.status is Status.WAITING and b.block_table == [] and b.num_computed == 0 and b.preemptions == 1
    assert sch.num_preemptions == 1
    check_books(sch, kv)

    done = apply(sch, kv, plan)
    check_books(sch, kv)
    run_to_end(sch, kv, [x, a, b, late], done)


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_needy_middle_preempts_the_newest_after_it(prefix_caching):
    """B needs a block and C was admitted after it: C gives way; A, older and idle this step, keeps
    its blocks, and X, already scheduled, keeps its chunk."""
    kv = KVManager(7, BS, prefix_caching=prefix_caching)
    sch = Scheduler(kv, max_batch_prefill_tokens=8, max_num_seqs=8, max_prefill_chunk_tokens=8)
    x = running(sch, kv, "X-oldest", list(range(100, 120)), [], 0, 2, max_new=2)
    a = running(sch, kv, "A-middle", list(range(200, 220)), [], 12, 3, max_new=2)
    b = running(sch, kv, "B-needy", [1, 2, 3, 4], [5], 4, 1, max_new=3)
    c = running(sch, kv, "C-newest", [30, 31], [32], 2, 1, max_new=2)
    a_blocks = list(a.block_table)
    assert kv.allocator.num_free == 0

    plan = sch.schedule()

    assert [s.request_id for s in plan.preempted] == ["C-newest"]
    assert [(ch.seq.request_id, ch.num_tokens) for ch in plan.chunks] == [("X-oldest", 8), ("B-needy", 1)]
    assert sch.running == [x, a, b]
    assert a.block_table == a_blocks and a.preemptions == 0
    assert len(b.block_table) == 2
    assert list(sch.waiting) == [c] and c.status is Status.WAITING and c.block_table == []
    check_books(sch, kv)

    done = apply(sch, kv, plan)
    check_books(sch, kv)
    run_to_end(sch, kv, [x, a, b, c], done)


def test_old_prefill_takes_blocks_from_the_newest_first_and_they_wait_in_admission_order():
    """X's chunk needs two blocks, the pool has none: R then Q give way (never P, older than both, once
    X has its blocks); they wait in admission order, ahead of a request that never ran."""
    kv = KVManager(3, BS, prefix_caching=True)
    sch = Scheduler(kv, max_batch_prefill_tokens=8, max_num_seqs=8, max_prefill_chunk_tokens=8)
    x = running(sch, kv, "X-oldest", list(range(100, 108)), [], 0, 0, max_new=2)
    p = running(sch, kv, "P", [40, 41], [42], 2, 1, max_new=2)
    q = running(sch, kv, "Q", [50, 51], [52], 2, 1, max_new=2)
    r = running(sch, kv, "R-newest", [60, 61], [62], 2, 1, max_new=2)
    new = Sequence("new", [9] * 4, SamplingParams(max_new_tokens=2))
    sch.add(new)

    plan = sch.schedule()

    assert [s.request_id for s in plan.preempted] == ["R-newest", "Q"]
    assert [(ch.seq.request_id, ch.num_tokens) for ch in plan.chunks] == [("X-oldest", 8), ("P", 1)]
    assert sch.running == [x, p]
    assert list(sch.waiting) == [q, r, new]
    check_books(sch, kv)

    done = apply(sch, kv, plan)
    check_books(sch, kv)
    run_to_end(sch, kv, [x, p, q, r, new], done)


def test_a_preempted_request_comes_back_once_its_whole_length_fits():
    """A request the cache gives nothing back to (no prefix cache, or prompt log-probs) was admitted again
    as soon as one chunk fitted, prefilled a few chunks, ran the pool dry beside a growing older request
    and was preempted again, each time from its first token (49 times in a review's run)."""
    kv = KVManager(24, BS, prefix_caching=False)
    sch = Scheduler(kv, max_batch_prefill_tokens=8, max_num_seqs=8, max_prefill_chunk_tokens=8)
    a = Sequence("A-older", list(range(100, 116)), SamplingParams(max_new_tokens=72))
    b = Sequence("B-newer", list(range(200, 240)), SamplingParams(max_new_tokens=2))
    finished: list[Sequence] = []
    sch.add(a)
    computed = 0
    for step in range(MAX_STEPS):
        if step == 30:  # (A holds 12 of the 24 blocks by then, and needs 22 at its end)
            sch.add(b)
        if not sch.has_work():
            break
        plan = sch.schedule()
        computed += sum(c.num_tokens for c in plan.chunks if c.seq is b)
        finished += apply(sch, kv, plan)
        check_books(sch, kv)
    assert sorted(s.request_id for s in finished) == ["A-older", "B-newer"]
    assert b.preemptions <= 1 and computed <= 2 * (40 + 2), (b.preemptions, computed)
