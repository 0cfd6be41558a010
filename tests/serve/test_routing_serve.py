"""The prefix router inside Ray Serve: stickiness, spreading, and a replica killed mid-run."""

from __future__ import annotations

import concurrent.futures as cf
import time

import httpx
import pytest
import ray

ROUTE = "/rtest"


@pytest.fixture(scope="module")
def routed(serve_app, model_dir, redis_server):
    """A separate app with fresh router state: 2 replicas of the tiny model behind the prefix router."""
    from ray import serve

    from app.config import Settings
    from app.main import build_app

    settings = Settings(model_id=model_dir("tiny"), num_replicas=2, replica_num_cpus=1, max_batch_total_tokens=4096,
                        redis_url=redis_server.url, router="prefix", deployment_name="rtest")
    serve.run(build_app(settings), name="rtest", route_prefix=ROUTE)
    with httpx.Client(base_url=serve_app + ROUTE, timeout=60) as c:
        yield c
    serve.delete("rtest")


def served_by(c: httpx.Client, text: str, n: int = 4) -> str:
    r = c.post("/generate", json={"inputs": text, "parameters": {"max_new_tokens": n}})
    assert r.status_code == 200, r.text
    return r.headers["x-radixserve-replica"]


def test_a_prefix_sticks_and_a_second_hot_prefix_goes_elsewhere(routed):
    a = "Alpha system prompt, long enough for many blocks of the cache. " * 4
    b = "Beta is a completely different system prompt for another tenant. " * 4
    first_a = served_by(routed, a + "q0")
    assert all(served_by(routed, a + f"q{i}") == first_a for i in range(1, 6))
    first_b = served_by(routed, b + "q0")
    assert first_b != first_a  # cold prefix goes to the replica that holds nothing of it
    for i in range(6):
        assert served_by(routed, a + f"again {i}") == first_a
        assert served_by(routed, b + f"again {i}") == first_b
    # and the cache agrees: repeat requests were hits
    r = routed.post("/v1/completions", json={"prompt": a + "final", "max_tokens": 2, "temperature": 0})
    assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= 16 * 14


def test_a_cancelled_stream_leaves_its_replica_in_rotation(routed):
    """A client that leaves a long stream: its replica must not stay counted as busy with the 3,000
    tokens it would have generated (it was: Serve does not report every cancelled request as done, and
    that replica then got no new prefix at all)."""
    text = "Delta prompt for the cancel test, several blocks long at least. " * 3
    with routed.stream("POST", "/generate_stream", json={"inputs": text, "parameters": {"max_new_tokens": 3000}}) as r:
        victim = r.headers["x-radixserve-replica"]
        next(r.iter_lines())  # the first token; then the client leaves
    time.sleep(1.0)
    cold = [served_by(routed, f"Epsilon {i} is a cold prompt of its own, several blocks long. " * 3) for i in range(6)]
    assert victim in cold, cold


def _replica_actors() -> dict[str, str]:
    out = {}
    for a in ray.util.list_named_actors(all_namespaces=True):
        name = a["name"] if isinstance(a, dict) else a
        if "rtest-llm" in name and name.startswith("SERVE_REPLICA"):
            out[name.rsplit("#", 1)[-1]] = name
    return out


def test_killed_replica_stops_getting_traffic_and_nothing_hangs(routed):
    text = "Gamma prompt for the failure test, several blocks long at least. " * 3
    victim = served_by(routed, text)
    actors = _replica_actors()
    assert victim in actors, actors

    def call(i: int) -> int:
        try:
            r = routed.post("/generate", json={"inputs": text + str(i), "parameters": {"max_new_tokens": 40}},
                            timeout=60)
            return r.status_code
        except httpx.TimeoutException:
            return -1

    with cf.ThreadPoolExecutor(6) as pool:
        futures = [pool.submit(call, i) for i in range(12)]
        time.sleep(0.3)
        ray.kill(ray.get_actor(actors[victim], namespace="serve"), no_restart=True)
        codes = [f.result(timeout=90) for f in futures]
    assert -1 not in codes, codes  # every request was answered
    # (those it was running: TGI's 424, a generation that failed; not yet taken: 503)
    assert all(c in (200, 424, 503) for c in codes), f"codes {codes}"
    after = [served_by(routed, text + f" after {i}") for i in range(8)]
    assert victim not in after


def test_with_two_ingress_replicas_both_routers_send_a_prefix_to_its_holder(serve_app, model_dir, redis_server):
    """Each ingress replica has its own router; what one routes, the other learns from the replicas'
    reports (a stats period), so a prefix still sticks to one replica whichever ingress takes it."""
    from ray import serve

    from app.config import Settings
    from app.main import build_app

    settings = Settings(model_id=model_dir("tiny"), num_replicas=2, ingress_replicas=2, replica_num_cpus=1,
                        max_batch_total_tokens=4096, redis_url=redis_server.url, router="prefix",
                        deployment_name="r2test")
    serve.run(build_app(settings), name="r2test", route_prefix="/r2test")
    try:
        ingresses = serve.status().applications["r2test"].deployments["r2test-ingress"].replica_states
        assert ingresses.get("RUNNING") == 2
        with httpx.Client(base_url=serve_app + "/r2test", timeout=60) as c:
            a = "Gamma system prompt shared by everyone behind two ingress replicas. " * 4
            first = served_by(c, a + "q0")
            time.sleep(2.5)  # the holder reports what it stored; both routers fold it in
            assert [served_by(c, a + f"q{i}") for i in range(1, 9)] == [first] * 8
    finally:
        serve.delete("r2test")
