"""The private redis-server of `radixserve serve`: a start that fails leaves nothing behind."""

from __future__ import annotations

import glob
import os
import tempfile

import pytest

from app.local_redis import LocalRedis


def test_a_failed_start_removes_its_folder():
    """Its folder (config, log) was made before the start: a start that failed (the port taken, a Ctrl-C
    while it came up) returned no object to stop(), and the folder stayed for good."""
    pattern = os.path.join(tempfile.gettempdir(), "radixserve-redis-*")
    other = LocalRedis()
    try:
        before = set(glob.glob(pattern))
        with pytest.raises(RuntimeError):
            LocalRedis(port=other.port)  # someone's server answers there: not ours
        assert set(glob.glob(pattern)) == before
    finally:
        other.stop()


def test_an_interrupted_start_stops_its_server(monkeypatch):
    """A Ctrl-C while it came up removed the folder but left the redis-server running."""
    started = []

    def interrupted(self, timeout=10.0):
        started.append(self.proc)
        raise KeyboardInterrupt

    monkeypatch.setattr(LocalRedis, "_wait_ready", interrupted)
    with pytest.raises(KeyboardInterrupt):
        LocalRedis()
    assert started and started[0].poll() is not None
