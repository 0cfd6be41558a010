"""Cost of one routing decision: ``choose_replicas`` for an 8k-token prompt over 16 replicas.

    python -m bench.router_cost

Runs the Serve router's own decision code (hashing, stats folding, policy ranking) on stand-in
replica handles whose indexes are warm, and prints p50/p99 in microseconds plus a JSON line.
"""

from __future__ import annotations

import asyncio
import json
import random
import statistics
import time
from types import SimpleNamespace

from routing.prefix_router import PrefixAwareRequestRouter


def main(prompt_tokens: int = 8192, replicas: int = 16, rounds: int = 2000) -> dict:
    router = object.__new__(PrefixAwareRequestRouter)  # the decision code only; no Serve plumbing
    router.initialize_state(mode="prefix", block_size=16, model_id="bench")
    reps = [SimpleNamespace(replica_id=SimpleNamespace(unique_id=f"r{i}"),
                            routing_stats={"kv_total_blocks": 65536, "queue": 0, "seq": None})
            for i in range(replicas)]
    rng = random.Random(0)
    systems = [[rng.randrange(32000) for _ in range(prompt_tokens - 256)] for _ in range(32)]

    def pending():
        ids = rng.choice(systems) + [rng.randrange(32000) for _ in range(256)]
        return SimpleNamespace(args=[ids, {"max_new_tokens": 64}], kwargs={},
                               metadata=SimpleNamespace(internal_request_id=str(rng.random())))

    async def run() -> list[float]:
        samples = []
        for i in range(rounds):
            p = pending()
            t0 = time.perf_counter()
            ranks = await router.choose_replicas(reps, p)
            samples.append(time.perf_counter() - t0)
            chosen = ranks[0][0].replica_id
            router.on_request_routed(p, chosen, None)
            if i % 2:
                router.on_request_completed(chosen, p.metadata.internal_request_id)
        return samples

    samples = sorted(asyncio.run(run())[200:])  # after the indexes warm up
    p50 = statistics.median(samples) * 1e6
    p99 = samples[int(len(samples) * 0.99)] * 1e6
    print(f"choose_replicas, {prompt_tokens}-token prompt, {replicas} replicas: p50 {p50:.0f} µs, p99 {p99:.0f} µs"
          f" (router errors: {router.errors})")
    out = {"choose_replicas_p50_us": p50, "choose_replicas_p99_us": p99, "errors": router.errors}
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
