"""Where one engine step's time goes: runs gsp-small closed-loop (as ``bench.engine_bench``), times every
step by kind (prefill tokens, chunks, decodes) and profiles the first few steps that prefill over a cached
prefix with ``torch.profiler``. ``python -m bench.step_profile [--model-dir PATH] [--no-cache]``."""

from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict
from pathlib import Path

import torch

from bench.workloads import gsp
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.model_init import write_model
from engine.model_loader import load_model
from engine.sequence import SamplingParams


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model-dir", default=None, help="default: the bench model (written if missing)")
    ap.add_argument("--no-cache", action="store_true", help="prefix caching off")
    ap.add_argument("--profile-steps", type=int, default=2)
    args = ap.parse_args(argv)
    model_dir = Path(args.model_dir or Path.home() / ".cache" / "radixserve" / "models" / "bench")
    if not (model_dir / "config.json").exists():
        write_model(model_dir, "bench")
    loaded = load_model(str(model_dir))
    eng = LLMEngine(EngineConfig(model_id=loaded.model_id, prefix_caching=not args.no_cache,
                                 max_batch_total_tokens=65536), loaded=loaded)
    eng.capture_graphs()
    pending = list(gsp())
    inflight, profiled = 0, 0
    by_kind: dict[str, list[float]] = defaultdict(list)
    sync = torch.cuda.synchronize if loaded.device.type == "cuda" else (lambda: None)
    while pending or inflight:
        while pending and inflight < 8:
            r = pending.pop(0)
            eng.add_request(r.prompt, SamplingParams(max_new_tokens=r.max_new_tokens, ignore_eos=True))
            inflight += 1
        before = eng.stats.prefill_tokens_computed
        # a new request waits and the cache already holds prefixes: most likely a step of cache hits
        hot = (profiled < args.profile_steps and bool(eng.scheduler.num_waiting)
               and eng.kv_stats()["prefix_hit_tokens"] > 0)
        sync()
        t = time.perf_counter()
        if hot:
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]
                                        + ([torch.profiler.ProfilerActivity.CUDA] if loaded.device.type == "cuda" else [])
                                        ) as prof:
                events = eng.step()
                sync()
        else:
            events = eng.step()
            sync()
        took = time.perf_counter() - t
        tokens = eng.stats.prefill_tokens_computed - before
        kind = "decode-only" if tokens == 0 else f"prefill {'<=' if tokens <= 512 else '>'} 512 tokens"
        if not hot:  # the profiler's own cost stays out of the table
            by_kind[kind].append(took)
        if hot and tokens:
            profiled += 1
            print(f"\n## profiled step: {tokens} prefill tokens, {took * 1000:.1f} ms")
            print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=18))
        inflight -= sum(1 for e in events if e.finished)
    print("\n| step kind | steps | total s | mean ms | p90 ms |\n|---|---:|---:|---:|---:|")
    for kind, xs in sorted(by_kind.items()):
        xs.sort()
        print(f"| {kind} | {len(xs)} | {sum(xs):.2f} | {1000 * statistics.mean(xs):.1f} | "
              f"{1000 * xs[int(0.9 * (len(xs) - 1))]:.1f} |")


if __name__ == "__main__":
    main()
