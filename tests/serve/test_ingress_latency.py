"""The ingress's end-to-end latency: the in-flight middleware times each generation request an engine
answered, from its last body byte to its last response byte (a whole stream), and nothing else."""

import asyncio
import time

from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route
from starlette.testclient import TestClient

from deployments.ingress import InFlight
from routing import in_process


def _answered() -> None:
    """What the ingress does when an engine's first token comes."""
    in_process.ENGINE_ANSWERED.get()[0] = True


async def streamed(request):
    await request.body()
    _answered()

    async def chunks():
        for i in range(3):
            await asyncio.sleep(0.05)
            yield f"data: {i}\n\n"

    return StreamingResponse(chunks(), media_type="text/event-stream")


async def whole(request):
    await request.body()
    _answered()
    return JSONResponse({"text": "hi"})


async def refused_after_the_engine(request):  # a guide that broke off: the engine answered, then a 400
    await request.body()
    _answered()
    return JSONResponse({"error": "no"}, status_code=400)


async def no_engine(request):  # a count, a tokenize, a refusal before any engine
    await request.body()
    return JSONResponse({"count": 3})


def test_the_ingress_times_each_answered_generation_to_its_last_byte(monkeypatch):
    monkeypatch.setattr(InFlight, "draining", False)  # (this process's: other tests drain it)
    monkeypatch.setattr(in_process, "INGRESS_E2E", type(in_process.INGRESS_E2E)(in_process.INGRESS_E2E.buckets))
    app = Starlette(routes=[Route("/stream", streamed, methods=["POST"]), Route("/whole", whole, methods=["POST"]),
                            Route("/refused", refused_after_the_engine, methods=["POST"]),
                            Route("/count", no_engine, methods=["POST"])],
                    middleware=[Middleware(InFlight)])
    h = in_process.INGRESS_E2E
    with TestClient(app) as c:
        t0 = time.monotonic()
        r = c.post("/stream", json={})
        took = time.monotonic() - t0
        assert r.status_code == 200 and r.text.count("data:") == 3
        assert sum(h.counts) == 1 and 0.15 <= h.sum <= took  # the whole stream, not its first chunk
        assert c.post("/whole", json={}).status_code == 200
        assert sum(h.counts) == 2
        assert c.post("/refused", json={}).status_code == 400
        assert c.post("/count", json={}).status_code == 200
        assert c.get("/count").status_code == 405
    assert sum(h.counts) == 2  # neither the 400 nor a request no engine answered
    assert in_process.ENGINE_ANSWERED.get() is None  # (the middleware's cell does not outlive its request)

    # a client that leaves after the first chunk: cancelled, not answered (as the replicas' own histogram)
    chunks: list[dict] = []

    async def leave_mid_stream():
        left = asyncio.Event()
        body = [{"type": "http.request", "body": b"{}", "more_body": False}]

        async def receive():
            if body:
                return body.pop()
            await left.wait()
            return {"type": "http.disconnect"}

        async def send(message):
            chunks.append(message)
            if message.get("more_body"):
                left.set()

        scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
                 "method": "POST", "scheme": "http", "path": "/stream", "raw_path": b"/stream", "root_path": "",
                 "query_string": b"", "headers": [(b"content-type", b"application/json")],
                 "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 80)}
        await app(scope, receive, send)

    asyncio.run(leave_mid_stream())
    assert chunks[0]["status"] == 200 and len(chunks) == 2  # the start and one chunk, then the client left
    assert sum(h.counts) == 2
