"""Hot-prefix directory against a real redis-server."""

from __future__ import annotations

import time
import uuid

import pytest

from app.local_redis import LocalRedis, free_port
from cache.directory import HotPrefixDirectory
from cache.hashing import block_hashes, pack_tokens

BS = 16


@pytest.fixture
def d(redis_server):
    directory = HotPrefixDirectory(redis_server.url, deployment=f"t{uuid.uuid4().hex[:8]}", model="m", block_size=BS)
    yield directory
    directory.clear()


def toks(seed: int, n: int = 64) -> list[int]:
    return [(seed * 7919 + i) % 30000 for i in range(n)]


def test_record_top_k_holders(d):
    a, b = toks(1), toks(2, 40)  # b: 2 whole blocks kept, 8 tokens dropped
    ha = d.record("r1", a, hits=3)
    hb = d.record("r2", b)
    assert ha == block_hashes(a, BS, "m")[-1] and hb == block_hashes(b[:32], BS, "m")[-1]
    top = d.top_k(5)
    assert [p.hash for p in top] == [ha, hb]
    assert top[0].tokens == a and top[1].tokens == b[:32]
    assert top[0].score == pytest.approx(3, rel=0.01)
    d.record("r2", a)
    assert sorted(d.holders(ha)) == ["r1", "r2"]
    assert [p.hash for p in d.top_k(1, token_budget=48)] == [hb]  # a does not fit 48 tokens


def test_hits_decay_with_time(d):
    now = time.time()
    ha = d.record("r1", toks(1), hits=3, now=now)
    hb = d.record("r1", toks(2), hits=1, now=now + 3 * d.half_life_s)  # 3 half-lives later: worth 8
    assert [p.hash for p in d.top_k(2)] == [hb, ha]


def test_entries_expire(redis_server):
    d = HotPrefixDirectory(redis_server.url, deployment=f"ttl{uuid.uuid4().hex[:6]}", model="m", ttl_s=1)
    h = d.record("r1", toks(3))
    assert d.top_k(3)
    time.sleep(2.1)
    assert d.top_k(3) == [] and d.holders(h) == []


def test_forget_replica_drops_only_its_holdings(d):
    h = d.record("r1", toks(4))
    d.record("r2", toks(4))
    h2 = d.record("r1", toks(5))
    assert d.forget_replica("r1") == 2
    assert d.holders(h) == ["r2"] and d.holders(h2) == []
    d.drop_holder("r2", [h])
    assert d.holders(h) == []


def test_salted_and_short_prefixes_are_never_written(d):
    assert d.record("r1", toks(6), cache_salt="tenant-a") is None
    assert d.record("r1", toks(6, 15)) is None
    assert d.top_k(5) == []


def test_garbage_in_the_namespace_is_skipped(d):
    r = d._r
    good = d.record("r1", toks(7))
    r.zadd(d.ns + "hot", {"not-a-number": 1e9, "12345": 1e9, str(good + 1): 1e9, "999": float("inf")})
    r.hset(d.ns + "p:12345", mapping={"tokens": b"\x01\x02\x03", "blocks": 1})  # not uint32s
    r.hset(d.ns + f"p:{good + 1}", mapping={"tokens": pack_tokens(toks(8)), "blocks": 4})  # wrong hash
    r.hset(d.ns + "p:999", mapping={"nothing": 1})
    top = d.top_k(10)
    assert [p.hash for p in top] == [good]
    assert d.skipped >= 3


def test_redis_down_never_raises_or_hangs():
    d = HotPrefixDirectory(f"redis://127.0.0.1:{free_port()}/0", model="m")
    t0 = time.monotonic()
    assert d.record("r1", toks(1)) is None
    assert d.top_k(4) == [] and d.holders(1) == [] and d.forget_replica("r1") == 0
    assert time.monotonic() - t0 < 3
    assert d.errors >= 1 and not d.ping()


def test_directory_resumes_after_redis_restarts():
    port = free_port()
    server = LocalRedis(port=port)
    d = HotPrefixDirectory(f"redis://127.0.0.1:{port}/0", model="m")
    assert d.record("r1", toks(1)) is not None
    server.stop()
    assert d.record("r1", toks(2)) is None and d.errors >= 1
    server = LocalRedis(port=port)
    try:
        deadline = time.monotonic() + 35
        while d.record("r1", toks(3)) is None and time.monotonic() < deadline:
            time.sleep(0.2)
        assert [p.tokens for p in d.top_k(3)] == [toks(3)]
    finally:
        server.stop()
