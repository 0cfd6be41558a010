"""Paged attention, plugged into transformers through ``AttentionInterface``.

The engine runs the model on one packed row of tokens (``[1, T]``): the decode tokens of running
sequences first, then prefill chunks. Each layer's attention function (1) writes the new K/V into the
paged pool by slot mapping, then (2) attends each query over its sequence's whole context read back
through the block table, with the causal offset (and sliding window) applied here, since
transformers passes no mask to a custom implementation. Batch metadata (slots, masks) is built once
per step in ``PagedBatch`` and reaches this function as a keyword argument of ``model(...)``.

Backends: torch SDPA everywhere (the reference), and ``vllm_flash_attn``'s paged varlen kernel on
CUDA when it imports and the pool is not fp8.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from cache.kv_pool import KVPool

ATTN_NAME = "radixserve_paged"
_SDPA_GQA = tuple(int(x) for x in torch.__version__.split(".")[:2]) >= (2, 5)  # enable_gqa argument
# Never cuDNN: it builds a graph for each new shape on first use (0.5-0.8 s each on an H200, measured by
# bench/gpu_check.sh), and a serving batch brings new (query, context) lengths every few steps.
SDPA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
# rows x padded context that decode attention gathers at once (32 decodes over 8,192 tokens): for an
# 8B Llama about 2 GB of K/V and scores; CUDA graph buckets stay within it
DECODE_ROW_TOKENS = 32 * 8192
# devices whose decode attention is SDPA's fused kernel (bench.step_profile measures it); elsewhere grouped
# matmuls with float32 scores: the masked CUDA kernels have not been checked against them on a GPU
FUSED_DECODE_DEVICES = ("cpu",)


# attention arguments some transformers models pass that this function would otherwise ignore:
# attention sinks (gpt-oss)
UNSUPPORTED_KWARGS = ("s_aux",)
PROBE_KWARG = "radixserve_probe"


@dataclass
class PrefillGroup:
    q_start: int  # offset of this chunk in the packed row
    q_len: int
    ctx_slots: torch.Tensor | None  # [ctx_len] slots of the whole context; None: no earlier context
    mask: torch.Tensor | None  # [q_len, ctx_len] bool (True = attend); None: plain causal


@dataclass
class BatchedPrefills:
    """Prefill chunks over earlier context, attended together by one padded SDPA call per layer. On a
    GPU a step of cache hits (eight questions after eight cached system prompts) otherwise costs a
    dozen kernel launches per chunk and layer, which took longer than the arithmetic. They come last
    in the packed row, in this order."""

    q_rows: torch.Tensor  # [C, Qmax] packed-row index of each chunk's queries (padding repeats its last)
    ctx_slots: torch.Tensor  # [C, Lmax] flat slots of each chunk's context (padding: the spare slot)
    mask: torch.Tensor  # [C, 1, Qmax, Lmax] bool (padding rows repeat the last real one)
    real: torch.Tensor  # [n] the real queries' rows in the flattened [C * Qmax] output, in packed order


@dataclass
class DecodeChunk:
    """Decode rows attended together, their contexts padded to the longest among them."""
    slots: torch.Tensor  # [n, Hkv, L] slot*Hkv+head of each row's context (padded)
    mask: torch.Tensor  # [n, 1, 1, L] bool
    rows: torch.Tensor | None = None  # [n] which of the step's decodes (None: all of them, in order)


@dataclass
class PagedBatch:
    pool: KVPool
    slot_mapping: torch.Tensor  # [T] where each new token's K/V goes
    # the first num_decodes queries attend one by one over contexts gathered from the pool: the decodes
    # (in a CUDA graph, every query: engine.cuda_graphs)
    num_decodes: int = 0
    decode_chunks: list[DecodeChunk] = field(default_factory=list)  # together, every decode row once
    prefills: list[PrefillGroup] = field(default_factory=list)
    batched: list[BatchedPrefills] = field(default_factory=list)  # after the prefills above, in row order
    # flash backend metadata (CUDA only)
    flash: dict | None = None
    # models whose layers differ (Gemma 3): these layers attend through ``sliding``, the same step's
    # metadata for their window (it shares ``slot_mapping``: every layer writes its K/V alike)
    sliding: PagedBatch | None = None
    sliding_layers: frozenset[int] = frozenset()


def decode_metadata(groups: list[tuple[torch.Tensor, torch.Tensor | None]], rows: int | None = None,
                    width: int | None = None, pad_slot: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """The flat context slots ``[rows, width]`` and ``decode_mask`` (on the host) of queries attended
    one by one, each over its own context gathered from the pool (``head_slots`` makes
    ``PagedBatch.decode_slots`` of the slots, on the device). ``groups`` are the chunks in row order:
    the flat slots of their context ``[L]`` and a mask ``[n, L]`` of what each of their ``n`` queries
    sees (None: one query that sees it all, a decode). Padded to ``rows`` x ``width`` (default: just
    enough); padding reads ``pad_slot``, masked off, and rows past the queries attend to that slot
    alone (a row with nothing to attend to would make NaNs)."""
    rows = rows or sum(1 if m is None else m.shape[0] for _, m in groups)
    width = width or max(len(ctx) for ctx, _ in groups)
    slots = torch.full((rows, width), pad_slot, dtype=torch.long)
    mask = torch.zeros(rows, 1, 1, width, dtype=torch.bool)
    r = 0
    for ctx, m in groups:
        n = 1 if m is None else m.shape[0]
        slots[r:r + n, : len(ctx)] = ctx
        mask[r:r + n, 0, 0, : len(ctx)] = True if m is None else m
        r += n
    mask[r:, 0, 0, 0] = True
    return slots, mask


# Decode rows whose contexts differ this much in length go in different chunks: padded to the longest
# of the batch, one 4,000-token context beside 31 of 100 tokens had every row gather 4,000 (a decode
# step of the bench model on one CPU thread: 810 ms, against 63 ms with the long one at 130 tokens)
CHUNK_PAD_RATIO = 2


def like_length_runs(lengths: list[int], row_tokens: int = DECODE_ROW_TOKENS) -> list[range]:
    """``length_chunks``'s rule over rows kept in their order: runs of neighbouring rows whose
    lengths are within ``CHUNK_PAD_RATIO`` of each other and whose rows x longest stay within
    ``row_tokens`` (the caller orders them by length, so like lengths are neighbours)."""
    runs: list[range] = []
    start, lo, hi = 0, 0, 0
    for i, n in enumerate(max(1, x) for x in lengths):
        if i and max(hi, n) <= CHUNK_PAD_RATIO * min(lo, n) and (i - start + 1) * max(hi, n) <= row_tokens:
            lo, hi = min(lo, n), max(hi, n)
            continue
        if i:
            runs.append(range(start, i))
        start, lo, hi = i, n, n
    if lengths:
        runs.append(range(start, len(lengths)))
    return runs


# query x key pairs one batched call of cached prefill chunks pads to (per head: a softcap model's float32
# scores are 4 bytes each, 1 GiB at 16 heads), and the padding it may add past twice the real pairs
PREFILL_PAIRS = 16 * DECODE_ROW_TOKENS
PREFILL_PAD_SLACK = 1 << 20


def prefill_runs(contexts: list[int], queries: list[int]) -> list[range]:
    """``like_length_runs`` for cached prefill chunks, which pad to their call's longest query as well as
    its longest context: runs within ``PREFILL_PAIRS`` rows x longest query x longest context, whose
    padding adds at most twice their real query x key pairs (or ``PREFILL_PAD_SLACK``, for short chunks,
    whose padding costs nothing). A 512-token chunk beside 127 tails of 8 tokens, padded each to 512
    queries, was 50x the work."""
    runs: list[range] = []
    start = real = 0
    c_lo = c_hi = q_hi = 0
    for i, (c, q) in enumerate(zip((max(1, x) for x in contexts), (max(1, x) for x in queries), strict=True)):
        n, ch, cl, qh, r = i - start + 1, max(c_hi, c), min(c_lo, c), max(q_hi, q), real + q * c
        if i and ch <= CHUNK_PAD_RATIO * cl and n * ch <= DECODE_ROW_TOKENS and n * ch * qh <= PREFILL_PAIRS \
                and n * ch * qh - r <= max(CHUNK_PAD_RATIO * r, PREFILL_PAD_SLACK):
            c_lo, c_hi, q_hi, real = cl, ch, qh, r
            continue
        if i:
            runs.append(range(start, i))
        start, c_lo, c_hi, q_hi, real = i, c, c, q, q * c
    if contexts:
        runs.append(range(start, len(contexts)))
    return runs


def length_chunks(lengths: list[int], row_tokens: int = DECODE_ROW_TOKENS) -> list[list[int]]:
    """Rows (indices into ``lengths``) grouped for decode attention: ``like_length_runs`` over the rows
    ordered longest first, so a row joins its chunk while it is at least 1 / ``CHUNK_PAD_RATIO`` of the
    chunk's longest (padding at most doubles what a chunk gathers) within ``row_tokens``. Rows of like
    lengths make one chunk, as before."""
    order = sorted(range(len(lengths)), key=lambda r: -lengths[r])
    return [[order[j] for j in run] for run in like_length_runs([lengths[i] for i in order], row_tokens)]


def decode_chunks(decodes: list[tuple[torch.Tensor, None]], pad_slot: int, num_kv_heads: int,
                  device: torch.device) -> list[DecodeChunk]:
    """The ``DecodeChunk``s of a step's decodes (each its context's flat slots), on ``device``."""
    groups = length_chunks([len(ctx) for ctx, _ in decodes])
    if len(groups) == 1:  # (in the step's order: a chunk without rows holds them all, in order)
        groups = [list(range(len(decodes)))]
    chunks = []
    for rows in groups:
        slots, mask = decode_metadata([decodes[i] for i in rows], pad_slot=pad_slot)
        chunks.append(DecodeChunk(head_slots(slots.to(device), num_kv_heads), mask.to(device),
                                  None if len(groups) == 1 else torch.tensor(rows, dtype=torch.long).to(device)))
    return chunks


def head_slots(slots: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """``[rows, width]`` flat slots -> ``[rows, Hkv, width]`` rows of the pool's per-head layout
    (``slot * Hkv + head``): built where the slots are, so only the slots cross to the device."""
    heads = torch.arange(num_kv_heads, device=slots.device)
    return slots[:, None, :] * num_kv_heads + heads[None, :, None]


def _expand_kv(x: torch.Tensor, groups: int) -> torch.Tensor:
    """[.., Hkv, L, D] -> [.., Hkv*groups, L, D] for grouped-query attention."""
    return x if groups == 1 else x.repeat_interleave(groups, dim=-3)


def _grouped(k: torch.Tensor, v: torch.Tensor, groups: int, masked: bool = False
             ) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """K, V and SDPA's keyword for grouped-query attention. K/V are repeated instead where torch < 2.5
    has no keyword, and for a masked call on CUDA: there flash takes no mask and the memory-efficient
    kernel no grouped heads, so ``enable_gqa`` would leave only the math kernel."""
    if groups == 1:
        return k, v, {}
    if _SDPA_GQA and not (masked and k.is_cuda):
        return k, v, {"enable_gqa": True}
    return _expand_kv(k, groups), _expand_kv(v, groups), {}


def paged_attention(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    attention_mask: torch.Tensor | None, scaling: float | None = None,
                    dropout: float = 0.0, paged_batch: PagedBatch | None = None, **kwargs):
    """The function transformers calls per layer: q/k/v ``[1, H, T, D]`` -> ``([1, T, H, D], None)``."""
    if (asked := kwargs.get(PROBE_KWARG)) is not None:  # engine.layer_probe: record what the layer asks, attend to nothing
        asked[module.layer_idx] = {"sliding_window": kwargs.get("sliding_window"), "groups": module.num_key_value_groups}
        return torch.zeros_like(query).transpose(1, 2), None
    if paged_batch is None:
        raise RuntimeError("radixserve paged attention called without batch metadata")
    for name in UNSUPPORTED_KWARGS:  # model_support refuses these models; never drop them silently
        if kwargs.get(name) is not None:
            raise NotImplementedError(f"radixserve paged attention does not implement {name!r}")
    b = paged_batch
    softcap = kwargs.get("softcap")  # Gemma 2: scores become tanh(s / cap) * cap before the softmax
    layer = module.layer_idx
    groups = module.num_key_value_groups
    q = query[0]  # [H, T, D]
    k_new = key[0].transpose(0, 1)  # [T, Hkv, D]
    v_new = value[0].transpose(0, 1)
    b.pool.write(layer, b.slot_mapping, k_new, v_new)
    if b.sliding is not None and layer in b.sliding_layers:
        b = b.sliding
    if b.flash is not None:
        return _flash_attention(b, layer, q, scaling, softcap), None

    outs: list[torch.Tensor] = []
    prefills = bool(b.prefills) or bool(b.batched)
    sdpa = prefills or (b.num_decodes > 0 and q.device.type in FUSED_DECODE_DEVICES)
    # once per layer, and only around SDPA: it sets (and restores) process-wide flags
    with sdpa_kernel(SDPA_BACKENDS) if sdpa else nullcontext():
        if b.num_decodes:
            outs.append(_decode_attention(b, layer, q[:, : b.num_decodes], groups, scaling, softcap))
        if prefills:
            outs.extend(_prefill_attention(b, layer, query, key, value, groups, scaling, softcap))
            outs.extend(_batched_prefill_attention(b, p, layer, q, groups, scaling, softcap) for p in b.batched)
    out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=0)
    return out.unsqueeze(0), None


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: torch.Tensor | None = None,
          is_causal: bool = False, scale: float | None = None, softcap: float | None = None,
          enable_gqa: bool = False) -> torch.Tensor:
    """SDPA; with ``softcap``, the same arithmetic with soft-capped scores, in float32 (no fused kernel
    here takes a cap)."""
    if softcap is None:
        gqa = {"enable_gqa": True} if enable_gqa else {}
        return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=is_causal, scale=scale, **gqa)
    if enable_gqa:
        k, v = _expand_kv(k, q.shape[-3] // k.shape[-3]), _expand_kv(v, q.shape[-3] // v.shape[-3])
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2))
    scores = _capped(scores.mul_(q.shape[-1] ** -0.5 if scale is None else scale), softcap)
    if is_causal:  # SDPA's: query i sees keys 0..i
        attn_mask = torch.ones(scores.shape[-2:], dtype=torch.bool, device=scores.device).tril_()
    if attn_mask is not None:
        scores.masked_fill_(~attn_mask, float("-inf"))
    return torch.matmul(torch.softmax(scores, dim=-1).to(v.dtype), v)


def _capped(scores: torch.Tensor, softcap: float | None) -> torch.Tensor:
    return scores if softcap is None else scores.div_(softcap).tanh_().mul_(softcap)


def _prefill_attention(b: PagedBatch, layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                       groups: int, scaling: float | None, softcap: float | None) -> list[torch.Tensor]:
    """Each prefill chunk over its context (its own new K/V when it starts the sequence, else the
    context read back from the pool): ``[n, H, Dh]`` per chunk."""
    outs = []
    for g in b.prefills:
        qp = query[:, :, g.q_start:g.q_start + g.q_len]  # [1, H, n, Dh]
        if g.ctx_slots is None:
            kp = key[:, :, g.q_start:g.q_start + g.q_len]
            vp = value[:, :, g.q_start:g.q_start + g.q_len]
            if b.pool.storage_dtype != query.dtype:  # lossy pool: read back what later steps will see
                kp, vp = b.pool.read_slots(layer, b.slot_mapping[g.q_start:g.q_start + g.q_len])
                kp, vp = kp.transpose(0, 1).unsqueeze(0), vp.transpose(0, 1).unsqueeze(0)
        else:
            kc, vc = b.pool.read_slots(layer, g.ctx_slots)  # [ctx, Hkv, Dh]
            kp, vp = kc.transpose(0, 1).unsqueeze(0), vc.transpose(0, 1).unsqueeze(0)
        kp, vp, gqa = _grouped(kp, vp, groups, masked=g.mask is not None)
        if g.mask is None:
            op = _sdpa(qp, kp, vp, is_causal=True, scale=scaling, softcap=softcap, **gqa)
        else:
            op = _sdpa(qp, kp, vp, attn_mask=g.mask, scale=scaling, softcap=softcap, **gqa)
        outs.append(op[0].transpose(0, 1))  # [n, H, Dh]
    return outs


def _batched_prefill_attention(b: PagedBatch, p: BatchedPrefills, layer: int, q: torch.Tensor, groups: int,
                               scaling: float | None, softcap: float | None = None) -> torch.Tensor:
    """``p``'s chunks (one of ``b.batched``) in one SDPA call: q ``[H, T, Dh]`` -> ``[n, H, Dh]`` of their queries."""
    c, lmax = p.ctx_slots.shape
    qb = q[:, p.q_rows].transpose(0, 1)  # [C, H, Qmax, Dh]
    k, v = b.pool.read_slots(layer, p.ctx_slots.reshape(-1))  # [C * Lmax, Hkv, Dh]
    k = k.view(c, lmax, *k.shape[1:]).transpose(1, 2)  # [C, Hkv, Lmax, Dh]
    v = v.view(c, lmax, *v.shape[1:]).transpose(1, 2)
    k, v, gqa = _grouped(k, v, groups, masked=True)
    out = _sdpa(qb, k, v, attn_mask=p.mask, scale=scaling, softcap=softcap, **gqa)  # [C, H, Qmax, Dh]
    return out.transpose(1, 2).reshape(-1, out.shape[1], out.shape[3])[p.real]


def _decode_attention(b: PagedBatch, layer: int, q: torch.Tensor, groups: int, scaling: float | None,
                      softcap: float | None = None) -> torch.Tensor:
    """One query per sequence over its paged context, its query heads grouped by their KV head, so GQA's
    shared K/V heads are read once instead of being repeated per query head. q ``[H, D, Dh]`` -> ``[D, H, Dh]``,
    chunk by chunk (``DecodeChunk``: rows of like context lengths)."""
    chunks = b.decode_chunks
    if len(chunks) == 1 and chunks[0].rows is None:
        return _decode_chunk(b.pool, layer, q, chunks[0], groups, scaling, softcap)
    out = q.new_empty(q.shape[1], q.shape[0], q.shape[2])
    for chunk in chunks:
        out[chunk.rows] = _decode_chunk(b.pool, layer, q[:, chunk.rows], chunk, groups, scaling, softcap)
    return out


def _decode_chunk(pool: KVPool, layer: int, q: torch.Tensor, chunk: DecodeChunk, groups: int,
                  scaling: float | None, softcap: float | None) -> torch.Tensor:
    """A chunk's rows, ``DECODE_ROW_TOKENS`` (rows x padded context) at a time: the gathered K/V and
    scores grow with both, and many decodes over long contexts would otherwise ask for tens of GB at once."""
    d, width = q.shape[1], chunk.slots.shape[-1]
    step = max(1, DECODE_ROW_TOKENS // width)
    if d <= step:
        return _decode_rows(pool, layer, q, chunk.slots, chunk.mask, groups, scaling, softcap)
    return torch.cat([_decode_rows(pool, layer, q[:, i:i + step], chunk.slots[i:i + step],
                                   chunk.mask[i:i + step], groups, scaling, softcap) for i in range(0, d, step)])


def _decode_rows(pool: KVPool, layer: int, q: torch.Tensor, slots: torch.Tensor, mask: torch.Tensor, groups: int,
                 scaling: float | None, softcap: float | None = None) -> torch.Tensor:
    h, d, dh = q.shape
    k, v = pool.read_heads(layer, slots)  # [D, Hkv, L, Dh], contiguous
    hkv = k.shape[1]
    qg = q.transpose(0, 1).reshape(d, hkv, groups, dh)  # query heads grouped by their KV head
    if k.device.type in FUSED_DECODE_DEVICES and softcap is None:
        # the query heads that share a KV head go in as that head's queries: K/V are read once, and the
        # fused kernel keeps its scores in float32 without writing them out (a decode step of the bench
        # model on one CPU thread: 54-63 ms against 76-84 with the matmuls below)
        return F.scaled_dot_product_attention(qg, k, v, attn_mask=mask, scale=scaling).reshape(d, h, dh)
    # scores in float32: a bf16 matmul would round them before the softmax, as fused kernels do not
    # (costs a float32 copy of the gathered K for 16-bit models, twice the gather's own size)
    scores = torch.matmul(qg.float(), k.float().transpose(-1, -2))  # [D, Hkv, G, L]
    _capped(scores.mul_(dh ** -0.5 if scaling is None else scaling), softcap)
    scores.masked_fill_(~mask, float("-inf"))  # mask [D, 1, 1, L]
    probs = torch.softmax(scores, dim=-1).to(v.dtype)
    return torch.matmul(probs, v).reshape(d, h, dh)


# ----------------------------------------------------------------------------- flash (CUDA)
def flash_available(device: torch.device) -> bool:
    """Whether vllm-flash-attn imports and runs here: its kernels need an Ampere GPU or newer (a T4 or a
    V100 passed the start-up and failed at the first real step)."""
    if device.type != "cuda" or torch.cuda.get_device_capability(device)[0] < 8:
        return False
    try:
        import vllm_flash_attn  # noqa: F401
    except Exception:  # noqa: BLE001 - any import failure means: use SDPA
        return False
    return True


def flash_fits(block_size: int, head_dim: int) -> bool:
    """Shapes vllm-flash-attn's paged kernels take (as vLLM's own flash backend checks): blocks of a
    multiple of 16 tokens and head sizes 32-256 in steps of 32; anything else runs on SDPA."""
    return block_size % 16 == 0 and head_dim % 32 == 0 and 32 <= head_dim <= 256


def _flash_attention(b: PagedBatch, layer: int, q: torch.Tensor, scaling: float | None,
                     softcap: float | None = None) -> torch.Tensor:
    from vllm_flash_attn import flash_attn_varlen_func

    f = b.flash
    k_cache, v_cache = b.pool.layer(layer)
    out = flash_attn_varlen_func(
        q.transpose(0, 1).contiguous(), k_cache, v_cache,
        cu_seqlens_q=f["cu_seqlens_q"], cu_seqlens_k=f["cu_seqlens_k"],
        max_seqlen_q=f["max_seqlen_q"], max_seqlen_k=f["max_seqlen_k"],
        softmax_scale=scaling, causal=True, window_size=f["window"], block_table=f["block_table"],
        **({"softcap": softcap} if softcap else {}))  # (only when set: vllm-flash-attn before 2.6 has no such argument)
    return out.unsqueeze(0)  # [1, T, H, D]


def register() -> str:
    """Register the paged attention under ``ATTN_NAME`` (idempotent); returns the name."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_NAME, paged_attention)
    return ATTN_NAME
