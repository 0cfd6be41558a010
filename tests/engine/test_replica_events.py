"""The replica's hand-over of cache events to the routers (no Serve needed: the buffers only)."""

from __future__ import annotations

import collections
import threading
import time

import deployments.llm_server as llm_server
from deployments.llm_server import LLMServer
from engine.async_engine import AsyncEngine
from engine.sequence import SamplingParams


def _replica(engine) -> LLMServer:
    r = object.__new__(LLMServer)  # the parts of __init__ the event hand-over uses
    r.engine, r.aengine = engine, AsyncEngine(engine)
    r._events_lock = threading.Lock()
    r._route_events, r._records_lock = collections.OrderedDict(), threading.Lock()
    r._overflow, r._recorded, r._stats_seq = False, set(), 0
    r._pending_records, r._pending_tokens, r._last_event = collections.deque(), 0, collections.OrderedDict()
    r._cut, r.directory, r.replica_id = False, None, "A"
    return r


class FakeDirectory:
    """What the replica calls on HotPrefixDirectory, Redis up or down, without Redis."""

    max_prefix_tokens = 32768

    def __init__(self, model: str, block_size: int = 16):
        self.model, self.block_size, self.available = model, block_size, True
        self.held: set[int] = set()

    def record(self, replica, tokens):
        from cache.hashing import block_hashes

        h = block_hashes(list(tokens), self.block_size, self.model)[-1]
        self.held.add(h)
        return h

    def drop_holder(self, replica, hashes):
        self.held.difference_update(hashes)


def test_a_prefix_evicted_before_its_record_reaches_the_directory_is_taken_back(make_engine):
    # the eviction event used to be dropped when it came before the record (a 1 s flush later), and
    # the replica stayed the prefix's holder in Redis, and in its own bookkeeping, for good
    eng = make_engine("tiny", max_batch_total_tokens=256)
    eng.kv.cache.record_events = True
    r = _replica(eng)
    r.directory = FakeDirectory(eng.kv.cache.model_id)
    prompt = list(range(40, 110))
    try:
        eng.generate([prompt], SamplingParams(max_new_tokens=1))
        r._queue_record(prompt[:64])  # the request proved 64 tokens shared: the record waits for the flush
        r.aengine.call(lambda e: e.kv.allocator.free(e.kv.cache.evict(10**6)))  # pressure: the cache lets go
        r._collect_events()  # the eviction is seen first (a routing stats poll)
        r._flush_directory()
        assert not r._recorded and not r.directory.held
        # the usual order: recorded, then evicted, then the next flush drops it
        eng.generate([prompt], SamplingParams(max_new_tokens=1))
        r._queue_record(prompt[:64])
        r._flush_directory()
        assert len(r._recorded) == 1 and r.directory.held == r._recorded
        r.aengine.call(lambda e: e.kv.allocator.free(e.kv.cache.evict(10**6)))
        r._flush_directory()
        assert not r._recorded and not r.directory.held
        # evicted, computed again and recorded, all between two flushes: held (an early version of
        # this fix applied the eviction after the record and dropped it)
        eng.generate([prompt], SamplingParams(max_new_tokens=1))
        r._collect_events()
        r.aengine.call(lambda e: e.kv.allocator.free(e.kv.cache.evict(10**6)))
        eng.generate([prompt], SamplingParams(max_new_tokens=1))
        r._queue_record(prompt[:64])
        r._flush_directory()
        assert len(r._recorded) == 1 and r.directory.held == r._recorded
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
        assert [t[0] for t in r._pending_records] == [7, 8, 9] and r._pending_tokens == 96
        r.directory.available = True
        r._flush_directory()
        assert len(r.directory.held) == 3 and r._pending_tokens == 0 and not r._pending_records
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
    eng = make_engine("tiny", max_batch_total_tokens=256)
    eng.kv.cache.record_events = True
    r = _replica(eng)
    try:
        eng.generate([list(range(40, 110))], SamplingParams(max_new_tokens=1))  # stores 4 blocks
        r.aengine.call(lambda e: e.kv.allocator.free(e.kv.cache.evict(10**6)))
        report = r.record_routing_stats()
        assert report["stored"] == [] and len(report["removed"]) == 4
        eng.generate([list(range(40, 110))], SamplingParams(max_new_tokens=1))  # and back again
        report = r.record_routing_stats()
        assert len(report["stored"]) == 4 and report["removed"] == []
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
                eng.generate([p], SamplingParams(max_new_tokens=1))
        time.sleep(0.05)
        s = r.record_autoscaling_stats()
        assert s["prompt_tps"] > 0 and s["recompute_tps"] / s["prompt_tps"] > 0.5, s
        assert s["ongoing"] == 0.0 and s["kv_usage"] == 0.0 and s["hot_blocks"] == 0.0  # nothing ever hit
        eng.generate([prompts[2] + [7]], SamplingParams(max_new_tokens=1))  # the last prompt is still cached
        s = r.record_autoscaling_stats()
        assert s["hot_blocks"] == 5.0 and s["recompute_tps"] == 0.0, s
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
