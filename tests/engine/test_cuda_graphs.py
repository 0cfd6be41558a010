"""Decode steps through fixed-shape buckets (``engine.cuda_graphs``).

On a CPU the buckets run eagerly with their padding (capture needs CUDA), which checks what a graph
replays: padded rows that write only the pool's spare slot, padded contexts masked off, logits of the
real rows in order. On CUDA (``bench/gpu_check.sh``) the same tests capture and replay real graphs.
"""

from __future__ import annotations

import random

import pytest
import torch

from engine.attention import decode_metadata, head_slots
from engine.cuda_graphs import StepGraphs, graphs_blocker, next_pow2
from engine.sequence import SamplingParams
from tests.engine.conftest import DEVICE, hf_greedy
from tests.engine.test_hf_equivalence import TOL, assert_matches_hf, prompts

CUDA = DEVICE.startswith("cuda")
MOE_PRESETS = {"tiny-qwen3_moe", "tiny-mixtral"}


def through_buckets(engine, sizes=(1, 2, 4, 8)) -> StepGraphs:
    """Route the engine's decode steps through buckets: graphs on CUDA, padded eager runs elsewhere."""
    g = StepGraphs(engine.loaded.model, engine.pool, sizes, engine.max_total_tokens, capture=CUDA,
                   sliding_layers=engine.sliding_layers)
    engine.runner.graphs = g
    return g


def test_buckets_pad_the_batch_to_a_listed_size_and_the_context_to_a_power_of_two():
    g = StepGraphs(torch.nn.Identity(), None, (1, 2, 4, 8), 4000, capture=False)
    assert g.max_context == 4096
    assert g.bucket(1, 10) == (1, 256)
    assert g.bucket(3, 256) == (4, 256)
    assert g.bucket(3, 257) == (4, 512)
    assert g.bucket(8, 4000) == (8, 4096)
    assert g.bucket(9, 10) is None  # more rows than the largest graph: eager
    assert g.bucket(2, 4097) is None
    assert StepGraphs(torch.nn.Identity(), None, (4,), 100, capture=False).bucket(1, 100) == (4, 128)
    assert StepGraphs(torch.nn.Identity(), None, (4,), 10**6, capture=False).max_context == 8192
    assert [next_pow2(n) for n in (1, 2, 3, 255, 256, 257)] == [1, 2, 4, 256, 256, 512]


def test_rows_are_one_per_query_each_over_its_own_context_and_padding_sees_the_spare_slot():
    decode_a, decode_b = (torch.tensor([3, 4, 5]), None), (torch.tensor([7]), None)
    chunk = (torch.tensor([20, 21, 22]), torch.tensor([[True, True, False], [True, True, True]]))  # 2 queries
    flat, mask = decode_metadata([decode_a, decode_b, chunk], rows=6, width=4, pad_slot=99)
    slots = head_slots(flat, 2)
    assert slots.shape == (6, 2, 4) and mask.shape == (6, 1, 1, 4)
    assert slots[0, 1].tolist() == [7, 9, 11, 199]  # slot * heads + head; padding reads the spare slot
    assert slots[3, 0].tolist() == slots[2, 0].tolist() == [40, 42, 44, 198]
    assert mask[:, 0, 0].tolist() == [[True, True, True, False], [True, False, False, False],
                                      [True, True, False, False], [True, True, True, False],
                                      [True, False, False, False], [True, False, False, False]]
    assert slots[5, 0].tolist() == [198] * 4
    assert decode_metadata([decode_a, chunk])[0].shape == (3, 3)  # default: just enough


@pytest.mark.parametrize("preset,ahead", [("tiny", False), ("tiny-mistral", False), ("tiny-qwen3", True),
                                          ("tiny-gemma3", True), ("tiny-qwen3_moe", True), ("tiny-mixtral", False)])
def test_decodes_through_buckets_match_hf(preset, ahead, make_engine, hf_model):
    """Five sequences (a bucket of 8), shared prefixes, a sliding window (Mistral): tokens and logits
    as transformers' ``generate``, with buckets made on first use or all ahead (as a replica does)."""
    engine = make_engine(preset)
    g = through_buckets(engine)
    if ahead:
        g.capture_all()
    assert_matches_hf(engine, hf_model(preset), prompts(engine.vocab_size))
    if CUDA and preset in MOE_PRESETS and g.stats.disabled:
        # float32 experts (torch's grouped_mm) copy host data while a graph is captured (an H200, torch
        # 2.11; bf16 ones capture): the engine says so once and serves eagerly, with the same tokens
        assert g.stats.disabled.startswith("capture failed") and g.stats.steps == g.stats.captured == 0
        return
    if ahead:
        assert g.max_context == 4096 and len(g._buckets) == 4 * 5  # sizes x contexts 256 ... 4096
    assert g.stats.steps >= 20 and g.stats.disabled is None
    assert (8, 256) in g._buckets  # five rows: a bucket of eight
    assert g.stats.captured == (len(g._buckets) if CUDA else 0)


@pytest.mark.parametrize("preset", ["tiny", "tiny-mistral", "tiny-gemma2", "tiny-gemma3"])
def test_steps_with_short_prefill_chunks_run_through_buckets_and_match_hf(preset, make_engine, hf_model):
    """Prompts prefilled 16 tokens at a time beside running decodes (the shape of a cached prompt's
    uncached tail): each token a row over its context, causal and windowed (Mistral) by its mask."""
    engine = make_engine(preset, max_prefill_chunk_tokens=16, max_batch_prefill_tokens=32)
    g = through_buckets(engine, sizes=(1, 2, 4, 8, 32, 64))
    assert_matches_hf(engine, hf_model(preset), prompts(engine.vocab_size))
    assert {(32, 256), (64, 256)} & set(g._buckets)  # steps that carried prefill chunks
    assert g.stats.captured == (len(g._buckets) if CUDA else 0)


def test_a_context_crossing_a_bucket_and_batches_shrinking_as_requests_end(make_engine, hf_model):
    engine = make_engine("tiny")
    g = through_buckets(engine, sizes=(2, 4))
    rng = random.Random(3)
    long = [rng.randrange(3, 255) for _ in range(250)]  # 250 + 24 tokens: from the 256 bucket into 512
    batch = [long, long[:40], long[:90] + [5, 6]]
    lengths = [24, 6, 12]
    engine.capture_logits = {}
    seqs = engine.generate(batch, [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in lengths])
    for seq, prompt, n in zip(seqs, batch, lengths, strict=True):
        ref_tokens, ref_logits = hf_greedy(hf_model("tiny"), prompt, n)
        assert (torch.stack(engine.capture_logits[seq.request_id]).cpu() - ref_logits).abs().max().item() < TOL
        assert seq.output_ids == ref_tokens
    assert g.stats.steps >= 20
    assert {(4, 256), (2, 512)} <= set(g._buckets)  # three rows; then two, past 256 tokens of context
    assert g.stats.captured == (len(g._buckets) if CUDA else 0)


def test_models_whose_rope_reads_positions_on_the_host_are_not_captured():
    class Config:
        rope_parameters = {"rope_type": "dynamic", "factor": 2.0}

    assert "dynamic" in graphs_blocker(Config())
    Config.rope_parameters = {"rope_type": "llama3", "factor": 8.0}
    assert graphs_blocker(Config()) is None


@pytest.mark.skipif(not CUDA, reason="CUDA graphs need a CUDA device")
def test_on_cuda_the_engine_captures_by_default_and_matches_its_eager_self(make_engine):
    batch = prompts(1000)
    ref = make_engine("tiny", cuda_graphs=(), attention_backend="sdpa")
    assert ref.runner.graphs is None
    eager = [s.output_ids for s in ref.generate(batch, SamplingParams(max_new_tokens=16, ignore_eos=True))]
    engine = make_engine("tiny", attention_backend="sdpa")  # the flash backend turns graphs off
    g = engine.runner.graphs
    assert g is not None and g.sizes == [1, 2, 4, 8, 16, 32, 64, 128]
    out = [s.output_ids for s in engine.generate(batch, SamplingParams(max_new_tokens=16, ignore_eos=True))]
    assert out == eager
    assert g.stats.captured >= 1 and g.stats.steps >= 15 and g.stats.disabled is None


@pytest.mark.skipif(not CUDA, reason="CUDA graphs need a CUDA device")
def test_a_capture_that_fails_leaves_the_engine_serving_eagerly(make_engine, monkeypatch):
    engine = make_engine("tiny", attention_backend="sdpa")
    g = engine.runner.graphs

    def broken(*a, **kw):
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(torch.cuda, "CUDAGraph", broken)
    seqs = engine.generate(prompts(1000)[:2], SamplingParams(max_new_tokens=8, ignore_eos=True))
    assert all(len(s.output_ids) == 8 for s in seqs)
    assert g.stats.disabled and "capture failed" in g.stats.disabled and g.stats.captured == 0
    assert not g._buckets  # nothing kept of it


@pytest.mark.skipif(not CUDA, reason="CUDA graphs need a CUDA device")
def test_a_bucket_out_of_device_memory_stays_eager_and_the_others_replay(make_engine, monkeypatch):
    engine = make_engine("tiny", attention_backend="sdpa")
    g = engine.runner.graphs
    real, made = torch.cuda.CUDAGraph, []

    def short_of_memory_at_first(*a, **kw):  # largest first: sizes 128 (4 contexts) and 64 (5) fail
        made.append(1)
        if len(made) <= 9:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory")
        return real(*a, **kw)

    monkeypatch.setattr(torch.cuda, "CUDAGraph", short_of_memory_at_first)
    engine.capture_graphs()
    assert g.stats.disabled is None and g.stats.skipped == 9 and g.stats.captured > 0
    assert all(size < 64 for size, _ in g._buckets)
    assert g.bucket(100, 300) is None and g.bucket(8, 300) == (8, 512)
    seqs = engine.generate(prompts(1000)[:2], SamplingParams(max_new_tokens=8, ignore_eos=True))
    assert all(len(s.output_ids) == 8 for s in seqs) and g.stats.steps > 0


@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
def test_fp8_scales_given_on_the_device_are_kept_on_the_host():
    # each write and read takes the layer's scale as a number: from a CUDA tensor that would be a sync
    # per layer and step, and an error inside a graph's capture
    from cache.kv_pool import KVPool, KVShape

    pool = KVPool(KVShape(num_layers=2, num_blocks=4, block_size=4, num_kv_heads=1, head_dim=8), "fp8_e4m3fn",
                  device=DEVICE)
    pool.set_scales(torch.tensor([2.0, 3.0], device=DEVICE), torch.tensor([4.0, 5.0], device=DEVICE))
    assert pool.k_scale.device.type == "cpu" and pool.k_scale.tolist() == [2.0, 3.0]
    assert pool.v_scale.device.type == "cpu" and pool.v_scale.tolist() == [4.0, 5.0]
