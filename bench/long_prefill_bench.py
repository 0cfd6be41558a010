"""Time to first token of short prompts that arrive while long prompts prefill, with the scheduler's
long-prompt slots and spare chunk (now) against the scheduler as it was (long prompts took the whole
prefill budget), alternating in one run.

    python -m bench.long_prefill_bench [--longs 8] [--long-len 2048] [--shorts 4] [--short-len 32] [--repeats 3]

The bench model (written if missing), float32 on a CPU with one torch thread (bf16 on CUDA), the
default budget and chunk (4,096 / 512 tokens), prefix caching on, eager steps. The long prompts arrive
together; after the first step one short prompt arrives every step until ``--shorts`` have come. Prints
a final JSON line and writes ``docs/long_prefill_bench.png``.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path

import torch

from bench import plots
from bench.bench_model import load_bench_model
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.sequence import SamplingParams

ARMS = ("whole budget (before)", "long slots + spare chunk")


def run(loaded, arm: str, longs: list[list[int]], shorts: list[list[int]]) -> dict[str, float]:
    """TTFTs (s) of the short and the long prompts, and the whole run's time."""
    total = sum(map(len, longs + shorts)) + 64 * len(longs + shorts) + 1024
    eng = LLMEngine(EngineConfig(model_id=loaded.model_id, max_batch_total_tokens=total, cuda_graphs=()), loaded=loaded)
    if arm == ARMS[0]:  # the scheduler before: no long-prompt limit, nothing left for arrivals
        eng.scheduler.long_slots = 1 << 30
        eng.scheduler._first_admissible = lambda long_ok: None
    t0 = time.perf_counter()
    arrived: dict[str, float] = {}
    first: dict[str, float] = {}
    for i, p in enumerate(longs):
        arrived[f"L{i}"] = t0
        eng.add_request(p, SamplingParams(max_new_tokens=4, ignore_eos=True), request_id=f"L{i}")
    pending = [(f"S{i}", p) for i, p in enumerate(shorts)]
    steps = 0
    while eng.has_work():
        if steps >= 1 and pending:
            rid, p = pending.pop(0)
            arrived[rid] = time.perf_counter()
            eng.add_request(p, SamplingParams(max_new_tokens=4, ignore_eos=True), request_id=rid)
        events = eng.step()
        if loaded.device.type == "cuda":
            torch.cuda.synchronize()
        now = time.perf_counter()
        for ev in events:
            first.setdefault(ev.request_id, now - arrived[ev.request_id])
        steps += 1
    return {"short_ttft": statistics.mean(v for k, v in first.items() if k[0] == "S"),
            "long_ttft": statistics.mean(v for k, v in first.items() if k[0] == "L"),
            "total": time.perf_counter() - t0}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--longs", type=int, default=8)
    ap.add_argument("--long-len", type=int, default=2048)
    ap.add_argument("--shorts", type=int, default=4)
    ap.add_argument("--short-len", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--model-dir", default=None, help="default: the bench model (written if missing)")
    ap.add_argument("--out", default="docs")
    args = ap.parse_args(argv)
    loaded = load_bench_model(args.model_dir)
    runs: dict[str, list[dict[str, float]]] = {arm: [] for arm in ARMS}
    for r in range(args.repeats):
        rng = random.Random(r)  # fresh prompts each repeat (the engine of each arm starts with an empty cache)
        longs = [[rng.randrange(256) for _ in range(args.long_len)] for _ in range(args.longs)]
        shorts = [[rng.randrange(256) for _ in range(args.short_len)] for _ in range(args.shorts)]
        for arm in ARMS if r % 2 == 0 else reversed(ARMS):
            runs[arm].append(got := run(loaded, arm, longs, shorts))
            print(f"repeat {r} {arm:26s} " + "  ".join(f"{k} {v:6.2f} s" for k, v in got.items()), flush=True)
    med = {arm: {k: statistics.median(x[k] for x in rs) for k in rs[0]} for arm, rs in runs.items()}
    fig, ax = plots.subplots(figsize=(6, 3.6))
    keys = ("short_ttft", "long_ttft", "total")
    for i, arm in enumerate(ARMS):
        ax.bar([x + 0.38 * i for x in range(len(keys))], [med[arm][k] for k in keys], width=0.38, label=arm,
               color="tab:gray" if i == 0 else "tab:green")
    ax.set_xticks([x + 0.19 for x in range(len(keys))], ["short prompts' TTFT", "long prompts' TTFT", "whole run"])
    ax.set_ylabel("seconds (median of repeats)")
    ax.legend()
    plots.save(fig, Path(args.out) / "long_prefill_bench.png",
               f"{args.shorts} x {args.short_len}-token prompts arriving behind {args.longs} x {args.long_len}")
    before, after = med[ARMS[0]], med[ARMS[1]]
    out = {"short_ttft_after_over_before": after["short_ttft"] / before["short_ttft"],
           "long_ttft_after_over_before": after["long_ttft"] / before["long_ttft"],
           "total_after_over_before": after["total"] / before["total"],
           "short_ttft_s": {"before": before["short_ttft"], "after": after["short_ttft"]},
           "device": str(loaded.device)}
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
