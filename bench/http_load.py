"""Closed-loop HTTP load for the end-to-end benchmarks: N clients stream ``/v1/completions`` and
record time to first token and totals. Loopback only."""

from __future__ import annotations

import asyncio
import json
import statistics
import time
from dataclasses import dataclass

import httpx


@dataclass
class Result:
    ttft_s: float
    total_s: float
    tokens: int
    ok: bool
    cached_share: float | None = None  # of the prompt, from the stream's closing usage (None: none came)
    end: float = 0.0  # time.perf_counter() when it ended


async def one_request(client: httpx.AsyncClient, ids: list[int], max_new: int) -> Result:
    """One streamed completion: time to first token, tokens, and the prompt's cached share."""
    t0 = time.perf_counter()
    ttft, n, usage, failed = None, 0, None, False
    # token-id prompts through the OpenAI API: no tokenizer round trip changes the workload
    body = {"prompt": ids, "max_tokens": max_new, "temperature": 0, "stream": True,
            "ignore_eos": True, "stream_options": {"include_usage": True}}
    async with client.stream("POST", "/v1/completions", json=body) as r:
        if r.status_code != 200:
            await r.aread()
            end = time.perf_counter()
            return Result(0, end - t0, 0, False, end=end)
        async for line in r.aiter_lines():
            if not line.startswith("data:") or line.endswith("[DONE]"):
                continue
            ev = json.loads(line[5:])
            if "error" in ev:  # failed mid-answer: the stream says so in an event of its own, still a 200
                failed = True
                continue
            if ttft is None:
                ttft = time.perf_counter() - t0
            n += 1 if ev.get("choices") and ev["choices"][0].get("text") is not None else 0
            usage = ev.get("usage") or usage
    end = time.perf_counter()
    share = usage["prompt_tokens_details"]["cached_tokens"] / usage["prompt_tokens"] if usage else None
    # a stream that ended early (no usage, or fewer tokens than asked for under ignore_eos) is no success
    done = not failed and usage is not None and usage.get("completion_tokens") == max_new
    return Result(ttft or 0.0, end - t0, n, done, share, end)


async def run_load(base_url: str, prompts: list[list[int]], max_new: int, concurrency: int) -> dict:
    queue = list(enumerate(prompts))
    results: list[Result | None] = [None] * len(prompts)

    async def worker(client):
        while queue:
            i, ids = queue.pop(0)
            results[i] = await one_request(client, ids, max_new)

    t0 = time.perf_counter()
    async with httpx.AsyncClient(base_url=base_url, timeout=600) as client:
        await asyncio.gather(*(worker(client) for _ in range(concurrency)))
    wall = time.perf_counter() - t0
    ok = [r for r in results if r and r.ok]
    ttfts = sorted(r.ttft_s for r in ok)
    # requests that found most of their prompt cached against the rest: whether a router can move the
    # TTFT p50 depends on which of the two the median request is
    hits = [r.ttft_s for r in ok if (r.cached_share or 0) >= 0.5]
    misses = [r.ttft_s for r in ok if (r.cached_share or 0) < 0.5]
    return {"requests": len(prompts), "ok": len(ok), "wall_s": wall,
            "req_s": len(ok) / wall, "ttft_p50_s": _median(ttfts),
            # the rank the engine bench and the routing simulator take (it was one lower here)
            "ttft_p90_s": ttfts[min(len(ttfts) - 1, int(0.9 * len(ttfts)))] if ttfts else float("nan"),
            "hit_requests": len(hits) / len(ok) if ok else float("nan"),
            "ttft_p50_hit_s": _median(hits), "ttft_p50_miss_s": _median(misses),
            "ttfts": [r.ttft_s if r and r.ok else None for r in results]}


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def metric_samples(url: str):
    """Every Prometheus sample ``url/metrics`` exposes (name, labels, value)."""
    from prometheus_client.parser import text_string_to_metric_families

    for fam in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=10).text):
        yield from fam.samples


def wait_healthy(url: str, timeout: float = 600) -> None:
    """Poll ``url/health`` until it answers 200 (replicas load their model first)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + "/health", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise RuntimeError(f"{url} did not come up within {timeout:.0f}s")
