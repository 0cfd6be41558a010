"""The end-to-end benches' client: a stream that fails or ends early is no success (its tokens would
count in the throughput), and the p90 is taken at the rank the other benches take it at."""

import asyncio
import json

import httpx

from bench.http_load import one_request, run_load


def _sse(*events) -> bytes:
    return "".join(f"data: {json.dumps(e)}\n\n" for e in (*events, "[DONE]")).replace('data: "[DONE]"', "data: [DONE]").encode()


def _token(text="a"):
    return {"choices": [{"index": 0, "text": text, "finish_reason": None}]}


def _usage(completion):
    return {"choices": [], "usage": {"prompt_tokens": 10, "completion_tokens": completion,
                                     "prompt_tokens_details": {"cached_tokens": 4}}}


def _client(body: bytes) -> httpx.AsyncClient:
    handler = lambda request: httpx.Response(200, content=body, headers={"content-type": "text/event-stream"})  # noqa: E731
    return httpx.AsyncClient(transport=httpx.MockTransport(handler), base_url="http://t")


def _one(body: bytes, max_new: int = 2):
    async def go():
        async with _client(body) as c:
            return await one_request(c, [1, 2, 3], max_new)

    return asyncio.run(go())


def test_a_stream_is_a_success_only_when_it_gave_every_token_asked_for():
    whole = _one(_sse(_token(), _token(), _usage(2)))
    assert whole.ok and whole.tokens == 2 and whole.cached_share == 0.4
    failed = _one(_sse(_token(), {"error": {"message": "engine failure", "type": "server_error"}}))
    assert not failed.ok  # (a 200 whose stream said it failed)
    short = _one(_sse(_token(), _usage(1)))
    assert not short.ok


def test_the_p90_is_taken_as_the_other_benches_take_it(monkeypatch):
    import bench.http_load as http_load
    from bench.http_load import Result

    ttfts = iter(float(i) for i in range(10))

    async def fake(client, ids, max_new):
        return Result(next(ttfts), 1.0, max_new, True)

    monkeypatch.setattr(http_load, "one_request", fake)
    out = asyncio.run(run_load("http://t", [[1]] * 10, 2, 1))
    assert out["ok"] == 10 and out["ttft_p90_s"] == 9.0 and out["ttft_p50_s"] == 4.5


def test_hits_and_misses_are_told_apart_by_their_cached_share(monkeypatch):
    import bench.http_load as http_load
    from bench.http_load import Result

    shares = iter([0.9, 0.9, 0.9, 0.1, None])  # (None: no usage came)
    ttfts = iter([0.1, 0.2, 0.3, 2.0, 3.0])

    async def fake(client, ids, max_new):
        return Result(next(ttfts), 1.0, max_new, True, next(shares))

    monkeypatch.setattr(http_load, "one_request", fake)
    out = asyncio.run(run_load("http://t", [[1]] * 5, 2, 1))
    assert out["hit_requests"] == 0.6 and out["ttft_p50_hit_s"] == 0.2 and out["ttft_p50_miss_s"] == 2.5
