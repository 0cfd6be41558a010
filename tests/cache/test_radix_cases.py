"""Named edge cases of the radix cache and allocator (after TGI radix.rs's tests)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cache.allocator import BlockAllocator, OutOfBlocks
from cache.hashing import block_hashes
from cache.radix import RadixCache

BS = 4


def make(num_blocks=32):
    cache = RadixCache(BS)
    return cache, BlockAllocator(num_blocks, BS, cache)


def publish(cache, alloc, tokens, salt=None):
    """Prefill ``tokens`` as a request would: match, allocate the rest, insert, finish."""
    m = cache.match(tokens, cache_salt=salt)
    cache.lock(m.node)
    full = len(tokens) // BS
    private = alloc.allocate(-(-len(tokens) // BS) - len(m.blocks))
    table = m.blocks + private
    res = cache.insert(tokens, table[:full], cache_salt=salt)
    alloc.free(res.redundant)
    cache.lock(res.node)
    cache.unlock(m.node)
    cache.unlock(res.node)
    alloc.free(table[full:])
    return res.blocks


def test_prompt_shorter_than_a_block_never_matches():
    cache, alloc = make()
    publish(cache, alloc, [1, 2, 3])
    assert cache.cached_blocks == 0
    assert cache.match([1, 2, 3]).blocks == []
    alloc.check_invariants([])


def test_non_aligned_prefix_matches_whole_blocks_only():
    cache, alloc = make()
    blocks = publish(cache, alloc, list(range(10)))  # 2 full blocks, 2 tokens left over
    assert len(blocks) == 2
    m = cache.match(list(range(6)) + [99, 99, 99])  # diverges inside block 2
    assert m.blocks == blocks[:1]
    assert cache.match(list(range(10)) + [5]).blocks == blocks
    alloc.check_invariants([])


def test_fully_cached_prompt_leaves_last_token_to_compute():
    cache, alloc = make()
    blocks = publish(cache, alloc, list(range(8)))
    assert cache.match(list(range(8))).blocks == blocks[:1]  # (8-1)//4 = 1 block
    assert cache.match(list(range(9))).blocks == blocks  # one more token: both blocks
    assert cache.match(list(range(8)), max_blocks=2).blocks == blocks  # warm-up may take all


def test_two_requests_inserting_the_same_prefix():
    cache, alloc = make()
    tokens = list(range(12))
    a = alloc.allocate(3)
    b = alloc.allocate(3)
    ra = cache.insert(tokens, a)
    cache.lock(ra.node)
    rb = cache.insert(tokens, b)
    assert rb.blocks == a and rb.redundant == b and rb.new_hashes == []
    alloc.free(rb.redundant)
    cache.unlock(ra.node)
    assert cache.cached_blocks == 3 and alloc.num_free == 32 - 3
    alloc.check_invariants([])


def test_oldest_evicted_first_and_touch_refreshes():
    cache, alloc = make()
    a = publish(cache, alloc, [1] * 8)
    b = publish(cache, alloc, [2] * 8)
    c = publish(cache, alloc, [3] * 8)
    cache.match([1] * 9)  # a is now the most recent
    assert cache.evict(2) == [b[1], b[0]]
    assert cache.evict(2) == [c[1], c[0]]
    assert cache.evict(2) == [a[1], a[0]]
    alloc.free(a + b + c)
    alloc.check_invariants([])


def test_shared_prompt_outlives_the_unique_questions_after_it():
    # plain LRU would evict the system prompt first: its last use is older than every question
    cache = RadixCache(BS, reuse_bonus=100)
    alloc = BlockAllocator(12, BS, cache)
    system = [9] * 8
    sys_blocks = publish(cache, alloc, system + [1] * 4)  # 2 prompt blocks + 1 question block
    publish(cache, alloc, system + [2] * 4)  # hits the prompt: it is now "reused"
    for q in range(3, 12):  # unique prompts fill the pool and force evictions
        publish(cache, alloc, [q] * 12)
    assert cache.match(system + [0]).blocks == sys_blocks[:2]
    alloc.check_invariants([])


def test_reuse_bonus_is_bounded_and_plain_lru_without_it():
    for bonus, prompt_survives in ((100, True), (2, False), (0, False)):
        cache = RadixCache(BS, reuse_bonus=bonus)
        alloc = BlockAllocator(4, BS, cache)
        a = publish(cache, alloc, [1] * 8)
        cache.match([1] * 9)  # reused
        for q in range(2, 6):
            publish(cache, alloc, [q] * 4)  # 4 operations later, each evicting one block
        assert (cache.match([1] * 9).blocks == a) == prompt_survives, bonus


def test_prefix_recomputed_soon_after_its_eviction_comes_back_protected():
    cache = RadixCache(BS, reuse_bonus=100)
    alloc = BlockAllocator(6, BS, cache)
    prompt = [5] * 8
    publish(cache, alloc, prompt)
    alloc.free(cache.evict(2))  # gone, but remembered
    again = publish(cache, alloc, prompt + [6] * 4)  # computed again: its 2 blocks return protected
    for q in range(7, 10):
        publish(cache, alloc, [q] * 8)  # newer unique prompts: the returning prefix outlives them
    assert cache.match(prompt + [6] * 4 + [0]).blocks == again[:2]  # its question was not protected
    alloc.check_invariants([])


def _evict_all(cache, alloc):
    alloc.free(cache.evict(cache.evictable_blocks))


def _churn(cache, alloc, first: int, n: int) -> None:
    """``n`` unique prompts of 2 blocks, each evicted at once (4 x ``reuse_bonus`` fill the ghost list)."""
    for q in range(first, first + n):
        publish(cache, alloc, [q] * 8)
        _evict_all(cache, alloc)


def test_a_prefix_evicted_again_is_remembered_from_its_latest_eviction():
    """The ghost list is ordered by eviction: a block that came back and was evicted again counts
    from its latest eviction (it used to keep its first place and leave the list early)."""
    cache = RadixCache(BS, reuse_bonus=2)  # the ghost list keeps 4 x 2 evicted hashes
    alloc = BlockAllocator(6, BS, cache)
    prompt = [5] * 8
    publish(cache, alloc, prompt)
    _evict_all(cache, alloc)
    _churn(cache, alloc, 10, 2)  # ghost: the prompt's 2 blocks, then 4 others
    publish(cache, alloc, prompt)  # back: 2 recomputed
    _evict_all(cache, alloc)  # evicted again, now the newest in the ghost list
    _churn(cache, alloc, 20, 2)  # 4 more evictions push out the 4 oldest entries
    publish(cache, alloc, prompt)
    assert cache.counters.recomputed_blocks == 4  # still remembered (was 2: forgotten)
    alloc.check_invariants([])


def test_a_warmed_up_prefix_evicted_again_is_remembered_from_that_eviction():
    """A warm-up inserts without the look-up that takes a returning block off the ghost list; its
    next eviction must still move it to the newest end."""
    cache = RadixCache(BS, reuse_bonus=2)
    alloc = BlockAllocator(6, BS, cache)
    prompt = [5] * 8
    publish(cache, alloc, prompt)
    _evict_all(cache, alloc)
    _churn(cache, alloc, 10, 2)
    cache.insert(prompt, alloc.allocate(2), protect=True)  # warm-up: back in the cache
    _evict_all(cache, alloc)
    _churn(cache, alloc, 20, 2)
    publish(cache, alloc, prompt)
    assert cache.counters.recomputed_blocks == 2  # remembered from its second eviction (was 0)
    alloc.check_invariants([])


def test_recomputed_blocks_count_only_what_returns_soon_after_its_eviction():
    cache = RadixCache(BS, reuse_bonus=2)  # the ghost list keeps 4 x 2 evicted hashes
    alloc = BlockAllocator(6, BS, cache)
    prompt = [5] * 8
    publish(cache, alloc, prompt)
    assert cache.counters.recomputed_blocks == 0  # a first computation is not a recomputation
    alloc.free(cache.evict(2))
    publish(cache, alloc, prompt + [6] * 4)  # its 2 evicted blocks come back (the question is new)
    assert cache.counters.recomputed_blocks == 2
    cache.insert([9] * 8, alloc.allocate(2), protect=True)  # a warm-up on purpose is not counted
    assert cache.counters.recomputed_blocks == 2
    alloc.free(cache.evict(6))
    for q in range(10, 15):  # 10 unique blocks evicted after it: the prompt leaves the ghost list
        publish(cache, alloc, [q] * 8)
        alloc.free(cache.evict(cache.evictable_blocks))
    publish(cache, alloc, prompt)
    assert cache.counters.recomputed_blocks == 2
    plain = RadixCache(BS)  # plain LRU keeps no ghost list: nothing counts
    palloc = BlockAllocator(4, BS, plain)
    publish(plain, palloc, prompt)
    palloc.free(plain.evict(2))
    publish(plain, palloc, prompt)
    assert plain.counters.recomputed_blocks == 0


def test_hot_blocks_are_those_hit_within_the_window():
    now = [100.0]
    cache = RadixCache(BS, clock=lambda: now[0])
    alloc = BlockAllocator(16, BS, cache)
    a, b = [1] * 12, [2] * 8
    publish(cache, alloc, a)
    publish(cache, alloc, b)
    assert cache.hot_blocks(since=0.0) == 0  # cached but never hit
    now[0] = 110.0
    cache.match(a[:8] + [7])  # hits a's first 2 blocks (the node splits: its third is not hit)
    assert cache.hot_blocks(since=105.0) == 2
    walk = cache.hot_walk(since=105.0)
    walk.advance(None)  # its sketch of their hashes (for the fleet's distinct count): few, so all of them
    assert walk.sketch.values() == sorted(block_hashes(a[:8], BS))
    now[0] = 130.0
    cache.match(b + [7])
    assert cache.hot_blocks(since=120.0) == 2 and cache.hot_blocks(since=105.0) == 4
    cache.match(a + [7], count=False)  # a lookup that serves a request is a hit too
    assert cache.hot_blocks(since=120.0) == 5
    now[0] = 140.0
    cache.match(a + [7], hit=False)  # a look (a warm-up's check) is not
    assert cache.hot_blocks(since=135.0) == 0
    cache.check()



@settings(max_examples=60, deadline=None)
@given(prompts=st.lists(st.lists(st.integers(0, 2), min_size=4, max_size=24), min_size=1, max_size=12),
       hits=st.lists(st.integers(0, 11), max_size=8), slice_=st.integers(1, 5),
       evictions=st.lists(st.integers(0, 3), max_size=6))
def test_a_sliced_hot_walk_counts_what_a_whole_one_does(prompts, hits, slice_, evictions):
    now = [0.0]
    cache = RadixCache(BS, clock=lambda: now[0])
    alloc = BlockAllocator(64, BS, cache)
    for p in prompts:
        if alloc.num_free * BS >= len(p):
            publish(cache, alloc, p)
    now[0] = 10.0
    for i in hits:
        cache.match(prompts[i % len(prompts)] + [9])
    whole = cache.hot_blocks(since=5.0)
    walk = cache.hot_walk(since=5.0)
    while not walk.advance(slice_):
        pass
    assert walk.done and walk.blocks == whole
    # evictions between slices: nodes gone before their turn are skipped, none is counted twice
    walk = cache.hot_walk(since=5.0)
    for k in evictions:
        if walk.advance(slice_):
            break
        alloc.free(cache.evict(k))
    walk.advance(None)
    assert cache.hot_blocks(since=5.0) <= walk.blocks <= whole
    cache.check()


def test_warm_up_inserts_can_be_protected_up_front():
    cache = RadixCache(BS, reuse_bonus=100)
    alloc = BlockAllocator(4, BS, cache)
    hot = alloc.allocate(2)
    cache.insert([4] * 8, hot, protect=True)
    for q in range(1, 4):
        publish(cache, alloc, [q] * 8)
    assert cache.match([4] * 9).blocks == hot


def test_partial_eviction_of_a_leaf_keeps_its_head():
    cache, alloc = make()
    blocks = publish(cache, alloc, list(range(16)))
    freed = cache.evict(1)
    assert freed == [blocks[3]]
    alloc.free(freed)
    assert cache.match(list(range(17))).blocks == blocks[:3]
    alloc.check_invariants([])


def test_locked_path_is_never_evicted():
    cache, alloc = make(num_blocks=4)
    blocks = publish(cache, alloc, list(range(16)))
    m = cache.match(list(range(16)))  # 3 blocks, splits the 4-block node
    cache.lock(m.node)
    assert cache.evict(10) == [blocks[3]]
    with pytest.raises(OutOfBlocks):
        alloc.allocate(2)
    cache.unlock(m.node)
    alloc.free([blocks[3]])
    assert alloc.allocate(4)  # everything evictable now


def test_salts_isolate_identical_prompts():
    cache, alloc = make()
    tokens = list(range(9))
    mine = publish(cache, alloc, tokens, salt="alice")
    assert cache.match(tokens, cache_salt="bob").blocks == []
    assert cache.match(tokens).blocks == []
    assert cache.match(tokens, cache_salt="alice").blocks == mine
    assert block_hashes(tokens, BS, cache_salt="alice") != block_hashes(tokens, BS, cache_salt="bob")
    for i in range(100):  # lookups of salts that never store a block (short prompts, aborted ones)...
        cache.match(tokens, cache_salt=f"session-{i}")
        cache.insert(tokens[:2], [], cache_salt=f"session-{i}")
    assert set(cache._roots) == {"alice"}  # ...keep no trie each (they did: one per salt, for good)
    plain = publish(cache, alloc, list(range(20, 29)), salt="")  # "" hashes as unsalted: it is unsalted
    assert cache.match(list(range(20, 29))).blocks == plain and set(cache._roots) == {"alice", None}
    alloc.free(cache.evict(10))
    assert "alice" not in cache._roots  # an emptied tenant trie is forgotten
    alloc.check_invariants([])


def test_pool_exhausted_fails_cleanly():
    cache, alloc = make(num_blocks=4)
    held = alloc.allocate(3)
    publish(cache, alloc, [7] * 4)  # fills the last block, then it is evictable
    with pytest.raises(OutOfBlocks):
        alloc.allocate(3)
    assert alloc.num_free == 0 and cache.cached_blocks == 1  # nothing was evicted for nothing
    assert alloc.allocate(1)  # evicts the cached one
    assert cache.cached_blocks == 0
    alloc.free(held)


def test_double_free_is_caught():
    _, alloc = make()
    b = alloc.allocate(1)
    alloc.free(b)
    with pytest.raises(RuntimeError):
        alloc.free(b)


def test_window_rollover_frees_private_blocks_only():
    cache, alloc = make(num_blocks=16)
    table = alloc.allocate(6)  # 24 tokens, first 2 blocks notionally cached
    freed = alloc.release_out_of_window(table, first_private=2, num_tokens=24, window_size=8)
    # tokens < 16 are out of the window: blocks 0..3; 0 and 1 belong to the cache
    assert freed == 2 and table[2] == table[3] == -1 and table[4] >= 0
    assert alloc.num_free == 16 - 4
    assert alloc.release_out_of_window(table, 2, 24, 8) == 0  # idempotent


def test_hashes_are_stable_and_chained():
    h = block_hashes(list(range(12)), BS, model_id="m")
    assert len(h) == 3 and len(set(h)) == 3
    assert h == block_hashes(list(range(12)) + [1, 2], BS, model_id="m")  # partial tail not hashed
    assert block_hashes([9] + list(range(1, 12)), BS, model_id="m")[1] != h[1]  # chain carries the past
    assert block_hashes(list(range(12)), BS, model_id="other") != h
    # frozen value: the hash must never change between releases or machines
    assert block_hashes([1, 2, 3, 4], 4)[0] == FROZEN


FROZEN = 6509323439801636884  # xxh3_64, seeded chain of [1, 2, 3, 4]


def test_cached_hashes_match_the_shared_function():
    cache, alloc = make()
    tokens = list(range(20))
    publish(cache, alloc, tokens, salt="t")
    assert cache.match(tokens + [0], cache_salt="t").hashes == block_hashes(tokens, BS, cache_salt="t")


def test_taking_back_ones_own_blocks_does_not_protect_them():
    # a preempted request re-matching the blocks it published is not a second user of them
    for own, prompt_survives in ((0, True), (1, True), (2, False)):  # own: its first blocks were its own
        cache = RadixCache(BS, reuse_bonus=100)
        alloc = BlockAllocator(4, BS, cache)
        a = publish(cache, alloc, [1] * 8)
        assert cache.match([1] * 9, own_blocks=own).blocks == a
        for q in range(2, 6):
            publish(cache, alloc, [q] * 4)
        assert (cache.match([1] * 9).blocks == a) == prompt_survives, own
        alloc.check_invariants([])
