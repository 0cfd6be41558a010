"""Paged KV pool: exact round trips for float dtypes, bounded fp8 error, sizes."""

from __future__ import annotations

import os

import pytest
import torch

from cache.kv_pool import KVPool, KVShape, bytes_per_token, num_blocks_for, resolve_kv_dtype

SHAPE = KVShape(num_layers=2, num_blocks=8, block_size=4, num_kv_heads=2, head_dim=16)
# bench/gpu_check.sh sets cuda: the fp8 casts, byte views and index copies then run on the device
DEV = torch.device(os.environ.get("RADIXSERVE_TEST_DEVICE", "cpu"))


def _roundtrip(dtype: str, compute=torch.float32):
    torch.manual_seed(0)
    pool = KVPool(SHAPE, dtype, compute, DEV)
    k = torch.randn(10, 2, 16, dtype=compute).to(DEV)
    v = torch.randn(10, 2, 16, dtype=compute).to(DEV)
    table = torch.tensor([5, 2, 7], device=DEV)
    slots = (table.repeat_interleave(4) * 4 + torch.arange(4, device=DEV).repeat(3))[:10]
    pool.write(1, slots, k, v)
    gk, gv = pool.gather(1, table, num_tokens=10)
    return k, v, gk, gv, pool


@pytest.mark.parametrize("dtype,compute", [("auto", torch.float32), ("float32", torch.float32),
                                           ("bfloat16", torch.bfloat16), ("float16", torch.float16),
                                           ("auto", torch.bfloat16)])
def test_float_roundtrip_is_exact(dtype, compute):
    k, v, gk, gv, pool = _roundtrip(dtype, compute)
    assert torch.equal(gk, k) and torch.equal(gv, v)
    assert gk.dtype == compute
    # other layer untouched
    assert torch.count_nonzero(pool.gather(0, torch.tensor([5, 2, 7], device=DEV))[0]) == 0


@pytest.mark.parametrize("dtype,bound", [("fp8_e4m3fn", 0.04), ("fp8_e5m2", 0.08)])
def test_fp8_roundtrip_error_is_bounded(dtype, bound):
    k, v, gk, gv, _ = _roundtrip(dtype)
    rel = ((gk - k).norm() / k.norm()).item()
    print(f"{dtype} relative error {rel:.4f}")
    assert 0 < rel < bound


def test_fp8_scale_keeps_large_values_finite():
    pool = KVPool(SHAPE, "fp8_e4m3fn", device=DEV)
    pool.set_scales([10.0, 10.0], [10.0, 10.0])
    k, zero = torch.full((1, 2, 16), 3000.0, device=DEV), torch.tensor([0], device=DEV)
    pool.write(0, zero, k, -k)
    gk, gv = pool.read_slots(0, zero)
    assert torch.isfinite(gk).all() and abs(gk[0, 0, 0].item() - 3000) / 3000 < 0.07
    pool2 = KVPool(SHAPE, "fp8_e4m3fn", device=DEV)  # scale 1: clamped at the fp8 max, never NaN
    pool2.write(0, zero, k, -k)
    assert torch.isfinite(pool2.read_slots(0, zero)[0]).all()


def test_a_float16_cache_of_a_wider_model_clamps_outliers_instead_of_storing_inf():
    pool = KVPool(SHAPE, "float16", torch.bfloat16, DEV)
    k = torch.tensor([1e5, -1e5, 3.0]).repeat_interleave(32).view(3, 2, 16).to(torch.bfloat16).to(DEV)
    slots = torch.tensor([0, 1, 2], device=DEV)
    pool.write(0, slots, k, k)
    gk, gv = pool.read_slots(0, slots)
    assert torch.isfinite(gk).all() and torch.isfinite(gv).all()
    assert gk[0, 0, 0] == 65504 and gk[1, 0, 0] == -65504 and gk[2, 0, 0] == 3.0


def test_bytes_per_token_fp8_half_bf16_quarter_fp32():
    args = (32, 8, 128)
    fp8 = bytes_per_token(*args, "fp8_e4m3fn")
    assert bytes_per_token(*args, "bfloat16") == 2 * fp8
    assert bytes_per_token(*args, "float32") == 4 * fp8
    assert KVPool(SHAPE, "fp8_e5m2").bytes_per_token * 2 == KVPool(SHAPE, "bfloat16").bytes_per_token


def test_sizing():
    assert num_blocks_for(16, 100, 4096, 0.5, torch.device("cpu")) == 256
    n = num_blocks_for(16, 1 << 20, None, 0.01, torch.device("cpu"))
    assert n >= 1
    with pytest.raises(ValueError):
        num_blocks_for(16, 100, None, 1.5, torch.device("cpu"))
    with pytest.raises(ValueError):
        resolve_kv_dtype("int4", torch.float32)
    # a CPU pool without a size takes at most 4 GiB, however much memory the machine has (this one: 24)
    from cache.kv_pool import CPU_POOL_CAP_BYTES, available_memory

    if available_memory(torch.device("cpu")) <= CPU_POOL_CAP_BYTES:
        pytest.skip("less than 4 GiB available: the cap cannot show")
    # (the pool's padding block within the budget: num_blocks + 1 blocks are allocated)
    assert num_blocks_for(16, 1024, None, 1.0, torch.device("cpu")) == CPU_POOL_CAP_BYTES // (1024 * 16) - 1


def test_a_gpu_pool_leaves_room_for_a_step_whatever_the_fraction(monkeypatch):
    # kv_memory_fraction 1.0 took every free byte, and the first step ran out of memory
    from cache.kv_pool import available_memory, pool_problem

    gib, emptied = 1 << 30, []
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (20 * gib, 80 * gib))
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: emptied.append(1))
    cuda = torch.device("cuda")
    assert available_memory(cuda) == 16 * gib and emptied  # 5% of 80 GiB kept (and torch's cache let go first)
    assert num_blocks_for(16, 1024, None, 1.0, cuda) == 16 * gib // (1024 * 16) - 1
    assert num_blocks_for(16, 1024, None, 0.5, cuda) == 8 * gib // (1024 * 16) - 1
    # (the blocks handed out and the padding block: 16 GiB of 16-token blocks of 1 KiB per token fit)
    assert pool_problem(16 * gib // (1024 * 16) - 1, 16, 1024, cuda) is None
    assert "free beside a step's working memory" in pool_problem(16 * gib // (1024 * 16), 16, 1024, cuda)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (2 * gib, 8 * gib))
    assert available_memory(cuda) == 1 * gib  # at least 1 GiB kept on a small GPU


def test_an_fp8_pool_a_device_cannot_store_is_refused_at_start_up(monkeypatch):
    """MPS has no float8 casts: the engine's start-up never wrote to the pool, so the service started and
    failed the first request's step."""
    def no_fp8(self, x, scale):
        raise TypeError("Trying to convert Float8_e4m3fn to the MPS backend but it does not have support for that dtype.")

    monkeypatch.setattr(KVPool, "_encode", no_fp8)
    with pytest.raises(ValueError, match=r"fp8_e4m3fn cannot be stored on cpu .*MPS backend.*use auto"):
        KVPool(SHAPE, "fp8_e4m3fn", torch.float32, "cpu")
    KVPool(SHAPE, "float16", torch.float32, "cpu")  # (float pools are not probed)
