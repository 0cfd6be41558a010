"""Autoscaling: the cache-aware policy against Serve's requests-in-flight policy, under a light load
whose system prompts do not fit in one replica's KV pool.

    python -m bench.autoscale_bench

A local Ray cluster; the bench model; autoscaling from 1 to ``--max-replicas`` replicas with
``--total-tokens`` pools (each holds about half of the ``--groups`` 1,024-token system prompts);
``--concurrency`` clients (fewer than the requests target of 8 per replica, so Serve's policy never
adds a replica) send ``gsp`` prompts of random groups for ``--seconds`` each. Each policy runs on a
fresh deployment. Prints a table and a final JSON line with ``throughput_cache_over_requests``,
``ttft_p50_cache_over_requests`` and each run's cached share, replica-seconds and requests per
replica-second; plots the replicas and the cached share over time.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time
from pathlib import Path

import httpx

from bench import local_cluster, plots
from bench.http_load import one_request, wait_healthy
from bench.workloads import gsp


def deploy(policy: str, args, port: int) -> str:
    from ray import serve

    from app.config import Settings
    from app.main import build_app

    name = f"ab-{policy}"
    s = Settings(model_id=args.model_dir, replica_num_cpus=1, max_batch_total_tokens=args.total_tokens,
                 max_batch_prefill_tokens=2048, router="prefix", deployment_name=name, port=port,
                 autoscaling={"min_replicas": 1, "max_replicas": args.max_replicas, "policy": policy,
                              "upscale_delay_s": 5, "downscale_delay_s": 30, "look_back_period_s": 15})
    serve.run(build_app(s), name=name, route_prefix=f"/{name}")
    url = f"http://127.0.0.1:{port}/{name}"
    wait_healthy(url)
    return url


def running_replicas(name: str) -> int:
    from ray import serve

    app = serve.status().applications.get(name)
    return app.deployments[f"{name}-llm"].replica_states.get("RUNNING", 0) if app else 0


async def drive(url: str, name: str, args, prompts: list[list[int]]) -> dict:
    rng = random.Random(1)
    done: list[dict] = []
    timeline: list[tuple[float, int]] = []
    t0 = time.perf_counter()
    stop = t0 + args.seconds

    async def client(c: httpx.AsyncClient):
        while time.perf_counter() < stop:
            r = await one_request(c, rng.choice(prompts), args.max_tokens)
            done.append({"ok": r.ok and r.cached_share is not None, "end": r.end, "ttft": r.ttft_s,
                         "cached": r.cached_share})

    async def watch():
        while time.perf_counter() < stop:
            timeline.append((time.perf_counter() - t0, await asyncio.to_thread(running_replicas, name)))
            await asyncio.sleep(2.0)

    async with httpx.AsyncClient(base_url=url, timeout=600) as c:
        await asyncio.gather(watch(), *(client(c) for _ in range(args.concurrency)))
    ok = [d for d in done if d["ok"]]
    # replica-seconds: the running replicas, sampled every 2 s, over the run
    replica_s = sum(n * (timeline[i + 1][0] - t if i + 1 < len(timeline) else args.seconds - t)
                    for i, (t, n) in enumerate(timeline))
    for d in ok:
        d["t"] = d["end"] - t0
    return {"requests_ok": len(ok), "failed": len(done) - len(ok), "req_s": len(ok) / args.seconds,
            "ttft_p50_s": statistics.median(d["ttft"] for d in ok), "cached_share": statistics.mean(d["cached"] for d in ok),
            "replica_s": replica_s, "req_per_replica_s": len(ok) / replica_s, "max_replicas": max(n for _, n in timeline),
            "timeline": timeline, "per_request": [(round(d["t"], 2), round(d["cached"], 3)) for d in ok]}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-dir", default=local_cluster.BENCH_MODEL_DIR)
    ap.add_argument("--groups", type=int, default=6)
    ap.add_argument("--total-tokens", type=int, default=4096, help="KV pool per replica (3 system prompts)")
    ap.add_argument("--max-replicas", type=int, default=2)
    ap.add_argument("--concurrency", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--seconds", type=float, default=180.0, help="of load per policy")
    ap.add_argument("--plot", default="docs/autoscale_bench.png", help="PNG path ('' for none)")
    args = ap.parse_args(argv)
    from ray import serve

    prompts = [r.prompt for r in gsp(num_groups=args.groups, prompts_per_group=8)]
    port = local_cluster.start(args.model_dir)
    rows = {}
    try:
        for policy in ("requests", "cache"):
            url = deploy(policy, args, port)
            rows[policy] = asyncio.run(drive(url, f"ab-{policy}", args, prompts))
            serve.delete(f"ab-{policy}")
            r = rows[policy]
            print(f"{policy}: {r['requests_ok']} ok ({r['failed']} failed), {r['req_s']:.2f} req/s, TTFT p50 "
                  f"{r['ttft_p50_s']:.2f}s, cached share {r['cached_share']:.2f}, up to {r['max_replicas']} replicas, "
                  f"{r['replica_s']:.0f} replica-s", flush=True)
    finally:
        local_cluster.stop()
    print("\n| policy | requests ok | req/s | TTFT p50 s | cached share | most replicas | replica-s | req per replica-s |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for policy, r in rows.items():
        print(f"| {policy} | {r['requests_ok']} | {r['req_s']:.2f} | {r['ttft_p50_s']:.2f} | {r['cached_share']:.2f} | "
              f"{r['max_replicas']} | {r['replica_s']:.0f} | {r['req_per_replica_s']:.3f} |")
    if args.plot:
        plot(rows, Path(args.plot), args)
    out = {k: {kk: v for kk, v in r.items() if kk not in ("timeline", "per_request")} for k, r in rows.items()}
    out["throughput_cache_over_requests"] = rows["cache"]["req_s"] / rows["requests"]["req_s"]
    out["ttft_p50_cache_over_requests"] = rows["cache"]["ttft_p50_s"] / rows["requests"]["ttft_p50_s"]
    print(json.dumps(out))
    return out


def plot(rows: dict, path: Path, args) -> None:
    fig, (top, bottom) = plots.subplots(2, 1, figsize=(8, 5.5), sharex=True)
    colors = {"cache": "tab:green", "requests": "tab:gray"}
    for policy, r in rows.items():
        t, n = zip(*r["timeline"], strict=True)
        top.step(t, n, where="post", color=colors[policy], label=policy)
        pts = r["per_request"]
        win = 20  # requests per point: a moving mean of the cached share
        xs = [pts[i][0] for i in range(win - 1, len(pts))]
        ys = [statistics.mean(p[1] for p in pts[i - win + 1:i + 1]) for i in range(win - 1, len(pts))]
        bottom.plot(xs, ys, color=colors[policy], label=policy)
    top.set_ylabel("running replicas")
    top.set_yticks(range(0, args.max_replicas + 2))
    top.legend()
    bottom.set_ylabel("cached share of prompt\n(moving mean, 20 requests)")
    bottom.set_xlabel("seconds of load")
    bottom.set_ylim(0, 1)
    plots.save(fig, path, f"Autoscaling 1-{args.max_replicas} replicas, {args.groups} system prompts, "
                          f"{args.concurrency} clients")


if __name__ == "__main__":
    main()
