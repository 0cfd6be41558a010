"""Builds one packed forward pass from scheduled chunks and runs the transformers model on it."""

from __future__ import annotations

import torch

from cache.kv_pool import KVPool
from engine.attention import (
    BatchedPrefills,
    PagedBatch,
    PrefillGroup,
    decode_chunks,
    prefill_runs,
)
from engine.cuda_graphs import StepGraphs
from engine.scheduler import Chunk


class ModelRunner:
    def __init__(self, model: torch.nn.Module, pool: KVPool, block_size: int, window_size: int | None,
                 use_flash: bool = False, graphs: StepGraphs | None = None,
                 layer_windows: tuple[int | None, ...] = ()):
        self.model = model
        self.pool = pool
        self.block_size = block_size
        self.window = window_size  # one window for every layer (its blocks leave the pool), or None
        # a model whose layers differ (Gemma 3: five sliding layers to one full): the full layers' metadata
        # as usual, and the sliding layers' built beside it (attention.PagedBatch.sliding)
        windows = {w for w in layer_windows if w is not None}
        if len(windows) > 1:
            raise ValueError(f"one sliding window per model, not {sorted(windows)}")
        self.sliding = windows.pop() if windows and window_size is None else None
        self.sliding_layers = frozenset() if self.sliding is None else frozenset(
            i for i, w in enumerate(layer_windows) if w is not None)
        self.device = pool.device
        self.use_flash = use_flash
        self.graphs = graphs  # small steps as CUDA graphs (engine.cuda_graphs); None: always eager
        # chunks over cached context in one padded SDPA call (attention.BatchedPrefills): on a GPU, where
        # launches cost more than the padding; a CPU does the padding's arithmetic instead
        self.batch_prefills = self.device.type == "cuda"
        self._offsets = torch.arange(block_size)

    def _slots(self, block_table: list[int]) -> torch.Tensor:
        """The flat pool slot of every position the sequence's blocks cover (``[blocks * block_size]``):
        built once per chunk, sliced for its new tokens and for its context. Blocks a window has given
        back (-1) give negative slots, at positions no query reads."""
        table = torch.tensor(block_table, dtype=torch.long)
        return (table[:, None] * self.block_size + self._offsets).view(-1)

    @staticmethod
    def _ctx_start(first_query_pos: int, window: int | None) -> int:
        """First key position any query from ``first_query_pos`` on can see."""
        return 0 if window is None else max(0, first_query_pos - window + 1)

    @staticmethod
    def _mask(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int | None) -> torch.Tensor:
        m = k_pos[None, :] <= q_pos[:, None]
        if window is not None:
            m &= k_pos[None, :] > q_pos[:, None] - window
        return m

    def _rows(self, flat: torch.Tensor, start: int, end: int, window: int | None
              ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One chunk as attention rows (``attention.decode_metadata``): its context's slots, and which of
        them each query sees (None: one query that sees them all)."""
        ctx0 = self._ctx_start(start, window)
        ctx = flat[ctx0:end]
        if end - start == 1:  # a decode sees all of its context (the window's start is where it begins)
            return ctx, None
        return ctx, self._mask(torch.arange(start, end), torch.arange(ctx0, end), window)

    def _graph_rows(self, flat: torch.Tensor, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """A chunk's rows for the sliding layers of a graph: the full layers' context (a graph has one
        gather per step), masked to the window."""
        return flat[:end], self._mask(torch.arange(start, end), torch.arange(0, end), self.sliding)

    @torch.inference_mode()
    def forward(self, chunks: list[Chunk], sample_mask: list[bool], all_rows: list[bool] | None = None
                ) -> torch.Tensor:
        """Run ``chunks`` (decodes first in the row); returns float32 logits ``[N, V]``, in chunk order:
        every row of the chunks whose ``all_rows`` entry is set (prompt log-probabilities), else the last
        row of those whose ``sample_mask`` entry is set."""
        # decodes, then chunks that start their sequence, then chunks over cached context, the longest
        # contexts first (neighbours of like lengths are batched together on a GPU: ``_batch``)
        order = sorted(range(len(chunks)), key=lambda i: (
            chunks[i].num_tokens != 1, chunks[i].seq.num_computed > 0,
            -(chunks[i].seq.num_computed + chunks[i].num_tokens) if chunks[i].num_tokens != 1 else 0))
        ids: list[int] = []
        positions: list[torch.Tensor] = []
        slots: list[torch.Tensor] = []
        keep: dict[int, list[int]] = {}
        spans: list[tuple[torch.Tensor, int, int]] = []  # (slots, first, end) of each chunk, in packed order
        for i in order:
            c = chunks[i]
            seq = c.seq
            start, end = seq.num_computed, seq.num_computed + c.num_tokens
            flat = self._slots(seq.block_table)
            if all_rows and all_rows[i]:
                keep[i] = list(range(len(ids), len(ids) + c.num_tokens))
            elif sample_mask[i]:
                keep[i] = [len(ids) + c.num_tokens - 1]
            ids.extend(seq.token_range(start, end))
            positions.append(torch.arange(start, end))
            slots.append(flat[start:end])
            spans.append((flat, start, end))
        rows = [r for i in range(len(chunks)) for r in keep.get(i, ())]  # logits rows to return, in chunk order
        if self.graphs is not None and self.graphs.takes(len(ids)):
            sliding = None if self.sliding is None else [self._graph_rows(*x) for x in spans]
            logits = self.graphs.run(ids, torch.cat(positions), torch.cat(slots),
                                     [self._rows(*x, self.window) for x in spans], sliding)
            if logits is not None:
                return logits[rows]
        dev = self.device
        slot_mapping = torch.cat(slots).to(dev)
        flash = self._flash_meta(chunks, order, spans) if self.use_flash else None
        batch = self._batch(spans, len(ids), self.window, slot_mapping, flash)
        if self.sliding is not None:
            flash = flash and {**flash, "window": (self.sliding - 1, 0)}
            batch.sliding = self._batch(spans, len(ids), self.sliding, slot_mapping, flash)
            batch.sliding_layers = self.sliding_layers
        input_ids = torch.tensor([ids], dtype=torch.long, device=dev)
        position_ids = torch.cat(positions).unsqueeze(0).to(dev)
        keep_idx = torch.tensor(rows, dtype=torch.long, device=dev)
        out = self.model(input_ids=input_ids, position_ids=position_ids, use_cache=False,
                         logits_to_keep=keep_idx, paged_batch=batch)
        return out.logits[0].float()

    def _batch(self, spans: list[tuple[torch.Tensor, int, int]], num_ids: int, window: int | None,
               slot_mapping: torch.Tensor, flash: dict | None) -> PagedBatch:
        """The attention metadata of one step for layers with this ``window``."""
        dev = self.device
        batch = PagedBatch(pool=self.pool, slot_mapping=slot_mapping, flash=flash)
        if flash is not None:
            return batch
        decodes = [self._rows(*x, window) for x in spans if x[2] - x[1] == 1]
        if decodes:
            batch.num_decodes = len(decodes)
            batch.decode_chunks = decode_chunks(decodes, self.pool.pad_slot, self.pool.shape.num_kv_heads, dev)
        q_start = len(decodes)
        chunks_left = spans[len(decodes):]
        cached = [x for x in chunks_left if x[1] > 0]
        if self.batch_prefills and len(cached) > 1:  # they come last in the row
            chunks_left = chunks_left[: len(chunks_left) - len(cached)]
            q_at = num_ids - sum(end - start for _, start, end in cached)
            # padded to the longest context of their call: like lengths together (a long context beside
            # short ones padded each to its length), within a budget of rows x context
            for run in prefill_runs([end - self._ctx_start(start, window) for _, start, end in cached],
                                    [end - start for _, start, end in cached]):
                group = cached[run.start:run.stop]
                batch.batched.append(self._batched(group, q_at, window))
                q_at += sum(end - start for _, start, end in group)
        for flat, start, end in chunks_left:
            batch.prefills.append(self._prefill(flat, start, end, q_start, window))
            q_start += end - start
        return batch

    def _prefill(self, flat: torch.Tensor, start: int, end: int, q_start: int, window: int | None) -> PrefillGroup:
        """A prefill chunk for SDPA: plain causal over its own K/V when it starts the sequence (and no
        window cuts in), else masked over its context read back from the pool."""
        n = end - start
        if start == 0:
            mask = None
            if window is not None and end > window:
                p = torch.arange(0, end)
                mask = self._mask(p, p, window).to(self.device)
            return PrefillGroup(q_start, n, None, mask)
        ctx, mask = self._rows(flat, start, end, window)
        return PrefillGroup(q_start, n, ctx.to(self.device), mask.to(self.device))

    def _batched(self, spans: list[tuple[torch.Tensor, int, int]], q_start: int, window: int | None
                 ) -> BatchedPrefills:
        rows = [self._rows(*x, window) for x in spans]
        q_max = max(end - start for _, start, end in spans)
        l_max = max(len(ctx) for ctx, _ in rows)
        q_rows = torch.zeros(len(spans), q_max, dtype=torch.long)
        ctx_slots = torch.full((len(spans), l_max), self.pool.pad_slot, dtype=torch.long)
        mask = torch.zeros(len(spans), 1, q_max, l_max, dtype=torch.bool)
        real = []
        for c, ((ctx, m), (_, start, end)) in enumerate(zip(rows, spans, strict=True)):
            n = end - start
            q_rows[c] = q_start + torch.arange(q_max).clamp_(max=n - 1)  # padding repeats the last query
            ctx_slots[c, : len(ctx)] = ctx
            mask[c, 0, :n, : len(ctx)] = m
            mask[c, 0, n:, : len(ctx)] = m[-1]
            real.append(c * q_max + torch.arange(n))
            q_start += n
        dev = self.device
        return BatchedPrefills(q_rows.to(dev), ctx_slots.to(dev), mask.to(dev), torch.cat(real).to(dev))

    def _flash_meta(self, chunks: list[Chunk], order: list[int], spans: list[tuple[torch.Tensor, int, int]]) -> dict:
        dev = self.device
        tables = [chunks[i].seq.block_table for i in order]
        width = max(len(t) for t in tables)
        table = torch.zeros(len(tables), width, dtype=torch.int32)
        for j, t in enumerate(tables):
            table[j, : len(t)] = torch.tensor([max(b, 0) for b in t], dtype=torch.int32)
        q = torch.tensor([0] + [end - start for _, start, end in spans], dtype=torch.int32).cumsum(0, dtype=torch.int32)
        k = torch.tensor([0] + [end for _, _, end in spans], dtype=torch.int32).cumsum(0, dtype=torch.int32)
        return {"cu_seqlens_q": q.to(dev), "cu_seqlens_k": k.to(dev),
                "max_seqlen_q": int((q[1:] - q[:-1]).max()), "max_seqlen_k": int((k[1:] - k[:-1]).max()),
                "block_table": table.to(dev),
                "window": (-1, -1) if self.window is None else (self.window - 1, 0)}
