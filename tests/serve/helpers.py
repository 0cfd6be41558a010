"""Small helpers shared by the Serve tests: per-replica and fleet metrics, polling."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
from prometheus_client.parser import text_string_to_metric_families


def _samples(c: httpx.Client):
    for fam in text_string_to_metric_families(c.get("/metrics").text):
        yield from fam.samples


def per_replica(c: httpx.Client, metric: str) -> dict[str, float]:
    """One metric's value per replica (the ``replica="all"`` sum left out)."""
    return {s.labels["replica"]: s.value for s in _samples(c) if s.name == metric and s.labels.get("replica") != "all"}


def fleet(c: httpx.Client) -> dict[str, float]:
    """The fleet's (``replica="all"``) value of every metric (histograms: their sums and counts)."""
    return {s.name: s.value for s in _samples(c) if s.labels.get("replica") == "all" and not s.labels.get("le")}


def wait_for(fn, timeout=60.0, every=0.5):
    """Poll ``fn`` until it returns something truthy or ``timeout`` passes; its last result."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = fn()
        if got:
            return got
        time.sleep(every)
    return fn()


def _data(lines) -> list:
    out = []
    for line in lines:
        if line.startswith("data:"):
            data = line[5:].strip()
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


def sse_events(resp: httpx.Response) -> list:
    """The ``data:`` payloads of a server-sent-event stream (JSON, or the literal ``[DONE]``)."""
    return _data(resp.iter_lines())


def response_events(response) -> list:
    """``sse_events`` of a streaming response a route returned, read without a server."""
    async def read():
        return "".join([piece async for piece in response.body_iterator])
    return _data(asyncio.run(read()).split("\n"))


class WarmupRecorder:
    """An LLM handle's ``warmup.remote`` that records the prefixes sent, for the ingress's ``/warmup``."""

    def __init__(self):
        self.sent: list = []

    @property
    def warmup(self):
        return self

    async def remote(self, prefixes, salt):
        self.sent.append(prefixes)
        return {"prefixes": len(prefixes), "cached_tokens": 0}
