"""Stateful property test: radix cache + allocator against a dict-of-prefixes reference.

Any interleaving of request (match + lock + allocate), insert, finish (unlock + free) and evict
must keep the pool's books balanced, hand no block out twice, never evict a block a live request
uses, evict least-recently-used leaves first, and match exactly what the reference has cached. The
second machine runs with reuse protection: a reused (or recomputed-after-eviction) block counts as
``BONUS`` operations younger than it is.
"""

from __future__ import annotations

from dataclasses import dataclass

import hypothesis.strategies as st
from hypothesis import settings
from hypothesis.stateful import Bundle, RuleBasedStateMachine, consumes, invariant, rule

from cache.allocator import BlockAllocator, OutOfBlocks
from cache.hashing import block_hashes
from cache.radix import Node, RadixCache

BS = 2
POOL = 24
FAMILIES = [(0, 1, 0, 1), (0, 1, 2, 3), (3, 3, 3, 3, 3, 3), (1,)]


@dataclass
class Req:
    tokens: tuple[int, ...]
    salt: str | None
    node: Node
    table: list[int]  # cached blocks first, then private ones
    n_cached: int  # how many leading table entries the cache owns


class CacheMachine(RuleBasedStateMachine):
    reqs = Bundle("reqs")
    BONUS = 0

    def __init__(self):
        super().__init__()
        self.cache = RadixCache(BS, reuse_bonus=self.BONUS)
        self.alloc = BlockAllocator(POOL, BS, self.cache)
        self.ref: dict[tuple, int] = {}  # (salt, prefix tokens) -> block id, one entry per cached block
        self.access: dict[tuple, int] = {}
        self.reused: set[tuple] = set()  # keys matched by a later request (or back soon after eviction)
        self.ghost: set[tuple] = set()  # keys evicted so far (the test never fills the cache's ghost list)
        self.clock = 0
        self.live: list[Req] = []

    # ------------------------------------------------------------ reference helpers
    def _prefixes(self, salt, tokens, n_blocks):
        return [(salt, tokens[: (i + 1) * BS]) for i in range(n_blocks)]

    def _ref_match(self, salt, tokens, limit):
        out = []
        for key in self._prefixes(salt, tokens, limit):
            if key not in self.ref:
                break
            out.append(key)
        return out

    def _locked_keys(self):
        keys = set()
        for r in self.live:
            keys.update(self._prefixes(r.salt, r.tokens, r.n_cached))
        return keys

    def _touch(self, keys):
        self.clock += 1
        for k in keys:
            self.access[k] = self.clock

    # ------------------------------------------------------------ rules
    @rule(target=reqs, family=st.sampled_from(FAMILIES), tail=st.lists(st.integers(0, 3), max_size=5),
          cut=st.integers(0, 6), salt=st.sampled_from([None, None, "tenant"]))
    def request(self, family, tail, cut, salt):
        tokens = tuple(family[:cut]) + tuple(tail)
        if not tokens:
            tokens = (0,)
        limit = (len(tokens) - 1) // BS
        m = self.cache.match(list(tokens), cache_salt=salt)
        keys = self._ref_match(salt, tokens, limit)
        assert m.blocks == [self.ref[k] for k in keys]
        # what the routers and the directory learn: every matched block's chained hash
        assert m.hashes == block_hashes(tokens[: len(keys) * BS], BS, cache_salt=salt)
        self.cache.lock(m.node)
        self._touch(keys)
        self.reused.update(keys)
        need = -(-len(tokens) // BS) - len(m.blocks)
        evictable_before = self.cache.evictable_blocks
        locked_before = self._locked_keys()
        try:
            private = self.alloc.allocate(need)
        except OutOfBlocks:
            assert need > self.alloc.num_free + evictable_before
            self.cache.unlock(m.node)
            return None
        self._sync_evictions(locked_before | set(keys))
        req = Req(tokens, salt, m.node, m.blocks + private, len(m.blocks))
        self.live.append(req)
        return req

    @rule(req=reqs)
    def insert(self, req):
        if req is None or req not in self.live:
            return
        full = len(req.tokens) // BS
        res = self.cache.insert(list(req.tokens), req.table[:full], cache_salt=req.salt)
        keys = self._prefixes(req.salt, req.tokens, full)
        # the blocks it added (under a cached prefix too: chained from that prefix, not from the root)
        added = [i for i, k in enumerate(keys) if k not in self.ref]
        assert res.new_hashes == [block_hashes(req.tokens, BS, cache_salt=req.salt)[i] for i in added]
        if self.BONUS:
            for k in (k for k in keys if k not in self.ref):  # the new leaf's leading returning blocks
                if k not in self.ghost:
                    break
                self.reused.add(k)
        for i, k in enumerate(keys):
            if k in self.ref:
                assert res.blocks[i] == self.ref[k], "cached block must win over the duplicate"
            else:
                self.ref[k] = req.table[i]
        assert res.blocks == [self.ref[k] for k in keys]
        own = set(req.table[req.n_cached:full])
        assert set(res.redundant) == own - set(res.blocks)
        self._touch(keys)
        self.cache.lock(res.node)
        self.cache.unlock(req.node)
        self.alloc.free(res.redundant)
        req.node = res.node
        req.table = res.blocks + req.table[full:]
        req.n_cached = full

    @rule(req=consumes(reqs))
    def finish(self, req):
        if req is None or req not in self.live:
            return
        self.cache.unlock(req.node)
        self.alloc.free(req.table[req.n_cached:])
        self.live.remove(req)

    @rule(k=st.integers(1, 5))
    def evict(self, k):
        locked = self._locked_keys()
        before = set(self.ref.values())
        freed = self.cache.evict(k)
        for b in freed:
            self._evict_ref_block(b, locked)
        self.alloc.free(freed)
        assert len(freed) == min(k, len(before) - len({self.ref[x] for x in locked}))

    def _evict_ref_block(self, block, locked):
        key = next(k for k, b in self.ref.items() if b == block)
        assert key not in locked, "evicted a block in use"
        salt, toks = key
        assert not any(s == salt and len(t) == len(toks) + BS and t[: len(toks)] == toks for s, t in self.ref), \
            "evicted a block that still has cached children"
        leaves = [k for k in self.ref if k not in locked and not any(
            s == k[0] and len(t) == len(k[1]) + BS and t[: len(k[1])] == k[1] for s, t in self.ref)]
        assert self._age(key) == min(self._age(x) for x in leaves), "not least recently used"
        del self.ref[key]
        del self.access[key]
        self.reused.discard(key)
        self.ghost.add(key)

    def _age(self, key) -> int:
        return self.access[key] + (self.BONUS if key in self.reused else 0)

    def _sync_evictions(self, locked):
        """Allocation may have evicted: drop from the reference whatever the cache no longer has."""
        cached = set(self.cache.block_ids())
        gone = [b for b in self.ref.values() if b not in cached]
        # replay in LRU order so each step is checked against the reference policy
        key_of = {v: k for k, v in self.ref.items()}
        gone.sort(key=lambda b: (self._age(key_of[b]), -len(key_of[b][1])))
        for b in gone:
            self._evict_ref_block(b, locked)

    @invariant()
    def books_balance(self):
        self.alloc.check_invariants([r.table[r.n_cached:] for r in self.live])
        assert sorted(self.cache.block_ids()) == sorted(self.ref.values())


class ProtectedCacheMachine(CacheMachine):
    BONUS = 6  # a few operations: reused blocks usually, not always, outlive fresh ones


for machine in (CacheMachine, ProtectedCacheMachine):
    machine.TestCase.settings = settings(max_examples=400, stateful_step_count=50, deadline=None)
TestCacheMachine = CacheMachine.TestCase
TestProtectedCacheMachine = ProtectedCacheMachine.TestCase
