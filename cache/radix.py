"""Block-granular radix prefix cache.

A radix trie over token ids whose edges are whole blocks. Each node holds a run of blocks: their
packed tokens (the key, compared byte for byte, so a hash collision can never return a wrong
block), their KV block ids, and their chained hashes (what the router and the Redis directory
see). One trie per tenant salt, so identical prompts of different tenants never share KV.

Lifecycle of a block id: the allocator hands it to a request; once its KV is written the request
inserts it here and the cache owns it; the request keeps it alive with ``lock``; when no request
holds it and it sits on a leaf, it is evictable, least recently used first, down to single blocks.
Locking a node locks its whole path, so an interior node is never evicted before its children.
"""

from __future__ import annotations

import heapq
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

from cache.hashing import chain_hashes, pack_tokens, root_hash
from cache.hot_sketch import BottomK


@dataclass(eq=False, slots=True)
class Node:
    key: bytes  # packed uint32 tokens of this node's blocks
    blocks: list[int]
    hashes: list[int]
    parent: Node | None
    children: dict[bytes, Node] = field(default_factory=dict)
    lock_ref: int = 0
    last_access: int = 0
    reused: bool = False  # matched by a later request (or warmed on purpose): protected from eviction
    last_hit: float = float("-inf")  # wall clock (the cache's ``clock``) of its last hit: the working set
    seed_hash: int = 0  # roots only: the chain's starting hash
    salt: str | None = None  # roots only
    alive: bool = True

    @property
    def is_root(self) -> bool:
        return self.parent is None

    def tail_hash(self) -> int:
        return self.hashes[-1] if self.hashes else self.seed_hash


@dataclass(slots=True)
class PrefixMatch:
    """Result of a lookup: the cached blocks of the longest matching prefix."""

    blocks: list[int]
    hashes: list[int]
    node: Node  # deepest matched node: pass to lock()/unlock()
    block_size: int

    @property
    def num_tokens(self) -> int:
        return len(self.blocks) * self.block_size


@dataclass(slots=True)
class InsertResult:
    node: Node  # deepest node now covering the inserted blocks
    blocks: list[int]  # canonical block ids for the inserted span (use these from now on)
    redundant: list[int]  # caller's blocks that duplicated cached ones: free them
    new_hashes: list[int]  # hashes of blocks added to the cache by this insert


@dataclass(slots=True)
class CacheCounters:
    queries: int = 0  # lookups
    query_tokens: int = 0  # prompt tokens looked up
    hit_tokens: int = 0  # of which served from cache
    inserted_blocks: int = 0
    evicted_blocks: int = 0
    # computed again soon after their eviction (still in the ghost list): the cache was too small for
    # them, work that a bigger cache (another replica) would have saved
    recomputed_blocks: int = 0


class RadixCache:
    def __init__(self, block_size: int, model_id: str = "", record_events: bool = False,
                 reuse_bonus: int = 0, clock: Callable[[], float] = time.monotonic):
        """``reuse_bonus``: how many cache operations (lookups + inserts) longer a block that was
        reused, or recomputed soon after its eviction, outlives one that never was. Prompts' unique
        tails (a question, a generated answer) would otherwise push out a shared system prompt as
        soon as it is a little older than them (plain LRU is not scan-resistant). 0 is plain LRU;
        the engine passes about its pool size. ``clock`` stamps hits (``hot_blocks``); eviction
        order never reads it."""
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        if reuse_bonus < 0:
            raise ValueError(f"reuse_bonus must be >= 0, got {reuse_bonus}")
        self.block_size = block_size
        self.model_id = model_id
        self.reuse_bonus = reuse_bonus
        self.wall_clock = clock
        # hashes of recently evicted blocks (bounded): a block computed again soon after eviction is
        # in demand, so it comes back protected and leaves the list until evicted again (ARC's ghosts)
        self._ghost: OrderedDict[int, None] = OrderedDict()
        self._step = block_size * 4
        self._roots: dict[str | None, Node] = {}
        self._clock = 0
        self._heap: list[tuple[int, int, Node]] = []  # (eviction key, tiebreak, leaf), lazily refreshed
        self._tiebreak = 0
        self._num_nodes = 0
        self.evictable_blocks = 0
        self.locked_blocks = 0
        self.counters = CacheCounters()
        # ("stored" | "removed", hashes): drained by the replica to keep routers/directories current;
        # bounded, so a replica nobody drains cannot grow without limit (overflow tells the reader)
        self.record_events = record_events
        self.events: list[tuple[str, list[int]]] = []
        self.max_events = 100_000
        self.events_overflowed = False

    # ----------------------------------------------------------------- queries
    @property
    def cached_blocks(self) -> int:
        return self.evictable_blocks + self.locked_blocks

    def root(self, cache_salt: str | None = None, keep: bool = True) -> Node:
        """The tenant's trie. ``keep=False``: a lookup does not create one to keep (an empty root that
        nothing stores under would stay for good: one per salt a client ever sent); ``insert`` does."""
        cache_salt = cache_salt or None  # "" hashes as unsalted (cache.hashing): it is unsalted here too
        node = self._roots.get(cache_salt)
        if node is None:
            node = Node(key=b"", blocks=[], hashes=[], parent=None,
                        seed_hash=root_hash(self.model_id, cache_salt), salt=cache_salt)
            if keep:
                self._roots[cache_salt] = node
        return node

    def match(self, token_ids: Sequence[int], cache_salt: str | None = None,
              max_blocks: int | None = None, count: bool = True, own_blocks: int = 0, hit: bool = True) -> PrefixMatch:
        """Longest cached prefix of ``token_ids``, in whole blocks.

        By default at most ``(n - 1) // block_size`` blocks match: the last prompt token is always
        recomputed, since its logits start generation. Touches the path (LRU) and splits a node
        when the match ends inside it, so the returned node can be locked exactly. Matched blocks
        count as reused (protected), except nodes within the first ``own_blocks``: a request taking
        back blocks it published itself (after a preemption) is not a second user of them. ``hit``: a
        request will use the match (stamps the working set, see ``hot_blocks``); False for a look.
        """
        n = len(token_ids)
        limit = (n - 1) // self.block_size if max_blocks is None else min(max_blocks, n // self.block_size)
        self._clock += 1
        node = self.root(cache_salt, keep=False)
        blocks: list[int] = []
        hashes: list[int] = []
        if limit > 0:
            packed = pack_tokens(token_ids[: limit * self.block_size])
            node = self._walk(node, packed, blocks, hashes, own_blocks, hit)
        if count:
            c = self.counters
            c.queries += 1
            c.query_tokens += n
            c.hit_tokens += len(blocks) * self.block_size
        return PrefixMatch(blocks, hashes, node, self.block_size)

    def _walk(self, node: Node, packed: bytes, blocks: list[int], hashes: list[int], own_blocks: int = 0,
              hit: bool = True) -> Node:
        step, pos, end = self._step, 0, len(packed)
        now = None
        while pos < end:
            child = node.children.get(packed[pos:pos + step])
            if child is None:
                break
            m = self._common_blocks(child.key, packed, pos)
            if m < len(child.blocks):
                child = self._split(child, m)
            child.last_access = self._clock
            if len(blocks) + len(child.blocks) > own_blocks:
                child.reused = True
                if hit:
                    child.last_hit = now = self.wall_clock() if now is None else now
            blocks.extend(child.blocks)
            hashes.extend(child.hashes)
            pos += m * step
            node = child  # a mismatch ends the loop: no child is keyed by the differing block
        return node

    def _common_blocks(self, key: bytes, packed: bytes, pos: int) -> int:
        """Number of leading whole blocks shared by ``key`` and ``packed[pos:]`` (>= 1 here)."""
        step = self._step
        hi = min(len(key), len(packed) - pos) // step
        if packed[pos:pos + hi * step] == key[: hi * step]:
            return hi
        lo = 1  # the first block matched through the children dict
        while lo + 1 < hi:  # invariant: lo blocks match, hi blocks do not
            mid = (lo + hi) // 2
            if packed[pos:pos + mid * step] == key[: mid * step]:
                lo = mid
            else:
                hi = mid
        return lo

    def _split(self, node: Node, m: int) -> Node:
        """Split ``node`` after ``m`` blocks; returns the new prefix node (node keeps the suffix,
        so references held by lockers stay valid: every lock through the suffix covers the prefix)."""
        cut = m * self._step
        parent = node.parent
        assert parent is not None and 0 < m < len(node.blocks)
        prefix = Node(key=node.key[:cut], blocks=node.blocks[:m], hashes=node.hashes[:m],
                      parent=parent, lock_ref=node.lock_ref, last_access=node.last_access, reused=node.reused,
                      last_hit=node.last_hit)
        parent.children[node.key[: self._step]] = prefix
        node.key, node.blocks, node.hashes = node.key[cut:], node.blocks[m:], node.hashes[m:]
        node.parent = prefix
        prefix.children[node.key[: self._step]] = node
        self._num_nodes += 1
        return prefix

    # ----------------------------------------------------------------- insert
    def insert(self, token_ids: Sequence[int], blocks: Sequence[int],
               cache_salt: str | None = None, protect: bool = False) -> InsertResult:
        """Publish ``blocks`` (whose KV is already written) as the cache of ``token_ids``'s first
        ``len(blocks)`` full blocks. Where the prefix is already cached the cached blocks win and the
        caller's duplicates come back as ``redundant``. ``protect``: count the span as reused (warm-up
        prefills prefixes known to be hot)."""
        k = len(blocks)
        if len(token_ids) < k * self.block_size:
            raise ValueError(f"{k} blocks need {k * self.block_size} tokens, got {len(token_ids)}")
        self._clock += 1
        node = self.root(cache_salt, keep=k > 0)
        canonical: list[int] = []
        redundant: list[int] = []
        new_hashes: list[int] = []
        if k == 0:
            return InsertResult(node, canonical, redundant, new_hashes)
        step = self._step
        packed = pack_tokens(token_ids[: k * self.block_size])
        pos, i = 0, 0
        while i < k:
            child = node.children.get(packed[pos:pos + step])
            if child is None:
                new_hashes = chain_hashes(packed[pos:], self.block_size, node.tail_hash())
                leaf = Node(key=packed[pos:], blocks=list(blocks[i:]), hashes=new_hashes, parent=node,
                            last_access=self._clock, reused=protect)
                node.children[packed[pos:pos + step]] = leaf
                self._num_nodes += 1
                self.evictable_blocks += len(leaf.blocks)
                self.counters.inserted_blocks += len(leaf.blocks)
                self._push(leaf)
                canonical.extend(leaf.blocks)
                self._protect_returning(leaf)  # may split it: after reading its blocks
                if self.record_events:
                    self._event("stored", list(new_hashes))
                return InsertResult(leaf, canonical, redundant, new_hashes)
            m = self._common_blocks(child.key, packed, pos)
            if m < len(child.blocks):
                child = self._split(child, m)
            for j, cached in enumerate(child.blocks):
                canonical.append(cached)
                if blocks[i + j] != cached:
                    redundant.append(blocks[i + j])
            child.last_access = self._clock
            child.reused = child.reused or protect
            i += m
            pos += m * step
            node = child
        return InsertResult(node, canonical, redundant, new_hashes)

    def _protect_returning(self, leaf: Node) -> None:
        """Mark the leading blocks of a new leaf that were evicted recently as reused (and count them
        as recomputed)."""
        if not self._ghost or leaf.reused:
            return
        ghost, n = self._ghost, 0
        for h in leaf.hashes:
            if h not in ghost:
                break
            del ghost[h]  # back: out of the ghost list until evicted again
            n += 1
        self.counters.recomputed_blocks += n
        if n == len(leaf.blocks):
            leaf.reused = True
        elif n:
            self._split(leaf, n).reused = True

    # ----------------------------------------------------------------- locking
    def lock(self, node: Node) -> None:
        """Mark ``node`` and its ancestors in use: none of them can be evicted until ``unlock``."""
        while node.parent is not None:
            if node.lock_ref == 0:
                self.evictable_blocks -= len(node.blocks)
                self.locked_blocks += len(node.blocks)
            node.lock_ref += 1
            node = node.parent

    def unlock(self, node: Node) -> None:
        leaf = node
        while node.parent is not None:
            if node.lock_ref <= 0:
                raise RuntimeError("unlock of a node that is not locked")
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self.evictable_blocks += len(node.blocks)
                self.locked_blocks -= len(node.blocks)
            node = node.parent
        if leaf.parent is not None and leaf.lock_ref == 0 and not leaf.children:
            self._push(leaf)

    # ----------------------------------------------------------------- eviction
    def _evict_key(self, node: Node) -> int:
        return node.last_access + (self.reuse_bonus if node.reused else 0)

    def _push(self, leaf: Node) -> None:
        self._tiebreak += 1
        heapq.heappush(self._heap, (self._evict_key(leaf), self._tiebreak, leaf))
        if len(self._heap) > 2 * self._num_nodes + 64:
            self._rebuild_heap()

    def _rebuild_heap(self) -> None:
        """Drop stale entries (dead, locked, interior): keeps the heap O(live leaves)."""
        entries = []
        for node in self._iter_nodes():
            if node.lock_ref == 0 and not node.children:
                self._tiebreak += 1
                entries.append((self._evict_key(node), self._tiebreak, node))
        heapq.heapify(entries)
        self._heap = entries

    def _pop_lru_leaf(self) -> Node | None:
        heap = self._heap
        while heap:
            stamp, _, node = heapq.heappop(heap)
            if not node.alive or node.lock_ref or node.children:
                continue  # stale: it will be pushed again when it becomes evictable
            if stamp != self._evict_key(node):  # touched since: re-queue at its true age
                self._tiebreak += 1
                heapq.heappush(heap, (self._evict_key(node), self._tiebreak, node))
                continue
            return node
        return None

    def evict(self, num_blocks: int) -> list[int]:
        """Free up to ``num_blocks`` blocks from unlocked leaves, least recently used first (a reused
        leaf counts as ``reuse_bonus`` operations younger than it is); a leaf
        is cut from its tail when only part of it is needed. Returns the freed block ids."""
        freed: list[int] = []
        while len(freed) < num_blocks:
            leaf = self._pop_lru_leaf()
            if leaf is None:
                break
            take = min(num_blocks - len(freed), len(leaf.blocks))
            cut = len(leaf.blocks) - take
            freed.extend(reversed(leaf.blocks[cut:]))  # deepest first, like one-by-one eviction
            removed = leaf.hashes[cut:]
            self.evictable_blocks -= take
            self.counters.evicted_blocks += take
            if self.record_events:
                self._event("removed", removed)
            if self.reuse_bonus:
                ghost = self._ghost
                for h in removed:  # newest end, also for a block that was still listed (a warm-up put
                    ghost.pop(h, None)  # it back without a look-up, or it followed one that was not)
                    ghost[h] = None
                while len(ghost) > 4 * self.reuse_bonus:  # remembers a few pools of evictions
                    ghost.popitem(last=False)
            if cut:
                leaf.key, leaf.blocks, leaf.hashes = leaf.key[: cut * self._step], leaf.blocks[:cut], leaf.hashes[:cut]
                self._push(leaf)
            else:
                self._remove_leaf(leaf)
        return freed

    def _remove_leaf(self, leaf: Node) -> None:
        parent = leaf.parent
        assert parent is not None
        del parent.children[leaf.key[: self._step]]
        leaf.alive = False
        self._num_nodes -= 1
        if parent.parent is not None:
            if parent.lock_ref == 0 and not parent.children:
                self._push(parent)
        elif not parent.children and parent.salt is not None:
            self._roots.pop(parent.salt, None)  # forget empty tenant tries

    # ----------------------------------------------------------------- introspection
    def _iter_nodes(self) -> Iterator[Node]:
        stack = list(self._roots.values())
        while stack:
            node = stack.pop()
            if node.parent is not None:
                yield node
            stack.extend(node.children.values())

    def hot_blocks(self, since: float) -> int:
        """Cached blocks that served a hit at ``since`` (the cache's clock) or later: the working set a
        replica would lose if it went away. Walks the tree (O(nodes)): for periodic stats only."""
        return self.hot_walk(since, whole=True).blocks

    def hot_walk(self, since: float, whole: bool = False) -> HotWalk:
        """``hot_blocks`` a slice at a time (``HotWalk.advance``), between other cache operations; ``whole``:
        walked to its end at once."""
        walk = HotWalk(list(self._roots.values()), since)
        if whole:
            walk.advance(None)
        return walk

    def block_ids(self) -> list[int]:
        """Every block the cache owns (for invariant checks)."""
        return [b for node in self._iter_nodes() for b in node.blocks]

    def all_hashes(self) -> list[int]:
        return [h for node in self._iter_nodes() for h in node.hashes]

    def check(self) -> None:
        """Recompute the counters from the tree and compare (cheap enough for tests)."""
        evictable = locked = nodes = 0
        for node in self._iter_nodes():
            nodes += 1
            assert node.alive and node.blocks, "empty or dead node in tree"
            assert len(node.key) == len(node.blocks) * self._step == len(node.hashes) * self._step
            expect = sum(c.lock_ref for c in node.children.values())
            assert node.lock_ref >= expect, "parent locked less than its children"
            if node.lock_ref:
                locked += len(node.blocks)
            else:
                evictable += len(node.blocks)
        assert nodes == self._num_nodes, (nodes, self._num_nodes)
        assert (evictable, locked) == (self.evictable_blocks, self.locked_blocks), (
            (evictable, locked), (self.evictable_blocks, self.locked_blocks))

    def _event(self, kind: str, hashes: list[int]) -> None:
        if len(self.events) >= self.max_events:
            del self.events[: len(self.events) // 2]
            self.events_overflowed = True
        self.events.append((kind, hashes))

    def drain_events(self) -> tuple[list[tuple[str, list[int]]], bool]:
        """Events since the last drain, and whether some were dropped (then resynchronize)."""
        events, overflowed = self.events, self.events_overflowed
        self.events, self.events_overflowed = [], False
        return events, overflowed


class HotWalk:
    """Counts the working set (blocks hit at ``since`` or later) a few nodes at a time: walking a big
    tree at once holds the engine thread (~40 ms per 100k nodes). The cache may change between slices:
    nodes evicted meanwhile are skipped and nodes added after they were due are missed, so a count
    taken while serving is an estimate (what the autoscaling policy needs). ``sketch`` keeps the
    smallest hashes of those blocks: the fleet's sketches merge into a count of the distinct ones."""

    def __init__(self, roots: list[Node], since: float):
        self._stack = roots
        self.since = since
        self.blocks = 0
        self.sketch = BottomK()

    @property
    def done(self) -> bool:
        return not self._stack

    def advance(self, max_nodes: int | None) -> bool:
        """Visit up to ``max_nodes`` more nodes (None: all; a hot node counts once more per 8 blocks it
        holds, which its sketching costs); True once the walk is complete."""
        stack, since, n = self._stack, self.since, 0
        while stack and (max_nodes is None or n < max_nodes):
            node = stack.pop()
            n += 1
            if not node.alive:
                continue  # evicted since it was queued (with its subtree)
            if node.parent is not None and node.last_hit >= since:
                self.blocks += len(node.blocks)
                self.sketch.update(node.hashes)
                n += len(node.blocks) // 8
            stack.extend(node.children.values())
        return not stack
