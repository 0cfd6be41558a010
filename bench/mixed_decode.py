"""Decode step time when one long context runs beside many short ones: decode rows padded to the
longest context of the step (as before), against rows grouped by like lengths (``attention.length_chunks``),
alternating in one run, with a batch of like lengths as the control.

    python -m bench.mixed_decode [--long 4000] [--short 31] [--short-len 100] [--repeats 3]

Eager steps (no CUDA graphs), prefix caching off, the bench model (written if missing), float32 on a CPU
with one torch thread (bf16 on CUDA). Prints a final JSON line and writes ``docs/mixed_decode.png``.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path

import torch

import engine.attention as attention
from bench import plots
from bench.bench_model import load_bench_model
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.sequence import SamplingParams

DECODE_STEPS = 24  # timed decode steps per run (after the prefills and a few warm-up steps)


def decode_step_ms(loaded, prompts: list[list[int]]) -> float:
    """Median time of a decode step in which every prompt decodes."""
    eng = LLMEngine(EngineConfig(model_id=loaded.model_id, max_batch_total_tokens=sum(map(len, prompts)) + 64 * len(prompts) + 4096,
                                 max_num_seqs=len(prompts), prefix_caching=False, cuda_graphs=()), loaded=loaded)
    for p in prompts:
        eng.add_request(p, SamplingParams(max_new_tokens=DECODE_STEPS + 8, ignore_eos=True))
    times = []
    while eng.has_work():
        t = time.perf_counter()
        events = eng.step()
        if loaded.device.type == "cuda":
            torch.cuda.synchronize()
        if len(events) == len(prompts):
            times.append(time.perf_counter() - t)
    return statistics.median(times[3:]) * 1000


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--long", type=int, default=4000, help="the long context's prompt tokens")
    ap.add_argument("--short", type=int, default=31, help="short prompts beside it")
    ap.add_argument("--short-len", type=int, default=100)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--model-dir", default=None, help="default: the bench model (written if missing)")
    ap.add_argument("--out", default="docs")
    args = ap.parse_args(argv)
    loaded = load_bench_model(args.model_dir)
    rng = random.Random(0)

    def prompt(n: int) -> list[int]:
        return [rng.randrange(256) for _ in range(n)]

    batches = {"mixed": [prompt(args.long)] + [prompt(args.short_len) for _ in range(args.short)],
               "like lengths": [prompt(args.short_len + 30)] + [prompt(args.short_len) for _ in range(args.short)]}
    ratio = attention.CHUNK_PAD_RATIO
    runs: dict[tuple[str, str], list[float]] = {}
    for _ in range(args.repeats):
        for name, prompts in batches.items():
            for variant, pad_ratio in (("padded to the longest", float("inf")), ("length chunks", ratio)):
                attention.CHUNK_PAD_RATIO = pad_ratio
                try:
                    runs.setdefault((name, variant), []).append(decode_step_ms(loaded, prompts))
                finally:
                    attention.CHUNK_PAD_RATIO = ratio
    med = {k: statistics.median(v) for k, v in runs.items()}
    for (name, variant), ms in med.items():
        print(f"{name:13s} {variant:22s} decode step {ms:8.1f} ms  (runs: {', '.join(f'{x:.1f}' for x in runs[(name, variant)])})")
    fig, ax = plots.subplots(figsize=(6, 3.6))
    names = list(batches)
    for i, variant in enumerate(("padded to the longest", "length chunks")):
        ax.bar([x + 0.38 * i for x in range(len(names))], [med[(n, variant)] for n in names], width=0.38,
               label=variant, color="tab:gray" if i == 0 else "tab:green")
    ax.set_xticks([x + 0.19 for x in range(len(names))], [f"{n}\n({args.long if n == 'mixed' else args.short_len + 30} + "
                                                          f"{args.short} x {args.short_len})" for n in names])
    ax.set_ylabel("decode step, ms")
    ax.legend()
    plots.save(fig, Path(args.out) / "mixed_decode.png", "decode step: one long context beside short ones")
    out = {"mixed_chunked_over_padded": med[("mixed", "length chunks")] / med[("mixed", "padded to the longest")],
           "like_chunked_over_padded": med[("like lengths", "length chunks")] / med[("like lengths", "padded to the longest")],
           "mixed_padded_ms": med[("mixed", "padded to the longest")], "mixed_chunked_ms": med[("mixed", "length chunks")],
           "device": str(loaded.device)}
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
