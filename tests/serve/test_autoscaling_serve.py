"""Autoscaling end to end: under load Serve adds a replica, which warms the hot prefix from the directory
before it takes traffic and hits on its first request; when the load falls Serve removes one, and the
requests that were running on it finish (nothing is cut or lost)."""

from __future__ import annotations

import concurrent.futures
import threading
import time

import httpx
import pytest

from cache.directory import HotPrefixDirectory
from tests.serve.helpers import per_replica, sse_events, wait_for

ROUTE = "/atest"
HOT = "Every user of this assistant shares this long system prompt, word for word. " * 4


@pytest.fixture(scope="module")
def scaling_app(serve_app, model_dir, own_redis):
    from ray import serve

    from app.config import Settings
    from app.main import build_app

    r, _ = own_redis
    s = Settings(model_id=model_dir("tiny"), replica_num_cpus=1, max_batch_total_tokens=4096, redis_url=r.url,
                 router="prefix", deployment_name="atest", warmup_top_k=8,
                 autoscaling={"min_replicas": 1, "max_replicas": 2, "target_ongoing_requests": 1,
                              "upscale_delay_s": 0, "downscale_delay_s": 2, "look_back_period_s": 11})
    serve.run(build_app(s), name="atest", route_prefix=ROUTE)
    with httpx.Client(base_url=serve_app + ROUTE, timeout=120) as c:
        yield c, HotPrefixDirectory(r.url, "atest", s.cache_namespace())  # (what its replicas write in)
    serve.delete("atest")


def running_replicas() -> int:
    from ray import serve

    return serve.status().applications["atest"].deployments["atest-llm"].replica_states.get("RUNNING", 0)


class Client(threading.Thread):
    """Streams requests of the hot prefix one after another until told to stop; keeps every outcome."""

    def __init__(self, base: str, name: str, max_new_tokens: int):
        super().__init__(daemon=True)
        self.base, self.tag, self.max_new_tokens = base, name, max_new_tokens
        self.stop = threading.Event()
        self.outcomes: list[tuple[int | None, object]] = []  # (status, last event, body or error)

    def run(self) -> None:
        with httpx.Client(base_url=self.base, timeout=120) as c:
            i = 0
            while not self.stop.is_set():
                body = {"inputs": HOT + f"{self.tag} asks question {i}",
                        "parameters": {"max_new_tokens": self.max_new_tokens}}
                try:
                    with c.stream("POST", "/generate_stream", json=body) as r:
                        events = sse_events(r) if r.status_code == 200 else [r.read()]
                        self.outcomes.append((r.status_code, events[-1] if events else "empty stream"))
                except Exception as e:  # noqa: BLE001 - a cut connection is an outcome too
                    self.outcomes.append((None, repr(e)))
                i += 1


def test_autoscaling_adds_a_warm_replica_and_removes_one_without_losing_requests(scaling_app, serve_app):
    c, directory = scaling_app
    assert running_replicas() == 1
    for i in range(4):
        r = c.post("/generate", json={"inputs": HOT + f"first question {i}", "parameters": {"max_new_tokens": 4}})
        assert r.status_code == 200, r.text
    assert wait_for(lambda: directory.top_k(1), timeout=30), "the hot prefix never reached the directory"
    hot_tokens = len(directory.top_k(1)[0].tokens)
    before = wait_for(lambda: set(per_replica(c, "radixserve_cache_blocks_total")), timeout=30)
    assert len(before) == 1

    # four clients at once, against a target of one request per replica: Serve adds the second replica
    base = serve_app + ROUTE
    clients = [Client(base, f"client {k}", 24) for k in range(4)]
    for t in clients:
        t.start()
    try:
        assert wait_for(lambda: running_replicas() == 2, timeout=120), "Serve never added a replica"
        new = wait_for(lambda: set(per_replica(c, "radixserve_cache_blocks_total")) - before, timeout=30)
        assert len(new) == 1
        (added,) = new
        assert per_replica(c, "radixserve_warmup_prefixes")[added] >= 1
        # the router learns what the new replica warmed: its first request finds the hot prefix cached
        first = wait_for(lambda: per_replica(c, "radixserve_first_request_cached_tokens").get(added, -1) >= 0,
                         timeout=60)
        assert first, "the added replica served nothing"
        assert per_replica(c, "radixserve_first_request_cached_tokens")[added] >= hot_tokens - 16

        # the load falls to one client: Serve removes a replica while that client's streams keep running
        for t in clients[1:]:
            t.stop.set()
        assert wait_for(lambda: running_replicas() == 1, timeout=120), "Serve never removed a replica"
        done = len(clients[0].outcomes)
        assert wait_for(lambda: len(clients[0].outcomes) >= done + 2, timeout=60)  # and it goes on serving
    finally:
        for t in clients:
            t.stop.set()
        for t in clients:
            t.join(timeout=120)
    assert not any(t.is_alive() for t in clients)
    outcomes = [o for t in clients for o in t.outcomes]
    assert len(outcomes) >= 8
    failed = [o for o in outcomes if o[0] != 200 or not isinstance(o[1], dict) or "error" in o[1]
              or o[1].get("generated_text") is None]
    assert not failed, failed[:3]


def test_scaled_to_zero_the_service_stays_healthy_and_the_next_request_starts_a_replica(serve_app, model_dir):
    """min_replicas 0: with no replica left, /health still answers 200 (a load balancer that took a 503
    would stop sending the request that brings a replica back), also while that request's replica
    starts (it answered 503 for the whole start-up), and that request is answered."""
    from ray import serve

    from app.config import Settings
    from app.main import build_app

    s = Settings(model_id=model_dir("tiny"), replica_num_cpus=1, max_batch_total_tokens=2048, router="prefix",
                 deployment_name="ztest",
                 autoscaling={"min_replicas": 0, "max_replicas": 1, "target_ongoing_requests": 1,
                              "upscale_delay_s": 0, "downscale_delay_s": 1, "look_back_period_s": 11})
    serve.run(build_app(s), name="ztest", route_prefix="/ztest")
    status = lambda: serve.status().applications["ztest"].deployments["ztest-llm"].replica_states  # noqa: E731
    try:
        with httpx.Client(base_url=serve_app + "/ztest", timeout=120) as c:
            body = {"inputs": "wake up", "parameters": {"max_new_tokens": 2}}
            assert c.post("/generate", json=body).status_code == 200
            # under a route prefix the OpenAI routes keep their own error format and checks (they were
            # told apart by the full path: TGI's format, and no 415 for a form body)
            bad = c.post("/v1/completions", json={"prompt": "x", "max_tokens": "5"})
            assert bad.status_code == 400 and bad.json()["error"]["param"] == "max_tokens", bad.text
            assert c.post("/v1/completions", content=b"prompt=x",
                          headers={"content-type": "application/x-www-form-urlencoded"}).status_code == 415
            # a max_tokens past the context is refused before routing (the router counts it as work)
            model = c.get("/v1/models").json()["data"][0]["id"]
            huge = c.post("/v1/completions", json={"model": model, "prompt": "x", "max_tokens": 10**300})
            assert huge.status_code == 400 and "max_total_tokens" in huge.json()["error"]["message"], huge.text
            assert wait_for(lambda: not status().get("RUNNING") and not status().get("STOPPING"), timeout=120), \
                "never scaled to zero"
            h = c.get("/health")
            assert h.status_code == 200 and h.json() == {"status": "ok", "replicas": 0}, h.text
            with concurrent.futures.ThreadPoolExecutor(1) as pool, httpx.Client(base_url=c.base_url, timeout=10) as hc:
                woke = pool.submit(c.post, "/generate", json=body)  # waits while Serve starts a replica
                health, seen_starting = [], False
                while not woke.done():
                    seen_starting = seen_starting or bool(status().get("STARTING"))
                    health.append((hc.get("/health").status_code, dict(status())))
                    time.sleep(0.3)
                r = woke.result()
                for _ in range(8):  # and until the new replica's first report (within a second)
                    health.append((hc.get("/health").status_code, dict(status())))
                    time.sleep(0.3)
            assert r.status_code == 200, r.text
            assert seen_starting and {code for code, _ in health} == {200}, [h for h in health if h[0] != 200]
            assert status().get("RUNNING") == 1
    finally:
        serve.delete("ztest")


def test_a_fleet_that_recomputes_its_prefixes_grows_though_its_queues_are_short(serve_app, model_dir):
    """One client cycles through four system prompts that one replica's pool cannot hold together: it
    keeps computing them again, with one request in flight against a target of 8 (Serve's own policy
    would stay at one replica). The cache-aware policy adds a replica; the prompts then fit in the two
    caches and hit, and that working set keeps the fleet at two while the load stays as light (Serve's
    policy would remove the replica again)."""
    from ray import serve

    from app.config import Settings
    from app.main import build_app

    s = Settings(model_id=model_dir("tiny"), replica_num_cpus=1, max_batch_total_tokens=1024, max_input_tokens=512,
                 max_total_tokens=600, router="prefix", deployment_name="rtest",
                 autoscaling={"min_replicas": 1, "max_replicas": 2, "target_ongoing_requests": 8,
                              "upscale_delay_s": 0, "downscale_delay_s": 2, "look_back_period_s": 11})
    serve.run(build_app(s), name="rtest", route_prefix="/rtest")
    replicas = lambda: serve.status().applications["rtest"].deployments["rtest-llm"].replica_states.get("RUNNING", 0)  # noqa: E731
    systems = [f"System prompt {k}: " + f"rule {k} says be brief; " * 13 for k in range(4)]  # ~320 tokens each
    shares: list[float] = []  # each request's cached share of its prompt

    def one_cycle(c: httpx.Client, i: int) -> None:
        for k, system in enumerate(systems):
            r = c.post("/v1/completions", json={"model": "tiny", "prompt": system + f"question {i}.{k}",
                                                 "max_tokens": 2})
            assert r.status_code == 200, r.text
            u = r.json()["usage"]
            shares.append(u["prompt_tokens_details"]["cached_tokens"] / u["prompt_tokens"])

    try:
        with httpx.Client(base_url=serve_app + "/rtest", timeout=120) as c:
            i = 0
            while replicas() < 2:
                assert i < 300, "the fleet never grew"
                one_cycle(c, i)
                i += 1
            before = sum(shares) / len(shares)
            assert before < 0.5, before
            assert wait_for(lambda: sum(per_replica(c, "radixserve_cache_recomputed_blocks_total").values()) > 0)
            # the same light load goes on: the router moves half of the prompts to the new replica (after
            # its work rate catches up with the old one's), they hit there, and the fleet keeps both
            held, j = True, i
            while len(shares) < 16 or sum(shares[-16:]) / 16 < 0.8:
                assert j < i + 200, f"the prompts never fit: {shares[-16:]}"
                one_cycle(c, j)
                held = held and replicas() == 2
                j += 1
            for extra in range(10):  # and a little longer, well past the downscale delay
                one_cycle(c, j + extra)
                held = held and replicas() == 2
            assert held, "the working set did not hold the second replica"
    finally:
        serve.delete("rtest")
