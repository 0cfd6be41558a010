"""Hot-prefix directory end to end: a replica started later warms up from Redis and hits at once;
Redis dying mid-run does not stop serving, and the directory resumes when it is back."""

from __future__ import annotations

import concurrent.futures as cf

import httpx
import pytest

from app.local_redis import LocalRedis
from cache.directory import HotPrefixDirectory
from tests.serve.helpers import per_replica, wait_for

ROUTE = "/wtest"
HOT = "This hot system prompt is shared by many users of the service. " * 5


@pytest.fixture(scope="module")
def warm_app(serve_app, model_dir, own_redis):
    from ray import serve

    from app.config import Settings
    from app.main import build_app

    r, _ = own_redis

    def deploy(n: int) -> None:
        s = Settings(model_id=model_dir("tiny"), num_replicas=n, replica_num_cpus=1, max_batch_total_tokens=4096,
                     redis_url=r.url, router="prefix", deployment_name="wtest", warmup_top_k=8)
        serve.run(build_app(s), name="wtest", route_prefix=ROUTE)

    with httpx.Client(base_url=serve_app + ROUTE, timeout=60) as c:
        deploy(2)
        # (the namespace the service's replicas and routers use: the model's name and its tokenizer's hash)
        yield c, deploy, HotPrefixDirectory(r.url, "wtest", Settings(model_id=model_dir("tiny")).cache_namespace())
    serve.delete("wtest")


def gen(c: httpx.Client, text: str) -> httpx.Response:
    return c.post("/generate", json={"inputs": text, "parameters": {"max_new_tokens": 8}})


def test_new_replica_warms_from_the_directory_and_hits_on_its_first_request(warm_app):
    c, deploy, directory = warm_app
    for i in range(4):
        assert gen(c, HOT + f"question {i}").status_code == 200
    assert wait_for(lambda: directory.top_k(4)), "the hot prefix never reached the directory"
    hot_tokens = len(directory.top_k(1)[0].tokens)
    assert hot_tokens >= 16 * 15
    before = wait_for(lambda: len(per_replica(c, "radixserve_cache_blocks_total")) == 2
                      and set(per_replica(c, "radixserve_cache_blocks_total")))
    # Redeploying with 3 replicas starts fresh replicas (Serve's Python API replaces them): every one of
    # them must warm the hot prefix from the directory before it takes traffic.
    deploy(3)
    new = wait_for(lambda: len(set(per_replica(c, "radixserve_cache_blocks_total")) - before) == 3
                   and set(per_replica(c, "radixserve_cache_blocks_total")) - before)
    assert new and len(new) == 3
    warm = per_replica(c, "radixserve_warmup_prefixes")
    assert all(warm[r] >= 1 for r in new), warm
    with cf.ThreadPoolExecutor(6) as pool:
        codes = list(pool.map(lambda i: gen(c, HOT + f"after restart {i}").status_code, range(9)))
    assert codes == [200] * 9
    def first_hits() -> dict[str, float]:
        got = per_replica(c, "radixserve_first_request_cached_tokens")
        return {r: v for r, v in got.items() if r in new and v >= 0}

    served = wait_for(lambda: len(first_hits()) == sum(
        1 for r, n in per_replica(c, "radixserve_requests_total").items() if r in new and n > 0) and first_hits())
    assert served, "no new replica served a request"
    # each new replica's very first request found the hot prefix already cached (the recorded
    # prefix may end a block into the first question, hence one block of slack)
    assert all(v >= hot_tokens - 16 for v in served.values()), served


def test_redis_down_mid_run_keeps_serving_then_directory_resumes(warm_app, own_redis):
    c, _, directory = warm_app
    server, port = own_redis
    server.stop()
    for i in range(3):
        r = gen(c, HOT + f"while redis is down {i}")
        assert r.status_code == 200, r.text
    assert wait_for(lambda: sum(per_replica(c, "radixserve_directory_errors_total").values()) > 0, timeout=20)
    restarted = LocalRedis(port=port)
    own_redis_proc = restarted  # keep a handle so the module fixture's stop() has a live process to end
    server.proc = own_redis_proc.proc
    other = "A second prompt, first seen after Redis came back, also shared. " * 4
    for i in range(3):
        assert gen(c, other + str(i)).status_code == 200
    assert wait_for(lambda: any(len(p.tokens) >= 16 * 10 for p in directory.top_k(8)), timeout=45)
