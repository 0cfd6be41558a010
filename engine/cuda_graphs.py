"""Small engine steps replayed as CUDA graphs.

On a GPU a small model's step is bound by kernel launches: the bench model's decode step of 8
sequences took 7.3 ms of wall time for 2.5 ms of kernels on an H200 (~360 launches, the CPU time spent
in transformers' eager modules). A graph captured once per shape replays the whole step with one
launch. A graph's shapes are fixed, so its attention takes one row per query token, each over its own
context gathered from the pool (``attention.decode_metadata``): a decode is one row, and a short
prefill chunk (the uncached tail of a cached prompt) one row per token, masked causally. A step is
padded up to the next listed row count (``cuda_graphs``: TGI's batch sizes, counted in tokens) and its
longest context up to the next power of two: padding rows write their K/V to the pool's spare slot and
attend to it alone, and their logits are dropped. Graphs share one memory pool (they never run at once;
each replay's logits are copied out before the next).

Steps with more tokens than the largest size, contexts over ``MAX_GRAPH_CONTEXT`` and buckets over
``MAX_ROW_CONTEXT`` run eagerly.
"""

from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass

import torch

from cache.kv_pool import KVPool
from engine.attention import DECODE_ROW_TOKENS, DecodeChunk, PagedBatch, decode_metadata, head_slots
from engine.model_support import LONGROPE, rope_type

log = logging.getLogger(__name__)

# tokens of context: longer ones run eagerly (vLLM's max_seq_len_to_capture), so that a graph's padded
# gather and scores stay small
MAX_GRAPH_CONTEXT = 8192
MIN_GRAPH_CONTEXT = 256
# rows x context tokens of one bucket, bounding the gathered K/V a graph keeps in its memory pool: 32
# decodes over 8,192 tokens, or 128 rows over 2,048 (what eager decode attention gathers at once too)
MAX_ROW_CONTEXT = DECODE_ROW_TOKENS
# RoPE types whose transformers update reads the positions on the host: a sync, which capture forbids
HOST_ROPE_TYPES = ("dynamic", *LONGROPE)


def graphs_blocker(config) -> str | None:
    """Why this model's steps cannot be captured, else None."""
    kind = rope_type(config)
    if kind in HOST_ROPE_TYPES:
        return f"RoPE type {kind!r} updates its frequencies from the positions on the host"
    return None


def next_pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


@dataclass
class GraphStats:
    captured: int = 0
    steps: int = 0  # engine steps run through a bucket (graph replays; padded eager runs without capture)
    capture_s: float = 0.0
    disabled: str | None = None  # why graphs are no longer used (a capture failed), else None
    skipped: int = 0  # buckets left eager: their capture ran out of device memory


@dataclass
class _Bucket:
    """One graph's fixed-shape inputs (written before each replay) and its output."""

    input_ids: torch.Tensor  # [1, B]
    position_ids: torch.Tensor  # [1, B]
    slot_mapping: torch.Tensor  # [B]
    ctx_slots: torch.Tensor  # [B, L] flat slots of each row's context (per KV head: inside the graph)
    decode_mask: torch.Tensor  # [B, 1, 1, L]
    sliding_mask: torch.Tensor | None = None  # [B, 1, 1, L] the sliding layers' (models whose layers differ)
    logits: torch.Tensor | None = None  # [B, V], written by the replay
    graph: torch.cuda.CUDAGraph | None = None


class StepGraphs:
    def __init__(self, model: torch.nn.Module, pool: KVPool, batch_sizes: tuple[int, ...] | list[int],
                 max_context: int, capture: bool = True, sliding_layers: frozenset[int] = frozenset()):
        self.model = model
        # layers that attend through ``_Bucket.sliding_mask`` (the same gathered context, masked to
        # their window); empty for a model whose layers are alike
        self.sliding_layers = sliding_layers
        self.pool = pool
        self.sizes = sorted(set(batch_sizes))
        self.max_context = min(next_pow2(max_context), MAX_GRAPH_CONTEXT)
        # False: run the padded shapes eagerly, without capture (how tests check the padding on a CPU)
        self.capture = capture
        self.stats = GraphStats()
        self._buckets: dict[tuple[int, int], _Bucket] = {}
        self._skipped: set[tuple[int, int]] = set()
        self._mempool = None
        self._side = None  # the one stream every bucket is warmed up and captured on (see _new_bucket)
        if capture:
            with self._on_device():
                self._mempool = torch.cuda.graph_pool_handle()

    def _on_device(self):
        """CUDA calls on the pool's device (``cuda:1`` need not be the current one: a graph captured on
        another device's stream would be empty)."""
        dev = self.pool.device
        return torch.cuda.device(dev) if self.capture and dev.type == "cuda" else contextlib.nullcontext()

    def takes(self, rows: int) -> bool:
        """Whether a step of ``rows`` tokens may fit a graph (checked before its rows are built)."""
        return self.stats.disabled is None and rows <= self.sizes[-1]

    def bucket(self, rows: int, context: int) -> tuple[int, int] | None:
        """(padded rows, padded context) for a step, or None: run it eagerly."""
        if not self.takes(rows) or context > self.max_context:
            return None
        key = (next(s for s in self.sizes if s >= rows), self._width(context))
        return key if key[0] * key[1] <= MAX_ROW_CONTEXT and key not in self._skipped else None

    def _width(self, context: int) -> int:
        """A context's padded length: the next power of two, at least ``MIN_GRAPH_CONTEXT``."""
        return min(self.max_context, max(MIN_GRAPH_CONTEXT, next_pow2(context)))

    def run(self, ids: list[int], positions: torch.Tensor, slots: torch.Tensor,
            groups: list[tuple[torch.Tensor, torch.Tensor | None]],
            sliding: list[tuple[torch.Tensor, torch.Tensor | None]] | None = None) -> torch.Tensor | None:
        """Logits ``[n, V]`` (float32) of a step's ``n`` tokens (id, position and new slot each; ``groups``:
        the chunks' contexts and masks, as ``attention.decode_metadata`` takes them; ``sliding``: the
        same contexts masked for the sliding layers, when they differ), or None when no graph fits: the
        caller runs the step eagerly."""
        n = len(ids)
        key = self.bucket(n, max(len(ctx) for ctx, _ in groups))
        if key is None:
            return None
        host = self._host(ids, positions, slots, groups, *key, sliding)
        b = self._buckets.get(key)
        if b is None:
            b = self._new_bucket(key, host)
            if b is None:
                return None
        else:
            for name, value in host.items():
                getattr(b, name).copy_(value)
        if b.graph is not None:
            with self._on_device():
                b.graph.replay()
        else:
            b.logits = self._forward(b)
        self.stats.steps += 1
        return b.logits[:n].to(torch.float32, copy=True)  # the next replay overwrites the graph's output

    def capture_all(self) -> int:
        """Capture every bucket now, largest first (smaller ones then reuse its memory), instead of on
        first use: a replica does this before it takes traffic. Returns how many it captured."""
        before = self.stats.captured
        widths = sorted({self._width(MIN_GRAPH_CONTEXT << i) for i in range(16)}, reverse=True)
        for size in reversed(self.sizes):
            for width in widths:
                key = self.bucket(size, width)  # None: over the size bound, skipped, or graphs are off
                if key is not None and key not in self._buckets:
                    empty = torch.empty(0, dtype=torch.long)  # padding rows only: they write the spare slot
                    self._new_bucket(key, self._host([], empty, empty, [], *key, []))
        return self.stats.captured - before

    def _host(self, ids: list[int], positions: torch.Tensor, slots: torch.Tensor,
              groups: list[tuple[torch.Tensor, torch.Tensor | None]], size: int, width: int,
              sliding: list[tuple[torch.Tensor, torch.Tensor | None]] | None = None) -> dict[str, torch.Tensor]:
        """A bucket's inputs on the host: the rows given, then padding rows up to ``size``."""
        pad = self.pool.pad_slot
        ctx_slots, mask = decode_metadata(groups, size, width, pad)
        filler = size - len(ids)
        host = {"input_ids": torch.tensor([ids + [0] * filler], dtype=torch.long),
                "position_ids": torch.cat([positions, positions.new_zeros(filler)]).unsqueeze(0),
                "slot_mapping": torch.cat([slots, slots.new_full((filler,), pad)]),
                "ctx_slots": ctx_slots, "decode_mask": mask}
        if self.sliding_layers:
            host["sliding_mask"] = decode_metadata(sliding or [], size, width, pad)[1]
        return host

    def _forward(self, b: _Bucket) -> torch.Tensor:
        slots = head_slots(b.ctx_slots, self.pool.shape.num_kv_heads)
        batch = PagedBatch(pool=self.pool, slot_mapping=b.slot_mapping, num_decodes=b.input_ids.shape[1],
                           decode_chunks=[DecodeChunk(slots, b.decode_mask)])
        if b.sliding_mask is not None:
            batch.sliding = PagedBatch(pool=self.pool, slot_mapping=b.slot_mapping, num_decodes=batch.num_decodes,
                                       decode_chunks=[DecodeChunk(slots, b.sliding_mask)])
            batch.sliding_layers = self.sliding_layers
        out = self.model(input_ids=b.input_ids, position_ids=b.position_ids, use_cache=False, logits_to_keep=0,
                         paged_batch=batch)
        return out.logits[0]

    def _new_bucket(self, key: tuple[int, int], host: dict[str, torch.Tensor]) -> _Bucket | None:
        dev = self.pool.device
        b = _Bucket(**{name: value.to(dev) for name, value in host.items()})
        if not self.capture:
            self._buckets[key] = b
            return b
        t0 = time.perf_counter()
        try:
            with self._on_device():
                # a first eager run on a side stream, as PyTorch asks: lazy initialisations (cuBLAS
                # workspaces) must not happen during capture; it writes the same K/V the replay will write
                # one stream for all: the allocator reuses a freed block only on the stream that freed it,
                # in a graph pool too, so a stream per capture held every bucket's memory at once
                side = self._side = self._side or torch.cuda.Stream(dev)
                side.wait_stream(torch.cuda.current_stream(dev))
                try:
                    with torch.cuda.stream(side):
                        self._forward(b)
                finally:  # (also when it runs out of memory: the eager step that follows must wait)
                    torch.cuda.current_stream(dev).wait_stream(side)
                graph = torch.cuda.CUDAGraph()
                # thread_local: the async engine's other threads may touch CUDA while this one captures;
                # on this device's own stream (torch's default capture stream is made once per process,
                # on whichever device captured first, and would move a cuda:1 capture to cuda:0's)
                with torch.cuda.graph(graph, pool=self._mempool, stream=side, capture_error_mode="thread_local"):
                    b.logits = self._forward(b)
            b.graph = graph
        except torch.cuda.OutOfMemoryError:  # this bucket alone stays eager; smaller ones may still fit
            self._skipped.add(key)
            self.stats.skipped += 1
            log.warning("no CUDA graph for %d rows x %d context tokens: out of device memory (eager instead)", *key)
            return None
        except Exception as e:  # noqa: BLE001 - serve eagerly rather than fail: said once, in the log and /info
            self.stats.disabled = f"capture failed ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"
            log.warning("CUDA graphs off, every step runs eagerly: %s", self.stats.disabled)
            self._buckets.clear()  # the graphs, their inputs and their memory pool go back
            self._mempool = None
            with self._on_device():
                torch.cuda.empty_cache()
            return None
        self._buckets[key] = b
        self.stats.captured += 1
        self.stats.capture_s += time.perf_counter() - t0
        log.debug("captured a CUDA graph for %d rows x %d context tokens in %.0f ms", b.input_ids.shape[1],
                 b.decode_mask.shape[-1], (time.perf_counter() - t0) * 1000)
        return b

    def info(self) -> dict:
        s = self.stats
        return {"batch_sizes": self.sizes, "max_context": self.max_context, "captured": s.captured,
                "skipped": s.skipped, "steps": s.steps, "capture_s": round(s.capture_s, 3), "disabled": s.disabled}
