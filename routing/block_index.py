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
from collections.abc import Iterator

GHOST_POOLS = 4  # dropped hashes remembered, in multiples of the replica's capacity (as its cache does)


class BlockIndex:
    __slots__ = ("probation", "protected", "ghost", "ghost_limit")

    def __init__(self, ghost_limit: int = GHOST_POOLS * 4096) -> None:
        self.probation: OrderedDict[int, None] = OrderedDict()
        self.protected: OrderedDict[int, None] = OrderedDict()
        self.ghost: OrderedDict[int, None] = OrderedDict()  # recently dropped hashes, oldest first
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
        if self.ghost.pop(h, 0) is None:
            self.protected[h] = None
        else:
            self.probation[h] = None
        return True

    def add(self, h: int) -> bool:
        """Index ``h`` if it is not (a report that the replica stored it: not a second use, so a block
        the router already counted stays where it is); True when it was not indexed before."""
        return h not in self and self.touch(h)

    def discard(self, h: int) -> bool:
        if self.probation.pop(h, 0) is None or self.protected.pop(h, 0) is None:
            self._remember(h)
            return True
        return False

    def _remember(self, h: int) -> None:
        ghost = self.ghost
        ghost[h] = None
        if len(ghost) > self.ghost_limit:
            ghost.popitem(last=False)

    def trim(self, limit: int) -> list[int]:
        """Shrink to ``limit`` blocks the way the replica evicts; returns the dropped hashes."""
        dropped = []
        while len(self) > limit:
            seg = self.probation if self.probation else self.protected
            h = seg.popitem(last=False)[0]
            self._remember(h)
            dropped.append(h)
        return dropped
