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
            self.dropped += self._waiting.get(replica_id, 0) + n
            self.drop(replica_id)
            return False
        for forget, hashes in ((True, removed), (False, stored)):
            if hashes:
                self._queue.append(_Pending(replica_id, forget, hashes))
                self._waiting[replica_id] = self._waiting.get(replica_id, 0) + len(hashes)
        return True

    def drop(self, replica_id: str) -> None:
        """Let go of what a replica reported (it left, or its backlog overflowed)."""
        if self._waiting.pop(replica_id, None) is not None:
            self._queue = deque(p for p in self._queue if p.replica_id != replica_id)

    def fold_replica(self, replica_id: str, forget: Callable[[str, Sequence[int]], None],
                     learn: Callable[[str, Sequence[int]], None]) -> None:
        """Fold one replica's queued hashes now, in order (before its cached-block count bounds its index:
        trimmed first, the index dropped prefixes the replica still holds and kept ones it had evicted)."""
        if replica_id not in self._waiting:
            return
        mine = [p for p in self._queue if p.replica_id == replica_id]
        self.drop(replica_id)
        for p in mine:
            (forget if p.forget else learn)(replica_id, p.hashes[p.done:])

    def fold(self, forget: Callable[[str, Sequence[int]], None], learn: Callable[[str, Sequence[int]], None],
             budget_s: float) -> bool:
        """Fold queued hashes (``forget``/``learn`` each get a slice) until ``budget_s`` is spent; at least
        one slice, so a backlog always shrinks. True when some remain."""
        deadline = time.perf_counter() + budget_s
        queue = self._queue
        while queue:
            p = queue[0]
            part = p.hashes[p.done:p.done + SLICE]
            (forget if p.forget else learn)(p.replica_id, part)
            p.done += len(part)
            self._waiting[p.replica_id] -= len(part)
            if p.done >= len(p.hashes):
                queue.popleft()
                if not self._waiting[p.replica_id]:
                    del self._waiting[p.replica_id]
            if time.perf_counter() >= deadline:
                break
        return bool(queue)
