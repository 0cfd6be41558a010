"""Warm-up benchmark: replicas that start after traffic has made some prefixes hot, with and without
prefilling the Redis directory's top-K before they take traffic.

    python -m bench.warmup_bench

Per variant (cold: ``warmup_top_k=0``; warm: ``--warm-top-k``, the default's 16), in one run on a local Ray cluster
with the bench model: Zipf ``gsp`` traffic on 1 replica, then the deployment goes to 2 replicas (Serve's
Python API starts both afresh), and the next requests all land on new replicas. Reports their TTFT
p50 and how much of the new replicas' first requests was already cached. Final JSON line with
``warm_over_cold_ttft_p50`` and ``warm_first_request_hit_rate``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time

from bench import local_cluster
from bench.http_load import metric_samples, run_load, wait_healthy
from bench.workloads import gsp


def metrics(url: str, name: str) -> dict[str, float]:
    return {s.labels["replica"]: s.value for s in metric_samples(url)
            if s.name == name and s.labels.get("replica") != "all"}


def run_variant(name: str, top_k: int, model_dir: str, redis_url: str, port: int, before, after, args) -> dict:
    from ray import serve

    from app.config import Settings
    from app.main import build_app

    def deploy(n: int) -> str:
        s = Settings(model_id=model_dir, num_replicas=n, replica_num_cpus=1, max_batch_total_tokens=16384,
                     redis_url=redis_url, deployment_name=name, warmup_top_k=top_k, router="prefix")
        serve.run(build_app(s), name=name, route_prefix=f"/{name}")
        url = f"http://127.0.0.1:{port}/{name}"
        wait_healthy(url)
        return url

    url = deploy(1)
    asyncio.run(run_load(url, [r.prompt for r in before], before[0].max_new_tokens, args.concurrency))
    time.sleep(3)  # the replica flushes its hot prefixes to the directory every second
    old = set(metrics(url, "radixserve_cache_blocks_total"))
    t0 = time.perf_counter()
    url = deploy(2)
    start_s = time.perf_counter() - t0
    deadline = time.monotonic() + 60  # wait for the new replicas' first metrics
    while time.monotonic() < deadline and len(set(metrics(url, "radixserve_cache_blocks_total")) - old) < 2:
        time.sleep(0.5)
    # Two tiny requests (shorter than a block: nothing to hit) open the new ingress' routing path, so
    # the measured TTFTs are about the replicas' caches, not the handle's start-up.
    asyncio.run(run_load(url, [[5, 6, 7, 8], [9, 10, 11, 12]], 1, 1))
    res = asyncio.run(run_load(url, [r.prompt for r in after], after[0].max_new_tokens, args.concurrency))
    time.sleep(2.5)
    first = {r: v for r, v in metrics(url, "radixserve_first_request_cached_tokens").items() if r not in old}
    hits = sum(v for r, v in metrics(url, "radixserve_prefix_cache_hits_total").items() if r not in old)
    queries = sum(v for r, v in metrics(url, "radixserve_prefix_cache_queries_total").items() if r not in old)
    serve.delete(name)
    served_first = [v for v in first.values() if v >= 0]
    return {"variant": name, "warmup_top_k": top_k, "scale_up_s": start_s, "ttft_p50_s": res["ttft_p50_s"],
            "ttft_p90_s": res["ttft_p90_s"], "first_requests_ttft_p50_s": _p50(res["ttfts"][: args.first]),
            "first_request_hit_rate": (sum(v > 0 for v in served_first) / len(served_first)) if served_first else 0.0,
            "first_request_cached_tokens": served_first, "token_hit_rate_after": hits / queries if queries else 0.0,
            "ok": res["ok"], "requests": res["requests"]}


def _p50(xs):
    xs = sorted(x for x in xs if x is not None)
    return xs[len(xs) // 2] if xs else float("nan")


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-dir", default=local_cluster.BENCH_MODEL_DIR)
    ap.add_argument("--before", type=int, default=48, help="requests on the single replica")
    ap.add_argument("--after", type=int, default=24, help="requests after scaling to 2")
    ap.add_argument("--first", type=int, default=8, help="how many of them count as 'first requests'")
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--warm-top-k", type=int, default=16, help="warmup_top_k of the warm variant (default: the default)")
    args = ap.parse_args(argv)
    from app.local_redis import LocalRedis

    reqs = gsp(num_groups=16, zipf_alpha=1.0, num_requests=args.before + args.after, seed=3)
    before, after = reqs[: args.before], reqs[args.before:]
    port = local_cluster.start(args.model_dir)
    rows = []
    with LocalRedis() as redis:
        try:
            for name, k in (("wb-cold", 0), ("wb-warm", args.warm_top_k)):
                rows.append(run_variant(name, k, args.model_dir, redis.url, port, before, after, args))
                print(json.dumps({k: v for k, v in rows[-1].items()}), flush=True)
        finally:
            local_cluster.stop()
    cold, warm = rows
    print("\n| variant | scale-up s | TTFT p50 s (first requests) | TTFT p50 s (all after) | first requests hit | "
          "token hit rate after |")
    print("|---|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['variant']} | {r['scale_up_s']:.1f} | {r['first_requests_ttft_p50_s']:.2f} | {r['ttft_p50_s']:.2f} |"
              f" {r['first_request_hit_rate']:.2f} | {r['token_hit_rate_after']:.2f} |")
    out = {"warm_over_cold_ttft_p50": warm["first_requests_ttft_p50_s"] / cold["first_requests_ttft_p50_s"],
           "warm_over_cold_ttft_p50_all_after": warm["ttft_p50_s"] / cold["ttft_p50_s"],
           "warm_first_request_hit_rate": warm["first_request_hit_rate"],
           "cold_first_request_hit_rate": cold["first_request_hit_rate"],
           "warm_scale_up_s": warm["scale_up_s"], "cold_scale_up_s": cold["scale_up_s"]}
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
