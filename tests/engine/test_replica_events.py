"""The replica's hand-over of cache events to the routers (no Serve needed: the buffers only)."""

from __future__ import annotations

import collections
import threading
import time
import types

import deployments.llm_server as llm_server
from cache.hashing import PackedHashes, block_hashes
from deployments.llm_server import LLMServer
from deployments.metrics import SnapshotStore
from engine.async_engine import AsyncEngine
from engine.sequence import SamplingParams


def _replica(engine) -> LLMServer:
    r = object.__new__(LLMServer)  # the parts of __init__ the event hand-over uses
    r.engine, r.aengine = engine, AsyncEngine(engine)
    r._events_lock = threading.Lock()
    r._route_events, r._records_lock = collections.OrderedDict(), threading.Lock()
    r._overflow, r._recorded, r._stats_seq = False, collections.OrderedDict(), 0
    r._pending_records, r._pending_tokens, r._last_event = collections.OrderedDict(), 0, collections.OrderedDict()
    r._cut_at, r.directory, r.replica_id, r._stop = None, None, "A", threading.Event()
    r._hot_sketch, r._hot_sketch_pushed_at, r._fleet_hot = None, float("-inf"), 0.0
    return r


PROMPT = list(range(40, 110))  # 4 full blocks


def _recording(make_engine, directory: bool = False):
    """A tiny engine with a small pool whose cache records events, and its replica (with a directory)."""
    eng = make_engine("tiny", max_batch_total_tokens=256)
    eng.kv.cache.record_events = True
    r = _replica(eng)
    if directory:
        r.directory = FakeDirectory(eng.kv.cache.model_id)
    return eng, r


def _generate(r: LLMServer, prompts, params: SamplingParams) -> None:
    """The engine's own generate, on the replica's engine thread: from the test's thread it raced the
    thread's loop, which stepped the request too and found no stream for it (a crashed engine)."""
    r.aengine.call(lambda e: e.generate(prompts, params))


def _evict_all(r: LLMServer) -> None:
    r.aengine.call(lambda e: e.kv.allocator.free(e.kv.cache.evict(10**6)))  # pressure: the cache lets go


class FakeDirectory:
    """What the replica calls on HotPrefixDirectory, Redis up or down, without Redis."""

    max_prefix_tokens = 32768

    def __init__(self, model: str, block_size: int = 16):
        self.model, self.block_size, self.available = model, block_size, True
        self.held: set[int] = set()
        self.writes: list[tuple[int, int]] = []  # (prefix hash, hits)

    def record(self, replica, tokens, hits=1):
        from cache.hashing import block_hashes

        h = block_hashes(list(tokens), self.block_size, self.model)[-1]
        self.held.add(h)
        self.writes.append((h, hits))
        return h

    def drop_holder(self, replica, hashes):
        if not self.available:
            return False
        self.held.difference_update(hashes)
        return True


def test_a_prefix_evicted_before_its_record_reaches_the_directory_is_taken_back(make_engine):
    # the eviction event used to be dropped when it came before the record (a 1 s flush later), and
    # the replica stayed the prefix's holder in Redis, and in its own bookkeeping, for good
    eng, r = _recording(make_engine, directory=True)
    prompt = PROMPT
    try:
        _generate(r, [prompt], SamplingParams(max_new_tokens=1))
        r._queue_record(prompt[:64])  # the request proved 64 tokens shared: the record waits for the flush
        _evict_all(r)  # pressure: the cache lets go
        r._collect_events()  # the eviction is seen first (a routing stats poll)
        r._flush_directory()
        assert not r._recorded and not r.directory.held
        # the usual order: recorded, then evicted, then the next flush drops it
        _generate(r, [prompt], SamplingParams(max_new_tokens=1))
        r._queue_record(prompt[:64])
        r._flush_directory()
        assert len(r._recorded) == 1 and r.directory.held == set(r._recorded)
        _evict_all(r)
        r._flush_directory()
        assert not r._recorded and not r.directory.held
        # evicted, computed again and recorded, all between two flushes: held (an early version of
        # this fix applied the eviction after the record and dropped it)
        _generate(r, [prompt], SamplingParams(max_new_tokens=1))
        r._collect_events()
        _evict_all(r)
        _generate(r, [prompt], SamplingParams(max_new_tokens=1))
        r._queue_record(prompt[:64])
        r._flush_directory()
        assert len(r._recorded) == 1 and r.directory.held == set(r._recorded)
    finally:
        r.aengine.shutdown()


def test_records_waiting_for_redis_keep_only_the_newest_tokens(make_engine, monkeypatch):
    monkeypatch.setattr(llm_server, "MAX_PENDING_RECORD_TOKENS", 100)
    r = _replica(make_engine("tiny"))
    r.directory = FakeDirectory("m")
    r.directory.available = False  # Redis down: records pile up, bounded by their tokens
    try:
        for i in range(10):
            r._queue_record([i] * 32)
        assert [t[0][0] for t in r._pending_records.values()] == [7, 8, 9] and r._pending_tokens == 96
        r.directory.available = True
        r._flush_directory()
        assert len(r.directory.held) == 3 and r._pending_tokens == 0 and not r._pending_records
    finally:
        r.aengine.shutdown()


class FailingDirectory(FakeDirectory):
    """Redis times out on the next ``fail`` writes (HotPrefixDirectory answers None and backs off)."""

    fail = 1

    def record(self, replica, tokens, hits=1):
        if self.fail:
            self.fail -= 1
            self.available = False
            return None
        return super().record(replica, tokens, hits)


def test_a_record_redis_failed_is_written_at_a_later_flush_with_its_hits(make_engine):
    # it used to be dropped: the hits of a prefix's requests since the last flush were lost
    r = _replica(make_engine("tiny"))
    r.directory = FailingDirectory("m")
    try:
        for _ in range(3):
            r._queue_record(list(range(32)))
        r._queue_record(list(range(16, 48)))
        r._flush_directory()  # the first write times out: nothing more is tried while Redis backs off
        assert not r.directory.writes and r._pending_tokens == 64
        r._queue_record(list(range(32)))  # one more request of it meanwhile
        r.directory.available = True
        r._flush_directory()
        assert sorted(hits for _, hits in r.directory.writes) == [1, 4] and not r._pending_records
        assert r._pending_tokens == 0
    finally:
        r.aengine.shutdown()


def test_requests_of_one_prefix_between_two_flushes_make_one_write(make_engine):
    r = _replica(make_engine("tiny"))
    r.directory = FakeDirectory("m")
    try:
        for _ in range(5):
            r._queue_record(list(range(32)))
        r._queue_record(list(range(16)))  # a shorter prefix of it: its own entry
        assert r._pending_tokens == 48
        r._flush_directory()
        assert [hits for _, hits in r.directory.writes] == [5, 1] and r._pending_tokens == 0
    finally:
        r.aengine.shutdown()


def test_a_later_choice_of_one_call_is_no_record_of_a_shared_prefix(make_engine):
    """``n`` choices of one unique prompt: the later ones find it cached, but only requests of their own
    prove a prefix shared. As records they filled the directory (and new replicas' warm-ups) with
    prompts that never come back."""
    import asyncio

    eng, r = _recording(make_engine, directory=True)
    r.block_size = eng.config.block_size

    async def run(sibling: bool) -> int:
        events = [ev async for ev in r.generate(PROMPT, {"max_new_tokens": 1}, sibling=sibling)]
        return events[-1]["num_cached_tokens"]

    try:
        assert asyncio.run(run(False)) == 0  # the first choice computes it
        assert asyncio.run(run(True)) == 64  # a sibling finds it...
        assert not r._pending_records  # ...and records nothing
        assert asyncio.run(run(False)) == 64  # another request of it: shared
        assert [hits for _, hits in r._pending_records.values()] == [1]
    finally:
        r.aengine.shutdown()


def test_the_first_requests_cached_tokens_are_the_first_taken_not_the_first_finished(make_engine):
    """The gauge was set as requests finished: on a cold replica, a later request that hit the first one's
    blocks and ended first showed as a warm-up that worked."""
    import asyncio

    eng, r = _recording(make_engine)
    r.block_size, r.warmup_report = eng.config.block_size, {"prefixes": 0, "tokens": 0}

    async def run() -> None:
        first = r.generate(PROMPT, {"max_new_tokens": 40, "ignore_eos": True})
        await first.__anext__()  # its prompt is computed (and cached)
        later = [ev async for ev in r.generate(PROMPT + [7, 8], {"max_new_tokens": 1})]
        assert later[-1]["num_cached_tokens"] == 64  # it hit the first one's blocks, and ended first
        async for _ in first:
            pass

    try:
        assert r._snapshot(eng)["first_request_cached_tokens"] == -1  # none yet
        asyncio.run(run())
        assert r._snapshot(eng)["first_request_cached_tokens"] == 0  # the first one found nothing cached
    finally:
        r.aengine.shutdown()


def test_a_request_refused_on_the_engine_thread_is_the_requests_error_and_records_nothing(make_engine, monkeypatch):
    """A refusal there (a guide the replica's check let through) was an "engine" error, a 503 that the
    ingress retries elsewhere; and its failed last event recorded its prompt as held (a warm-up's, a hit)."""
    import asyncio

    from engine.llm_engine import RequestError

    eng, r = _recording(make_engine, directory=True)
    r.block_size = eng.config.block_size

    def refuse(*_, **__):
        raise RequestError("the guide cannot be used")

    monkeypatch.setattr(eng, "add_request", refuse)

    async def run(prefill_only: bool) -> dict:
        return [ev async for ev in r.generate(PROMPT, {"max_new_tokens": 1}, prefill_only=prefill_only)][-1]

    try:
        for prefill_only in (True, False):
            last = asyncio.run(run(prefill_only))
            assert last["error_kind"] == "validation" and "guide" in last["error"], last
        assert not r._pending_records and eng.kv.first_request_cached_tokens is None
    finally:
        r.aengine.shutdown()


def test_events_drained_after_the_wait_ran_out_still_reach_the_next_report(make_engine, monkeypatch):
    """A stats poll that gives up on a busy engine thread must not lose the events the engine drains
    later (they were returned to a caller that had already left): the next report carries them."""
    eng = make_engine("tiny")
    eng.kv.cache.record_events = True
    eng.generate([list(range(40, 110))], SamplingParams(max_new_tokens=2))  # stores 4 blocks
    r = _replica(eng)
    try:
        monkeypatch.setattr(llm_server, "EVENTS_WAIT_S", 0.2)
        busy = threading.Event()
        threading.Thread(target=r.aengine.call, args=(lambda e: (busy.set(), time.sleep(1.0)),), daemon=True).start()
        busy.wait(5)
        r._collect_events()  # times out: the engine is busy
        time.sleep(1.5)  # the engine gets to the drain and fills the buffers itself
        with r._events_lock:
            assert list(r._route_events.values()) == [True] * 4 and not r._overflow
    finally:
        r.aengine.shutdown()


def test_a_report_carries_each_blocks_net_change_since_the_last(make_engine):
    # stored then evicted within one stats period: reported as two lists, the routers applied the
    # eviction first and the store after, and counted on blocks the replica no longer had
    eng, r = _recording(make_engine)
    try:
        _generate(r, [list(range(40, 110))], SamplingParams(max_new_tokens=1))  # stores 4 blocks
        _evict_all(r)
        cache = r.engine.kv.cache
        chain = block_hashes(list(range(40, 110)), cache.block_size, cache.model_id)[:4]
        report = r.record_routing_stats()  # (hashes packed as hex: a list of ints cost Serve's controller more)
        assert report["stored"] == "" and list(PackedHashes(report["removed"])) == chain
        _generate(r, [list(range(40, 110))], SamplingParams(max_new_tokens=1))  # and back again
        report = r.record_routing_stats()
        assert list(PackedHashes(report["stored"])) == chain and report["removed"] == ""
    finally:
        r.aengine.shutdown()


def test_health_check_fails_when_the_engine_loop_hangs(make_engine):
    """A step that never returns (a stuck device, a deadlock) leaves the thread alive: the watchdog must
    still fail the health check so Serve replaces the replica."""
    from app.config import Settings

    r = _replica(make_engine("tiny"))
    r.settings = Settings(engine_stall_timeout_s=0.3)
    release = threading.Event()
    try:
        r.check_health()  # idle: the loop comes round every 50 ms
        threading.Thread(target=r.aengine.call, args=(lambda e: release.wait(5),), daemon=True).start()
        time.sleep(0.8)
        try:
            r.check_health()
            raise AssertionError("a hung engine loop passed the health check")
        except RuntimeError as e:
            assert "stuck" in str(e)
        release.set()
        deadline = time.monotonic() + 10
        while r.aengine.stalled_s() > 0.3 and time.monotonic() < deadline:  # a loaded machine may be slow
            time.sleep(0.05)
        r.check_health()  # came round again: healthy
    finally:
        release.set()
        r.aengine.shutdown()


def test_autoscaling_stats_report_prefixes_computed_again_and_the_working_set(make_engine):
    """What the cache-aware autoscaling policy reads: prompt and recomputed tokens per second since the
    last poll, and the blocks hit within the window. Three 5-block prompts cycle through an 8-block
    pool: after the first round every prompt is computed again soon after its eviction."""
    eng = make_engine("tiny", max_batch_total_tokens=128)
    r = _replica(eng)
    r._autoscaling_prev = None
    prompts = [[k * 60 + j for j in range(80)] for k in (1, 2, 3)]  # the tiny vocabulary: 320 ids
    try:
        first = r.record_autoscaling_stats()
        assert first["prompt_tps"] == first["recompute_tps"] == 0.0 and first["total_blocks"] == 8.0
        for _ in range(3):
            for p in prompts:
                _generate(r, [p], SamplingParams(max_new_tokens=1))
        time.sleep(0.05)
        s = r.record_autoscaling_stats()
        assert s["prompt_tps"] > 0 and s["recompute_tps"] / s["prompt_tps"] > 0.5, s
        assert s["ongoing"] == 0.0 and s["kv_usage"] == 0.0 and s["hot_blocks"] == 0.0  # nothing ever hit
        _generate(r, [prompts[2] + [7]], SamplingParams(max_new_tokens=1))  # the last prompt is still cached
        s = r.record_autoscaling_stats()
        assert s["hot_blocks"] == 5.0 and s["recompute_tps"] == 0.0, s
        # the working set's sketch goes to the hub, whose count of the fleet's distinct blocks comes back
        assert r._hot_sketch == sorted(eng.kv.cache.match(prompts[2] + [7], hit=False).hashes)
        r._hub = types.SimpleNamespace(call=lambda method, *args, **kw: getattr(store, method)(*args))
        clock = [0.0]
        store = SnapshotStore(clock=lambda: clock[0])
        store.push("B", {})
        store.hot_union("B", r._hot_sketch[:2] + [1])  # another replica holds 2 of these and one more
        clock[0] += 5.0  # (the hub merges the sketches every few seconds)
        r._hot_sketch_pushed_at = float("-inf")
        r._push_hot_sketch()
        assert r.record_autoscaling_stats()["fleet_hot_blocks"] == 6.0
    finally:
        r.aengine.shutdown()


def test_the_working_set_is_counted_a_slice_per_step_while_serving(make_engine, monkeypatch):
    """A whole-tree walk would hold the engine thread (~40 ms per 100k nodes) at every autoscaling poll:
    while requests run, the engine reports its last complete count and walks a slice per step."""
    import engine.llm_engine as llm_engine

    monkeypatch.setattr(llm_engine, "HOT_WALK_NODES_PER_STEP", 1)
    eng = make_engine("tiny")
    a, b = list(range(40, 120)), list(range(140, 220))  # 5 blocks each
    eng.generate([a, b], SamplingParams(max_new_tokens=1))
    eng.generate([a + [7]], SamplingParams(max_new_tokens=1))  # a's 5 blocks are hit
    assert eng.hot_blocks(60.0) == 5  # idle: counted at once
    eng.generate([b + [7]], SamplingParams(max_new_tokens=1))
    rid = eng.add_request(list(range(240, 260)), SamplingParams(max_new_tokens=30, ignore_eos=True))
    eng.step()
    assert eng.hot_blocks(60.0) == 5  # busy: the last count, and a new walk starts
    seen = []
    while eng.has_work():
        eng.step()
        seen.append(eng._hot)
        if eng._hot_walk is None:
            break
    assert seen[-1] == 10 and seen.count(5) >= 2  # one node per step: the new count came steps later
    assert eng.hot_blocks(60.0) == 10
    eng.abort(rid)


class HotDirectory(FakeDirectory):
    """Hands out ``prefixes`` (hottest first) as the directory's top k, within the token budget."""

    def __init__(self, model: str, prefixes: list[list[int]]):
        super().__init__(model)
        self.prefixes, self.budgets = prefixes, []

    def top_k(self, k, token_budget=None, max_tokens=None):
        import types

        self.budgets.append(token_budget)
        self.max_tokens = max_tokens
        out, total = [], 0
        for p in [p for p in self.prefixes if max_tokens is None or len(p) <= max_tokens][:k]:
            if token_budget is not None and total + len(p) > token_budget:
                break
            out.append(types.SimpleNamespace(tokens=p))
            total += len(p)
        return out


def _warming(engine, prefixes, timeout_s: float = 300.0) -> LLMServer:
    import types

    r = _replica(engine)
    r.directory = HotDirectory(engine.kv.cache.model_id, prefixes)
    r.settings = types.SimpleNamespace(warmup_top_k=16, warmup_token_budget=65536, warmup_timeout_s=timeout_s)
    return r


def _prefix(i: int) -> list[int]:
    """96 tokens (6 blocks) of the tiny model's vocabulary, a different first token for each ``i``."""
    return [3 + i] + [3 + (13 * j + 29 * i) % 316 for j in range(95)]


def _held(engine, tokens) -> int:
    return len(engine.kv.cache.match(tokens, max_blocks=len(tokens) // 16, count=False, hit=False).blocks)


def test_start_up_warm_up_keeps_to_the_pool_and_the_hottest_prefixes_stay(make_engine):
    """Past the pool, the later prefixes evicted the earlier ones: the hottest, queued first, went."""
    eng = make_engine("tiny", max_batch_total_tokens=512)  # 32 blocks of 16
    prefixes = [_prefix(i) for i in range(8)]  # 6 blocks each, 48 in all
    r = _warming(eng, prefixes)
    try:
        report = r._warm_up()
        assert r.directory.budgets == [int(0.75 * eng.kv.capacity_tokens)]
        assert r.directory.max_tokens == min(eng.max_input_tokens, eng.max_total_tokens)  # (longer: refused)
        assert report["prefixes"] == 4 and not report.get("error")
        assert [_held(eng, p) for p in prefixes[:4]] == [6] * 4  # the hottest are cached, in full
        assert [list(t) for t, _ in r._pending_records.values()] == prefixes[:4]  # recorded as held, queued hottest first
    finally:
        r.aengine.shutdown()


def test_a_warm_up_past_its_deadline_or_failing_starts_the_replica_cold(make_engine, monkeypatch):
    """Warm-up ran in __init__ with no deadline, and an engine error there failed the replica: Serve
    never gives up on a start-up, so a stuck one counted toward the fleet's size for good."""
    eng = make_engine("tiny", max_batch_total_tokens=512)
    prefixes = [_prefix(i) for i in range(2)]
    r = _warming(eng, prefixes, timeout_s=1e-9)
    try:
        report = r._warm_up()
        assert "--warmup-timeout-s" in report["error"] and report["prefixes"] == 0
        assert not eng.has_work() and not eng.requests and not r._pending_records
    finally:
        r.aengine.shutdown()
    eng2 = make_engine("tiny", max_batch_total_tokens=512)
    r = _warming(eng2, prefixes)
    monkeypatch.setattr(eng2, "step", lambda: (_ for _ in ()).throw(RuntimeError("device lost")))
    try:
        report = r._warm_up()
        assert report["error"] == "device lost" and not eng2.has_work() and not eng2.requests
    finally:
        r.aengine.shutdown()
    # but records that failed their check are no cold start: the replica would serve on them (one block
    # given to two requests); it fails, as its engine loop does over them, and Serve starts another
    import pytest

    from engine.llm_engine import BooksBroken

    eng3 = make_engine("tiny", max_batch_total_tokens=512)
    r = _warming(eng3, prefixes)
    monkeypatch.setattr(eng3, "step", lambda: (_ for _ in ()).throw(BooksBroken("a block held twice")))
    try:
        with pytest.raises(BooksBroken):
            r._warm_up()
    finally:
        r.aengine.shutdown()


def test_a_slow_redis_does_not_hold_the_background_thread(make_engine):
    """The flush looped until every waiting record was written: with Redis slow inside its timeouts it
    never returned, and the metrics pushes on the same thread (what /health reads) stopped."""
    r = _replica(make_engine("tiny"))

    class Slow(FakeDirectory):
        def record(self, replica, tokens, hits=1):
            time.sleep(0.1)
            return super().record(replica, tokens)

    r.directory = Slow("m")
    try:
        for i in range(30):
            r._queue_record([i] * 32)
        t0 = time.monotonic()
        r._flush_directory()
        assert time.monotonic() - t0 < 1.0 and 0 < len(r._pending_records) < 30
    finally:
        r.aengine.shutdown()


def test_a_holder_removal_redis_did_not_run_is_tried_again(make_engine):
    eng, r = _recording(make_engine, directory=True)
    prompt = PROMPT
    try:
        _generate(r, [prompt], SamplingParams(max_new_tokens=1))
        r._queue_record(prompt[:64])
        r._flush_directory()
        assert len(r.directory.held) == 1
        _evict_all(r)
        r._collect_events()
        r.directory.available = False  # the removal fails (or is skipped in backoff)
        r._flush_directory()
        assert len(r._recorded) == 1  # kept: dropping it here left the holder in Redis for an hour
        r.directory.available = True
        r._flush_directory()
        assert not r._recorded and not r.directory.held
    finally:
        r.aengine.shutdown()


def test_the_replicas_record_of_its_directory_holdings_is_bounded_by_its_pool(make_engine):
    # a record whose eviction had left the event window before a flush judged it (Redis slow or down
    # meanwhile) stayed in the replica's bookkeeping, and its holder in Redis, for good
    eng, r = _recording(make_engine, directory=True)
    try:
        cap = eng.kv.allocator.num_blocks
        prefixes = [list(range(1000 + 16 * i, 1016 + 16 * i)) for i in range(3 * cap)]
        for p in prefixes:
            r._queue_record(p)
        r._flush_directory()
        assert len(r._recorded) == cap and r.directory.held == set(r._recorded)
        r._queue_record(prefixes[0])  # recorded again: the newest, kept over the least recently recorded
        r._queue_record(list(range(5000, 5016)))
        r._flush_directory()
        newest = list(r._recorded)[-2:]
        assert len(r._recorded) == cap and r.directory.held == set(r._recorded)
        assert newest == [block_hashes(p, 16, eng.kv.cache.model_id)[-1] for p in (prefixes[0], list(range(5000, 5016)))]
        # a replica that is stopping writes nothing more: its holdings are forgotten as it goes, and a
        # flush still running past that would name it a holder again
        r._stop.set()
        writes = len(r.directory.writes)
        r._queue_record(list(range(6000, 6016)))
        r._flush_directory()
        assert len(r.directory.writes) == writes
    finally:
        r.aengine.shutdown()


def test_shutdown_tells_the_hub_and_the_directory_before_the_slow_engine_join():
    """Serve's force-kill can land during the engine's join (up to 10 s): the calls after it were lost."""
    import types

    calls = []
    r = object.__new__(LLMServer)
    r._stop = threading.Event()
    r.replica_id = "A"

    def stopped(rid):
        calls.append("hub")
        raise RuntimeError("the hub is gone")  # one failing does not skip the others

    r._hub = types.SimpleNamespace(handle=types.SimpleNamespace(stopped=types.SimpleNamespace(remote=stopped)))
    r.directory = types.SimpleNamespace(forget_replica=lambda rid: calls.append("directory"))
    r._hub.call = lambda method, *args, **kw: calls.append(method)
    r.aengine = types.SimpleNamespace(shutdown=lambda: calls.append("engine"), call=lambda fn, timeout: {})
    r._background = types.SimpleNamespace(join=lambda timeout: calls.append("background"))
    r.__del__()
    # the background thread first: a push or a record of its own after them would undo them; the last
    # counts after the engine's end (what it aborted)
    assert calls == ["background", "hub", "directory", "engine", "push"] and r._stop.is_set()


def test_a_stopping_replica_hands_the_hub_its_last_counts_and_what_the_stop_aborted(make_engine):
    """Counts reached the hub only through the push each second: a stop lost what finished since the last
    one, and the requests it aborted were never counted (each scale-down)."""
    import asyncio

    from deployments.metrics import render

    store = SnapshotStore()
    eng = make_engine("tiny", max_batch_total_tokens=1024)
    r = _replica(eng)
    r.warmup_report = {"prefixes": 0, "tokens": 0}
    r._hub = types.SimpleNamespace(call=lambda method, *args, **kw: getattr(store, method)(*args),
                                   handle=types.SimpleNamespace(stopped=types.SimpleNamespace(remote=store.stopped)))
    r._background = threading.Thread(target=lambda: None)
    r._background.start()
    store.push("A", r._snapshot_now())  # the background thread's last push, before any request

    async def run() -> None:
        params = SamplingParams(max_new_tokens=3, ignore_eos=True)
        for _ in range(2):
            async for _ev in r.aengine.generate(PROMPT, params):
                pass
        long = r.aengine.generate(PROMPT, SamplingParams(max_new_tokens=900, ignore_eos=True))
        await long.__anext__()  # running when Serve stops the replica
        await asyncio.to_thread(r.__del__)
        rest = [ev async for ev in long]
        assert rest[-1].finished and rest[-1].error  # the stop ended it

    asyncio.run(run())
    text = render(*store.export())
    assert 'radixserve_requests_total{replica="all"} 2' in text
    assert 'radixserve_requests_aborted_total{replica="all"} 1' in text
    assert not store.snapshots()  # retired, not a live series again


def test_a_replica_whose_engine_crashed_is_no_live_engine_for_health(make_engine):
    """After a crash its background thread pushed on, with the counts read after the engine's end: the hub
    counted a live engine and /health answered 200 until Serve replaced the replica."""
    import asyncio

    store = SnapshotStore()
    eng = make_engine("tiny", max_batch_total_tokens=1024)
    r = _replica(eng)
    r.warmup_report = {"prefixes": 0, "tokens": 0}
    r._hub = types.SimpleNamespace(call=lambda method, *args, **kw: getattr(store, method)(*args))
    r._flush_warned_at = 0.0
    store.push("A", r._snapshot_now())
    assert store.fresh(10.0) == 1

    def boom():
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    eng.step = boom

    async def one() -> None:
        async for _ev in r.aengine.generate(PROMPT, SamplingParams(max_new_tokens=3)):
            pass

    asyncio.run(one())
    assert not r.aengine.alive
    loop = threading.Thread(target=r._background_loop)
    loop.start()
    loop.join(5)
    assert not loop.is_alive() and store.fresh(10.0) == 0  # (its series ended: retired, not live)
    store.push("A", r._snapshot_now())  # (a late push of its own counts, but brings no live series back)
    assert store.fresh(10.0) == 0 and not store.snapshots()
