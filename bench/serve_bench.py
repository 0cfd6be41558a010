"""End-to-end routing benchmark: the prefix router against Serve's power-of-two, over real HTTP.

    python -m bench.serve_bench                      # both routers, side by side, one run
    python -m bench.serve_bench --router prefix      # one router only

A local Ray cluster, 2 replicas of the bench model with ``--total-tokens`` of KV pool each (8192, the
issue's figure, holds all 8 system prompts of 1,024 tokens; ``--total-tokens 5120`` holds about half),
``gsp-small`` with 16 prompts per group (128 requests), streamed over HTTP at concurrency 8. Prints a
table and a final JSON line.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from pathlib import Path

from bench import local_cluster
from bench.http_load import metric_samples, run_load, wait_healthy
from bench.plots import bar_panels
from bench.workloads import gsp


def deploy(router: str, model_dir: str, port: int, total_tokens: int, name: str, chunk: int = 512):
    from ray import serve

    from app.config import Settings
    from app.main import build_app

    s = Settings(model_id=model_dir, num_replicas=2, replica_num_cpus=1, max_batch_total_tokens=total_tokens,
                 max_batch_prefill_tokens=2048, max_prefill_chunk_tokens=chunk, router=router, deployment_name=name,
                 port=port)
    serve.run(build_app(s), name=name, route_prefix=f"/{name}")
    url = f"http://127.0.0.1:{port}/{name}"
    wait_healthy(url)
    return url


def fleet_metrics(url: str) -> tuple[float, float]:
    """(prefix-cache hit rate, engine-side TTFT p50 interpolated in its histogram), all replicas."""
    hit, buckets = float("nan"), []
    for s in metric_samples(url):
        if s.labels.get("replica") != "all":
            continue
        if s.name == "radixserve_cache_hit_rate":
            hit = s.value
        elif s.name == "radixserve_time_to_first_token_seconds_bucket":
            buckets.append((float(s.labels["le"]), s.value))
    buckets.sort()
    if not buckets or not buckets[-1][1]:
        return hit, float("nan")
    half, lo_le, lo_n = buckets[-1][1] / 2, 0.0, 0.0
    for le, n in buckets:
        if n >= half:
            if le == float("inf"):
                return hit, lo_le
            return hit, lo_le + (le - lo_le) * (half - lo_n) / max(n - lo_n, 1e-9)
        lo_le, lo_n = le, n
    return hit, float("nan")


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--router", choices=["prefix", "pow2", "both"], default="both")
    ap.add_argument("--model-dir", default=local_cluster.BENCH_MODEL_DIR)
    ap.add_argument("--per-group", type=int, default=16)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--total-tokens", type=int, default=8192)
    ap.add_argument("--prefill-chunk", type=int, default=512, help="max_prefill_chunk_tokens of both deployments")
    ap.add_argument("--plot", default="docs/serve_bench.png", help="PNG path ('' for none)")
    args = ap.parse_args(argv)
    from ray import serve

    port = local_cluster.start(args.model_dir)
    reqs = gsp(num_groups=8, prompts_per_group=args.per_group)
    prompts = [r.prompt for r in reqs]
    routers = ["pow2", "prefix"] if args.router == "both" else [args.router]
    rows = {}
    try:
        for router in routers:
            name = f"sb-{router}"
            url = deploy(router, args.model_dir, port, args.total_tokens, name, args.prefill_chunk)
            asyncio.run(run_load(url, [[5] * 64], 2, 1))  # warm the path (4 blocks that start no prompt of the workload)
            res = asyncio.run(run_load(url, prompts, reqs[0].max_new_tokens, args.concurrency))
            time.sleep(2.5)  # let the replicas push their metrics
            res["hit_rate"], res["engine_ttft_p50_s"] = fleet_metrics(url)
            res["out_tok_s"] = res["ok"] * reqs[0].max_new_tokens / res["wall_s"]
            rows[router] = res
            serve.delete(name)
            print(f"{router}: {res['ok']}/{res['requests']} ok in {res['wall_s']:.1f}s, {res['out_tok_s']:.1f} out tok/s,"
                  f" TTFT p50 {res['ttft_p50_s']:.2f}s p90 {res['ttft_p90_s']:.2f}s (in the engine"
                  f" ~{res['engine_ttft_p50_s']:.2f}s), hit rate {res['hit_rate']:.2f}; {res['hit_requests']:.0%} of"
                  f" requests found most of their prompt cached (TTFT p50 {res['ttft_p50_hit_s']:.2f}s, the others"
                  f" {res['ttft_p50_miss_s']:.2f}s)",
                  flush=True)
    finally:
        local_cluster.stop()
    print("\n| router | requests ok | wall s | output tok/s | TTFT p50 s | TTFT p90 s | cache hit rate "
          "| requests that hit | their TTFT p50 s |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for router, r in rows.items():
        print(f"| {router} | {r['ok']}/{r['requests']} | {r['wall_s']:.1f} | {r['out_tok_s']:.1f} | "
              f"{r['ttft_p50_s']:.2f} | {r['ttft_p90_s']:.2f} | {r['hit_rate']:.2f} | {r['hit_requests']:.2f} "
              f"| {r['ttft_p50_hit_s']:.2f} |")
    out = {k: {kk: v for kk, v in r.items() if kk != "ttfts"} for k, r in rows.items()}
    if args.plot:
        plot(out, Path(args.plot))
    if len(rows) == 2:
        out["throughput_prefix_over_pow2"] = rows["prefix"]["out_tok_s"] / rows["pow2"]["out_tok_s"]
        out["ttft_p50_prefix_over_pow2"] = rows["prefix"]["ttft_p50_s"] / rows["pow2"]["ttft_p50_s"]
    print(json.dumps(out))
    return out


def plot(rows: dict, path: Path) -> None:
    bar_panels({k: r for k, r in rows.items() if isinstance(r, dict)},
               [("out_tok_s", "output tokens/s"), ("ttft_p50_s", "TTFT p50 (s)"), ("hit_rate", "prefix cache hit rate")],
               "2 replicas, bench model, gsp-small x16 over HTTP, concurrency 8", path)

if __name__ == "__main__":
    main()
