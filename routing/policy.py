"""Prefix-aware routing policy: affinity, a per-candidate load bound, and cold spreading.

Pure Python (no Ray, no torch), shared by the Ray Serve request router and the simulator.

The router keeps, per replica, an approximate index of the block-hash chains it has sent there (the
same ``cache.hashing`` chains the engines cache), bounded by that replica's KV capacity plus the new
blocks of its requests in flight (a queued prompt is cached only when it runs, so trimming to the
capacity at routing time dropped prefixes the replica still held), trimmed the way the replica evicts
(``routing.block_index``) and corrected by what replicas report. A request goes to the replica that
holds the longest part of its prefix, unless that holder's recent work rate is above the fleet's mean
by more than a tolerance; the tolerance shrinks as the prefix gets more popular, so a hot prefix gets
a second holder early and a rare one is never copied for balance (a copy costs a full prefill and
evicts something else). Among equal holders the least busy one wins, which splits a hot prefix's
traffic between its copies. A prefix lighter than ``move_popularity`` of one replica's traffic that no
holder takes moves rather than being copied: the router forgets it on its holders. A request that
matches nowhere goes back to the replica its prefix last went to if that one is under the load bounds
(the index lost track of it, but the replica may still cache part of it; a prefix that wanders evicts
another one elsewhere); a new prefix goes to a new or emptied replica first, else (up to
``small_fleet`` replicas) to the one that is home to the fewest prefixes, ties broken by the prefix's
consistent-hash ring walk (larger fleets: the first replica on that walk under the load bounds). Work
rates (decayed sums of routed work) balance the long run; a replica that joins starts at the fleet's
mean, so load moves to it as the rates decay. Outstanding work bounds bursts.
"""

from __future__ import annotations

import bisect
import heapq
from collections import Counter, OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import xxhash

from routing.block_index import GHOST_POOLS, BlockIndex
from routing.holders import Holders


@dataclass
class PolicyConfig:
    block_size: int = 16
    # prefill tokens one token of outstanding work costs a holder's score, for a prefix of one
    # replica's fair share of traffic (scaled by popularity). 0: holders are ranked by match length,
    # then by recent work; bursts are still bounded by spill_load_factor below.
    load_weight: float = 0.0
    decode_token_cost: float = 8.0  # outstanding work of one generated token, in prefill tokens
    default_capacity_blocks: int = 4096  # index bound until a replica reports its pool size
    # A holder whose recent work rate exceeds the fleet mean x (1 + rate_tolerance / popularity)
    # gets no more of that prefix; rates decay with this half-life (in routed requests).
    rate_tolerance: float = 0.08
    rate_half_life: float = 250.0  # routed requests per replica (the fleet's half-life scales with its size)
    # Nor does any replica whose outstanding work exceeds spill_load_factor x the fleet mean + slack.
    spill_load_factor: float = 1.25
    spill_slack_tokens: float = 256.0
    ring_vnodes: int = 32  # large fleets place cold prefixes by a consistent-hash ring walk
    small_fleet: int = 64  # up to this many replicas, cold placement scans them all
    # a new prefix may go to a replica that is home to this many more prefixes than the fewest
    placement_slack: int = 0
    fill_threshold: float = 0.5  # replicas whose index is below this share of capacity get cold traffic first
    # Popularity: a prefix's share of recent requests x replicas (1.0 = one replica's fair share).
    popularity_half_life: float = 2000.0  # requests
    popularity_min_scale: float = 0.1
    popularity_max_scale: float = 4.0
    min_match_blocks: int = 1  # fewer matched blocks than this counts as cold
    home_memory: int = 200_000  # prefixes whose last replica is remembered (see _cold_choice)
    popularity_memory: int = 200_000  # prefixes whose popularity is counted (the least recently seen go)
    # A prefix with less traffic than this (in fair shares) whose holders are all over its work-rate
    # bound moves to the replica it spills to: the router forgets it on the old holders instead of
    # counting on two copies (see _move_away). One that moved within move_cooldown rate half-lives
    # (a quarter: 62 routed requests per replica) is copied instead: it keeps overloading its homes.
    move_popularity: float = 0.9
    move_cooldown: float = 0.25


@dataclass(frozen=True, slots=True)
class Routed:
    """What ``on_routed`` returns, to pass back to ``on_completed`` when the request ends."""

    work: float  # estimated work (prefill tokens)
    new_blocks: int  # blocks the request adds to the replica's cache (its unmatched part)
    new_tokens: int = 0  # tokens it may generate (max_new_tokens), counted in ``work``
    at: int = 0  # routing counter when routed (the work rate has decayed since)


@dataclass(eq=False)
class ReplicaView:
    replica_id: str
    capacity_blocks: int
    index: BlockIndex = field(default_factory=BlockIndex)  # block hashes it likely caches
    outstanding: float = 0.0  # estimated work routed here and not completed (prefill tokens)
    in_flight: int = 0
    pending_blocks: int = 0  # new blocks of the requests in flight there (not all cached yet)
    last_cold: int = 0  # routing counter when it last received a cold request
    routed: int = 0
    version: int = 0  # bumps when its load key changes (lazy heap of least-loaded replicas)
    stats_seq: int | None = None  # last replica report folded in
    recent: float = 0.0  # decayed sum of work routed here (see PolicyConfig.rate_half_life)
    recent_at: int = 0  # routing counter when ``recent`` was last brought up to date
    # placement count: the prefixes homed here (PrefixPolicy._home_counts, set by routing and by
    # learn_hashes) plus a head start: a replica added to a running fleet starts one cache's worth of
    # prefixes behind the emptiest one, not at zero (old replicas' counts include every prefix the
    # router still remembers, most long gone from their caches)
    home_base: int = 0
    home_raw: float | None = None  # home_base before rounding and the floor at 0 (joined a running fleet)
    join_prompt_blocks: float = 1.0  # the mean prompt (blocks) that sized its head start in prefixes


class PrefixPolicy:
    def __init__(self, config: PolicyConfig | None = None):
        self.cfg = config or PolicyConfig()
        self.replicas: dict[str, ReplicaView] = {}
        self.holders = Holders()  # block hash -> replicas whose index has it
        self._counter = 0
        self._heap: list[tuple] = []  # (outstanding, index size, last cold, version, id), lazily refreshed
        self._ring: list[tuple[int, str]] = []  # (point, replica): consistent-hash order for cold routes
        self._total_outstanding = 0.0
        self._unfilled: set[str] = set()  # replicas whose index is still small (new, restarted)
        # first-block hash -> (decayed count, at request n), least recently counted first
        self._pop: OrderedDict[int, tuple[float, int]] = OrderedDict()
        self._pop_total = (0.0, 0)
        self._home: OrderedDict[int, str] = OrderedDict()  # first-block hash -> replica it last went to
        self._home_counts: Counter[str] = Counter()  # replica -> entries of _home pointing at it (any id)
        self._moved: OrderedDict[int, int] = OrderedDict()  # first-block hash -> when it moved (oldest first)
        self._prompt_blocks = 0.0  # running mean of prompt length in blocks (sizes a cache in prefixes)
        self._recent_total = (0.0, 0)
        self.affinity_hits = 0
        self.cold_routes = 0

    # ------------------------------------------------------------------ fleet
    def add_replica(self, replica_id: str, capacity_blocks: int | None = None) -> None:
        if replica_id not in self.replicas:
            cap = capacity_blocks or self.cfg.default_capacity_blocks
            view = ReplicaView(replica_id, cap, BlockIndex(ghost_limit=GHOST_POOLS * cap))
            if self.replicas:  # joins a running fleet: one cache's worth of prefixes behind the emptiest
                view.join_prompt_blocks = max(self._prompt_blocks, 1.0)
                fill = cap / view.join_prompt_blocks
                view.home_raw = min(self.homes(r) for r in self.replicas) - fill - self._home_counts[replica_id]
                view.home_base = max(0, round(view.home_raw))
                # and at the fleet's mean work rate: at zero, every holder would be over the rate bound
                # at once and the newcomer would take all traffic (recomputing each prefix while the
                # warm caches idle) until its rate caught up; cold placement still fills it first
                total = self._reanchor_rates()
                view.recent, view.recent_at = total / len(self.replicas), self._counter
                self._recent_total = (total + view.recent, self._counter)
            self.replicas[replica_id] = view
            self._push_load(view)
            self._unfilled.add(replica_id)
            for v in range(self.cfg.ring_vnodes):
                bisect.insort(self._ring, (xxhash.xxh64_intdigest(f"{replica_id}#{v}".encode()), replica_id))

    def remove_replica(self, replica_id: str) -> None:
        """Forget a replica at once (it died or drained): its index must not attract traffic."""
        if replica_id not in self.replicas:
            return
        self._reanchor_rates()
        view = self.replicas.pop(replica_id)
        self._total_outstanding -= view.outstanding
        self._recent_total = (self._recent_total[0] - view.recent, self._counter)
        self._unfilled.discard(replica_id)
        self._ring = [x for x in self._ring if x[1] != replica_id]
        self.holders.remove_replica(replica_id, view.index)

    def _reanchor_rates(self) -> float:
        """Bring every replica's work rate (and the fleet's sum) up to now; returns the sum. Rates decay
        with a half-life that scales with the fleet, so at a fleet change they are settled with the old
        one: the sum then stays the sum of the parts, whatever the new half-life."""
        for view in self.replicas.values():
            view.recent, view.recent_at = self._recent(view), self._counter
        total = sum(view.recent for view in self.replicas.values())
        self._recent_total = (total, self._counter)
        return total

    def sync_replicas(self, replica_ids: Iterable[str]) -> None:
        live = set(replica_ids)
        for rid in list(self.replicas):
            if rid not in live:
                self.remove_replica(rid)
        for rid in live:
            self.add_replica(rid)

    # ------------------------------------------------------------------ index upkeep
    def _touch(self, view: ReplicaView, hashes: Sequence[int], use: bool = True) -> None:
        """Index ``hashes`` on the replica; ``use``: as used again (else known ones stay as they are)."""
        idx, rid, holders = view.index, view.replica_id, self.holders
        if use:
            # a chain's last block first: its first is then the most recent, and a trim takes the tail, as
            # the replica evicts a leaf's blocks from its end (the first block gone, the guess matched nothing
            # of a prompt the replica still held all but its last blocks of)
            new = [h for h in reversed(hashes) if idx.touch(h)]
        else:
            new = idx.add_chain(hashes)
        for h in new:
            holders.add(h, rid)
        self._trim(view)
        self._update_fill(view)

    def _update_fill(self, view: ReplicaView) -> None:
        if len(view.index) < self.cfg.fill_threshold * view.capacity_blocks:
            self._unfilled.add(view.replica_id)
        else:
            self._unfilled.discard(view.replica_id)

    def _trim(self, view: ReplicaView, cached: int | None = None) -> None:
        """Bound the index to what the replica caches (``cached``, default its capacity) plus the new
        blocks of its requests in flight, which it caches only when they run."""
        limit = (view.capacity_blocks if cached is None else cached) + view.pending_blocks
        idx = view.index
        for h in idx.trim(limit):
            self._drop_holder(h, view.replica_id)

    def _drop_holder(self, h: int, replica_id: str) -> None:
        self.holders.discard(h, replica_id)

    def forget_hashes(self, replica_id: str, hashes: Iterable[int]) -> None:
        """A replica reported evictions: stop counting on those blocks there."""
        view = self.replicas.get(replica_id)
        if view is None:
            return
        for h in hashes:
            if view.index.discard(h):
                self._drop_holder(h, replica_id)
        self._update_fill(view)

    def learn_hashes(self, replica_id: str, hashes: Sequence[int], from_root: bool = True) -> None:
        """A replica reported blocks it holds (warm-up, another router's traffic, the directory).
        ``from_root``: ``hashes`` is one chain from its first block (not a batch of stored events); a
        prefix without a live home (never placed, or its replica is gone) gets this replica as home."""
        view = self.replicas.get(replica_id)
        if view is not None:
            # a replica's report of what it stored is no second use of what the router already sent there
            # (promoted, those blocks would outlive the ones the replica protects); a chain from the root
            # (warm-up, the directory) is hot: the replica protects it
            self._touch(view, hashes, use=from_root)
            if from_root and hashes and self._home.get(hashes[0]) not in self.replicas:
                self._remember_home(hashes[0], replica_id)

    def report(self, replica_id: str, capacity_blocks: int | None = None, cached_blocks: int | None = None,
               in_flight: int | None = None) -> None:
        """Correct the view from a replica's own stats (stale by up to a stats period)."""
        view = self.replicas.get(replica_id)
        if view is None:
            return
        if capacity_blocks:
            if capacity_blocks != view.capacity_blocks and view.home_raw is not None:
                # it joined before its pool size was known (Serve adds replicas before their first report):
                # its head start was one default-sized cache of prefixes, now one of its own
                view.home_raw += (view.capacity_blocks - capacity_blocks) / view.join_prompt_blocks
                view.home_base = max(0, round(view.home_raw))
            view.capacity_blocks = capacity_blocks
            view.index.ghost_limit = GHOST_POOLS * capacity_blocks
        # the replica caches no more than it says: trim the oldest guesses beyond that
        limit = view.capacity_blocks if cached_blocks is None else min(view.capacity_blocks, max(cached_blocks, 0))
        self._trim(view, limit)
        self._update_fill(view)
        if in_flight is not None and in_flight == 0 and view.in_flight == 0:
            self._total_outstanding -= view.outstanding
            view.outstanding = 0.0  # drift guard: nothing running there
            view.pending_blocks = 0
        self._push_load(view)

    # ------------------------------------------------------------------ routing
    def matches(self, hashes: Sequence[int], candidates: Iterable[str] | None = None) -> dict[str, int]:
        """Matched leading blocks per replica (only replicas with at least one)."""
        return self.holders.matches(hashes, candidates)

    def work_of(self, prompt_tokens: int, matched_tokens: int, max_new_tokens: int) -> float:
        # (never negative: a caller's odd counts must not make a replica look busier or idler than idle)
        return max(0.0, (prompt_tokens - matched_tokens) + self.cfg.decode_token_cost * max(0, max_new_tokens))

    def choose(self, hashes: Sequence[int], prompt_tokens: int, max_new_tokens: int = 0,
               candidates: Sequence[str] | None = None) -> str | None:
        """The best candidate. Cheap at any fleet size: only replicas that hold the prefix are scored
        one by one; the cold choice scans small fleets and walks a ring (or a heap) in large ones."""
        return self._choose(hashes, candidates)[0]

    def _choose(self, hashes: Sequence[int], candidates: Sequence[str] | None) -> tuple[str | None, dict[str, int]]:
        """``choose``, and the matched blocks per candidate it scored (``rank`` orders the rest by them)."""
        if candidates is None or len(candidates) >= len(self.replicas):
            cands = None
        else:
            cands = [c for c in candidates if c in self.replicas]
            if not cands:
                return None, {}
        allowed = None if cands is None else set(cands)
        matched = self.matches(hashes, cands)
        cold = self._cold_choice(hashes[0] if hashes else None, allowed, spill=bool(matched))
        if cold is None:
            return None, matched
        bs = self.cfg.block_size
        pop = self._popularity_scale(hashes[0]) if hashes else 1.0
        w = self.cfg.load_weight * pop
        rate_bound = self._rate_bound(allowed, pop)
        best, best_score = cold, (-w * self.replicas[cold].outstanding, 0.0)
        for r, m in sorted(matched.items()):  # sorted: ties break the same every run
            if m < self.cfg.min_match_blocks:
                continue
            view = self.replicas[r]
            recent = self._recent(view)
            if recent > rate_bound:
                continue
            score = (m * bs - w * view.outstanding, -recent)
            if score > best_score:
                best, best_score = r, score
        return best, matched

    def _recent(self, view: ReplicaView) -> float:
        return self._decayed((view.recent, view.recent_at), self._rate_hl())

    def _rate_hl(self) -> float:
        return self.cfg.rate_half_life * max(len(self.replicas), 1)

    def _rate_bound(self, allowed: set[str] | None, pop: float) -> float:
        """Recent work above which a replica gets no more of a prefix of this popularity."""
        n = len(self.replicas) if allowed is None else len(allowed)
        total = self._decayed(self._recent_total, self._rate_hl()) if allowed is None else sum(
            self._recent(self.replicas[r]) for r in allowed)
        # + one big prompt's worth: no bound at all while the fleet is nearly idle
        return total / max(n, 1) * (1.0 + self.cfg.rate_tolerance / pop) + 2048.0

    def rank(self, hashes: Sequence[int], prompt_tokens: int, max_new_tokens: int = 0,
             candidates: Sequence[str] | None = None) -> list[str]:
        """All candidates, best first (for small fleets: the Serve router). Serve tries the next one when
        one is at its ``max_ongoing_requests``: the other holders of the prefix come first, longest match
        first, then the rest, least loaded first."""
        cands = list(self.replicas) if candidates is None else [c for c in candidates if c in self.replicas]
        best, matched = self._choose(hashes, cands)  # one chain walk serves both
        if best is None:
            return []
        return [best] + sorted((c for c in cands if c != best), key=lambda c: (-matched.get(c, 0), self._cold_key(c)))

    def _decayed(self, entry: tuple[float, int], half_life: float | None = None) -> float:
        value, at = entry
        return value * 0.5 ** ((self._counter - at) / (half_life or self.cfg.popularity_half_life))

    def _popularity_scale(self, key: int) -> float:
        """This prefix's share of recent requests, in units of one replica's fair share, clamped."""
        total = self._decayed(self._pop_total)
        if total <= 0:
            return 1.0
        share = self._decayed(self._pop.get(key, (0.0, self._counter))) / total
        c = self.cfg
        return min(c.popularity_max_scale, max(c.popularity_min_scale, share * len(self.replicas)))

    def _count(self, key: int) -> None:
        pop = self._pop
        pop[key] = (self._decayed(pop.get(key, (0.0, self._counter))) + 1.0, self._counter)
        pop.move_to_end(key)
        self._pop_total = (self._decayed(self._pop_total) + 1.0, self._counter)
        if len(pop) > self.cfg.popularity_memory:  # bounded: forget the least recently counted (one at a
            pop.popitem(last=False)  # time: sorting them all paused routing for 150 ms)

    def _remember_home(self, key: int, replica_id: str) -> None:
        home, counts = self._home, self._home_counts
        old = home.get(key)
        if old != replica_id:
            if old is not None:
                self._uncount_home(old)
            counts[replica_id] += 1
        home[key] = replica_id
        home.move_to_end(key)
        if len(home) > self.cfg.home_memory:
            self._uncount_home(home.popitem(last=False)[1])

    def _uncount_home(self, replica_id: str) -> None:
        counts = self._home_counts
        counts[replica_id] -= 1
        if counts[replica_id] <= 0:
            del counts[replica_id]  # bounded: only ids that some remembered prefix points at

    def homes(self, replica_id: str) -> int:
        """How many prefixes count as living on this replica, for placing new ones."""
        view = self.replicas.get(replica_id)
        return self._home_counts[replica_id] + (view.home_base if view is not None else 0)

    def _load_bound(self, allowed) -> float:
        """Outstanding work above which a replica takes no affinity or spill traffic."""
        n = len(self.replicas) if allowed is None else len(allowed)
        total = self._total_outstanding if allowed is None else sum(self.replicas[r].outstanding for r in allowed)
        return self.cfg.spill_load_factor * total / max(n, 1) + self.cfg.spill_slack_tokens

    def _cold_choice(self, key: int | None, allowed: set[str] | None, spill: bool = False) -> str | None:
        """Where a request goes when no holder takes it, among replicas under both load bounds: a prefix
        seen before to the replica it last went to; a new one to an unfilled replica, else to the one
        that is home to the fewest prefixes (first on its ring walk among equals), so caches fill
        evenly; a spilled one to the least busy. Large fleets: an idle new replica, else the first
        replica under the bounds on the ring walk. Everyone over the bounds: the least loaded."""
        n = len(self.replicas) if allowed is None else len(allowed)
        if n == 0:
            return None
        bound = self._load_bound(allowed)
        rate_bound = self._rate_bound(allowed, 1.0)

        def ok(rid: str) -> bool:
            view = self.replicas[rid]
            return view.outstanding <= bound and self._recent(view) <= rate_bound

        if not spill and key is not None:
            # a prefix the index lost track of goes back to where it went last: that replica may still
            # cache part of it, and otherwise its own eviction decides (prefixes do not wander the fleet)
            home = self._home.get(key)
            if home is not None and home in self.replicas and (allowed is None or home in allowed) and ok(home):
                return home
        if n <= self.cfg.small_fleet:
            pool = [r for r in sorted(self.replicas if allowed is None else allowed) if ok(r)]
            if pool:
                if spill:
                    return min(pool, key=lambda r: self._recent(self.replicas[r]))
                unfilled = [r for r in pool if r in self._unfilled]  # new or emptied replicas fill first
                homes = {r: self.homes(r) for r in pool}
                fewest = min(homes.values()) + self.cfg.placement_slack
                roomy = unfilled or [r for r in pool if homes[r] <= fewest]
                if key is None or len(roomy) == 1 or unfilled:
                    return min(roomy, key=lambda r: (homes[r], self._recent(self.replicas[r])))
                return self._ring_walk(key, set(roomy))
        elif allowed is None and self._unfilled:
            # large fleets: the least-loaded heap (keyed by load, then index size) finds idle new replicas
            rid = self._least_loaded()
            if rid in self._unfilled:
                return rid
        if key is not None and n > self.cfg.small_fleet:
            rid = self._ring_walk(key, allowed, ok)
            if rid is not None:
                return rid
        if allowed is None:
            return self._least_loaded()
        return min(sorted(allowed), key=self._cold_key)

    def _ring_walk(self, key: int, allowed: set[str] | None, ok=None) -> str | None:
        """The first replica (in ``allowed``, passing ``ok``) on the consistent-hash ring from ``key``:
        the same replicas in the same order for a prefix every time, while the fleet stays the same."""
        ring = self._ring
        start = bisect.bisect_left(ring, (key, ""))
        seen = 0
        for i in range(len(ring)):
            rid = ring[(start + i) % len(ring)][1]
            if allowed is not None and rid not in allowed:
                continue
            if ok is None or ok(rid):
                return rid
            seen += 1
            if seen > 4 * self.cfg.ring_vnodes:  # everyone is busy
                break
        return None

    def _cold_key(self, rid: str) -> tuple:
        v = self.replicas[rid]
        return (v.outstanding, len(v.index), v.last_cold)

    def _push_load(self, view: ReplicaView) -> None:
        view.version += 1
        heapq.heappush(self._heap, (*self._cold_key(view.replica_id), view.version, view.replica_id))
        if len(self._heap) > 4 * len(self.replicas) + 64:
            self._heap = [(*self._cold_key(r), v.version, r) for r, v in self.replicas.items()]
            heapq.heapify(self._heap)

    def _least_loaded(self) -> str | None:
        heap = self._heap
        while heap:
            *_, version, rid = heap[0]
            view = self.replicas.get(rid)
            if view is not None and view.version == version:
                return rid
            heapq.heappop(heap)
        if self.replicas:  # heap lost track (first use): rebuild
            for v in self.replicas.values():
                self._push_load(v)
            return self._least_loaded()
        return None

    def on_routed(self, replica_id: str, hashes: Sequence[int], prompt_tokens: int, max_new_tokens: int = 0
                  ) -> Routed:
        """Record a routing decision; returns what to pass back to ``on_completed``."""
        view = self.replicas.get(replica_id)
        if view is None:
            return Routed(0.0, 0)
        self._counter += 1
        self._prompt_blocks += (len(hashes) - self._prompt_blocks) / min(self._counter, 1000)
        m = self.matches(hashes, (replica_id,)).get(replica_id, 0)
        if m == 0 and hashes:
            self._move_away(hashes, replica_id)
        if hashes:
            self._count(hashes[0])
            self._remember_home(hashes[0], replica_id)
        if m >= self.cfg.min_match_blocks:
            self.affinity_hits += 1
        else:
            self.cold_routes += 1
            view.last_cold = self._counter
        work = self.work_of(prompt_tokens, m * self.cfg.block_size, max_new_tokens)
        hl = self._rate_hl()
        view.recent, view.recent_at = self._recent(view) + work, self._counter
        self._recent_total = (self._decayed(self._recent_total, hl) + work, self._counter)
        view.outstanding += work
        self._total_outstanding += work
        view.in_flight += 1
        view.routed += 1
        new_blocks = max(0, len(hashes) - m)
        view.pending_blocks += new_blocks
        self._touch(view, hashes)
        self._push_load(view)
        return Routed(work, new_blocks, max(0, max_new_tokens), self._counter)

    def _move_away(self, hashes: Sequence[int], replica_id: str) -> None:
        """A prefix went to a replica that holds none of it while others do. If it has less traffic
        than one replica can serve and every holder is over its work-rate bound (the policy spilled it;
        not a Serve fallback past a full holder), it moves: the router stops counting on the old copies,
        which age out of their caches, so its traffic is not split over two caches that each spend a
        prefix's room on it. A prefix that moved shortly before needs two homes: it is copied.
        Prefixes are keyed by their first block: prompts that share it move together."""
        key = hashes[0]
        holders = self.holders.of(key)
        if not holders:
            return
        pop = self._popularity_scale(key)
        if pop >= self.cfg.move_popularity:
            return
        bound = self._rate_bound(None, pop)
        if any(self._recent(self.replicas[r]) <= bound for r in holders):
            return
        moved, window = self._moved, self.cfg.move_cooldown * self._rate_hl()
        while moved and self._counter - next(iter(moved.values())) >= window:
            moved.popitem(last=False)  # bounded: only moves within the cooldown are kept
        if key in moved:
            return
        moved[key] = self._counter
        for rid in holders:
            self.forget_hashes(rid, hashes)

    def on_generated(self, replica_id: str, routed: Routed, generated: int) -> None:
        """A request generated ``generated`` tokens in all. One that stopped early (EOS, a stop string,
        a client that left) did less work than its ``max_new_tokens`` promised: the replica's work rate
        keeps only what it did, or one cancelled long request would hold its replica over the rate
        bound for hundreds of requests."""
        view = self.replicas.get(replica_id)
        if view is None or generated >= routed.new_tokens:
            return
        hl = self._rate_hl()
        unused = self.cfg.decode_token_cost * (routed.new_tokens - generated)
        recent = self._recent(view)
        unused = min(recent, unused * 0.5 ** ((self._counter - routed.at) / hl))  # decayed as the rate has since
        view.recent, view.recent_at = recent - unused, self._counter
        self._recent_total = (max(0.0, self._decayed(self._recent_total, hl) - unused), self._counter)

    def on_completed(self, replica_id: str, routed: Routed) -> None:
        view = self.replicas.get(replica_id)
        if view is None:
            return
        view.pending_blocks = max(0, view.pending_blocks - routed.new_blocks)
        self._trim(view)
        before = view.outstanding
        view.outstanding = max(0.0, view.outstanding - routed.work)
        self._total_outstanding -= before - view.outstanding
        view.in_flight = max(0, view.in_flight - 1)
        self._push_load(view)

    def index_size(self, replica_id: str) -> int:
        view = self.replicas.get(replica_id)
        return len(view.index) if view else 0
