"""Discrete-event simulator of a fleet behind a router: real radix caches, modelled service times.

    python -m bench.routing_sim --replicas 8 --workload gsp-zipf
    python -m bench.routing_sim --replicas 1000 --requests 1000000 --policies ours,pow2   # scale run

Each replica has a real ``RadixCache`` of fixed capacity (blocks) and ``--concurrency`` slots; a request
occupies a slot for ``prefill_ms * uncached tokens + decode_ms * output tokens`` (its prefix is matched
when it starts, as the engine does on admission). Arrivals are Poisson at ``--load`` of the fleet's
capacity. The router policies see only what a real router sees: their own routing history, corrected
by the replicas' reports of what they evicted and stored every ``--report-s`` seconds.

Policies: ours (``routing.policy``), pow2 (Serve's default), round robin, consistent hashing of the
first block, Ray-LLM-like (``PrefixCacheAffinityRouter``: match rate >= 0.1 wins, else smallest tenant;
Serve then takes the least loaded of all the chosen, the first on ties, as its router does with one rank
of candidates; ``imbalanced_threshold`` defaults to infinity, so it never falls back to pow2),
SGLang-like (cache-aware: match rate > 0.3 wins, else smallest tree; shortest queue when max-min > 64
and max > 1.5 min), and an oracle (one cache with the fleet's capacity). ``clairvoyant`` is a reference no
router can be: told each group's popularity in advance, it plans copies and placement once
(``clairvoyant_plan``; again from scratch when the fleet changes, so it is a weak reference for runs
that add or remove replicas) and sends each request to the least busy of its group's homes. Like the real routers, the
Ray- and SGLang-likes keep a tree of what they routed where and hear nothing from the replicas (Ray's
tree does not evict by default, ``do_eviction=False``; SGLang's approximate tree evicts by its own LRU
only past ``max_tree_size``, millions of characters: never here); they match whole blocks of 16 tokens
rather than characters. ``ray_llm_reports`` and ``sglang_reports`` are the same
policies reading our router's index instead (bounded, trimmed like the replicas evict, corrected by
their reports): more than the real routers know.
"""

from __future__ import annotations

import argparse
import bisect
import heapq
import json
import math
import random
import statistics
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import xxhash

from bench import plots
from cache.allocator import BlockAllocator
from cache.hashing import chain_hashes, pack_tokens, root_hash
from cache.radix import RadixCache
from routing.holders import Holders
from routing.policy import PolicyConfig, PrefixPolicy

BS = 16


# ----------------------------------------------------------------------------- workloads
@dataclass
class SimRequest:
    arrival: float
    tokens: list[int]
    hashes: list[int]
    output: int
    group: int


@dataclass
class Workload:
    name: str
    num_groups: int
    system_len: int
    question_len: int
    output_len: int
    zipf_alpha: float | None
    turns: int = 1  # multiturn: each user's prompt grows by question + answer per turn


def _systems(w: Workload, rng: random.Random) -> tuple[list[list[int]], list[list[int]]]:
    systems = [[rng.randrange(3, 32000) for _ in range(w.system_len)] for _ in range(w.num_groups)]
    seed = root_hash("sim")
    return systems, [chain_hashes(pack_tokens(s), BS, seed) for s in systems]


def generate(w: Workload, n: int, rate: float, seed: int = 0) -> Iterator[SimRequest]:
    """Lazily: ``n`` requests with Poisson arrivals at ``rate``/s (memory stays flat at 1M requests)."""
    rng = random.Random(seed)
    systems, sys_hashes = _systems(w, rng)
    weights = None if w.zipf_alpha is None else [1 / (r + 1) ** w.zipf_alpha for r in range(w.num_groups)]
    cum = None if weights is None else list(_accumulate(weights))
    histories: dict[int, list[int]] = {}
    t = 0.0
    for _ in range(n):
        t += rng.expovariate(rate)
        if w.turns > 1:  # multiturn: user u's history grows; group = user
            u = rng.randrange(w.num_groups)
            hist = histories.get(u) or list(systems[u % len(systems)])
            hist = hist + [rng.randrange(3, 32000) for _ in range(w.question_len)]
            toks = hist
            histories[u] = hist + [rng.randrange(3, 32000) for _ in range(w.output_len)]
            if len(histories[u]) > w.system_len * w.turns:
                histories.pop(u)  # conversation over; the user starts a new one
            hashes = chain_hashes(pack_tokens(toks), BS, root_hash("sim"))
            yield SimRequest(t, toks, hashes, w.output_len, u)
            continue
        if cum is None:
            g = rng.randrange(w.num_groups)
        else:
            g = bisect.bisect_left(cum, rng.random() * cum[-1])
        q = [rng.randrange(3, 32000) for _ in range(w.question_len)]
        sh = sys_hashes[g]
        hashes = sh + chain_hashes(pack_tokens(systems[g][len(sh) * BS:] + q), BS, sh[-1] if sh else root_hash("sim"))
        yield SimRequest(t, systems[g] + q, hashes, w.output_len, g)


def group_shares(w: Workload) -> list[float]:
    """Each group's expected share of the requests (what the clairvoyant reference is told)."""
    weights = [1.0 if w.zipf_alpha is None else 1 / (r + 1) ** w.zipf_alpha for r in range(w.num_groups)]
    total = sum(weights)
    return [x / total for x in weights]


def clairvoyant_plan(shares: list[float], replicas: list[str], slots: int, per_copy: float = 0.7
                     ) -> dict[int, list[str]]:
    """Where each group lives when its popularity is known in advance: a group gets one copy per
    ``per_copy`` of a replica's fair share it carries, then largest-first onto the least-planned
    replica that has a free slot (its cache holds ``slots`` prefixes) and lacks that group."""
    n = len(replicas)
    items = []
    for g, share in enumerate(shares):
        k = min(n, max(1, math.ceil(share * n / per_copy)))
        items += [(share / k, g)] * k
    items.sort(key=lambda x: (-x[0], x[1]))
    planned = {r: 0.0 for r in replicas}
    held: dict[str, set[int]] = {r: set() for r in replicas}
    home: dict[int, list[str]] = {}
    for share, g in items:
        free = [r for r in replicas if g not in held[r]]
        roomy = [r for r in free if len(held[r]) < slots] or free
        r = min(roomy, key=lambda r: (planned[r], r))
        planned[r] += share
        held[r].add(g)
        home.setdefault(g, []).append(r)
    return home


def _accumulate(xs):
    s = 0.0
    for x in xs:
        s += x
        yield s


WORKLOADS = {
    "gsp-small": Workload("gsp-small", 8, 1024, 64, 32, None),
    "gsp-zipf": Workload("gsp-zipf", 64, 1024, 64, 32, 1.0),
    "multiturn": Workload("multiturn", 64, 256, 64, 32, None, turns=6),
    "churn": Workload("churn", 512, 1024, 64, 32, 0.6),  # far more prefixes than the fleet holds
}


# ----------------------------------------------------------------------------- baselines' trees
class HistoryTree:
    """What the Ray-LLM and SGLang routers track: every block chain routed to each replica, never
    corrected by the replicas (an inverted index: block hash -> replicas it was routed to)."""

    def __init__(self) -> None:
        self.holders = Holders()
        self.size: dict[str, int] = {}  # tenant size: distinct blocks routed there

    def add(self, rid: str) -> None:
        self.size.setdefault(rid, 0)

    def remove(self, rid: str) -> None:
        self.size.pop(rid, None)
        self.holders.remove_replica(rid)

    def insert(self, rid: str, hashes: list[int]) -> None:
        for h in hashes:
            if self.holders.add(h, rid):
                self.size[rid] = self.size.get(rid, 0) + 1

    def match(self, hashes: list[int]) -> dict[str, int]:
        """Matched leading blocks per replica (replicas with at least one)."""
        return self.holders.matches(hashes)


# ----------------------------------------------------------------------------- replicas
@dataclass
class Replica:
    rid: str
    cache: RadixCache
    alloc: BlockAllocator
    slots: int
    busy: int = 0
    queue: list = field(default_factory=list)
    work_s: float = 0.0
    alive: bool = True
    joined_s: float = 0.0  # when it joined the fleet (its load is its work over the time since)

    @classmethod
    def make(cls, rid: str, capacity_blocks: int, slots: int) -> Replica:
        cache = RadixCache(BS, "sim", record_events=True, reuse_bonus=capacity_blocks)
        return cls(rid, cache, BlockAllocator(capacity_blocks, BS, cache), slots)


class Sim:
    def __init__(self, policy: str, replicas: int, capacity_blocks: int, slots: int, prefill_ms: float,
                 decode_ms: float, report_s: float, seed: int, load_weight: float | None,
                 shares: list[float] | None = None, cache_prompts: int = 8, plan_copy_share: float = 0.7):
        self.policy_name = policy
        self.shares = shares  # the clairvoyant reference's knowledge of each group's popularity
        self.cache_prompts = cache_prompts
        self.plan_copy_share = plan_copy_share
        self.plan: dict[int, list[str]] | None = None
        self.capacity = capacity_blocks
        self.slots = slots
        self.prefill_s = prefill_ms / 1000
        self.decode_s = decode_ms / 1000
        self.report_s = report_s
        self.rng = random.Random(seed)
        self.replicas: dict[str, Replica] = {}
        cfg = PolicyConfig(block_size=BS, decode_token_cost=decode_ms / prefill_ms,
                           default_capacity_blocks=capacity_blocks)
        if load_weight is not None:
            cfg.load_weight = load_weight
        self.policy = PrefixPolicy(cfg)  # ours, and the index the *_reports variants read
        self.tree = HistoryTree()  # what the Ray-LLM-like and SGLang-like routers remember
        self.rr = 0
        self.ring: list[tuple[int, str]] = []
        self.ttft: list[float] = []
        self.prompt_tokens = 0
        self.hit_tokens = 0
        self.events: list = []
        self.clock = 0.0  # simulated seconds: the latest arrival or completion
        self.next_report = report_s
        self.seq = 0
        self._live_cache: list[str] | None = None  # reset on fleet changes
        for i in range(replicas):
            self.add_replica(f"r{i}")

    # ------------------------------------------------------------------ fleet changes
    def add_replica(self, rid: str) -> None:
        self._live_cache = None
        self.plan = None
        self.replicas[rid] = Replica.make(rid, self.capacity, self.slots)
        self.replicas[rid].joined_s = self.clock
        self.policy.add_replica(rid, self.capacity)
        self.tree.add(rid)
        for v in range(64):
            bisect.insort(self.ring, (xxhash.xxh64_intdigest(f"{rid}#{v}".encode()), rid))

    def remove_replica(self, rid: str) -> None:
        self._live_cache = None
        self.plan = None
        self.replicas[rid].alive = False
        self.policy.remove_replica(rid)
        self.tree.remove(rid)
        self.ring = [x for x in self.ring if x[1] != rid]

    def live(self) -> list[str]:
        return [r for r, rep in self.replicas.items() if rep.alive]

    def _refresh_live(self) -> list[str]:
        self._live_cache = self.live()
        return self._live_cache

    # ------------------------------------------------------------------ routing
    def route(self, req: SimRequest) -> str:
        p = self.policy_name
        if p == "ours":  # no per-request fleet scan: the policy's own structures are O(log R)
            return self.policy.choose(req.hashes, len(req.tokens), req.output)
        live = self._live_cache if self._live_cache is not None else self._refresh_live()
        if p == "round_robin":
            self.rr += 1
            return live[self.rr % len(live)]
        if p == "pow2":
            return self._pow2(live)
        if p == "clairvoyant":  # knows each group's popularity; sends to its least busy planned home
            if self.plan is None:
                self.plan = clairvoyant_plan(self.shares or [1.0], live, self.cache_prompts, self.plan_copy_share)
            homes = self.plan.get(req.group) or live
            return min(homes, key=lambda r: (self.replicas[r].work_s, r))
        if p == "consistent_hash":
            i = bisect.bisect_left(self.ring, (req.hashes[0] if req.hashes else 0, ""))
            return self.ring[i % len(self.ring)][1]
        reports = p.endswith("_reports")
        if reports:
            matched, size = self.policy.matches(req.hashes), self.policy.index_size
        else:
            matched = {r: m for r, m in self.tree.match(req.hashes).items() if r in live}
            size = self.tree.size.__getitem__
        matched = dict(sorted(matched.items()))  # set order varies per process (string hashing): fix it
        n = max(1, len(req.tokens))
        if p.startswith("ray_llm"):  # imbalanced_threshold defaults to inf: never falls back to pow2
            best = max(matched.values(), default=0)
            if best * BS / n >= 0.1:
                return self._least_loaded([r for r, m in matched.items() if m == best])
            least = min(size(r) for r in live)
            return self._least_loaded([r for r in live if size(r) == least])
        if p.startswith("sglang"):
            loads = {r: self.replicas[r].busy + len(self.replicas[r].queue) for r in live}
            lo, hi = min(loads.values()), max(loads.values())
            if hi - lo > 64 and hi > 1.5 * lo:
                return min(live, key=loads.__getitem__)
            best = max(matched.items(), key=lambda kv: kv[1], default=(None, 0))
            if best[0] is not None and best[1] * BS / n > 0.3:
                return best[0]
            return min(live, key=lambda r: (size(r), loads[r]))
        raise ValueError(p)

    def _least_loaded(self, candidates: list[str]) -> str:
        """Serve's pick among one rank of candidates (``_select_from_candidate_replicas``): the lowest queue
        length, the first of them on ties (a strict ``<`` scan)."""
        return min(candidates, key=lambda r: self.replicas[r].busy + len(self.replicas[r].queue))

    def _pow2(self, live: list[str]) -> str:
        a, b = self.rng.sample(live, 2) if len(live) > 1 else (live[0], live[0])  # live: candidates
        la = self.replicas[a].busy + len(self.replicas[a].queue)
        lb = self.replicas[b].busy + len(self.replicas[b].queue)
        return a if la <= lb else b

    # ------------------------------------------------------------------ service
    def _start(self, rep: Replica, req: SimRequest, work_token: float, now: float) -> None:
        m = rep.cache.match(req.tokens)
        rep.cache.lock(m.node)
        full = len(req.tokens) // BS
        need = full - len(m.blocks)
        if rep.alloc.can_allocate(need):
            blocks = rep.alloc.allocate(need)
            res = rep.cache.insert(req.tokens, m.blocks + blocks)
            rep.alloc.free(res.redundant)
            rep.cache.lock(res.node)
            rep.cache.unlock(m.node)
            node = res.node
        else:  # pool full of locked blocks: run uncached
            node = m.node
        hit = len(m.blocks) * BS
        self.prompt_tokens += len(req.tokens)
        self.hit_tokens += hit
        prefill = self.prefill_s * (len(req.tokens) - hit)
        service = prefill + self.decode_s * req.output
        rep.busy += 1
        rep.work_s += service
        self.ttft.append(now - req.arrival + prefill + self.decode_s)
        self.seq += 1
        heapq.heappush(self.events, (now + service, self.seq, "done", (rep, node, work_token)))

    def run(self, requests: Iterator[SimRequest], changes: dict[int, list[str]]) -> None:
        for i, req in enumerate(requests):
            self.clock = max(self.clock, req.arrival)  # (a replica added here joins at this arrival)
            for what in changes.get(i, ()):
                self._change(what)
            self._advance(req.arrival)
            rid = self.route(req)
            work = self.policy.on_routed(rid, req.hashes, len(req.tokens), req.output)
            if self.policy_name in ("ray_llm", "sglang"):
                self.tree.insert(rid, req.hashes)
            rep = self.replicas[rid]
            if rep.busy < rep.slots:
                self._start(rep, req, work, req.arrival)
            else:
                rep.queue.append((req, work))
        self._advance(math.inf)

    def _change(self, what: str) -> None:
        if what == "add":
            self.add_replica(f"r{len(self.replicas)}")
        else:
            victim = self.live()[0]
            self.remove_replica(victim)

    def _advance(self, until: float) -> None:
        while self.events and self.events[0][0] <= until:
            now, _, _, (rep, node, work) = heapq.heappop(self.events)
            self.clock = max(self.clock, now)
            rep.busy -= 1
            rep.cache.unlock(node)
            self.policy.on_completed(rep.rid, work)
            if rep.queue:
                req, w = rep.queue.pop(0)
                self._start(rep, req, w, now)
            if now >= self.next_report:
                self._report()
                self.next_report = now + self.report_s
        if until != math.inf and until >= self.next_report:
            self._report()
            self.next_report = until + self.report_s

    def _report(self) -> None:
        """Replicas tell the router what they evicted and stored since the last report, each block's net
        change (as record_routing_stats does), which the router folds removed first (as PrefixRouter)."""
        for rid, rep in self.replicas.items():
            events, _ = rep.cache.drain_events()
            if rep.alive:
                net: dict[int, bool] = {}
                for kind, hs in events:
                    for h in hs:
                        net[h] = kind == "stored"
                self.policy.forget_hashes(rid, [h for h, kept in net.items() if not kept])
                self.policy.learn_hashes(rid, [h for h, kept in net.items() if kept], from_root=False)


def oracle_hit_rate(w: Workload, n: int, capacity_blocks: int, seed: int) -> float:
    cache = RadixCache(BS, reuse_bonus=capacity_blocks)
    alloc = BlockAllocator(capacity_blocks, BS, cache)
    hit = total = 0
    for req in generate(w, n, 1.0, seed):
        m = cache.match(req.tokens)
        full = len(req.tokens) // BS
        need = full - len(m.blocks)
        cache.lock(m.node)
        if alloc.can_allocate(need):
            res = cache.insert(req.tokens, m.blocks + alloc.allocate(need))
            alloc.free(res.redundant)
        cache.unlock(m.node)
        hit += len(m.blocks) * BS
        total += len(req.tokens)
    return hit / total


# ----------------------------------------------------------------------------- driver
def simulate(policy: str, w: Workload, args, rate: float, changes: dict[int, list[str]]) -> dict:
    t0 = time.perf_counter()
    sim = Sim(policy, args.replicas, args.capacity_blocks, args.concurrency, args.prefill_ms, args.decode_ms,
              args.report_s, args.seed, args.load_weight, group_shares(w), args.cache_prompts, args.plan_copy_share)
    sim.run(generate(w, args.requests, rate, args.seed), changes)
    # each replica's work per second of its time in the fleet: one added mid-run had less time to do its
    # share, and its total alone read as an imbalance (round robin's even split as max/mean 1.05)
    work = [r.work_s / max(sim.clock - r.joined_s, 1e-9) for r in sim.replicas.values() if r.alive]
    mean = statistics.fmean(work)
    ttft = sorted(sim.ttft)
    return {"policy": policy, "hit_rate": sim.hit_tokens / sim.prompt_tokens,
            "max_mean_load": max(work) / mean if mean else 0.0,
            "load_cov": statistics.pstdev(work) / mean if mean else 0.0,
            "ttft_p50_s": ttft[len(ttft) // 2], "ttft_p90_s": ttft[int(len(ttft) * 0.9)],
            "wall_s": time.perf_counter() - t0}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--replicas", type=int, default=8)
    ap.add_argument("--workload", choices=list(WORKLOADS), default="gsp-zipf")
    ap.add_argument("--requests", type=int, default=4096)
    ap.add_argument("--cache-prompts", type=int, default=8, help="system prompts one replica's cache holds")
    ap.add_argument("--concurrency", type=int, default=8, help="requests a replica serves at once")
    ap.add_argument("--prefill-ms", type=float, default=0.25, help="per uncached prompt token")
    ap.add_argument("--decode-ms", type=float, default=5.0, help="per generated token (per request)")
    ap.add_argument("--load", type=float, default=0.7, help="offered load vs. the fleet's capacity at full hit rate")
    ap.add_argument("--report-s", type=float, default=1.0, help="replicas report what they evicted and stored every this many seconds")
    ap.add_argument("--load-weight", type=float, default=None, help="ours: default PolicyConfig's")
    ap.add_argument("--policies", default="ours,pow2,round_robin,consistent_hash,ray_llm,sglang,ray_llm_reports,"
                    "sglang_reports,clairvoyant")
    ap.add_argument("--plan-copy-share", type=float, default=0.7,
                    help="clairvoyant: one copy of a group per this much of a replica's fair share of traffic")
    ap.add_argument("--add-replica-at", type=float, default=None, help="fraction of the run")
    ap.add_argument("--remove-replica-at", type=float, default=None, help="fraction of the run")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--plot", default=None, help="write a PNG of hit rate and load balance here")
    args = ap.parse_args(argv)
    if args.plan_copy_share <= 0:
        ap.error("--plan-copy-share must be positive")
    w = WORKLOADS[args.workload]
    sys_blocks = w.system_len // BS
    q_blocks = -(-w.question_len // BS)
    args.capacity_blocks = args.cache_prompts * sys_blocks + args.concurrency * (q_blocks + 1)
    t_hit = args.prefill_ms / 1000 * w.question_len + args.decode_ms / 1000 * w.output_len
    rate = args.load * args.replicas * args.concurrency / t_hit
    changes: dict[int, list[str]] = {}  # (an add and a remove at the same point: both)
    if args.add_replica_at is not None:
        changes.setdefault(int(args.add_replica_at * args.requests), []).append("add")
    if args.remove_replica_at is not None:
        changes.setdefault(int(args.remove_replica_at * args.requests), []).append("remove")

    oracle = oracle_hit_rate(w, args.requests, args.capacity_blocks * args.replicas, args.seed)
    rows = [simulate(p, w, args, rate, changes) for p in args.policies.split(",")]
    print(f"workload {w.name}: {args.requests} requests, {args.replicas} replicas x {args.capacity_blocks} blocks,"
          f" {rate:.0f} req/s; oracle hit rate {oracle:.3f}\n")
    print("| policy | token hit rate | vs oracle | max/mean load | load CoV | TTFT p50 s | TTFT p90 s | sim s |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['policy']} | {r['hit_rate']:.3f} | {r['hit_rate'] / oracle:.3f} | {r['max_mean_load']:.2f} "
              f"| {r['load_cov']:.3f} | {r['ttft_p50_s']:.3f} | {r['ttft_p90_s']:.3f} | {r['wall_s']:.1f} |")
    by = {r["policy"]: r for r in rows}
    out: dict = {"workload": w.name, "replicas": args.replicas, "requests": args.requests, "oracle_hit_rate": oracle}
    if "ours" in by:
        ours = by["ours"]
        out.update({"hit_rate": ours["hit_rate"], "hit_rate_over_oracle": ours["hit_rate"] / oracle,
                    "max_mean_load": ours["max_mean_load"], "ttft_p50_s": ours["ttft_p50_s"]})
        for name in ("pow2", "ray_llm", "sglang", "round_robin", "consistent_hash", "ray_llm_reports",
                     "sglang_reports", "clairvoyant"):
            if name in by:
                out[f"hit_rate_vs_{name}"] = ours["hit_rate"] / max(by[name]["hit_rate"], 1e-9)
                out[f"max_mean_load_{name}"] = by[name]["max_mean_load"]
    if args.plot:
        _plot(rows, oracle, w.name, Path(args.plot))
    print(json.dumps(out))
    return out


def _plot(rows: list[dict], oracle: float, name: str, path: Path) -> None:
    fig, (a, b) = plots.subplots(1, 2, figsize=(11, 4))
    names = [r["policy"] for r in rows]
    a.bar(names, [r["hit_rate"] for r in rows], color=["tab:green" if n == "ours" else "tab:gray" for n in names])
    a.axhline(oracle, ls="--", color="k", label=f"oracle {oracle:.2f}")
    a.set_ylabel("token hit rate")
    a.legend()
    b.bar(names, [r["max_mean_load"] for r in rows], color=["tab:green" if n == "ours" else "tab:gray" for n in names])
    b.axhline(1.1, ls="--", color="r", label="goal 1.1")
    b.set_ylabel("max/mean work per replica")
    b.legend()
    for ax in (a, b):
        ax.tick_params(axis="x", rotation=30)
    plots.save(fig, path, f"routing simulator: {name}")


if __name__ == "__main__":
    main()
