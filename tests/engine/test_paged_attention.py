"""The paged attention function alone: which SDPA kernels prefills may use, and decode numerics."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import engine.attention as attention
from engine.sequence import SamplingParams


@pytest.fixture(params=["fused", "matmuls"])
def decode_path(request, monkeypatch):
    """Both decode attention paths: SDPA's fused kernel (CPUs) and the grouped matmuls (elsewhere)."""
    monkeypatch.setattr(attention, "FUSED_DECODE_DEVICES", ("cpu",) if request.param == "fused" else ())
    return request.param


def test_prefill_attention_never_runs_cudnn(make_engine, monkeypatch):
    """cuDNN's SDPA builds a graph for every new shape on first use (0.5-0.8 s each on an H200), so
    both prefill paths (plain causal, and cached context with a mask) must run with it switched off."""
    seen: list[tuple[bool, bool]] = []  # (had a mask, cuDNN allowed) per call
    real = torch.nn.functional.scaled_dot_product_attention

    def spy(*args, **kwargs):
        seen.append((kwargs.get("attn_mask") is not None, torch.backends.cuda.cudnn_sdp_enabled()))
        return real(*args, **kwargs)

    monkeypatch.setattr(attention.F, "scaled_dot_product_attention", spy)
    before = torch.backends.cuda.cudnn_sdp_enabled()
    eng = make_engine("tiny", max_prefill_chunk_tokens=32, cuda_graphs=())  # graphs take short chunks on CUDA
    prefix = list(range(20, 84))
    eng.generate([prefix + [5, 6, 7]], SamplingParams(max_new_tokens=2))
    eng.generate([prefix + [8, 9]], SamplingParams(max_new_tokens=2))  # cached prefix: masked path
    assert {masked for masked, _ in seen} == {True, False}
    assert not any(allowed for _, allowed in seen)
    assert torch.backends.cuda.cudnn_sdp_enabled() == before  # the process-wide setting is left as it was


def test_decode_scores_are_not_rounded_to_bf16_before_the_softmax(decode_path):
    """With a bf16 model, Q.K in bf16 rounds each score (spacing 0.25 near 50) before the softmax, which
    fused kernels never do: greedy paths then parted from transformers' after ~4 tokens on an H200
    (8 with float32 scores; transformers' own batched variants: 11-13)."""
    g = torch.Generator().manual_seed(0)
    d, hkv, groups, length, dh = 4, 2, 4, 96, 64
    q = torch.randn(hkv * groups, d, dh, generator=g)
    k = torch.randn(d, hkv, length, dh, generator=g)
    v = torch.randn(d, hkv, length, dh, generator=g)
    q, k, v = (x.to(torch.bfloat16) for x in (q, k, v))
    scale = 1.0  # scores of std ~8 and peaks near 30: where bf16 spacing is 0.125-0.25
    pool = SimpleNamespace(read_heads=lambda layer, slots: (k, v))
    batch = SimpleNamespace(pool=pool, decode_chunks=[attention.DecodeChunk(
        torch.zeros(d, hkv, length, dtype=torch.long), torch.ones(d, 1, 1, length, dtype=torch.bool))])
    out = attention._decode_attention(batch, 0, q, groups, scale).float()  # [D, H, Dh]

    qg = q.float().transpose(0, 1).reshape(d, hkv, groups, dh)
    probs = torch.softmax(qg @ k.float().transpose(-1, -2) * scale, dim=-1)
    ref = (probs @ v.float()).reshape(d, hkv * groups, dh)
    err = ((out - ref).norm() / ref.norm()).item()
    assert err < 0.005, err  # bf16 probabilities and output only: 0.002 (bf16 scores: 0.014)


def test_many_decodes_beside_a_long_context_attend_in_bounded_slices(monkeypatch, decode_path):
    """A chunk's rows are padded to its longest context, so rows x context bounds what one call gathers;
    past ``DECODE_ROW_TOKENS`` the rows go in slices, with the same result as all at once. And rows of
    unlike lengths go in chunks of their own, with the same result again, gathering less."""
    from cache.kv_pool import KVPool, KVShape

    g = torch.Generator().manual_seed(0)
    hkv, groups, dh, bs = 2, 3, 8, 16
    pool = KVPool(KVShape(num_layers=1, num_blocks=64, block_size=bs, num_kv_heads=hkv, head_dim=dh))
    slots = torch.randperm(64 * bs, generator=g)
    pool.write(0, slots, torch.randn(len(slots), hkv, dh, generator=g), torch.randn(len(slots), hkv, dh, generator=g))
    lengths = [700, 5, 33, 1, 16, 250, 9]  # one long context beside short ones
    ctx = [slots[sum(lengths[:i]):sum(lengths[:i + 1])] for i in range(len(lengths))]
    flat, mask = attention.decode_metadata([(c, None) for c in ctx])
    batch = SimpleNamespace(pool=pool, decode_chunks=[attention.DecodeChunk(attention.head_slots(flat, hkv), mask)])
    q = torch.randn(hkv * groups, len(lengths), dh, generator=g)
    whole = attention._decode_attention(batch, 0, q, groups, None)
    gathered: list[int] = []
    read = pool.read_heads
    monkeypatch.setattr(pool, "read_heads", lambda layer, s: gathered.append(s.numel()) or read(layer, s))
    monkeypatch.setattr(attention, "DECODE_ROW_TOKENS", 2 * 700)
    sliced = attention._decode_attention(batch, 0, q, groups, None)
    assert gathered == [2 * hkv * 700] * 3 + [hkv * 700]  # 7 rows, 2 at a time
    torch.testing.assert_close(sliced, whole)
    monkeypatch.setattr(attention, "DECODE_ROW_TOKENS", 32 * 8192)
    gathered.clear()
    batch.decode_chunks = attention.decode_chunks([(c, None) for c in ctx], pool.pad_slot, hkv, torch.device("cpu"))
    chunked = attention._decode_attention(batch, 0, q, groups, None)
    assert sorted(gathered) == sorted(hkv * n for n in (700, 250, 33, 16 * 2, 5, 1))  # 700 | 250 | 33 | 16, 9 | 5 | 1
    assert sum(gathered) < len(lengths) * hkv * 700 / 3  # (a third of padding them all to 700)
    torch.testing.assert_close(chunked, whole)
    for order in ([ctx[6], ctx[4]], [ctx[4], ctx[6]]):  # lengths 9, 16 (and 16, 9): one chunk, in the step's order
        batch.decode_chunks = attention.decode_chunks([(c, None) for c in order], pool.pad_slot, hkv,
                                                      torch.device("cpu"))
        assert len(batch.decode_chunks) == 1
        one = attention._decode_attention(batch, 0, q[:, :2], groups, None)
        flat2, mask2 = attention.decode_metadata([(c, None) for c in order])
        alone = SimpleNamespace(pool=pool, decode_chunks=[attention.DecodeChunk(attention.head_slots(flat2, hkv), mask2)])
        torch.testing.assert_close(one, attention._decode_attention(alone, 0, q[:, :2], groups, None))
    for i, c in enumerate(ctx):  # and each row is its own context's attention
        k, v = pool.read_slots(0, c)
        qg = q[:, i].reshape(hkv, groups, dh)
        ref = torch.softmax(qg @ k.transpose(0, 1).transpose(-1, -2) * dh ** -0.5, -1) @ v.transpose(0, 1)
        torch.testing.assert_close(sliced[i], ref.reshape(hkv * groups, dh))


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, 5000), min_size=1, max_size=64), st.integers(1, 20_000))
def test_length_chunks_hold_every_row_once_pad_at_most_double_and_keep_the_budget(lengths, budget):
    chunks = attention.length_chunks(lengths, budget)
    assert sorted(i for c in chunks for i in c) == list(range(len(lengths)))
    for c in chunks:
        width = max(1, lengths[c[0]])
        assert all(max(1, lengths[i]) <= width and max(1, lengths[i]) * attention.CHUNK_PAD_RATIO >= width for i in c)
        assert len(c) == 1 or len(c) * width <= budget
    if len({max(1, n) for n in lengths}) == 1 and len(lengths) * max(1, lengths[0]) <= budget:
        assert len(chunks) == 1  # like lengths: one chunk, as before


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, 5000), max_size=64), st.integers(1, 20_000))
def test_like_length_runs_keep_the_order_pad_at_most_double_and_keep_the_budget(lengths, budget):
    runs = attention.like_length_runs(lengths, budget)
    assert [i for r in runs for i in r] == list(range(len(lengths)))  # contiguous, in order, each once
    for r in runs:
        sizes = [max(1, lengths[i]) for i in r]
        assert len(r) == 1 or (max(sizes) <= attention.CHUNK_PAD_RATIO * min(sizes) and len(r) * max(sizes) <= budget)
    for a, b in zip(runs, runs[1:], strict=False):  # greedy: a run ends only where the next row could not join it
        sizes = [max(1, lengths[i]) for i in (*a, b[0])]
        assert max(sizes) > attention.CHUNK_PAD_RATIO * min(sizes) or len(sizes) * max(sizes) > budget


def test_the_flash_backend_is_only_chosen_for_shapes_its_kernels_take():
    assert attention.flash_fits(16, 128) and attention.flash_fits(32, 64) and attention.flash_fits(16, 256)
    assert not attention.flash_fits(8, 128)  # blocks of a multiple of 16 tokens only
    assert not any(attention.flash_fits(16, h) for h in (16, 80, 100, 288, 512))  # head sizes 32..256, steps of 32


def test_the_mixed_decode_bench_runs(model_dir, tmp_path):
    from bench.mixed_decode import main

    out = main(["--model-dir", model_dir("tiny"), "--long", "200", "--short", "3", "--short-len", "20",
                "--repeats", "1", "--out", str(tmp_path)])
    assert out["mixed_chunked_ms"] > 0 and (tmp_path / "mixed_decode.png").stat().st_size > 0
    assert attention.CHUNK_PAD_RATIO == 2  # (put back)


def test_flash_is_taken_only_on_gpus_its_kernels_run_on(monkeypatch):
    # a T4 or V100 (compute capability 7.x) took vllm-flash-attn when it imported, and failed at the first
    # real step, after the start-up passed
    import sys
    import types

    from engine import attention

    monkeypatch.setitem(sys.modules, "vllm_flash_attn", types.ModuleType("vllm_flash_attn"))
    for capability, takes in (((7, 5), False), ((8, 0), True), ((9, 0), True)):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None, c=capability: c)
        assert attention.flash_available(torch.device("cuda")) is takes, capability
    assert attention.flash_available(torch.device("cpu")) is False


def test_cached_prefill_chunks_are_batched_alike_in_queries_too():
    # a 512-token chunk and 127 tails of 8 tokens, contexts 1100-2048: grouped by context alone they made
    # one call padded to 128 x 512 queries x 2048 keys (50x the real work; gigabytes of float32 scores)
    from engine.attention import PREFILL_PAD_SLACK, PREFILL_PAIRS, prefill_runs

    contexts, queries = [2048] + [1100 + 7 * i for i in range(127)], [512] + [8] * 127
    runs = prefill_runs(contexts, queries)
    assert [r.start for r in runs] == sorted(r.start for r in runs) and sum(map(len, runs)) == 128
    for r in runs:
        n, q, c = len(r), max(queries[i] for i in r), max(contexts[i] for i in r)
        real = sum(queries[i] * contexts[i] for i in r)
        assert n * q * c <= PREFILL_PAIRS and n * q * c - real <= max(2 * real, PREFILL_PAD_SLACK)
    assert len(runs) <= 3  # (the tails still share calls)
    assert prefill_runs([67, 104, 81, 73], [3, 40, 17, 9]) == [range(0, 4)]  # short chunks: one call, as before
