"""Shared fixtures: small models written once per test session (offline, random weights)."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory):
    """``model_dir(preset)`` -> path of that preset, written on first use."""
    from engine.model_init import write_model

    root = tmp_path_factory.mktemp("models")
    made: dict[str, str] = {}

    def get(preset: str = "tiny") -> str:
        if preset not in made:
            made[preset] = str(write_model(root / preset, preset))
        return made[preset]

    return get


@pytest.fixture(scope="session")
def redis_server():
    """A real redis-server on a free port (never 6379: Ray's GCS uses it)."""
    from app.local_redis import LocalRedis

    with LocalRedis() as r:
        yield r
