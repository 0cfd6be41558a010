"""The Serve request router's own bookkeeping, without a Serve cluster: how it folds replica reports
and directory syncs into the policy, and that its hooks never raise."""

from __future__ import annotations

import time
from types import SimpleNamespace as NS

import pytest

from cache.directory import HotPrefixDirectory
from cache.hashing import block_hashes
from routing import in_process
from routing.prefix_router import PrefixAwareRequestRouter, _Routed

CHAIN = block_hashes(list(range(64)), 16, "m")
BASE = dict(kv_total_blocks=256, queue=0, truncated=False, stored=[], removed=[])


def _router(**kw) -> PrefixAwareRequestRouter:
    r = object.__new__(PrefixAwareRequestRouter)  # Serve builds it with its own __init__; the state is ours
    r.initialize_state(mode="prefix", block_size=16, model_id="m", **kw)
    return r


def _replica(rid: str, **stats) -> NS:
    return NS(replica_id=NS(unique_id=rid), routing_stats={**BASE, **stats})


def _indexed(r: PrefixAwareRequestRouter, rid: str) -> int:
    return sum(h in r.policy.replicas[rid].index for h in CHAIN)


def test_consecutive_reports_keep_what_was_stored():
    r = _router()
    r._absorb_stats([_replica("A", seq=1, stored=CHAIN, cached_blocks=4)])
    r._absorb_stats([_replica("A", seq=2, cached_blocks=0)])  # nothing evicted in between: exact deltas
    assert _indexed(r, "A") == len(CHAIN)


def test_packed_reports_fold_as_lists_do_and_a_malformed_one_is_a_truncated_one():
    from cache.hashing import pack_hashes

    r = _router()
    r._absorb_stats([_replica("A", seq=1, stored=pack_hashes(CHAIN), removed="", cached_blocks=4)])
    assert _indexed(r, "A") == len(CHAIN)
    r._absorb_stats([_replica("A", seq=2, stored="", removed=pack_hashes(CHAIN[2:]), cached_blocks=2)])
    assert _indexed(r, "A") == 2
    r._absorb_stats([_replica("A", seq=3, stored="abc", removed="", cached_blocks=1)])  # (not 16 digits a hash)
    assert _indexed(r, "A") == 1 and r.errors == 0


def test_a_missed_report_bounds_the_index_by_what_the_replica_caches():
    """Serve hands a router only each replica's latest report: one that routed nothing during a period
    never saw that period's evictions, so a gap in seq must not leave a phantom holder."""
    r = _router()
    r._absorb_stats([_replica("A", seq=1, stored=CHAIN, cached_blocks=4)])
    r._absorb_stats([_replica("A", seq=3, cached_blocks=0)])  # report 2 (the eviction) was never seen
    assert _indexed(r, "A") == 0
    assert r.policy.matches(CHAIN) == {}


def test_hooks_never_raise():
    r = _router()
    r.policy.add_replica("A")
    r._routed[("x", "A")] = [_Routed("A", "not a ticket", None, 0.0)]  # corrupt: the policy raises on it
    r.on_request_completed(NS(unique_id="A"), "x")
    assert r.errors == 1


def test_directory_sync_keeps_one_snapshot_while_nothing_is_routed(redis_server):
    """An idle router must not queue the directory's holders every period (it did: a backlog that grew
    without bound in the ingress and stalled the next routing decision)."""
    d = HotPrefixDirectory(redis_server.url, "radixserve", "m", 16)
    d.record("A", list(range(64)))
    hgets = d._r.info("commandstats").get("cmdstat_hget", {}).get("calls", 0)
    r = _router(redis_url=redis_server.url, directory_sync_s=0.05)
    try:
        time.sleep(0.6)  # about a dozen syncs, no routing decision in between
        # its tokens fetched once (and hashed once), not at each sync
        assert d._r.info("commandstats").get("cmdstat_hget", {}).get("calls", 0) - hgets == 1
        learned = r._learned
        assert learned is not None and len(learned) == 1 and learned[0][0] == "A"
        r.policy.add_replica("A")
        r._apply_learned()
        assert r.policy.matches(CHAIN) == {"A": len(CHAIN)}
        assert r._learned is None or len(r._learned) == 1
        assert list(r._chains.values()) == [CHAIN]
    finally:
        r._stop.set()
        d.clear()


def test_directory_holders_are_applied_a_decisions_share_at_a_time_and_only_when_new(monkeypatch):
    """Each sync's holders were all checked, and the new ones learned, inside the next routing decision:
    8 replicas holding 64 prefixes of 16k tokens stalled it 214 ms, and 49 ms at each sync after."""
    import routing.prefix_router as pr

    monkeypatch.setattr(pr, "LEARN_PER_DECISION", 256)
    r = _router()
    for rid in "AB":
        r.policy.add_replica(rid)
    chains = [block_hashes([i] * 2048, 16, "m") for i in range(6)]  # 128 blocks each
    sync = [(rid, chain) for chain in chains for rid in "AB"]

    def held() -> int:
        return sum(chain[-1] in r.policy.replicas[rid].index for rid, chain in sync)

    r._learned = list(sync)
    r._apply_learned()
    assert held() == 2  # a decision's share: 256 hashes
    for _ in range(10):
        r._apply_learned()
    assert held() == len(sync) and not r._to_learn
    r._learned = list(sync) + [("C", chains[0])]  # the same again, and a replica not in the fleet yet
    r._apply_learned()
    assert not r._to_learn and ("C", chains[0][-1]) not in r._synced  # (nothing to check again)
    r.policy.add_replica("C")
    r._learned = list(sync) + [("C", chains[0])]
    r._apply_learned()
    assert chains[0][-1] in r.policy.replicas["C"].index  # brought by the next sync
    for rid, chain in sync:  # the index let them go (its guesses), the replicas still hold them
        r.policy.forget_hashes(rid, chain)
    while r._syncs_taken % pr.RELEARN_EVERY_SYNCS:
        r._learned = list(sync)
        r._apply_learned()
    for _ in range(10):
        r._apply_learned()
    assert held() == len(sync)  # all again, every RELEARN_EVERY_SYNCS syncs


def test_a_replica_whose_engine_failed_is_ranked_last_until_it_is_replaced(monkeypatch):
    """The ingress's one retry after an engine failure must not go back to the same holder."""
    import routing.prefix_router as pr

    r = _router()
    reps = [_replica("A", seq=1, stored=CHAIN, cached_blocks=4), _replica("B", seq=1, cached_blocks=0)]
    pending = NS(args=(list(range(64)) + [7], {"max_new_tokens": 4}))

    def first_choice() -> str:
        return r._choose(reps, pending)[0][0].replica_id.unique_id

    assert first_choice() == "A"  # it holds the prefix
    pr.avoid_replica("A", seconds=60)
    try:
        assert first_choice() == "B"
        assert [x[0].replica_id.unique_id for x in r._choose(reps, pending)] == ["B", "A"]  # still a fallback
        real = time.monotonic
        monkeypatch.setattr(pr.time, "monotonic", lambda: real() + 61)
        assert first_choice() == "A"  # the window ended
    finally:
        in_process.FAILED.clear()


def test_token_ids_no_model_has_route_as_cold_without_an_error():
    """A negative or over-32-bit id reaches the router before the replica refuses it (a 400): the router
    must not count or log that as its own failure."""
    r = _router()
    for ids in ([5, -1] * 20, [5, 2**40] * 20):
        pending = NS(args=(ids, {"max_new_tokens": 4}))
        assert r._hashes(pending) == []
    assert r.errors == 0


def _route(r: PrefixAwareRequestRouter, rid: str, caller: str, internal: str) -> None:
    pending = NS(args=[list(range(64)), {"max_new_tokens": 3000}, caller], metadata=NS(internal_request_id=internal))
    r.on_request_routed(pending, NS(unique_id=rid), None)


class _Result:
    """A replica result: its done callbacks run at once if it is done, else when it completes."""

    def __init__(self, done: bool):
        self.done, self.callbacks = done, []

    def add_done_callback(self, cb):
        cb(self) if self.done else self.callbacks.append(cb)

    def complete(self):
        self.done = True
        for cb in self.callbacks:
            cb(self)


def test_a_call_serve_reports_ended_before_it_says_it_was_routed_still_ends():
    """Serve registers its completion callback before it awaits the replica's acceptance, and says a call
    was routed only after: a call that ends that fast (a warm-up, a refused request) was reported ended
    first, found nothing to end, and then stayed counted on its replica (a warm-up, with no caller to
    end it, for good on a replica never idle). A rejected call's report must not end its retry at once."""
    import asyncio

    from routing.prefix_router import request_ended

    r = _router()
    warm = NS(args=[[list(range(64))], None], metadata=NS(internal_request_id="w1"))

    async def scenario():
        view = None
        # a warm-up that ended before Serve said it was routed: its result is done, its entry ends
        r.on_request_completed(NS(unique_id="A"), "w1")
        r.on_request_routed(warm, NS(unique_id="A"), _Result(done=True))
        await asyncio.sleep(0)
        view = r.policy.replicas["A"]
        assert view.in_flight == 0 and view.outstanding == 0 and not r._routed
        # a rejected attempt reported ended, then its retry on the same replica accepted: it runs on
        r.on_request_completed(NS(unique_id="A"), "s1")
        running = _Result(done=False)
        pending = NS(args=[list(range(64)), {"max_new_tokens": 30}, "c1"], metadata=NS(internal_request_id="s1"))
        r.on_request_routed(pending, NS(unique_id="A"), running)
        await asyncio.sleep(0)
        assert view.in_flight == 1
        request_ended("c1", 5)  # the caller's end, then its result's, then Serve's report: one end
        await asyncio.sleep(0)
        assert view.in_flight == 0 and view.outstanding == 0
        running.complete()
        await asyncio.sleep(0)
        r.on_request_completed(NS(unique_id="A"), "s1")  # (a report it cannot tell from an early one)
        assert view.in_flight == 0 and view.outstanding == 0 and r.policy._recent(view) < 200
        assert not r._routed and not r._by_caller and not r._ended and not r._settled and not r._reported
        # the next call at that key still counts until its own result is done
        again = _Result(done=False)
        r.on_request_routed(pending, NS(unique_id="A"), again)
        assert view.in_flight == 1
        again.complete()
        await asyncio.sleep(0)
        assert view.in_flight == 0 and not r._routed and r.errors == 0

    asyncio.run(scenario())


def test_a_cancelled_request_stops_counting_on_its_replica():
    """Serve does not always report a cancelled request as completed: one aborted long stream kept
    its replica over the load bounds, out of rotation for good. The ingress says when a request ends
    and how many tokens it generated: the replica's outstanding work and work rate keep only that."""
    import asyncio

    from routing.prefix_router import request_ended

    r = _router()
    r.policy.add_replica("B")

    async def scenario():
        _route(r, "A", "caller-1", "serve-1")
        _route(r, "A", "caller-2", "serve-2")
        view = r.policy.replicas["A"]
        assert view.in_flight == 2 and view.outstanding > 48_000 and r.policy._recent(view) > 48_000
        request_ended("caller-1", 1)  # cancelled after one token, from the ingress's thread in Serve
        await asyncio.sleep(0)  # runs on the router's loop
        assert view.in_flight == 1 and r.policy._recent(view) < 24_100
        r.on_request_completed(NS(unique_id="A"), "serve-1")  # if Serve reports it after all: no double count
        assert view.in_flight == 1
        # Serve's report first, the caller's count after: the rate still learns it (EOS at token 10)
        r.on_request_completed(NS(unique_id="A"), "serve-2")
        assert view.in_flight == 0 and view.outstanding == 0 and r.policy._recent(view) > 24_000
        request_ended("caller-2", 10)
        await asyncio.sleep(0)
        assert r.policy._recent(view) < 300
        assert not r._routed and not r._by_caller and not r._ended and not r._settled
        # so the replica takes new prefixes again (over the rate bound it would get none of them)
        got = []
        for i in range(6):
            chain = block_hashes(list(range(1000 * i, 1000 * i + 64)), 16, "m")
            got.append(r.policy.choose(chain, 64, 8))
            r.policy.on_completed(got[-1], r.policy.on_routed(got[-1], chain, 64, 8))
        assert got.count("A") >= 2, got

    asyncio.run(scenario())
    assert r.errors == 0


def test_an_idle_replica_ends_what_was_routed_there_long_before(monkeypatch):
    import routing.prefix_router as pr

    r = _router()
    _route(r, "A", "old", "serve-old")
    r._routed[("serve-old", "A")][0].at -= pr.STALE_AFTER_IDLE_S + 1  # routed long ago, never reported done
    _route(r, "A", "new", "serve-new")  # routed just now: may not have reached the replica yet
    r._absorb_stats([_replica("A", seq=1, queue=0, at=time.time() - 60)])  # a report from before either
    assert set(r._routed) == {("serve-old", "A"), ("serve-new", "A")}
    r._absorb_stats([_replica("A", seq=2, queue=0, at=time.time())])
    assert set(r._routed) == {("serve-new", "A")} and r.policy.replicas["A"].in_flight == 1
    r._absorb_stats([_replica("A", seq=3, queue=1, at=time.time() + 60)])  # busy: nothing is dropped
    assert set(r._routed) == {("serve-new", "A")}
    # idle by a clock an hour ahead of this router's (another machine): what was just routed stands
    r._absorb_stats([_replica("A", seq=4, queue=0, at=time.time() + 3600)])
    assert set(r._routed) == {("serve-new", "A")}


def test_calls_that_share_serves_request_id_end_one_by_one_and_only_on_their_replica():
    # the calls of one HTTP request share Serve's internal id (/info then generate; a retry elsewhere),
    # and Serve reports each attempt's end: one key used to overwrite the other (its in-flight count
    # leaked) and a rejected attempt's end released the accepted one's work on another replica
    r = _router()
    _route(r, "A", "caller-1", "shared")
    _route(r, "B", "caller-2", "shared")  # the retry, on B
    a, b = r.policy.replicas["A"], r.policy.replicas["B"]
    r.on_request_completed(NS(unique_id="A"), "shared")  # the first attempt's end
    assert a.in_flight == 0 and b.in_flight == 1 and b.outstanding > 0
    _route(r, "B", None, "shared")  # another call of the same request, to B as well
    r.on_request_completed(NS(unique_id="B"), "shared")
    r.on_request_completed(NS(unique_id="B"), "shared")
    assert b.in_flight == 0 and b.outstanding == 0 and not r._routed and r.errors == 0


def test_serves_late_report_of_a_call_that_ended_already_ends_no_other_call():
    # a first attempt fails and its caller says so; the retry lands on the same replica with the same
    # Serve request id; Serve's report of the first attempt comes after: the retry still runs
    import asyncio

    from routing.prefix_router import request_ended

    r = _router()

    async def scenario():
        _route(r, "A", "attempt-1", "shared")
        request_ended("attempt-1", 0)
        await asyncio.sleep(0)
        _route(r, "A", "attempt-2", "shared")
        view = r.policy.replicas["A"]
        r.on_request_completed(NS(unique_id="A"), "shared")  # Serve's word on the first attempt
        assert view.in_flight == 1 and view.outstanding > 0
        r.on_request_completed(NS(unique_id="A"), "shared")  # and on the second
        assert view.in_flight == 0 and not r._routed and not r._settled

    asyncio.run(scenario())
    assert r.errors == 0


def test_serve_backs_off_when_no_ranked_replica_takes_the_request():
    # Serve polls again at once unless told to back off (its default): with every replica full, each
    # routing task asked every replica for its queue length in a loop
    from ray.serve._private.request_router.common import RequestRoutingContext

    r = _router()
    pending = NS(args=[list(range(64)), {"max_new_tokens": 8}, "c"], routing_context=RequestRoutingContext())
    assert r._choose([_replica("A"), _replica("B")], pending)
    assert pending.routing_context.should_backoff


def test_a_replica_that_left_the_fleet_is_dropped_from_the_directory(redis_server, monkeypatch):
    """A replica that crashed never removes its own entries: the routers that saw it go do, instead of
    leaving its holdings in the directory for their whole TTL."""
    from ray.serve.request_router import RequestRouter

    d = HotPrefixDirectory(redis_server.url, "radixserve", "m", 16)
    h = d.record("A", list(range(64)))
    d.record("B", list(range(64)))
    monkeypatch.setattr(RequestRouter, "update_replicas", lambda self, replicas: None)  # Serve's own part
    r = _router(redis_url=redis_server.url, directory_sync_s=0.05)
    try:
        r.update_replicas([_replica("A"), _replica("B")])
        assert sorted(d.holders(h)) == ["A", "B"]
        r.update_replicas([_replica("B")])  # A died; Serve replaces it
        deadline = time.monotonic() + 5
        while d.holders(h) != ["B"] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert d.holders(h) == ["B"]
    finally:
        r._stop.set()
        d.clear()


def test_a_gone_replica_waits_for_redis_to_come_back():
    from app.local_redis import free_port

    r = _router(redis_url=f"redis://127.0.0.1:{free_port()}", directory_sync_s=0.05)  # nothing listens there
    try:
        r._gone.append("A")
        time.sleep(0.5)  # several syncs, each failing
        assert r._gone == ["A"]  # kept for when Redis answers again, not dropped with the failed call
    finally:
        r._stop.set()


def test_the_process_counts_what_its_routers_decided_for_prompts_only(monkeypatch):
    """The ingress heartbeat sends these to the metrics hub (radixserve_router_*_total): a call with no
    prompt (/info) is no routing decision."""
    monkeypatch.setattr(in_process, "ROUTED", {"router_affinity_hits": 0, "router_cold_routes": 0})
    r = _router()
    _route(r, "A", "c1", "s1")  # a new prefix: cold
    _route(r, "A", "c2", "s2")  # its home now: a hit
    r.on_request_routed(NS(args=[], metadata=NS(internal_request_id="s3")), NS(unique_id="A"), None)
    assert in_process.ROUTED == {"router_affinity_hits": 1, "router_cold_routes": 1}


def test_a_stored_report_is_not_a_second_use_of_what_was_routed():
    # the router indexed the prompt when it routed it (seen once: first to go); the replica's report that
    # it stored those blocks promoted them to "seen again", which the replica had not done
    r = _router()
    _route(r, "A", "c1", "s1")
    index = r.policy.replicas["A"].index
    assert len(index.probation) == 4 and not index.protected
    r._absorb_stats([_replica("A", seq=1, stored=CHAIN, cached_blocks=4)])
    assert len(index.probation) == 4 and not index.protected
    _route(r, "A", "c2", "s2")  # a second request for it: now it is protected, as on the replica
    assert len(index.protected) == 4


def test_a_replica_without_a_prefix_cache_is_not_counted_on_for_what_it_served():
    # it reports no stored/removed events: the router kept every prompt it routed there as cached
    r = _router()
    _route(r, "A", "c1", "s1")
    r.on_request_completed(NS(unique_id="A"), "s1")
    assert _indexed(r, "A") == len(CHAIN)
    r._absorb_stats([_replica("A", seq=1, cached_blocks=0, prefix_caching=False)])
    assert _indexed(r, "A") == 0


def test_serve_reporting_a_request_routed_to_a_replica_that_left_does_not_bring_it_back(monkeypatch):
    """Serve reports the routing after its choice: a replica that left in between (its actor died, a
    downscale) came back into the policy as a phantom, with an index and a share of the fleet's load,
    until the next fleet update, which may never come."""
    from ray.serve.request_router import RequestRouter

    monkeypatch.setattr(RequestRouter, "update_replicas", lambda self, replicas: None)  # Serve's own part
    monkeypatch.setattr(RequestRouter, "on_replica_actor_died", lambda self, replica_id: None)
    r = _router()
    r.update_replicas([_replica("A"), _replica("B"), _replica("C")])
    r.update_replicas([_replica("A"), _replica("C")])  # B scaled down
    r.on_replica_actor_died(NS(unique_id="C"))
    _route(r, "B", "c1", "s1")
    _route(r, "C", "c2", "s2")
    assert sorted(r.policy.replicas) == ["A"]
    r.on_request_completed(NS(unique_id="B"), "s1")  # and its end is no error
    assert r.errors == 0
    _route(r, "A", "c3", "s3")
    assert r.policy.replicas["A"].in_flight == 1


def test_an_absurd_max_new_tokens_does_not_erase_a_replicas_load():
    """Counted in full, a 10**300 (refused by the engine later) made a busy replica's work, in float
    arithmetic, 0 once it ended: a replica with requests in flight looked idle."""
    r = _router()
    _route(r, "A", "c1", "s1")  # 3,000 new tokens: real work
    before = r.policy.replicas["A"].outstanding
    pending = NS(args=[list(range(64)), {"max_new_tokens": 10**300}, "c2"], metadata=NS(internal_request_id="s2"))
    r.on_request_routed(pending, NS(unique_id="A"), None)
    r.on_request_completed(NS(unique_id="A"), "s2")
    assert r.policy.replicas["A"].outstanding == before and r.errors == 0
    # nor does a negative one (a caller past the ingress's checks): it counts as none
    pending = NS(args=[list(range(64)), {"max_new_tokens": -10**6}, "c3"], metadata=NS(internal_request_id="s3"))
    r.on_request_routed(pending, NS(unique_id="A"), None)
    assert r.policy.replicas["A"].outstanding >= before
    r.on_request_completed(NS(unique_id="A"), "s3")
    assert r.policy.replicas["A"].outstanding == before and r.errors == 0


@pytest.mark.parametrize("exact", [True, False], ids=["exact", "truncated"])
def test_a_large_report_is_folded_between_decisions_not_in_one(exact):
    """Folding 20k hashes takes tens of milliseconds: the decision that first sees the report leaves it
    to the loop, which folds it in slices between decisions. So for a truncated report, whose cached
    count bounds the index once its hashes are in (it was folded whole in the decision: 40 ms)."""
    import asyncio

    r = _router()
    big = block_hashes(list(range(16 * 5000)), 16, "m")
    cached = len(big) if exact else 1000
    report = _replica("A", kv_total_blocks=10_000, seq=1, stored=big, cached_blocks=cached, truncated=not exact)
    slices = []

    async def decide_then_idle():
        r._choose([report], None)
        assert len(r.policy.replicas["A"].index) == 0  # none in the decision
        assert len(r._backlog) == len(big) + (not exact)  # (and the bound waits behind them)
        assert r._fold_pending
        while r._fold_pending:
            slices.append(len(r._backlog))
            await asyncio.sleep(0.001)

    asyncio.run(decide_then_idle())
    assert len(r._backlog) == 0 and r.errors == 0
    index = r.policy.replicas["A"].index
    assert sum(h in index for h in big) == cached  # bounded after the hashes came in, not before
    assert len(set(slices)) > 2  # in several slices


def test_a_replica_whose_backlog_overflows_is_bounded_by_its_cached_count(monkeypatch):
    import asyncio

    from routing import prefix_router

    monkeypatch.setattr(prefix_router, "BACKLOG_PER_REPLICA", 1000)
    r = _router()
    flood = block_hashes(list(range(16 * 1200)), 16, "x")

    async def two_reports():  # on a loop: nothing is folded until the loop is idle
        r._absorb_stats([_replica("A", seq=1, stored=CHAIN, cached_blocks=4)])
        r._absorb_stats([_replica("A", seq=2, stored=flood, cached_blocks=2)])  # past the limit: let go

    asyncio.run(two_reports())
    assert len(r._backlog) == 0 and r._backlog.dropped == len(CHAIN) + len(flood)
    assert len(r.policy.replicas["A"].index) == 0
    r._absorb_stats([_replica("A", seq=3, stored=CHAIN, cached_blocks=4)])  # off a loop: folded at once
    assert _indexed(r, "A") == len(CHAIN)


def test_the_routing_cost_bench_runs_with_reports_flowing():
    from bench.router_cost import run_once

    out = run_once(prompt_tokens=512, replicas=4, rounds=300, report_hashes=300, report_every=50, gap_s=0.0)
    assert out["errors"] == 0 and out["backlog_dropped"] == 0 and out["p50_us"] > 0


def test_a_router_that_serve_drops_is_freed_and_its_directory_thread_ends(redis_server):
    """Serve drops a router with its handle; the directory thread held it (and its index) for good."""
    import gc
    import threading
    import weakref

    before = set(threading.enumerate())
    r = _router(redis_url=redis_server.url, directory_sync_s=0.05)
    (thread,) = set(threading.enumerate()) - before
    time.sleep(0.2)  # a few syncs
    ref = weakref.ref(r)
    del r
    gc.collect()
    assert ref() is None
    thread.join(timeout=2)
    assert not thread.is_alive()


def test_an_inexact_report_bounds_the_index_after_its_own_hashes_on_an_event_loop():
    """On Serve's loop the reported hashes wait in the backlog for the loop's idle time; an inexact report's
    cached-block count used to trim the index before them: the prefix it had just evicted stayed as a
    phantom holder, or the one it still held was trimmed and its traffic routed cold."""
    import asyncio

    other = block_hashes(list(range(1000, 1064)), 16, "m")

    async def phantom():
        r = _router()
        r._absorb_stats([_replica("A", seq=1, stored=CHAIN, cached_blocks=4)])
        await asyncio.sleep(0.05)
        # report 2 (CHAIN evicted) was missed; report 3: stored the other prefix, 4 blocks cached
        r._absorb_stats([_replica("A", seq=3, stored=other, removed=[], cached_blocks=4)])
        await asyncio.sleep(0.05)
        return r

    r = asyncio.run(phantom())
    assert r.policy.matches(CHAIN) == {} and r.policy.matches(other) == {"A": len(other)}

    async def lost():
        r = _router()
        r._absorb_stats([_replica("A", seq=1, stored=CHAIN, cached_blocks=4)])
        r._absorb_stats([_replica("A", seq=2, stored=other, cached_blocks=8)])
        # report 3 was missed; report 4: the other prefix evicted, CHAIN still cached
        r._absorb_stats([_replica("A", seq=4, removed=other, cached_blocks=4)])
        await asyncio.sleep(0.05)
        return r

    r = asyncio.run(lost())
    assert r.policy.matches(CHAIN) == {"A": len(CHAIN)} and r.policy.matches(other) == {}


def test_round_robin_takes_turns_puts_a_failed_replica_last_and_reads_no_reports():
    from routing.prefix_router import avoid_replica

    r = object.__new__(PrefixAwareRequestRouter)
    r.initialize_state(mode="round_robin", block_size=16, model_id="m")
    reps = [_replica(rid, seq=1, stored=CHAIN, cached_blocks=4) for rid in "CAB"]
    firsts = [r._choose(reps, None)[0][0].replica_id.unique_id for _ in range(6)]
    assert firsts == ["A", "B", "C", "A", "B", "C"]
    assert not r.policy.replicas and not r._backlog  # (its index was kept and never used)
    avoid_replica("A")
    try:
        ranks = r._choose(reps, None)
        assert [rank[0].replica_id.unique_id for rank in ranks] == ["B", "C", "A"]
    finally:
        in_process.FAILED.pop("A", None)
