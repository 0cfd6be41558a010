"""The HTTP request models' parameter ranges and what they hand the engine (no server: pydantic only)."""

from __future__ import annotations

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


def test_tgi_frequency_penalty_asks_for_tgis_normalisation():
    params = _tgi(frequency_penalty=0.5)
    assert params["frequency_penalty"] == 0.5 and params["frequency_penalty_per_context"] is True
    assert SamplingParams(**params).validate().frequency_penalty_per_context
    for kind in ("chat", "completion"):  # OpenAI's keeps OpenAI's per-count penalty on generated tokens
        sp = SamplingParams(**_openai(kind, frequency_penalty=0.5)).validate()
        assert sp.frequency_penalty == 0.5 and not sp.frequency_penalty_per_context
