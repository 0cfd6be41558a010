"""Chunked prefill: the step's prefill budget is shared by running prompts and new arrivals. No model:
steps are simulated (``apply``)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.kv_manager import KVManager
from engine.scheduler import Scheduler
from engine.sequence import SamplingParams, Sequence
from tests.engine.test_scheduler_preemption import MAX_STEPS, apply, check_books, run_to_end, running

BS = 4


def first_token_steps(sch: Scheduler, kv: KVManager, watched: list[Sequence], arrivals=lambda step: (),
                      finished: list[Sequence] | None = None, limit: int = 2000) -> dict[str, int]:
    """Step (adding ``arrivals(step)`` first) until every watched request has its first token; the step of
    each. ``finished`` gets the requests that end meanwhile."""
    got: dict[str, int] = {}
    for step in range(1, limit):
        for s in arrivals(step):
            sch.add(s)
        done = apply(sch, kv, sch.schedule())
        if finished is not None:
            finished += done
        got.update({s.request_id: step for s in watched if s.output_ids and s.request_id not in got})
        if len(got) == len(watched):
            return got
    raise AssertionError(f"no first token for {[s.request_id for s in watched if s.request_id not in got]}")


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
    assert first_token_steps(sch, kv, [short], finished=finished) == {"short": 1}
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


@settings(max_examples=120, deadline=None)
@given(lengths=st.lists(st.integers(1, 40), min_size=1, max_size=10), arrivals=st.lists(st.integers(0, 6), max_size=10),
       chunk=st.sampled_from([4, 8, 16]), slots=st.integers(1, 5), num_blocks=st.integers(13, 120),
       max_num_seqs=st.integers(1, 8), priorities=st.none() | st.lists(st.integers(0, 2), min_size=10, max_size=10))
def test_steps_keep_to_the_budget_and_the_chunk_and_every_request_finishes(lengths, arrivals, chunk, slots,
                                                                           num_blocks, max_num_seqs, priorities):
    kv = KVManager(num_blocks, BS, prefix_caching=True)
    budget = chunk * slots
    sch = Scheduler(kv, max_batch_prefill_tokens=budget, max_num_seqs=max_num_seqs, max_prefill_chunk_tokens=chunk,
                    policy="fcfs" if priorities is None else "priority")
    seqs = [Sequence(f"r{i}", [i % 3] * 8 + [50 + i] * n,  # (<= 13 blocks)
                     SamplingParams(max_new_tokens=2, priority=priorities[i] if priorities else 0))
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
    assert turn2.output_ids and [s.request_id for s in sch.held] == ["long4", "long5"]
    run_to_end(sch, kv, [chat, *seqs], finished)


def test_a_long_prompt_waiting_for_a_long_slot_keeps_a_seat():
    # held for a long slot, it kept its place but not a seat: chat requests behind it took every seat, and
    # once a slot freed it waited for one of them to finish its 400-token answer (step 407)
    kv = KVManager(100_000, BS, prefix_caching=True)
    sch = Scheduler(kv, max_batch_prefill_tokens=32, max_num_seqs=4, max_prefill_chunk_tokens=16)  # 2 long slots
    longs = [Sequence(f"L{i}", [1000 + i] * 64, SamplingParams(max_new_tokens=400)) for i in range(3)]
    for s in longs:
        sch.add(s)
    def chats(step):
        return [Sequence(f"s{step}", [step] * 8, SamplingParams(max_new_tokens=400))] if step <= 20 else []
    assert first_token_steps(sch, kv, [longs[2]], chats)["L2"] <= 30  # (its chunks cut while chats start)


def test_under_priority_the_spare_chunk_comes_only_from_prompts_the_waiting_request_outranks():
    # an urgent prompt left its chunk to low-priority short prompts arriving every step (0 tokens a step
    # for the second urgent one: its first token at step 15, not 8)
    kv = KVManager(4096, BS, prefix_caching=False)
    sch = Scheduler(kv, max_batch_prefill_tokens=128, max_num_seqs=64, max_prefill_chunk_tokens=64, policy="priority")
    urgent = [Sequence(f"U{i}", [1 + i] * 512, SamplingParams(max_new_tokens=1, priority=0)) for i in range(2)]
    for s in urgent:
        sch.add(s)
    def low(step):
        return [Sequence(f"s{step}", [100 + step] * 64, SamplingParams(max_new_tokens=1, priority=5))]
    assert first_token_steps(sch, kv, urgent, low) == {"U0": 8, "U1": 8}


def test_a_prefill_that_left_its_chunk_to_the_spare_still_makes_a_sharer_wait_for_its_blocks():
    # with 0 tokens this step it registered nothing: a request sharing its prefix was admitted and computed
    # 56 of the 64 shared tokens again beside it
    kv = KVManager(1024, BS, prefix_caching=True)
    sch = Scheduler(kv, max_batch_prefill_tokens=32, max_num_seqs=16, max_prefill_chunk_tokens=8)
    shared = list(range(1000, 1064))
    owner = Sequence("P", shared + [1], SamplingParams(max_new_tokens=1))
    seqs = [Sequence(f"X{i}", [10 + i] * 16, SamplingParams(max_new_tokens=4)) for i in range(3)] + [owner]
    for s in seqs:
        sch.add(s)
    sharer = Sequence("W", shared + [2, 3], SamplingParams(max_new_tokens=1))
    finished = apply(sch, kv, sch.schedule())
    sch.add(sharer)
    run_to_end(sch, kv, [*seqs, sharer], finished)
    assert sharer.num_cached_prompt_tokens == 64


def short_prompt_behind_long_ones(longs: int, length: int, seats: int) -> tuple[Scheduler, KVManager]:
    """``longs`` long prompts queued (one step run), then a short one: it gets its first token in one step."""
    kv = KVManager(1_000_000, 16, prefix_caching=True)
    sch = Scheduler(kv, max_batch_prefill_tokens=4096, max_num_seqs=seats, max_prefill_chunk_tokens=512)
    for i in range(longs):
        sch.add(Sequence(f"L{i}", [10**6 + i] * length, SamplingParams(max_new_tokens=1)))
    apply(sch, kv, sch.schedule())
    short = Sequence("short", [5] * 100, SamplingParams(max_new_tokens=1))
    assert first_token_steps(sch, kv, [short], lambda step: [short] if step == 1 else []) == {"short": 1}
    return sch, kv


def test_a_short_prompt_passes_a_long_queue_of_long_prompts():
    # admission looked at 16 held long prompts a step: behind 80 a short prompt waited 133 steps
    sch, kv = short_prompt_behind_long_ones(80, 8192, seats=256)
    matched = []
    real = kv.match
    kv.match = lambda seq: matched.append(seq.request_id) or real(seq)
    for _ in range(8):  # while the slots stay taken those held unmatched are matched in turn, 16 a step,
        apply(sch, kv, sch.schedule())  # and none again: what the running prompts cache is not theirs
    assert len(matched) == len(set(matched)) and set(matched) == {s.request_id for s in sch.held[16:]}, matched


def test_with_few_seats_the_held_long_prompts_leave_one_for_a_short_prompt():
    # two long slots, four seats: the two held long prompts kept the two free seats, and a short prompt
    # waited for a long answer to end (step 207 with answers of 200)
    kv = KVManager(100_000, BS, prefix_caching=True)
    sch = Scheduler(kv, max_batch_prefill_tokens=32, max_num_seqs=4, max_prefill_chunk_tokens=16)
    longs = [Sequence(f"L{i}", [1000 + i] * 128, SamplingParams(max_new_tokens=200)) for i in range(4)]
    for s in longs:
        sch.add(s)
    apply(sch, kv, sch.schedule())
    short = Sequence("S", [7] * 8, SamplingParams(max_new_tokens=1))
    assert first_token_steps(sch, kv, [short], lambda step: [short] if step == 1 else []) == {"S": 1}


def test_a_held_long_prompt_whose_prefix_another_request_computed_is_admitted_as_short():
    # held while both long slots were taken, it was not matched again until one freed (step 38 here),
    # though a short request had computed all but 8 of its tokens at step 1
    kv = KVManager(100_000, BS, prefix_caching=True)
    sch = Scheduler(kv, max_batch_prefill_tokens=32, max_num_seqs=16, max_prefill_chunk_tokens=16)
    longs = [Sequence(f"L{i}", [1000 + i] * 600, SamplingParams(max_new_tokens=1)) for i in range(2)]
    for s in longs:
        sch.add(s)
    apply(sch, kv, sch.schedule())
    doc = list(range(100, 116))
    held = Sequence("H", doc + [1] * 8, SamplingParams(max_new_tokens=1))  # 24 tokens: long until doc is cached
    short = Sequence("S", doc, SamplingParams(max_new_tokens=1))
    sch.add(held)
    sch.add(short)
    finished: list[Sequence] = []
    assert first_token_steps(sch, kv, [short, held], finished=finished) == {"S": 1, "H": 2}
    assert held.num_cached_prompt_tokens == 16
    run_to_end(sch, kv, [*longs, held, short], finished)


def test_under_priority_a_low_priority_prompt_does_not_take_the_chunk_left_for_a_held_urgent_one():
    # the urgent long prompt was the first admissible one, so the running prompts left it a chunk; it was
    # held for a long slot, and a low-priority prompt behind it took the chunk they had left
    kv = KVManager(10_000, BS, prefix_caching=False)
    sch = Scheduler(kv, max_batch_prefill_tokens=64, max_num_seqs=16, max_prefill_chunk_tokens=16, policy="priority")
    mid = [Sequence(f"M{i}", [10 + i] * 400, SamplingParams(max_new_tokens=1, priority=1)) for i in range(4)]
    for s in mid:
        sch.add(s)
    apply(sch, kv, sch.schedule())
    sch.add(Sequence("U", [1] * 400, SamplingParams(max_new_tokens=1, priority=0)))
    sch.add(Sequence("low", [2] * 8, SamplingParams(max_new_tokens=1, priority=5)))
    plan = sch.schedule()
    assert [(c.seq.request_id, c.num_tokens) for c in plan.chunks] == [(f"M{i}", 16) for i in range(4)]
    assert [s.request_id for s in sch.held] == ["U"]


def test_a_step_that_preempts_still_gives_the_unused_spare_chunk_back():
    # a preemption ended the step before the chunk left to the waiting request went back: the second
    # running prompt computed nothing that step
    kv = KVManager(14, BS, prefix_caching=True)
    sch = Scheduler(kv, max_batch_prefill_tokens=32, max_num_seqs=16, max_prefill_chunk_tokens=16)
    a1 = running(sch, kv, "A1", [1] * 36, [], computed=0, nblocks=4, max_new=1)
    a2 = running(sch, kv, "A2", [2] * 36, [], computed=0, nblocks=4, max_new=1)
    b = running(sch, kv, "B", [3] * 8, [5] * 17, computed=24, nblocks=6, max_new=40)  # its next token needs a block
    waiting = Sequence("W", [4] * 8, SamplingParams(max_new_tokens=1))
    sch.add(waiting)
    plan = sch.schedule()
    assert plan.preempted == [b]
    assert [(c.seq.request_id, c.num_tokens) for c in plan.chunks] == [("A1", 16), ("A2", 16)]
    finished = apply(sch, kv, plan)
    run_to_end(sch, kv, [a1, a2, b, waiting], finished)


def test_a_short_prompt_behind_hundreds_of_held_long_prompts_is_still_seen():
    # the held long prompts filled the 256 places admission looked down the queue: a short prompt
    # behind 300 of them waited 23 steps
    short_prompt_behind_long_ones(300, 2048, seats=512)


def test_a_cached_chat_turn_behind_a_burst_of_long_prompts_is_matched_soon():
    # held by its length (past the matches a step affords), it was matched only once every long prompt
    # ahead of it had left: its first token at step 29 behind 100 of them (12 before long prompts were
    # held apart; 7 now: the long prompts ahead of it take the slots as they free, then it passes them)
    kv = KVManager(100_000, 16, prefix_caching=True)
    sch = Scheduler(kv, max_batch_prefill_tokens=4096, max_num_seqs=256, max_prefill_chunk_tokens=512)
    history = list(range(2000))
    turn1 = Sequence("turn1", history, SamplingParams(max_new_tokens=1))
    sch.add(turn1)
    finished: list[Sequence] = []
    run_to_end(sch, kv, [turn1], finished)
    longs = [Sequence(f"L{i}", [10**6 + i] * 2048, SamplingParams(max_new_tokens=1)) for i in range(100)]
    turn2 = Sequence("turn2", history + [7] * 40, SamplingParams(max_new_tokens=1))
    for s in [*longs, turn2]:
        sch.add(s)
    assert first_token_steps(sch, kv, [turn2], finished=finished)["turn2"] <= 8
