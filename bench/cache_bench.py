"""Cache-core micro-benchmark: radix match/insert vs a naive linear scan, and eviction cost vs size.

    python -m bench.cache_bench [--quick]

Prints a markdown table and a final JSON line. Numbers are medians of repeated runs in one process.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

from cache.allocator import BlockAllocator
from cache.radix import RadixCache

BS = 16


def _median_us(fn, repeat: int) -> float:
    samples = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples) * 1e6


class NaiveCache:
    """The baseline: a list of cached prompts, each lookup scans them all for the longest prefix."""

    def __init__(self):
        self.entries: list[tuple[list[int], list[int]]] = []

    def insert(self, tokens, blocks):
        self.entries.append((tokens, blocks))

    def match(self, tokens):
        best: list[int] = []
        limit = (len(tokens) - 1) // BS
        for cached, blocks in self.entries:
            n = 0
            while n < limit and n < len(blocks) and cached[n * BS:(n + 1) * BS] == tokens[n * BS:(n + 1) * BS]:
                n += 1
            if n > len(best):
                best = blocks[:n]
        return best


def bench_lookup(prompt_len: int, num_prompts: int, repeat: int) -> dict:
    rng = random.Random(0)
    nblk = prompt_len // BS
    cache = RadixCache(BS)
    naive = NaiveCache()
    prompts = []
    next_block = 0
    # 16 groups: each prompt is its group's shared half (a system prompt) plus a unique half
    systems = [[rng.randrange(32000) for _ in range(prompt_len // 2)] for _ in range(16)]
    for i in range(num_prompts):
        toks = systems[i % 16] + [rng.randrange(32000) for _ in range(prompt_len - prompt_len // 2)]
        blocks = list(range(next_block, next_block + nblk))
        next_block += nblk
        cache.insert(toks, blocks)
        naive.insert(toks, blocks)
        prompts.append(toks)
    query = prompts[num_prompts // 2] + [1]
    assert len(cache.match(query).blocks) == len(naive.match(query)) == (len(query) - 1) // BS
    match_us = _median_us(lambda: cache.match(query), repeat)
    naive_us = _median_us(lambda: naive.match(query), max(3, repeat // 20))
    fresh = [[rng.randrange(32000) for _ in range(prompt_len)] for _ in range(repeat)]
    it = iter(fresh)

    def do_insert():
        cache.insert(next(it), list(range(next_block, next_block + nblk)))

    insert_us = _median_us(do_insert, repeat)
    return {"prompt_tokens": prompt_len, "cached_prompts": num_prompts, "match_us": match_us,
            "insert_us": insert_us, "naive_match_us": naive_us, "speedup": naive_us / match_us}


def bench_evict(num_blocks: int, repeat: int) -> dict:
    """Fill a cache with ``num_blocks`` blocks in 16-block prompts, then time evicting 16 blocks."""
    rng = random.Random(1)
    cache = RadixCache(BS)
    alloc = BlockAllocator(num_blocks, BS, cache)
    per = 16
    t0 = time.perf_counter()
    for _ in range(num_blocks // per):
        toks = [rng.randrange(32000) for _ in range(per * BS)]
        cache.insert(toks, alloc.allocate(per))
    fill_s = time.perf_counter() - t0
    samples = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        alloc.allocate(per)  # free list empty: evicts one LRU leaf of 16 blocks
        samples.append(time.perf_counter() - t0)
    per_block_us = statistics.median(samples) * 1e6 / per
    # naive: find the LRU leaf by scanning every node
    nodes = list(cache._iter_nodes())
    t0 = time.perf_counter()
    min((n for n in nodes if not n.children and not n.lock_ref), key=lambda n: n.last_access)
    naive_us = (time.perf_counter() - t0) * 1e6 / per
    return {"cached_blocks": num_blocks, "evict_us_per_block": per_block_us,
            "naive_scan_us_per_block": naive_us, "fill_s": fill_s}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true", help="smaller sizes (CI smoke run)")
    args = ap.parse_args(argv)
    lookups = [bench_lookup(n, 64 if args.quick else 256, 50 if args.quick else 200)
               for n in (1024, 4096, 32768)]
    sizes = (10_000, 100_000) if args.quick else (10_000, 100_000, 1_000_000)
    evicts = [bench_evict(n, 100 if args.quick else 400) for n in sizes]

    print("| prompt tokens | cached prompts | radix match µs | radix insert µs | naive scan µs | speedup |")
    print("|---:|---:|---:|---:|---:|---:|")
    for r in lookups:
        print(f"| {r['prompt_tokens']} | {r['cached_prompts']} | {r['match_us']:.1f} | {r['insert_us']:.1f}"
              f" | {r['naive_match_us']:.0f} | {r['speedup']:.0f}x |")
    print()
    print("| cached blocks | evict µs/block (LRU heap) | naive scan µs/block |")
    print("|---:|---:|---:|")
    for r in evicts:
        print(f"| {r['cached_blocks']:,} | {r['evict_us_per_block']:.2f} | {r['naive_scan_us_per_block']:.0f} |")
    flat = evicts[-1]["evict_us_per_block"] / evicts[0]["evict_us_per_block"]
    result = {"match_4k_us": lookups[1]["match_us"], "insert_4k_us": lookups[1]["insert_us"],
              "match_4k_speedup_vs_naive": lookups[1]["speedup"],
              "evict_us_per_block_largest": evicts[-1]["evict_us_per_block"],
              "evict_cost_largest_over_smallest": flat}
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
