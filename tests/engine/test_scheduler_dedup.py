"""Requests that wait for a block another prefill is computing: they are not matched against the cache
again every step (a burst of prompts sharing a long prefix re-matched every one each step), and each
starts as soon as that prefill has passed what it shares. No model: steps are simulated."""

from __future__ import annotations

from collections import Counter

from engine.kv_manager import KVManager
from engine.scheduler import Scheduler
from engine.sequence import SamplingParams, Sequence, Status
from tests.engine.test_scheduler_preemption import BS, apply, run_to_end


def test_waiting_requests_match_once_more_when_the_prefill_they_wait_for_has_passed_their_prefix():
    kv = KVManager(256, BS, prefix_caching=True)
    # a chunk is 8 tokens and a step takes 16: room to admit others beside the long prefill
    sch = Scheduler(kv, max_batch_prefill_tokens=16, max_num_seqs=16, max_prefill_chunk_tokens=8)
    prefix = list(range(10, 74))  # 64 tokens: 8 steps of 8
    owner = Sequence("owner", prefix + [1, 2], SamplingParams(max_new_tokens=2))
    full = [Sequence(f"full{i}", prefix + [3 + i], SamplingParams(max_new_tokens=2)) for i in range(4)]
    part = Sequence("part", prefix[:24] + [99] * 8, SamplingParams(max_new_tokens=2))  # shares 6 blocks
    seqs = [owner, *full, part]
    for s in seqs:
        sch.add(s)
    matched: Counter[str] = Counter()
    real = kv.match

    def counting(seq):
        matched[seq.request_id] += 1
        return real(seq)

    kv.match = counting
    started: dict[str, int] = {}
    finished: list[Sequence] = []
    for step in range(40):
        if not sch.has_work():
            break
        finished += apply(sch, kv, sch.schedule())
        for s in seqs:
            if s.status is Status.RUNNING or s.status is Status.FINISHED:
                started.setdefault(s.request_id, step)
    run_to_end(sch, kv, seqs, finished)
    assert max(matched[s.request_id] for s in full) <= 2, matched  # once to wait, once to go (was: every step)
    assert started["part"] <= 3, started  # right after the owner computed its 24 shared tokens
    assert min(started[s.request_id] for s in full) >= 8  # the whole prefix first: computed once


def test_waiting_requests_go_when_the_prefill_they_wait_for_is_aborted():
    kv = KVManager(256, BS, prefix_caching=True)
    sch = Scheduler(kv, max_batch_prefill_tokens=16, max_num_seqs=16, max_prefill_chunk_tokens=8)
    prefix = list(range(10, 74))
    owner = Sequence("owner", prefix + [1, 2], SamplingParams(max_new_tokens=2))
    waiters = [Sequence(f"w{i}", prefix + [3 + i], SamplingParams(max_new_tokens=2)) for i in range(3)]
    for s in [owner, *waiters]:
        sch.add(s)
    finished: list[Sequence] = []
    for _ in range(2):
        finished += apply(sch, kv, sch.schedule())
    assert all(w.waits_on is not None for w in waiters)
    sch.remove(owner)  # the client left
    run_to_end(sch, kv, waiters, finished)


def test_what_a_preempted_waiter_shares_counts_its_output_too():
    """Its key covers its output: counting its prompt alone gave less than was known, and it went back to
    being matched every step."""
    from engine.scheduler import _shared_blocks

    tokens = list(range(100, 116))
    waiter = Sequence("w", tokens[:6], SamplingParams())
    waiter.output_ids = tokens[6:]
    owner = Sequence("o", tokens, SamplingParams())
    assert _shared_blocks(waiter, owner, 12, BS) == 16
    assert _shared_blocks(Sequence("x", tokens[:9] + [1], SamplingParams()), owner, 4, BS) == 8


def test_a_request_waiting_for_a_shared_prefill_keeps_its_seat():
    # the owner prefills a long prefix; a request sharing it waits; later requests took every seat
    # (max_num_seqs) and the waiter waited for one of them to finish: 300 steps on the real engine
    kv = KVManager(1024, BS, prefix_caching=True)
    sch = Scheduler(kv, max_batch_prefill_tokens=16, max_num_seqs=3, max_prefill_chunk_tokens=8)
    prefix = list(range(10, 74))  # 64 tokens: 8 steps of 8
    owner = Sequence("owner", prefix + [1, 2], SamplingParams(max_new_tokens=100))  # (its seat stays taken)
    waiter = Sequence("waiter", prefix + [3], SamplingParams(max_new_tokens=2))
    later = [Sequence(f"late{i}", [200 + i] * 5, SamplingParams(max_new_tokens=100)) for i in range(4)]
    seqs = [owner, waiter, *later]
    for s in seqs:
        sch.add(s)
    started: dict[str, int] = {}
    finished: list[Sequence] = []
    for step in range(500):
        finished += apply(sch, kv, sch.schedule())
        for s in seqs:
            if s.status in (Status.RUNNING, Status.FINISHED):
                started.setdefault(s.request_id, step)
        if "waiter" in started:
            break
    # right after the owner's prefix (16 steps: its chunks share the steps with a decode), not after a
    # later request's 100-token decode freed a seat
    assert started.get("waiter", 999) <= 20, started
    assert [s.request_id for s in later if s.request_id in started] == ["late0"]  # the one seat left free
    run_to_end(sch, kv, seqs, finished)


def _first_token_step(sch: Scheduler, kv: KVManager, watched: Sequence, arrivals, limit: int = 200) -> int:
    for step in range(limit):
        for s in arrivals(step):
            sch.add(s)
        apply(sch, kv, sch.schedule())
        if watched.output_ids:
            return step
    raise AssertionError(f"{watched.request_id} got no first token in {limit} steps")


def test_a_request_stops_waiting_for_a_prefill_that_stands_still():
    """The prefill it waited for got no tokens, step after step (the chunk it left to requests arriving
    every step): the request waited 12 steps for 48 tokens while later ones went first."""
    kv = KVManager(40_000, BS, prefix_caching=True)
    sch = Scheduler(kv, max_batch_prefill_tokens=4096, max_num_seqs=256, max_prefill_chunk_tokens=512)  # 8 long slots
    longs = [Sequence(f"L{i}", [1000 * (i + 1) + t for t in range(3000)], SamplingParams(max_new_tokens=1))
             for i in range(8)]
    for s in longs:
        sch.add(s)
    for _ in range(2):
        apply(sch, kv, sch.schedule())
    last = longs[-1]
    sharer = Sequence("W", last.prompt_ids[:last.num_computed + 48] + [7] * 64, SamplingParams(max_new_tokens=1))

    def shorts(step):
        return ([sharer] if step == 0 else []) + [Sequence(f"s{step}", [50 + step % 200] * 512,
                                                           SamplingParams(max_new_tokens=1))]

    assert _first_token_step(sch, kv, sharer, shorts) <= 2


def test_under_priority_a_request_waits_for_no_prefill_it_outranks():
    """An urgent request that shares a prefix with a low-priority prompt, whose chunks the urgent traffic
    cuts, waited on it and came later than with nothing shared."""
    def run(shared: bool) -> int:
        kv = KVManager(4096, BS, prefix_caching=True)
        sch = Scheduler(kv, max_batch_prefill_tokens=32, max_num_seqs=64, max_prefill_chunk_tokens=16,
                        policy="priority")
        low = Sequence("Lo", list(range(1000, 1400)), SamplingParams(max_new_tokens=1, priority=5))
        sch.add(low)
        apply(sch, kv, sch.schedule())
        urgent = Sequence("W", (low.prompt_ids[:120] if shared else list(range(5000, 5120))) + [7] * 8,
                          SamplingParams(max_new_tokens=1, priority=0))

        def traffic(step):
            return ([urgent] if step == 0 else []) + [
                Sequence(f"s{step}", [60 + step] * 8, SamplingParams(max_new_tokens=1, priority=0))]

        return _first_token_step(sch, kv, urgent, traffic)

    assert run(shared=True) <= run(shared=False)
