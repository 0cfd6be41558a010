"""The scheduler's own cost in a burst of requests that share a long prefix nobody has cached yet (no
model: each step's chunks are marked computed and published, as the engine does after its forward).

    python -m bench.scheduler_bench [--requests 128] [--prefix 4032] [--question 64] [--chunk 512]

One request prefills the prefix in chunks; the others wait for its blocks rather than computing them
again. Prints each step's ``schedule()`` time and how many waiting requests it matched against the
radix cache, then a JSON line with the totals."""

from __future__ import annotations

import argparse
import json
import random
import time

from engine.kv_manager import KVManager
from engine.scheduler import Scheduler
from engine.sequence import SamplingParams, Sequence, Status

BS = 16


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=128)
    ap.add_argument("--prefix", type=int, default=4032, help="shared prompt tokens")
    ap.add_argument("--question", type=int, default=64, help="each request's own tokens after the prefix")
    ap.add_argument("--chunk", type=int, default=512, help="prefill chunk (and step budget) in tokens")
    args = ap.parse_args(argv)
    rng = random.Random(0)
    prompt_len = args.prefix + args.question
    kv = KVManager(args.requests * (prompt_len // BS + 4) + 64, BS, prefix_caching=True, model_id="bench")
    sch = Scheduler(kv, args.chunk * 8, max_num_seqs=args.requests * 2, max_prefill_chunk_tokens=args.chunk)
    prefix = [rng.randrange(32000) for _ in range(args.prefix)]
    seqs = [Sequence(str(i), prefix + [rng.randrange(32000) for _ in range(args.question)],
                     SamplingParams(max_new_tokens=1)) for i in range(args.requests)]
    for s in seqs:
        sch.add(s)
    real, matched = kv.match, [0]

    def counting(seq):
        matched[0] += 1
        return real(seq)

    kv.match = counting
    steps, total_s, total_matched = 0, 0.0, 0
    while any(s.status is Status.WAITING or s.num_uncomputed > 1 for s in seqs):
        matched[0] = 0
        t0 = time.perf_counter()
        plan = sch.schedule()
        dt = time.perf_counter() - t0
        for c in plan.chunks:  # the engine's forward, then what it does after one
            c.seq.num_computed += c.num_tokens
            kv.publish(c.seq)
            if c.seq.num_computed == c.seq.num_tokens:
                c.seq.output_ids.append(1)
        print(f"step {steps}: schedule {dt * 1e3:.2f} ms, {matched[0]} waiting requests matched, "
              f"{len(plan.chunks)} chunks, {sum(c.num_tokens for c in plan.chunks)} tokens")
        steps, total_s, total_matched = steps + 1, total_s + dt, total_matched + matched[0]
    out = {"requests": args.requests, "prefix": args.prefix, "steps": steps,
           "schedule_ms_total": round(total_s * 1e3, 2), "matches": total_matched}
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
