"""The LLM replica: a Ray Serve deployment hosting one async engine.

Takes token ids (the ingress tokenizes once), streams engine events as dicts, warms prefixes
without generating, pushes metrics to the hub, keeps the Redis hot-prefix directory current, and
reports routing and autoscaling stats that Serve polls. At start it prefills the directory's hottest
prefixes before ``__init__`` returns, so it is warm before Serve sends it traffic. Errors for a bad
request come back as an event with ``error`` set, never as a crash.
"""

from __future__ import annotations

import array
import asyncio
import collections
import contextlib
import itertools
import logging
import os
import threading
import time
from typing import Any

from ray import serve

from app.config import Settings
from cache.directory import HotPrefixDirectory
from cache.hashing import pack_hashes
from deployments.logs import show_our_info_logs
from deployments.metrics import HubClient
from engine.async_engine import AsyncEngine, EngineDeadError
from engine.llm_engine import BooksBroken, LLMEngine, RequestError
from engine.sequence import SamplingParams

log = logging.getLogger("radixserve.replica")
# a stats period's report holds the last event (stored or evicted) of at most twice this many block
# hashes, the newest; past that it says it is truncated, and routers trim to the cached count
MAX_REPORTED_HASHES = 20_000
# directory records waiting for Redis (down, or backing off): the newest this many tokens are kept
MAX_PENDING_RECORD_TOKENS = 4_000_000  # 16 MB as uint32
LAST_EVENTS_KEPT = 100_000  # block hashes whose last cache event (stored/removed) is remembered
# a block hit within this window is in the working set that scaling down must not throw away
HOT_WINDOW_S = 60.0
HOT_SKETCH_PUSH_S = 5.0  # how often a replica's working-set sketch goes to the hub (see hot_union)
EVENTS_WAIT_S = 5.0  # how long a stats poll waits for the engine thread to hand over its cache events


def _note_events(last: collections.OrderedDict, hashes: list[int], stored: bool, keep: int) -> bool:
    """Each hash's latest cache event (True: stored), newest last; only the newest ``keep``. True when
    older ones were dropped."""
    for h in hashes:
        last[h] = stored
        last.move_to_end(h)
    dropped = len(last) > keep
    while len(last) > keep:
        last.popitem(last=False)
    return dropped


def _cached_tokens(engine: LLMEngine, prefixes: list[list[int]], cache_salt: str | None) -> int:
    """KV tokens of ``prefixes`` the radix cache holds now (whole blocks; a block they share counts once)."""
    cache, bs = engine.kv.cache, engine.config.block_size
    if cache is None:
        return 0
    held: set[int] = set()
    for p in prefixes:
        held.update(cache.match(p, cache_salt, max_blocks=len(p) // bs, count=False, hit=False).blocks)
    return len(held) * bs


# how long a replica the stopping service cut stays healthy: the CLI removes the application within seconds
# of the cut; one still here after this was abandoned (its CLI killed), and answers every request
# "unavailable" until Serve replaces it
CUT_HEALTHY_S = 60.0
FLUSH_BUDGET_S = 0.5  # of directory writes per background tick (once a second)
WARMUP_POOL_SHARE = 0.75  # of the KV pool a start-up warm-up may fill (the rest: the first requests)


class LLMServer:
    def __init__(self, settings: dict[str, Any], cache_namespace: str | None = None):
        """``cache_namespace``: what the deployment's routers hash prompts in (``Settings.cache_namespace``,
        computed by ``build_app``); default: the served model's name."""
        show_our_info_logs()
        self.settings = Settings(**settings)
        cfg = self.settings.engine_config(cache_namespace=cache_namespace)
        if cfg.num_threads is None and self.settings.replica_num_gpus == 0:
            # replicas share the machine's cores; oversubscribed torch threads only slow everyone down
            cfg.num_threads = max(1, int(self.settings.replica_num_cpus) or 1)
        self.engine = LLMEngine(cfg)
        self.engine.capture_graphs()  # CUDA: every step graph before traffic (no-op elsewhere)
        self.block_size = cfg.block_size
        if self.engine.kv.cache is not None:
            self.engine.kv.cache.record_events = True  # drained by _collect_events
        try:
            self.replica_id = serve.get_replica_context().replica_id.unique_id
        except Exception:  # noqa: BLE001 - outside Serve (tests)
            self.replica_id = f"local-{os.getpid()}"
        self._stats_seq = 0
        self._autoscaling_prev: tuple[float, dict] | None = None  # last autoscaling poll (for rates)
        self._hot_sketch: list[int] | None = None  # of the working set at the last poll, for the hub
        self._hot_sketch_pushed_at = float("-inf")
        self._fleet_hot = 0.0  # the hub's count of the fleet's distinct hot blocks (0: none yet)
        self._events_lock = threading.Lock()
        # block hash -> True if its last event since the routers' last report was "stored", else "removed":
        # the net change (a block stored and evicted within one period is not held; reported as two
        # lists, the routers would apply the eviction before the store and keep it)
        self._route_events: collections.OrderedDict[int, bool] = collections.OrderedDict()
        self._overflow = False
        # hashes' last cache event, True for stored: a record that reaches Redis after its prefix was
        # evicted (the eviction was seen first) is taken back at once instead of holding for good
        self._last_event: collections.OrderedDict[int, bool] = collections.OrderedDict()
        # records waiting for the flush, by their packed tokens -> [uint32 token array, hits]: requests of
        # one prefix between two flushes make one write (with their hits), not one each
        self._pending_records: collections.OrderedDict[bytes, list] = collections.OrderedDict()
        self._records_lock = threading.Lock()
        self._pending_tokens = 0
        # prefix hashes this replica put in the directory, least recently recorded first
        self._recorded: collections.OrderedDict[int, None] = collections.OrderedDict()
        self.directory: HotPrefixDirectory | None = None
        if (url := self.settings.directory_url()) and self.engine.kv.cache is not None:
            self.directory = HotPrefixDirectory(url, self.settings.deployment_name,
                                                cfg.cache_namespace or cfg.model_id, cfg.block_size)
        self.warmup_report = self._warm_up()  # before Serve marks this replica ready
        self.aengine = AsyncEngine(self.engine)
        self._hub = HubClient(self.settings.deployment_name)
        self._stop = threading.Event()
        self._flush_warned_at = float("-inf")
        # (monotonic) when the stopping service told this replica to end what it runs; None: not so
        self._cut_at: float | None = None
        self._background = threading.Thread(target=self._background_loop, name="replica-background", daemon=True)
        self._background.start()

    def _warm_up(self) -> dict[str, Any]:
        """Prefill the directory's hottest prefixes. Synchronous: the engine thread is not running yet
        and Serve routes nothing here until ``__init__`` returns. Never fails the replica: past
        ``warmup_timeout_s``, or on an engine error, it starts with what is cached (Serve gives up on
        no start-up: a replica stuck here would count toward the fleet's size for good)."""
        k = self.settings.warmup_top_k
        # no more than the pool holds (less a margin for the first requests): past it, the later prefixes
        # would evict the earlier ones
        budget = min(self.settings.warmup_token_budget, int(WARMUP_POOL_SHARE * self.engine.kv.capacity_tokens))
        report: dict[str, Any] = {"prefixes": 0, "tokens": 0, "seconds": 0.0}
        if self.directory is None or k <= 0 or budget <= 0:
            return report
        t0 = time.monotonic()
        added: list[tuple[str, list[int]]] = []
        try:
            # (hot prefixes longer than this replica takes, recorded under other limits, would fill k and warm nothing)
            hot = self.directory.top_k(k, token_budget=budget,
                                       max_tokens=min(self.engine.max_input_tokens, self.engine.max_total_tokens))
        except Exception as e:  # noqa: BLE001 - a directory that fails starts the replica cold, never stops it
            log.warning("warm-up skipped: the hot-prefix directory failed: %s", e)
            report["error"] = str(e)
            return report
        for hp in hot:  # the hottest first: a deadline cuts the coldest
            try:
                added.append((self.engine.add_request(hp.tokens, SamplingParams(max_new_tokens=1),
                                                      prefill_only=True), hp.tokens))
            except RequestError as e:  # e.g. longer than this replica's limits
                log.warning("skipping a hot prefix at warm-up: %s", e)
        deadline = t0 + self.settings.warmup_timeout_s
        aborted: set[str] = set()
        try:
            while self.engine.has_work():
                if time.monotonic() > deadline:
                    raise TimeoutError(f"not done within {self.settings.warmup_timeout_s:g} s (--warmup-timeout-s)")
                self.engine.step()
        except BooksBroken:  # the pool's or scheduler's records failed: serving on them could give one block
            raise  # to two requests (the engine loop ends over it too); the replica fails, Serve starts another
        except Exception as e:  # noqa: BLE001 - serve cold rather than not at all
            log.warning("warm-up stopped, starting with what is cached: %s", e)
            report["error"] = str(e)
            for rid, _ in added:
                try:
                    if self.engine.abort(rid):
                        aborted.add(rid)
                except Exception:  # noqa: BLE001 - a step that failed may leave it half-done: still start
                    aborted.add(rid)
                    log.warning("warm-up: could not abort %s", rid, exc_info=True)
        for rid, tokens in added:
            if rid not in aborted:
                # this replica holds it now; not a hit: a prefix no request uses would stay hot for good as
                # long as replicas kept starting (each warm-up renewed it)
                self._queue_record(tokens, hits=0)
                report["prefixes"] += 1
                report["tokens"] += len(tokens)
        report["seconds"] = time.monotonic() - t0
        log.info("warm-up: %d hot prefixes, %d tokens in %.2fs", report["prefixes"], report["tokens"],
                 report["seconds"])
        return report

    # ------------------------------------------------------------------ requests
    async def generate(self, prompt_ids: list[int], params: dict[str, Any], request_id: str | None = None,
                       prefill_only: bool = False, sibling: bool = False):
        """Async generator of event dicts; the first carries ``error`` if the request is refused.
        ``sibling``: a later choice (``n``, ``best_of``) of a prompt the call's first choice computed here:
        its cache hit is no evidence that the prompt is shared (no directory record, no reuse)."""
        try:
            sp = SamplingParams(**params)
            # aclosing: when the caller goes away, the engine stream is closed (and the request aborted)
            # right here, not whenever the garbage collector gets to it
            async with contextlib.aclosing(self.aengine.generate(prompt_ids, sp, request_id,
                                                                 prefill_only=prefill_only,
                                                                 sibling=sibling)) as stream:
                async for ev in stream:
                    d = dict(ev.__dict__)  # (asdict's deep copy: 48 µs an event, 40x this, at every token)
                    d["replica"] = self.replica_id
                    if ev.finished and not sibling and not ev.error:  # (a failed one proved nothing cached)
                        self._note_finished(prompt_ids, ev.num_cached_tokens, sp.cache_salt, prefill_only)
                    yield d
        except RequestError as e:
            yield {"error": str(e), "error_kind": "validation", "finished": True, "replica": self.replica_id}
        except EngineDeadError as e:  # named, so the caller retries elsewhere and routes around this one
            yield {"error": str(e), "error_kind": "unavailable", "finished": True, "replica": self.replica_id}
        except TypeError as e:  # unknown sampling field: a caller bug, reported as such
            yield {"error": f"bad parameters: {e}", "error_kind": "validation", "finished": True,
                   "replica": self.replica_id}

    def _note_finished(self, prompt_ids: list[int], cached: int, salt: str | None, prefill_only: bool) -> None:
        if self.directory is None or salt:
            return
        shared = len(prompt_ids) if prefill_only else cached  # what this request proved to be shared
        if shared >= self.block_size:
            self._queue_record(prompt_ids[:shared])

    def _queue_record(self, tokens, hits: int = 1) -> None:
        """Queue a directory record (``hits``: requests it served; 0, it only holds it): packed (4 bytes a
        token, as long as the directory keeps), and only the newest MAX_PENDING_RECORD_TOKENS while Redis
        cannot take them."""
        toks = array.array("I", tokens[: self.directory.max_prefix_tokens])
        key = toks.tobytes()
        with self._records_lock:  # (not the events' lock: an engine-thread drain may hold that a while)
            queued = self._pending_records.get(key)
            if queued is not None:
                queued[1] += hits
                self._pending_records.move_to_end(key)  # while Redis is down, the oldest go first
                return
            self._pending_records[key] = [toks, hits]
            self._pending_tokens += len(toks)
            while self._pending_tokens > MAX_PENDING_RECORD_TOKENS and len(self._pending_records) > 1:
                self._pending_tokens -= len(self._pending_records.popitem(last=False)[1][0])

    def _requeue_record(self, key: bytes, toks, hits: int) -> None:
        """Put a record Redis failed back at the head of the queue (the oldest go first), merged with one
        for the same prefix queued since."""
        with self._records_lock:
            queued = self._pending_records.get(key)
            if queued is not None:
                queued[1] += hits
                return
            self._pending_records[key] = [toks, hits]
            self._pending_records.move_to_end(key, last=False)
            self._pending_tokens += len(toks)

    async def warmup(self, prefixes: list[list[int]], cache_salt: str | None = None) -> dict[str, Any]:
        """Prefill ``prefixes`` into the radix cache without generating (and record them as hot), one at a
        time: a warm-up then takes at most one prompt chunk of each engine step, and live requests keep
        the rest. Reports the tokens of them the cache holds at the end (a later one may evict an earlier)."""
        t0 = time.monotonic()
        for ids in prefixes:
            async for ev in self.generate(ids, {"max_new_tokens": 1, "cache_salt": cache_salt}, prefill_only=True):
                if ev.get("error"):  # an answer, not an exception (Serve would log a traceback per refusal)
                    return {"error": ev["error"], "error_kind": ev.get("error_kind"), "replica": self.replica_id}
        cached = await asyncio.to_thread(self.aengine.call, lambda e: _cached_tokens(e, prefixes, cache_salt))
        return {"prefixes": len(prefixes), "cached_tokens": cached, "seconds": time.monotonic() - t0,
                "replica": self.replica_id}

    def info(self) -> dict[str, Any]:
        e = self.engine
        m = e.loaded
        return {"model_id": m.model_id, "model_type": m.config.model_type, "model_dtype": str(m.dtype),
                "model_device_type": m.device.type, "vocab_size": e.vocab_size,
                "max_input_tokens": e.max_input_tokens, "max_total_tokens": e.max_total_tokens,
                "max_batch_prefill_tokens": e.config.max_batch_prefill_tokens,
                "scheduling_policy": e.config.scheduling_policy,
                "max_batch_total_tokens": e.kv.capacity_tokens, "block_size": e.config.block_size,
                "prefix_caching": e.config.prefix_caching, "kv_cache_dtype": e.config.kv_cache_dtype,
                "kv_cache_scales": e.kv_scales if e.pool.fp8_dtype is not None else None,
                "window_size": e.window, "attention_backend": e.attention_backend,
                "cuda_graphs": e.runner.graphs.info() if e.runner.graphs is not None else None,
                "replica": self.replica_id, "warmup": self.warmup_report}

    # ------------------------------------------------------------------ stats
    def _snapshot(self, engine: LLMEngine) -> dict[str, Any]:
        s = engine.kv_stats()
        st = engine.stats
        return {**s, "blocks_used": s["blocks_total"] - s["blocks_free"],
                "requests_finished": st.requests_finished, "requests_aborted": st.requests_aborted,
                "requests_failed": st.requests_failed,
                "prompt_tokens": st.prompt_tokens,
                "generated_tokens": st.generated_tokens, "prefill_tokens_computed": st.prefill_tokens_computed,
                "directory_errors": self.directory.errors if self.directory else 0,
                "warmup_prefixes": self.warmup_report["prefixes"], "warmup_tokens": self.warmup_report["tokens"],
                # -1 until the first request: how much of it warm-up had already cached
                "first_request_cached_tokens": (-1 if engine.kv.first_request_cached_tokens is None
                                                else engine.kv.first_request_cached_tokens),
                # counted by the engine as each sample came (on this thread): none dropped between snapshots
                **{k: getattr(st, k).to_dict() for k in ("ttft", "itl", "e2e")}}

    def stats(self) -> dict[str, Any]:
        return self.aengine.call(self._snapshot)

    def check_invariants(self) -> bool:
        self.aengine.call(lambda e: e.check_invariants())
        return True

    def _collect_events(self) -> bool:
        """Drain the radix cache's stored/removed hashes into the router and directory buffers; False if
        the engine was too busy to answer in time. The buffers are filled on the engine thread itself, so
        a drain that outlasts the wait (a long engine step) still lands in them instead of being lost
        with the timed-out call's result."""
        if self.engine.kv.cache is None:
            return False
        try:
            self.aengine.call(self._drain_events, timeout=EVENTS_WAIT_S)
        except TimeoutError:
            log.debug("engine busy: its cache events will be in the next report")
            return False
        return True

    def _drain_events(self, engine: LLMEngine) -> None:
        events, overflow = engine.kv.cache.drain_events()
        with self._events_lock:
            self._overflow |= overflow
            for kind, hashes in events:
                stored = kind == "stored"
                self._overflow |= _note_events(self._route_events, hashes, stored, 2 * MAX_REPORTED_HASHES)
                if self.directory is not None:
                    _note_events(self._last_event, hashes, stored, LAST_EVENTS_KEPT)

    def record_routing_stats(self) -> dict[str, Any]:
        """Polled by Serve every stats period and handed to every router: load, capacity, and the
        block hashes stored and evicted since the last poll, so routers correct their indexes."""
        self._collect_events()
        s = self.aengine.call(lambda e: e.kv_stats(), timeout=5)
        with self._events_lock:
            events, overflow = self._route_events, self._overflow
            self._route_events, self._overflow = collections.OrderedDict(), False
        stored = [h for h, kept in events.items() if kept]
        removed = [h for h, kept in events.items() if not kept]
        self._stats_seq += 1
        return {"queue": s["running"] + s["waiting"], "kv_free_blocks": s["blocks_free"] + s["blocks_evictable"],
                "kv_total_blocks": s["blocks_total"], "cached_blocks": s["blocks_cached"],
                "prefix_caching": self.engine.kv.cache is not None,
                "stored": pack_hashes(stored), "removed": pack_hashes(removed), "truncated": overflow, "seq": self._stats_seq,
                "replica": self.replica_id, "at": time.time()}

    def record_autoscaling_stats(self) -> dict[str, float]:
        """Polled by Serve for the cache-aware autoscaling policy (``deployments.autoscaling_policy``),
        which averages each value over its look-back window: load, KV pressure, the prompt tokens
        computed again after their eviction (per second, since the last poll), the working set, and the
        fleet's distinct hot blocks (the hub's merge of every replica's sketch, see ``hot_union``)."""
        s, hot, self._hot_sketch = self.aengine.call(
            lambda e: (e.kv_stats(), e.hot_blocks(HOT_WINDOW_S), e.hot_sketch()), timeout=5)
        now = time.monotonic()
        prev, self._autoscaling_prev = self._autoscaling_prev, (now, s)
        prompt_tps = recompute_tps = 0.0
        if prev is not None and now > prev[0]:
            dt, p = now - prev[0], prev[1]
            prompt_tps = (s["prefix_queries_tokens"] - p["prefix_queries_tokens"]) / dt
            recompute_tps = (s["recomputed_blocks"] - p["recomputed_blocks"]) * s["block_size"] / dt
        return {"ongoing": float(s["running"] + s["waiting"]),
                "kv_usage": float(s["blocks_in_use"]) / max(1, s["blocks_total"]),
                "prompt_tps": prompt_tps, "recompute_tps": recompute_tps,
                "hot_blocks": float(hot), "total_blocks": float(s["blocks_total"]),
                "fleet_hot_blocks": self._fleet_hot}

    def _background_loop(self) -> None:
        """Every second: push metrics to the hub and flush directory records; never on the request path.
        (Not at once: /health would turn 200 before ``radixserve serve`` has seen its start-up finish,
        and a Ctrl-C then would abandon the start-up instead of draining.)"""
        while not self._stop.wait(1.0):
            if not self.aengine.alive and self._cut_at is None:
                self._end_series()
                return
            try:
                # the ingress (re)creates the hub; a replica only finds it (see HubClient.call)
                cut = self._hub.call("push", self.replica_id, self._snapshot_now(), create=False)
                if cut is True:  # `radixserve serve` is stopping past its drain: end what still runs
                    log.warning("the service is stopping: ending the requests still running")
                    self._cut_at = time.monotonic()
                    self.aengine.shutdown()
                    self._push_last()
                    return
            except Exception as e:  # noqa: BLE001 - metrics must never take a replica down
                log.debug("metrics push failed: %s", e)
            try:
                self._push_hot_sketch()
            except Exception as e:  # noqa: BLE001 - an autoscaling hint: a failed push keeps the last count
                log.debug("working-set sketch push failed: %s", e)
            try:
                self._flush_directory()
            except Exception:  # noqa: BLE001 - the directory is a hint: say so, at most once a minute
                if time.monotonic() - self._flush_warned_at > 60:
                    self._flush_warned_at = time.monotonic()
                    log.warning("hot-prefix directory: records lost", exc_info=True)

    def _snapshot_now(self) -> dict[str, Any]:
        """The engine's counts, read on its thread; once that thread is gone (a crash, a stop), directly:
        nothing else touches the engine then, and the requests its end aborted are counted there."""
        try:
            return self.aengine.call(self._snapshot, timeout=5)
        except EngineDeadError:
            return self.aengine.read_after_end(self._snapshot)

    def _end_series(self) -> None:
        """The engine thread is gone (a crash): its last counts, then its series ends at the hub. Pushed on,
        the counts read after its end kept it a live engine in /health (200) until Serve replaced it."""
        self._push_last()
        try:
            self._hub.call("stopped", self.replica_id, timeout=2, create=False)
        except Exception as e:  # noqa: BLE001 - the hub retires it anyway once its pushes are stale
            log.debug("ending the metrics series failed: %s", e)

    def _push_last(self) -> None:
        """The counts since the last push, and the requests a stop aborted, to the hub once more (it keeps
        a stopped replica's last push as its retired totals): else every stop lost up to a second of them."""
        try:
            self._hub.call("push", self.replica_id, self._snapshot_now(), timeout=2, create=False)
        except Exception as e:  # noqa: BLE001 - metrics must never hold a stop up
            log.debug("last metrics push failed: %s", e)

    def _push_hot_sketch(self) -> None:
        sketch = self._hot_sketch
        if sketch is None or time.monotonic() - self._hot_sketch_pushed_at < HOT_SKETCH_PUSH_S:
            return
        self._hot_sketch_pushed_at = time.monotonic()
        self._fleet_hot = float(self._hub.call("hot_union", self.replica_id, sketch, create=False))

    def _flush_directory(self) -> None:
        if self.directory is None:
            return
        drained = self._collect_events()
        # bounded: a slow Redis (inside its timeouts) writes fewer records a second than requests make, and
        # this thread also pushes the metrics that /health reads; the rest waits for the next flush
        until = time.monotonic() + FLUSH_BUDGET_S
        # (not once the replica is stopping: its holdings are forgotten then, and a late write would undo it)
        while self.directory.available and time.monotonic() < until and not self._stop.is_set():
            with self._records_lock:
                if not self._pending_records:
                    break
                key, (toks, hits) = self._pending_records.popitem(last=False)
                self._pending_tokens -= len(toks)
            h = self.directory.record(self.replica_id, toks, hits=hits)
            if h is not None:
                self._recorded[h] = None
                self._recorded.move_to_end(h)
            elif not self.directory.available:  # Redis failed this write (a timeout): keep its hits
                # (a write that timed out may still have landed: its hits may then count twice, a smaller
                # error in a popularity hint than losing them)
                self._requeue_record(key, toks, hits)
                break
        if not drained:  # the latest events are not in yet: judge what is gone at the next flush
            return
        # by each hash's latest event, not the order they came in: a record may reach Redis after its
        # prefix's eviction (the request ended, then the cache let it go), and a prefix evicted and
        # computed again since is held
        with self._events_lock:
            gone = [h for h in self._recorded if self._last_event.get(h) is False]
        # bounded: a record whose eviction left the event window before a flush judged it (Redis slow or
        # down meanwhile) would be kept for good; the pool holds no more prefixes than it has blocks, so
        # past that many the least recently recorded go too (one still cached is recorded at its next hit)
        if (over := len(self._recorded) - len(gone) - self.engine.kv.allocator.num_blocks) > 0:
            dead = set(gone)
            gone += itertools.islice((h for h in self._recorded if h not in dead), over)
        if gone and not self._stop.is_set() and self.directory.drop_holder(self.replica_id, gone):  # else tried again at the next flush
            for h in gone:
                del self._recorded[h]

    def check_health(self) -> None:
        """Serve replaces the replica when this raises: its engine thread died, or hangs in a step."""
        if self._cut_at is not None:
            if time.monotonic() - self._cut_at < CUT_HEALTHY_S:
                return  # stopped on purpose, the service with it: a replacement would only be cut too
            raise RuntimeError(f"ended by a stop of the service {CUT_HEALTHY_S:.0f} s ago, and still deployed "
                               "(the stop was abandoned): to be replaced")
        if not self.aengine.alive:
            raise RuntimeError("engine thread is not running")
        stalled = self.aengine.stalled_s()
        if stalled > self.settings.engine_stall_timeout_s:
            raise RuntimeError(f"engine loop stuck: no progress for {stalled:.0f} s "
                               f"(--engine-stall-timeout-s {self.settings.engine_stall_timeout_s:g})")

    def __del__(self):
        # Serve calls this on graceful shutdown, after the drain, with its force-kill near: the quick
        # calls first (the hub forgets this replica's series, the directory its holdings), then abort what
        # is running so every block goes back (a join of up to 10 s)
        # (the background thread is joined first: a push or record of its own after them would undo them);
        # last, the counts since the last push and the aborts, which the hub adds to the retired series
        for step in (lambda: self._stop.set(), lambda: self._background.join(1.5),
                     lambda: self._hub.handle.stopped.remote(self.replica_id),
                     lambda: self.directory is not None and self.directory.forget_replica(self.replica_id),
                     lambda: self.aengine.shutdown(), self._push_last):
            try:
                step()
            except Exception:  # noqa: BLE001 - each one on its own: one failing must not skip the rest
                pass
