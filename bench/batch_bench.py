"""Batch jobs: ``radixserve batch`` in prefix order against the same file sent in its own (shuffled) order.

    python -m bench.batch_bench

A local Ray cluster, 2 replicas of the bench model whose KV pools (``--total-tokens`` each) hold fewer
system prompts than the file has groups; ``gsp`` with ``--groups`` groups of ``--per-group`` prompts
(1,024-token system prompt, 64-token question), ``--max-tokens`` generated each, ``--concurrency`` in
flight. Each order runs on a fresh deployment (cold caches). Prints a table and a final JSON line with
``prefix_order_speedup`` (wall time, file order over prefix order) and both runs' cached shares.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
from pathlib import Path

from app import batch
from bench import local_cluster
from bench.plots import bar_panels
from bench.serve_bench import deploy
from bench.workloads import gsp


def run_batch(url: str, src: Path, keep_order: bool, concurrency: int, max_tokens: int) -> dict:
    out = Path(tempfile.mkdtemp()) / "out.jsonl"
    parser = argparse.ArgumentParser()
    batch.add_arguments(parser)  # the command's own defaults (retries, timeouts)
    args = parser.parse_args(["--input", str(src), "--output", str(out), "--url", url, "--concurrency", str(concurrency),
                              "--max-tokens", str(max_tokens)] + (["--keep-order"] if keep_order else []))
    totals: dict = {}
    asyncio.run(batch.run(args, totals))
    return batch.summary(totals)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-dir", default=local_cluster.BENCH_MODEL_DIR)
    ap.add_argument("--groups", type=int, default=16)
    ap.add_argument("--per-group", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--total-tokens", type=int, default=4096, help="KV pool per replica (3-4 system prompts)")
    ap.add_argument("--plot", default="docs/batch_bench.png", help="PNG path ('' for none)")
    args = ap.parse_args(argv)
    from ray import serve

    src = Path(tempfile.mkdtemp()) / "prompts.jsonl"
    reqs = gsp(num_groups=args.groups, prompts_per_group=args.per_group)  # shuffled: groups interleave
    src.write_text("".join(json.dumps({"id": str(i), "prompt": r.prompt, "ignore_eos": True}) + "\n"
                           for i, r in enumerate(reqs)))
    port = local_cluster.start(args.model_dir)
    rows = {}
    try:
        for order in ("file", "prefix"):
            name = f"bb-{order}"
            url = deploy("prefix", args.model_dir, port, args.total_tokens, name)
            rows[order] = run_batch(url, src, order == "file", args.concurrency, args.max_tokens)
            serve.delete(name)
            print(f"{order} order: {json.dumps(rows[order])}", flush=True)
    finally:
        local_cluster.stop()
    print("\n| order | requests ok | wall s | cached share of prompt tokens | prompt tokens computed |")
    print("|---|---:|---:|---:|---:|")
    for order, r in rows.items():
        print(f"| {order} | {r['ok']}/{r['to_send']} | {r['wall_s']:.1f} | {r['cached_share']:.3f} | "
              f"{r['prompt_tokens'] - r['cached_tokens']} |")
    out = {"rows": rows, "prefix_order_speedup": rows["file"]["wall_s"] / rows["prefix"]["wall_s"],
           "cached_share_file": rows["file"]["cached_share"], "cached_share_prefix": rows["prefix"]["cached_share"]}
    if args.plot:
        plot(rows, Path(args.plot), args)
    print(json.dumps(out))
    return out


def plot(rows: dict, path: Path, args) -> None:
    bar_panels(rows, [("wall_s", "wall time (s)"), ("cached_share", "cached share of prompt tokens")],
               f"radixserve batch: {args.groups} groups x {args.per_group}, 2 replicas x {args.total_tokens} tokens", path)

if __name__ == "__main__":
    main()
