"""Greedy output must equal transformers' ``generate``: tokens and the logits of every step.

Prompts span several blocks and share prefixes, so these runs hit the radix cache, reuse fully
cached prompts, chunk long prefills, preempt under a tiny pool and slide the window (Mistral).
"""

from __future__ import annotations

import random

import pytest
import torch

from engine.presets import PRESETS
from engine.sequence import SamplingParams
from tests.engine.conftest import hf_greedy

NEW = 24
TOL = 2e-3


def prompts(vocab: int) -> list[list[int]]:
    rng = random.Random(7)
    base = [rng.randrange(3, min(vocab, 255)) for _ in range(70)]
    other = [rng.randrange(3, min(vocab, 255)) for _ in range(25)]
    return [base, base[:50] + other, base[:5], list(base), base + [9, 10, 11]]


def assert_matches_hf(engine, hf, batch, n=NEW):
    engine.capture_logits = {}
    seqs = engine.generate(batch, SamplingParams(max_new_tokens=n, ignore_eos=True))
    worst = 0.0
    for seq, prompt in zip(seqs, batch, strict=True):
        ref_tokens, ref_logits = hf_greedy(hf, prompt, n)
        mine = engine.capture_logits[seq.request_id]
        assert len(mine) == n
        diff = (torch.stack(mine).cpu() - ref_logits).abs().max().item()
        worst = max(worst, diff)
        assert diff < TOL, f"logits differ by {diff}"
        assert seq.output_ids == ref_tokens
        assert len(set(ref_tokens)) > 4, "reference collapsed: the test would prove little"
    return seqs, worst


CHECKED = [p for p in PRESETS if p != "bench-1b"]  # one per supported architecture, and the bench model


@pytest.mark.parametrize("preset", CHECKED)
def test_batch_with_shared_prefixes_matches_hf(preset, make_engine, hf_model):
    eng = make_engine(preset)
    batch = prompts(eng.vocab_size)
    seqs, worst = assert_matches_hf(eng, hf_model(preset), batch)
    print(f"{preset}: max |logit diff| {worst:.2e}")
    hits = [s.num_cached_prompt_tokens for s in seqs]
    assert hits[1] >= 48 and hits[3] >= 64, f"expected prefix hits, got {hits}"


def test_fully_cached_prompt_recomputes_last_token(make_engine, hf_model):
    eng = make_engine("tiny")
    p = prompts(eng.vocab_size)[0][:64]  # exactly 4 blocks
    assert_matches_hf(eng, hf_model("tiny"), [p])
    seqs, _ = assert_matches_hf(eng, hf_model("tiny"), [p])
    assert seqs[0].num_cached_prompt_tokens == 48  # (64-1)//16 blocks


def test_generated_tokens_are_cached_for_the_next_turn(make_engine, hf_model):
    eng = make_engine("tiny")
    p = prompts(eng.vocab_size)[0]
    first = eng.generate([p], SamplingParams(max_new_tokens=40, ignore_eos=True))[0]
    turn2 = p + first.output_ids + [5, 6, 7]
    seqs, _ = assert_matches_hf(eng, hf_model("tiny"), [turn2], n=8)
    assert seqs[0].num_cached_prompt_tokens == (len(p) + 40 - 1) // 16 * 16


@pytest.mark.parametrize("preset", ["tiny", "tiny-mistral", "tiny-gemma2", "tiny-gemma3"])
def test_chunked_prefill_matches_hf(preset, make_engine, hf_model):
    eng = make_engine(preset, max_batch_prefill_tokens=16)
    assert_matches_hf(eng, hf_model(preset), prompts(eng.vocab_size))
    assert eng.stats.steps > 10


@pytest.mark.parametrize("preset", ["tiny", "tiny-mistral", "tiny-gemma2", "tiny-gemma3"])
def test_preemption_under_a_tiny_pool_matches_hf(preset, make_engine, hf_model):
    eng = make_engine(preset, max_batch_total_tokens=160, block_size=16)  # 10 blocks for 5 requests
    assert_matches_hf(eng, hf_model(preset), prompts(eng.vocab_size))
    assert eng.scheduler.num_preemptions > 0


def test_cache_on_and_off_give_identical_outputs(make_engine):
    on = make_engine("tiny")
    off = make_engine("tiny", prefix_caching=False)
    batch = prompts(on.vocab_size) * 2
    p = SamplingParams(max_new_tokens=NEW, ignore_eos=True)
    a = [s.output_ids for s in on.generate(batch, p)]
    b = [s.output_ids for s in off.generate(batch, p)]
    assert a == b
    assert on.kv_stats()["prefix_hit_tokens"] > 0 and off.kv_stats()["prefix_hit_tokens"] == 0


def test_sliding_window_frees_generated_blocks(make_engine, hf_model):
    eng = make_engine("tiny-mistral", block_size=4)
    assert eng.window == 24
    p = prompts(eng.vocab_size)[2]  # 5 tokens: everything after is generated
    rid = eng.add_request(p, SamplingParams(max_new_tokens=80, ignore_eos=True))
    seq = eng.requests[rid]
    held = []
    while eng.has_work():
        eng.step()
        if seq.block_table:
            held.append(sum(b >= 0 for b in seq.block_table))
    assert max(held) <= 24 // 4 + 2, f"window not enforced: held {max(held)} blocks"
    ref, _ = hf_greedy(hf_model("tiny-mistral"), p, 80)
    assert seq.output_ids == ref


@pytest.mark.parametrize("preset", ["tiny", "tiny-mistral", "tiny-gemma2", "tiny-gemma3"])
def test_cache_hits_prefilled_together_in_one_padded_call_match_hf(preset, make_engine, hf_model, monkeypatch):
    """Four prompts over a cached prefix, with tails of 3 to 40 tokens, in one step: on a GPU their
    chunks share SDPA calls per layer (padded; windowed for Mistral), those of like context lengths
    one call. Forced on here."""
    from engine import attention

    calls = []
    real = attention._batched_prefill_attention
    monkeypatch.setattr(attention, "_batched_prefill_attention", lambda b, p, *a: calls.append(p) or real(b, p, *a))
    eng = make_engine(preset, cuda_graphs=())  # on CUDA a graph would take a step this small
    eng.runner.batch_prefills = True
    base = prompts(eng.vocab_size)[0][:64]
    eng.generate([base], SamplingParams(max_new_tokens=1))
    batch = [base + [100 + i] + list(range(5, 4 + n)) for i, n in enumerate((3, 40, 17, 9))]  # tails share nothing
    seqs, _ = assert_matches_hf(eng, hf_model(preset), batch)
    assert [s.num_cached_prompt_tokens for s in seqs] == [64] * 4
    shapes = {tuple(p.q_rows.shape) for p in calls}
    if preset == "tiny":
        assert shapes == {(4, 40)}  # contexts of 67-104 tokens: one call
    else:  # a sliding window clips the contexts (Gemma's sliding layers too): 3 + 31 tokens against 40 + 31
        assert {(3, 40), (1, 3)} <= shapes <= {(3, 40), (1, 3), (4, 40)}


@pytest.mark.parametrize("preset", ["tiny", "tiny-mistral", "tiny-gemma2", "tiny-gemma3"])
def test_batched_cache_hits_beside_decodes_and_a_fresh_prompt_match_hf(preset, make_engine, hf_model, monkeypatch):
    """One step with two running decodes, a prompt that starts its sequence and three cache hits (the
    batched call comes last in the packed row): every output as transformers' ``generate``."""
    from engine import attention

    steps = []
    real = attention._batched_prefill_attention
    monkeypatch.setattr(attention, "_batched_prefill_attention",
                        lambda b, p, *a: steps.append((b.num_decodes, len(b.prefills))) or real(b, p, *a))
    eng = make_engine(preset, cuda_graphs=())
    eng.runner.batch_prefills = True
    eng.capture_logits = {}
    rng = random.Random(11)
    base = [rng.randrange(3, 255) for _ in range(64)]
    eng.generate([base], SamplingParams(max_new_tokens=1))
    p = SamplingParams(max_new_tokens=NEW, ignore_eos=True)
    first = [[rng.randrange(3, 255) for _ in range(n)] for n in (20, 33)]
    later = [[rng.randrange(3, 255) for _ in range(27)]] + [base + [100 + i] + [7] * n for i, n in enumerate((2, 30, 11))]
    rids = [eng.add_request(x, p) for x in first]
    eng.step()  # the first two prefill; from the next step on they decode
    rids += [eng.add_request(x, p) for x in later]
    while eng.has_work():
        eng.step()
    assert (2, 1) in {(d, n) for d, n in steps}  # two decodes and one fresh prompt beside the batched hits
    for rid, prompt in zip(rids, first + later, strict=True):
        ref_tokens, ref_logits = hf_greedy(hf_model(preset), prompt, NEW)
        mine = torch.stack(eng.capture_logits[rid]).cpu()
        assert (mine - ref_logits).abs().max().item() < TOL
        assert mine.argmax(-1).tolist() == ref_tokens


def test_yarn_rope_serves_past_max_position_embeddings_as_transformers_computes(tmp_path):
    # Qwen3 says 40960 positions and, with the YaRN its card gives (factor 4 over 32768), serves 131072: its
    # context was taken as max_position_embeddings, and the longer requests refused
    import json

    from transformers import AutoModelForCausalLM

    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine
    from engine.model_init import write_model

    folder = write_model(tmp_path / "yarn", "tiny")
    config = json.loads((folder / "config.json").read_text())
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32, "rope_theta": 10000.0}
    (folder / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 40, "rope_parameters": yarn,
                                                    "rope_scaling": yarn}))
    eng = LLMEngine(EngineConfig(model_id=str(folder), max_batch_total_tokens=1024))
    assert eng.max_total_tokens == 128  # 32 x 4, where max_position_embeddings says 40
    hf = AutoModelForCausalLM.from_pretrained(folder, attn_implementation="sdpa", use_kernels=False).eval()
    prompt = prompts(eng.vocab_size)[0][:60]  # past 40 positions before it generates
    assert_matches_hf(eng, hf, [prompt], n=40)
