"""Soak (``make test-slow``, not in ``make test``): minutes of mixed traffic on two replicas whose KV
pools are small enough to evict and preempt all the time: TGI and OpenAI calls, streamed and not,
shared prefixes and unique ones, clients that leave mid-stream, and bad requests. Every request must
get its answer (no 5xx, no dropped connection), and once the traffic stops every KV block must be back
in the pool or in the prefix cache, with every request counted once.

``RADIXSERVE_SOAK_S`` sets the length (default 300 s), ``RADIXSERVE_SOAK_CLIENTS`` the concurrency
(default 8)."""

from __future__ import annotations

import json
import os
import random
import threading
import time
from collections import Counter

import httpx
import pytest

from tests.serve.helpers import fleet, per_replica, wait_for

pytestmark = pytest.mark.slow

ROUTE = "/soak"
GROUPS = [f"Tenant {g} system prompt: answer briefly, cite nothing, and stay on topic {g}. " * 3 for g in range(6)]


@pytest.fixture(scope="module")
def soak(serve_app, model_dir, redis_server):
    from ray import serve

    from app.config import Settings
    from app.main import build_app

    # 1,024-token pools: eight clients with prompts of up to ~300 tokens and answers of up to 200
    # overflow them, so blocks are evicted, reused and preempted throughout
    settings = Settings(model_id=model_dir("tiny"), num_replicas=2, replica_num_cpus=1, max_batch_total_tokens=1024,
                        max_input_tokens=512, max_total_tokens=1024, redis_url=redis_server.url, router="prefix",
                        deployment_name="soaktest")
    serve.run(build_app(settings), name="soaktest", route_prefix=ROUTE)
    yield serve_app + ROUTE
    serve.delete("soaktest")


class Client:
    """One simulated user: picks a call at random until the deadline; tallies what came back."""

    def __init__(self, url: str, seed: int, deadline: float):
        self.http = httpx.Client(base_url=url, timeout=120)
        self.rng = random.Random(seed)
        self.deadline = deadline
        self.seen: Counter[str] = Counter()
        self.failures: list[str] = []

    def question(self) -> str:
        return f"question {self.rng.randrange(10**6)}: how does {self.rng.choice(['a', 'the', 'this'])} cache work?"

    def prompt(self) -> str:  # the tiny model's tokenizer takes a character for a token: up to ~270
        return (self.rng.choice(GROUPS) if self.rng.random() < 0.8 else "") + self.question()

    def run(self) -> None:
        calls = [self.generate, self.generate_stream, self.completion_stream, self.chat, self.responses_stream,
                 self.tool_stream, self.leave_mid_stream, self.bad_request]
        weights = [3, 2, 3, 2, 2, 1, 1, 1]
        while time.monotonic() < self.deadline:
            call = self.rng.choices(calls, weights)[0]
            try:
                call()
            except Exception as e:  # noqa: BLE001 - anything is a failed call, counted (not a dead client)
                self.failures.append(f"{call.__name__}: {type(e).__name__}: {e}"[:300])
        self.http.close()

    def expect(self, r: httpx.Response, status: int = 200) -> None:
        assert r.status_code == status, f"{r.status_code} {r.text[:200]}"

    def tokens(self) -> int:
        return self.rng.choice([1, 8, 32, 64, 200])

    def generate(self) -> None:
        r = self.http.post("/generate", json={"inputs": self.prompt(),
                                              "parameters": {"max_new_tokens": self.tokens(), "do_sample": True}})
        self.expect(r)
        assert isinstance(r.json()["generated_text"], str)
        self.seen["ok"] += 1

    def generate_stream(self) -> None:
        body = {"inputs": self.prompt(), "parameters": {"max_new_tokens": self.tokens()}}
        with self.http.stream("POST", "/generate_stream", json=body) as r:
            self.expect(r)
            events = [json.loads(line[5:]) for line in r.iter_lines() if line.startswith("data:")]
        assert events and events[-1]["generated_text"] is not None, events[-1:]
        self.seen["ok"] += 1

    def completion_stream(self) -> None:
        body = {"prompt": self.prompt(), "max_tokens": self.tokens(), "stream": True,
                "ignore_eos": self.rng.random() < 0.5, "stop": ["\n\n"] if self.rng.random() < 0.3 else None}
        with self.http.stream("POST", "/v1/completions", json=body) as r:
            self.expect(r)
            data = [line[5:].strip() for line in r.iter_lines() if line.startswith("data:")]
        assert data[-1] == "[DONE]" and json.loads(data[-2])["choices"][0]["finish_reason"], data[-2:]
        self.seen["ok"] += 1

    def chat(self) -> None:
        body = {"messages": [{"role": "system", "content": self.rng.choice(GROUPS)},
                             {"role": "user", "content": self.question()}], "max_tokens": self.tokens()}
        r = self.http.post("/v1/chat/completions", json=body)
        self.expect(r)
        assert r.json()["choices"][0]["finish_reason"] in ("stop", "length")
        self.seen["ok"] += 1

    def responses_stream(self) -> None:
        body = {"instructions": self.rng.choice(GROUPS), "input": self.question(), "max_output_tokens": self.tokens(),
                "stream": True}
        with self.http.stream("POST", "/v1/responses", json=body) as r:
            self.expect(r)
            events = [json.loads(line[5:]) for line in r.iter_lines() if line.startswith("data:")]
        assert events[-1]["type"] in ("response.completed", "response.incomplete"), events[-1:]
        self.seen["ok"] += 1

    def tool_stream(self) -> None:
        """A chat stream whose answer calls a tool (held to it by a regex), cut short by max_tokens at times:
        the call streams as it is written, and a whole one's arguments are JSON."""
        call = r'Sure\.<tool_call>\{"name": "save", "arguments": \{"text": "[a-z ]{10,60}"\}\}</tool_call>'
        body = {"messages": [{"role": "system", "content": self.rng.choice(GROUPS)},
                             {"role": "user", "content": self.question()}], "stream": True, "guided_regex": call,
                "max_tokens": self.rng.choice([20, 200]),
                "tools": [{"type": "function", "function": {"name": "save", "parameters": {"type": "object"}}}]}
        with self.http.stream("POST", "/v1/chat/completions", json=body) as r:
            self.expect(r)
            data = [line[5:].strip() for line in r.iter_lines() if line.startswith("data:")]
        assert data[-1] == "[DONE]", data[-2:]
        chunks = [json.loads(d) for d in data[:-1]]
        finish = chunks[-1]["choices"][0]["finish_reason"]
        args = "".join(c["function"]["arguments"] for ch in chunks for c in ch["choices"][0]["delta"].get("tool_calls", ()))
        assert finish == "length" or (finish == "tool_calls" and json.loads(args)["text"]), (finish, args)
        self.seen["ok"] += 1

    def leave_mid_stream(self) -> None:
        path, body = self.rng.choice([
            ("/v1/completions", {"prompt": self.prompt(), "max_tokens": 200}),
            ("/v1/responses", {"input": self.prompt(), "max_output_tokens": 200})])
        body = {**body, "ignore_eos": True, "stream": True}
        leave_after = self.rng.randrange(1, 12)  # lines read
        with self.http.stream("POST", path, json=body) as r:
            self.expect(r)
            for n, _ in enumerate(r.iter_lines()):
                if n >= leave_after:
                    break
        self.seen["left"] += 1

    def bad_request(self) -> None:
        kind = self.rng.randrange(4)
        if kind == 0:  # longer than max_input_tokens
            r = self.http.post("/v1/completions", json={"prompt": [5] * 600, "max_tokens": 4})
        elif kind == 1:
            r = self.http.post("/generate", content=b"{not json", headers={"content-type": "application/json"})
        elif kind == 2:
            r = self.http.post("/generate", json={"inputs": "hi", "parameters": {"max_new_tokens": -1}})
        else:  # more than the pool could ever hold
            r = self.http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 5000})
        assert 400 <= r.status_code < 500 and "error" in r.json(), f"bad request {kind}: {r.status_code} {r.text[:200]}"
        self.seen["refused"] += 1


def test_minutes_of_mixed_traffic_lose_no_request_and_no_block(soak):
    seconds = float(os.environ.get("RADIXSERVE_SOAK_S", "300"))
    clients = int(os.environ.get("RADIXSERVE_SOAK_CLIENTS", "8"))
    with httpx.Client(base_url=soak, timeout=30) as c:
        assert wait_for(lambda: len(per_replica(c, "radixserve_cache_blocks_total")) == 2), "replicas never reported"
        before = fleet(c)
        deadline = time.monotonic() + seconds
        users = [Client(soak, seed, deadline) for seed in range(clients)]
        threads = [threading.Thread(target=u.run, daemon=True) for u in users]
        for t in threads:
            t.start()
        while any(t.is_alive() for t in threads):
            time.sleep(min(30.0, max(1.0, deadline - time.monotonic())))
            done = sum((u.seen for u in users), Counter())
            print(f"soak: {dict(done)}, {sum(len(u.failures) for u in users)} failure(s)", flush=True)
        for t in threads:
            t.join(timeout=180)
        seen = sum((u.seen for u in users), Counter())
        failures = [f for u in users for f in u.failures]
        assert not failures, f"{len(failures)} of {sum(seen.values()) + len(failures)} calls failed: {failures[:5]}"
        assert seen["ok"] >= clients and seen["left"] and seen["refused"], seen

        # nothing in flight: every block back in the pool or held by the prefix cache, no request lost
        def settled():
            m = fleet(c)
            done = (m["radixserve_requests_total"] + m["radixserve_requests_aborted_total"]
                    - before.get("radixserve_requests_total", 0) - before.get("radixserve_requests_aborted_total", 0))
            quiet = (m["radixserve_cache_blocks_in_use"] == 0 and m["radixserve_running_requests"] == 0
                     and m["radixserve_queue_depth"] == 0)
            return m if quiet and done == seen["ok"] + seen["left"] else None

        m = wait_for(settled, timeout=60, every=1.0)
        assert m is not None, (seen, fleet(c))
        assert m["radixserve_cache_blocks_used"] == m["radixserve_cache_blocks_cached"], m
        assert m["radixserve_cache_blocks_total"] == before["radixserve_cache_blocks_total"]
        # the pools were under pressure the whole time, and the shared prefixes were still reused
        assert m["radixserve_cache_evictions_total"] > before.get("radixserve_cache_evictions_total", 0)
        hits = m["radixserve_prefix_cache_hits_total"] - before.get("radixserve_prefix_cache_hits_total", 0)
        queried = m["radixserve_prefix_cache_queries_total"] - before.get("radixserve_prefix_cache_queries_total", 0)
        print(f"soak: {dict(seen)}; prefix cache hit rate {hits / queried:.2f}, "
              f"{m['radixserve_cache_evictions_total']:.0f} blocks evicted, "
              f"{m.get('radixserve_preemptions_total', 0):.0f} preemptions", flush=True)
        assert hits / queried > 0.3, (hits, queried)
        # and the service still answers as before
        r = c.post("/generate", json={"inputs": GROUPS[0] + "last", "parameters": {"max_new_tokens": 4}})
        assert r.status_code == 200, r.text
