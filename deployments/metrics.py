"""Replica metrics: each LLM replica pushes a snapshot to one small hub actor every second; the
ingress renders the hub's view as Prometheus text, per replica and summed (``replica="all"``).

Snapshots are plain dicts, so this module is testable without Ray (the hub is a thin actor shell).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import ray
from ray.experimental import internal_kv

from cache.hot_sketch import union_estimate
from engine.latency import E2E_BUCKETS, ITL_BUCKETS, TTFT_BUCKETS

STALE_AFTER_S = 30.0
RETIRED_MERGE_S = 600.0
# after a hub restart, how long a newer view than the one taken back may still replace it (under
# STALE_AFTER_S: the entries a view gave have not folded away yet)
RESTORE_WINDOW_S = 20.0
HOT_UNION_EVERY_S = 2.0  # replicas send their working-set sketches every 5 s (see hot_union)
HUB_VERSION = 11  # in the hub's name: a detached hub of older code (without ``stopped``) is not reused
# (11: the latency histograms' buckets changed: a hub of older code summed none of the new replicas' retired ones)
INGRESS_FRESH_S = 3.0  # an ingress heartbeats twice a second: one not heard from in this long is gone
SAVED_NAMESPACE = "radixserve-metrics"  # Ray's internal KV (in the GCS), where a hub keeps its last export
HUNG_AFTER_TIMEOUTS = 2  # calls in a row that time out before a client restarts the hub
log = logging.getLogger(__name__)

COUNTERS = {
    "radixserve_requests_total": ("requests_finished", "Requests finished (warm-up prefills not counted)."),
    "radixserve_requests_aborted_total": ("requests_aborted",
                                          "Requests cancelled before they finished (client gone, shutdown, engine failure)."),
    "radixserve_requests_failed_total": ("requests_failed", "Requests an engine error ended alone (in their "
                                         "sampling or text; counted in requests_total too)."),
    "radixserve_prompt_tokens_total": ("prompt_tokens", "Prompt tokens received, warm-up prefixes included."),
    "radixserve_generation_tokens_total": ("generated_tokens", "Tokens generated."),
    "radixserve_prefill_tokens_computed_total": ("prefill_tokens_computed",
                                                 "Prompt tokens actually prefilled (not served from cache), "
                                                 "warm-up included."),
    "radixserve_prefix_cache_queries_total": ("prefix_queries_tokens",
                                              "Prompt tokens of requests looked up in the prefix cache (warm-up "
                                              "not counted, so the hit rate is the requests')."),
    "radixserve_prefix_cache_hits_total": ("prefix_hit_tokens", "Prompt tokens served from the prefix cache."),
    "radixserve_cache_evictions_total": ("evicted_blocks", "KV blocks evicted from the prefix cache."),
    "radixserve_cache_recomputed_blocks_total": ("recomputed_blocks",
                                                 "KV blocks computed again soon after their eviction (cache too small)."),
    "radixserve_preemptions_total": ("preemptions", "Sequences preempted for lack of KV blocks."),
    "radixserve_directory_errors_total": ("directory_errors",
                                          "Hot-prefix directory (Redis) calls that failed; serving went on."),
    # the ingress replicas' prefix routers (replica="all" only): routing happens before any replica
    "radixserve_router_affinity_hits_total": ("router_affinity_hits",
                                              "Requests the prefix router sent to a replica it believed held at "
                                              "least a block of their prompt (prompts of a block or more)."),
    "radixserve_router_cold_routes_total": ("router_cold_routes",
                                            "Requests the prefix router placed without such a match (a new "
                                            "prefix, a spill off a busy holder; prompts of a block or more; "
                                            "the pow2 and round_robin routers count none)."),
    # the ingress replicas' own (replica="all" only): refused before any replica
    "radixserve_requests_overloaded_total": ("requests_overloaded",
                                             "Requests the ingress replicas refused with 429 at their "
                                             "--max-concurrent-requests."),
}
GAUGES = {
    "radixserve_cache_blocks_used": ("blocks_used", "KV blocks in use or cached (not free)."),
    "radixserve_cache_blocks_cached": ("blocks_cached", "KV blocks held by the prefix cache."),
    "radixserve_cache_blocks_in_use": ("blocks_in_use", "KV blocks held by running requests."),
    "radixserve_cache_blocks_total": ("blocks_total", "KV blocks in the pool."),
    "radixserve_cache_block_size": ("block_size",
                                    "Tokens per KV block: a shared prefix shorter than this cannot hit."),
    "radixserve_running_requests": ("running", "Sequences in the running batch."),
    "radixserve_warmup_prefixes": ("warmup_prefixes", "Hot prefixes prefilled at replica start."),
    "radixserve_first_request_cached_tokens": ("first_request_cached_tokens",
                                               "Cached prompt tokens of the replica's first request (-1: none yet)."),
    "radixserve_queue_depth": ("waiting", "Requests waiting for admission."),
    # the ingress replicas' (replica="all" only): beyond the replicas' running and waiting, the rest
    # wait in Serve's routers for a replica under max_ongoing_requests
    "radixserve_ingress_requests_in_flight": ("ingress_in_flight",
                                              "HTTP requests the ingress replicas are serving (tokenizing, "
                                              "waiting for a replica, streaming)."),
}
PER_REPLICA_ONLY = frozenset({"radixserve_first_request_cached_tokens"})  # a fleet sum would mean nothing
FLEET_ONLY = frozenset({"radixserve_router_affinity_hits_total", "radixserve_router_cold_routes_total",
                        "radixserve_requests_overloaded_total",
                        "radixserve_ingress_requests_in_flight", "radixserve_ingress_time_to_first_token_seconds",
                        "radixserve_ingress_request_latency_seconds"})
ROUTER_KEYS = ("router_affinity_hits", "router_cold_routes", "requests_overloaded")
HISTOGRAMS = {
    "radixserve_time_to_first_token_seconds": ("ttft", "Time to first token.", TTFT_BUCKETS),
    "radixserve_inter_token_latency_seconds": ("itl", "Time between generated tokens.", ITL_BUCKETS),
    "radixserve_request_latency_seconds": ("e2e", "Time from a request's arrival at its replica to its end "
                                           "(waiting, prefill and generation; cancelled ones not counted).",
                                           E2E_BUCKETS),
    # the ingress replicas' (replica="all" only)
    "radixserve_ingress_time_to_first_token_seconds": (
        "ingress_ttft", "Time to first token from the ingress's receipt of the request (tokenizing and the wait "
        "for a replica included; each choice of a request counted).", TTFT_BUCKETS),
    "radixserve_ingress_request_latency_seconds": (
        "ingress_e2e", "Time from the ingress's receipt of a generation request to its last response byte (a "
        "stream's included), for those answered in full with a 200.", E2E_BUCKETS),
}
# the fleet-wide histograms: the ingresses measure them and send them in their heartbeats
INGRESS_HISTOGRAMS = {key: buckets for name, (key, _, buckets) in HISTOGRAMS.items() if name in FLEET_ONLY}


def _esc(v: str) -> str:
    return v.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


COUNTER_KEYS = frozenset(key for key, _ in COUNTERS.values())


@dataclass
class _View:
    """The view a restarted store took back: when, how much it counted, and the entries it gave that no
    replica or ingress has reported over since (a newer view replaces them)."""

    at: float
    total: float
    replicas: set[str] = field(default_factory=set)
    ingresses: set[str] = field(default_factory=set)


def _view_total(live: dict[str, dict], retired: dict[str, dict], merged: dict[str, Any]) -> float:
    """Everything a view counted (a later view of the same store counts at least as much)."""
    total: dict[str, Any] = {}
    for part in (*live.values(), *retired.values(), merged, *merged.get("ingress_routing", {}).values()):
        _add(total, part, COUNTER_KEYS)
    return sum(v for k, v in total.items() if k in COUNTER_KEYS)


def _add(total: dict[str, Any], snap: dict[str, Any], keys: frozenset[str] | None = None) -> None:
    """Add ``snap``'s numbers and histograms into ``total`` (only ``keys`` and histograms, if given)."""
    for key, val in snap.items():
        if isinstance(val, (int, float)) and not isinstance(val, bool):
            if keys is None or key in keys:
                total[key] = total.get(key, 0) + val
        elif isinstance(val, dict) and "counts" in val:
            t = total.setdefault(key, {"counts": [0] * len(val["counts"]), "sum": 0.0})
            if len(t["counts"]) != len(val["counts"]):
                continue  # buckets changed between releases: leave that one out rather than fail
            t["counts"] = [a + b for a, b in zip(t["counts"], val["counts"], strict=True)]
            t["sum"] += val["sum"]


def render(snapshots: dict[str, dict[str, Any]], retired: dict[str, Any] | None = None) -> str:
    """Prometheus text for every replica's snapshot, plus a ``replica="all"`` sum. ``retired``: the
    counters and histograms of replicas that are gone, so the "all" counters never go down (Prometheus
    would read a drop as a reset)."""
    snaps = dict(snapshots)
    total: dict[str, Any] = {}
    for s in snaps.values():
        _add(total, s)
    if retired:
        _add(total, retired)
    if snaps or retired:
        # a constant of the deployment: while autoscaling holds no replica, the last one's (not 0)
        total["block_size"] = max((s.get("block_size", 0) for s in snaps.values()), default=0) or (
            retired or {}).get("block_size", 0)
        snaps["all"] = total
    lines: list[str] = []
    for name, (key, help_) in COUNTERS.items():
        lines += [f"# HELP {name} {help_}", f"# TYPE {name} counter"]
        lines += [f'{name}{{replica="{_esc(r)}"}} {float(s.get(key, 0))}' for r, s in snaps.items()
                  if r == "all" or name not in FLEET_ONLY]
    for name, (key, help_) in GAUGES.items():
        lines += [f"# HELP {name} {help_}", f"# TYPE {name} gauge"]
        lines += [f'{name}{{replica="{_esc(r)}"}} {float(s.get(key, 0))}' for r, s in snaps.items()
                  if not (r == "all" and name in PER_REPLICA_ONLY) and (r == "all" or name not in FLEET_ONLY)]
    name = "radixserve_cache_hit_rate"
    lines += [f"# HELP {name} Token-weighted prefix cache hit rate since start.", f"# TYPE {name} gauge"]
    for r, s in snaps.items():
        q = s.get("prefix_queries_tokens", 0)
        lines.append(f'{name}{{replica="{_esc(r)}"}} {s.get("prefix_hit_tokens", 0) / q if q else 0.0}')
    name = "radixserve_block_utilization"
    lines += [f"# HELP {name} Share of KV blocks not free.", f"# TYPE {name} gauge"]
    for r, s in snaps.items():
        t = s.get("blocks_total", 0)
        lines.append(f'{name}{{replica="{_esc(r)}"}} {s.get("blocks_used", 0) / t if t else 0.0}')
    for name, (key, help_, buckets) in HISTOGRAMS.items():
        lines += [f"# HELP {name} {help_}", f"# TYPE {name} histogram"]
        for r, s in snaps.items():
            if r != "all" and name in FLEET_ONLY:
                continue
            h = s.get(key)
            if not h or len(h["counts"]) != len(buckets) + 1:  # (none yet, or another release's buckets)
                h = {"counts": [0] * (len(buckets) + 1), "sum": 0.0}
            cum = 0
            for b, c in zip((*buckets, float("inf")), h["counts"], strict=True):
                cum += c
                le = "+Inf" if b == float("inf") else repr(b)
                lines.append(f'{name}_bucket{{replica="{_esc(r)}",le="{le}"}} {float(cum)}')
            lines.append(f'{name}_sum{{replica="{_esc(r)}"}} {h["sum"]}')
            lines.append(f'{name}_count{{replica="{_esc(r)}"}} {float(cum)}')
    return "\n".join(lines) + "\n"


class SnapshotStore:
    """Latest snapshot per replica; replicas that stop pushing drop out after ``STALE_AFTER_S``, and
    their counters and histograms are kept (``retired``), so the "all" sums never go down. Retired
    totals stay per replica for ``RETIRED_MERGE_S``: a replica that pushes again in that time (a stall,
    a push racing its own shutdown) takes them back, since its own totals include them."""

    def __init__(self, clock=time.monotonic):
        self._clock = clock
        self._snaps: dict[str, tuple[float, dict]] = {}
        self._retired: dict[str, tuple[float, dict]] = {}  # replica -> (when, its last totals)
        self._merged: dict[str, Any] = {}  # retired long ago, replica ids forgotten
        # a fresh store (the hub restarted) starts empty; each ingress gives it back its last view, and the
        # newest one offered within RESTORE_WINDOW_S stands (see restore)
        self.incarnation = uuid.uuid4().hex
        self._view: _View | None = None
        self._view_merged: dict[str, Any] = {}  # its merged totals (replaced by a newer view's)
        self._draining_until = float("-inf")  # the CLI's drain, refreshed while it lasts (see drain)
        # ingress replica -> (when, requests in flight, whether it was told of the drain then)
        self._ingress: dict[str, tuple[float, int, bool]] = {}
        # ingress replica -> its routers' counters (cumulative); those of ingress replicas gone quiet, kept
        # apart for RETIRED_MERGE_S (one that polls again takes them back: its counters include them),
        # then summed
        self._routing: dict[str, dict[str, int]] = {}
        self._routing_retired: dict[str, tuple[float, dict[str, int]]] = {}
        self._routing_gone: dict[str, Any] = {}
        self._cut: set[str] = set()  # replicas told to end what still runs (see cut)
        self._stopped: dict[str, float] = {}  # replicas that said they stopped -> when (see stopped)
        self._hot_sketches: dict[str, list[int]] = {}  # replica -> its working set's sketch (see hot_union)
        self._hot_union = (float("-inf"), 0.0)  # (when, the count then): merged at most every HOT_UNION_EVERY_S
        self._block_size = 0  # the last one a replica reported, rendered while none is live
        self._swept_at = float("-inf")

    def push(self, replica: str, snapshot: dict) -> bool:
        """A replica's snapshot in; True when it must stop its engine now (``cut``)."""
        if replica in self._stopped:  # a push that raced its stop: its counts, not a live series again
            totals: dict[str, Any] = {}
            _add(totals, snapshot, COUNTER_KEYS)  # (cumulative: they include what it had retired with)
            self._retired[replica] = (self._retired.get(replica, (self._clock(), None))[0], totals)
            return False
        self._retired.pop(replica, None)
        if self._view is not None:
            self._view.replicas.discard(replica)  # its own word now, newer than any view's
        now = self._clock()
        self._snaps[replica] = (now, snapshot)
        if now - self._swept_at >= 1.0:  # retire and fold the gone replicas even if nobody scrapes /metrics
            self._swept_at = now
            self.snapshots()
        self._block_size = snapshot.get("block_size") or self._block_size
        return replica in self._cut

    def cut(self) -> None:
        """The drain ran out (or a second Ctrl-C): the replicas running now are told, at their next push,
        to stop their engines, which ends each request still running with an error event (a 503 before
        its first token) instead of a connection that just closes when Ray stops. Only those: a
        replacement Serve starts, or a later deployment of the same name, is not cut."""
        self._cut |= set(self._snaps)

    def hot_union(self, replica: str, sketch: list[int]) -> float:
        """A replica's working-set sketch in (``cache.hot_sketch``); out, the distinct hot blocks of the
        replicas that push (a prefix on every replica counted once), for the autoscaling policy."""
        self._hot_sketches[replica] = list(sketch)
        now = self._clock()
        if now - self._hot_union[0] >= HOT_UNION_EVERY_S:  # (100 replicas' sketches take ~25 ms to merge)
            live = self.snapshots()  # (forgets the replicas gone quiet, their sketches with them)
            self._hot_union = (now, union_estimate(s for r, s in self._hot_sketches.items() if r in live or r == replica))
        return self._hot_union[1]

    def stopped(self, replica: str) -> None:
        """A replica's graceful stop: its series ends now, and a push of its own still on its way (its
        background thread outlived the stop's short wait for it) counts, but does not bring it back as live
        (it did, for ``STALE_AFTER_S``: in /health, a drain's wait, the gauges). Remembered for
        ``RETIRED_MERGE_S``, until a later stop."""
        now = self._clock()
        self._stopped[replica] = now
        for r in [r for r, at in self._stopped.items() if now - at >= RETIRED_MERGE_S]:
            del self._stopped[r]  # bounded: ids are never reused, and a late push comes within seconds
        self.forget(replica)

    def forget(self, replica: str) -> None:
        self._hot_sketches.pop(replica, None)
        gone = self._snaps.pop(replica, None)
        if gone is not None:
            totals: dict[str, Any] = {}
            _add(totals, gone[1], COUNTER_KEYS)
            self._retired[replica] = (self._clock(), totals)

    def snapshots(self) -> dict[str, dict]:
        now = self._clock()
        for r in [r for r, (at, _) in self._snaps.items() if now - at >= STALE_AFTER_S]:
            self.forget(r)
        for r in [r for r, (at, _) in self._retired.items() if now - at >= RETIRED_MERGE_S]:
            _add(self._merged, self._retired.pop(r)[1])  # bounded: old replicas fold into one sum
        return {r: s for r, (_, s) in self._snaps.items()}

    def export(self) -> tuple[dict[str, dict], dict[str, Any]]:
        """(live snapshots, retired totals), for ``render``."""
        live = self.snapshots()
        retired: dict[str, Any] = {}
        _add(retired, self._merged)
        _add(retired, self._view_merged)
        _add(retired, self._routing_gone)
        for counts in (*self._routing.values(), *(c for _, c in self._routing_retired.values())):
            _add(retired, counts)
        # (an ingress gone without a word stops counting at once, not when it retires)
        now = self._clock()
        retired["ingress_in_flight"] = sum(n for at, n, _ in self._ingress.values() if now - at < INGRESS_FRESH_S)
        for _, totals in self._retired.values():
            _add(retired, totals)
        if self._block_size:
            retired["block_size"] = self._block_size
        return live, retired

    def export_state(self) -> tuple[dict[str, dict], dict[str, Any], str, dict[str, dict], dict[str, Any]]:
        """``export`` plus what a restarted store needs back (``restore``): (live snapshots, retired
        sum, incarnation, retired totals per replica, merged totals). The merged totals carry the
        routers' counts too, or a restart would drop them: those of ingress replicas gone, summed in,
        and each known one's under ``"ingress_routing"`` (the reader's tuple keeps its shape)."""
        live, retired = self.export()
        merged: dict[str, Any] = {}
        _add(merged, self._merged)  # a copy, histograms included
        _add(merged, self._view_merged)
        _add(merged, self._routing_gone)
        if self._block_size:
            merged["block_size"] = self._block_size
        # the quiet ones by id too: summed in, they were counted again when one spoke up after a restart
        merged["ingress_routing"] = {**{r: dict(c) for r, (_, c) in self._routing_retired.items()},
                                     **{r: dict(c) for r, c in self._routing.items()}}
        return live, retired, self.incarnation, {r: t for r, (_, t) in self._retired.items()}, merged

    def restore(self, live: dict[str, dict], retired: dict[str, dict], merged: dict[str, Any]) -> bool:
        """Take back a view a reader kept of the store before it restarted: replicas not heard from since
        count as just heard (a live one replaces its entry at its next push; a dead one retires after
        ``STALE_AFTER_S``), so the "all" counters continue where they were instead of dropping to what the
        live replicas alone counted. Each ingress offers its own view, taken at its last scrape; within
        ``RESTORE_WINDOW_S`` of the first, a newer one (more counted) replaces what an older one gave, or
        the counters would stay at the older view's, below what a scrape of another ingress showed.
        False if this view changed nothing."""
        now = self._clock()
        total = _view_total(live, retired, merged)
        if self._view is not None:
            if now - self._view.at > RESTORE_WINDOW_S or total <= self._view.total:
                return False
            for r in self._view.replicas:  # what the older view gave and nothing has told since
                self._snaps.pop(r, None)
                self._retired.pop(r, None)
            for r in self._view.ingresses:
                self._routing.pop(r, None)
        view = self._view = _View(now if self._view is None else self._view.at, total)
        merged = dict(merged)
        block_size = merged.pop("block_size", 0)  # (a constant: never summed into the totals)
        routing: dict[str, dict[str, int]] = merged.pop("ingress_routing", {})  # absent in older state
        self._block_size = self._block_size or block_size
        for r, snap in live.items():
            if r not in self._snaps and r not in self._retired:
                self._snaps[r] = (now, snap)
                view.replicas.add(r)
        for r, totals in retired.items():
            if r not in self._snaps and r not in self._retired:
                self._retired[r] = (now, totals)
                view.replicas.add(r)
        for r, counts in routing.items():
            if r not in self._routing:  # one that polled since sent its own, newer counts
                self._routing[r] = dict(counts)
                view.ingresses.add(r)
                # as just heard, so a dead one retires after STALE_AFTER_S (its counts kept); nothing in
                # flight and "told", so it never holds up a drain
                self._ingress.setdefault(r, (now, 0, True))
        self._view_merged = {}
        _add(self._view_merged, merged)
        return True

    def fresh(self, within_s: float) -> int:
        """Replicas that pushed within ``within_s``: a replica pushes every second only while its engine
        thread answers, so this is the count of live engines, busy or not."""
        now = self._clock()
        return sum(1 for at, _ in self._snaps.values() if now - at < within_s)

    def drain(self, for_s: float) -> None:
        """Every ingress replica refuses new requests for ``for_s`` seconds (the CLI renews this while it
        drains, so a drain whose CLI died does not outlive it)."""
        self._draining_until = max(self._draining_until, self._clock() + for_s)

    def ingress_poll(self, replica: str, in_flight: int, routing: dict[str, int] | None = None) -> bool:
        """An ingress replica's heartbeat: its requests in flight (and its routers' counters) in; whether
        to drain out."""
        now = self._clock()
        told = now < self._draining_until
        self._ingress[replica] = (now, in_flight, told)
        if routing is not None:
            self._routing[replica] = {k: int(routing.get(k, 0)) for k in ROUTER_KEYS}
            for key, buckets in INGRESS_HISTOGRAMS.items():
                h = routing.get(key)
                if isinstance(h, dict) and len(h.get("counts") or ()) == len(buckets) + 1:
                    self._routing[replica][key] = {"counts": [int(c) for c in h["counts"]],
                                                   "sum": float(h.get("sum", 0.0))}
            self._routing_retired.pop(replica, None)  # back after a gap: its own counts include these
            if self._view is not None:
                self._view.ingresses.discard(replica)
        for r in [r for r, (at, *_) in self._ingress.items() if now - at >= STALE_AFTER_S]:
            del self._ingress[r]  # bounded: replicas gone long ago
            if r in self._routing:  # its counts stay in the sums
                self._routing_retired[r] = (now, self._routing.pop(r))
        for r in [r for r, (at, _) in self._routing_retired.items() if now - at >= RETIRED_MERGE_S]:
            _add(self._routing_gone, self._routing_retired.pop(r)[1])
        return told

    def ingress_heartbeat(self, replica: str, in_flight: int, routing: dict[str, int]) -> tuple[bool, str]:
        """``ingress_poll``, and this store's incarnation: an ingress that finds it new (the hub restarted)
        offers its last view at once (``restore``), not at its next scrape."""
        return self.ingress_poll(replica, in_flight, routing), self.incarnation

    def ingress_in_flight(self, within_s: float) -> int:
        """Requests in flight on the ingress replicas heard from within ``within_s``; during a drain, one
        more for each that has not yet reported since it was told (it may still be taking requests)."""
        now = self._clock()
        draining = now < self._draining_until
        return sum(n + (draining and not told) for at, n, told in self._ingress.values() if now - at < within_s)

    def busy(self, within_s: float) -> int:
        """Requests running or waiting on the replicas that pushed within ``within_s`` (a dead
        replica's last report must not hold up a drain)."""
        now = self._clock()
        return sum(s.get("running", 0) + s.get("waiting", 0) for at, s in self._snaps.values() if now - at < within_s)


@ray.remote(num_cpus=0, max_restarts=-1)
class MetricsHub(SnapshotStore):
    """The store as one small detached actor per deployment (restarted by Ray if its process dies; the
    replicas fill it again within a second). Each export (each scrape) is saved in Ray's internal KV, and
    a restarted hub takes it back before it answers anything: the "all" counters go on from at least what
    the last scrape showed, even when the ingress that served it was lost with the hub (the ingresses'
    own views, offered after a restart, are the fallback). A new hub (not a restart) starts empty."""

    def __init__(self):
        super().__init__()
        self._saved_as: str | None = None
        try:
            context = ray.get_runtime_context()
            self._saved_as = context.get_actor_name()
            if context.was_current_actor_reconstructed:
                saved = internal_kv._internal_kv_get(self._saved_as, namespace=SAVED_NAMESPACE)
                if saved:
                    live, by_replica, merged = json.loads(saved)
                    self.restore(live, by_replica, merged)
            else:  # (a former deployment's, of the same name)
                internal_kv._internal_kv_del(self._saved_as, namespace=SAVED_NAMESPACE)
        except Exception:  # noqa: BLE001 - the ingresses' views still restore it
            log.warning("metrics hub: its saved counters could not be read", exc_info=True)

    def export_state(self):
        state = super().export_state()
        if self._saved_as:
            live, _, _, by_replica, merged = state
            try:
                internal_kv._internal_kv_put(self._saved_as, json.dumps([live, by_replica, merged]),
                                             namespace=SAVED_NAMESPACE)
            except Exception:  # noqa: BLE001 - a scrape must not fail over it
                log.debug("metrics hub: saving its counters failed", exc_info=True)
        return state

    def pid(self) -> int:
        return os.getpid()


def hub_name(deployment_name: str) -> str:
    # versioned: the detached hub of an older release (another interface) must not be reused
    return f"{deployment_name}-metrics-hub-v{HUB_VERSION}"


def hub_handle(deployment_name: str):
    """The hub of one deployment (created on first use, detached so replica restarts keep it)."""
    return MetricsHub.options(name=hub_name(deployment_name), namespace="radixserve",
                              get_if_exists=True, lifetime="detached").remote()


def hub_scope(deployment_name: str) -> str:
    """Whose hub a replica's is: its application's (two applications of one Serve config, each with
    the default deployment name, must not count each other's replicas in /health and /metrics). The
    application `radixserve serve` deploys is named after the deployment: its hub keeps that name."""
    from ray import serve

    try:
        app = serve.get_replica_context().app_name
    except Exception:  # noqa: BLE001 - not in a replica (tests, tools)
        app = ""
    return deployment_name if not app or app == deployment_name else f"{app}.{deployment_name}"


class HubClient:
    """The application's hub, found (or created) again when the actor is gone for good (``ray.kill``, a
    lost node): a dead handle must not leave ``/health`` failing until every replica restarts."""

    def __init__(self, deployment_name: str):
        self._name = hub_scope(deployment_name)
        self.handle = hub_handle(self._name)
        self._timeouts = 0

    def renew(self, create: bool = True) -> None:
        """A fresh handle: to the hub, created if need be (``create``), else to one that exists (ValueError
        if none does)."""
        if create:
            self.handle = hub_handle(self._name)
        else:
            self.handle = ray.get_actor(hub_name(self._name), namespace="radixserve")

    def _timed_out(self) -> None:
        """A hub that stops answering (a hung process) is not restarted by Ray, which restarts only dead
        actors: after a few timeouts in a row, kill it so Ray starts it again (readers restore it)."""
        self._timeouts += 1
        if self._timeouts >= HUNG_AFTER_TIMEOUTS:
            self._timeouts = 0
            log.warning("the metrics hub has not answered %d calls in a row: restarting it", HUNG_AFTER_TIMEOUTS)
            try:
                ray.kill(self.handle, no_restart=False)
            except Exception:  # noqa: BLE001 - already gone: the next call renews the handle
                pass

    def call(self, method: str, *args, timeout: float = 5.0, renew: bool = True, create: bool = True):
        """``method(*args)`` on the hub, blocking (background threads); renews the handle once if the
        actor died (``renew``; a heartbeat that must not bring back a hub the CLI removed passes False,
        and takes the handle the other callers renew). ``create`` False: renew only to a hub that exists
        (the LLM replicas' pushes: a replica that outlives its application's deletion, draining its
        streams, would otherwise bring back a detached hub that nobody removes)."""
        for attempt in range(2):
            try:
                out = ray.get(getattr(self.handle, method).remote(*args), timeout=timeout)
                self._timeouts = 0
                return out
            except ray.exceptions.GetTimeoutError:
                self._timed_out()
                raise
            except ray.exceptions.ActorDiedError:
                if attempt or not renew:
                    raise
                self.renew(create)

    async def acall(self, method: str, *args, timeout: float = 5.0, create: bool = True):
        """The same from asyncio code (the ingress; one that drains passes ``create`` False: the CLI
        removes the hub as it deletes the application, and a late scrape must not bring it back)."""
        for attempt in range(2):
            try:
                out = await asyncio.wait_for(getattr(self.handle, method).remote(*args), timeout=timeout)
                self._timeouts = 0
                return out
            except asyncio.TimeoutError:
                await asyncio.to_thread(self._timed_out)
                raise
            except ray.exceptions.ActorDiedError:
                if attempt:
                    raise
                await asyncio.to_thread(self.renew, create)
