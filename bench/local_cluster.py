"""A local Ray cluster with Serve on a free port, for the end-to-end benchmarks."""

from __future__ import annotations

import os
from pathlib import Path

BENCH_MODEL_DIR = str(Path.home() / ".cache/radixserve/models/bench")


def start(model_dir: str) -> int:
    """Write the bench model to ``model_dir`` if it has none, start Ray (logical CPUs for several
    replicas on few cores) and Serve; returns Serve's HTTP port."""
    import ray
    from ray import serve

    from app.local_redis import free_port
    from engine.model_init import write_model

    if not Path(model_dir, "config.json").exists():
        write_model(model_dir, "bench")
    os.environ.pop("RAY_ADDRESS", None)
    ray.init(num_cpus=8, include_dashboard=False, log_to_driver=False)
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    return port


def stop() -> None:
    import ray
    from ray import serve

    serve.shutdown()
    ray.shutdown()
