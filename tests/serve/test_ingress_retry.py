"""The ingress's one retry before the first token, without Serve: which failures are retried, and that
the failed replica is ranked last for the retry."""

from __future__ import annotations

import asyncio

import pytest

from deployments.ingress import ApiError, Ingress
from routing import in_process
from tests.serve.helpers import WarmupRecorder

_stream = Ingress.func_or_class._stream


class FakeResponse:
    def __init__(self, events):
        self.events, self.cancelled = list(events), False

    def __aiter__(self):
        return self

    async def __anext__(self):
        if not self.events:
            raise StopAsyncIteration
        return self.events.pop(0)

    def cancel(self):
        self.cancelled = True


class FakeIngress:
    """What ``_stream`` touches: the LLM handle and ``_failure``."""

    def __init__(self, *answers):
        self.answers, self.calls = list(answers), 0
        self.llm = self

    def options(self, **_):
        return self

    @property
    def generate(self):
        return self

    def remote(self, *_):
        self.calls += 1
        return self.answers.pop(0)

    def _failure(self, e):
        return f"engine failure: {type(e).__name__}"

    async def info_cached(self):
        return {"max_total_tokens": 1 << 20, "max_input_tokens": (1 << 20) - 1}

    _refuse_past_context = Ingress.func_or_class._refuse_past_context


OK = [{"token_id": 1, "text": "a", "finished": False, "replica": "B"},
      {"token_id": 2, "text": "b", "finished": True, "replica": "B"}]


def _run(fake):
    async def go():
        first, rest = await _stream(fake, [1, 2, 3], {})
        return [first] + [ev async for ev in rest]
    return asyncio.run(go())


def test_a_request_the_engine_never_took_is_retried_once_and_the_replica_ranked_last():
    dead = FakeResponse([{"error": "the engine thread has stopped", "error_kind": "unavailable", "finished": True,
                          "replica": "A"}])
    fake = FakeIngress(dead, FakeResponse(OK))
    try:
        assert [ev["text"] for ev in _run(fake)] == ["a", "b"]
        assert fake.calls == 2 and dead.cancelled and "A" in in_process.FAILED
    finally:
        in_process.FAILED.clear()


@pytest.mark.parametrize("kind,status,code", [("engine", 503, "engine_failure"), ("validation", 422, None)])
def test_a_request_that_ran_when_the_engine_failed_or_was_refused_is_not_retried(kind, status, code):
    """And the 503 says so in its code: a client (batch) must not take it for the service being gone."""
    fake = FakeIngress(FakeResponse([{"error": "boom", "error_kind": kind, "finished": True, "replica": "A"}]),
                       FakeResponse(OK))
    with pytest.raises(ApiError) as err:
        _run(fake)
    assert err.value.status == status and fake.calls == 1 and not in_process.FAILED
    assert err.value.code == code


def test_a_stream_the_client_left_before_it_began_is_cancelled():
    # the rest of the events is a generator the response reads; one that never started has no finally
    # to run, so a client that left before the body was read left its request generating to the end
    import gc

    long = FakeResponse([{"token_id": i, "text": "x", "finished": i == 99, "replica": "B"} for i in range(100)])

    async def go():
        first, rest = await _stream(FakeIngress(long), [1, 2, 3], {})
        del rest  # the response is dropped unread
        gc.collect()
        return first

    assert asyncio.run(go())["token_id"] == 0 and long.cancelled

    # one that started and is dropped mid-stream: its own finally ends it, with the tokens it got
    # (the finalizer used to run first and report one)
    class Router:  # what request_ended tells the process's routers
        def __init__(self):
            self.ended = []

        def end_soon(self, request_id, generated):
            self.ended.append(generated)

    router = Router()
    in_process.ROUTERS.add(router)
    try:
        async def half():
            stream = FakeResponse([{"token_id": i, "text": "x", "finished": i == 99, "replica": "B"} for i in range(100)])
            first, rest = await _stream(FakeIngress(stream), [1, 2, 3], {})
            got = [await rest.__anext__() for _ in range(5)]
            del rest, got
            gc.collect()
            for _ in range(3):
                await asyncio.sleep(0)  # asyncio closes the dropped generator on the loop
            return stream

        assert asyncio.run(half()).cancelled and router.ended == [6]
    finally:
        in_process.ROUTERS.discard(router)
    done = FakeResponse(OK)  # read to the end: nothing to cancel
    _run(FakeIngress(done))
    gc.collect()
    assert not done.cancelled


def test_a_second_failure_is_a_503():
    gone = [{"error": "stopping", "error_kind": "unavailable", "finished": True, "replica": r} for r in "AB"]
    fake = FakeIngress(FakeResponse(gone[:1]), FakeResponse(gone[1:]))
    try:
        with pytest.raises(ApiError) as err:
            _run(fake)
        assert err.value.status == 503 and fake.calls == 2
    finally:
        in_process.FAILED.clear()


def test_a_client_gone_reads_as_a_disconnect_not_an_error():
    """Serve's receive raises TaskCancelledError once the client has left; passed on, every ordinary
    disconnect logged a 70-line "Task exception was never retrieved"."""
    from ray.exceptions import TaskCancelledError

    from deployments.ingress import PayloadLimit

    got = []

    async def app(scope, receive, send):
        got.append(await receive())

    async def receive():
        raise TaskCancelledError()

    async def send(message):
        raise AssertionError("nothing to send to a client that left")

    asyncio.run(PayloadLimit(app)({"type": "http", "headers": []}, receive, send))
    assert got == [{"type": "http.disconnect"}]


def test_a_replica_that_fails_to_say_its_limits_is_a_503_in_the_api_format():
    """Until an ingress first reads the model's limits, a replica failing that call was Starlette's
    plain-text 500 (TGI's clients cannot parse it)."""

    class Failing:
        _info = None

        class llm:  # noqa: N801 - stands in for the handle
            class info:  # noqa: N801
                @staticmethod
                async def remote():
                    raise RuntimeError("the actor died")

    with pytest.raises(ApiError) as err:
        asyncio.run(Ingress.func_or_class.info_cached(Failing()))
    assert err.value.status == 503 and "the actor died" in err.value.message


def test_the_later_choices_of_a_call_are_sent_as_siblings_of_the_first():
    """``n`` choices: the first computes the prompt, the others find it cached on its replica; they go
    flagged, so that replica does not take their hits for a prefix that many requests share."""
    sent = []

    class Choices(FakeIngress):
        settings = type("S", (), {"max_ongoing_requests": 8})
        _choices = Ingress.func_or_class._choices
        _stream = Ingress.func_or_class._stream
        _stream_alone = Ingress.func_or_class._stream_alone
        _drain = Ingress.func_or_class._drain

        def remote(self, *args, **kwargs):
            sent.append((args[0], kwargs))
            return FakeResponse(OK)

    runs = asyncio.run(Choices()._choices([([1, 2, 3], {})], 3, stream=False))
    assert len(runs) == 3 and sent == [([1, 2, 3], {}), ([1, 2, 3], {"sibling": True}), ([1, 2, 3], {"sibling": True})]


class FakeWarmIngress:
    """What ``warmup`` touches, with an LLM handle that records the warm-ups sent."""

    def __init__(self, **info):
        self.info = {"block_size": 16, "vocab_size": 100, "max_input_tokens": 64, "max_batch_total_tokens": 4096,
                     "prefix_caching": True, **info}
        self.llm = WarmupRecorder()
        self.sent = self.llm.sent

    async def info_cached(self):
        return self.info

    async def _off_loop(self, fn, *args):
        return fn(*args)


def test_a_warmup_is_refused_whole_before_any_prefix_is_warmed():
    """The replica warms one prefix at a time: one too long for it was refused after the ones before it
    were prefilled and recorded as hot (a 422 that had changed the caches)."""
    from app.schemas import WarmupRequest

    warmup = Ingress.func_or_class.warmup
    fake = FakeWarmIngress()
    with pytest.raises(ApiError, match=r"prefixes\[1\] has 65 tokens, more than max_input_tokens \(64\)"):
        asyncio.run(warmup(fake, WarmupRequest(prefixes=[[5] * 20, [6] * 65])))
    off = FakeWarmIngress(prefix_caching=False)
    with pytest.raises(ApiError, match="prefix cache is off"):
        asyncio.run(warmup(off, WarmupRequest(prefixes=[[5] * 20])))
    assert fake.sent == off.sent == []
    assert asyncio.run(warmup(fake, WarmupRequest(prefixes=[[5] * 20, [6] * 64])))["prefixes"] == 2


def test_a_prompt_over_max_input_tokens_is_refused_for_itself_not_for_max_tokens():
    # the engine's order: a 5,004-token prompt in a 4,096-token context was refused as "prompt + max_tokens",
    # with param max_tokens, which no smaller max_tokens could fix
    class Limits:
        async def info_cached(self):
            return {"max_total_tokens": 100, "max_input_tokens": 99}

    check = Ingress.func_or_class._refuse_past_context
    with pytest.raises(ApiError) as e:
        asyncio.run(check(Limits(), 120, 5))
    assert e.value.message == "the prompt has 120 tokens, more than max_input_tokens (99)" and e.value.param is None
    with pytest.raises(ApiError) as e:
        asyncio.run(check(Limits(), 90, 20))
    assert e.value.message.startswith("prompt (90) + max_new_tokens (20) = 110") and e.value.param == "max_tokens"
    asyncio.run(check(Limits(), 90, 10))


def test_a_prompt_past_the_context_is_said_in_the_words_each_apis_clients_read():
    """OpenAI's code (LangChain, litellm shorten a conversation on it) and Anthropic's message: Claude Code
    compacts its conversation when a 400 says "prompt is too long" (and reads the token gap), and got a
    bare 400 on every turn once a local model's context filled."""
    import json

    from starlette.requests import Request

    from deployments.ingress import _error_response

    class Limits:
        _max_token_chars = 4

        async def info_cached(self):
            return {"max_total_tokens": 100, "max_input_tokens": 99}

    errors = []
    for call in (lambda: Ingress.func_or_class._refuse_past_context(Limits(), 120, 5),
                 lambda: Ingress.func_or_class._refuse_overlong(Limits(), 1000, "messages")):
        with pytest.raises(ApiError) as e:
            asyncio.run(call())
        errors.append(e.value)

    def answer(path: str, err: ApiError) -> tuple[int, dict]:
        r = _error_response(Request({"type": "http", "path": path, "method": "POST", "headers": []}), err)
        return r.status_code, json.loads(r.body)

    for err, tokens in zip(errors, (120, 125), strict=True):
        assert answer("/v1/chat/completions", err)[1]["error"]["code"] == "context_length_exceeded"
        status, body = answer("/v1/messages", err)
        assert status == 400 and body["error"] == {"type": "invalid_request_error",
                                                   "message": f"prompt is too long: {tokens} tokens > 99 maximum"}


def test_a_failed_request_is_found_in_the_logs_by_the_id_its_client_has(caplog):
    """The engine's request ids were fresh uuids that no response or access log line named, and a 5xx
    answer logged nothing at the ingress: a client's complaint could not be matched to its traceback."""
    import contextvars

    from ray.serve import context as serve_context
    from starlette.requests import Request

    from deployments.ingress import _api_error, _engine_request_id

    def in_request(fn, request_id: str):
        ctx = contextvars.copy_context()
        ctx.run(serve_context._serve_request_context.set, serve_context._RequestContext(request_id=request_id))
        return ctx.run(fn)

    rid = in_request(_engine_request_id, "client-req-42")
    assert rid.startswith("client-req-42-") and rid != in_request(_engine_request_id, "client-req-42")
    assert in_request(_engine_request_id, "a b\n" + "x" * 100).startswith("ab" + "x" * 62 + "-")  # (safe to log)
    assert "-" not in _engine_request_id()  # (outside a request: its own id alone)
    request = Request({"type": "http", "method": "POST", "path": "/v1/completions", "headers": [], "query_string": b""})
    with caplog.at_level("WARNING", logger="radixserve.ingress"):
        in_request(lambda: asyncio.run(_api_error(request, ApiError(503, "engine failure: boom", "generation"))), "client-req-42")
        in_request(lambda: asyncio.run(_api_error(request, ApiError(400, "bad", "validation"))), "client-req-43")
    assert "request client-req-42: POST /v1/completions answered 503" in caplog.text and "boom" in caplog.text
    assert "client-req-43" not in caplog.text  # (the client's own fault: no line)
