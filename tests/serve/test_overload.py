"""--max-concurrent-requests: one generation request past the limit is refused at once with 429 (in each
API's own error format, with Retry-After), counted, and the requests under it are served as before."""

import asyncio

import httpx
from starlette.applications import Starlette
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from deployments.ingress import ApiError, InFlight, _api_error, _http_error
from routing import in_process


def _held_app(release: asyncio.Event) -> Starlette:
    async def generation(request: Request):
        await request.body()
        await release.wait()  # a long generation: holds its place until the test lets it go
        return JSONResponse({"generated_text": "hi"})

    async def tokenize(request: Request):
        await request.body()
        return JSONResponse([{"id": 1}])

    routes = [Route(p, generation, methods=["POST"]) for p in ("/generate", "/v1/chat/completions", "/v1/messages")]
    routes.append(Route("/tokenize", tokenize, methods=["POST"]))
    return Starlette(routes=routes, middleware=[Middleware(InFlight)],
                     exception_handlers={ApiError: _api_error, StarletteHTTPException: _http_error})


def _run(scenario):
    """``scenario(client, release)`` against the held app, in one event loop."""
    async def go():
        release = asyncio.Event()
        transport = httpx.ASGITransport(app=_held_app(release))
        async with httpx.AsyncClient(transport=transport, base_url="http://t", timeout=10) as c:
            return await scenario(c, release)

    return asyncio.run(go())


async def _hold(c: httpx.AsyncClient, n: int, counter: str) -> list[asyncio.Task]:
    """``n`` generations under way (``InFlight.<counter>`` has them all)."""
    held = [asyncio.create_task(c.post("/generate", json={"inputs": "x"})) for _ in range(n)]
    while getattr(InFlight, counter) < n:
        await asyncio.sleep(0.01)
    return held


def test_a_request_past_the_limit_is_refused_at_once_in_each_apis_format(monkeypatch):
    monkeypatch.setattr(InFlight, "draining", False)  # (this process's: other tests drain it)
    monkeypatch.setattr(InFlight, "limit", 2)
    monkeypatch.setattr(in_process, "ROUTED", {**in_process.ROUTED, "requests_overloaded": 0})

    async def scenario(c, release):
        held = await _hold(c, 2, "admitted")
        tgi = await c.post("/generate", json={"inputs": "x"})
        oai = await c.post("/v1/chat/completions", json={})
        anthropic = await c.post("/v1/messages", json={})
        tokenized = await c.post("/tokenize", json={"inputs": "x"})  # no generation: not limited
        release.set()
        first = await asyncio.gather(*held)
        after = await c.post("/generate", json={"inputs": "x"})  # the places are free again
        return tgi, oai, anthropic, tokenized, first, after

    tgi, oai, anthropic, tokenized, first, after = _run(scenario)
    assert tgi.status_code == 429 and tgi.json() == {"error": "Model is overloaded", "error_type": "overloaded"}
    assert tgi.headers["retry-after"] == "1"
    assert oai.status_code == 429 and oai.headers["retry-after"] == "1"
    assert oai.json()["error"]["type"] == "server_error" and oai.json()["error"]["code"] == "overloaded"
    assert anthropic.status_code == 529
    assert anthropic.json() == {"type": "error", "error": {"type": "overloaded_error", "message": "Model is overloaded"}}
    assert tokenized.status_code == 200
    assert [r.status_code for r in first] == [200, 200] and after.status_code == 200
    assert InFlight.admitted == 0 and InFlight.count == 0
    assert in_process.ROUTED["requests_overloaded"] == 3


def test_without_a_limit_nothing_is_refused(monkeypatch):
    monkeypatch.setattr(InFlight, "draining", False)
    monkeypatch.setattr(InFlight, "limit", None)

    async def scenario(c, release):
        held = await _hold(c, 20, "count")
        release.set()
        return await asyncio.gather(*held)

    assert [r.status_code for r in _run(scenario)] == [200] * 20


def test_a_client_that_leaves_gives_its_place_back(monkeypatch):
    monkeypatch.setattr(InFlight, "draining", False)
    monkeypatch.setattr(InFlight, "limit", 1)

    async def scenario(c, release):
        (gone,) = await _hold(c, 1, "admitted")
        gone.cancel()  # the client leaves mid-request
        await asyncio.gather(gone, return_exceptions=True)
        assert InFlight.admitted == 0
        release.set()
        return await c.post("/generate", json={"inputs": "x"})

    assert _run(scenario).status_code == 200


def test_an_upload_that_stalls_holds_no_place(monkeypatch):
    """Places were taken at a request's first byte: clients that sent part of a body and stalled (until
    the proxy's request timeout, 10 minutes) held every one, and everyone else got 429. They are taken
    when the body is in, as TGI reads the body before its semaphore."""
    monkeypatch.setattr(InFlight, "draining", False)
    monkeypatch.setattr(InFlight, "limit", 2)
    monkeypatch.setattr(in_process, "ROUTED", {**in_process.ROUTED, "requests_overloaded": 0})

    async def stalled_body():
        yield b'{"inputs": "'
        await asyncio.sleep(3600)

    async def scenario(c, release):
        slow = [asyncio.create_task(c.post("/generate", content=stalled_body(),
                                           headers={"content-type": "application/json"})) for _ in range(3)]
        await asyncio.sleep(0.2)
        assert InFlight.admitted == 0
        held = await _hold(c, 2, "admitted")
        over = await c.post("/v1/chat/completions", json={})  # refused once its body is in, as before
        release.set()
        done = await asyncio.gather(*held)
        for t in slow:
            t.cancel()
        await asyncio.gather(*slow, return_exceptions=True)
        return over, done

    over, done = _run(scenario)
    assert [r.status_code for r in done] == [200, 200]
    assert over.status_code == 429 and over.json()["error"]["code"] == "overloaded"
    assert InFlight.admitted == 0 and in_process.ROUTED["requests_overloaded"] == 1
