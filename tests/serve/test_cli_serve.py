"""`radixserve serve` as a user runs it: a subprocess with its own Ray and Redis, stopped by SIGINT
(Ctrl-C) or SIGTERM (systemd, Kubernetes)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest

from app.local_redis import free_port


@pytest.mark.parametrize(("stop_signal", "ingresses"), [(signal.SIGINT, 1), (signal.SIGTERM, 2)],
                         ids=["SIGINT", "SIGTERM-2-ingresses"])
def test_serve_subprocess_answers_and_stops_cleanly(model_dir, tmp_path, stop_signal, ingresses):
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env["RADIXSERVE_MAX_BATCH_TOTAL_TOKENS"] = "4096"  # settings from the environment work too
    env["RADIXSERVE_DRAIN_TIMEOUT_S"] = "90"  # the long stream below must finish within the drain
    cmd = [sys.executable, "-m", "app.cli", "serve", "--model-id", model_dir("tiny"), "--port", str(port),
           "--num-replicas", "1", "--router", "pow2", "--ingress-replicas", str(ingresses)]
    log = open(tmp_path / "serve.log", "w+")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline and "RadixServe is up" not in open(tmp_path / "serve.log").read():
            assert proc.poll() is None, open(tmp_path / "serve.log").read()[-3000:]
            time.sleep(0.2)
        # "up" means answering: a load balancer or script may start at once (it used to 503 for a second)
        assert httpx.get(url + "/health", timeout=5).status_code == 200, open(tmp_path / "serve.log").read()[-3000:]
        info = httpx.get(url + "/info", timeout=10).json()
        assert info["max_batch_total_tokens"] == 4096
        r = httpx.post(url + "/generate", json={"inputs": "hello", "parameters": {"max_new_tokens": 4}}, timeout=30)
        assert r.status_code == 200
        # Ctrl-C drains: a stream in flight finishes; a new request meanwhile gets a 503 that says why
        # (from every ingress replica: the proxy spreads these requests over them)
        body = {"prompt": "hello", "max_tokens": 300, "ignore_eos": True, "stream": True}
        # still running when the second signal comes, and until the checks below are done: once
        # nothing is in flight the drain ends and the port closes (on a loaded machine, 1,900 tokens
        # once ended before eight requests had their 503)
        long_body = {**body, "max_tokens": 3900}
        cut = stop_signal == signal.SIGTERM
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as stream, \
                httpx.stream("POST", url + "/v1/completions", json=long_body, timeout=60) as long_stream:
            lines = stream.iter_lines()
            long_lines = long_stream.iter_lines()
            assert next(line for line in lines if line.startswith("data:"))
            assert next(line for line in long_lines if line.startswith("data:"))
            proc.send_signal(stop_signal)
            deadline, refused = time.monotonic() + 20, None
            while refused is None and time.monotonic() < deadline:
                try:
                    r = httpx.post(url + "/generate", json={"inputs": "hi", "parameters": {"max_new_tokens": 1}}, timeout=10)
                except httpx.TransportError as e:  # seen once under a full suite: say what the service said
                    pytest.fail(f"{type(e).__name__} during the drain: {e}\n{open(tmp_path / 'serve.log').read()[-3000:]}")
                refused = r if r.status_code == 503 else None
                time.sleep(0.2)
            assert refused is not None and "shutting down" in refused.json()["error"], "no 503 while draining"
            if ingresses > 1:  # (before the checks below: the proxy may send any of them to another replica)
                time.sleep(1)  # the other ingress replicas hear of the drain at their next heartbeat (0.5 s)
            bad = httpx.post(url + "/v1/completions", content=b"{not json", timeout=10)  # refused before parsing
            assert bad.status_code == 503 and "shutting down" in bad.json()["error"]["message"]
            assert httpx.get(url + "/health", timeout=10).status_code == 503
            if ingresses > 1:
                codes = [httpx.post(url + "/generate", json={"inputs": "hi", "parameters": {"max_new_tokens": 1}}, timeout=10).status_code for _ in range(8)]
                assert codes == [503] * 8, codes
            rest = [line for line in lines if line.startswith("data:")]
            assert rest[-1] == "data: [DONE]" and '"finish_reason":"length"' in rest[-2], rest[-3:]
            if cut:  # a second signal skips the rest of the drain: what still runs ends with an error event
                proc.send_signal(stop_signal)
            long_rest = [line for line in long_lines if line.startswith("data:")]
        if cut:
            # (then [DONE], as every OpenAI stream ends)
            assert long_rest[-1] == "data: [DONE]" and '"error"' in long_rest[-2] and "shutting down" in long_rest[-2], \
                long_rest[-3:]
            assert all('"finish_reason":"length"' not in x for x in long_rest), "a cut stream ended as finished"
        else:
            assert long_rest[-1] == "data: [DONE]", long_rest[-2:]  # the drain lets it finish
        # after the drain the port closes: no moment where the app is gone and Serve answers 404, which
        # a load balancer would pass on as an answer instead of trying another server
        seen, deadline = set(), time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                seen.add(httpx.post(url + "/generate", json={"inputs": "hi", "parameters": {"max_new_tokens": 1}}, timeout=5).status_code)
            except httpx.HTTPError:
                break
            time.sleep(0.1)
        assert seen <= {503}, seen
        assert proc.wait(90) == 0
        out = open(tmp_path / "serve.log").read()
        assert "RadixServe is up" in out and "stopped" in out and "local redis-server" in out
        assert "with a generated password" in out and "redis://:" not in out  # the password is not shown
        assert "finishing the requests in flight" in out
        assert "engine ready" in out and "warm-up: " in out  # the replicas' INFO lines reach the console
        try:
            httpx.get(url + "/health", timeout=2)
            raise AssertionError(f"the server still answers after {stop_signal.name}")
        except httpx.HTTPError:
            pass
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


def test_a_sigterm_to_the_whole_process_group_stops_at_once_with_a_clear_line(model_dir, tmp_path):
    # systemd's default KillMode and `timeout` signal the whole group, and the local Ray's processes are
    # in it: the CLI used to wait a minute for the dead GCS and print Ray's traceback
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_", "RADIXSERVE_"))}
    log = open(tmp_path / "serve.log", "w+")
    proc = subprocess.Popen([sys.executable, "-m", "app.cli", "serve", "--model-id", model_dir("tiny"), "--port",
                             str(port), "--max-batch-total-tokens", "2048"], stdout=log, stderr=subprocess.STDOUT,
                            env=env, start_new_session=True)
    try:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline and "RadixServe is up" not in open(tmp_path / "serve.log").read():
            assert proc.poll() is None, open(tmp_path / "serve.log").read()[-3000:]
            time.sleep(1)
        t0 = time.monotonic()
        os.killpg(proc.pid, signal.SIGTERM)
        assert proc.wait(45) == 1
        assert time.monotonic() - t0 < 30
        out = open(tmp_path / "serve.log").read()
        assert "KillMode=mixed" in out and "Failed to connect to GCS" not in out, out[-2000:]
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _cli(*args: str, timeout: float = 60, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_", "RADIXSERVE_"))}
    return subprocess.run([sys.executable, "-m", "app.cli", *args], capture_output=True, text=True, timeout=timeout,
                          env={**clean, **(env or {})})


def test_serve_refuses_bad_settings_in_seconds_before_starting_anything(model_dir, tmp_path):
    tiny = model_dir("tiny")
    (tmp_path / "empty").mkdir()
    (tmp_path / "afile").write_text("x")
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen()
    cases = [
        (["--model-id", str(tmp_path / "missing")], "does not exist"),
        (["--model-id", str(tmp_path / "afile")], "is a file"),
        (["--model-id", str(tmp_path / "empty")], "no config.json"),
        (["--model-id", tiny, "--max-input-tokens", "5000", "--max-total-tokens", "100"], "must be below"),
        (["--model-id", tiny, "--max-total-tokens", "100000"], "context (4096"),
        (["--model-id", tiny, "--max-input-tokens", "4096"], "must be below max_total_tokens (4096)"),
        (["--model-id", tiny, "--autoscaling", '{"min_replicas": 3, "max_replicas": 1}'], "min_replicas (3)"),
        (["--model-id", tiny, "--port", str(busy.getsockname()[1])], "cannot listen"),
        # found here, not half a minute later in a replica's traceback
        (["--model-id", tiny, "--device", "cuda:99"], "device 'cuda:99'"),
        (["--model-id", tiny, "--device", "tpu"], "device"),
        (["--model-id", tiny, "--num-replicas", "3", "--autoscaling", '{"max_replicas": 2}'], "both set"),
        ({"RADIXSERVE_HOME": "/proc/radixserve-nope"}, "cannot write the built-in model"),
        ({"RADIXSERVE_BLOKC_SIZE": "8"}, "RADIXSERVE_BLOKC_SIZE"),
        # both once failed in every replica after Ray had started (a password's / splits the URL)
        (["--model-id", tiny, "--redis-url", "redis://:pa/ss@127.0.0.1:6380/0"], "percent-encoded"),
        # (parsed without an error: the host was "ss", the rest of the password a database it ignored)
        (["--model-id", tiny, "--redis-url", "redis://:p@ss/word@127.0.0.1:6380/0"], "percent-encoded"),
        (["--model-id", tiny, "--deployment-name", "a#b"], "'a#b' is not a name"),
        ({"RADIXSERVE_AUTOSCALING": "{bad"}, "RADIXSERVE_AUTOSCALING is not JSON"),
        # ray.init would join that cluster and refuse the local Ray's CPUs, with a traceback
        ({"RAY_ADDRESS": "127.0.0.1:1"}, "RAY_ADDRESS is set (127.0.0.1:1): pass --address auto"),
    ]
    if not _flash_importable():
        cases.append((["--model-id", tiny, "--attention-backend", "flash"], "vllm-flash-attn"))
    try:
        for args, needle in cases:
            t0 = time.monotonic()
            r = _cli("serve", *args) if isinstance(args, list) else _cli("serve", env=args)
            assert r.returncode == 2, (args, r.stdout[-500:], r.stderr[-2000:])
            assert needle in r.stderr and len(r.stderr.strip().splitlines()) == 1, (args, r.stderr)
            assert "redis" not in r.stdout and time.monotonic() - t0 < 30, args  # nothing was started
    finally:
        busy.close()


def _flash_importable() -> bool:
    import importlib.util

    return importlib.util.find_spec("vllm_flash_attn") is not None


def test_init_model_does_not_overwrite_by_accident(tmp_path):
    (tmp_path / "afile").write_text("x")
    r = _cli("init-model", str(tmp_path / "afile"))
    assert r.returncode == 2 and "is a file" in r.stderr
    assert _cli("init-model", str(tmp_path / "m")).returncode == 0
    r = _cli("init-model", str(tmp_path / "m"), "--preset", "tiny-qwen2")
    assert r.returncode == 2 and "--force" in r.stderr
    # over a sharded checkpoint: its index and shards go, or the index would name missing files
    (tmp_path / "m" / "model.safetensors.index.json").write_text('{"weight_map": {"x": "model-00002.safetensors"}}')
    (tmp_path / "m" / "model-00002.safetensors").write_bytes(b"old")
    # and the old tokenizer's leftovers (transformers 4 wrote these beside it): they changed the new one's EOS
    (tmp_path / "m" / "special_tokens_map.json").write_text('{"eos_token": "<|pad|>", "bos_token": "<|pad|>"}')
    (tmp_path / "m" / "added_tokens.json").write_text('{"<|pad|>": 258}')
    assert _cli("init-model", str(tmp_path / "m"), "--preset", "tiny-qwen2", "--force").returncode == 0
    assert "qwen2" in (tmp_path / "m" / "config.json").read_text()
    assert sorted(f.name for f in (tmp_path / "m").glob("model*")) == ["model.safetensors"]
    assert not (tmp_path / "m" / "special_tokens_map.json").exists() and not (tmp_path / "m" / "added_tokens.json").exists()
    from transformers import AutoTokenizer

    assert AutoTokenizer.from_pretrained(tmp_path / "m").eos_token == "<|eos|>"
    # a mistaken flag: its line and where to look, not the whole usage
    r = _cli("serve", "--port", "abc")
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [
        "radixserve serve: error: argument --port: invalid int value: 'abc' (see `radixserve serve --help`)"]
    r = _cli("serve", "--bogus")  # the command's own help, not the top level's
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [
        "radixserve serve: error: unrecognized arguments: --bogus (see `radixserve serve --help`)"]
    r = _cli("serve", "--max-num-seqs", "-5")
    assert r.returncode == 2 and "max_num_seqs (--max-num-seqs): Input should be greater than 0" in r.stderr
    r = _cli("init-model", "/proc/radixserve-nope")  # not writable: one line, not a traceback
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and "cannot write" in r.stderr, r.stderr


def test_preflight_leaves_the_model_folder_to_the_cluster_it_joins(tmp_path):
    from app.cli import preflight
    from app.config import Settings

    s = Settings(model_id=str(tmp_path / "only-on-the-cluster"))
    assert "does not exist" in preflight(s, local_ray=True)
    assert preflight(s, local_ray=False) is None


def test_the_cli_restarts_its_redis_once_and_gives_up_after_a_failed_restart(capsys):
    from app.cli import _supervise_redis

    class Redis:
        shown_url = "redis://127.0.0.1:1/0"

        def __init__(self, outcomes):
            self.outcomes = list(outcomes)

        def restart_if_dead(self):
            got = self.outcomes.pop(0)
            if isinstance(got, Exception):
                raise got
            return got

    assert _supervise_redis(Redis([False]))  # alive: nothing said
    assert _supervise_redis(Redis([True]))
    assert "restarted it" in capsys.readouterr().err
    assert not _supervise_redis(Redis([RuntimeError("port 1 is taken by another process")]))
    assert "serving goes on without the hot-prefix directory" in capsys.readouterr().err


def test_the_gcs_check_says_gone_only_when_refused(monkeypatch):
    import types

    import ray

    from app import cli

    def gcs(address):
        monkeypatch.setattr(ray, "get_runtime_context", lambda: types.SimpleNamespace(gcs_address=address))
        return cli._gcs_answers(timeout=0.5)

    for family, host in ((socket.AF_INET, "127.0.0.1"), (socket.AF_INET6, "::1")):
        try:
            srv = socket.socket(family)
            srv.bind((host, 0))
        except OSError:
            continue  # no IPv6 here
        srv.listen()
        port = srv.getsockname()[1]
        shown = f"[{host}]" if family == socket.AF_INET6 else host  # how Ray writes an IPv6 address
        assert gcs(f"{shown}:{port}")
        srv.close()
        assert not gcs(f"{shown}:{port}")  # refused twice: gone
    assert gcs("not an address")  # cannot tell: drain as usual


def test_joining_a_cluster_refuses_another_port_or_a_taken_application(serve_app, model_dir):
    """Serve keeps its first HTTP port (a new one was ignored while the CLI said it listened there), and
    a second `radixserve serve` took over the first's application, which its Ctrl-C then deleted."""
    import ray

    from deployments.metrics import hub_name

    address = ray.get_runtime_context().gcs_address
    port = int(serve_app.rsplit(":", 1)[1])
    for args, said in ((["--port", str(free_port())], f"listens on port {port}, not"),
                       # (a new host was ignored too, and the CLI said it listened there)
                       (["--port", str(port), "--host", "0.0.0.0"], "with its host 127.0.0.1, not 0.0.0.0"),
                       (["--port", str(port)], "the application 'radixserve' already serves / on this cluster")):
        r = _cli("serve", "--address", address, "--model-id", model_dir("tiny"), "--redis-url", "none", *args,
                 timeout=120, env={"RAY_AUTH_MODE": "token"})  # (as the test session's Ray has it)
        assert r.returncode == 2 and said in r.stderr, (r.stdout[-1000:], r.stderr[-2000:])
        assert "RadixServe is up" not in r.stdout
    # the application there is untouched, its metrics hub included
    assert ray.get_actor(hub_name("radixserve"), namespace="radixserve") is not None
    assert httpx.get(serve_app + "/health", timeout=10).status_code == 200


def test_joining_a_cluster_names_the_host_its_serve_listens_on(serve_app):
    """Serve keeps the host it started with; the line `RadixServe is up` named this start's own default."""
    from app.cli import _served_host
    from app.config import Settings

    assert _served_host(Settings(host="0.0.0.0")) == "127.0.0.1"  # (the test session's Serve)


def test_version_is_the_projects():
    import re
    from pathlib import Path

    project = re.search(r'^version = "(.+)"$', (Path(__file__).parents[2] / "pyproject.toml").read_text(), re.M)
    r = _cli("--version", timeout=60)
    assert r.returncode == 0 and r.stdout.strip() == f"radixserve {project[1]}", (r.stdout, r.stderr)


def test_a_cluster_ray_start_began_here_is_named_before_a_local_ray_would_join_it(monkeypatch):
    import ray._private.services as services

    from app.cli import _ray_here_problem

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setattr(services, "find_bootstrap_address", lambda temp_dir: "10.0.0.5:6379")
    assert "`ray start` runs on this machine (10.0.0.5:6379): pass --address auto" in _ray_here_problem()
    monkeypatch.setattr(services, "find_bootstrap_address", lambda temp_dir: None)
    assert _ray_here_problem() is None
    monkeypatch.setenv("RAY_ADDRESS", "local")  # Ray's word for starting one
    assert _ray_here_problem() is None
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.5:6379")
    assert "RAY_ADDRESS is set (10.0.0.5:6379)" in _ray_here_problem()
