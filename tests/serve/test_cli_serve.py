"""`radixserve serve` as a user runs it: a subprocess with its own Ray and Redis, stopped by SIGINT."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import httpx

from app.local_redis import free_port


def test_serve_subprocess_answers_and_stops_cleanly(model_dir, tmp_path):
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env["RADIXSERVE_MAX_BATCH_TOTAL_TOKENS"] = "2048"  # settings from the environment work too
    cmd = [sys.executable, "-m", "app.cli", "serve", "--model-id", model_dir("tiny"), "--port", str(port),
           "--num-replicas", "1", "--router", "pow2"]
    log = open(tmp_path / "serve.log", "w+")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 180
        ok = False
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                ok = httpx.get(url + "/health", timeout=5).status_code == 200
            except httpx.HTTPError:
                pass
            if ok:
                break
            time.sleep(1)
        assert ok, open(tmp_path / "serve.log").read()[-3000:]
        info = httpx.get(url + "/info", timeout=10).json()
        assert info["max_batch_total_tokens"] == 2048
        r = httpx.post(url + "/generate", json={"inputs": "hello", "parameters": {"max_new_tokens": 4}}, timeout=30)
        assert r.status_code == 200
        proc.send_signal(signal.SIGINT)
        assert proc.wait(90) == 0
        out = open(tmp_path / "serve.log").read()
        assert "RadixServe is up" in out and "stopped" in out and "local redis-server" in out
        try:
            httpx.get(url + "/health", timeout=2)
            raise AssertionError("the server still answers after SIGINT")
        except httpx.HTTPError:
            pass
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
