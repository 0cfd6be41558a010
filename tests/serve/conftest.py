"""One real local Ray cluster and one Serve application (2 replicas of the tiny model) per session."""

from __future__ import annotations

import os

import httpx
import pytest

from app.local_redis import LocalRedis, free_port
from bench.http_load import wait_healthy


@pytest.fixture(scope="session")
def ray_cluster():
    import ray
    from ray import serve

    os.environ.pop("RAY_ADDRESS", None)
    # autoscaling tests: Serve hears the load every second instead of every 10 (workers inherit this)
    for var in ("RAY_SERVE_HANDLE_AUTOSCALING_METRIC_PUSH_INTERVAL_S", "RAY_SERVE_REPLICA_AUTOSCALING_METRIC_PUSH_INTERVAL_S"):
        os.environ.setdefault(var, "1")
    # logical CPUs: several apps of tiny-model replicas share the two real cores
    ray.init(num_cpus=16, include_dashboard=False, namespace="radixserve-test", log_to_driver=False)
    yield ray
    serve.shutdown()
    ray.shutdown()


@pytest.fixture(scope="session")
def serve_app(ray_cluster, model_dir, redis_server):
    """Base URL of the service; settings as a user of the embedded default would have them."""
    from ray import serve

    from app.config import Settings
    from app.main import build_app

    port = free_port()
    settings = Settings(model_id=model_dir("tiny"), num_replicas=2, replica_num_cpus=1,
                        max_batch_total_tokens=4096, max_input_tokens=1024, max_total_tokens=2048,
                        port=port, redis_url=redis_server.url, router="prefix")
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    serve.run(build_app(settings), name="radixserve", route_prefix="/")
    url = f"http://127.0.0.1:{port}"
    wait_healthy(url, timeout=120)
    yield url


@pytest.fixture
def client(serve_app):
    with httpx.Client(base_url=serve_app, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def own_redis():
    """A module's own redis-server (its tests may stop and restart it): (server, port)."""
    port = free_port()
    r = LocalRedis(port=port)
    yield r, port
    r.stop()
