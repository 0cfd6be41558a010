"""Small helpers shared by the Serve tests: per-replica metrics and polling."""

from __future__ import annotations

import json
import time

import httpx
from prometheus_client.parser import text_string_to_metric_families


def per_replica(c: httpx.Client, metric: str) -> dict[str, float]:
    """One metric's value per replica (the ``replica="all"`` sum left out)."""
    out = {}
    for fam in text_string_to_metric_families(c.get("/metrics").text):
        for s in fam.samples:
            if s.name == metric and s.labels.get("replica") != "all":
                out[s.labels["replica"]] = s.value
    return out


def wait_for(fn, timeout=60.0, every=0.5):
    """Poll ``fn`` until it returns something truthy or ``timeout`` passes; its last result."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = fn()
        if got:
            return got
        time.sleep(every)
    return fn()


def sse_events(resp: httpx.Response) -> list:
    """The ``data:`` payloads of a server-sent-event stream (JSON, or the literal ``[DONE]``)."""
    out = []
    for line in resp.iter_lines():
        if line.startswith("data:"):
            data = line[5:].strip()
            out.append(data if data == "[DONE]" else json.loads(data))
    return out
