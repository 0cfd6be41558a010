"""A router's guess of one replica's cached blocks, trimmed the way the replica evicts.

The replica's radix cache protects blocks that were reused (see ``cache.radix``), so a shared system
prompt outlives the unique questions that follow it. A plain LRU guess would drop the prompt first
and send its next request elsewhere, so this index is segmented the same way: blocks seen once sit
in ``probation`` and leave first; blocks seen again move to ``protected``.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator


class BlockIndex:
    __slots__ = ("probation", "protected")

    def __init__(self) -> None:
        self.probation: OrderedDict[int, None] = OrderedDict()
        self.protected: OrderedDict[int, None] = OrderedDict()

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
        self.probation[h] = None
        return True

    def discard(self, h: int) -> bool:
        return self.probation.pop(h, 0) is None or self.protected.pop(h, 0) is None

    def trim(self, limit: int) -> list[int]:
        """Shrink to ``limit`` blocks the way the replica evicts; returns the dropped hashes."""
        dropped = []
        while len(self) > limit:
            seg = self.probation if self.probation else self.protected
            dropped.append(seg.popitem(last=False)[0])
        return dropped
