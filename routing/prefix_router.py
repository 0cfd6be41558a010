"""The Ray Serve request router: ``routing.policy`` on the token ids the ingress passes.

Attached to the LLM deployment with ``RequestRouterConfig``; it runs inside each caller's process
(the ingress). Never blocks (no remote calls on the hot path) and never lets an exception escape
``choose_replicas``: Serve would leave the request hanging, so errors fall back to Serve's own
ranking and are counted.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import logging
import threading
import time
import weakref
from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import Any

from ray.serve.request_router import PendingRequest, ReplicaID, ReplicaResult, RequestRouter, RunningReplica

from cache.hashing import block_hashes, reported_hashes
from routing import in_process
from routing.policy import PolicyConfig, PrefixPolicy, Routed
from routing.report_backlog import ReportBacklog

log = logging.getLogger("radixserve.router")

def avoid_replica(replica_id: str, seconds: float = 15.0) -> None:
    """Rank ``replica_id`` last for ``seconds`` in every router of this process: a replica whose
    engine failed while its actor lives on (Serve's health check replaces it within seconds), so the
    caller's one retry goes elsewhere. Per process: the ingress that saw the failure is the process
    its routers run in."""
    in_process.FAILED[replica_id] = time.monotonic() + seconds


def _failed_last(order: list[str]) -> list[str]:
    failed = in_process.FAILED
    if not failed:
        return order
    now = time.monotonic()
    for rid, until in list(failed.items()):
        if until < now:
            failed.pop(rid, None)
    return sorted(order, key=lambda r: r in failed)  # stable: the ranking is kept among the rest


# A replica that reports an empty queue at time T has finished every request routed to it before
# T minus this (time for a routed request to reach its engine, and clock skew between nodes).
STALE_AFTER_IDLE_S = 10.0
MAX_COUNTED_NEW_TOKENS = 1 << 20  # no context is longer: what the router counts of a max_new_tokens
# Replica reports are folded into the index outside routing decisions, in slices of the router's event
# loop this long with pauses between them (folding takes at most a fifth of the loop); a replica's
# unfolded hashes past the limit (two and a half full reports) are let go, and its cached count bounds its index
FOLD_SLICE_S = 0.0005
FOLD_PAUSE_S = 0.002
BACKLOG_PER_REPLICA = 100_000
# directory holders applied per routing decision, in hashes (~1 ms; one chain whole past it): 8 replicas
# holding 64 prefixes of 16k tokens took 214 ms in the first decision after a sync, and 49 ms in each
# after it that checked all of them again
LEARN_PER_DECISION = 2048
# every so many syncs the directory's holders are all applied again, not only those new since the last
# (a chain the index let go, by its guesses, while its replica kept it)
RELEARN_EVERY_SYNCS = 12
ENDED_MEMORY = 4096  # completed requests whose caller has not said yet how many tokens they generated


def request_ended(request_id: str, generated: int) -> None:
    """The caller's request ``request_id`` (the third argument of ``generate``) ended, finished or
    cancelled, after ``generated`` tokens. Only the caller knows that count: the policy counted the
    request's ``max_new_tokens`` in full in its replica's work rate, so one cancelled long stream (or
    a long ``max_tokens`` that met EOS early) held that replica over the rate bound for hundreds of
    requests. Never raises: it runs in the caller's ``finally`` blocks."""
    try:
        for router in list(in_process.ROUTERS):
            router.end_soon(request_id, generated)
    except Exception:  # noqa: BLE001 - a router added meanwhile, a loop closing: the count is a hint
        log.debug("request_ended failed", exc_info=True)


@dataclass(slots=True, eq=False)  # entries are told apart by identity (see _finish)
class _Routed:
    replica: str
    ticket: Routed
    caller_id: str | None  # the caller's request id, for request_ended
    at: float  # time.time() when routed (compared with the replicas' report times)


def caller_request_id(pending: PendingRequest | None) -> str | None:
    args = (pending.args or ()) if pending is not None else ()
    return args[2] if len(args) > 2 and isinstance(args[2], str) else None


def request_tokens(pending: PendingRequest | None) -> tuple[list[int], int, str | None]:
    """(token ids, max_new_tokens, cache_salt) of a ``generate``/``warmup`` call; empty otherwise."""
    if pending is None:
        return [], 0, None
    args = pending.args or ()
    if not args:
        return [], 0, None
    first = args[0]
    if isinstance(first, list) and first and isinstance(first[0], list):  # warmup(prefixes, salt)
        salt = args[1] if len(args) > 1 and isinstance(args[1], str) else None
        return first[0], 0, salt
    if not isinstance(first, list):
        return [], 0, None
    params = args[1] if len(args) > 1 and isinstance(args[1], dict) else {}
    # bounded: a caller past the ingress's checks (a library, Ray) must not make one request's work
    # swamp a replica's real load in float arithmetic
    return first, max(0, min(int(params.get("max_new_tokens", 0) or 0), MAX_COUNTED_NEW_TOKENS)), params.get("cache_salt")


class PrefixAwareRequestRouter(RequestRouter):
    def initialize_state(self, mode: str = "prefix", block_size: int = 16, model_id: str = "",
                         load_weight: float | None = None, decode_token_cost: float = 8.0,
                         redis_url: str | None = None, deployment: str = "radixserve",
                         directory_sync_s: float = 5.0, directory_top_k: int = 64, **_: Any) -> None:
        self.mode = mode
        self.model_id = model_id
        cfg = PolicyConfig(block_size=block_size, decode_token_cost=decode_token_cost)
        if load_weight is not None:
            cfg.load_weight = load_weight
        self.policy = PrefixPolicy(cfg)
        self._rr = itertools.count()
        # (Serve's internal request id, replica) -> what the policy was told, oldest first. Not the id
        # alone: the calls one HTTP request makes share it (/info, then generate; a retry on another
        # replica), and Serve reports each attempt's end, rejected ones too
        self._routed: dict[tuple[str, str], list[_Routed]] = {}
        self._by_caller: dict[str, tuple[str, str]] = {}  # caller's request id -> its key in _routed
        # keys whose entry ended before Serve reported it (the caller said so, or the replica went idle):
        # Serve's report for it, when it comes, must not end another call's entry at the same key
        self._settled: OrderedDict[tuple[str, str], int] = OrderedDict()
        self._ended: OrderedDict[str, _Routed] = OrderedDict()  # completed, awaiting the caller's count
        # keys Serve reported ended before it said they were routed (it registers its completion callback
        # before it awaits the replica's acceptance): the call routed next at that key ends with its result
        self._early: OrderedDict[tuple[str, str], int] = OrderedDict()
        self._reported: set[_Routed] = set()  # entries routed after such a report (none left to settle)
        # replicas that left the fleet (ids are never reused): Serve may still report a request routed to
        # one just before, and that report must not bring it back into the policy as a phantom
        self._left: OrderedDict[str, None] = OrderedDict()
        self._loop: asyncio.AbstractEventLoop | None = None  # the loop Serve runs this router on
        in_process.ROUTERS.add(self)
        self.errors = 0
        self._backlog = ReportBacklog(BACKLOG_PER_REPLICA)
        self._fold_pending: asyncio.AbstractEventLoop | None = None
        # Holders learned from the Redis directory (after a router restart, or for replicas this
        # router never sent a prefix to); fetched off the hot path, applied at the next decision. Only
        # the latest sync is kept: a router that routes nothing for hours holds one snapshot, not a backlog.
        self._learned: list[tuple[str, list[int]]] | None = None
        # the directory thread's block hashes of the hot prefixes it read (by their hash): it fetches and
        # hashes a prefix's tokens once, not every sync
        self._chains: OrderedDict[int, list[int]] = OrderedDict()
        # the routing thread's side: (replica, chain) pairs not applied yet, in a decision's share at a time,
        # and the pairs (replica, last hash) of the syncs taken so far (a pair is applied when it is new)
        self._to_learn: deque[tuple[str, list[int]]] = deque()
        self._synced: set[tuple[str, int]] = set()
        self._syncs_taken = 0
        self._stop = threading.Event()
        directory = bool(redis_url) and mode == "prefix"
        # replicas that left the fleet, for the directory thread to drop (list ops are atomic); None: no directory
        self._gone: list[str] | None = [] if directory else None
        if directory:
            threading.Thread(target=self._sync_directory, args=(weakref.ref(self), redis_url, deployment,
                                                                directory_sync_s, directory_top_k),
                             name="router-directory", daemon=True).start()

    @staticmethod
    def _sync_directory(ref: weakref.ref, url: str, deployment: str, period: float, top_k: int) -> None:
        """The directory thread. It holds its router weakly: Serve drops a router with its handle, and a
        strong reference here kept every one alive (its index with it) and syncing, for good."""
        from cache.directory import HotPrefixDirectory  # redis stays out of routing's import path

        router = ref()
        if router is None:
            return
        stop = router._stop
        try:
            directory = HotPrefixDirectory(url, deployment, router.model_id, router.policy.cfg.block_size)
        except Exception:  # noqa: BLE001 - an unusable URL: route on without the directory
            log.warning("router: no hot-prefix directory at this URL", exc_info=True)
            router._gone = None
            return
        del router
        while not stop.wait(period):
            router = ref()
            if router is None:
                return
            router._sync_once(directory, top_k)
            del router

    def _sync_once(self, directory, top_k: int) -> None:
        try:
            # a crashed replica never says goodbye: its entries would stand for their TTL; while Redis
            # is down (or backing off) the ids wait for a later sync
            while self._gone and directory.available:
                gone, errors = self._gone.pop(), directory.errors
                directory.forget_replica(gone)
                if directory.errors > errors:
                    self._gone.append(gone)
                    break
            learned = []
            chains = self._chains  # (this thread's alone)
            # (the directory is this router's block size and model: its hashes of a prefix are the router's)
            for hp in directory.top_k(top_k, known=chains):
                if hp.block_hashes:
                    chains[hp.hash] = hp.block_hashes
                chains.move_to_end(hp.hash)
                learned += [(rid, chains[hp.hash]) for rid in directory.holders(hp.hash)]
            while len(chains) > 4 * top_k:
                chains.popitem(last=False)
            self._learned = learned  # one reference swap: the routing thread takes it whole
        except Exception:  # noqa: BLE001 - the directory is a hint; never fail routing over it
            log.debug("directory sync failed", exc_info=True)

    def _apply_learned(self) -> None:
        learned, self._learned = self._learned, None
        if learned is not None:
            pairs = {(rid, chain[-1]) for rid, chain in learned}
            self._syncs_taken += 1
            if self._syncs_taken % RELEARN_EVERY_SYNCS == 0:
                self._to_learn.clear()  # (all of them again: what waits is among them)
                self._synced.clear()
            self._to_learn.extend((rid, chain) for rid, chain in learned if (rid, chain[-1]) not in self._synced)
            self._synced = pairs
        spent = 0
        while self._to_learn and spent < LEARN_PER_DECISION:
            rid, chain = self._to_learn.popleft()
            view = self.policy.replicas.get(rid)
            if view is None:  # (not in the fleet yet, or gone: the next sync brings it again)
                self._synced.discard((rid, chain[-1]))
                continue
            spent += len(chain)
            if not all(h in view.index for h in chain):
                self.policy.learn_hashes(rid, chain)

    # ------------------------------------------------------------------ routing
    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        try:
            return self._choose(candidate_replicas, pending_request)
        except Exception:  # noqa: BLE001 - never let Serve hang a request on a routing bug
            self.errors += 1
            log.exception("prefix routing failed; falling back to Serve's ranking")
            return [candidate_replicas]

    def _choose(self, candidates: list[RunningReplica], pending: PendingRequest | None
                ) -> list[list[RunningReplica]]:
        if (context := getattr(pending, "routing_context", None)) is not None:
            # the ranks hold every candidate: if none takes the request (all at max_ongoing_requests),
            # Serve must back off before asking again, not poll them all in a loop (its default: False)
            context.should_backoff = True
        if not candidates:
            return []
        by_id = {r.replica_id.unique_id: r for r in candidates}
        if self.mode == "round_robin":  # (no index to keep: the replicas' reports are not read)
            order = sorted(by_id)
            start = next(self._rr) % len(order)
            return [[by_id[i]] for i in _failed_last(order[start:] + order[:start])]
        self._absorb_stats(candidates)
        self._apply_learned()
        hashes = self._hashes(pending)
        ids, max_new, _ = request_tokens(pending)
        ranked = self.policy.rank(hashes, len(ids), max_new, list(by_id))
        return [[by_id[r]] for r in _failed_last(ranked) if r in by_id]

    def _hashes(self, pending: PendingRequest | None) -> list[int]:
        if pending is None:
            return []
        cached = getattr(pending, "_radixserve_hashes", None)
        if cached is None:  # computed once per request, even when Serve retries the routing
            ids, _, salt = request_tokens(pending)
            try:
                cached = block_hashes(ids, self.policy.cfg.block_size, self.model_id, salt) if ids else []
            except (OverflowError, TypeError):  # an id no model has (negative, over 32 bits): the replica
                cached = []  # refuses the request with a 400; routing it as cold is all there is to do
            pending._radixserve_hashes = cached
        return cached

    def _absorb_stats(self, replicas: list[RunningReplica]) -> None:
        """Take in the replicas' latest reports (stats arrive every stats period): their hashes go to the
        backlog, folded into the index between decisions; their counts apply at once."""
        reports = []
        for r in replicas:
            stats = r.routing_stats or {}
            rid = r.replica_id.unique_id
            if self._left:
                self._left.pop(rid, None)  # Serve offers it: it is live after all
            self.policy.add_replica(rid, stats.get("kv_total_blocks"))
            seq = stats.get("seq")
            view = self.policy.replicas[rid]
            if seq is None or view.stats_seq == seq:
                continue
            # Serve hands routers only each replica's latest report: a router that routed nothing for
            # a stats period never saw that period's hashes (a gap in seq), as if they were truncated
            missed = view.stats_seq is not None and seq != view.stats_seq + 1
            view.stats_seq = seq
            try:
                removed, stored = reported_hashes(stats.get("removed")), reported_hashes(stats.get("stored"))
                malformed = False
            except ValueError:  # (no replica of ours sends such): its cached count bounds the index
                removed, stored, malformed = (), (), True
            queued = self._backlog.push(rid, removed, stored) and not malformed
            # The stored/removed hashes keep the index exact; only when some were dropped (truncated by
            # the replica, missed here, or let go from an overflowing backlog) does its cached-block count
            # bound the index instead.
            # (a replica without a prefix cache reports no events: its count, 0, is all there is)
            exact = queued and not (stats.get("truncated") or missed) and stats.get("prefix_caching", True)
            reports.append((rid, stats, exact))
        self._fold_soon()  # in the loop's idle time, not in this decision
        for rid, stats, exact in reports:
            if stats.get("queue") == 0 and isinstance(stats.get("at"), (int, float)):
                self._drop_stale(rid, stats["at"])
            self.policy.report(rid, capacity_blocks=stats.get("kv_total_blocks"), in_flight=stats.get("queue"))
            if not exact:  # the count describes the cache after these hashes: it bounds the index after them
                self._backlog.push_bound(rid, stats.get("cached_blocks"), self._bound)

    def _learn_stored(self, replica_id: str, hashes: list[int]) -> None:
        self.policy.learn_hashes(replica_id, hashes, from_root=False)

    def _bound(self, replica_id: str, cached_blocks: int | None) -> None:
        self.policy.report(replica_id, cached_blocks=cached_blocks)

    def _fold(self, budget_s: float) -> bool:
        return self._backlog.fold(self.policy.forget_hashes, self._learn_stored, self._bound, budget_s)

    def _fold_soon(self) -> None:
        queued_on = self._fold_pending  # the loop a slice is queued on (a closed one never runs it)
        if not self._backlog or (queued_on is not None and not queued_on.is_closed()):
            return
        self._fold_pending = None
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # not on a loop (tests, tools): nothing to defer to
            self._fold(float("inf"))
            return
        self._fold_pending = loop
        # in slices with pauses between them: queued right after each other they took the loop from
        # the routing as often as the routing had it, and requests that arrived meanwhile waited
        loop.call_later(FOLD_PAUSE_S, self._fold_some)

    def _fold_some(self) -> None:
        """One slice of the report backlog; the next is queued after a pause."""
        self._fold_pending = None
        try:
            if self._fold(FOLD_SLICE_S):
                self._fold_soon()
        except Exception:  # noqa: BLE001
            self.errors += 1
            log.exception("folding replica reports failed")

    def _drop_stale(self, replica_id: str, idle_at: float) -> None:
        """The replica was idle at ``idle_at`` (its clock): whatever was routed there well before has
        ended, whether or not its end reached this router (a backstop for any path that misses it).
        Never later than this router's own now: a replica whose clock runs ahead must not end requests
        routed there a moment ago (one behind only makes the backstop later)."""
        cutoff = min(idle_at, time.time()) - STALE_AFTER_IDLE_S
        for key, entries in [(k, list(v)) for k, v in self._routed.items() if k[1] == replica_id]:
            for entry in entries:
                if entry.at < cutoff:
                    self._finish(key, entry)

    def _finish(self, key: tuple[str, str], entry: _Routed | None = None, settle: bool = True) -> None:
        """A request at ``key`` ended: ``entry`` (the caller's word, or found stale), else (Serve's
        report) the oldest routed there, unless that report is of one that ended already. ``settle``:
        Serve's report for ``entry`` is still to come (not when it came before the entry did)."""
        settled = self._settled
        if entry is None and settled.get(key):
            settled[key] -= 1
            if not settled[key]:
                del settled[key]
            return
        entries = self._routed.get(key)
        if not entries:
            if entry is None:  # Serve's report came before on_request_routed (see on_request_routed)
                self._early[key] = self._early.get(key, 0) + 1
                while len(self._early) > ENDED_MEMORY:  # bounded: rejected calls are never routed
                    self._early.popitem(last=False)
            return
        if entry is None:
            entry = entries[0]
        elif entry not in entries:
            return
        elif settle and entry not in self._reported:
            settled[key] = settled.get(key, 0) + 1
            while len(settled) > ENDED_MEMORY:  # bounded: a report that never comes
                settled.popitem(last=False)
        entries.remove(entry)
        self._reported.discard(entry)
        if not entries:
            del self._routed[key]
        if entry.caller_id is not None:
            self._by_caller.pop(entry.caller_id, None)
            # Serve's report can come before the caller's: keep the ticket for its token count
            self._ended[entry.caller_id] = entry
            while len(self._ended) > ENDED_MEMORY:
                self._ended.popitem(last=False)
        self.policy.on_completed(entry.replica, entry.ticket)

    def end_soon(self, caller_id: str, generated: int) -> None:
        """``request_ended`` from the caller's thread: it runs on this router's loop."""
        loop = self._loop
        if loop is not None and not loop.is_closed():
            try:
                loop.call_soon_threadsafe(self._end, caller_id, generated)
            except RuntimeError:  # closed since the check
                pass

    def _end(self, caller_id: str, generated: int) -> None:
        try:
            key = self._by_caller.get(caller_id)
            entry = next((e for e in self._routed.get(key, ()) if e.caller_id == caller_id), None) if key else None
            if entry is not None:
                self._finish(key, entry)
            entry = self._ended.pop(caller_id, None)
            if entry is not None:
                self.policy.on_generated(entry.replica, entry.ticket, generated)
        except Exception:  # noqa: BLE001
            self.errors += 1
            log.exception("request_ended failed")

    # ------------------------------------------------------------------ lifecycle hooks
    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID,
                          result: ReplicaResult) -> None:
        try:
            if self.mode == "round_robin":
                return
            ids, max_new, _ = request_tokens(pending_request)
            rid = replica_id.unique_id
            if rid in self._left:  # it left since it was chosen: nothing of it to count on
                return
            self.policy.add_replica(rid)
            if self._loop is None:
                try:
                    self._loop = asyncio.get_running_loop()
                except RuntimeError:  # called outside Serve's loop (tests): releases then wait for reports
                    pass
            hashes = self._hashes(pending_request)
            hits, colds = self.policy.affinity_hits, self.policy.cold_routes
            work = self.policy.on_routed(rid, hashes, len(ids), max_new)
            if hashes:  # a prompt of a block or more: not /info, nor a prompt too short to share
                in_process.ROUTED["router_affinity_hits"] += self.policy.affinity_hits - hits
                in_process.ROUTED["router_cold_routes"] += self.policy.cold_routes - colds
            key, caller = (pending_request.metadata.internal_request_id, rid), caller_request_id(pending_request)
            entry = _Routed(rid, work, caller, time.time())
            self._routed.setdefault(key, []).append(entry)
            if caller is not None:
                self._by_caller[caller] = key
            if self._early.get(key) and result is not None:
                # Serve reported a call at this key ended before this one was routed: this one, if it
                # finished that fast, or a rejected one. Its result says which: it ends this entry when
                # it is done (at once if it is), and a later report from Serve finds nothing to end
                self._early[key] -= 1
                if not self._early[key]:
                    del self._early[key]
                self._reported.add(entry)
                result.add_done_callback(functools.partial(self._result_done, key, entry))
        except Exception:  # noqa: BLE001
            self.errors += 1
            log.exception("on_request_routed failed")

    def _result_done(self, key: tuple[str, str], entry: _Routed, _result=None) -> None:
        """A result's done callback (from a Ray thread): its entry ends on this router's loop."""
        loop = self._loop
        if loop is None:  # (tests, tools: no loop)
            self._finish_result(key, entry)
            return
        try:
            loop.call_soon_threadsafe(self._finish_result, key, entry)
        except RuntimeError:  # the loop closed: nothing left to count
            pass

    def _finish_result(self, key: tuple[str, str], entry: _Routed) -> None:
        try:
            self._finish(key, entry, settle=False)
        except Exception:  # noqa: BLE001
            self.errors += 1
            log.exception("ending a routed request failed")

    # Serve's own bookkeeping runs first and the policy's after, guarded: a policy bug must not stop
    # Serve from handling a finished request or a dead replica.
    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        try:
            self._finish((internal_request_id, replica_id.unique_id))
        except Exception:  # noqa: BLE001
            self.errors += 1
            log.exception("on_request_completed failed")

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        try:
            if self._gone is not None:
                self._gone.append(replica_id.unique_id)
            self._forget_replica(replica_id.unique_id)
        except Exception:  # noqa: BLE001
            self.errors += 1
            log.exception("on_replica_actor_died failed")

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        try:
            live = {r.replica_id.unique_id for r in replicas}
            left = [rid for rid in self.policy.replicas if rid not in live]
            if self._gone is not None:
                self._gone.extend(left)
            for rid in left:
                self._forget_replica(rid)
            for rid in live:
                self._left.pop(rid, None)
            self.policy.sync_replicas(live)
        except Exception:  # noqa: BLE001
            self.errors += 1
            log.exception("update_replicas failed")

    def _forget_replica(self, replica_id: str) -> None:
        self.policy.remove_replica(replica_id)
        self._backlog.drop(replica_id)
        self._left[replica_id] = None
        while len(self._left) > ENDED_MEMORY:  # bounded: a late report comes within seconds
            self._left.popitem(last=False)
