"""How many distinct block hashes a fleet's replicas hold between them, from a small sketch of each.

Each replica counts its working set (``HotWalk``), but a prefix hot enough to live on every replica is
in each count: summed, 4 replicas sharing 6.5k hot blocks look like 26k. A bottom-k sketch (the ``k``
smallest hashes seen) estimates the distinct count of a set of uniformly spread 64-bit hashes (block
hashes are xxh3) within ~``1/sqrt(k)``, and the sketches of several sets merge into the sketch of their
union: each replica sends ``k`` integers, whatever its pool size. Exact below ``k`` distinct hashes.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Sequence

SKETCH_SIZE = 1024  # ~3% error; 8 KB a replica
_SPACE = float(1 << 64)


class BottomK:
    """The ``k`` smallest distinct hashes added so far."""

    def __init__(self, k: int = SKETCH_SIZE):
        if k < 2:
            raise ValueError(f"a bottom-k sketch needs k >= 2, got {k}")
        self.k = k
        self._heap: list[int] = []  # negated: the largest kept hash on top, the one a smaller hash evicts
        self._kept: set[int] = set()

    def add(self, h: int) -> None:
        if h in self._kept:
            return
        if len(self._heap) < self.k:
            heapq.heappush(self._heap, -h)
            self._kept.add(h)
        elif h < -self._heap[0]:
            self._kept.discard(-heapq.heappushpop(self._heap, -h))
            self._kept.add(h)

    def update(self, hashes: Iterable[int]) -> None:
        if len(self._heap) >= self.k:  # full: most hashes are above the largest kept (a cheap filter first)
            top = -self._heap[0]
            hashes = [h for h in hashes if h < top]
        for h in hashes:
            self.add(h)

    def values(self) -> list[int]:
        return sorted(self._kept)


def union_estimate(sketches: Iterable[Sequence[int]], k: int = SKETCH_SIZE) -> float:
    """Distinct hashes in the union of the sets the sketches (each the ``k`` smallest of its set, as
    ``BottomK.values`` gives) were taken from: exact when the union keeps fewer than ``k``."""
    smallest = heapq.nsmallest(k, {h for s in sketches for h in s})
    if len(smallest) < k:
        return float(len(smallest))
    # the k-th smallest of n uniform hashes sits near k/n of the space; (k - 1) makes the estimate unbiased
    return (k - 1) / ((smallest[-1] + 1) / _SPACE)
