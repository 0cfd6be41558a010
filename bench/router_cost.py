"""Cost of one routing decision: ``choose_replicas`` for an 8k-token prompt over 16 replicas.

    python -m bench.router_cost [--report-hashes 2000] [--report-every 500]

Runs the Serve router's own decision code (hashing, stats folding, policy ranking) on stand-in
replica handles whose indexes are warm, and prints p50/p99 in microseconds plus a JSON line. Four
runs, side by side: decisions back to back with replicas that report nothing (the issue's figure);
then requests arriving every 2 ms (open loop: a stalled event loop delays every request that arrives
meanwhile, which the time from arrival to decision shows), first with no reports, then with replicas
that each report, every ``--report-every`` requests (a 1 s stats period), ``--report-hashes`` stored
and as many evicted blocks (32k prompt tokens a second of new prefill per replica), folded the way the router does (in
short slices of its event loop between decisions); and the same reports folded whole inside the
decision that first sees them (as the router did before).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time
from types import SimpleNamespace

from cache.hashing import pack_hashes
from routing.prefix_router import PrefixAwareRequestRouter


def run_once(prompt_tokens: int, replicas: int, rounds: int, report_hashes: int, report_every: int,
             gap_s: float, whole: bool = False) -> dict:
    router = object.__new__(PrefixAwareRequestRouter)  # the decision code only; no Serve plumbing
    router.initialize_state(mode="prefix", block_size=16, model_id="bench")
    if whole:  # as the router did before: every report folded at once, inside the decision that sees it
        router._fold_soon = lambda: router._fold(1e9)
    reps = [SimpleNamespace(replica_id=SimpleNamespace(unique_id=f"r{i}"),
                            routing_stats={"kv_total_blocks": 65536, "queue": 0, "seq": None})
            for i in range(replicas)]
    rng = random.Random(0)
    systems = [[rng.randrange(32000) for _ in range(prompt_tokens - 256)] for _ in range(32)]
    stored_before: dict[str, list[int]] = {}

    def pending():
        ids = rng.choice(systems) + [rng.randrange(32000) for _ in range(256)]
        return SimpleNamespace(args=[ids, {"max_new_tokens": 64}], kwargs={},
                               metadata=SimpleNamespace(internal_request_id=str(rng.random())))

    def publish(seq: int) -> None:
        for r in reps:
            rid = r.replica_id.unique_id
            stored = [rng.getrandbits(63) for _ in range(report_hashes)]
            r.routing_stats = {"kv_total_blocks": 65536, "queue": 1, "seq": seq, "truncated": False,
                               "stored": pack_hashes(stored), "removed": pack_hashes(stored_before.get(rid, []))}
            stored_before[rid] = stored

    async def run() -> tuple[list[float], list[float]]:
        samples, delays = [], []
        loop = asyncio.get_running_loop()
        start = loop.time()
        for i in range(rounds):
            if report_hashes and i % report_every == 0:
                publish(i // report_every + 1)
            # open loop: request i arrives at start + i * gap whatever happened before, so a stalled loop
            # shows as the delay of every request that arrived during the stall
            arrival = start + i * gap_s
            await asyncio.sleep(max(0.0, arrival - loop.time()))
            p = pending()
            t0 = time.perf_counter()
            ranks = await router.choose_replicas(reps, p)
            samples.append(time.perf_counter() - t0)
            delays.append(loop.time() - arrival)
            chosen = ranks[0][0].replica_id
            router.on_request_routed(p, chosen, None)
            if i % 2:
                router.on_request_completed(chosen, p.metadata.internal_request_id)
        return samples, delays

    samples, delays = (sorted(x[200:]) for x in asyncio.run(run()))  # after the indexes warm up
    return {"p50_us": statistics.median(samples) * 1e6, "p99_us": samples[int(len(samples) * 0.99)] * 1e6,
            "max_us": samples[-1] * 1e6, "over_1ms": sum(s > 1e-3 for s in samples),
            "routed_p99_us": delays[int(len(delays) * 0.99)] * 1e6, "routed_max_us": delays[-1] * 1e6,
            "errors": router.errors, "backlog_dropped": router._backlog.dropped}


def main(prompt_tokens: int = 8192, replicas: int = 16, rounds: int = 3000, report_hashes: int = 2000,
         report_every: int = 500, gap_ms: float = 2.0) -> dict:
    args = (prompt_tokens, replicas, rounds)
    gap = gap_ms / 1000
    runs = {"back to back, no reports (the issue's figure)": run_once(*args, 0, report_every, 0.0),
            f"every {gap_ms:g} ms, no reports": run_once(*args, 0, report_every, gap),
            f"every {gap_ms:g} ms, reports folded between decisions (as shipped)":
                run_once(*args, report_hashes, report_every, gap),
            f"every {gap_ms:g} ms, reports folded whole in the decision (as before)":
                run_once(*args, report_hashes, report_every, gap, whole=True)}
    for name, r in runs.items():
        paced_line = "back to back" not in name
        print(f"choose_replicas, {prompt_tokens}-token prompt, {replicas} replicas, {name}: p50 {r['p50_us']:.0f} µs,"
              f" p99 {r['p99_us']:.0f} µs, max {r['max_us']:.0f} µs, {r['over_1ms']} over 1 ms"
              + (f"; arrival to decision p99 {r['routed_p99_us']:.0f} µs, max {r['routed_max_us']:.0f} µs"
                 if paced_line else "")
              + f" (router errors: {r['errors']}, backlog hashes let go: {r['backlog_dropped']})")
    back_to_back, paced, sliced, whole = runs.values()
    out = {"choose_replicas_p50_us": back_to_back["p50_us"], "choose_replicas_p99_us": back_to_back["p99_us"],
           "errors": sum(r["errors"] for r in runs.values()), "backlog_dropped": sliced["backlog_dropped"]}
    for key, r in (("paced", paced), ("with_reports", sliced), ("whole_reports", whole)):
        out |= {f"{key}_p99_us": r["p99_us"], f"{key}_max_us": r["max_us"], f"{key}_over_1ms": r["over_1ms"],
                f"{key}_arrival_to_decision_p99_us": r["routed_p99_us"],
                f"{key}_arrival_to_decision_max_us": r["routed_max_us"]}
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompt-tokens", type=int, default=8192)
    ap.add_argument("--replicas", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=3000)
    ap.add_argument("--report-hashes", type=int, default=2000, help="stored (and evicted) per replica per report")
    ap.add_argument("--report-every", type=int, default=500, help="decisions between two rounds of reports")
    ap.add_argument("--gap-ms", type=float, default=2.0, help="time between two requests' arrivals")
    a = ap.parse_args()
    main(a.prompt_tokens, a.replicas, a.rounds, a.report_hashes, a.report_every, a.gap_ms)
