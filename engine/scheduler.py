"""Continuous batching: which sequences run in the next step, and how many tokens each.

Every step: running decodes (1 token each), running prefills continued in chunks of at most
``max_prefill_chunk_tokens``, then waiting requests admitted in queue order while the prefill budget
(``max_batch_prefill_tokens``) and the pool allow. Chunking keeps a step short, so a cache hit admitted
next to a long uncached prompt gets its first token after one short step, not after the whole prompt
(and in a step where some request gets its first token, the other prompts' chunks shrink further).
Long prompts (more than one chunk left) prefill at most as many at once as the budget has chunks, and
leave one chunk to the waiting requests, so a short prompt is not stuck behind a burst of long ones.
Admission matches the radix cache first, so only the uncached suffix is prefilled. No request reserves
``input + max_new_tokens`` up front: blocks are taken as tokens arrive, and when the pool runs dry the
most recently admitted sequence is preempted (its written blocks stay cached, so its recompute is
mostly a cache hit).

Under the ``priority`` policy (vLLM's), both queues are kept in (priority, arrival) order instead: the
waiting request with the lowest ``priority`` value is admitted first, and the running one with the highest
gives way first when the pool runs dry. A running request is never preempted to admit a waiting one.
"""

from __future__ import annotations

import bisect
import itertools
import weakref
from collections import deque
from dataclasses import dataclass, field

from engine.kv_manager import KVManager
from engine.sequence import Sequence, Status

# a prompt whose log-probabilities are asked for returns every row's logits ([tokens, vocabulary] floats):
# a step computes at most this many such rows, over all its prompts (256 MB at a 128k vocabulary)
PROMPT_LOGPROBS_CHUNK = 512
# while every long-prompt slot is taken, admission looks this far down the queue for a prompt it can
# admit, matching at most ADMISSION_MATCHES prompts against the cache to tell (the others by their length)
ADMISSION_LOOKAHEAD = 256
ADMISSION_MATCHES = 16
# held long prompts (see Scheduler.held) matched per step: first those held unmatched, then, in turn,
# those the cache may now hold more of (one whose prefix another request computed meanwhile may be
# short now), found by a one-block look at up to RECHECK_WALK of them
RECHECK_MATCHES = 16
RECHECK_WALK = 32
# long prompts held by their length per step at most (each costs a few microseconds: a burst of 50,000
# is sorted out over steps, not in one step of 70 ms)
ADMISSION_HOLDS = 1024


@dataclass
class Chunk:
    seq: Sequence
    num_tokens: int  # tokens computed this step


@dataclass
class StepPlan:
    chunks: list[Chunk] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    finished_at_admission: list[Sequence] = field(default_factory=list)


def _queue_key(seq: Sequence) -> tuple[int, int]:
    return seq.params.priority, seq.queue_order


def _shared_blocks(seq: Sequence, other: Sequence, known: int, bs: int) -> int:
    """Tokens, in whole blocks, that ``seq`` shares with ``other`` from the start (the
    first ``known`` are the same). A bisection over slice comparisons: C-speed, not a Python loop a token."""
    n = seq.num_tokens  # (a preempted one's output too: its key covers it)
    a, b = seq.token_range(0, n), other.token_range(0, n)
    lo, hi = min(known, len(b)), len(b)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo // bs * bs


class Scheduler:
    def __init__(self, kv: KVManager, max_batch_prefill_tokens: int, max_num_seqs: int,
                 max_prefill_chunk_tokens: int | None = None, policy: str = "fcfs"):
        self.kv = kv
        self.by_priority = policy == "priority"
        self._arrivals = itertools.count()
        self.max_batch_prefill_tokens = max_batch_prefill_tokens
        self.max_chunk = max_prefill_chunk_tokens or max_batch_prefill_tokens
        self.long_slots = max(1, max_batch_prefill_tokens // self.max_chunk)  # long prompts prefilling at once
        self._logit_rows = PROMPT_LOGPROBS_CHUNK  # all-rows logits left in the step being planned
        self.max_num_seqs = max_num_seqs
        self.waiting: deque[Sequence] = deque()
        # long prompts found while every long-prompt slot was taken, in queue order: out of ``waiting``,
        # so a short prompt behind thousands of them is still seen (each has ``held`` set)
        self.held: list[Sequence] = []
        self._unmatched: deque[Sequence] = deque()  # those held by their length alone, to match in turn
        self._recheck_after: tuple[int, int] | None = None  # queue key the last look at ``held`` ended on
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        seq.queue_order = next(self._arrivals)
        if self.by_priority:
            bisect.insort(self.waiting, seq, key=_queue_key)
        else:
            self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.held or self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting) + len(self.held)

    def remove(self, seq: Sequence) -> None:
        """Take ``seq`` out of the queues and give back its blocks (finish or abort)."""
        if seq.status is Status.RUNNING:
            self.running.remove(seq)
        elif seq.status is Status.WAITING:
            if seq.held:
                self._unhold(seq)
            elif seq in self.waiting:  # (not where an admission that a crash cut short took it out)
                self.waiting.remove(seq)
        self.kv.release(seq)
        seq.status = Status.FINISHED

    def _preempt(self, seq: Sequence, plan: StepPlan) -> None:
        self.kv.publish(seq)  # what it computed stays reusable
        self.running.remove(seq)
        self.kv.release(seq)
        seq.status = Status.WAITING
        seq.preemptions += 1
        self.num_preemptions += 1
        if self.by_priority:  # behind the waiting requests that outrank it
            bisect.insort(self.waiting, seq, key=_queue_key)
        else:
            self.waiting.appendleft(seq)
        plan.preempted.append(seq)

    def schedule(self) -> StepPlan:
        plan = StepPlan()
        budget = self.max_batch_prefill_tokens
        # next-block keys of prompts being prefilled: a waiting request that needs the same block waits
        # for it to be published (one more step) instead of computing it twice
        # (salted per tenant: another tenant's prefill of the same tokens publishes nothing it may hit)
        pending_keys: dict[tuple, Sequence] = {}  # -> the sequence computing that block
        bs = self.kv.block_size
        dedup = self.kv.cache is not None
        self._logit_rows = PROMPT_LOGPROBS_CHUNK
        # Long prompts (more than one chunk left to compute) prefill at most as many at once as the budget
        # has chunks, and while a request waits they leave it one chunk (given back to them if admission
        # does not use it): eight long prompts took the whole budget every step, and a short prompt
        # arriving behind them waited until one of them had computed its whole prompt (vLLM's
        # max_long_partial_prefills, derived from the budget).
        # (Under priority, only the prompts the first waiting request outranks leave it their part.)
        long_slots = self.long_slots
        longs = sum(self._is_long(seq) for seq in self.running)
        if self.held:
            self._recheck_held()
        first = self._first_admissible(longs < long_slots) if budget >= 2 * self.max_chunk else None
        held_back: list[Sequence] = []  # running prefills that left their tokens to the spare chunk
        left: list[tuple[tuple[int, int], int]] = []  # (their queue key, tokens left), under priority

        def pending(seq: Sequence) -> None:  # (its next block is being computed: this step or the next)
            if dedup:
                start = seq.num_computed // bs * bs
                pending_keys[(seq.params.cache_salt, *seq.token_range(0, start + bs))] = seq
        # 1. running sequences in queue order (admission under fcfs, (priority, arrival) under priority);
        # the last in it are preempted when blocks run out
        for seq in list(self.running):
            if seq.status is not Status.RUNNING:
                continue  # preempted earlier in this loop
            uncomputed = seq.num_uncomputed
            spare = self.max_chunk if first is not None and (not self.by_priority or _queue_key(seq) > first) else 0
            n = uncomputed if uncomputed == 1 else min(uncomputed, budget - spare, self._chunk(seq))
            want = min(uncomputed, budget, self._chunk(seq))
            if spare and 1 < uncomputed and n < want:
                held_back.append(seq)
                if self.by_priority:
                    left.append((_queue_key(seq), want - max(n, 0)))
            if n <= 0:
                if uncomputed > 1:
                    pending(seq)
                continue
            while not self.kv.ensure_blocks(seq, seq.num_computed + n):
                # The victim is the last running sequence in queue order, and only one after ``seq``: the
                # list is walked in that order, so those are not scheduled yet, while every one before
                # keeps its place and blocks (even a prefill the budget left without tokens this step).
                # When ``seq`` is the last it gives way itself and waits.
                victim = self.running[-1]
                self._preempt(victim, plan)
                if victim is seq:
                    break
            if seq.status is not Status.RUNNING:
                continue
            if seq.wants_prompt_logprobs:
                self._logit_rows -= n
            if uncomputed > 1:
                budget -= n
                pending(seq)
            plan.chunks.append(Chunk(seq, n))
        if plan.preempted:  # the pool is tight: admit nothing new this step
            if held_back and budget > 0:
                self._give_back(plan, held_back, budget)
            return plan
        # 2. admit waiting requests in queue order, skipping one whose next block another prefill computes;
        # one that waits for another's prefill keeps its seat (counted against max_num_seqs): requests
        # behind it took every seat, and it waited for one to free, hundreds of steps where computing the
        # prefix again would take six. A long prompt found while the long slots are taken goes to ``held``
        # (in queue order, back in turn once a slot frees), and the first of them (as many as there are
        # long slots) keep their seats from the requests behind them: short requests took every seat, and a
        # held long prompt waited for one of them to finish its whole answer once a slot freed
        # (and never every free seat: with few seats, a short prompt waited for a long answer).
        skipped: list[Sequence] = []
        kept_seats = looked = holds = 0
        held_seats = max(0, min(long_slots, self.max_num_seqs - long_slots - 1))
        while budget > 0:
            long_ok = longs < long_slots
            from_held = bool(self.held) and long_ok and (
                not self.waiting or _queue_key(self.held[0]) < _queue_key(self.waiting[0]))
            if not from_held and not self.waiting:
                break
            seq = self.held[0] if from_held else self.waiting[0]
            ahead = 0 if long_ok else self._held_ahead(seq, held_seats)
            if len(self.running) + kept_seats + ahead >= self.max_num_seqs:
                break
            if from_held:
                self._unhold(seq)
            else:
                self.waiting.popleft()
            if seq.waits_on is not None:
                if self._still_waits(seq):
                    skipped.append(seq)  # its next block is still being computed: matching again finds the same
                    kept_seats += 1
                    ref, shared, _ = seq.waits_on
                    seq.waits_on = (ref, shared, ref().num_computed)  # (it waits one more step if that one goes on)
                    continue
                ref, shared, seen = seq.waits_on
                owner = ref()
                # one that stood still a step (no tokens: its long-prompt slot, the budget, the chunk it left
                # to the spare) is waited for no more: this request computes the prefix itself
                seq.waited_in_vain = owner is not None and owner.status is Status.RUNNING and owner.num_computed < shared
                seq.waits_on = None
            # (past the matches a step affords, one long by its length is held unmatched)
            if not long_ok and looked >= ADMISSION_MATCHES and self._is_long(seq):
                self._hold(seq, None)
                holds += 1
                if holds >= ADMISSION_HOLDS:
                    break
                continue
            looked += not long_ok
            self.kv.match(seq)
            if not long_ok and self._is_long(seq):
                mark = self.kv.match_mark(seq)
                self.kv.release(seq)
                self._hold(seq, mark)
                continue
            if seq.num_uncomputed == 0:  # warm-up of a prefix that is already cached
                self.kv.count_admission(seq)
                plan.finished_at_admission.append(seq)
                self.kv.release(seq)
                seq.status = Status.FINISHED
                continue
            key = (seq.params.cache_salt, *seq.token_range(0, seq.num_computed + bs))
            owner = pending_keys.get(key) if dedup and len(key) == seq.num_computed + bs + 1 else None
            if owner is not None and self._may_wait_for(seq, owner):
                self.kv.release(seq)
                skipped.append(seq)  # it will hit the blocks being computed now: not matched again until
                kept_seats += 1  # their owner has computed what the two share
                seq.waits_on = (weakref.ref(owner), _shared_blocks(seq, owner, len(key) - 1, bs), owner.num_computed)
                continue
            if seq.preemptions and not self.kv.allocator.can_allocate(
                    self.kv.allocator.blocks_for_tokens(seq.num_tokens + 1) - len(seq.block_table)):
                # a preempted request comes back once its whole length fits: else one the cache gives nothing
                # back to (prompt log-probs, no prefix cache) prefilled a few chunks, ran the pool dry and was
                # preempted again, over and over, each time from its first token (49 times in one run)
                self.kv.release(seq)
                self.waiting.appendleft(seq)
                break
            # under priority, the chunk a running prompt left is not for a request it outranks
            reserved = sum(t for k, t in left if k < _queue_key(seq)) if left else 0
            if budget - reserved <= 0:  # (nor for any behind it: they rank lower still)
                self.kv.release(seq)
                self.waiting.appendleft(seq)
                break
            long = self._is_long(seq)
            n = min(seq.num_uncomputed, budget - reserved, self._chunk(seq))
            if n == 0:  # its prompt's logits would not fit this step's rows: the next step
                self.kv.release(seq)
                skipped.append(seq)
                kept_seats += 1
                continue
            if not self.kv.ensure_blocks(seq, seq.num_computed + n):
                self.kv.release(seq)
                self.waiting.appendleft(seq)
                break
            self.kv.count_admission(seq)
            if seq.wants_prompt_logprobs:
                self._logit_rows -= n
            pending_keys[key] = seq
            seq.status = Status.RUNNING
            if self.by_priority:  # (the preemption victim is the last: the lowest priority, newest of its rank)
                bisect.insort(self.running, seq, key=_queue_key)
            else:
                self.running.append(seq)
            budget -= n
            longs += long
            plan.chunks.append(Chunk(seq, n))
        self.waiting.extendleft(reversed(skipped))
        if held_back and budget > 0:
            self._give_back(plan, held_back, budget)
        self._favor_first_tokens(plan)
        return plan

    def _hold(self, seq: Sequence, mark: tuple | None) -> None:
        """Keep a long prompt out of ``waiting`` until a long slot frees (``mark`` None: not matched)."""
        seq.held, seq.held_mark = True, mark
        if mark is None:
            if len(self._unmatched) > 2 * len(self.held) + 64:  # (those admitted unmatched meanwhile)
                self._unmatched = deque(s for s in self._unmatched if s.held and s.held_mark is None)
            self._unmatched.append(seq)
        held = self.held
        if not held or _queue_key(held[-1]) < _queue_key(seq):  # (the common case: in queue order)
            held.append(seq)
        else:
            bisect.insort(held, seq, key=_queue_key)

    def _unhold(self, seq: Sequence) -> None:
        held = self.held
        i = 0 if held[0] is seq else bisect.bisect_left(held, _queue_key(seq), key=_queue_key)  # (keys are unique)
        del held[i]
        seq.held, seq.held_mark = False, None
        if not held:
            self._unmatched.clear()

    def _held_ahead(self, seq: Sequence, seats: int) -> int:
        """How many of the held prompts ahead of ``seq`` keep their seats from it: at most ``seats``."""
        held = self.held
        if len(held) >= seats and (seats == 0 or _queue_key(held[seats - 1]) < _queue_key(seq)):
            return seats
        return min(bisect.bisect_left(held, _queue_key(seq), key=_queue_key), seats)

    def _recheck_held(self) -> None:
        """Match the held prompts that may be short by now, at most RECHECK_MATCHES a step: first those held
        by their length alone, in the order they were held (a cached chat turn behind a burst of long
        prompts waited for every one ahead of it), then, looking at the rest in turn, those the cache holds
        more of since their match (one whose prefix another request computed stayed held until a long
        slot freed: its first token at step 38 where 2 would do). One found short goes back to the queue."""
        matches = RECHECK_MATCHES
        while self._unmatched and matches:
            seq = self._unmatched.popleft()
            if seq.held and seq.held_mark is None:
                matches -= 1
                self._rematch(seq)
        held = self.held
        if not held or not matches:
            return
        i = 0 if self._recheck_after is None else bisect.bisect_right(held, self._recheck_after, key=_queue_key)
        for _ in range(min(len(held), RECHECK_WALK)):
            if not held or not matches:
                break
            if i >= len(held):
                i = 0
            seq = held[i]
            self._recheck_after = _queue_key(seq)
            if seq.held_mark is not None and self.kv.match_grew(seq, seq.held_mark):
                matches -= 1
                if not self._rematch(seq):
                    continue  # (gone from ``held``: the next one is at i now)
            i += 1

    def _rematch(self, seq: Sequence) -> bool:
        """Match a held prompt again: still long, it stays held (True); short, it goes back to the queue."""
        self.kv.match(seq)
        long = self._is_long(seq)
        mark = self.kv.match_mark(seq)
        self.kv.release(seq)
        if long:
            seq.held_mark = mark
            return True
        self._unhold(seq)
        bisect.insort(self.waiting, seq, key=_queue_key)
        return False

    def _is_long(self, seq: Sequence) -> bool:
        return seq.num_uncomputed > self.max_chunk

    def _may_wait_for(self, seq: Sequence, owner: Sequence) -> bool:
        """Whether ``seq`` may wait for ``owner``'s prefill of the block they share next: not one that asks for
        its prompt's log-probs (it computes its prompt itself), nor one that waited in vain before, nor,
        under priority, for a request it outranks (whose chunks are cut for requests it is outranked by:
        sharing a prefix with a low-priority prompt made an urgent request slower)."""
        return (not seq.wants_prompt_logprobs and not seq.waited_in_vain
                and not (self.by_priority and _queue_key(owner) > _queue_key(seq)))

    @staticmethod
    def _still_waits(seq: Sequence) -> bool:
        """Whether the prefill of the prefix ``seq`` shares with another request is still under way, and
        went on since ``seq`` last looked (a prefill the budget or its long-prompt slot leaves without
        tokens is no reason to wait: a request waited 12 steps for 48 tokens while later ones went first)."""
        ref, shared, seen = seq.waits_on
        owner = ref()
        return owner is not None and owner.status is Status.RUNNING and seen < owner.num_computed < shared

    def _first_admissible(self, long_ok: bool) -> tuple[int, int] | None:
        """The queue key of the first waiting request that may be admitted this step (a seat is free, it
        does not wait for another's prefill of the prefix they share, nor, ``long_ok`` false, is it held
        for a long slot); None if there is none."""
        if len(self.running) >= self.max_num_seqs:
            return None
        first = next((_queue_key(seq) for seq in itertools.islice(self.waiting, ADMISSION_LOOKAHEAD)
                      if not (seq.waits_on and self._still_waits(seq))), None)
        if long_ok and self.held and (first is None or _queue_key(self.held[0]) < first):
            return _queue_key(self.held[0])
        return first

    def _give_back(self, plan: StepPlan, held_back: list[Sequence], budget: int) -> None:
        """The spare chunk admission left, to the running prefills that left it (in queue order; one
        whose next blocks the pool cannot give without a preemption keeps what it had)."""
        chunks = {id(c.seq): c for c in plan.chunks}
        for seq in held_back:
            if seq.status is not Status.RUNNING or budget <= 0:
                continue
            c = chunks.get(id(seq))
            given = c.num_tokens if c else 0
            rows = max(self._logit_rows, 0) + given if seq.wants_prompt_logprobs else self.max_chunk
            more = min(seq.num_uncomputed, self.max_chunk, rows, budget + given) - given
            if more <= 0 or not self.kv.ensure_blocks(seq, seq.num_computed + given + more):
                continue
            if seq.wants_prompt_logprobs:
                self._logit_rows -= more
            budget -= more
            if c:
                c.num_tokens += more
            else:
                plan.chunks.append(Chunk(seq, more))

    def _chunk(self, seq: Sequence) -> int:
        return min(self.max_chunk, max(self._logit_rows, 0)) if seq.wants_prompt_logprobs else self.max_chunk

    def _favor_first_tokens(self, plan: StepPlan) -> None:
        """When a request gets its first token in this step, cut the other prompts' chunks to a quarter:
        its time to first token is this step's length. (Their blocks are already reserved; the rest
        of each prompt follows in the next steps.) Under priority, only the prompts it outranks: a trickle
        of low-priority short requests held an urgent long prompt to a quarter of its chunks (32 steps
        became 125). Under a steady trickle of short requests (one admitted into the spare chunk every
        step) every step is cut: long prompts take more, shorter steps (eight 8k-token prompts, 59 steps
        instead of 16), at about the same pace where a step's time follows its tokens (a CPU, a large
        model; bench.long_prefill_bench) and slower where a step has a large fixed cost."""
        firsts = [c.seq for c in plan.chunks if c.seq.first_token_time is None and not c.seq.prefill_only
                  and c.num_tokens == c.seq.num_uncomputed]
        if not firsts:
            return
        urgent = min(map(_queue_key, firsts)) if self.by_priority else None
        cut = max(self.kv.block_size, self.max_chunk // 4)
        for c in plan.chunks:
            if (c.num_tokens > cut and c.num_tokens < c.seq.num_uncomputed
                    and (urgent is None or _queue_key(c.seq) > urgent)):
                c.num_tokens = cut
