"""Block allocator over a preallocated pool of KV blocks.

Every block is in exactly one place: the free list, the radix cache (evictable or locked), or a
request's private table. Allocation takes free blocks first and evicts cached LRU leaves only for
the shortfall; when even that cannot cover the request it fails without touching anything.
"""

from __future__ import annotations

from collections.abc import Iterable

from cache.radix import RadixCache

_FREE, _USED = 0, 1


class OutOfBlocks(RuntimeError):
    pass


class BlockAllocator:
    def __init__(self, num_blocks: int, block_size: int, cache: RadixCache | None = None):
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError(f"need positive num_blocks and block_size, got {num_blocks}, {block_size}")
        if cache is not None and cache.block_size != block_size:
            raise ValueError("cache and allocator disagree on block_size")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.cache = cache
        # Popped from the end: low ids first, which keeps a small working set in low memory.
        self._free = list(range(num_blocks - 1, -1, -1))
        self._state = bytearray(num_blocks)  # _FREE / _USED, for O(1) double-free detection
        self.evictions = 0

    @classmethod
    def for_tokens(cls, max_batch_total_tokens: int, block_size: int,
                   cache: RadixCache | None = None) -> BlockAllocator:
        """A pool that holds ``max_batch_total_tokens`` tokens (rounded down to whole blocks)."""
        return cls(max(1, max_batch_total_tokens // block_size), block_size, cache)

    # --------------------------------------------------------------- accounting
    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_evictable(self) -> int:
        return self.cache.evictable_blocks if self.cache is not None else 0

    @property
    def num_available(self) -> int:
        """Blocks an allocation could get right now (free plus evictable)."""
        return self.num_free + self.num_evictable

    @property
    def num_in_use(self) -> int:
        """Blocks held by running requests: private ones plus locked cached ones."""
        return self.num_blocks - self.num_free - self.num_evictable

    def blocks_for_tokens(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # --------------------------------------------------------------- allocate / free
    def can_allocate(self, n: int) -> bool:
        return n <= self.num_available

    def allocate(self, n: int) -> list[int]:
        """``n`` blocks, evicting cached leaves if needed; raises ``OutOfBlocks`` with no side effect."""
        if n < 0:
            raise ValueError("negative allocation")
        if n > self.num_available:
            raise OutOfBlocks(f"need {n} blocks, {self.num_free} free + {self.num_evictable} evictable")
        short = n - len(self._free)
        if short > 0:
            assert self.cache is not None
            freed = self.cache.evict(short)
            # (num_evictable promised them: fewer would hand out a shorter table than asked for)
            assert len(freed) == short, f"evicted {len(freed)} of the {short} blocks counted evictable"
            self.evictions += len(freed)
            self._release(freed)
        out = self._free[len(self._free) - n:] if n else []
        del self._free[len(self._free) - n:]
        for b in out:
            self._state[b] = _USED
        return out

    def free(self, blocks: Iterable[int]) -> None:
        """Return private (never inserted, or redundant) blocks to the pool."""
        self._release([b for b in blocks if b >= 0])

    def _release(self, blocks: list[int]) -> None:
        state = self._state
        for b in blocks:
            if state[b] != _USED:
                raise RuntimeError(f"block {b} freed twice")
            state[b] = _FREE
        self._free.extend(reversed(blocks))

    def release_out_of_window(self, table: list[int], first_private: int, num_tokens: int,
                              window_size: int) -> int:
        """Free private blocks of ``table`` whose tokens are all older than the attention window
        (position < ``num_tokens - window_size``), marking them ``-1``. Cached blocks (index below
        ``first_private``) stay: the cache owns them. Returns how many blocks were freed."""
        dead_blocks = max(0, num_tokens - window_size) // self.block_size
        freed = []
        for i in range(first_private, min(dead_blocks, len(table))):
            if table[i] >= 0:
                freed.append(table[i])
                table[i] = -1
        self._release(freed)
        return len(freed)

    # --------------------------------------------------------------- invariants
    def check_invariants(self, private_tables: Iterable[Iterable[int]] | None = None) -> None:
        """Assert the pool's books balance: each block in exactly one place.

        With ``private_tables`` (every live request's private blocks), also asserts that
        ``free + evictable + in_use == total`` accounts for every block, none owned twice.
        """
        free = self._free
        free_set = set(free)
        assert len(free_set) == len(free), "a block is on the free list twice"
        assert all(self._state[b] == _FREE for b in free), "free-list block marked used"
        assert self._state.count(_FREE) == len(free), "a freed block is missing from the free list"
        cached: list[int] = []
        if self.cache is not None:
            self.cache.check()
            cached = self.cache.block_ids()
            cached_set = set(cached)
            assert len(cached_set) == len(cached), "a block is cached twice"
            assert not (cached_set & free_set), "a cached block is also free"
        if private_tables is not None:
            owned = set(cached) | free_set
            private = 0
            for table in private_tables:
                for b in table:
                    if b < 0:
                        continue
                    assert b not in owned, f"block {b} owned twice"
                    owned.add(b)
                    private += 1
            assert len(owned) == self.num_blocks, (
                f"blocks leaked: free {len(free)} + cached {len(cached)} + private {private}"
                f" != total {self.num_blocks}")
            locked = self.cache.locked_blocks if self.cache is not None else 0
            assert self.num_free + self.num_evictable + locked + private == self.num_blocks
