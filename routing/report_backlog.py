"""Replica reports waiting to be folded into the router's index, a slice at a time.

A replica reports up to tens of thousands of stored and evicted block hashes per stats period, and
folding one hash costs one or two microseconds: folding every report whole inside a routing decision
stalled that decision, and every request behind it, for tens of milliseconds each period. The router
queues the hash lists here and folds them in short slices of its event loop, between decisions.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

SLICE = 64  # hashes folded between two looks at the clock (~0.1 ms)


@dataclass
class _Pending:
    replica_id: str
    forget: bool  # evicted hashes (else stored ones)
    hashes: Sequence[int]
    done: int = 0
    bound: bool = False  # no hashes: here the replica's index is bounded by its cached-block count
    cached_blocks: int | None = None  # (that count; None: its capacity)


Fold = Callable[[str, Sequence[int]], None]
Bound = Callable[[str, int | None], None]


class ReportBacklog:
    """FIFO of hash lists, all replicas together, so a replica's evictions and stores keep their order."""

    def __init__(self, per_replica_limit: int):
        self.per_replica_limit = per_replica_limit
        self._queue: deque[_Pending] = deque()
        self._waiting: dict[str, int] = {}  # hashes not yet folded, per replica
        self.dropped = 0  # hashes let go because a replica's backlog passed its limit

    def __len__(self) -> int:
        return sum(self._waiting.values())

    def __bool__(self) -> bool:
        return bool(self._queue)

    def push(self, replica_id: str, removed: Sequence[int], stored: Sequence[int]) -> bool:
        """Queue one report's hashes; False when that replica's backlog would pass the limit, in which case
        its whole backlog is let go (the caller then bounds that replica's index by its cached count)."""
        n = len(removed) + len(stored)
        if self._waiting.get(replica_id, 0) + n > self.per_replica_limit:
            self.dropped += n + sum(len(p.hashes) - p.done for p in self._queue if p.replica_id == replica_id)
            self.drop(replica_id)
            return False
        for forget, hashes in ((True, removed), (False, stored)):
            if hashes:
                self._queue.append(_Pending(replica_id, forget, hashes))
                self._waiting[replica_id] = self._waiting.get(replica_id, 0) + len(hashes)
        return True

    def push_bound(self, replica_id: str, cached_blocks: int | None, bound: Bound) -> None:
        """The replica caches ``cached_blocks`` once the hashes queued before are in (a report whose
        hashes were not all sent or seen): ``bound`` its index then, or now when nothing of it waits.
        Folded in its turn, not in the decision that saw the report: folding a replica's whole backlog
        there stalled that decision for tens of milliseconds."""
        if replica_id not in self._waiting:
            bound(replica_id, cached_blocks)
            return
        self._queue.append(_Pending(replica_id, False, (), bound=True, cached_blocks=cached_blocks))
        self._waiting[replica_id] += 1  # (counted as one entry, so the replica stays known until it is done)

    def drop(self, replica_id: str) -> None:
        """Let go of what a replica reported (it left, or its backlog overflowed)."""
        if self._waiting.pop(replica_id, None) is not None:
            self._queue = deque(p for p in self._queue if p.replica_id != replica_id)

    def fold(self, forget: Fold, learn: Fold, bound: Bound, budget_s: float) -> bool:
        """Fold queued hashes (``forget``/``learn`` each get a slice) and bounds, in order, until
        ``budget_s`` is spent; at least one slice, so a backlog always shrinks. True when some remain.
        (A bound comes after its report's hashes: trimmed first, the index would drop prefixes the
        replica still holds and keep ones it had evicted.)"""
        deadline = time.perf_counter() + budget_s
        queue = self._queue
        while queue:
            p = queue[0]
            if p.bound:
                bound(p.replica_id, p.cached_blocks)
                folded, finished = 1, True  # (one entry, as counted)
            else:
                try:
                    # stored hashes from the list's end: its slices then go in as the whole list would, the
                    # chains' last blocks the oldest (``BlockIndex.add_chain``); slices from the start left a
                    # chain's first slice older than its second, and a trim cut it in the middle
                    n = len(p.hashes)
                    part = p.hashes[p.done:p.done + SLICE] if p.forget else p.hashes[max(0, n - p.done - SLICE):n - p.done]
                except ValueError:  # packed hashes that are not hex (no replica of ours sends them): let go
                    folded = len(p.hashes) - p.done
                    self.dropped += folded
                    p.done = len(p.hashes)
                else:
                    (forget if p.forget else learn)(p.replica_id, part)
                    p.done += len(part)
                    folded = len(part)
                finished = p.done >= len(p.hashes)
            self._waiting[p.replica_id] -= folded
            if finished:
                queue.popleft()
                if not self._waiting[p.replica_id]:
                    del self._waiting[p.replica_id]
            if time.perf_counter() >= deadline:
                break
        return bool(queue)
