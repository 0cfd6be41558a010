"""Chunked prefill: the step's prefill budget is shared by running prompts and new arrivals. No model:
steps are simulated (``apply``)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.kv_manager import KVManager
from engine.scheduler import Scheduler
from engine.sequence import SamplingParams, Sequence
from tests.engine.test_scheduler_preemption import MAX_STEPS, apply, check_books, run_to_end

BS = 4


def first_token_step(sch: Scheduler, kv: KVManager, target: Sequence, seqs: list[Sequence],
                     finished: list[Sequence]) -> int:
    for step in range(1, 200):
        finished += apply(sch, kv, sch.schedule())
        if target.output_ids:
            return step
    raise AssertionError("no first token")


@pytest.mark.parametrize("longs", [4, 8])
def test_long_prefills_leave_room_for_a_short_prompt_that_arrives(longs):
    # long prompts prefilling in chunks took the whole budget every step: a short prompt arriving behind
    # them was not admitted before one of them finished its prompt (16 steps here)
    kv = KVManager(1024, BS, prefix_caching=True)
    sch = Scheduler(kv, max_batch_prefill_tokens=64, max_num_seqs=16, max_prefill_chunk_tokens=16)
    seqs = [Sequence(f"long{i}", [100 + i] * 256, SamplingParams(max_new_tokens=2)) for i in range(longs)]
    for s in seqs:
        sch.add(s)
    finished: list[Sequence] = []
    finished += apply(sch, kv, sch.schedule())
    short = Sequence("short", [9] * 8, SamplingParams(max_new_tokens=2))
    sch.add(short)
    seqs.append(short)
    assert first_token_step(sch, kv, short, seqs, finished) == 1
    run_to_end(sch, kv, seqs, finished)


def test_long_prefills_take_back_the_spare_chunk_when_no_waiting_request_can_use_it():
    kv = KVManager(1024, BS, prefix_caching=True)
    sch = Scheduler(kv, max_batch_prefill_tokens=64, max_num_seqs=16, max_prefill_chunk_tokens=16)
    seqs = [Sequence(f"long{i}", [100 + i] * 64, SamplingParams(max_new_tokens=1)) for i in range(6)]
    for s in seqs:
        sch.add(s)
    for _ in range(2):  # the second step: long4 and long5 wait for a long slot, the spare goes back
        plan = sch.schedule()
        assert [(c.seq.request_id, c.num_tokens) for c in plan.chunks] == [(f"long{i}", 16) for i in range(4)]
        apply(sch, kv, plan)
    run_to_end(sch, kv, seqs, [])


@settings(max_examples=80, deadline=None)
@given(lengths=st.lists(st.integers(1, 40), min_size=1, max_size=10), arrivals=st.lists(st.integers(0, 6), max_size=10),
       chunk=st.sampled_from([4, 8, 16]), slots=st.integers(1, 5), num_blocks=st.integers(13, 120),
       max_num_seqs=st.integers(1, 8))
def test_steps_keep_to_the_budget_and_the_chunk_and_every_request_finishes(lengths, arrivals, chunk, slots,
                                                                           num_blocks, max_num_seqs):
    kv = KVManager(num_blocks, BS, prefix_caching=True)
    budget = chunk * slots
    sch = Scheduler(kv, max_batch_prefill_tokens=budget, max_num_seqs=max_num_seqs, max_prefill_chunk_tokens=chunk)
    seqs = [Sequence(f"r{i}", [i % 3] * 8 + [50 + i] * n, SamplingParams(max_new_tokens=2))  # (<= 13 blocks)
            for i, n in enumerate(lengths)]
    finished: list[Sequence] = []
    for step in range(MAX_STEPS):
        for i, s in enumerate(seqs):
            if (arrivals[i] if i < len(arrivals) else 0) == step:
                sch.add(s)
        if step > 6 and not sch.has_work():
            break
        plan = sch.schedule()
        prefill = [c.num_tokens for c in plan.chunks if c.seq.num_uncomputed > 1]
        assert sum(prefill) <= budget and all(0 < n <= chunk for n in prefill)
        finished += apply(sch, kv, plan)
        check_books(sch, kv)
    run_to_end(sch, kv, seqs, finished)


def test_long_prompts_over_the_slots_keep_their_place_and_a_cached_one_counts_as_short():
    kv = KVManager(1024, BS, prefix_caching=True)
    sch = Scheduler(kv, max_batch_prefill_tokens=64, max_num_seqs=16, max_prefill_chunk_tokens=16)
    history = [5] * 200
    finished: list[Sequence] = []
    chat = Sequence("turn1", history, SamplingParams(max_new_tokens=1))
    sch.add(chat)
    run_to_end(sch, kv, [chat], finished)
    seqs = [Sequence(f"long{i}", [100 + i] * 128, SamplingParams(max_new_tokens=1)) for i in range(6)]
    turn2 = Sequence("turn2", history + [6] * 8, SamplingParams(max_new_tokens=1))  # 200 of 208 cached
    seqs.append(turn2)
    for s in seqs:
        sch.add(s)
    admitted: list[str] = []
    for _ in range(3):
        plan = sch.schedule()
        admitted += [c.seq.request_id for c in plan.chunks if c.seq.request_id not in admitted]
        finished += apply(sch, kv, plan)
    # four long slots (64 / 16); the cached turn passes long4 and long5, which keep their order
    assert admitted == ["long0", "long1", "long2", "long3", "turn2"]
    assert turn2.output_ids and [s.request_id for s in sch.waiting] == ["long4", "long5"]
    run_to_end(sch, kv, [chat, *seqs], finished)
