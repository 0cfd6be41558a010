"""Builds one packed forward pass from scheduled chunks and runs the transformers model on it."""

from __future__ import annotations

import torch

from cache.kv_pool import KVPool
from engine.attention import PagedBatch, PrefillGroup
from engine.scheduler import Chunk


class ModelRunner:
    def __init__(self, model: torch.nn.Module, pool: KVPool, block_size: int, window_size: int | None,
                 use_flash: bool = False):
        self.model = model
        self.pool = pool
        self.block_size = block_size
        self.window = window_size
        self.device = pool.device
        self.use_flash = use_flash

    def _slots(self, table: torch.Tensor, start: int, end: int) -> torch.Tensor:
        pos = torch.arange(start, end)
        return table[pos // self.block_size] * self.block_size + pos % self.block_size

    def _ctx_start(self, first_query_pos: int) -> int:
        """First key position any query from ``first_query_pos`` on can see."""
        return 0 if self.window is None else max(0, first_query_pos - self.window + 1)

    def _mask(self, q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
        m = k_pos[None, :] <= q_pos[:, None]
        if self.window is not None:
            m &= k_pos[None, :] > q_pos[:, None] - self.window
        return m

    @torch.inference_mode()
    def forward(self, chunks: list[Chunk], sample_mask: list[bool]) -> torch.Tensor:
        """Run ``chunks`` (decodes first in the row); returns float32 logits ``[N, V]`` for the chunks
        whose ``sample_mask`` entry is set, in chunk order."""
        order = sorted(range(len(chunks)), key=lambda i: chunks[i].num_tokens != 1)
        ids: list[int] = []
        positions: list[torch.Tensor] = []
        slots: list[torch.Tensor] = []
        keep: dict[int, int] = {}
        decode_ctx: list[torch.Tensor] = []
        decode_pos: list[int] = []
        prefills: list[PrefillGroup] = []
        flash_meta = {"q": [0], "k": [0], "tables": []} if self.use_flash else None
        for i in order:
            c = chunks[i]
            seq = c.seq
            start, end = seq.num_computed, seq.num_computed + c.num_tokens
            table = torch.tensor(seq.block_table, dtype=torch.long)
            q_start = len(ids)
            ids.extend(seq.tokens[start:end])
            positions.append(torch.arange(start, end))
            slots.append(self._slots(table, start, end))
            if sample_mask[i]:
                keep[i] = q_start + c.num_tokens - 1
            if flash_meta is not None:
                flash_meta["q"].append(flash_meta["q"][-1] + c.num_tokens)
                flash_meta["k"].append(flash_meta["k"][-1] + end)
                flash_meta["tables"].append(seq.block_table)
                continue
            ctx0 = self._ctx_start(start)
            if c.num_tokens == 1:
                decode_ctx.append(self._slots(table, ctx0, end))
                decode_pos.append(start)
            elif start == 0:
                mask = None
                if self.window is not None and end > self.window:
                    p = torch.arange(0, end)
                    mask = self._mask(p, p).to(self.device)
                prefills.append(PrefillGroup(q_start, c.num_tokens, None, mask))
            else:
                q_pos = torch.arange(start, end)
                k_pos = torch.arange(ctx0, end)
                prefills.append(PrefillGroup(q_start, c.num_tokens, self._slots(table, ctx0, end).to(self.device),
                                             self._mask(q_pos, k_pos).to(self.device)))
        dev = self.device
        batch = PagedBatch(pool=self.pool, slot_mapping=torch.cat(slots).to(dev), prefills=prefills)
        if decode_ctx:
            lmax = max(len(x) for x in decode_ctx)
            dslots = torch.zeros(len(decode_ctx), lmax, dtype=torch.long)
            dmask = torch.zeros(len(decode_ctx), 1, 1, lmax, dtype=torch.bool)
            for j, x in enumerate(decode_ctx):
                dslots[j, : len(x)] = x
                dmask[j, 0, 0, : len(x)] = True
            hkv = self.pool.shape.num_kv_heads
            head_slots = dslots[:, None, :] * hkv + torch.arange(hkv)[None, :, None]  # [D, Hkv, L]
            batch.num_decodes = len(decode_ctx)
            batch.decode_slots = head_slots.to(dev)
            batch.decode_mask = dmask.to(dev)
        if flash_meta is not None:
            batch.flash = self._flash_meta(flash_meta, chunks)
        input_ids = torch.tensor([ids], dtype=torch.long, device=dev)
        position_ids = torch.cat(positions).unsqueeze(0).to(dev)
        keep_idx = torch.tensor([keep[i] for i in range(len(chunks)) if i in keep], dtype=torch.long, device=dev)
        out = self.model(input_ids=input_ids, position_ids=position_ids, use_cache=False,
                         logits_to_keep=keep_idx, paged_batch=batch)
        return out.logits[0].float()

    def _flash_meta(self, m: dict, chunks: list[Chunk]) -> dict:
        dev = self.device
        width = max(len(t) for t in m["tables"])
        table = torch.zeros(len(m["tables"]), width, dtype=torch.int32)
        for j, t in enumerate(m["tables"]):
            table[j, : len(t)] = torch.tensor([max(b, 0) for b in t], dtype=torch.int32)
        q = torch.tensor(m["q"], dtype=torch.int32)
        k = torch.tensor(m["k"], dtype=torch.int32)
        return {"cu_seqlens_q": q.to(dev), "cu_seqlens_k": k.to(dev),
                "max_seqlen_q": int((q[1:] - q[:-1]).max()), "max_seqlen_k": int((k[1:] - k[:-1]).max()),
                "block_table": table.to(dev),
                "window": (-1, -1) if self.window is None else (self.window - 1, 0)}
