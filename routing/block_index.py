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

REPORTED, TRIMMED_PROBATION, TRIMMED_PROTECTED = 0, 1, 2  # how a hash in the ghost list was dropped
GHOST_POOLS = 4  # dropped hashes remembered, in multiples of the replica's capacity (as its cache does)


class BlockIndex:
    __slots__ = ("probation", "protected", "ghost", "ghost_limit")

    def __init__(self, ghost_limit: int = GHOST_POOLS * 4096) -> None:
        self.probation: OrderedDict[int, None] = OrderedDict()
        self.protected: OrderedDict[int, None] = OrderedDict()
        # recently dropped hashes, oldest first -> how: the replica reported it, or this guess's own trim took
        # it from one of its segments (see add)
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
        """Index the blocks of ``hashes`` (a replica's report that it stored them, each chain from its first
        block) that are not indexed: a report is no second use, so a block the router already counted stays
        where it is. Returns those newly indexed. A block this guess dropped itself, and the replica never
        did, goes back where the trim took it from, the oldest of its segment (a chain's last block the
        oldest, as the trim took it first): the report is of its first computation (a new prefix routed to
        a full replica is trimmed here at once, and the replica stores it), no return after an eviction,
        which the replica would protect; protected here, or the newest, the guess dropped a hot prefix, or
        the rest of that chain, in its place at the next trim. Others go in as ``touch`` has them, a
        chain's last block first."""
        new = []
        for h in hashes:
            seg = {TRIMMED_PROBATION: self.probation, TRIMMED_PROTECTED: self.protected}.get(self.ghost.get(h))
            if seg is not None and h not in self:
                del self.ghost[h]
                seg[h] = None
                seg.move_to_end(h, last=False)
                new.append(h)
        for h in reversed(hashes):
            if h not in self and self.touch(h):
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
            self._remember(h, TRIMMED_PROBATION if seg is self.probation else TRIMMED_PROTECTED)
            dropped.append(h)
        return dropped
