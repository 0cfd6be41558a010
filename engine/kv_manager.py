"""Ties sequences to the cache core: prefix match on admission, block growth, publication of
written blocks into the radix cache, and release. The only place that moves block ownership."""

from __future__ import annotations

from collections import Counter

from cache.allocator import BlockAllocator, OutOfBlocks
from cache.hashing import pack_tokens
from cache.radix import RadixCache
from engine.sequence import Sequence


class KVManager:
    def __init__(self, num_blocks: int, block_size: int, prefix_caching: bool = True,
                 model_id: str = "", window_size: int | None = None):
        self.block_size = block_size
        self.window_size = window_size
        # reused prefixes outlive unique tails by about one pool's worth of cache operations
        self.cache = RadixCache(block_size, model_id, reuse_bonus=num_blocks) if prefix_caching else None
        self.allocator = BlockAllocator(num_blocks, block_size, self.cache)
        # cached tokens of the first request taken with a prompt longer than a block (the shortest that can
        # hit): what warm-up left cached for it; None until then (see count_admission)
        self.first_request_cached_tokens: int | None = None

    @property
    def capacity_tokens(self) -> int:
        return self.allocator.num_blocks * self.block_size

    # ------------------------------------------------------------------ admission
    def match(self, seq: Sequence) -> None:
        """Take the cached prefix: lock it and start the block table with its blocks."""
        assert not seq.block_table and seq.lock_node is None
        seq.num_computed = 0
        if self.cache is None or seq.wants_prompt_logprobs:  # every prompt token's logits are needed
            return
        max_blocks = len(seq.tokens) // self.block_size if seq.prefill_only else None
        # after a preemption the sequence takes back the blocks it held: matching them is no reuse
        # (blocks past them, published by others meanwhile, are)
        own = seq.own_cached_blocks if seq.admitted_once else 0
        if seq.sibling:  # the prompt its first choice computed is no more reused than its own would be
            own = len(seq.tokens) // self.block_size
        m = self.cache.match(seq.tokens, cache_salt=seq.params.cache_salt, max_blocks=max_blocks, count=False,
                             own_blocks=own, hit=not seq.prefill_only)  # warm-up is not the working set
        self.cache.lock(m.node)
        seq.lock_node = m.node
        seq.block_table = list(m.blocks)
        seq.num_cached_blocks = len(m.blocks)
        seq.num_computed = m.num_tokens

    def match_mark(self, seq: Sequence) -> tuple:
        """Where ``seq``'s match ended (call between ``match`` and ``release``), for ``match_grew``: its
        last node, that node's length then, and the tokens matched; () if no match can ever give more."""
        node = seq.lock_node
        if node is None:  # no cache, or every prompt token's logits asked for
            return ()
        return node, len(node.blocks), seq.num_computed

    def match_grew(self, seq: Sequence, mark: tuple) -> bool:
        """Whether matching ``seq`` again could give more than at ``mark``, by a one-block look: the cache
        holds the block after its match, or the match's last node was cut or dropped since (then True
        to be safe). A waiting prompt is not matched again at every step for nothing: a match packs
        the whole prompt, and the cache takes blocks at nearly every step."""
        if not mark:
            return False
        node, length, depth = mark
        if node.is_root:  # (a root made for a look is not kept: ask for the tenant's own)
            node = self.cache.root(seq.params.cache_salt, keep=False)
        elif not node.alive or len(node.blocks) != length:
            return True
        return pack_tokens(seq.token_range(depth, depth + self.block_size)) in node.children

    def count_admission(self, seq: Sequence) -> None:
        """Prefix-cache stats count a request once: a re-admission after preemption is not a query."""
        if seq.admitted_once:
            return
        seq.admitted_once = True
        if seq.prefill_only:
            return  # warm-up is not user traffic: keep it out of the hit rate
        seq.num_cached_prompt_tokens = min(seq.num_computed, len(seq.prompt_ids))
        # taken in order, not as they finish: a later request that hit the first one's blocks and finished
        # first reported a hit on a cold replica (a sibling's hit is its first choice's work)
        if self.first_request_cached_tokens is None and not seq.sibling and len(seq.prompt_ids) > self.block_size:
            self.first_request_cached_tokens = seq.num_cached_prompt_tokens
        if self.cache is not None:
            c = self.cache.counters
            c.queries += 1
            c.query_tokens += len(seq.prompt_ids)
            c.hit_tokens += seq.num_cached_prompt_tokens

    def ensure_blocks(self, seq: Sequence, num_tokens: int) -> bool:
        """Grow the block table to hold ``num_tokens`` tokens; False (nothing changed) if the pool can't."""
        need = self.allocator.blocks_for_tokens(num_tokens) - len(seq.block_table)
        if need <= 0:
            return True
        try:
            seq.block_table.extend(self.allocator.allocate(need))
        except OutOfBlocks:
            return False
        return True

    # ------------------------------------------------------------------ after a forward pass
    def publish(self, seq: Sequence) -> None:
        """Insert the sequence's fully written blocks into the radix cache (prompt and generated
        tokens alike; for sliding-window models only the prompt, so generated blocks can leave the
        window and go back to the pool)."""
        if self.cache is None:
            return
        written = seq.num_computed
        if self.window_size is not None:
            written = min(written, len(seq.prompt_ids))
        full = written // self.block_size
        if full <= seq.num_cached_blocks:
            return
        # warm-up prefills prefixes known to be hot: protect them like reused ones
        res = self.cache.insert(seq.tokens, seq.block_table[:full], cache_salt=seq.params.cache_salt,
                                protect=seq.prefill_only)
        self.cache.lock(res.node)
        if seq.lock_node is not None:
            self.cache.unlock(seq.lock_node)
        seq.lock_node = res.node
        self.allocator.free(res.redundant)
        seq.block_table[:full] = res.blocks
        seq.num_cached_blocks = full

    def trim_window(self, seq: Sequence) -> int:
        if self.window_size is None:
            return 0
        # the next query sits at position num_computed; it sees keys > num_computed - window
        return self.allocator.release_out_of_window(seq.block_table, seq.num_cached_blocks,
                                                    seq.num_computed + 1, self.window_size)

    # ------------------------------------------------------------------ release
    def release(self, seq: Sequence) -> None:
        """Give back everything the sequence holds (blocks already published stay cached)."""
        if self.cache is not None and seq.lock_node is not None:
            self.cache.unlock(seq.lock_node)
        self.allocator.free(seq.private_blocks)
        seq.own_cached_blocks = seq.num_cached_blocks  # what a re-admission takes back
        seq.lock_node = None
        seq.block_table = []
        seq.num_cached_blocks = 0
        seq.num_computed = 0

    def check(self, live: list[Sequence]) -> None:
        """Assert the pool's books balance (see ``BlockAllocator.check_invariants``), and that each cache
        lock belongs to a live request whose cached blocks are the path it locked: a lock nobody owns
        shrinks the pool for good, and a cached block off its owner's locked path can be evicted and
        handed to another request while the owner still reads it."""
        self.allocator.check_invariants([s.private_blocks for s in live])
        if self.cache is None:
            return
        owners: Counter[int] = Counter()
        for s in live:
            nodes, node = [], s.lock_node
            while node is not None and node.parent is not None:
                assert node.alive, f"request {s.request_id} holds a lock on a removed node"
                owners[id(node)] += 1
                nodes.append(node)
                node = node.parent
            path = [b for n in reversed(nodes) for b in n.blocks]
            assert path == s.block_table[:s.num_cached_blocks], (
                f"request {s.request_id}'s cached blocks are not the path it locked")
        for node in self.cache._iter_nodes():
            assert node.lock_ref == owners[id(node)], "a prefix-cache lock that no live request owns"
