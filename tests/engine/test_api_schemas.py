"""The HTTP request models' parameter ranges and what they hand the engine (no server: pydantic only)."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from app.schemas import ChatRequest, CompletionRequest, TGIRequest
from engine.sequence import SamplingParams

CHAT = {"messages": [{"role": "user", "content": "hi"}]}
COMPLETION = {"prompt": "hi"}


def _openai(kind: str, **kw) -> dict:
    req = (ChatRequest if kind == "chat" else CompletionRequest).model_validate(
        {**(CHAT if kind == "chat" else COMPLETION), **kw})
    return req.sampling(16, logprobs=False)


def _tgi(**parameters) -> dict:
    return TGIRequest.model_validate({"inputs": "hi", "parameters": parameters}).sampling(64)


@pytest.mark.parametrize("kind", ["chat", "completion"])
@pytest.mark.parametrize(("top_k", "engine"), [(-1, 0), (0, 0), (None, 0), (1, 1), (40, 40)])
def test_openai_top_k_takes_vllms_minus_one_as_off(kind, top_k, engine):
    params = _openai(kind, top_k=top_k, temperature=0.8)
    assert params["top_k"] == engine
    SamplingParams(**params).validate()


@pytest.mark.parametrize("kind", ["chat", "completion"])
@pytest.mark.parametrize("top_k", [-2, -100])
def test_openai_top_k_below_minus_one_is_refused(kind, top_k):
    with pytest.raises(ValidationError, match="top_k"):
        _openai(kind, top_k=top_k)


@pytest.mark.parametrize("top_k", [0, -1])
def test_tgi_top_k_must_be_positive_as_in_tgi(top_k):
    # TGI's router (router/src/validation.rs) refuses top_k <= 0: leaving it out is TGI's "off"
    with pytest.raises(ValidationError, match="top_k"):
        _tgi(top_k=top_k)
    assert _tgi(top_k=3)["top_k"] == 3 and _tgi()["top_k"] == 0


def test_typical_p_and_min_p_reach_the_engine():
    # TGI's typical_p samples (as any of TGI's warpers does) and is refused outside (0, 1]
    params = _tgi(typical_p=0.5)
    assert params["typical_p"] == 0.5 and params["temperature"] == 1.0
    assert SamplingParams(**params).validate().typical_p == 0.5
    assert _tgi()["typical_p"] == 1.0 and _tgi()["temperature"] == 0.0  # unset: greedy, as TGI
    for bad in (0, 1.5):
        with pytest.raises(ValidationError, match="typical_p"):
            _tgi(typical_p=bad)
    for kind in ("chat", "completion"):  # vLLM's min_p; typical_p as an extension
        sp = SamplingParams(**_openai(kind, min_p=0.1, typical_p=0.9, temperature=0.8)).validate()
        assert (sp.min_p, sp.typical_p) == (0.1, 0.9)
        assert _openai(kind, min_p=None)["min_p"] == 0.0  # null: the default
        with pytest.raises(ValidationError, match="min_p"):
            _openai(kind, min_p=1.5)


def test_best_of_is_checked_as_tgi_and_vllm_check_it():
    assert _tgi(best_of=2, do_sample=True)["temperature"] == 1.0
    for bad, needle in ((dict(best_of=2), "needs sampling"), (dict(best_of=2, do_sample=True, seed=3), "seed must not"),
                        (dict(best_of=17, do_sample=True), "best_of")):
        with pytest.raises(ValidationError, match=needle):
            _tgi(**bad)
    assert _openai("completion", best_of=3, n=2)["max_new_tokens"] == 16
    for bad, needle in ((dict(best_of=1, n=2), "at least n"), (dict(best_of=2, stream=True), "stream")):
        with pytest.raises(ValidationError, match=needle):
            _openai("completion", **bad)
    with pytest.raises(ValidationError, match="best_of > 1 in chat"):
        _openai("chat", best_of=2)
    _openai("chat", best_of=1)


def test_tgi_frequency_penalty_asks_for_tgis_normalisation():
    params = _tgi(frequency_penalty=0.5)
    assert params["frequency_penalty"] == 0.5 and params["frequency_penalty_per_context"] is True
    assert SamplingParams(**params).validate().frequency_penalty_per_context
    for kind in ("chat", "completion"):  # OpenAI's keeps OpenAI's per-count penalty on generated tokens
        sp = SamplingParams(**_openai(kind, frequency_penalty=0.5)).validate()
        assert sp.frequency_penalty == 0.5 and not sp.frequency_penalty_per_context


QWEN_DEFAULTS = {"temperature": 0.7, "top_p": 0.8, "top_k": 20, "min_p": 0.05, "repetition_penalty": 1.05}


@pytest.mark.parametrize("kind", ["chat", "completion"])
def test_the_models_sampling_defaults_fill_only_what_a_request_leaves_unset(kind):
    body = CHAT if kind == "chat" else COMPLETION
    model = ChatRequest if kind == "chat" else CompletionRequest

    def params(**kw) -> dict:
        return model.model_validate({**body, **kw}).sampling(16, logprobs=False, defaults=QWEN_DEFAULTS)

    got = params()
    assert {k: got[k] for k in QWEN_DEFAULTS} == QWEN_DEFAULTS
    SamplingParams(**got).validate()
    # what OpenAI's client sends for an argument left out (null) is no choice either
    assert params(temperature=None, top_p=None)["temperature"] == 0.7
    # what a request sends wins, OpenAI's own default values and "off" included
    sent = params(temperature=1.0, top_p=1.0, top_k=0, min_p=0.0, repetition_penalty=1.0)
    assert (sent["temperature"], sent["top_p"], sent["top_k"], sent["min_p"], sent["repetition_penalty"]) == \
        (1.0, 1.0, 0, 0.0, 1.0)
    assert params(top_k=None, repetition_penalty=None)["top_k"] == 20  # null: the default, the model's
    assert params(top_k=-1)["top_k"] == 0  # vLLM's "off"
    assert params(temperature=0)["temperature"] == 0 and params(temperature=0)["top_k"] == 20
    # without defaults: OpenAI's
    plain = model.model_validate(body).sampling(16, logprobs=False)
    assert (plain["temperature"], plain["top_p"], plain["top_k"], plain["repetition_penalty"]) == (1.0, 1.0, 0, 1.0)


def test_sampling_defaults_are_read_from_generation_config_and_checked(tmp_path, caplog):
    import json

    from app.sampling_defaults import read_sampling_defaults

    assert read_sampling_defaults(tmp_path) == {}  # no file: none
    gc = tmp_path / "generation_config.json"
    gc.write_text(json.dumps({"do_sample": True, "eos_token_id": [1, 2], **QWEN_DEFAULTS, "max_new_tokens": 9}))
    got = read_sampling_defaults(tmp_path)
    assert got == {**QWEN_DEFAULTS, "max_new_tokens": 9}  # the default max_tokens too
    assert isinstance(got["top_k"], int) and isinstance(got["temperature"], float)
    gc.write_text(json.dumps({"temperature": 1, "top_p": None}))
    assert read_sampling_defaults(tmp_path) == {"temperature": 1.0}  # an int temperature is a temperature
    # values a request could not send are left out, each with a warning; the rest stay
    bad = {"temperature": 3.0, "top_p": 0, "top_k": 20.5, "repetition_penalty": True}
    gc.write_text(json.dumps(bad))
    with caplog.at_level("WARNING", logger="app.sampling_defaults"):
        assert read_sampling_defaults(tmp_path) == {}
    assert all(name in caplog.text for name in bad)
    gc.write_text(json.dumps({"temperature": 0.6, "top_k": -1}))
    assert read_sampling_defaults(tmp_path) == {"temperature": 0.6}
    for junk in ("{not json", "[0.7]", '{"temperature": NaN}'):
        gc.write_text(junk)
        assert read_sampling_defaults(tmp_path) == {}, junk


@pytest.mark.parametrize("kind", ["chat", "completion"])
@pytest.mark.parametrize(("priority", "engine"), [(None, 0), (0, 0), (-5, -5), (7, 7)])
def test_openai_priority_reaches_the_engine(kind, priority, engine):
    assert _openai(kind, priority=priority)["priority"] == engine
    with pytest.raises(ValidationError, match="priority"):
        _openai(kind, priority=2**63)


def test_null_stream_options_fields_are_their_defaults():
    # nullable in OpenAI's spec (and vLLM's): {"include_usage": null} was a 400, "should be a valid boolean"
    for body in ({"prompt": "x", "stream": True}, {"messages": [{"role": "user", "content": "x"}], "stream": True}):
        cls = CompletionRequest if "prompt" in body else ChatRequest
        req = cls.model_validate({**body, "stream_options": {"include_usage": None, "continuous_usage_stats": None}})
        assert not req.stream_options.include_usage and not req.stream_options.continuous_usage_stats
        assert cls.model_validate({**body, "stream_options": {"include_usage": True}}).stream_options.include_usage
        with pytest.raises(ValidationError):
            cls.model_validate({**body, "stream_options": {"include_usage": "yes"}})


def test_chat_takes_tgis_json_schema_response_format():
    # TGI's {"type": "json_schema", "value": {"name", "schema"}} was refused in chat ("json_schema.schema must
    # be a JSON schema") though /generate's grammar takes it; OpenAI's own form still reads json_schema
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    for rf in ({"type": "json_schema", "value": {"name": "x", "schema": schema}},
               {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}):
        req = ChatRequest.model_validate({**CHAT, "response_format": rf})
        assert req.guide() == ("json", json.dumps(schema)), rf
