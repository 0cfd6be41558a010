"""The routing policy alone: affinity, per-candidate load gate, cold spreading, churn, memory bound."""

from __future__ import annotations

import itertools

import hypothesis.strategies as st
from hypothesis import given, settings

from cache.hashing import block_hashes
from routing.policy import PolicyConfig, PrefixPolicy

BS = 16


def prompt(group: int, n_blocks: int = 8, tail: int = 0) -> list[int]:
    return [group * 1000 + i % 97 for i in range(n_blocks * BS)] + [7] * tail


def route(p: PrefixPolicy, tokens: list[int], out: int = 0) -> tuple[str, float]:
    h = block_hashes(tokens, BS)
    r = p.choose(h, len(tokens), out)
    return r, p.on_routed(r, h, len(tokens), out)


def fleet(n: int = 4, **kw) -> PrefixPolicy:
    p = PrefixPolicy(PolicyConfig(block_size=BS, **kw))
    for i in range(n):
        p.add_replica(f"r{i}", capacity_blocks=256)
    return p


def test_same_prefix_sticks_to_its_replica():
    p = fleet(load_weight=0.1)
    first, w = route(p, prompt(1, tail=5))
    p.on_completed(first, w)
    for t in range(10):
        r, w = route(p, prompt(1, tail=t))
        assert r == first
        p.on_completed(r, w)
    assert p.affinity_hits == 10


def test_cold_prefixes_spread_over_every_replica_first():
    p = fleet(4)
    chosen = [route(p, prompt(g))[0] for g in range(4)]
    assert sorted(chosen) == ["r0", "r1", "r2", "r3"]


def test_load_gate_is_per_candidate():
    p = fleet(3, load_weight=1.0, decode_token_cost=8.0)
    holder, w = route(p, prompt(1))
    p.on_completed(holder, w)
    assert route(p, prompt(1) + [1])[0] == holder  # idle holder: 128 cached tokens win
    assert route(p, prompt(1) + [2], out=100)[0] == holder  # still worth it; now 800+ tokens queued
    idle = {r for r, v in p.replicas.items() if v.in_flight == 0}
    r, _ = route(p, prompt(1) + [3])
    assert r != holder and r in idle  # the holder alone is penalized, not the fleet


def test_hot_prefix_spills_then_both_holders_share_it():
    p = fleet(2, load_weight=0.5)
    seen = set()
    for t in range(40):
        r, _ = route(p, prompt(1, n_blocks=4, tail=t % 7))
        seen.add(r)
    assert seen == {"r0", "r1"}
    assert all(p.matches(block_hashes(prompt(1, n_blocks=4), BS)).get(r) == 4 for r in seen)


def test_dead_replica_is_dropped_at_once():
    p = fleet(2, load_weight=0.0)
    r, _ = route(p, prompt(3))
    p.remove_replica(r)
    assert r not in p.replicas
    assert all(r not in s for s in p.holders.as_sets().values())
    for g in range(5):
        assert route(p, prompt(g))[0] != r


def test_new_replica_gets_cold_traffic_first():
    p = fleet(2, load_weight=0.0)
    for g in range(6):
        w = route(p, prompt(g))
        p.on_completed(*w)
    p.add_replica("new", 256)
    assert route(p, prompt(99))[0] == "new"


def test_candidates_restrict_the_choice():
    p = fleet(3, load_weight=0.5)
    r, w = route(p, prompt(5))
    p.on_completed(r, w)
    h = block_hashes(prompt(5), BS)
    others = [x for x in p.replicas if x != r]
    assert p.choose(h, 128, 0, others) in others
    ranked = p.rank(h, 128, 0, list(p.replicas))
    assert ranked[0] == r and sorted(ranked) == sorted(p.replicas)


def test_the_fallbacks_after_the_best_are_the_other_holders_first():
    # Serve tries rank 2 when rank 1 is at max_ongoing_requests: a second copy of the prefix, not the
    # least loaded replica (a full prefill) while a copy exists
    p = fleet(4)
    h = block_hashes(prompt(5), BS)
    p.learn_hashes("r2", h)
    p.learn_hashes("r3", h[:2])
    ranked = p.rank(h, 128, 0)
    assert ranked[:2] == ["r2", "r3"] and sorted(ranked) == sorted(p.replicas)


def test_reported_evictions_stop_the_affinity():
    p = fleet(2, load_weight=0.0)
    r, _ = route(p, prompt(8))
    p.forget_hashes(r, block_hashes(prompt(8), BS))
    assert p.matches(block_hashes(prompt(8), BS)) == {}


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 30), st.integers(1, 12), st.booleans(), st.integers(0, 5)),
                min_size=1, max_size=80),
       st.integers(4, 40))
def test_index_never_outgrows_the_replica_and_holders_stay_consistent(ops, capacity):
    p = PrefixPolicy(PolicyConfig(block_size=BS))
    for i in range(3):
        p.add_replica(f"r{i}", capacity_blocks=capacity)
    open_routes = []
    for group, n_blocks, complete, hot in ops:
        if hot < 3:  # a replica far over its work-rate bound: its prefixes spill, and light ones move
            _overload(p, f"r{hot}")
        r, w = route(p, prompt(group, n_blocks))
        if complete:
            p.on_completed(r, w)
        else:
            open_routes.append((r, w))
        for view in p.replicas.values():  # the cache, plus what its requests in flight will add
            assert len(view.index) <= capacity + view.pending_blocks
    for r, w in open_routes:
        p.on_completed(r, w)
    for view in p.replicas.values():
        assert view.pending_blocks == 0 and len(view.index) <= capacity
    expect: dict[int, set[str]] = {}
    for rid, view in p.replicas.items():
        for h in view.index:
            expect.setdefault(h, set()).add(rid)
    assert expect == p.holders.as_sets()


def test_popular_prefix_spills_sooner_than_a_rare_one():
    p = fleet(4, load_weight=0.25, decode_token_cost=8.0)
    hot, rare = prompt(1), prompt(2)
    for t in range(30):  # make prefix 1 popular
        r, w = route(p, hot + [t])
        p.on_completed(r, w)
    r_rare, w_rare = route(p, rare)
    p.on_completed(r_rare, w_rare)
    assert p._popularity_scale(block_hashes(hot, BS)[0]) > p._popularity_scale(block_hashes(rare, BS)[0])
    hot_holders = set(p.matches(block_hashes(hot, BS)))
    # the same queue on their holders: the hot prefix moves, the rare one stays
    for rid in hot_holders | {r_rare}:
        p.replicas[rid].outstanding = 600.0
    assert route(p, rare + [1])[0] == r_rare
    assert route(p, hot + [99])[0] not in hot_holders


def test_shared_prefix_outlives_unique_tails_in_the_index():
    # the replica's cache protects a reused prompt; the router's guess must not drop it first
    p = fleet(1)
    p.replicas["r0"].capacity_blocks = 12
    shared = block_hashes(prompt(1, n_blocks=4), BS)
    for t in range(2):
        p.on_completed(*route(p, prompt(1, n_blocks=4, tail=BS + t)))
    for g in range(2, 8):
        p.on_completed(*route(p, prompt(g, n_blocks=2)))  # unique prompts push the index over capacity
    assert len(p.replicas["r0"].index) <= 12
    assert p.matches(shared) == {"r0": 4}


def test_prefix_back_soon_after_its_drop_is_protected_like_the_replica_does():
    # the replica's cache protects blocks recomputed soon after their eviction (its ghost list); a
    # guess that put them on probation again would drop them first and send the next request elsewhere
    p = fleet(1)
    p.replicas["r0"].capacity_blocks = 12
    back = block_hashes(prompt(1, n_blocks=4), BS)
    p.on_completed(*route(p, prompt(1, n_blocks=4)))
    for g in range(2, 8):
        p.on_completed(*route(p, prompt(g, n_blocks=2)))
    assert p.matches(back) == {}  # seen once, then pushed out by newer prompts
    p.on_completed(*route(p, prompt(1, n_blocks=4)))  # it comes back
    for g in range(8, 14):
        p.on_completed(*route(p, prompt(g, n_blocks=2)))  # prompts seen once leave first
    assert p.matches(back) == {"r0": 4}


def test_blocks_of_requests_in_flight_stay_indexed_until_they_end():
    # a replica caches a queued request's prompt only when it runs: trimming the guess to the cache's
    # size at routing time dropped prefixes the replica still held (multiturn sim: 0.83 -> 0.98 of oracle)
    p = fleet(1)
    p.replicas["r0"].capacity_blocks = 12
    tickets = [route(p, prompt(g, n_blocks=4)) for g in range(4)]  # 16 blocks queued for a 12-block cache
    assert all(p.matches(block_hashes(prompt(g, n_blocks=4), BS)) == {"r0": 4} for g in range(4))
    for t in tickets:
        p.on_completed(*t)
    assert len(p.replicas["r0"].index) <= 12 and p.replicas["r0"].pending_blocks == 0
    assert p.matches(block_hashes(prompt(3, n_blocks=4), BS)) == {"r0": 4}  # the newest stays


def test_one_hot_prefix_is_split_by_work_rate_even_without_queues():
    p = fleet(2)
    for t in range(400):  # every request completes at once: only the long-run rate can balance
        p.on_completed(*route(p, prompt(1, tail=t % 5), out=32))
    rates = [p._recent(v) for v in p.replicas.values()]
    assert max(rates) / min(rates) < 1.2, rates
    assert set(p.matches(block_hashes(prompt(1), BS))) == {"r0", "r1"}


def test_new_prefixes_fill_caches_evenly():
    p = fleet(3)
    for g in range(9):
        p.on_completed(*route(p, prompt(g)))
    assert sorted(p.homes(r) for r in p.replicas) == [3, 3, 3]
    held = [sum(block_hashes(prompt(g), BS)[0] in v.index for g in range(9)) for v in p.replicas.values()]
    assert held == [3, 3, 3]


def test_prefix_the_index_lost_goes_back_to_its_last_replica():
    p = fleet(4)
    for g in range(4):  # one prefix per replica
        p.on_completed(*route(p, prompt(g)))
    home, w = route(p, prompt(9))
    p.on_completed(home, w)
    p.forget_hashes(home, block_hashes(prompt(9), BS))  # evicted there, or the guess was trimmed
    assert p.matches(block_hashes(prompt(9), BS)) == {}
    p.add_replica("new", 256)  # an empty replica would get a new prefix first...
    assert route(p, prompt(99))[0] == "new"
    assert route(p, prompt(9))[0] == home  # ...but a known one returns where it may still be cached


def test_lost_prefix_does_not_return_to_an_overloaded_home():
    p = fleet(2, spill_slack_tokens=0.0)
    home, w = route(p, prompt(3))
    p.on_completed(home, w)
    p.forget_hashes(home, block_hashes(prompt(3), BS))
    for t in range(4):  # a burst of other work piles up at the home
        p.on_routed(home, block_hashes(prompt(50 + t), BS), 128, 50)
    assert route(p, prompt(3))[0] != home


def test_remembered_homes_and_popularities_are_bounded():
    p = fleet(2, home_memory=10, popularity_memory=20)
    for g in range(50):
        p.on_completed(*route(p, prompt(g)))
    assert len(p._home) == 10
    assert list(p._pop) == [block_hashes(prompt(g), BS)[0] for g in range(30, 50)]  # the most recent stay


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["route", "route", "learn", "remove", "add", "sync"]), st.integers(0, 15),
                          st.integers(0, 4)), min_size=1, max_size=120))
def test_home_counts_and_work_rates_stay_consistent_through_fleet_changes(ops):
    """The remembered homes match their counts, and the fleet's work rate stays the sum of the
    replicas' rates (which decay with a half-life that scales with the fleet)."""
    p = PrefixPolicy(PolicyConfig(block_size=BS, home_memory=4, rate_half_life=5.0))
    for i in range(4):
        p.add_replica(f"r{i}", capacity_blocks=64)
    for op, group, replica in ops:
        rid = f"r{replica}"
        if op == "route":
            p.on_completed(*route(p, prompt(group, 2)))
        elif op == "learn":  # warm-up or the directory: a replica holds this prefix
            p.learn_hashes(rid, block_hashes(prompt(group, 2), BS))
        elif op == "remove" and len(p.replicas) > 1:
            p.remove_replica(rid)
        elif op == "add":
            p.add_replica(rid, 64)
        elif op == "sync":  # Serve's replica set: all but one
            p.sync_replicas([f"r{i}" for i in range(5) if i != replica])
        assert len(p._home) <= 4
        homes = list(p._home.values())
        assert dict(p._home_counts) == {r: homes.count(r) for r in set(homes)}
        parts = sum(p._recent(v) for v in p.replicas.values())
        assert abs(p._decayed(p._recent_total, p._rate_hl()) - parts) <= 1e-6 * max(1.0, parts)
        assert all(p._recent(v) >= 0 for v in p.replicas.values())


def test_replica_added_to_a_running_fleet_does_not_take_every_new_prefix():
    p = fleet(2, fill_threshold=0.0)  # no "fill the new replica first" phase: placement by homes alone
    for g in range(100):
        p.on_completed(*route(p, prompt(g)))  # 50 remembered prefixes each, far more than a cache holds
    p.add_replica("new", 16)  # a cache of 2 prompts of 8 blocks
    assert p.homes("new") == min(p.homes("r0"), p.homes("r1")) - 2  # one cache's worth behind
    chosen = [r for r, w in (route(p, prompt(200 + g)) for g in range(12))]
    assert 4 <= chosen.count("new") <= 7  # 2 to fill its cache, then a third of the rest; not all 12


def test_learned_prefix_gets_a_home_unless_it_has_a_live_one():
    p = fleet(2)
    h = block_hashes(prompt(7), BS)
    p.learn_hashes("r1", h)  # warm-up filled r1: the prefix lives there
    assert p._home[h[0]] == "r1"
    p.learn_hashes("r0", h)  # another holder does not move its home
    assert p._home[h[0]] == "r1"
    p.remove_replica("r1")
    p.learn_hashes("r0", h)  # its home is gone: the holder that reports it becomes home
    assert p._home[h[0]] == "r0"


def _overload(p: PrefixPolicy, rid: str) -> None:
    """Make ``rid``'s recent work rate far above the fleet's: no prefix's holder check passes there."""
    view = p.replicas[rid]
    view.recent, view.recent_at = 1e6, p._counter


def _light_prefixes_fleet() -> PrefixPolicy:
    """Four replicas serving eight prefixes of equal traffic: each is half a replica's fair share."""
    p = fleet(4)
    for _ in range(10):
        for g in range(8):
            p.on_completed(*route(p, prompt(g, tail=1)))
    return p


def _spill_prefix_one(p: PrefixPolicy) -> tuple[list[int], str, str]:
    """Overload prefix 1's only holder and route one request of it: (its hashes, old holder, new)."""
    hashes = block_hashes(prompt(1), BS)
    (old,) = p.matches(hashes)
    _overload(p, old)
    new, w = route(p, prompt(1, tail=2))
    p.on_completed(new, w)
    return hashes, old, new


def test_light_prefix_moves_when_its_holder_is_over_its_bound():
    p = _light_prefixes_fleet()
    hashes, old, new = _spill_prefix_one(p)
    assert new != old
    assert set(p.matches(hashes)) == {new}  # moved: the old holder no longer attracts it
    assert not any(h in p.replicas[old].index for h in hashes)  # its whole chain, not just the head
    p.replicas[old].recent = 0.0
    assert route(p, prompt(1, tail=3))[0] == new


def test_prefix_moved_moments_ago_is_copied_when_its_new_home_overloads_too():
    p = _light_prefixes_fleet()
    hashes, first, second = _spill_prefix_one(p)
    _overload(p, second)
    third, _ = route(p, prompt(1, tail=3))
    assert third not in (first, second)
    assert set(p.matches(hashes)) == {second, third}  # a second move so soon: it needs two homes


def test_prefix_stays_indexed_where_serve_could_not_send_it():
    p = _light_prefixes_fleet()
    hashes = block_hashes(prompt(1), BS)
    (holder,) = p.matches(hashes)
    assert p.choose(hashes, len(prompt(1))) == holder
    other = next(r for r in p.replicas if r != holder)
    p.on_routed(other, hashes, len(prompt(1)))  # Serve's fallback: the holder was at max_ongoing_requests
    assert set(p.matches(hashes)) == {holder, other}  # not over its work-rate bound: its copy still counts


def test_prefix_too_popular_for_one_replica_is_copied_not_moved():
    p = fleet(4)
    for t in range(40):  # prefix 1 is half of all traffic: two replicas' fair share
        p.on_completed(*route(p, prompt(1, tail=t % 3)))
        p.on_completed(*route(p, prompt(10 + t % 8, tail=1)))
    hashes = block_hashes(prompt(1), BS)
    holders = set(p.matches(hashes))
    for rid in holders:
        _overload(p, rid)
    new, _ = route(p, prompt(1, tail=5))
    assert new not in holders
    assert set(p.matches(hashes)) == holders | {new}  # a copy: the old holders keep theirs


def test_warm_replica_keeps_its_prefixes_when_a_new_one_joins():
    """A replica added to a warm fleet starts at the fleet's mean work rate, not zero: at zero, every
    holder was over the rate bound at once, so all traffic went to the newcomer (prefilling each prefix
    again while the warm cache idled) until its rate caught up. Now the load moves over as the rates
    decay (a half-life is 250 routed requests per replica) and ends evenly split."""
    p = fleet(1)
    prompts = [prompt(g, n_blocks=4, tail=t) for t in range(1, 40) for g in range(4)]
    for tokens in prompts:  # one replica serving 4 prefixes, one request at a time
        p.on_completed(*route(p, tokens, out=16))
    p.add_replica("new", capacity_blocks=256)
    chosen = []
    for tokens in itertools.islice(itertools.cycle(prompts), 1000):
        r, w = route(p, tokens, out=16)
        p.on_completed(r, w)
        chosen.append(r)
    assert chosen[:40].count("r0") == 40  # (was: all 40 to the newcomer)
    assert 40 <= chosen[:200].count("new") <= 120  # a hot prefix is copied within the first half-life
    assert 80 <= chosen[600:800].count("new") <= 120


def test_a_replica_whose_pool_size_comes_later_gets_the_head_start_of_its_own_pool():
    # Serve adds a replica before its first report: its head start was sized by the default capacity
    def grown() -> PrefixPolicy:
        p = fleet(2)
        for g in range(40):
            p.on_completed(*route(p, prompt(g)))
        return p

    known, late = grown(), grown()
    known.add_replica("new", capacity_blocks=64)
    late.add_replica("new")  # size unknown yet: the default's head start (4,096 blocks: none here)
    assert late.replicas["new"].home_base == 0 < known.replicas["new"].home_base
    late.report("new", capacity_blocks=64)
    assert late.replicas["new"].home_base == known.replicas["new"].home_base


def _serve_on_a_real_cache(cache, alloc, tokens: list[int], full_blocks: int) -> None:
    """One request on a replica's own cache: match, allocate the rest, insert the prompt's full blocks,
    free what it does not keep (as the engine's KV manager does)."""
    from cache.radix import RadixCache  # noqa: F401 - (the type the caller built)

    m = cache.match(tokens)
    cache.lock(m.node)
    table = m.blocks + alloc.allocate(-(-len(tokens) // cache.block_size) - len(m.blocks))
    res = cache.insert(tokens, table[:full_blocks])
    alloc.free(res.redundant)
    cache.lock(res.node)
    cache.unlock(m.node)
    cache.unlock(res.node)
    alloc.free(table[full_blocks:])


@settings(max_examples=2000, deadline=None)
@given(groups=st.lists(st.tuples(st.integers(0, 5), st.integers(1, 4)), min_size=1, max_size=40))
def test_with_the_replicas_reports_the_routers_guess_of_its_cache_is_the_cache(groups):
    """The index the policy keeps for a replica against the replica's own radix cache (same capacity),
    request by request, with the stored and removed blocks it reports (as ``record_routing_stats`` hands
    them over): the guess and the reports agree on every block. The guess is a segmented LRU: a reused
    block outlives every block seen once, which the replica's reuse bonus (a pool's worth of cache
    operations: hundreds of requests' worth in a real pool) gives it unless it sits unused that long; a
    pool this small turns over in a few requests, so its bonus here is past any run's length."""
    import routing.report_backlog as report_backlog
    from cache.allocator import BlockAllocator
    from cache.radix import RadixCache

    bs, cap = 4, 12
    cache = RadixCache(bs, reuse_bonus=10**6, record_events=True)
    alloc = BlockAllocator(cap + 1, bs, cache)  # (one block for the unshared tail each request holds)
    p = PrefixPolicy(PolicyConfig(block_size=bs))
    p.add_replica("r0", capacity_blocks=cap)
    backlog = report_backlog.ReportBacklog(per_replica_limit=10**6)
    slice_was, report_backlog.SLICE = report_backlog.SLICE, 3  # (chains of up to 5 blocks folded in slices)
    try:
        for n, (g, k) in enumerate(groups):  # the first k blocks of group g's prompt: prefixes of each other
            tokens = [g * 100 + i for i in range(k * bs)] + [5000 + n]
            _serve_on_a_real_cache(cache, alloc, tokens, k)
            h = block_hashes(tokens, bs)
            p.on_completed("r0", p.on_routed("r0", h, len(tokens)))
            net: dict[int, bool] = {}  # each block's last event, as the replica reports them
            for kind, hashes in cache.drain_events()[0]:
                net.update(dict.fromkeys(hashes, kind == "stored"))
            backlog.push("r0", [x for x, kept in net.items() if not kept], [x for x, kept in net.items() if kept])
            backlog.fold(p.forget_hashes, lambda rid, part: p.learn_hashes(rid, part, from_root=False),
                         lambda rid, cached: None, float("inf"))
            assert set(p.replicas["r0"].index) == set(cache.all_hashes()), (n, groups[: n + 1])
    finally:
        report_backlog.SLICE = slice_was


def test_the_routers_guess_keeps_the_prefixes_the_replica_protects_in_their_order_of_use():
    """Without reports: three prefixes used twice each (protected), the first used again, then a new one
    twice: the replica lets the least recently used protected one go (B), and so must the guess (the
    protected blocks' recency order was untested: a guess that dropped A routed the hottest prefix cold)."""
    from cache.allocator import BlockAllocator
    from cache.radix import RadixCache

    def tokens(g: str, n: int) -> list[int]:
        return [("ABCD".index(g) + 1) * 1000 + i for i in range(4 * BS)] + [9000 + n]

    cache = RadixCache(BS, reuse_bonus=12)
    alloc = BlockAllocator(13, BS, cache)
    p = PrefixPolicy(PolicyConfig(block_size=BS))
    p.add_replica("r0", capacity_blocks=12)
    for n, g in enumerate("ABCABCAADD"):
        _serve_on_a_real_cache(cache, alloc, tokens(g, n), 4)
        p.on_completed("r0", p.on_routed("r0", block_hashes(tokens(g, n), BS), 4 * BS + 1))
    held = [g for g in "ABCD" if cache.match(tokens(g, 99), hit=False, count=False).blocks]
    assert held == ["A", "C", "D"]
    assert [g for g in "ABCD" if p.matches(block_hashes(tokens(g, 99), BS))] == held


def test_of_two_holders_of_a_prefix_the_less_busy_takes_the_next_request():
    p = fleet(2)
    shared = prompt(1)
    for r in ("r0", "r1"):
        p.learn_hashes(r, block_hashes(shared, BS))
    picks = []
    for t in range(8):
        r, w = route(p, shared + [t] * BS, 64)
        p.on_completed(r, w)
        picks.append(r)
    assert picks[0::2] == [picks[0]] * 4 and picks[1::2] == [picks[1]] * 4 and picks[0] != picks[1], picks


def test_a_replica_that_emptied_takes_new_prefixes_first():
    """``fill_threshold``: a replica that restarted with an empty cache is where new prefixes go until it
    fills, not one of an even spread (an earlier test passed for another reason: the fewest homes)."""
    p = PrefixPolicy(PolicyConfig(block_size=BS))
    for i in range(3):
        p.add_replica(f"r{i}", capacity_blocks=16)
    for g in range(30):
        r, w = route(p, prompt(g, 4))
        p.on_completed(r, w)
    assert {p.homes(r) for r in p.replicas} == {10}  # as many homes each: only the fill tells them apart
    p.report("r2", cached_blocks=0)
    picks = []
    for g in range(100, 102):
        r, w = route(p, prompt(g, 4))
        p.on_completed(r, w)
        picks.append(r)
    assert picks == ["r2", "r2"], picks


def test_a_fleet_past_small_fleet_places_cold_prefixes_on_its_ring_through_churn():
    """Fleets over ``small_fleet`` replicas place cold prefixes by a hash ring: a path no test ran (a
    replica removed without its ring entries made every cold route fail, and Serve's fallback ranking
    took over without a word)."""
    import random

    rng = random.Random(0)
    p = PrefixPolicy(PolicyConfig(block_size=BS, small_fleet=4))
    for i in range(8):
        p.add_replica(f"r{i}", capacity_blocks=64)
    seen = set()
    for step in range(600):
        if step % 50 == 25:
            p.remove_replica(rng.choice(sorted(p.replicas)))
        elif step % 50 == 40:
            p.add_replica(f"r{8 + step}", capacity_blocks=64)
        h = block_hashes(prompt(rng.randrange(200), 4), BS)
        cands = None if step % 2 else rng.sample(sorted(p.replicas), 3)
        r = p.choose(h, 4 * BS, 8, cands)
        assert r in p.replicas and (cands is None or r in cands), (step, r)
        p.on_completed(r, p.on_routed(r, h, 4 * BS, 8))
        seen.add(r)
    assert len(seen) > 8  # replicas added mid-run get cold prefixes too
