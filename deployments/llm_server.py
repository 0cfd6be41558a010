"""The LLM replica: a Ray Serve deployment hosting one async engine.

Takes token ids (the ingress tokenizes once), streams engine events as dicts, warms prefixes
without generating, pushes metrics to the hub, and reports routing and autoscaling stats that
Serve polls. Errors for a bad request come back as an event with ``error`` set, never as a crash.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
from typing import Any

from ray import serve

from app.config import Settings
from deployments.metrics import HISTOGRAMS, Histogram, hub_handle
from engine.async_engine import AsyncEngine
from engine.llm_engine import LLMEngine, RequestError
from engine.sequence import SamplingParams

log = logging.getLogger("radixserve.replica")
MAX_REPORTED_HASHES = 20_000  # per stats period; more and routers just trim to the cached count


class LLMServer:
    def __init__(self, settings: dict[str, Any]):
        self.settings = Settings(**settings)
        cfg = self.settings.engine_config()
        if cfg.num_threads is None and self.settings.replica_num_gpus == 0:
            # replicas share the machine's cores; oversubscribed torch threads only slow everyone down
            cfg.num_threads = max(1, int(self.settings.replica_num_cpus) or 1)
        self.engine = LLMEngine(cfg)
        if self.engine.kv.cache is not None:
            self.engine.kv.cache.record_events = True  # drained by record_routing_stats
        self._stats_seq = 0
        self.aengine = AsyncEngine(self.engine)
        try:
            self.replica_id = serve.get_replica_context().replica_id.unique_id
        except Exception:  # noqa: BLE001 - outside Serve (tests)
            self.replica_id = f"local-{os.getpid()}"
        self._hists = {spec[0]: Histogram(spec[2]) for spec in HISTOGRAMS.values()}
        self._hub = hub_handle(self.settings.deployment_name)
        self._stop = threading.Event()
        self._pusher = threading.Thread(target=self._push_loop, name="metrics-push", daemon=True)
        self._pusher.start()

    # ------------------------------------------------------------------ requests
    async def generate(self, prompt_ids: list[int], params: dict[str, Any], request_id: str | None = None,
                       prefill_only: bool = False):
        """Async generator of event dicts; the first carries ``error`` if the request is refused."""
        try:
            sp = SamplingParams(**params)
            stream = self.aengine.generate(prompt_ids, sp, request_id, prefill_only=prefill_only)
            async for ev in stream:
                d = dataclasses.asdict(ev)
                d["replica"] = self.replica_id
                yield d
        except RequestError as e:
            yield {"error": str(e), "error_kind": "validation", "finished": True, "replica": self.replica_id}
        except TypeError as e:  # unknown sampling field: a caller bug, reported as such
            yield {"error": f"bad parameters: {e}", "error_kind": "validation", "finished": True,
                   "replica": self.replica_id}

    async def warmup(self, prefixes: list[list[int]], cache_salt: str | None = None) -> dict[str, Any]:
        """Prefill ``prefixes`` into the radix cache without generating; returns what was cached."""
        import asyncio

        async def one(ids: list[int]) -> int:
            async for ev in self.generate(ids, {"max_new_tokens": 1, "cache_salt": cache_salt}, prefill_only=True):
                if ev.get("error"):
                    raise RequestError(ev["error"])
            return len(ids) // self.engine.config.block_size * self.engine.config.block_size

        t0 = time.monotonic()
        cached = await asyncio.gather(*(one(p) for p in prefixes))
        return {"prefixes": len(prefixes), "cached_tokens": int(sum(cached)), "seconds": time.monotonic() - t0,
                "replica": self.replica_id}

    def info(self) -> dict[str, Any]:
        e = self.engine
        m = e.loaded
        return {"model_id": m.model_id, "model_type": m.config.model_type, "model_dtype": str(m.dtype),
                "model_device_type": m.device.type, "vocab_size": e.vocab_size,
                "max_input_tokens": e.max_input_tokens, "max_total_tokens": e.max_total_tokens,
                "max_batch_prefill_tokens": e.config.max_batch_prefill_tokens,
                "max_batch_total_tokens": e.kv.capacity_tokens, "block_size": e.config.block_size,
                "prefix_caching": e.config.prefix_caching, "kv_cache_dtype": e.config.kv_cache_dtype,
                "window_size": e.window, "attention_backend": e.attention_backend,
                "replica": self.replica_id}

    # ------------------------------------------------------------------ stats
    def _snapshot(self, engine: LLMEngine) -> dict[str, Any]:
        s = engine.kv_stats()
        st = engine.stats
        for key, src in (("ttft", st.ttft_s), ("itl", st.itl_s)):
            while src:
                self._hists[key].observe(src.popleft())
        return {**s, "blocks_used": s["blocks_total"] - s["blocks_free"],
                "requests_finished": st.requests_finished, "prompt_tokens": st.prompt_tokens,
                "generated_tokens": st.generated_tokens, "prefill_tokens_computed": st.prefill_tokens_computed,
                **{k: h.to_dict() for k, h in self._hists.items()}}

    def stats(self) -> dict[str, Any]:
        return self.aengine.call(self._snapshot)

    def check_invariants(self) -> bool:
        self.aengine.call(lambda e: e.check_invariants())
        return True

    def _push_loop(self) -> None:
        while not self._stop.wait(1.0):
            try:
                self._hub.push.remote(self.replica_id, self.aengine.call(self._snapshot, timeout=5))
            except Exception as e:  # noqa: BLE001 - metrics must never take a replica down
                log.debug("metrics push failed: %s", e)

    def record_routing_stats(self) -> dict[str, Any]:
        """Polled by Serve every stats period and handed to every router: load, capacity, and the
        block hashes stored and evicted since the last poll, so routers correct their indexes."""
        def collect(e: LLMEngine) -> dict[str, Any]:
            s = e.kv_stats()
            stored: list[int] = []
            removed: list[int] = []
            overflow = False
            if e.kv.cache is not None:
                events, overflow = e.kv.cache.drain_events()
                for kind, hashes in events:
                    (stored if kind == "stored" else removed).extend(hashes)
            return {"queue": s["running"] + s["waiting"], "kv_free_blocks": s["blocks_free"] + s["blocks_evictable"],
                    "kv_total_blocks": s["blocks_total"], "cached_blocks": s["blocks_cached"],
                    "stored": stored[-MAX_REPORTED_HASHES:], "removed": removed[-MAX_REPORTED_HASHES:],
                    "truncated": overflow or max(len(stored), len(removed)) > MAX_REPORTED_HASHES}

        self._stats_seq += 1
        return {**self.aengine.call(collect, timeout=5), "seq": self._stats_seq, "replica": self.replica_id}

    def record_autoscaling_stats(self) -> dict[str, Any]:
        s = self.aengine.call(lambda e: e.kv_stats(), timeout=5)
        return {"ongoing": float(s["running"] + s["waiting"]),
                "kv_usage": float(s["blocks_in_use"]) / max(1, s["blocks_total"])}

    def check_health(self) -> None:
        if not self.aengine.alive:
            raise RuntimeError("engine thread is not running")

    def __del__(self):
        # Serve calls this on graceful shutdown: abort what is running so every block goes back.
        try:
            self._stop.set()
            self.aengine.shutdown()
            self._hub.forget.remote(self.replica_id)
        except Exception:  # noqa: BLE001
            pass
