"""The sampler's time per step against a row-by-row baseline, side by side in one run.

The baseline is the textbook way (and this engine's until now): each row filtered on its own, top-p by
a full sort of its vocabulary, the probabilities copied to the host and drawn with ``torch.multinomial``.
``engine.sampler.sample`` draws every row at once and looks for the top-p cut among the best tokens
first. Rows are random logits (scale 3, peaked like a model's), each request with its own seed; in
the last kind one row is nearly flat, so its cut lies past the first candidates.

    python -m bench.sampler_bench [--repeats 5] [--out docs/sampler_bench.png]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from engine.sampler import make_generator, sample
from engine.sequence import SamplingParams, Sequence

SHAPES = ((32, 32000), (64, 128256))  # (rows, vocabulary): a Llama-2 and a Llama-3 vocabulary
KINDS = {"greedy": {}, "temperature": {"temperature": 0.8}, "top_k 50": {"temperature": 0.8, "top_k": 50},
         "top_p 0.95": {"temperature": 0.8, "top_p": 0.95}, "top_p, 1 flat row": {"temperature": 0.8, "top_p": 0.95}}
FLAT_ROW = "top_p, 1 flat row"  # one nearly uniform row (its top-p cut lies far down) among peaked ones


def baseline(logits: torch.Tensor, seqs: list[Sequence]) -> list[int]:
    """One row at a time: temperature, top-k, top-p by a full sort, then a draw on the host."""
    out = []
    for row, seq in zip(logits, seqs, strict=True):
        p = seq.params
        if p.greedy:
            out.append(int(row.argmax()))
            continue
        row = row / p.temperature
        if p.top_k:
            row = row.masked_fill(row < torch.topk(row, p.top_k).values[-1], float("-inf"))
        if p.top_p < 1.0:
            sorted_logits, order = torch.sort(row, descending=True)
            probs = torch.softmax(sorted_logits, -1)
            drop = probs.cumsum(-1) - probs >= p.top_p
            row = row.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))
        out.append(int(torch.multinomial(torch.softmax(row, -1).cpu(), 1, generator=seq.generator)))
    return out


def requests(n: int, params: dict) -> list[Sequence]:
    seqs = []
    for i in range(n):
        s = Sequence(str(i), [1, 2, 3], SamplingParams(seed=i, **params))
        if not s.params.greedy:
            s.generator = make_generator(i)
        seqs.append(s)
    return seqs


def per_step(fn, logits: torch.Tensor, seqs: list[Sequence], repeats: int) -> float:
    fn(logits, seqs)  # warm-up
    t = time.perf_counter()
    for _ in range(repeats):
        fn(logits, seqs)
    return (time.perf_counter() - t) / repeats


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=Path("docs/sampler_bench.png"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    rows: dict[str, dict] = {}
    print(f"{'rows x vocab':>14} {'kind':>12} {'ours ms':>9} {'baseline ms':>12} {'speed-up':>9}")
    for n, vocab in SHAPES:
        logits = torch.randn(n, vocab) * 3
        for kind, params in KINDS.items():
            if kind == FLAT_ROW:
                logits = logits.clone()
                logits[0] = torch.randn(vocab) * 0.01
            ours = per_step(sample, logits, requests(n, params), args.repeats)
            base = per_step(baseline, logits, requests(n, params), args.repeats)
            rows[f"{n}x{vocab // 1000}k {kind}"] = {"ours_ms": ours * 1e3, "baseline_ms": base * 1e3, "speedup": base / ours}
            print(f"{n:>5} x {vocab:>6} {kind:>12} {ours * 1e3:9.1f} {base * 1e3:12.1f} {base / ours:8.2f}x")
    plot(rows, args.out)
    print(json.dumps({"top_p_speedup_32k": rows["32x32k top_p 0.95"]["speedup"],
                      "top_p_speedup_128k": rows["64x128k top_p 0.95"]["speedup"],
                      "min_speedup": min(r["speedup"] for r in rows.values())}))


def plot(rows: dict[str, dict], path: Path) -> None:
    from bench.plots import save, subplots

    names = list(rows)
    fig, ax = subplots(figsize=(10, 3.8))
    x = range(len(names))
    ax.bar([i - 0.2 for i in x], [rows[k]["baseline_ms"] for k in names], 0.4, label="row by row, full sort",
           color="tab:gray")
    ax.bar([i + 0.2 for i in x], [rows[k]["ours_ms"] for k in names], 0.4, label="engine.sampler", color="tab:green")
    ax.set_xticks(list(x), names, rotation=30, ha="right")
    ax.set_yscale("log")
    ax.set_ylabel("ms per step (CPU)")
    ax.legend()
    save(fig, path, "Sampling one token per row")


if __name__ == "__main__":
    main()
