"""A request whose own step work raises ends alone, with an error; its batch and its blocks are fine."""

from __future__ import annotations

import engine.llm_engine as llm_engine
import engine.sampler as sampler
from engine.sequence import SamplingParams

PROMPTS = [list(range(30, 70)), list(range(80, 125)), list(range(130, 160))]


def _run(eng, params: list[SamplingParams]) -> tuple[dict, dict]:
    """Every request of PROMPTS to its end: (request id -> its events, request id -> its sequence)."""
    seqs = {}
    for ids, p in zip(PROMPTS, params, strict=True):
        rid = eng.add_request(ids, p)
        seqs[rid] = eng.requests[rid]
    events: dict[str, list] = {rid: [] for rid in seqs}
    while eng.has_work():
        for ev in eng.step():
            events[ev.request_id].append(ev)
    return events, seqs


def _params() -> list[SamplingParams]:
    # greedy, one with a penalty (its row goes through the sampler's adjustments), one sampled with a seed
    return [SamplingParams(max_new_tokens=6), SamplingParams(max_new_tokens=6, repetition_penalty=1.3),
            SamplingParams(max_new_tokens=6, temperature=0.8, seed=3)]


def test_a_request_whose_text_fails_ends_alone_and_the_others_answer_as_without_it(make_engine, monkeypatch):
    eng = make_engine("tiny")
    _, clean = _run(eng, _params())
    expected = [s.output_ids for s in clean.values()]
    real = llm_engine.update_text

    def update_text(tokenizer, seq):
        if seq.prompt_ids == PROMPTS[1] and len(seq.output_ids) == 3:
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "a tokenizer bug")
        return real(tokenizer, seq)

    monkeypatch.setattr(llm_engine, "update_text", update_text)
    events, seqs = _run(eng, _params())
    failed = [evs for evs in events.values() if evs[-1].finish_reason == "error"]
    assert len(failed) == 1 and len(failed[0]) == 3  # two tokens, then its error: no more of it
    end = failed[0][-1]
    assert end.finished and end.error_kind == "engine" and "UnicodeDecodeError" in end.error
    outs = [s.output_ids for s in seqs.values()]
    assert outs[0] == expected[0] and outs[2] == expected[2]  # the batch went on as before
    assert eng.stats.requests_failed == 1 and not eng.requests
    eng.check_invariants()  # its blocks went back (cached or free)
    assert eng.kv.allocator.num_in_use == 0


def test_a_request_whose_sampling_fails_ends_alone_and_the_others_sample_as_in_the_batch(make_engine, monkeypatch):
    eng = make_engine("tiny")
    _, clean = _run(eng, _params())
    expected = [s.output_ids for s in clean.values()]
    real = sampler._adjust
    calls = []

    def adjust(row, seq, **kw):
        calls.append(seq.request_id)
        if seq.params.repetition_penalty != 1.0 and len(seq.output_ids) == 2:
            raise RuntimeError("a guide's mask could not be computed")
        return real(row, seq, **kw)

    monkeypatch.setattr(sampler, "_adjust", adjust)
    events, seqs = _run(eng, _params())
    outs = [s.output_ids for s in seqs.values()]
    assert outs[0] == expected[0] and outs[2] == expected[2]  # the seeded draw too: row by row, the same
    assert outs[1] == expected[1][:2]
    end = list(events.values())[1][-1]
    assert end.finish_reason == "error" and "RuntimeError: a guide's mask" in end.error
    assert eng.stats.requests_failed == 1 and not eng.requests
    eng.check_invariants()
    assert eng.kv.allocator.num_in_use == 0


def test_a_failure_in_the_pools_books_still_ends_the_engine_loop(make_engine, monkeypatch):
    # a request's own work fails alone; the KV pool's or the scheduler's bookkeeping is every request's
    # (their books may be wrong now): that still ends the step, and the loop, as before
    import pytest

    eng = make_engine("tiny")

    def broken(seq):
        raise AssertionError("a block freed twice")

    monkeypatch.setattr(eng.kv, "trim_window", broken)
    eng.add_request(PROMPTS[0], SamplingParams(max_new_tokens=4))
    with pytest.raises(llm_engine.BooksBroken, match="AssertionError: a block freed twice"):
        while eng.has_work():
            eng.step()


def test_a_request_its_own_constraints_end_is_no_engine_failure(make_engine):
    """radixserve_requests_failed_total counts engine failures (a 503): a request whose allowed ids its own
    bad words leave empty ends with a 4xx, and an alert on the counter fired on clients' input."""
    eng = make_engine("tiny")
    params = _params()
    params[1] = SamplingParams(max_new_tokens=6, allowed_token_ids=[65], bad_words_ids=[[65, 65]])
    events, _ = _run(eng, params)
    end = list(events.values())[1][-1]
    assert end.finish_reason == "error" and end.error_kind == "validation"
    assert eng.stats.requests_failed == 0 and eng.stats.requests_finished == 3
