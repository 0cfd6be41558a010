"""Hot-prefix directory against a real redis-server."""

from __future__ import annotations

import time
import uuid
from pathlib import Path

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


def test_drop_holder_says_whether_the_removal_ran(d):
    """The replica forgets an evicted prefix only once Redis has: it could not tell a failure (or a skip
    while backing off) from success, and the holder entry stayed for up to the TTL."""
    h = d.record("r1", toks(80))
    down = HotPrefixDirectory(f"redis://127.0.0.1:{free_port()}/0", deployment=d.deployment, model="m", block_size=BS)
    assert down.drop_holder("r1", [h]) is False and down.errors == 1  # failed
    assert down.drop_holder("r1", [h]) is False and down.errors == 1  # skipped: backing off
    assert d.holders(h) == ["r1"]
    assert d.drop_holder("r1", [h]) is True and d.holders(h) == []
    assert d.drop_holder("r1", []) is True  # nothing to remove


def test_a_rescale_cannot_slip_between_weighing_a_hit_and_adding_it(redis_server, d):
    """The script weighed a hit (2 ** exp) and a later round trip added it: another replica's rescale in
    between left this hit worth 2 ** 60 where a new hit is worth 1, on top of the ranking for hours."""
    other = HotPrefixDirectory(redis_server.url, deployment=d.deployment, model="m", block_size=BS)
    now, half_life = time.time(), d.half_life_s
    d.record("r1", toks(70), now=now)  # sets the epoch
    send, raced = d._r.execute_command, []

    def then_the_other_replica_rescales(*args, **kwargs):
        out = send(*args, **kwargs)
        if args[0] == "EVALSHA" and not raced:
            raced.append(other.record("r2", toks(71), now=now + 61 * half_life))
        return out

    d._r.execute_command = then_the_other_replica_rescales
    mine = d.record("r1", toks(72), now=now + 60 * half_life)  # worth 2 ** 60, then rescaled by 2 ** -61
    scores = {int(m): s for m, s in d._r.zrange(d.ns + "hot", 0, -1, withscores=True)}
    assert raced and scores[raced[0]] == pytest.approx(1.0)
    assert scores[mine] == pytest.approx(0.5)


def test_without_scripting_a_rescale_between_reading_the_epoch_and_adding_is_retried(redis_server, d,
                                                                                       monkeypatch):
    """The same race on the path for Redis users without @scripting: one command at a time, it weighed
    the hit by the epoch it had read before another replica's rescale."""
    from cache import directory

    other = HotPrefixDirectory(redis_server.url, deployment=d.deployment, model="m", block_size=BS)
    now, half_life = time.time(), d.half_life_s
    d.record("r1", toks(70), now=now)
    d._scripting = False
    read, raced = directory._epoch, []

    def then_the_other_replica_rescales(*args):
        out = read(*args)
        if not raced:
            raced.append(other.record("r2", toks(71), now=now + 61 * half_life))
        return out

    monkeypatch.setattr(directory, "_epoch", then_the_other_replica_rescales)
    mine = d.record("r1", toks(72), now=now + 60 * half_life)
    scores = {int(m): s for m, s in d._r.zrange(d.ns + "hot", 0, -1, withscores=True)}
    assert raced and scores[raced[0]] == pytest.approx(1.0)
    assert scores[mine] == pytest.approx(0.5)


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
    # dropped from the ranking, so they are not fetched and checked again on every read
    assert [m.decode() for m in r.zrange(d.ns + "hot", 0, -1)] == [str(good)]


def test_an_entry_longer_than_the_prefix_cap_is_never_hashed_or_returned(d):
    long = toks(9, 2 * d.max_prefix_tokens)
    h = block_hashes(long, BS, "m")[-1]  # a valid entry, as a writer without the cap would store it
    d._r.zadd(d.ns + "hot", {str(h): 1e9})
    d._r.hset(d.ns + f"p:{h}", mapping={"tokens": pack_tokens(long), "blocks": len(long) // BS})
    assert d.top_k(3) == [] and d.skipped == 1


def test_the_ranking_keeps_only_the_hottest(redis_server):
    d = HotPrefixDirectory(redis_server.url, deployment=f"cap{uuid.uuid4().hex[:6]}", model="m", max_hot=3)
    try:
        now = time.time()
        hashes = [d.record(f"r{i % 2}", toks(20 + i), hits=i + 1, now=now) for i in range(5)]
        d.record("r1", toks(20), hits=1, now=now)  # (dropped again at once: the coldest)
        assert d._r.zcard(d.ns + "hot") == 3
        # nor does a holder's own set keep them (a long-lived replica's would grow with every prefix)
        held = d._r.smembers(d.ns + "r:r0") | d._r.smembers(d.ns + "r:r1")
        assert sorted(int(h) for h in held) == sorted(hashes[2:])
        assert [p.hash for p in d.top_k(5)] == hashes[:1:-1]  # the three hottest, hottest first
        # what leaves the ranking leaves Redis: its tokens would otherwise stay for their whole TTL
        assert sorted(k.decode().rsplit(":", 2)[-2] for k in d._r.scan_iter(match=d.ns + "*:*")
                      if k.decode().rsplit(":", 2)[-2] in ("p", "h")) == ["h"] * 3 + ["p"] * 3
    finally:
        d.clear()


def test_old_scores_are_rescaled_when_the_epoch_moves(d):
    now = time.time()
    ha = d.record("r1", toks(30), hits=1, now=now)
    later = now + 61 * d.half_life_s  # past the rescale point: a hit now weighs 2**61 before rescaling
    d.record("r1", toks(31), hits=1, now=later)
    d.record("r2", toks(32), hits=1, now=later)
    scores = dict(d._r.zrange(d.ns + "hot", 0, -1, withscores=True))
    assert scores[str(ha).encode()] == pytest.approx(2.0 ** -61, rel=1e-6)  # the old hit, rescaled once
    assert float(d._r.get(d.ns + "epoch")) == pytest.approx(later)


@pytest.mark.parametrize("scripting", [True, False])
def test_a_replica_whose_clock_is_behind_weighs_its_hits_on_redis_clock(redis_server, d, scripting, monkeypatch):
    """A host clock more than a half-life behind saw the shared decay epoch as garbage from the future:
    each of its writes reset the epoch and brought the ranking down to one hit, and its holder entries
    expired 20 minutes early in everyone else's eyes."""
    import cache.directory as directory

    hot, warm = d.record("r1", toks(80), hits=50), d.record("r1", toks(81), hits=10)
    real = time.time
    monkeypatch.setattr(directory.time, "time", lambda: real() - 1200)  # 2 half-lives behind
    behind = HotPrefixDirectory(redis_server.url, deployment=d.deployment, model="m", block_size=BS)
    behind._scripting = scripting
    new = behind.record("r2", toks(82), hits=20)
    monkeypatch.setattr(directory.time, "time", real)
    assert [p.hash for p in d.top_k(3)] == [hot, new, warm]  # was [new, hot, warm]: 20 > 1 after the reset
    assert [p.score for p in d.top_k(3)] == pytest.approx([50, 20, 10], rel=0.01)
    expiry = d._r.zscore(d.ns + f"h:{new}", "r2")
    assert expiry == pytest.approx(time.time() + d.ttl_s, abs=5)


def test_a_host_clock_that_steps_after_its_measure_moves_nothing(redis_server, d, monkeypatch):
    """The offset to Redis's clock was kept against the wall clock: a step back of 2 hours within the 5
    minutes between measures reset the shared epoch (the ranking flattened) and wrote holders expired."""
    import cache.directory as directory

    hot, warm = d.record("r1", toks(90), hits=50), d.record("r1", toks(91), hits=1)
    stepped = HotPrefixDirectory(redis_server.url, deployment=d.deployment, model="m", block_size=BS)
    measured = stepped.record("r2", toks(92), hits=2)  # (measured its clock here)
    real = time.time
    monkeypatch.setattr(directory.time, "time", lambda: real() - 7200)
    new = stepped.record("r2", toks(93), hits=20)
    monkeypatch.setattr(directory.time, "time", real)
    assert [p.hash for p in d.top_k(4)] == [hot, new, measured, warm]
    assert d.top_k(4)[0].score == pytest.approx(50, rel=0.01)
    assert "r2" in d.holders(new)


@pytest.mark.parametrize("scripting", [True, False])
def test_a_lost_epoch_does_not_freeze_the_ranking(d, scripting):
    """Scores weighed against an epoch that was then lost (evicted, replaced) stayed up to 2**60 heavier than
    any new hit: a prefix with 100 fresh hits ranked below three stale ones, and was the one dropped."""
    d._scripting = scripting
    now = time.time()
    old = [d.record("r1", toks(60 + i), hits=1, now=now) for i in range(3)]
    later = now + 50 * d.half_life_s  # each old hit weighs 2**50 against a hit at the epoch now
    recent = d.record("r1", toks(59), hits=1, now=later)
    d._r.delete(d.ns + "epoch")
    new = d.record("r2", toks(70), hits=100, now=later + 1)
    top = [p.hash for p in d.top_k(5)]
    assert top[:2] == [new, recent] and set(top[2:]) == set(old)  # (the others keep their order below it)


def test_a_key_of_another_type_in_the_namespace_is_repaired_not_retried_for_good(d):
    """A prefix's key holding a string failed every read of the ranking (WRONGTYPE) and every write of
    that prefix, as if Redis were down: the replica's queue of records stopped at it for good."""
    r = d._r
    good = d.record("r1", toks(80))
    bad = block_hashes(toks(81), BS, "m")[-1]
    r.zadd(d.ns + "hot", {str(bad): 1e9})
    r.set(d.ns + f"p:{bad}", "not a hash")
    assert [p.hash for p in d.top_k(5)] == [good] and d.errors == 0
    r.set(d.ns + f"h:{bad}", "not a zset")
    r.set(d.ns + "r:r2", "not a set")
    assert d.record("r2", toks(81), hits=3) == bad and d.errors == 0
    assert {p.hash for p in d.top_k(5)} == {good, bad} and d.holders(bad) == ["r2"]
    # reading holders, dropping one, forgetting a replica: each counted as Redis down (every router then
    # learned no holder at all for the back-off, and a warning every 5 s), and the key stayed
    for key in (f"h:{good}", f"h:{bad}", "r:r2"):
        r.set(d.ns + key, "left by hand")
    assert d.holders(good) == [] and d.holders(bad) == [] and d.errors == 0
    r.set(d.ns + f"h:{bad}", "again")
    assert d.drop_holder("r2", [bad]) and d.errors == 0
    r.sadd(d.ns + "r:r1", str(bad))
    r.set(d.ns + f"h:{bad}", "and again")
    assert d.forget_replica("r1") == 2 and d.errors == 0  # (good, recorded by r1, and bad)
    assert d.forget_replica("r2") == 0 and d.errors == 0  # (its r: key held a string)
    assert all(r.type(d.ns + k) in (b"none", b"zset", b"set") for k in (f"h:{good}", f"h:{bad}", "r:r1", "r:r2"))


def test_prefixes_longer_than_a_replica_takes_leave_their_places_to_the_next(d):
    """Hot prefixes recorded under a larger --max-input-tokens filled k and each was refused at warm-up:
    a replica warmed nothing, and the prefixes it could take were never read."""
    long = [d.record("r1", toks(200 + i, 64), hits=100 - i) for i in range(3)]
    short = [d.record("r1", toks(300 + i, 16), hits=10 - i) for i in range(3)]
    assert [p.hash for p in d.top_k(3)] == long
    assert [p.hash for p in d.top_k(3, max_tokens=32)] == short
    assert [p.hash for p in d.top_k(4, token_budget=100, max_tokens=64)] == long[:1] + short[:2]


def test_known_prefixes_come_without_their_tokens(d):
    """A router that had a prefix's block hashes read its payload again at every sync (64 of up to 128 KiB
    every 5 s, per ingress)."""
    a, b = d.record("r1", toks(400), hits=5), d.record("r1", toks(401), hits=3)

    def hgets() -> int:
        return int(d._r.info("commandstats").get("cmdstat_hget", {}).get("calls", 0))

    before = hgets()
    top = d.top_k(2, known={a})
    assert [(p.hash, len(p.tokens)) for p in top] == [(a, 0), (b, 64)] and hgets() - before == 1
    assert top[0].score == pytest.approx(5, rel=0.01)
    assert [p.hash for p in d.top_k(1, known={a})] == [a]  # (it counts toward k)


def test_top_k_fetches_only_the_payloads_it_can_return(d):
    """A page of 4 k entries was fetched whole before the budget was applied: 600 ranked 32k-token prefixes
    and a warm-up budget of two of them read 170 MB."""
    for i in range(40):
        d.record("r1", toks(100 + i, 256), hits=40 - i)

    def hgets() -> int:
        return int(d._r.info("commandstats").get("cmdstat_hget", {}).get("calls", 0))

    before = hgets()
    top = d.top_k(16, token_budget=600)
    assert [len(p.tokens) for p in top] == [256, 256] and hgets() - before == 2
    before = hgets()
    assert len(d.top_k(3)) == 3 and hgets() - before == 3


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


def test_the_private_redis_server_is_restarted_on_its_port_when_it_dies():
    server = LocalRedis(password="s3cret")  # as `radixserve serve` starts it: with a generated password
    try:
        d = HotPrefixDirectory(server.url, model="m")
        assert d.ping() and not server.restart_if_dead()
        assert "s3cret" not in server.shown_url and not HotPrefixDirectory(f"redis://127.0.0.1:{server.port}/0").ping()
        assert b"s3cret" not in Path(f"/proc/{server.proc.pid}/cmdline").read_bytes()  # ps shows the command line
        server.proc.kill()  # out of memory, or killed by hand
        server.proc.wait()
        assert server.restart_if_dead()
        deadline = time.monotonic() + 35  # the client waits out its backoff
        while not d.ping() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert d.ping() and d.record("r1", toks(1)) is not None
        assert not HotPrefixDirectory(f"redis://127.0.0.1:{server.port}/0").ping()  # still required
    finally:
        server.stop()


def test_a_restart_refuses_a_port_another_process_took():
    server = LocalRedis()
    other = None
    try:
        server.proc.kill()
        server.proc.wait()
        other = LocalRedis(port=server.port)  # someone else's server on the freed port
        with pytest.raises(RuntimeError, match="taken by another process"):
            server.restart_if_dead()
    finally:
        server.stop()
        if other is not None:
            other.stop()


def test_a_redis_user_without_scripting_still_records(redis_server, d):
    """Managed Redis often refuses EVAL (an ACL without @scripting): the directory falls back to plain
    commands instead of failing every write."""
    d._r.execute_command("ACL", "SETUSER", "noscript", "on", ">pw", "~*", "+@all", "-@scripting")
    try:
        limited = HotPrefixDirectory(f"redis://noscript:pw@127.0.0.1:{redis_server.port}/0",
                                     deployment=d.deployment, model="m", block_size=BS)
        now = time.time()
        old = limited.record("r1", toks(40), now=now)
        assert old is not None and not limited._scripting and limited.errors == 0
        new = limited.record("r1", toks(41), hits=2, now=now + 61 * limited.half_life_s)  # rescales
        assert new is not None
        scores = dict(d._r.zrange(d.ns + "hot", 0, -1, withscores=True))
        assert scores[str(old).encode()] == pytest.approx(2.0 ** -61, rel=1e-6)
        assert scores[str(new).encode()] == pytest.approx(2.0)  # added after the rescale, at its weight
    finally:
        d._r.execute_command("ACL", "DELUSER", "noscript")


def test_a_redis_user_without_time_still_records_on_the_hosts_clock(redis_server, d):
    """An ACL user without TIME (or a proxy that does not pass it on): the clock sync failed as an outage,
    backed off the write after it, and did so at every record, so nothing was ever recorded."""
    d._r.execute_command("ACL", "SETUSER", "notime", "on", ">pw", "~*", "+@all", "-time")
    try:
        limited = HotPrefixDirectory(f"redis://notime:pw@127.0.0.1:{redis_server.port}/0",
                                     deployment=d.deployment, model="m", block_size=BS)
        recorded = [limited.record("r1", toks(40 + i)) for i in range(3)]
        assert None not in recorded and limited.errors == 0 and limited.available
        assert {e.hash for e in limited.top_k(10)} >= set(recorded)
    finally:
        d._r.execute_command("ACL", "DELUSER", "notime")


@pytest.mark.parametrize("scripting", [True, False])
def test_a_garbage_epoch_is_replaced_and_recording_goes_on(d, scripting):
    """Another tool's value in the epoch key once failed every write for good, uncounted."""
    d._scripting = scripting
    for garbage in (b"garbage", b"nan", b"inf", b"1e20"):  # (far ahead: a warm-up's top_k once overflowed)
        d._r.set(d.ns + "epoch", garbage)
        now = time.time()
        h = d.record("r1", toks(50), now=now)
        assert h is not None and d.errors == 0 and d._scripting == scripting, garbage
        assert float(d._r.get(d.ns + "epoch")) == pytest.approx(now)
    assert d.top_k(1)[0].hash == h
    d._r.set(d.ns + "epoch", b"1e20")
    assert d.top_k(1)[0].hash == h  # read before any write repaired it


def test_a_passing_redis_refusal_does_not_turn_scripting_off(redis_server, d):
    """Out of memory (or CLUSTERDOWN, BUSY) is a failure like a lost connection: counted, backed off, and
    the atomic script is used again once Redis is well; only an ACL or a disabled EVAL turns it off."""
    r = d._r
    before = {k: r.config_get(k)[k] for k in ("maxmemory", "maxmemory-policy")}
    try:
        r.config_set("maxmemory-policy", "noeviction")
        r.config_set("maxmemory", 1)
        assert d.record("r1", toks(51)) is None and d.errors == 1 and d._scripting
    finally:
        for k, v in before.items():
            r.config_set(k, v)
    d._down_until = 0.0  # past the back-off
    assert d.record("r1", toks(51)) is not None and d._scripting


def test_fleets_of_other_block_sizes_keep_apart(redis_server, d):
    """Same deployment and model, other block size: other hashes. They used to share keys, and each
    dropped the other's entries from the ranking as foreign."""
    other = HotPrefixDirectory(redis_server.url, deployment=d.deployment, model="m", block_size=2 * BS)
    try:
        h = d.record("r1", toks(52))
        other.record("r9", toks(53))
        assert [p.hash for p in other.top_k(5)] != [h] and other.skipped == 0
        assert [p.hash for p in d.top_k(5)] == [h] and d.skipped == 0
    finally:
        other.clear()


def test_a_hot_prefixs_holder_set_does_not_keep_expired_holders(d):
    now = time.time()
    h = d.record("old", toks(60), now=now)
    d.record("new", toks(60), now=now + 2 * d.ttl_s)  # "old" never came back: its holding expired
    assert d._r.zrange(d.ns + f"h:{h}", 0, -1) == [b"new"]
    assert d.holders(h, now=now + 2 * d.ttl_s) == ["new"]


def test_the_private_redis_server_outlives_a_terminals_ctrl_c_but_not_its_parent():
    """A terminal's Ctrl-C reaches the whole foreground process group: the redis-server went at once,
    and the drain that `radixserve serve` then runs had no directory. It must still go when its parent
    does, however that ends."""
    import os
    import signal
    import subprocess
    import sys

    parent = ("import signal, sys, time\nfrom app.local_redis import LocalRedis\nr = LocalRedis()\n"
              "signal.signal(signal.SIGINT, lambda *_: None)  # (the CLI drains on Ctrl-C)\n"
              "print(r.proc.pid, flush=True)\nsys.stdin.readline()\nprint(r.proc.poll(), flush=True)\ntime.sleep(60)\n")
    p = subprocess.Popen([sys.executable, "-c", parent], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                         start_new_session=True)
    try:
        pid = int(p.stdout.readline())
        os.killpg(p.pid, signal.SIGINT)
        time.sleep(1)
        p.stdin.write("\n")
        p.stdin.flush()
        assert p.stdout.readline().strip() == "None"  # still running
    finally:
        p.kill()
        p.wait()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and _alive(pid):
        time.sleep(0.1)
    assert not _alive(pid), "the redis-server outlived its parent"


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_a_prefix_recorded_again_renews_its_tokens_without_sending_them(d):
    """Each request of a hot prefix used to write its tokens (up to 128 KiB) to Redis again."""
    r, t = d._r, toks(30, 256)
    h = d.record("r1", t)
    pkey = d.ns + f"p:{h}"
    r.hdel(pkey, "blocks")  # a mark: a write of the entry would bring the field back
    r.expire(pkey, 5)
    assert d.record("r1", t) == h
    assert r.hget(pkey, "blocks") is None  # not sent again
    assert r.ttl(pkey) > 5  # but renewed
    r.delete(pkey)  # gone meanwhile (dropped as cold by another writer, or flushed): sent again
    assert d.record("r2", t) == h
    assert [(p.hash, p.tokens) for p in d.top_k(1)] == [(h, t)]
    other = HotPrefixDirectory(d._url, deployment=d.deployment, model="m", block_size=BS)
    r.hdel(pkey, "blocks")
    other.record("r3", t)  # another client has not sent them: it does
    assert r.hget(pkey, "blocks") == b"16"


@pytest.mark.parametrize("scripting", [True, False])
def test_a_gone_deployment_leaves_no_key_without_a_ttl(d, scripting):
    """The ranking and its decay epoch had no TTL: a deployment deleted long ago kept them for good."""
    d._scripting = scripting
    d.record("r1", toks(60))
    keys = d._r.keys(d.ns.replace("{", "\\{").replace("}", "\\}") + "*")
    assert {k.decode().rsplit(":", 2)[-1] for k in keys} >= {"hot", "epoch"}
    assert all(0 < d._r.ttl(k) <= int(d.ttl_s) for k in keys), {k: d._r.ttl(k) for k in keys}


def test_top_k_reads_past_expired_entries_at_the_top(d):
    """A burst's prefixes rank high after their tokens expired, until a read drops them: a starting
    replica reads once, and the first page of them alone warmed it with nothing."""
    now = time.time()
    old = [d.record("old", toks(100 + i), hits=5000, now=now) for i in range(64)]
    live = [d.record("r1", toks(i), hits=20, now=now) for i in range(5)]
    d._r.delete(*(d.ns + f"p:{h}" for h in old))  # (as their TTL does)
    assert sorted(p.hash for p in d.top_k(16)) == sorted(live)
    assert d._r.zcard(d.ns + "hot") == 5  # and the expired ones left the ranking


def test_a_warm_up_holds_a_prefix_without_ranking_it_or_keeping_it_alive(d):
    """A replica that warmed a prefix holds it, but no request used it: counted as a hit (and renewing
    the entry), a prefix nobody asks for stayed hot for good while replicas kept starting."""
    h = d.record("r1", toks(1), hits=3)
    ttl = d._r.ttl(d.ns + f"p:{h}")
    d._r.expire(d.ns + f"p:{h}", 5)
    assert d.record("r2", toks(1), hits=0) == h
    assert sorted(d.holders(h)) == ["r1", "r2"]  # r2 holds it now
    assert d.top_k(1)[0].score == pytest.approx(3, rel=0.01)  # not a hit
    assert d._r.ttl(d.ns + f"p:{h}") <= 5 < ttl  # not renewed
    assert d.record("r3", toks(2), hits=0) is not None and [p.hash for p in d.top_k(5)] == [h]  # never ranked


def test_an_oversized_entry_is_never_read_whole(d):
    # every entry's fields were read (HGETALL) before their size was checked: another writer of this Redis
    # could make a starting replica, and every router, pull hundreds of MB
    good = d.record("r1", toks(7))
    d._r.zadd(d.ns + "hot", {"4242": 1e9})
    d._r.hset(d.ns + "p:4242", mapping={"tokens": b"\0" * (4 * d.max_prefix_tokens + 4), "blocks": 1})

    def calls(command: str) -> int:
        return d._r.info("commandstats").get(f"cmdstat_{command}", {}).get("calls", 0)

    before = calls("hgetall"), calls("hget")
    assert [p.hash for p in d.top_k(3)] == [good] and d.skipped == 1
    assert (calls("hgetall"), calls("hget")) == (before[0], before[1] + 1)  # the good one's payload alone
