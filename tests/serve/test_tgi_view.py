"""TGI's routes against what TGI does and its clients read, without Serve: a stand-in for the ingress's
engine side (its ``_stream``, its cached ``/info``), the route methods themselves."""

from __future__ import annotations

import asyncio
import json

import pytest

from app.schemas import TGIRequest
from deployments.ingress import ApiError, Ingress
from tests.serve.helpers import response_events

Cls = Ingress.func_or_class


class FakeTGI:
    """What the TGI routes touch: the model's limits, a tokenizer stand-in, an engine that answers these events."""

    model_name = "m"
    sampling_defaults: dict = {}
    _special: set = set()
    _anchor = None

    class settings:  # noqa: N801 - stands in for the Settings instance
        router, max_ongoing_requests, num_replicas = "prefix", 64, 1  # (the ingress is not told the count)
        max_concurrent_requests = None

    _live_replicas = Cls._live_replicas

    _within_room, _tgi_max_new_tokens = Cls._within_room, Cls._tgi_max_new_tokens
    _tgi_finish = Cls._tgi_finish
    _tgi_token = Cls._tgi_token
    _tgi_sequence = Cls._tgi_sequence
    _tgi_prefill = Cls._tgi_prefill
    _tgi_answer, generate_stream = Cls._tgi_answer, Cls.generate_stream

    def __init__(self, events: list[dict] | None = None, max_total_tokens: int = 100):
        self.events, self.asked = events or [], []
        self.max_total_tokens = max_total_tokens
        self._text_cache: dict = {}

    def _token_text(self, tid: int) -> str:
        return f"<{tid}>"

    async def info_cached(self) -> dict:
        return {"model_id": "/models/m", "max_total_tokens": self.max_total_tokens,
                "max_input_tokens": self.max_total_tokens - 1}

    async def _tgi_ids(self, req) -> list[int]:
        return [1] * len(req.inputs)

    async def _stream(self, ids, params):
        self.asked.append(params)

        async def rest():
            for ev in self.events[1:]:
                yield ev
        return self.events[0], rest()

    async def _collect(self, ids, params):
        first, rest = await self._stream(ids, params)
        return [first] + [ev async for ev in rest]


def _token(i: int, text: str, finish: str | None = None, stop_reason=None) -> dict:
    return {"token_id": 10 + i, "text": text, "logprob": -0.5, "finished": finish is not None, "finish_reason": finish,
            "stop_reason": stop_reason, "num_output_tokens": i + 1, "num_prompt_tokens": 3, "num_cached_tokens": 0}


@pytest.mark.parametrize("finish,stop_reason,expected", [
    ("stop", None, "eos_token"),  # a complete grammar: TGI's ends with the EOS it then allows
    ("stop", "END", "stop_sequence"), ("stop", 7, "stop_sequence"), ("eos", None, "eos_token"), ("length", None, "length")])
def test_the_finish_reason_is_tgis(finish, stop_reason, expected):
    fake = FakeTGI([_token(0, "{"), _token(1, "}", finish, stop_reason)])
    req = TGIRequest.model_validate({"inputs": "hi", "parameters": {"details": True, "max_new_tokens": 5}})
    out, _ = asyncio.run(Cls._tgi_answer(fake, req))
    assert out["details"]["finish_reason"] == expected
    last = response_events(asyncio.run(Cls.generate_stream(fake, req)))[-1]
    assert last["details"]["finish_reason"] == expected and last["generated_text"] == "{}"


def test_max_new_tokens_is_tgi_v3s_the_room_left_when_unset_and_cut_to_it_when_past():
    # TGI v3 (its "auto max_new_tokens"): unset or null, all the room the context leaves (v2's 100 cut
    # huggingface_hub's text_generation(prompt) short with 'length'); an explicit value past that room is
    # taken while its first chunk of 1,024 tokens fits, and the answer ends with the context
    fake = FakeTGI([_token(0, "a", "length")], max_total_tokens=2000)
    for prompt, params, expected in (("x" * 190, {}, 1810), ("x" * 10, {}, 1990), ("x" * 10, {"max_new_tokens": None}, 1990),
                                     ("x" * 10, {"max_new_tokens": 150}, 150), ("x" * 900, {"max_new_tokens": 1500}, 1100),
                                     ("x" * 976, {"max_new_tokens": 5000}, 1024)):
        asyncio.run(Cls._tgi_answer(fake, TGIRequest.model_validate({"inputs": prompt, "parameters": params})))
        assert fake.asked[-1]["max_new_tokens"] == expected, params
        list(response_events(asyncio.run(Cls.generate_stream(fake, TGIRequest.model_validate(
            {"inputs": prompt, "parameters": params})))))
        assert fake.asked[-1]["max_new_tokens"] == expected, params
    # where even the first chunk does not fit, TGI's own refusal
    for route in (Cls._tgi_answer, Cls.generate_stream):
        with pytest.raises(ApiError) as e:
            asyncio.run(route(fake, TGIRequest.model_validate({"inputs": "x" * 977, "parameters": {"max_new_tokens": 1500}})))
        assert e.value.status == 422 and e.value.param == "max_new_tokens"
        assert "must be <= 2000. Given: 977 `inputs` tokens and 1500 `max_new_tokens`" in str(e.value.message)
    # (return_full_text is nullable in TGI: null is false)
    assert not TGIRequest.model_validate({"inputs": "x", "parameters": {"return_full_text": None}}).parameters.return_full_text


def test_decoder_input_details_alone_brings_details_with_the_prompt():
    # as TGI's router (details || decoder_input_details): a client reading details.prefill got a KeyError
    fake = FakeTGI([{**_token(0, "a"), "prompt_logprobs": [None, (-1.5, {})]}, _token(1, "b", "length")])
    req = TGIRequest.model_validate({"inputs": "hi", "parameters": {"decoder_input_details": True, "max_new_tokens": 2}})
    out, _ = asyncio.run(Cls._tgi_answer(fake, req))
    assert fake.asked[-1]["prompt_logprobs"] == 0
    assert out["details"]["generated_tokens"] == 2
    assert out["details"]["prefill"] == [{"id": 1, "text": "<1>", "logprob": None}, {"id": 1, "text": "<1>", "logprob": -1.5}]


def test_a_json_object_grammar_is_a_json_one_as_in_tgi():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    for kind in ("json", "json_object"):
        req = TGIRequest.model_validate({"inputs": "hi", "parameters": {"grammar": {"type": kind, "value": schema}}})
        assert req.sampling(5)["guide"] == ("json", json.dumps(schema))


def test_an_error_mid_stream_says_whose_it_is():
    for kind, error_type in (("validation", "validation"), ("engine", "generation")):
        fake = FakeTGI([_token(0, "a"), {"token_id": None, "text": "", "finished": True, "finish_reason": "error",
                                         "error": "broke", "error_kind": kind}])
        req = TGIRequest.model_validate({"inputs": "hi", "parameters": {"max_new_tokens": 5}})
        assert response_events(asyncio.run(Cls.generate_stream(fake, req)))[-1] == {"error": "broke", "error_type": error_type}


def test_top_p_of_one_filters_nothing_and_keeps_a_request_greedy():
    assert not TGIRequest.model_validate({"inputs": "x", "parameters": {"top_p": 1.0}}).parameters.samples()
    assert TGIRequest.model_validate({"inputs": "x", "parameters": {"top_p": 0.9}}).parameters.samples()


def test_info_has_the_fields_tgis_clients_read():
    import time

    class Hub:
        async def acall(self, method, *args, **kw):
            assert method == "fresh"
            return 2  # replicas whose engines reported lately

    fake = FakeTGI()
    fake._last_health, fake._hub = (float("-inf"), 0), Hub()
    info = asyncio.run(Cls.info(fake))
    for key in ("model_id", "model_sha", "model_pipeline_tag", "max_concurrent_requests", "max_best_of",
                "max_stop_sequences", "max_input_tokens", "max_total_tokens", "validation_workers",
                "max_client_batch_size", "router", "version", "sha", "docker_label"):
        assert key in info, key
    assert info["router"] == "text-generation-router" and info["request_router"] == "prefix"
    # every live replica's max_ongoing_requests (it said one replica's: the ingress's num_replicas is never set)
    assert info["max_concurrent_requests"] == 128 and info["max_best_of"] == 16 and info["max_stop_sequences"] == 16
    fake._last_health = (time.monotonic(), 3)  # the count /health took a moment ago stands
    assert asyncio.run(Cls.info(fake))["max_concurrent_requests"] == 192
    fake.settings = type("limited", (fake.settings,), {"max_concurrent_requests": 100})
    assert asyncio.run(Cls.info(fake))["max_concurrent_requests"] == 100  # the limit that answers 429


def test_best_of_picks_the_best_log_probability_per_token_as_tgi_does():
    # TGI's generate_best_of: the largest mean over the generated tokens (vLLM's best_of: the largest sum)
    from deployments.ingress import _likeliest

    def run(*lps: float) -> list[dict]:
        return [{"token_id": 1, "logprob": x, "text": "a"} for x in lps]

    short, long_ = run(-1.0), run(-0.6, -0.6)  # sum -1.0 vs -1.2; mean -1.0 vs -0.6
    assert _likeliest([short, long_], 2) == [short, long_]
    assert _likeliest([short, long_], 2, per_token=True) == [long_, short]
    first, second = run(-0.5), run(-0.25, -0.75)  # a tie: the first drawn wins, as in TGI
    assert _likeliest([first, second], 1, per_token=True)[0] is first


def test_the_root_route_gives_the_prompt_with_the_answer_unless_told_otherwise():
    # TGI's "/" (where huggingface_hub's text_generation posts, return_full_text left out) prepends the
    # prompt for a text-generation model; "/generate" does not. The root gave the answer alone
    for params, whole in (({}, True), ({"return_full_text": None}, True), ({"return_full_text": False}, False),
                          ({"return_full_text": True}, True)):
        fake = FakeTGI([_token(0, "a"), _token(1, "b", "length")])
        body = {"inputs": "Say: ", "parameters": {"max_new_tokens": 2, **params}}
        out = asyncio.run(Cls.tgi_compat(fake, TGIRequest.model_validate(body)))
        assert json.loads(out.body)[0]["generated_text"] == ("Say: ab" if whole else "ab"), params
        last = response_events(asyncio.run(Cls.tgi_compat(fake, TGIRequest.model_validate({**body, "stream": True}))))[-1]
        assert last["generated_text"] == ("Say: ab" if whole else "ab"), params
        plain = asyncio.run(Cls.generate(fake, TGIRequest.model_validate(body)))
        assert json.loads(plain.body)["generated_text"] == ("Say: ab" if params.get("return_full_text") else "ab")


def test_a_failed_generation_is_tgis_424_and_an_unreachable_engine_a_503():
    from starlette.requests import Request

    from deployments.ingress import ENGINE_FAILURE, ApiError, _error_response

    def answer(path: str, err: ApiError) -> tuple[int, dict]:
        r = _error_response(Request({"type": "http", "path": path, "method": "POST", "headers": []}), err)
        return r.status_code, json.loads(r.body)

    failed = ApiError(503, "boom", "generation", code=ENGINE_FAILURE)
    assert answer("/generate", failed) == (424, {"error": "boom", "error_type": "generation"})
    assert answer("/", failed)[0] == 424
    assert answer("/generate", ApiError(503, "no replica", "generation"))[0] == 503
    assert answer("/v1/completions", failed)[0] == 503  # (OpenAI's routes: a server error, its code says which)


def test_a_stream_refuses_best_of_in_tgis_words():
    from deployments.ingress import ApiError

    req = TGIRequest.model_validate({"inputs": "x", "parameters": {"best_of": 2, "do_sample": True}})
    with pytest.raises(ApiError, match="`best_of` != 1 is not supported when streaming tokens") as err:
        asyncio.run(Cls.generate_stream(FakeTGI([_token(0, "a", "length")]), req))
    assert err.value.status == 422
