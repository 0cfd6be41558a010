"""The ingress's drain word without Serve: ``drain()`` (Serve's threads) and the heartbeat (its own
thread) each set it; neither may overwrite the other's."""

from __future__ import annotations

import threading

from deployments.ingress import InFlight, Ingress

Cls = Ingress.func_or_class
GLOBALS = Cls._heartbeat.__globals__  # (serve.ingress wraps the class with its own copy of the module's)


class _Ingress(Cls):
    """A stand-in whose drain lease, read by the heartbeat, lets a drain() from another thread run right
    after the reading (the heartbeat then stores what it read)."""

    def __del__(self):  # (Serve's wrapper closes an ASGI app that a stand-in never started)
        pass

    @property
    def _drained_until(self) -> float:
        until = self._until
        if threading.current_thread().name == "heartbeat" and not self.drainer:
            self.drainer.append(threading.Thread(target=Cls.drain, args=(self,)))
            self.drainer[0].start()
            self.drainer[0].join(0.3)
        return until

    @_drained_until.setter
    def _drained_until(self, value: float) -> None:
        self._until = value


def test_a_drain_during_a_heartbeat_is_not_undone_by_it(monkeypatch):
    # the heartbeat read drain()'s lease, drain() then set the word, and the heartbeat stored its own
    # older reading over it: the ingress took new requests while it drained, for up to a heartbeat
    monkeypatch.setattr(InFlight, "draining", False)
    monkeypatch.setitem(GLOBALS, "HEARTBEAT_S", 0.01)
    ing = object.__new__(_Ingress)
    ing._until, ing.drainer, ing._drain_lock, ing._stop = float("-inf"), [], threading.Lock(), threading.Event()
    ing._hub_view, ing._replica_id = None, "I"

    class Hub:
        def call(self, *args, **kwargs):
            ing._stop.set()  # one heartbeat
            return False, "incarnation"  # the hub has not heard of the drain yet
    ing._hub = Hub()
    beat = threading.Thread(target=Cls._heartbeat, args=(ing,), name="heartbeat")
    beat.start()
    beat.join(5)
    ing.drainer[0].join(5)
    assert InFlight.draining
