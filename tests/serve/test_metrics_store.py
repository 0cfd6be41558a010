"""The metrics hub's store and the Prometheus text, without Ray: per-replica series come and go, the
replica="all" counters never go down (and the hub actor's restart, on the session's Ray)."""

from __future__ import annotations

import time

import pytest
from prometheus_client.parser import text_string_to_metric_families

from deployments.metrics import HOT_UNION_EVERY_S, RETIRED_MERGE_S, STALE_AFTER_S, SnapshotStore, render
from engine.latency import TTFT_BUCKETS


def values(text: str) -> dict[tuple[str, str], float]:
    return {(s.name, s.labels.get("replica", "")): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def snap(requests: int, running: int = 0) -> dict:
    return {"requests_finished": requests, "prompt_tokens": 10 * requests, "running": running, "blocks_total": 8,
            "ttft": {"counts": [requests] + [0] * len(TTFT_BUCKETS), "sum": 0.01 * requests}}


def test_all_counters_stay_monotonic_when_a_replica_goes_away():
    now = [0.0]
    store = SnapshotStore(clock=lambda: now[0])
    store.push("a", snap(100, running=3))
    store.push("b", snap(50, running=1))
    before = values(render(*store.export()))
    assert before[("radixserve_requests_total", "all")] == 150
    assert before[("radixserve_running_requests", "all")] == 4
    now[0] = STALE_AFTER_S / 2
    store.push("a", snap(120))  # b stopped pushing (killed)
    assert store.fresh(5.0) == 1
    now[0] = STALE_AFTER_S + 1
    store.push("a", snap(130))
    after = values(render(*store.export()))
    assert ("radixserve_requests_total", "b") not in after  # its own series ends
    assert after[("radixserve_requests_total", "all")] == 180  # 130 live + 50 retired: no drop
    assert after[("radixserve_prompt_tokens_total", "all")] == 1800
    assert after[("radixserve_time_to_first_token_seconds_count", "all")] == 180
    assert after[("radixserve_running_requests", "all")] == 0  # gauges are not carried over
    store.forget("a")  # a graceful shutdown retires too
    assert values(render(*store.export()))  # renders with no live replica
    assert store.export()[1]["requests_finished"] == 180


def test_a_replica_that_reports_again_takes_its_retired_totals_back():
    now = [0.0]
    store = SnapshotStore(clock=lambda: now[0])
    store.push("a", snap(100))
    store.forget("a")  # a graceful stop...
    store.push("a", snap(100))  # ...raced by its own last push
    now[0] = STALE_AFTER_S + 1  # then it goes quiet for good
    assert values(render(*store.export()))[("radixserve_requests_total", "all")] == 100  # not 200
    store.push("b", snap(10))
    now[0] += 2 * STALE_AFTER_S  # b stalls past the staleness limit, then recovers
    store.snapshots()
    store.push("b", snap(12))
    assert values(render(*store.export()))[("radixserve_requests_total", "all")] == 112  # not 122
    now[0] += 10_000  # long retired: folded into one sum, still counted
    store.push("c", snap(1))
    assert values(render(*store.export()))[("radixserve_requests_total", "all")] == 113


def test_busy_counts_only_replicas_that_report():
    now = [0.0]
    store = SnapshotStore(clock=lambda: now[0])
    store.push("dead", {"running": 5, "waiting": 2})
    now[0] = 4.0
    store.push("live", {"running": 1, "waiting": 0})
    assert store.busy(3.0) == 1 and store.busy(10.0) == 8 and store.fresh(3.0) == 1


def test_a_restarted_store_takes_back_the_last_view_and_counters_continue():
    """The hub restarts empty (killed, or restarted because it hung): the reader's last view, given
    back once, keeps the "all" counters from dropping to what the live replicas alone counted."""
    now = [0.0]
    old = SnapshotStore(clock=lambda: now[0])
    old.push("gone", snap(40))
    now[0] = STALE_AFTER_S + 1
    old.push("a", snap(100))
    old.push("b", snap(50))
    old.snapshots()  # "gone" retires
    live, retired, inc, by_replica, merged = old.export_state()
    assert values(render(live, retired))[("radixserve_requests_total", "all")] == 190

    new = SnapshotStore(clock=lambda: now[0])  # the restart
    assert new.incarnation != inc
    new.push("a", snap(101))  # a reported before the reader came back; b has not yet
    assert new.restore(live, by_replica, merged)
    assert not new.restore(live, by_replica, merged)  # once: a second reader must not add it again
    assert values(render(*new.export()))[("radixserve_requests_total", "all")] == 191  # 101 + 50 + 40
    new.push("b", snap(52))  # b's own report replaces the restored one
    assert values(render(*new.export()))[("radixserve_requests_total", "all")] == 193
    now[0] += STALE_AFTER_S + 1  # a and b die without a word: they retire, still counted
    assert values(render(*new.export()))[("radixserve_requests_total", "all")] == 193


def test_a_replica_only_gauge_has_no_fleet_sum():
    got = values(render({"a": {"first_request_cached_tokens": 0}, "b": {"first_request_cached_tokens": -1}}))
    assert got[("radixserve_first_request_cached_tokens", "a")] == 0
    assert got[("radixserve_first_request_cached_tokens", "b")] == -1  # "no request yet"
    assert ("radixserve_first_request_cached_tokens", "all") not in got  # a sum of those would be -1



def test_a_drain_reaches_every_ingress_and_lapses_without_renewal():
    now = [0.0]
    store = SnapshotStore(clock=lambda: now[0])
    assert store.ingress_poll("i1", 2) is False and store.ingress_poll("i2", 1) is False
    store.drain(10.0)
    # i2 has not reported since the drain began: it may still be taking requests, so it counts as busy
    assert store.ingress_poll("i1", 2) is True
    assert store.ingress_in_flight(3.0) == 2 + 1 + 1
    assert store.ingress_poll("i2", 0) is True
    assert store.ingress_in_flight(3.0) == 2
    now[0] = 5.0
    assert store.ingress_in_flight(3.0) == 0  # neither heard from lately: their counts no longer hold up a drain
    now[0] = 11.0  # the CLI that drained stopped renewing (it died): serving resumes
    assert store.ingress_poll("i1", 0) is False
    now[0] = 50.0
    store.ingress_poll("i3", 0)
    assert set(store._ingress) == {"i3"}  # replicas gone long ago are dropped


def test_a_cut_reaches_the_replicas_running_then_and_no_later_one():
    store = SnapshotStore()
    assert store.push("a", snap(1)) is False
    store.push("b", snap(1))
    store.cut()  # the CLI's drain ran out
    assert store.push("a", snap(1)) is True and store.push("b", snap(1)) is True
    # a replacement Serve starts meanwhile, or a later deployment of the same name, keeps running
    assert store.push("c", snap(1)) is False


def test_router_counts_from_ingress_heartbeats_are_summed_and_outlive_their_ingress():
    now = [0.0]
    store = SnapshotStore(clock=lambda: now[0])
    store.push("a", snap(10))
    store.ingress_poll("i1", 0, {"router_affinity_hits": 7, "router_cold_routes": 2})
    store.ingress_poll("i2", 0, {"router_affinity_hits": 3, "router_cold_routes": 1})
    store.ingress_poll("i1", 0, {"router_affinity_hits": 9, "router_cold_routes": 2})  # cumulative: replaces
    m = values(render(*store.export()))
    assert m[("radixserve_router_affinity_hits_total", "all")] == 12
    assert m[("radixserve_router_cold_routes_total", "all")] == 3
    assert ("radixserve_router_affinity_hits_total", "a") not in m  # decided before any replica: fleet only
    now[0] = STALE_AFTER_S + 1
    store.push("a", snap(10))
    store.ingress_poll("i1", 0, {"router_affinity_hits": 11, "router_cold_routes": 2})  # i2 is gone
    m = values(render(*store.export()))
    assert m[("radixserve_router_affinity_hits_total", "all")] == 14  # i2's 3 kept: the sum never drops
    assert store.ingress_poll("i1", 0) is False  # an older caller without counts still polls


def test_each_application_has_its_own_hub(monkeypatch):
    """Two applications of one Serve config, both with the default deployment name, shared a hub: each
    one's /health counted the other's replicas."""
    import types

    from ray import serve

    from deployments.metrics import hub_scope

    assert hub_scope("radixserve") == "radixserve"  # not in a replica
    for app, scope in (("radixserve", "radixserve"), ("chat", "chat.radixserve"), ("code", "code.radixserve")):
        monkeypatch.setattr(serve, "get_replica_context", lambda app=app: types.SimpleNamespace(app_name=app))
        assert hub_scope("radixserve") == scope  # `radixserve serve` names its application after it


def test_the_block_size_outlives_the_last_replica_and_a_hub_restart():
    # autoscaling down to zero: the fleet's block size is still the deployment's, not 0
    now = [0.0]
    store = SnapshotStore(clock=lambda: now[0])
    store.push("a", {**snap(5), "block_size": 16})
    assert values(render(*store.export()))[("radixserve_cache_block_size", "all")] == 16
    now[0] = STALE_AFTER_S + 1
    live, retired = store.export()
    assert not live and values(render(live, retired))[("radixserve_cache_block_size", "all")] == 16
    assert values(render(live, retired))[("radixserve_requests_total", "all")] == 5  # not summed into counters
    *_, by_replica, merged = store.export_state()
    new = SnapshotStore(clock=lambda: now[0])
    assert new.restore({}, by_replica, merged)
    assert values(render(*new.export()))[("radixserve_cache_block_size", "all")] == 16
    assert values(render(*new.export()))[("radixserve_requests_total", "all")] == 5


def test_replicas_that_are_gone_are_folded_away_without_a_scrape():
    # nothing scrapes /metrics: an autoscaled fleet's dead replicas must not pile up in the hub
    now = [0.0]
    store = SnapshotStore(clock=lambda: now[0])
    for i in range(500):
        now[0] += 60.0
        store.push(f"r{i}", snap(1))
        if i % 2:
            store.forget(f"r{i}")  # a graceful stop; the others just stop pushing (crashed)
    assert len(store._snaps) <= 2 and len(store._retired) <= 11  # what RETIRED_MERGE_S (600 s) keeps
    assert values(render(*store.export()))[("radixserve_requests_total", "all")] == 500


def routed(text: str) -> tuple[float, float]:
    m = values(text)
    return m[("radixserve_router_affinity_hits_total", "all")], m[("radixserve_router_cold_routes_total", "all")]


def test_router_counts_survive_a_hub_restart():
    """The counts of ingress replicas gone (folded) or just dead (not yet folded) were left out of the
    exported state: after a hub restart the "all" router counters dropped by them."""
    now = [0.0]
    old = SnapshotStore(clock=lambda: now[0])
    old.ingress_poll("folded", 0, {"router_affinity_hits": 100, "router_cold_routes": 7})
    now[0] = 1.0
    old.ingress_poll("live", 0, {"router_affinity_hits": 3, "router_cold_routes": 1})
    old.ingress_poll("dying", 0, {"router_affinity_hits": 20, "router_cold_routes": 2})
    now[0] = STALE_AFTER_S + 0.5
    old.ingress_poll("live", 0, {"router_affinity_hits": 4, "router_cold_routes": 1})  # "folded" is gone
    live, retired, _, by_replica, merged = old.export_state()
    assert routed(render(live, retired)) == (124, 10)

    new = SnapshotStore(clock=lambda: now[0])  # the restart ("dying" died just before it)
    new.ingress_poll("live", 0, {"router_affinity_hits": 5, "router_cold_routes": 1})  # before the reader
    assert new.restore(live, by_replica, merged)
    assert routed(render(*new.export())) == (125, 10)  # live's own newer count, not its old one added
    now[0] += 1
    new.ingress_poll("live", 0, {"router_affinity_hits": 6, "router_cold_routes": 1})
    assert routed(render(*new.export())) == (126, 10)
    assert new.ingress_in_flight(3.0) == 0  # the restored entries hold up no drain
    now[0] += STALE_AFTER_S
    new.ingress_poll("live", 0, {"router_affinity_hits": 6, "router_cold_routes": 1})
    assert "dying" not in new._routing  # folded like any ingress gone...
    assert routed(render(*new.export())) == (126, 10)  # ...and still counted
    live, retired, _, by_replica, merged = new.export_state()  # a second restart keeps them too
    again = SnapshotStore(clock=lambda: now[0])
    assert again.restore(live, by_replica, merged)
    assert routed(render(*again.export())) == (126, 10)


def test_an_ingress_back_after_a_gap_takes_back_its_router_counts():
    """An ingress replica quiet for STALE_AFTER_S (a stalled process) and back: its counts were summed
    as gone, and its next report, which includes them, counted them again (100 then 101 rendered 201)."""
    now = [0.0]
    store = SnapshotStore(clock=lambda: now[0])
    store.ingress_poll("a", 2, {"router_affinity_hits": 100, "router_cold_routes": 5})
    store.ingress_poll("b", 1, {"router_affinity_hits": 1, "router_cold_routes": 0})
    assert values(render(*store.export()))[("radixserve_ingress_requests_in_flight", "all")] == 3
    now[0] = STALE_AFTER_S + 1
    store.ingress_poll("b", 0, {"router_affinity_hits": 1, "router_cold_routes": 0})  # "a" quiet: retired
    assert routed(render(*store.export())) == (101, 5)  # still counted
    assert values(render(*store.export()))[("radixserve_ingress_requests_in_flight", "all")] == 0
    store.ingress_poll("a", 0, {"router_affinity_hits": 101, "router_cold_routes": 5})
    assert routed(render(*store.export())) == (102, 5)  # not 202
    now[0] += STALE_AFTER_S  # quiet again, and for good: retired, then summed once
    store.ingress_poll("b", 0, {"router_affinity_hits": 1, "router_cold_routes": 0})
    now[0] += RETIRED_MERGE_S
    store.ingress_poll("b", 0, {"router_affinity_hits": 1, "router_cold_routes": 0})
    assert not store._routing_retired and routed(render(*store.export())) == (102, 5)
    text = render(*store.export())
    assert 'radixserve_ingress_requests_in_flight{replica="all"}' in text
    assert text.count("radixserve_ingress_requests_in_flight{") == 1  # (fleet-wide only)


def heartbeat(key: str, *samples: float) -> dict:
    """An ingress heartbeat's counts whose histogram ``key`` (ingress_ttft, ingress_e2e) holds ``samples``."""
    from deployments.metrics import INGRESS_HISTOGRAMS
    from engine.latency import Histogram

    h = Histogram(INGRESS_HISTOGRAMS[key])
    for x in samples:
        h.observe(x)
    return {"router_affinity_hits": 0, "router_cold_routes": 0, key: h.to_dict()}


def test_the_ingress_time_to_first_token_is_fleet_wide_and_survives_a_gap_and_a_restart():
    def ttft(*samples):
        return heartbeat("ingress_ttft", *samples)

    def count(text):
        return values(text).get(("radixserve_ingress_time_to_first_token_seconds_count", "all"))

    now = [0.0]
    store = SnapshotStore(clock=lambda: now[0])
    store.push("r1", snap(1))
    store.ingress_poll("a", 0, ttft(0.2, 3.0))
    store.ingress_poll("b", 0, ttft(0.04))
    text = render(*store.export())
    assert count(text) == 3 and 'radixserve_ingress_time_to_first_token_seconds_count{replica="r1"}' not in text
    assert values(text)[("radixserve_ingress_time_to_first_token_seconds_bucket", "all")] == 3  # (the +Inf one)
    now[0] = STALE_AFTER_S + 1
    store.ingress_poll("b", 0, ttft(0.04, 0.05))  # "a" quiet: retired, its samples kept
    assert count(render(*store.export())) == 4
    store.ingress_poll("a", 0, ttft(0.2, 3.0, 0.3))  # back: its own counts include the kept ones
    assert count(render(*store.export())) == 5
    live, _, _, by_replica, merged = store.export_state()
    restarted = SnapshotStore(clock=lambda: now[0])
    assert restarted.restore(live, by_replica, merged)
    assert count(render(*restarted.export())) == 5
    store.ingress_poll("c", 0, {"router_affinity_hits": 0, "ingress_ttft": {"counts": [1, 2], "sum": 1.0}})
    assert count(render(*store.export())) == 5  # (another release's buckets: left out)


def test_the_ingress_request_latency_is_fleet_wide_and_summed_over_the_ingresses():
    store = SnapshotStore(clock=lambda: 0.0)
    store.push("r1", snap(1))
    store.ingress_poll("a", 0, heartbeat("ingress_e2e", 0.3, 40.0))
    store.ingress_poll("b", 0, heartbeat("ingress_e2e", 2.0))
    store.ingress_poll("c", 0, {"ingress_e2e": {"counts": [1, 2], "sum": 1.0}})  # another release's buckets
    v = values(text := render(*store.export()))
    assert v[("radixserve_ingress_request_latency_seconds_count", "all")] == 3
    assert v[("radixserve_ingress_request_latency_seconds_sum", "all")] == 42.3
    assert 'radixserve_ingress_request_latency_seconds_count{replica="r1"}' not in text  # (fleet-wide only)
    assert 'radixserve_ingress_request_latency_seconds_bucket{replica="all",le="0.5"} 1.0' in text


def test_a_histogram_of_other_buckets_renders_empty_not_a_500():
    text = render({"r1": {**snap(1), "ttft": {"counts": [1] * 3, "sum": 0.5}}})
    assert 'radixserve_time_to_first_token_seconds_count{replica="r1"} 0.0' in text


def test_a_state_exported_by_older_code_is_restored():
    """A reader's view taken before the upgrade has no routers' counts: restore takes it all the same."""
    now = [0.0]
    old = SnapshotStore(clock=lambda: now[0])
    old.push("a", {**snap(5), "block_size": 16})
    live, _, _, by_replica, merged = old.export_state()
    merged.pop("ingress_routing", None)  # as the old code exported it
    new = SnapshotStore(clock=lambda: now[0])
    assert new.restore(live, by_replica, merged)
    m = values(render(*new.export()))
    assert m[("radixserve_requests_total", "all")] == 5 and m[("radixserve_router_affinity_hits_total", "all")] == 0


def test_the_newest_view_offered_after_a_restart_stands():
    """Two ingresses keep views of the hub from their last scrapes; after a restart the one that offers
    first may hold the older. The counters then stood at its totals, below what a scrape of the other
    ingress had shown (a drop Prometheus reads as a reset): a newer view offered soon after replaces it."""
    now = [0.0]
    old = SnapshotStore(clock=lambda: now[0])
    old.push("a", snap(10))
    old.push("b", snap(10))
    old.ingress_poll("i1", 0, {"router_affinity_hits": 5, "router_cold_routes": 1})
    older = old.export_state()  # ingress 1's last scrape
    now[0] = 40.0
    old.push("a", snap(30))  # b dies; a counts on; a third replica comes and goes
    old.push("c", snap(7))
    old.forget("c")
    old.ingress_poll("i1", 0, {"router_affinity_hits": 9, "router_cold_routes": 1})
    newer = old.export_state()  # ingress 2's last scrape
    seen = values(render(newer[0], newer[1]))
    assert seen[("radixserve_requests_total", "all")] == 30 + 10 + 7

    for first, second in ((older, newer), (newer, older)):
        new = SnapshotStore(clock=lambda: now[0])  # the restart
        new.push("b2", snap(1))  # a replica that started meanwhile
        assert new.restore(first[0], first[3], first[4])
        now[0] += 5.0
        assert new.restore(second[0], second[3], second[4]) == (second is newer)
        m = values(render(*new.export()))
        assert m[("radixserve_requests_total", "all")] == 47 + 1  # the newer view's, and b2's own
        assert m[("radixserve_router_affinity_hits_total", "all")] == 9
        new.push("a", snap(31))  # a's own word replaces the view's entry
        assert values(render(*new.export()))[("radixserve_requests_total", "all")] == 48 + 1
        now[0] += 30.0  # a view offered long after the restart is not taken: the counters moved on
        late = SnapshotStore(clock=lambda: now[0])
        _, _, _, by, merged = late.export_state()
        assert not new.restore({"a": snap(99)}, by, merged)


def test_the_hub_counts_the_distinct_hot_blocks_of_the_replicas_that_push():
    now = [0.0]
    store = SnapshotStore(clock=lambda: now[0])
    store.push("a", snap(1))
    store.push("b", snap(1))
    assert store.hot_union("a", [1, 2, 3]) == 3
    assert store.hot_union("b", [2, 3, 4, 5]) == 3  # merged at most every HOT_UNION_EVERY_S: the last count
    now[0] += HOT_UNION_EVERY_S
    assert store.hot_union("b", [2, 3, 4, 5]) == 5  # 2 and 3 held by both: once
    now[0] += HOT_UNION_EVERY_S
    assert store.hot_union("b", [2]) == 3  # b's newer sketch replaces its older one
    now[0] = STALE_AFTER_S + 10
    store.push("a", snap(2))  # b stopped pushing: its sketch goes with it
    assert store.hot_union("a", [1, 2, 3]) == 3
    store.forget("a")
    now[0] += HOT_UNION_EVERY_S
    assert store.hot_union("c", [9]) == 1  # a sketch that came before its replica's first push counts


def test_requests_refused_as_overloaded_are_summed_over_the_ingresses():
    store = SnapshotStore()
    store.push("a", snap(10))
    store.ingress_poll("i1", 0, {"router_affinity_hits": 0, "router_cold_routes": 0, "requests_overloaded": 4})
    store.ingress_poll("i2", 0, {"router_affinity_hits": 0, "router_cold_routes": 0, "requests_overloaded": 1})
    m = values(render(*store.export()))
    assert m[("radixserve_requests_overloaded_total", "all")] == 5
    assert ("radixserve_requests_overloaded_total", "a") not in m  # refused before any replica: fleet only


def test_a_cut_replica_stays_healthy_only_while_its_stop_can_still_remove_it(monkeypatch):
    """A replica the stopping service cut passed every health check for good: if the stop was abandoned
    (its CLI killed before it removed the application), Serve never replaced it, and it answered every
    request "unavailable"."""
    import types

    import deployments.llm_server as llm_server
    from deployments.llm_server import CUT_HEALTHY_S, LLMServer

    now = [1000.0]
    monkeypatch.setattr(llm_server.time, "monotonic", lambda: now[0])
    check = LLMServer.check_health
    replica = types.SimpleNamespace(_cut_at=now[0], aengine=types.SimpleNamespace(alive=False))
    check(replica)  # its engine ended on purpose: healthy while the stop goes on
    now[0] += CUT_HEALTHY_S + 1
    with pytest.raises(RuntimeError, match="the stop was abandoned"):
        check(replica)


def test_a_push_that_raced_a_graceful_stop_counts_but_does_not_bring_the_replica_back():
    # the stop's wait for its background thread is short: a push still on its way after `stopped` made the
    # replica live again for 30 s (in /health, a drain's wait and the gauges)
    now = [0.0]
    store = SnapshotStore(clock=lambda: now[0])
    store.push("a", snap(100, running=3))
    store.stopped("a")
    assert store.push("a", snap(101, running=3)) is False
    assert store.fresh(10.0) == 0 and store.busy(10.0) == 0
    m = values(render(*store.export()))
    assert ("radixserve_requests_total", "a") not in m and m[("radixserve_requests_total", "all")] == 101
    assert m[("radixserve_running_requests", "all")] == 0
    store.stopped("b")  # stopped within its first second, before its first push: its late one still counts
    store.push("b", snap(2))
    assert values(render(*store.export()))[("radixserve_requests_total", "all")] == 103 and store.fresh(10.0) == 0


def test_a_quiet_ingress_is_counted_once_after_a_hub_restart_and_a_gone_ones_in_flight_at_once():
    # its counts, retired after STALE_AFTER_S, were exported summed: when it spoke up after a restart, its
    # full total came on top of that sum (100 then 101 rendered 201)
    now = [0.0]
    old = SnapshotStore(clock=lambda: now[0])
    old.ingress_poll("a", 2, {"router_affinity_hits": 100})
    assert values(render(*old.export()))[("radixserve_ingress_requests_in_flight", "all")] == 2
    now[0] = 3.5  # a crashed ingress's requests are no longer in flight (were, until it retired at 30 s)
    assert values(render(*old.export()))[("radixserve_ingress_requests_in_flight", "all")] == 0
    now[0] = STALE_AFTER_S + 1
    old.ingress_poll("b", 0, {"router_affinity_hits": 1})  # "a" retires
    live, _, _, by_replica, merged = old.export_state()
    new = SnapshotStore(clock=lambda: now[0])
    assert new.restore(live, by_replica, merged)
    new.ingress_poll("a", 0, {"router_affinity_hits": 101})
    assert values(render(*new.export()))[("radixserve_router_affinity_hits_total", "all")] == 102


def test_a_restarted_hub_goes_on_from_its_last_export_and_a_new_one_starts_empty(ray_cluster):
    """The ingresses' views are taken at their own scrapes: lost with the hub, the ingress that served the
    newest one left only older views, and the "all" counters went down (a reset to Prometheus)."""
    import ray

    from deployments.metrics import hub_handle

    hub = hub_handle("restart-test")
    ray.get(hub.push.remote("r1", snap(300)))
    assert "requests_finished" not in ray.get(hub.export_state.remote())[1]  # (r1 is live, not retired)
    pid = ray.get(hub.pid.remote())
    ray.kill(hub, no_restart=False)  # a crash: Ray starts it again
    deadline = time.monotonic() + 60
    while True:
        try:
            if ray.get(hub.pid.remote(), timeout=10) != pid:
                break
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
            pass
        assert time.monotonic() < deadline, "the hub did not restart"
        time.sleep(0.5)
    live, retired = ray.get(hub.export.remote())
    assert values(render(live, retired))[("radixserve_requests_total", "all")] == 300  # before any replica pushed
    ray.kill(hub)  # the CLI's end of a deployment: the next hub of that name is a new one
    hub = hub_handle("restart-test")
    assert values(render(*ray.get(hub.export.remote()))).get(("radixserve_requests_total", "all"), 0) == 0
    ray.kill(hub)
