"""Hot-prefix directory in Redis: which prefixes are hot, who holds them, and the tokens to rebuild them.

Replicas record the prefixes their requests shared (the matched part of a prompt); a replica that
starts reads the top-K and prefills them before taking traffic; a router that restarts reads who
holds what. Keys live under ``radixserve:{<deployment>:<model>:b<block size>}:``, braces included (two
fleets of one model with other block sizes hash other chains: they keep apart): the part in braces
is a Redis Cluster hash tag, so one deployment's keys share a slot (its Lua script and pipelines touch
several at once). A URL that points at a node of a Redis Cluster works too: the first ``MOVED`` answer
switches to a cluster client. The keys are:

- ``hot``: sorted set, prefix hash -> decayed hit count. Decay without rewriting: each hit adds
  ``2 ** ((now - epoch) / half_life)``, so older hits weigh exponentially less; scores are rescaled
  (and the epoch moved) before they grow too large.
- ``p:{hash}``: hash with ``tokens`` (packed uint32) and ``blocks``; expires after ``ttl_s``.
- ``h:{hash}``: sorted set of holders, replica id -> expiry time.
- ``r:{replica}``: set of hashes a replica holds, to forget them all when it dies or drains.

Salted (tenant) prefixes are never written. Entries whose tokens do not hash back to their key are
skipped (foreign or corrupt data never reaches a replica). Redis being down never raises: the call
returns empty, a counter goes up, and reconnection waits with exponential backoff.
"""

from __future__ import annotations

import logging
import math
import threading
import time
import urllib.parse
from array import array
from collections import OrderedDict
from collections.abc import Callable, Container, Sequence
from dataclasses import dataclass, field

import redis

from cache.hashing import block_hashes, pack_tokens

log = logging.getLogger(__name__)
_MAX_EXP = 60.0  # rescale scores before 2**exp loses precision
# Reads the decay epoch (setting it on first use), rescales every score when the weights grow too large,
# and adds the hits at the weight that epoch gives, in one atomic step: two replicas that both saw the
# epoch as old must not rescale twice, and a rescale between weighing a hit and adding it would leave
# that hit 2**exp times too heavy. Both keys live a TTL past the last hit (a deployment that is gone leaves
# nothing behind). KEYS: epoch, hot; ARGV: now, half-life, max exponent, member, hits, TTL (whole seconds).
# Returns the size of the ranking.
_INCREMENT_LUA = """
local epoch = tonumber(redis.call('GET', KEYS[1]))
-- none yet, or garbage (not a number, or further ahead than a clock could be off): from now
if not epoch or epoch ~= epoch or math.abs(epoch) == math.huge or epoch > tonumber(ARGV[1]) + tonumber(ARGV[2]) then
  -- scores weighed against a lost epoch (up to 2^60): brought down to at most one hit now, in their order
  local top = redis.call('ZREVRANGE', KEYS[2], 0, 0, 'WITHSCORES')
  if top[2] and tonumber(top[2]) > 1 then
    redis.call('ZUNIONSTORE', KEYS[2], 1, KEYS[2], 'WEIGHTS', string.format('%.17g', 1 / tonumber(top[2])))
  end
  redis.call('SET', KEYS[1], ARGV[1]); epoch = tonumber(ARGV[1])
end
local exp = (tonumber(ARGV[1]) - epoch) / tonumber(ARGV[2])
if exp > tonumber(ARGV[3]) then
  redis.call('ZUNIONSTORE', KEYS[2], 1, KEYS[2], 'WEIGHTS', string.format('%.17g', 2 ^ -exp))
  redis.call('SET', KEYS[1], ARGV[1])
  exp = 0
end
redis.call('ZINCRBY', KEYS[2], string.format('%.17g', 2 ^ exp * tonumber(ARGV[5])), ARGV[4])
redis.call('EXPIRE', KEYS[1], ARGV[6])
redis.call('EXPIRE', KEYS[2], ARGV[6])
return redis.call('ZCARD', KEYS[2])
"""


# what a call may raise when Redis fails or holds what it should not (another tool's value in a key):
# counted and backed off, never passed on (the directory is a hint; anything else is logged with its trace)
_FAILURES = (redis.RedisError, redis.exceptions.RedisClusterException, OSError, ValueError, TypeError)
# a key of the namespace that holds another type than ours (another tool's value, a hand-made key): that
# key is deleted and the write runs again, once; a failure like any other kept failing the same write
# (it went back first in the replica's queue, and every record behind it waited for good)
_WRONG_TYPE = "WRONGTYPE"


_NO_TIME = "refused"  # what _redis_time gives where Redis will never answer TIME


def _refused_for_good(e: redis.ResponseError) -> bool:
    """Scripting (or another command) is off for good (an ACL without @scripting, EVAL renamed away),
    not failing for now."""
    if isinstance(e, redis.exceptions.NoPermissionError):  # NOPERM
        return True
    msg = str(e).lower()
    return "unknown command" in msg or "no permissions" in msg or ("script" in msg and "disabled" in msg)


def _epoch(raw, now: float, half_life_s: float) -> float | None:
    """A stored epoch, or None when it is missing or garbage: not a number, or further ahead than a
    host's clock could be off (2 ** -(now - epoch) would overflow, and every new hit weigh nothing)."""
    try:
        x = float(raw)
    except (TypeError, ValueError):
        return None
    return x if math.isfinite(x) and x <= now + half_life_s else None


CLOCK_SYNC_S = 300.0  # how often a client measures its clock against Redis's (see _now)
TOP_K_PAGES = 8  # top_k reads at most this many pages of 4 k ranked entries
WATCH_RETRIES = 16  # tries of a transaction whose watched epoch another writer changed meanwhile


@dataclass
class HotPrefix:
    hash: int
    tokens: list[int]
    score: float
    # its blocks' hashes (the last is ``hash``), as checking its tokens made them; empty with its tokens
    block_hashes: list[int] = field(default_factory=list)


def _hash_of(member: bytes) -> int | None:
    """A ranking member's prefix hash (None: not one of ours)."""
    try:
        return int(member)
    except ValueError:
        return None


class HotPrefixDirectory:
    def __init__(self, url: str, deployment: str = "radixserve", model: str = "", block_size: int = 16,
                 ttl_s: float = 3600.0, half_life_s: float = 600.0, socket_timeout_s: float = 0.5,
                 max_prefix_tokens: int = 32768, max_hot: int = 10_000):
        self.ns = f"radixserve:{{{deployment}:{model}:b{block_size}}}:"
        self.deployment, self.model = deployment, model
        self.block_size = block_size
        self.ttl_s = ttl_s
        self.half_life_s = half_life_s
        self.max_prefix_tokens = max_prefix_tokens
        self.max_hot = max_hot  # the ranking keeps this many prefixes: the coldest beyond it are dropped
        self._url, self._timeouts = url, {"socket_timeout": socket_timeout_s, "socket_connect_timeout": socket_timeout_s}
        self._r = redis.Redis.from_url(url, **self._timeouts)
        self.cluster = False
        self.errors = 0
        self.skipped = 0
        self._down_until = 0.0
        self._backoff = 0.5
        self._lock = threading.Lock()
        self._warned = False
        self._increment_script = self._r.register_script(_INCREMENT_LUA)
        self._scripting = True
        # prefixes whose tokens this client wrote lately -> until when it trusts they are there: a hot
        # prefix's next record only renews their TTL instead of sending them again (up to 128 KiB each)
        self._tokens_sent: OrderedDict[int, float] = OrderedDict()
        # Redis's clock minus our monotonic one, measured at most CLOCK_SYNC_S ago (None: not yet)
        self._clock_offset: float | None = None
        self._clock_synced_until = float("-inf")  # (monotonic)

    # ------------------------------------------------------------------ resilience
    @property
    def available(self) -> bool:
        return time.monotonic() >= self._down_until

    def _call(self, fn, default):
        """Run ``fn(redis)``; on a Redis failure count it, back off, and return ``default``."""
        if not self.available:
            return default
        try:
            try:
                out = fn(self._r)
            except redis.exceptions.MovedError:  # a node of a Redis Cluster, not the one with our slot
                if self.cluster:
                    raise
                self._to_cluster()
                out = fn(self._r)
        except Exception as e:  # noqa: BLE001 - the directory is a hint: serving goes on without it
            if not isinstance(e, _FAILURES):
                log.warning("hot-prefix directory call failed", exc_info=True)
            with self._lock:
                self.errors += 1
                self._down_until = time.monotonic() + self._backoff
                self._backoff = min(self._backoff * 2, 30.0)
            if not self._warned:
                log.warning("hot-prefix directory unavailable (%s: %s); serving goes on without it", type(e).__name__, e)
                self._warned = True
            return default
        with self._lock:
            if self._warned:
                log.warning("hot-prefix directory is back")
            self._backoff, self._warned = 0.5, False
        return out

    def _to_cluster(self) -> None:
        from redis.cluster import RedisCluster

        log.info("hot-prefix directory: %s is a Redis Cluster node; using a cluster client", _without_secret(self._url))
        self._r = RedisCluster.from_url(self._url, **self._timeouts)
        self._increment_script = self._r.register_script(_INCREMENT_LUA)
        self.cluster = True

    def _now(self) -> float:
        """Redis's clock: every replica weighs hits against the decay epoch, and stamps holders' expiry, on
        one clock, whatever its host's says (one more than a half-life behind saw the shared epoch as
        garbage from the future, and reset it at its every write, flattening the ranking). Measured with
        ``TIME`` every CLOCK_SYNC_S, against the monotonic clock: a step of the host's wall clock between
        two measures (NTP, a VM resumed) moves nothing; our own clock while Redis has not answered one."""
        if time.monotonic() >= self._clock_synced_until:
            sent = time.monotonic()
            got = self._call(self._redis_time, None)
            if got == _NO_TIME:  # refused for good: our own clock, and the write that asked goes on
                self._clock_synced_until = float("inf")
            elif got is not None:
                back = time.monotonic()
                self._clock_offset = float(got[0]) + float(got[1]) / 1e6 - (sent + back) / 2
                self._clock_synced_until = back + CLOCK_SYNC_S
        return time.time() if self._clock_offset is None else time.monotonic() + self._clock_offset

    @staticmethod
    def _redis_time(r):
        """``TIME``, or ``_NO_TIME`` where it is refused for good (an ACL user without it, a proxy that
        does not pass it on: counted as an outage, it backed off the write after it, at every record)."""
        try:
            return r.time()
        except redis.ResponseError as e:
            if _refused_for_good(e):  # NOPERM, an unknown or renamed command
                log.warning("hot-prefix directory: Redis refuses TIME (%s); using this host's clock", e)
                return _NO_TIME
            raise

    def ping(self) -> bool:
        return bool(self._call(lambda r: r.ping(), False))

    # ------------------------------------------------------------------ writes
    def _add_hits(self, r, now: float, member: str, hits: int) -> int:
        """Add ``hits`` to ``member``'s score at the weight of a hit now (older hits weigh exponentially
        less). Returns the size of the ranking."""
        if self._scripting:
            try:
                return int(self._increment_script(
                    keys=[self.ns + "epoch", self.ns + "hot"],
                    args=[repr(now), repr(self.half_life_s), repr(_MAX_EXP), member, repr(float(hits)),
                          int(self.ttl_s)], client=r))
            except redis.exceptions.AskError:  # a cluster redirection (MOVED too): not a refusal
                raise
            except redis.ResponseError as e:
                if not _refused_for_good(e):  # OOM, CLUSTERDOWN, BUSY...: a failure like any other
                    raise
                log.warning("hot-prefix directory: Lua scripts refused (%s); rescaling without them", e)
                self._scripting = False
        # the same steps in a transaction that watches the epoch: a rescale by another writer between
        # reading it and adding the hit (which would weigh the hit 2**exp times too much) retries it
        epoch_key, hot = self.ns + "epoch", self.ns + "hot"
        # (the epoch's expiry is renewed only when half gone: any write to a watched key, EXPIRE too, made
        # every other writer's transaction start again; six writers aborted 2,000 transactions for 900 records)
        with r.pipeline(transaction=True) as p:  # (a cluster's too: both keys share the namespace's slot)
            for _ in range(WATCH_RETRIES):
                try:
                    p.watch(epoch_key)
                    epoch = _epoch(p.get(epoch_key), now, self.half_life_s)
                    top = p.zrevrange(hot, 0, 0, withscores=True) if epoch is None else []
                    renew = epoch is None or p.ttl(epoch_key) < self.ttl_s / 2
                    p.multi()
                    if epoch is None:  # none yet, or garbage: decay from now (scores at most one hit now)
                        if top and top[0][1] > 1:
                            p.zunionstore(hot, {hot: 1.0 / top[0][1]})
                        p.set(epoch_key, now)
                        epoch = now
                    exp = (now - epoch) / self.half_life_s
                    if exp > _MAX_EXP:
                        p.zunionstore(hot, {hot: 2.0 ** -exp})
                        p.set(epoch_key, now)
                        exp, renew = 0.0, True
                    p.zincrby(hot, 2.0 ** exp * hits, member)
                    if renew:
                        p.expire(epoch_key, int(self.ttl_s))
                    p.expire(hot, int(self.ttl_s))
                    p.zcard(hot)
                    return int(p.execute()[-1])
                except redis.WatchError:
                    continue
        raise redis.WatchError(f"the epoch kept changing ({WATCH_RETRIES} tries)")

    def record(self, replica: str, tokens: Sequence[int], hits: int = 1, cache_salt: str | None = None,
               now: float | None = None) -> int | None:
        """Note that ``replica`` holds (and served ``hits`` requests of) the prefix ``tokens`` (whole blocks
        only). With ``hits`` 0 (a warm-up) only the holder is written: the prefix's rank and its entry's
        expiry are its requests' to keep. Returns the prefix hash, or None when nothing was written
        (salted, too short, Redis down)."""
        if cache_salt:
            return None  # tenants' prefixes stay private
        n = min(len(tokens), self.max_prefix_tokens) // self.block_size * self.block_size
        if n == 0:
            return None
        toks = list(tokens[:n])
        h = block_hashes(toks, self.block_size, self.model)[-1]
        now = self._now() if now is None else now

        def write(r):
            # the tokens go in before the ranking names the prefix: a reader drops a ranked prefix
            # without tokens as stale
            p = r.pipeline(transaction=False)
            pkey, ttl = self.ns + f"p:{h}", int(self.ttl_s)
            sent = self._tokens_sent.get(h, 0.0) > now
            if not hits:
                self._write_holder(p, h, replica, now)
                p.execute()
                return h
            if sent:
                p.expire(pkey, ttl)  # answers 0 when the entry is gone (dropped as cold, flushed)
            else:
                p.hset(pkey, mapping={"tokens": pack_tokens(toks), "blocks": n // self.block_size})
                p.expire(pkey, ttl)
            self._write_holder(p, h, replica, now)
            if sent and not p.execute()[0]:  # gone since: sent again, still before the ranking names it
                r.hset(pkey, mapping={"tokens": pack_tokens(toks), "blocks": n // self.block_size})
                r.expire(pkey, ttl)
            elif not sent:
                p.execute()
            self._tokens_sent[h] = now + self.ttl_s / 4
            self._tokens_sent.move_to_end(h)
            while len(self._tokens_sent) > self.max_hot:  # bounded like the ranking
                self._tokens_sent.popitem(last=False)
            over = self._add_hits(r, now, str(h), hits) - self.max_hot
            if over > 0:
                self._drop_coldest(r, over)
            return h

        def expected() -> dict[str, bytes]:
            self._tokens_sent.pop(h, None)  # (its payload goes again: the entry may be deleted)
            return {self.ns + f"p:{h}": b"hash", self.ns + f"h:{h}": b"zset", self.ns + f"r:{replica}": b"set",
                    self.ns + "hot": b"zset", self.ns + "epoch": b"string"}

        return self._call(self._repairing(write, expected), None)

    def _repairing(self, fn, expected: Callable[[], dict[str, bytes]]):
        """``fn(redis)``, run again after deleting the keys of ``expected()`` that hold another type than
        ours, if a WRONGTYPE reply stopped it (a key left by hand or by an older version: without this, the
        failure counted as Redis down, and every call backed off)."""
        def run(r):
            try:
                return fn(r)
            except redis.ResponseError as e:
                if _WRONG_TYPE not in str(e):
                    raise
                self._delete_wrong_types(r, expected())
                return fn(r)

        return run

    def _delete_wrong_types(self, r, expected: dict[str, bytes]) -> None:
        """Delete those of these keys that hold another type than ours (missing ones are fine)."""
        p = r.pipeline(transaction=False)
        for key in expected:
            p.type(key)
        kinds = [k.encode() if isinstance(k, str) else k for k in p.execute()]
        wrong = [key for key, kind in zip(expected, kinds, strict=True) if kind not in (expected[key], b"none")]
        if wrong:
            log.warning("hot-prefix directory: %d key(s) of another type in its namespace deleted", len(wrong))
            r.delete(*wrong)

    def _write_holder(self, p, h: int, replica: str, now: float) -> None:
        """``replica`` holds prefix ``h`` (into pipeline ``p``)."""
        p.zadd(self.ns + f"h:{h}", {replica: now + self.ttl_s})
        # holders whose own entry expired (gone without a goodbye): a prefix that stays hot keeps its
        # set alive, which would otherwise collect every replica that ever held it
        p.zremrangebyscore(self.ns + f"h:{h}", "-inf", now)
        p.expire(self.ns + f"h:{h}", int(self.ttl_s))
        p.sadd(self.ns + f"r:{replica}", str(h))
        p.expire(self.ns + f"r:{replica}", int(self.ttl_s))

    def _drop_coldest(self, r, n: int) -> None:
        """Bounded: the ``n`` coldest leave the ranking, with their tokens (up to 128 KiB each), their
        holders, and their place in each holder's ``r:`` set (a replica that lives for weeks would
        otherwise keep every prefix it ever held there)."""
        dropped = [m.decode(errors="replace") for m, _ in r.zpopmin(self.ns + "hot", n)]
        if not dropped:
            return
        p = r.pipeline(transaction=False)
        for m in dropped:
            p.zrange(self.ns + f"h:{m}", 0, -1)
        held_by = p.execute(raise_on_error=False)  # (a key of another type: no holders to tell)
        for m, holders in zip(dropped, held_by, strict=True):
            for holder in [] if isinstance(holders, Exception) else holders:
                p.srem(self.ns + f"r:{holder.decode(errors='replace')}", m)
            p.delete(self.ns + f"p:{m}", self.ns + f"h:{m}")
        p.execute(raise_on_error=False)

    def drop_holder(self, replica: str, hashes: Sequence[int]) -> bool:
        """``replica`` evicted these prefixes (by their last-block hash). True when Redis ran every removal
        (or there was none to run); False when the write failed or was skipped while backing off: the
        caller keeps the hashes and drops them again later (removing twice is harmless)."""
        if not hashes:
            return True

        def write(r) -> bool:
            p = r.pipeline(transaction=False)
            for h in hashes:
                p.zrem(self.ns + f"h:{h}", replica)
                p.srem(self.ns + f"r:{replica}", str(h))
            p.execute()  # raises on any error reply: some removals may then have run, but not all
            return True

        def expected() -> dict[str, bytes]:
            return {self.ns + f"r:{replica}": b"set", **{self.ns + f"h:{h}": b"zset" for h in hashes}}

        return bool(self._call(self._repairing(write, expected), False))

    def forget_replica(self, replica: str) -> int:
        """Drop everything ``replica`` holds (it died or drains). Returns how many entries."""
        held: set[bytes] = set()  # (kept for a second run: the first one's pipeline ran whole, its delete too)

        def write(r):
            held.update(r.smembers(self.ns + f"r:{replica}"))
            p = r.pipeline(transaction=False)
            for h in held:
                p.zrem(self.ns + f"h:{h.decode(errors='replace')}", replica)
            p.delete(self.ns + f"r:{replica}")
            p.execute()
            return len(held)

        def expected() -> dict[str, bytes]:
            return {self.ns + f"r:{replica}": b"set",
                    **{self.ns + f"h:{h.decode(errors='replace')}": b"zset" for h in held}}

        return self._call(self._repairing(write, expected), 0)

    # ------------------------------------------------------------------ reads
    def top_k(self, k: int, token_budget: int | None = None, max_tokens: int | None = None,
              known: Container[int] = ()) -> list[HotPrefix]:
        """The ``k`` hottest prefixes (valid ones only), within ``token_budget`` tokens in all; ``max_tokens``:
        of at most that many tokens each (a replica's limit: longer ones are passed over, not fetched, and
        leave their place to the next). Those whose hash is in ``known`` come without their tokens (empty:
        not fetched, nor counted against the budget): a router that has their block hashes already read up
        to 64 payloads of 128 KiB every sync for nothing."""
        if k <= 0:
            return []

        page = 4 * k

        most = 4 * self.max_prefix_tokens  # bytes of the longest token payload an entry may hold

        def read(r, start: int, need: int, room: int | None):
            """Up to a page of the ranking from ``start``, cut after the ``need``-th entry worth fetching:
            (the entries read, their payloads, the epoch, whether the ranking ended)."""
            ranked = r.zrevrange(self.ns + "hot", start, start + page - 1, withscores=True)
            end = len(ranked) < page
            keys = [self.ns + f"p:{member.decode(errors='replace')}" for member, _ in ranked]
            # sizes first: an entry's payload is fetched only when it may be one (one that another writer
            # of this Redis made hundreds of MB would be read whole, by a starting replica and every router),
            # and fits what is left of the budget, and only as many as are needed (a page of 4 k was read
            # whole: 256 prefixes of 32k tokens, 170 MB, for a warm-up budget that took two of them)
            # (an error answer, a key of another type: malformed, not a failure of the whole read)
            p = r.pipeline(transaction=False)
            for key in keys:
                p.hstrlen(key, "tokens")
                p.exists(key)
            found = [0 if isinstance(x, Exception) else x for x in p.execute(raise_on_error=False)]
            sizes, there = found[0::2], found[1::2]
            kinds: list[str] = []  # per entry read: "fetch", "over" (past the budget), "malformed", "gone"
            for (member, _), size, ok in zip(ranked, sizes, there, strict=True):
                if not 0 < size <= most:
                    kinds.append("malformed" if ok else "gone")
                elif known and _hash_of(member) in known:
                    kinds.append("known")
                    need -= 1
                    if need == 0:
                        break
                elif (room is not None and size // 4 > room) or (max_tokens is not None and size // 4 > max_tokens):
                    kinds.append("over")
                else:
                    kinds.append("fetch")
                    room = None if room is None else room - size // 4
                    need -= 1
                    if need == 0:
                        break
            ranked, keys = ranked[:len(kinds)], keys[:len(kinds)]
            p = r.pipeline(transaction=False)
            for key, kind in zip(keys, kinds, strict=True):
                if kind == "fetch":
                    p.hget(key, "tokens")
            fetched = iter(p.execute())
            # (an entry that is there without a payload it may hold: malformed, counted as skipped)
            entries = [{b"tokens": next(fetched)} if kind == "fetch" else {b"known": b""} if kind == "known" else
                       None if kind == "over" else {b"malformed": b""} if kind == "malformed" else {}
                       for kind in kinds]
            try:
                epoch = r.get(self.ns + "epoch")
            except redis.ResponseError:  # (another type: garbage, read as none; the next record repairs it)
                epoch = None
            return ranked, entries, epoch, end

        out: list[HotPrefix] = []
        used = start = 0
        stale: list[bytes] = []
        # page on past entries that expired (a burst's prefixes, ranked high, outlive their tokens until a
        # read drops them): a starting replica reads once, and a first page of them alone warmed nothing
        for _ in range(TOP_K_PAGES):
            room = None if token_budget is None else token_budget - used
            need = k - len(out)
            got = self._call(lambda r, s=start, n=need, room=room: read(r, s, n, room), None)
            if not got:
                break
            ranked, entries, epoch, end = got
            start += len(ranked)
            before = len(stale)
            now = self._now()  # report decayed hit counts as of now
            epoch = _epoch(epoch, now, self.half_life_s)
            scale = 2.0 ** -max(0.0, (now - epoch) / self.half_life_s) if epoch is not None else 1.0
            for (member, score), entry in zip(ranked, entries, strict=True):
                if entry is None:
                    continue  # past the budget: not read
                if b"known" in entry and math.isfinite(score):
                    out.append(HotPrefix(int(member), [], float(score * scale)))
                    continue
                hp = self._parse(member, score * scale, entry)
                if hp is None:
                    stale.append(member)  # expired, corrupt or foreign: drop it from the ranking for good
                    continue
                if token_budget is not None and used + len(hp.tokens) > token_budget:
                    continue
                out.append(hp)
                used += len(hp.tokens)
            if len(out) >= k or end or (len(ranked) == page and 2 * (len(stale) - before) < page):
                break  # enough, the ranking's end, or a page read whole and mostly live (the budget left it short)
        if stale:
            self._call(lambda r: r.zrem(self.ns + "hot", *stale), None)
        return out[:k]

    def _parse(self, member: bytes, score: float, entry: dict) -> HotPrefix | None:
        """A checked entry, or None (counted) for anything malformed or foreign."""
        try:
            h = int(member)
            raw = entry[b"tokens"]
            if (not raw or len(raw) % 4 or len(raw) // 4 % self.block_size or len(raw) // 4 > self.max_prefix_tokens
                    or not math.isfinite(score)):
                raise ValueError("bad token payload")
            toks = array("I")
            toks.frombytes(raw)
            tokens = toks.tolist()
            chain = block_hashes(tokens, self.block_size, self.model)
            if chain[-1] != h:
                raise ValueError("tokens do not hash to the key")
            return HotPrefix(h, tokens, float(score), chain)
        except (KeyError, ValueError, TypeError):
            if entry:
                self.skipped += 1
            return None

    def holders(self, h: int, now: float | None = None) -> list[str]:
        now = self._now() if now is None else now
        key = self.ns + f"h:{h}"
        got = self._call(self._repairing(lambda r: r.zrangebyscore(key, now, "+inf"), lambda: {key: b"zset"}), [])
        return [m.decode(errors="replace") for m in got]

    def clear(self) -> None:
        """Delete the whole namespace (tests, resets)."""
        def wipe(r):
            keys = list(r.scan_iter(match=self.ns + "*", count=1000))
            if keys:
                r.delete(*keys)

        self._call(wipe, None)


def _without_secret(url: str) -> str:
    """A Redis URL to log: its user name and password left out (a cluster's URL carries them)."""
    parts = urllib.parse.urlsplit(url)
    host = parts.hostname or ""
    host = f"[{host}]" if ":" in host else host
    return urllib.parse.urlunsplit(parts._replace(netloc=host + (f":{parts.port}" if parts.port else "")))
