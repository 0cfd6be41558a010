"""The paged attention function alone: which SDPA kernels prefills may use, and decode numerics."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

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
    batch = SimpleNamespace(pool=pool, decode_slots=torch.zeros(d, hkv, length, dtype=torch.long),
                            decode_mask=torch.ones(d, 1, 1, length, dtype=torch.bool))
    out = attention._decode_attention(batch, 0, q, groups, scale).float()  # [D, H, Dh]

    qg = q.float().transpose(0, 1).reshape(d, hkv, groups, dh)
    probs = torch.softmax(qg @ k.float().transpose(-1, -2) * scale, dim=-1)
    ref = (probs @ v.float()).reshape(d, hkv * groups, dh)
    err = ((out - ref).norm() / ref.norm()).item()
    assert err < 0.005, err  # bf16 probabilities and output only: 0.002 (bf16 scores: 0.014)


def test_many_decodes_beside_a_long_context_attend_in_bounded_slices(monkeypatch, decode_path):
    """Decode rows are padded to the longest context, so rows x context bounds what one call gathers;
    past ``DECODE_ROW_TOKENS`` the rows go in slices, with the same result as all at once."""
    from cache.kv_pool import KVPool, KVShape

    g = torch.Generator().manual_seed(0)
    hkv, groups, dh, bs = 2, 3, 8, 16
    pool = KVPool(KVShape(num_layers=1, num_blocks=64, block_size=bs, num_kv_heads=hkv, head_dim=dh))
    slots = torch.randperm(64 * bs, generator=g)
    pool.write(0, slots, torch.randn(len(slots), hkv, dh, generator=g), torch.randn(len(slots), hkv, dh, generator=g))
    lengths = [700, 5, 33, 1, 16, 250, 9]  # one long context beside short ones
    ctx = [slots[sum(lengths[:i]):sum(lengths[:i + 1])] for i in range(len(lengths))]
    flat, mask = attention.decode_metadata([(c, None) for c in ctx])
    batch = SimpleNamespace(pool=pool, decode_slots=attention.head_slots(flat, hkv), decode_mask=mask)
    q = torch.randn(hkv * groups, len(lengths), dh, generator=g)
    whole = attention._decode_attention(batch, 0, q, groups, None)
    gathered: list[int] = []
    read = pool.read_heads
    monkeypatch.setattr(pool, "read_heads", lambda layer, s: gathered.append(s.numel()) or read(layer, s))
    monkeypatch.setattr(attention, "DECODE_ROW_TOKENS", 2 * 700)
    sliced = attention._decode_attention(batch, 0, q, groups, None)
    assert gathered == [2 * hkv * 700] * 3 + [hkv * 700]  # 7 rows, 2 at a time
    torch.testing.assert_close(sliced, whole)
    for i, c in enumerate(ctx):  # and each row is its own context's attention
        k, v = pool.read_slots(0, c)
        qg = q[:, i].reshape(hkv, groups, dh)
        ref = torch.softmax(qg @ k.transpose(0, 1).transpose(-1, -2) * dh ** -0.5, -1) @ v.transpose(0, 1)
        torch.testing.assert_close(sliced[i], ref.reshape(hkv * groups, dh))


def test_the_flash_backend_is_only_chosen_for_shapes_its_kernels_take():
    assert attention.flash_fits(16, 128) and attention.flash_fits(32, 64) and attention.flash_fits(16, 256)
    assert not attention.flash_fits(8, 128)  # blocks of a multiple of 16 tokens only
    assert not any(attention.flash_fits(16, h) for h in (16, 80, 100, 288, 512))  # head sizes 32..256, steps of 32
