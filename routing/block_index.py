"""A router's guess of one replica's cached blocks, trimmed the way the replica evicts.

The replica's radix cache protects blocks that were reused (see ``cache.radix``), so a shared system
prompt outlives the unique questions that follow it. A plain LRU guess would drop the prompt first
and send its next request elsewhere, so this index is segmented the same way: blocks seen once sit
in ``probation`` and leave first; blocks seen again move to ``protected``. Like the replica, it
remembers a bounded number of recently dropped hashes (``ghost``): a block that comes back soon after it
was dropped is in demand, and the replica protects it at once, so the guess must too, or the router
drops the prefix from its guess while the replica still holds it and sends the next request elsewhere.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator, Sequence

REPORTED, TRIMMED = 0, 1  # how a hash in the ghost list was dropped: the replica's report, this guess's trim
GHOST_POOLS = 4  # dropped hashes remembered, in multiples of the replica's capacity (as its cache does)


class BlockIndex:
    __slots__ = ("probation", "protected", "ghost", "ghost_limit")

    def __init__(self, ghost_limit: int = GHOST_POOLS * 4096) -> None:
        self.probation: OrderedDict[int, None] = OrderedDict()
        self.protected: OrderedDict[int, None] = OrderedDict()
        # recently dropped hashes, oldest first -> how: the replica reported it, or this guess's own trim took
        # it from one of its segments (see add_chain)
        self.ghost: OrderedDict[int, int] = OrderedDict()
        self.ghost_limit = ghost_limit

    def __len__(self) -> int:
        return len(self.probation) + len(self.protected)

    def __contains__(self, h: int) -> bool:
        return h in self.protected or h in self.probation

    def __iter__(self) -> Iterator[int]:
        yield from self.probation
        yield from self.protected

    def touch(self, h: int) -> bool:
        """Record a use of ``h``; True when it was not indexed before."""
        if h in self.protected:
            self.protected.move_to_end(h)
            return False
        if self.probation.pop(h, 0) is None:
            self.protected[h] = None
            return False
        if self.ghost.pop(h, None) is not None:  # back soon after it was dropped: in demand
            self.protected[h] = None
        else:
            self.probation[h] = None
        return True

    def add_chain(self, hashes: Sequence[int]) -> list[int]:
        """A replica's report that it stored ``hashes`` (chains, each from its first block; a long list comes
        in slices, the last first): each is the replica's newest, its chain's last block the oldest of them,
        as the replica evicts a leaf from its end. One on probation here moves to its end; a protected one
        stays (a report is no second use); one not indexed goes on probation, or is protected where the
        replica reported its eviction before (a return soon after it, which the replica protects), not where
        this guess trimmed it itself (a new prefix routed to a full replica is trimmed here at once, and the
        replica stores it: protected here, the guess dropped a hot prefix in its place). Returns those that
        were not indexed."""
        new = []
        for h in reversed(hashes):
            if h in self.probation:
                self.probation.move_to_end(h)
            elif h not in self.protected:
                (self.protected if self.ghost.pop(h, None) == REPORTED else self.probation)[h] = None
                new.append(h)
        return new

    def discard(self, h: int) -> bool:
        """The replica reported ``h`` evicted; True when it was indexed."""
        if self.probation.pop(h, 0) is None or self.protected.pop(h, 0) is None:
            self._remember(h, REPORTED)
            return True
        if h in self.ghost:  # dropped here first: the replica's word now (its recomputation is a return)
            self.ghost[h] = REPORTED
        return False

    def _remember(self, h: int, how: int) -> None:
        ghost = self.ghost
        ghost[h] = how
        ghost.move_to_end(h)
        if len(ghost) > self.ghost_limit:
            ghost.popitem(last=False)

    def trim(self, limit: int) -> list[int]:
        """Shrink to ``limit`` blocks the way the replica evicts; returns the dropped hashes."""
        dropped = []
        while len(self) > limit:
            seg = self.probation if self.probation else self.protected
            h = seg.popitem(last=False)[0]
            self._remember(h, TRIMMED)
            dropped.append(h)
        return dropped
