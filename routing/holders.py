"""Which replicas hold each block hash: an inverted index, one integer bit mask per hash.

A fleet's index holds up to (replicas x pool blocks) entries, a million for 16 replicas of 64k blocks.
As a set of replica ids per hash that is ~200 bytes each, and every set is a container the garbage
collector walks: a full collection then stalls the router's process for 100+ ms. An int mask is a
fraction of the size and invisible to the collector. Each replica gets a bit (its slot); a slot is
reused once its replica is gone and its bit is clear everywhere.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence


class Holders:
    def __init__(self) -> None:
        self.masks: dict[int, int] = {}  # block hash -> bits of the replicas that hold it
        self._slot: dict[str, int] = {}  # replica -> its bit
        self._ids: list[str | None] = []  # bit -> replica (None: free)

    def __len__(self) -> int:
        return len(self.masks)

    def __contains__(self, h: int) -> bool:
        return h in self.masks

    def __iter__(self) -> Iterator[int]:
        return iter(self.masks)

    # ------------------------------------------------------------------ replicas
    def bit(self, replica_id: str) -> int:
        """The replica's bit, given one (the lowest free slot: masks stay as short as the fleet)."""
        slot = self._slot.get(replica_id)
        if slot is None:
            slot = next((i for i, r in enumerate(self._ids) if r is None), len(self._ids))
            if slot == len(self._ids):
                self._ids.append(replica_id)
            else:
                self._ids[slot] = replica_id
            self._slot[replica_id] = slot
        return 1 << slot

    def mask_of(self, replica_ids: Iterable[str]) -> int:
        m = 0
        for r in replica_ids:
            slot = self._slot.get(r)
            if slot is not None:
                m |= 1 << slot
        return m

    def ids(self, mask: int) -> list[str]:
        out = []
        while mask:
            low = mask & -mask
            out.append(self._ids[low.bit_length() - 1])
            mask ^= low
        return out

    def remove_replica(self, replica_id: str, hashes: Iterable[int] | None = None) -> None:
        """Clear the replica's bit (from ``hashes``, the ones it holds, or else from every mask) and free
        its slot."""
        slot = self._slot.pop(replica_id, None)
        if slot is None:
            return
        b = 1 << slot
        masks = self.masks
        for h in list(masks) if hashes is None else hashes:
            m = masks.get(h, 0)
            if m & b:
                if m == b:
                    del masks[h]
                else:
                    masks[h] = m ^ b
        self._ids[slot] = None

    # ------------------------------------------------------------------ entries
    def add(self, h: int, replica_id: str) -> bool:
        """Record that the replica holds ``h``; True when it was not recorded before."""
        b = self.bit(replica_id)
        m = self.masks.get(h, 0)
        if m & b:
            return False
        self.masks[h] = m | b
        return True

    def discard(self, h: int, replica_id: str) -> None:
        slot = self._slot.get(replica_id)
        m = self.masks.get(h, 0)
        if slot is None or not m >> slot & 1:
            return
        if m == 1 << slot:
            del self.masks[h]
        else:
            self.masks[h] = m ^ (1 << slot)

    def of(self, h: int) -> list[str]:
        """The replicas that hold ``h``."""
        return self.ids(self.masks.get(h, 0))

    def as_sets(self) -> dict[int, set[str]]:
        """Every entry as a set of replica ids (for tests and reports; not for the hot path)."""
        return {h: set(self.ids(m)) for h, m in self.masks.items()}

    def matches(self, hashes: Sequence[int], candidates: Iterable[str] | None = None) -> dict[str, int]:
        """Leading blocks of ``hashes`` each replica holds; only replicas with at least one. Walks the
        chain once: the set of holders only shrinks, so each replica gets its depth when it drops out."""
        masks = self.masks
        alive = masks.get(hashes[0], 0) if hashes else 0
        if candidates is not None and alive:
            alive &= self.mask_of(candidates)
        out: dict[str, int] = {}
        if not alive:
            return out
        depth = 0
        for h in hashes:
            kept = alive & masks.get(h, 0)
            if kept != alive:
                for r in self.ids(alive ^ kept):
                    out[r] = depth
                alive = kept
                if not alive:
                    break
            depth += 1
        for r in self.ids(alive):
            out[r] = depth
        return {r: d for r, d in out.items() if d > 0}
