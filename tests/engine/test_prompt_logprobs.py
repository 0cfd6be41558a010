"""The prompt tokens' own log-probabilities (TGI's decoder_input_details, OpenAI's echo with logprobs,
vLLM's prompt_logprobs): the model's distribution at each prompt position, as transformers computes it,
whatever part of the prompt the prefix cache holds and however the prompt is chunked."""

from __future__ import annotations

import pytest
import torch

from engine.sequence import SamplingError, SamplingParams

PROMPT = list(range(40, 110))  # 70 tokens: four whole blocks and a part


def _hf_prompt_logprobs(hf, prompt: list[int], k: int) -> list[tuple[float, list[tuple[int, float]]]]:
    with torch.inference_mode():
        lp = torch.log_softmax(hf(torch.tensor([prompt], device=hf.device)).logits[0].float(), -1)
    out = []
    for p in range(len(prompt) - 1):
        vals, ids = torch.topk(lp[p], k)
        own = lp[p, prompt[p + 1]]
        out.append((own.item(), int((lp[p] > own).sum()) + 1, list(zip(ids.tolist(), vals.tolist(), strict=True))))
    return out


def _first_event(eng, prompt, params):
    rid = eng.add_request(prompt, params)
    first = None
    while eng.has_work():
        for ev in eng.step():
            if ev.request_id == rid and ev.token_id is not None and first is None:
                first = ev
    return first


def _assert_close(got, want):
    assert got[0] is None and len(got) == len(want) + 1
    for (lp, rank, top), (ref, ref_rank, ref_top) in zip(got[1:], want, strict=True):
        assert lp == pytest.approx(ref, abs=1e-4) and rank == ref_rank
        assert [t for t, _ in top] == [t for t, _ in ref_top]
        assert [v for _, v in top] == pytest.approx([v for _, v in ref_top], abs=1e-4)


@pytest.mark.parametrize("preset", ["tiny", "tiny-mistral", "tiny-gemma3"])
def test_prompt_logprobs_match_transformers_even_over_a_cached_prefix(preset, make_engine, hf_model):
    eng = make_engine(preset, max_prefill_chunk_tokens=16, max_batch_prefill_tokens=32)  # chunked prefill
    want = _hf_prompt_logprobs(hf_model(preset), PROMPT, 3)
    eng.generate([PROMPT], SamplingParams(max_new_tokens=2))  # now its first four blocks are cached
    ev = _first_event(eng, PROMPT, SamplingParams(max_new_tokens=3, prompt_logprobs=3))
    _assert_close(ev.prompt_logprobs, want)
    assert ev.num_cached_tokens == 0  # computed whole: a cached block has no logits
    # the answer is the same as without them, and the request after it still finds the prefix cached
    plain = eng.generate([PROMPT], SamplingParams(max_new_tokens=3))[0]
    assert plain.num_cached_prompt_tokens == 64
    again = eng.generate([PROMPT], SamplingParams(max_new_tokens=3, prompt_logprobs=0))[0]
    assert again.output_ids == plain.output_ids and all(top == [] for _, _, top in again.prompt_logprobs[1:])
    assert {rank for _, rank, _ in again.prompt_logprobs[1:]} != {1}  # (random weights: not every token the best)


def test_prompt_logprobs_beside_other_requests_and_after_a_preemption(make_engine, hf_model):
    # a pool of 8 blocks: two 70-token prompts and their outputs cannot all fit, so one is preempted
    # and computes its prompt again (its log-probabilities are not counted twice)
    eng = make_engine("tiny", max_batch_total_tokens=128, max_prefill_chunk_tokens=32)
    other = [7] * 60
    want = _hf_prompt_logprobs(hf_model("tiny"), PROMPT, 2)
    ids = [eng.add_request(other, SamplingParams(max_new_tokens=40, ignore_eos=True)),
           eng.add_request(PROMPT, SamplingParams(max_new_tokens=40, ignore_eos=True, prompt_logprobs=2))]
    firsts = {}
    while eng.has_work():
        for ev in eng.step():
            if ev.token_id is not None and ev.request_id not in firsts:
                firsts[ev.request_id] = ev
    assert eng.scheduler.num_preemptions > 0
    assert firsts[ids[0]].prompt_logprobs is None  # only for the request that asked
    _assert_close(firsts[ids[1]].prompt_logprobs, want)


def test_a_prompt_with_logprobs_is_prefilled_in_small_chunks(make_engine, hf_model, monkeypatch):
    # every row's logits come back ([tokens, vocabulary] floats): a long prompt must not bring them all at once
    monkeypatch.setattr("engine.scheduler.PROMPT_LOGPROBS_CHUNK", 16)
    eng = make_engine("tiny")
    eng.add_request(PROMPT, SamplingParams(max_new_tokens=1, prompt_logprobs=1))
    eng.add_request(PROMPT[::-1], SamplingParams(max_new_tokens=2))
    eng.add_request(PROMPT[1:], SamplingParams(max_new_tokens=1, prompt_logprobs=0))
    eng.step()
    # 16 such rows a step in all: the second one waits; the one without them is not held back
    assert [s.num_computed for s in eng.scheduler.running] == [16, 70]
    events = [ev for _ in range(20) for ev in eng.step() if ev.prompt_logprobs is not None]
    _assert_close(events[0].prompt_logprobs, _hf_prompt_logprobs(hf_model("tiny"), PROMPT, 1))
    assert len(events) == 2 and len(events[1].prompt_logprobs) == len(PROMPT) - 1


def test_a_one_token_prompt_has_none_and_bad_values_are_refused(make_engine):
    eng = make_engine("tiny")
    assert _first_event(eng, [42], SamplingParams(max_new_tokens=1, prompt_logprobs=1)).prompt_logprobs == [None]
    for bad in (-1, 21, 1.5, True):
        with pytest.raises(SamplingError, match="prompt_logprobs"):
            SamplingParams(prompt_logprobs=bad).validate()
