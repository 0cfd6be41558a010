"""A saturated fleet: how fast Serve finds a free slot behind the prefix router's ranks.

    python -m bench.saturation_bench

A local Ray cluster, ``--replicas`` stand-in replicas (no model: each request sleeps ``--service-ms``)
at ``--max-ongoing`` requests each, and ``--concurrency`` callers on one handle, far more than the fleet
runs at once, so every routing decision meets full replicas. The routers, alternating, on fresh
deployments: ``singles`` (as shipped: every replica a rank of its own, which Serve probes one after
another when its cached queue lengths say they are full), ``tiers`` (an alternative: the prefix's
holders and the copy target as single ranks, the other replicas as one rank, which Serve probes at
once) and Serve's own power-of-two router (``pow2``) for reference. Prints each run and a final JSON
line with ``throughput_tiers_over_singles`` and ``throughput_singles_over_pow2`` (the ideal is
``replicas x max_ongoing / service time``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time

from bench import local_cluster
from routing.prefix_router import PrefixAwareRequestRouter

ROUTERS = {"singles": "routing.prefix_router:PrefixAwareRequestRouter",
           "tiers": "bench.saturation_bench:TiersRouter",
           "pow2": None}  # Serve's own, for reference: it ranks two replicas at a time


class TiersRouter(PrefixAwareRequestRouter):
    """The same ranking; the first choice, the prefix's other holders and the next replica (where a
    copy would land) alone, the rest in one rank."""

    def _choose(self, candidates, pending):
        flat = [r for rank in super()._choose(candidates, pending) for r in rank]
        holders = self.policy.matches(self._hashes(pending))
        alone = 2 + sum(1 for r in flat[1:] if r.replica_id.unique_id in holders)
        return [[r] for r in flat[:alone]] + ([flat[alone:]] if len(flat) > alone else [])


def deploy(router: str, args) -> object:
    from ray import serve
    from ray.serve.config import RequestRouterConfig

    @serve.deployment(num_replicas=args.replicas, max_ongoing_requests=args.max_ongoing,
                      ray_actor_options={"num_cpus": 0},
                      request_router_config=RequestRouterConfig(request_routing_stats_period_s=1.0) if ROUTERS[router]
                      is None else RequestRouterConfig(
                          request_router_class=ROUTERS[router],
                          request_router_kwargs={"mode": "prefix", "block_size": 16, "model_id": "sat"},
                          request_routing_stats_period_s=1.0))
    class StandIn:
        async def generate(self, ids: list[int], params: dict, rid: str) -> int:
            await asyncio.sleep(params["service_s"])
            return len(ids)

    name = f"sat-{router}"
    return serve.run(StandIn.bind(), name=name, route_prefix=None).options(method_name="generate")


async def drive(handle, args, rng: random.Random) -> float:
    """Requests per second over ``--requests`` calls from ``--concurrency`` callers."""
    params = {"service_s": args.service_ms / 1000, "max_new_tokens": 1}
    todo = iter(range(16))  # first, warm the routers (and Serve's queue-length cache)

    async def caller() -> None:
        for i in todo:
            prompt = [rng.randrange(3, 32000) for _ in range(64)]  # cold: no replica holds it
            await handle.remote(prompt, params, f"req-{i}")

    await asyncio.gather(*(caller() for _ in range(8)))
    todo = iter(range(args.requests))
    t0 = time.perf_counter()
    await asyncio.gather(*(caller() for _ in range(args.concurrency)))
    return args.requests / (time.perf_counter() - t0)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--replicas", type=int, default=8)
    ap.add_argument("--max-ongoing", type=int, default=2)
    ap.add_argument("--service-ms", type=float, default=100.0)
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--requests", type=int, default=800)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args(argv)
    from ray import serve

    local_cluster.start(local_cluster.BENCH_MODEL_DIR)
    ideal = args.replicas * args.max_ongoing / (args.service_ms / 1000)
    rates: dict[str, list[float]] = {r: [] for r in ROUTERS}
    try:
        for n in range(args.rounds):
            for router in list(ROUTERS) if n % 2 == 0 else reversed(ROUTERS):
                handle = deploy(router, args)
                rate = asyncio.run(drive(handle, args, random.Random(n)))
                serve.delete(f"sat-{router}")
                rates[router].append(rate)
                print(f"round {n} {router}: {rate:.1f} req/s ({rate / ideal:.2f} of the ideal {ideal:.0f})", flush=True)
    finally:
        local_cluster.stop()
    out = {"replicas": args.replicas, "max_ongoing": args.max_ongoing, "service_ms": args.service_ms,
           "concurrency": args.concurrency, "ideal_rps": ideal,
           **{f"rps_{r}": statistics.median(v) for r, v in rates.items()},
           "throughput_tiers_over_singles": statistics.median(rates["tiers"]) / statistics.median(rates["singles"]),
           "throughput_singles_over_pow2": statistics.median(rates["singles"]) / statistics.median(rates["pow2"])}
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
