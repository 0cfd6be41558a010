"""The metrics hub's store and the Prometheus text, without Ray: per-replica series come and go, the
replica="all" counters never go down."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from deployments.metrics import STALE_AFTER_S, SnapshotStore, render


def values(text: str) -> dict[tuple[str, str], float]:
    return {(s.name, s.labels.get("replica", "")): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def snap(requests: int, running: int = 0) -> dict:
    return {"requests_finished": requests, "prompt_tokens": 10 * requests, "running": running, "blocks_total": 8,
            "ttft": {"counts": [requests] + [0] * 12, "sum": 0.01 * requests}}


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
