"""Hot-prefix directory against a real three-node Redis Cluster (redis-server in cluster mode)."""

from __future__ import annotations

import logging
import shutil
import subprocess
import tempfile
import time
import uuid
from pathlib import Path

import pytest
import redis
from redis.cluster import RedisCluster, key_slot

from app.local_redis import free_port
from cache.directory import HotPrefixDirectory
from cache.hashing import block_hashes

BS = 16


@pytest.fixture(scope="module")
def cluster():
    """Three primaries on free loopback ports, no replicas; yields their ports."""
    exe, cli = shutil.which("redis-server"), shutil.which("redis-cli")
    if not exe or not cli:
        pytest.skip("redis-server / redis-cli not installed")
    root = Path(tempfile.mkdtemp(prefix="radixserve-cluster-"))
    ports = [free_port() for _ in range(3)]
    # the cluster bus port is given: the default (port + 10000) does not exist for high free ports
    procs = [subprocess.Popen([exe, "--port", str(p), "--cluster-port", str(free_port()), "--bind", "127.0.0.1",
                               "--cluster-enabled", "yes", "--cluster-config-file", f"nodes-{p}.conf", "--save", "",
                               "--appendonly", "no", "--dir", str(root), "--logfile", str(root / f"{p}.log")],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) for p in ports]
    try:
        for p in ports:
            _wait(lambda p=p: redis.Redis(port=p, socket_timeout=0.5).ping())
        subprocess.run([cli, "--cluster", "create", *[f"127.0.0.1:{p}" for p in ports], "--cluster-replicas", "0",
                        "--cluster-yes"], check=True, capture_output=True, timeout=30)
        _wait(lambda: all(b"cluster_state:ok" in redis.Redis(port=p).execute_command("CLUSTER", "INFO")
                          for p in ports))
        yield ports
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()
        shutil.rmtree(root, ignore_errors=True)


def _wait(ok, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if ok():
                return
        except (redis.RedisError, OSError):
            pass
        time.sleep(0.1)
    raise TimeoutError("redis cluster did not come up")


def _owner(ports: list[int], key: str) -> int:
    """The port of the node that serves ``key``'s slot."""
    slot = key_slot(key.encode())
    for start, end, (_host, port, *_), *_ in redis.Redis(port=ports[0]).execute_command("CLUSTER", "SLOTS"):
        if start <= slot <= end:
            return int(port)
    raise AssertionError(f"no node serves slot {slot}")


def test_the_directory_works_through_a_node_that_does_not_own_its_slot(cluster):
    """A URL naming any node of a Redis Cluster: the first MOVED answer switches to a cluster client,
    and every key of one deployment shares a slot (the Lua script and the pipelines span several)."""
    deployment = f"c{uuid.uuid4().hex[:8]}"
    probe = HotPrefixDirectory(f"redis://127.0.0.1:{cluster[0]}/0", deployment=deployment, model="m", block_size=BS)
    owner = _owner(cluster, probe.ns + "hot")
    other = next(p for p in cluster if p != owner)
    d = HotPrefixDirectory(f"redis://127.0.0.1:{other}/0", deployment=deployment, model="m", block_size=BS)
    a, b = [(7 * i) % 300 for i in range(64)], [(11 * i) % 300 for i in range(32)]
    ha = d.record("r1", a, hits=3)
    hb = d.record("r2", b)
    assert d.cluster and d.errors == 0 and d._scripting  # moved once, the Lua script ran on the owner
    assert ha == block_hashes(a, BS, "m")[-1] and hb is not None
    assert [p.hash for p in d.top_k(5)] == [ha, hb]
    d.record("r2", a)
    assert sorted(d.holders(ha)) == ["r1", "r2"]
    assert d.forget_replica("r2") == 2 and d.holders(ha) == ["r1"]
    keys = RedisCluster(host="127.0.0.1", port=owner).keys(target_nodes=RedisCluster.ALL_NODES)
    ours = [k for k in keys if k.startswith(d.ns.encode())]
    assert ours and {key_slot(k) for k in ours} == {key_slot((d.ns + "hot").encode())}
    d.clear()
    assert not [k for k in RedisCluster(host="127.0.0.1", port=owner).keys(target_nodes=RedisCluster.ALL_NODES)
                if k.startswith(d.ns.encode())]


def test_the_switch_to_a_cluster_client_logs_no_password(monkeypatch, caplog):
    """The first MOVED answer is logged with the URL, which carried the cluster's password into every
    replica's log."""
    made = []
    monkeypatch.setattr(RedisCluster, "from_url", classmethod(
        lambda cls, url, **kw: made.append(url) or type("Client", (), {"register_script": lambda self, s: None})()))
    d = HotPrefixDirectory("redis://user:s3cret@redis-node-1:6379/0", deployment="d", model="m", block_size=BS)

    def moved(_client):
        if not d.cluster:
            raise redis.exceptions.MovedError("3999 10.0.0.2:6379")
        return "ok"

    with caplog.at_level(logging.INFO, logger="cache.directory"):
        assert d._call(moved, None) == "ok"
    assert made == ["redis://user:s3cret@redis-node-1:6379/0"]  # (the client gets it whole)
    assert "redis://redis-node-1:6379/0" in caplog.text and "s3cret" not in caplog.text and "user" not in caplog.text
