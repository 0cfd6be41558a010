"""A private ``redis-server`` on a free loopback port (never 6379: Ray's GCS uses it)."""

from __future__ import annotations

import ctypes
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _prctl():
    try:
        return ctypes.CDLL(None).prctl
    except (OSError, AttributeError):  # not Linux
        return None


_PRCTL = _prctl()  # found here, not in the forked child (where another thread may hold a lock it needs)


def _die_with_parent() -> None:
    """In the child, before exec: SIGTERM when the process that started it dies (Linux's
    PR_SET_PDEATHSIG, 1; elsewhere nothing)."""
    if _PRCTL is not None:
        _PRCTL(1, signal.SIGTERM)


class LocalRedis:
    def __init__(self, port: int | None = None, password: str | None = None):
        exe = shutil.which("redis-server")
        if exe is None:
            raise RuntimeError("redis-server is not installed (Debian: apt-get install redis-server), "
                               "or pass --redis-url to use an existing Redis")
        self.port = port or free_port()
        self.password = password
        self._dir = tempfile.mkdtemp(prefix="radixserve-redis-")
        # the password goes in on stdin ("-": a config file read from there), not on the command line,
        # which every local user can read (ps)
        self._args = [exe, *(["-"] if password else []), "--port", str(self.port), "--bind", "127.0.0.1",
                      "--save", "", "--appendonly", "no", "--dir", self._dir,
                      "--logfile", str(Path(self._dir) / "redis.log")]
        try:
            self._start()
        except BaseException:  # no object to stop(): its process and folder go here (a failed start, a Ctrl-C)
            proc = getattr(self, "proc", None)
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait()
            shutil.rmtree(self._dir, ignore_errors=True)
            raise

    def _start(self) -> None:
        # its own session: a terminal's Ctrl-C goes to the whole foreground group, and a redis-server
        # that quit at once left the drain that follows without its directory (a warning per replica);
        # it goes when this process does, however that ends (stop(), or the parent-death signal)
        self.proc = subprocess.Popen(self._args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                     stdin=subprocess.PIPE if self.password else subprocess.DEVNULL,
                                     start_new_session=True, preexec_fn=_die_with_parent)
        if self.password:
            quoted = self.password.replace("\\", "\\\\").replace('"', '\\"')
            try:
                with self.proc.stdin:
                    self.proc.stdin.write(f'requirepass "{quoted}"\n'.encode())
            except BrokenPipeError:  # it exited at once: _wait_ready says so
                pass
        self._wait_ready()

    def restart_if_dead(self) -> bool:
        """Start it again on the same port if it exited (killed, out of memory); True if it was
        restarted. It comes back empty: the directory refills as replicas serve (it is a hint)."""
        if self.proc.poll() is None:
            return False
        self._start()
        return True

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        return f"redis://{auth}127.0.0.1:{self.port}/0"

    @property
    def shown_url(self) -> str:
        """``url`` without the password, to print."""
        return f"redis://127.0.0.1:{self.port}/0" + (" (with a generated password)" if self.password else "")

    def _wait_ready(self, timeout: float = 10.0) -> None:
        """Until our redis-server answers: the one that answers must be this process (on a restart,
        another program may have taken the port meanwhile)."""
        import redis

        client = redis.Redis(host="127.0.0.1", port=self.port, password=self.password, socket_timeout=0.5,
                             socket_connect_timeout=0.2)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"redis-server exited with code {self.proc.returncode} (port {self.port})")
            try:
                pid = int(client.info("server")["process_id"])
            except (redis.RedisError, OSError, KeyError, ValueError):
                time.sleep(0.05)
                continue
            finally:
                client.close()
            if pid == self.proc.pid:
                return
            self.proc.kill()
            self.proc.wait()
            raise RuntimeError(f"port {self.port} is taken by another process")
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        raise RuntimeError(f"redis-server did not start on port {self.port}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        shutil.rmtree(self._dir, ignore_errors=True)

    def __enter__(self) -> LocalRedis:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
