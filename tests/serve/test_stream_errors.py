"""How an OpenAI stream ends when its engine fails mid-answer, without Serve: the error event, then
``[DONE]`` as every stream ends (a client reading to ``[DONE]`` was left waiting for a close)."""

from __future__ import annotations

import asyncio
import json

import pytest

from app.schemas import ChatRequest, CompletionRequest
from deployments.ingress import Ingress
from tests.serve.helpers import response_events

Cls = Ingress.func_or_class
TOKEN = {"token_id": 7, "text": "a", "finished": False, "replica": "A"}
FAILED = {"token_id": None, "text": "", "finished": True, "error": "the engine thread has stopped",
          "error_kind": "engine", "replica": "A"}


async def _rest():
    yield FAILED


class FakeIngress:
    """What the stream bodies touch: the started choices, the model's name, the tool parser setting."""

    model_name = "m"

    class settings:  # noqa: N801 - stands in for the Settings instance
        tool_call_parser = "hermes"

    async def _choices(self, jobs, n, stream, prompt_only=False):
        return [(dict(TOKEN), _rest())]

    _translated = staticmethod(Cls._translated)
    _late_view = Cls._late_view
    first_token_ping_s = Cls.first_token_ping_s


class _Answering(FakeIngress):
    """A stand-in whose one choice answers these token texts, then ends with ``finish``; its events count
    the tokens as the engine's do (3 prompt tokens)."""

    _usage_event = Cls._usage_event

    def __init__(self, texts: list[str], finish: str):
        last = len(texts) - 1
        self.events = [{"token_id": 10 + i, "text": t, "finished": i == last, "finish_reason": finish if i == last
                        else None, "replica": "A", "num_prompt_tokens": 3, "num_cached_tokens": 0,
                        "num_output_tokens": i + 1} for i, t in enumerate(texts)]

    async def _choices(self, jobs, n, stream, prompt_only=False):
        async def rest():
            for ev in self.events[1:]:
                yield ev
        return [(self.events[0], rest())]


class Chatting(FakeIngress):
    """A stand-in whose chat route streams its choices (for the Messages and Responses views of it)."""

    async def _chat(self, req, default, counted=None):
        return await Cls._openai_stream(self, [([1, 2, 3], {"logprobs": False})], "chat-1", 0,
                                        "chat.completion.chunk", req, [""])


@pytest.mark.parametrize("kind", ["completion", "chat", "chat with tools"])
def test_a_stream_whose_engine_fails_ends_with_the_error_then_done(kind):
    fake, jobs = FakeIngress(), [([1, 2, 3], {"logprobs": False})]
    if kind == "completion":
        req = CompletionRequest(prompt="hi", stream=True)
        response = asyncio.run(Cls._openai_stream(fake, jobs, "cmpl-1", 0, "text_completion", req, [""]))
    else:
        tools = [{"type": "function", "function": {"name": "save", "parameters": {"type": "object"}}}]
        req = ChatRequest(messages=[{"role": "user", "content": "hi"}], stream=True,
                          **({"tools": tools} if kind == "chat with tools" else {}))
        if kind == "chat":
            response = asyncio.run(Cls._openai_stream(fake, jobs, "chat-1", 0, "chat.completion.chunk", req, [""]))
        else:
            response = asyncio.run(Cls._tool_stream(fake, req, jobs, "chat-1", 0, 0))
    events = response_events(response)
    assert events[-1] == "[DONE]" and events.count("[DONE]") == 1, events
    assert events[-2]["error"]["code"] == "engine_failure", events[-2:]
    assert events[-2]["error"]["message"] == FAILED["error"]
    assert any(e != "[DONE]" and "choices" in e for e in events[:-2]), events  # what came before it was sent


def test_a_tgi_token_entry_is_special_only_without_the_answers_text():
    """EOS shows its own text as a special entry; when its event carries the answer's held-back end (a cut
    character, text kept for a stop string), that text is the answer's: TGI's clients skip special entries."""
    fake = type("Fake", (), {"_special": {2}, "_token_text": staticmethod(lambda t: "</s>")})()
    entry = Cls._tgi_token
    assert entry(fake, {"token_id": 2, "text": "", "logprob": -0.1}) == {
        "id": 2, "text": "</s>", "logprob": -0.1, "special": True}
    assert entry(fake, {"token_id": 2, "text": "ab", "logprob": -0.1})["special"] is False
    assert entry(fake, {"token_id": 7, "text": "a"})["special"] is False


@pytest.mark.parametrize("api", ["messages", "responses"])
def test_a_translated_stream_whose_engine_fails_ends_with_the_engines_error(api, caplog):
    # the chat stream's error and its [DONE] come as one piece: read as one event, the client got a JSON
    # decoder's complaint ("Extra data") and the server logged a traceback
    from app.messages_api import MessageEvents
    from app.responses_api import ResponseEvents, ResponsesRequest

    body = {"messages": [{"role": "user", "content": "hi"}], "stream": True}
    events = (MessageEvents("msg_1", "m", 10) if api == "messages" else
              ResponseEvents(ResponsesRequest.model_validate({"input": "hi", "stream": True}), "resp_1", 0, "m"))
    response = asyncio.run(Cls._chat_view(Chatting(), body, 10, events, True))
    sent = [e for e in response_events(response) if e != "[DONE]"]
    errors = [e for e in sent if e["type"] == "error"]
    assert len(errors) == 1, sent
    message = errors[0]["error"]["message"] if api == "messages" else errors[0]["message"]
    assert message == FAILED["error"]
    assert any("delta" in e for e in sent)  # the text before it was sent
    if api == "responses":
        assert sent[-1]["type"] == "response.failed"
        assert sent[-1]["response"]["error"]["message"] == FAILED["error"]
    assert "stream of" not in caplog.text  # no traceback: an engine failure is not the stream's
    # unstreamed (made from the same stream): the engine's failure, as the chat route's whole answer says it
    from deployments.ingress import ApiError

    events = (MessageEvents("msg_1", "m", 10) if api == "messages" else
              ResponseEvents(ResponsesRequest.model_validate({"input": "hi"}), "resp_1", 0, "m"))
    with pytest.raises(ApiError) as raised:
        asyncio.run(Cls._chat_view(Chatting(), {**body, "stream": False}, 10, events, False))
    assert raised.value.status == 503 and raised.value.message == FAILED["error"]
    assert raised.value.code == "engine_failure"


@pytest.mark.parametrize("api", ["messages", "responses"])
def test_a_translated_stream_that_its_request_broke_ends_with_a_request_error(api):
    # a guide that cannot go on is the request's fault (the chat stream says invalid_request_error): the
    # Messages stream said api_error and the Responses stream server_error, as for an engine failure
    from app.messages_api import MessageEvents
    from app.responses_api import ResponseEvents, ResponsesRequest

    async def broken():
        yield {**FAILED, "error": "the guide cannot go on", "error_kind": "validation"}

    class Broken(Chatting):
        async def _choices(self, jobs, n, stream, prompt_only=False):
            return [(dict(TOKEN), broken())]

    body = {"messages": [{"role": "user", "content": "hi"}], "stream": True}
    events = (MessageEvents("msg_1", "m", 10) if api == "messages" else
              ResponseEvents(ResponsesRequest.model_validate({"input": "hi", "stream": True}), "resp_1", 0, "m"))
    sent = [e for e in response_events(asyncio.run(Cls._chat_view(Broken(), body, 10, events, True))) if e != "[DONE]"]
    (error,) = [e for e in sent if e["type"] == "error"]
    said = error["error"]["type"] if api == "messages" else error["code"]
    assert said == "invalid_request_error", error


def test_a_streamed_chats_reasoning_tokens_count_the_tokens_whose_text_was_held_back():
    # a character spread over byte tokens: the first two have no text of their own (held back), and the
    # stream sends no chunk for them; it did not count them either (3 where the whole answer says 5)
    from app.reasoning import TAGGED, reasoning_tokens

    texts = ["<think>", "", "", "\u601d", "</think>", "Hi", ""]
    req = ChatRequest(messages=[{"role": "user", "content": "hi"}], stream=True,
                      stream_options={"include_usage": True})
    response = asyncio.run(Cls._openai_stream(_Answering(texts, "eos"), [([1, 2, 3], {"logprobs": False})], "chat-1",
                                              0, "chat.completion.chunk", req, [""], thinking=TAGGED))
    usage = [e for e in response_events(response) if e != "[DONE]" and e.get("usage")][-1]["usage"]
    whole = reasoning_tokens([(t, True) for t in texts], TAGGED)
    assert whole == 5 and usage["completion_tokens_details"] == {"reasoning_tokens": whole}


@pytest.mark.parametrize("tools", [False, True])
def test_continuous_usage_stats_put_the_usage_so_far_on_every_chunk(tools):
    # vLLM's stream_options.continuous_usage_stats was accepted and ignored
    def counting():
        return _Answering(["a", "b", "c"], "length")

    extra = {"tools": [{"type": "function", "function": {"name": "save", "parameters": {"type": "object"}}}]} \
        if tools else {}
    req = ChatRequest(messages=[{"role": "user", "content": "hi"}], stream=True, **extra,
                      stream_options={"include_usage": True, "continuous_usage_stats": True})
    jobs = [([1, 2, 3], {"logprobs": False})]
    response = asyncio.run(Cls._tool_stream(counting(), req, jobs, "chat-1", 0, 0) if tools else
                           Cls._openai_stream(counting(), jobs, "chat-1", 0, "chat.completion.chunk", req, [""]))
    chunks = [e for e in response_events(response) if e != "[DONE]"]
    assert all(c["usage"] for c in chunks)
    assert chunks[0]["usage"] == {"prompt_tokens": 3, "completion_tokens": 0, "total_tokens": 3}  # (its role)
    text = [c for c in chunks[1:] if c["choices"] and c["choices"][0]["delta"].get("content")]
    assert [c["usage"]["completion_tokens"] for c in text] == [1, 2, 3]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 3
    # without it, the chunks say null, as OpenAI's
    req = ChatRequest(messages=[{"role": "user", "content": "hi"}], stream=True, stream_options={"include_usage": True})
    plain = [e for e in response_events(asyncio.run(Cls._openai_stream(counting(), jobs, "chat-1", 0, "chat.completion.chunk",
                                                                req, [""]))) if e != "[DONE]"]
    assert all(c["usage"] is None for c in plain[:-1]) and plain[-1]["usage"]["completion_tokens"] == 3


@pytest.mark.parametrize("finish", ["length", "eos"])
def test_a_chat_answer_and_its_stream_make_the_same_calls_with_the_same_finish(finish):
    # the whole answer was read by other rules than the stream: a call cut by max_tokens gave finish
    # "tool_calls" (Messages: tool_use) where the stream said "length" (max_tokens), and a second call
    # after a first whose closing tag never came was the stream's alone
    texts = ['<tool_call>{"name": "save", "arguments": {"a": 1}}', "\n<tool_call>", '{"name": "save", "arguments": ',
             '{"b": "Par']
    if finish == "eos":
        texts += ['is"}}', "</tool_call>"]
    tools = [{"type": "function", "function": {"name": "save", "parameters": {"type": "object"}}}]
    req = ChatRequest(messages=[{"role": "user", "content": "hi"}], stream=True, tools=tools)
    chunks = [e for e in response_events(asyncio.run(Cls._tool_stream(_Answering(texts, finish), req, [([1], {})], "c", 0, 0)))
              if e != "[DONE]"]
    streamed_calls: list = []
    for c in chunks:
        for call in c["choices"][0]["delta"].get("tool_calls") or ():
            if call["index"] == len(streamed_calls):
                streamed_calls.append([call["function"]["name"], ""])
            streamed_calls[call["index"]][1] += call["function"]["arguments"]
    message, said = Cls._assistant_message(FakeIngress(), req, _Answering(texts, finish).events)
    whole_calls = [[c["function"]["name"], c["function"]["arguments"]] for c in message["tool_calls"]]
    assert whole_calls == streamed_calls and len(whole_calls) == 2
    assert (said or finish) == chunks[-1]["choices"][0]["finish_reason"] == ("tool_calls" if finish == "eos" else "length")


@pytest.mark.parametrize("kind,status", [("validation", 422), ("engine", 503)])
def test_an_answer_that_ends_in_an_error_is_the_clients_only_when_its_request_caused_it(kind, status):
    # a guide that broke off while it ran (a grammar whose strings never end) is the request's fault
    from deployments.ingress import ApiError

    async def rest():
        yield {**FAILED, "error": "the guide cannot go on", "error_kind": kind}

    with pytest.raises(ApiError) as raised:
        asyncio.run(Cls._drain(None, dict(TOKEN), rest()))
    assert raised.value.status == status and raised.value.message == "the guide cannot go on"


def test_parallel_tool_calls_false_keeps_one_call_streamed_or_not():
    # it held only the required guide: with tool_choice auto both calls went out (Messages'
    # disable_parallel_tool_use too), where vLLM keeps the first
    texts = ['<tool_call>{"name": "save", "arguments": {"a": 1}}</tool_call>',
             '\n<tool_call>{"name": "save", "arguments": {"b": 2}}</tool_call>']
    tools = [{"type": "function", "function": {"name": "save", "parameters": {"type": "object"}}}]
    req = ChatRequest(messages=[{"role": "user", "content": "hi"}], stream=True, tools=tools, parallel_tool_calls=False)
    message, finish = Cls._assistant_message(FakeIngress(), req, _Answering(texts, "eos").events)
    assert [c["function"]["arguments"] for c in message["tool_calls"]] == ['{"a": 1}'] and finish == "tool_calls"
    chunks = [e for e in response_events(asyncio.run(Cls._tool_stream(_Answering(texts, "eos"), req, [([1], {})], "c", 0, 0)))
              if e != "[DONE]"]
    indexes = {call["index"] for c in chunks for call in c["choices"][0]["delta"].get("tool_calls") or ()}
    assert indexes == {0} and chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
    # a later call cut short by max_tokens is not sent, nor does it make the one call sent "length"
    cut = [texts[0], '\n<tool_call>{"name": "save", "arguments": {"b": ']
    message, finish = Cls._assistant_message(FakeIngress(), req, _Answering(cut, "length").events)
    assert len(message["tool_calls"]) == 1 and finish == "tool_calls"
    chunks = [e for e in response_events(asyncio.run(Cls._tool_stream(_Answering(cut, "length"), req, [([1], {})],
                                                                      "c", 0, 0))) if e != "[DONE]"]
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"


def test_a_streamed_chats_log_probs_go_with_the_chunk_that_sends_their_tokens_text():
    # a chunk carried the log-probs of every token so far, also of one whose text was held back (it might
    # begin a stop string) and came in a later chunk; completions already waited for a token's text
    class Aligned(_Answering):
        TEXT = {10: "He", 11: " wo", 12: "rld", 13: "?"}
        _oai_logprobs = Cls._oai_logprobs

        def _token_text(self, t):
            return self.TEXT[t]

        def _token_bytes(self, t):
            return list(self.TEXT[t].encode())

    fake = Aligned(["He", "", " wo", "rld?"], "eos")  # " wo" held one token, "rld" the next
    for ev, offset in zip(fake.events, (0, 2, 5, 8), strict=True):
        ev.update(logprob=-0.5, top_logprobs=[], text_offset=offset)
    req = ChatRequest(messages=[{"role": "user", "content": "hi"}], stream=True, logprobs=True)
    response = asyncio.run(Cls._openai_stream(fake, [([1, 2, 3], {"logprobs": True})], "chat-1", 0,
                                              "chat.completion.chunk", req, [""]))
    sent = [(c["choices"][0]["delta"].get("content"), [e["token"] for e in c["choices"][0]["logprobs"]["content"]])
            for c in response_events(response)[1:] if c != "[DONE]" and c["choices"][0]["logprobs"]]
    assert sent == [("He", ["He"]), (" wo", [" wo"]), ("rld?", ["rld", "?"])]


@pytest.mark.parametrize("api", ["messages", "responses"])
def test_a_translated_stream_starts_and_pings_while_its_first_token_is_slow(api):
    # it sent no byte until the first token: a long prefill behind a proxy that cuts idle streams (nginx's
    # 60 s) ended in a 504, where the README promised pings
    import deployments.ingress as ingress
    from app.messages_api import MessageEvents
    from app.responses_api import ResponseEvents, ResponsesRequest

    class Slow(_Answering):
        first_token_ping_s = 0.05

        def __init__(self, refuse: int = 0):
            super().__init__(["Hi", " there"], "stop")
            self.refuse = refuse

        async def _chat(self, req, default, counted=None):
            counted[0] = 3  # (tokenized)
            await asyncio.sleep(0.3)  # a long prefill
            if self.refuse:
                raise ingress.ApiError(self.refuse, "refused late: max_new_tokens")
            return await Cls._openai_stream(self, [([1, 2, 3], {"logprobs": False})], "chat-1", 0,
                                            "chat.completion.chunk", req, [""])

    def read(fake) -> list:
        events = (MessageEvents("msg_1", "m", 10) if api == "messages" else
                  ResponseEvents(ResponsesRequest.model_validate({"input": "hi", "stream": True}), "resp_1", 0, "m"))

        async def go():  # (one loop: the chat route's answer is awaited while the stream is read)
            response = await Cls._chat_view(fake, {"messages": [{"role": "user", "content": "hi"}]}, 10, events, True)
            return "".join([piece async for piece in response.body_iterator])
        return asyncio.run(go()).split("\n\n")

    pieces = read(Slow())
    first = "message_start" if api == "messages" else "response.created"
    assert first in pieces[0]
    pings = [p for p in pieces if "ping" in p]
    assert len(pings) >= 3 and pieces.index(pings[0]) < min(i for i, p in enumerate(pieces) if "Hi" in p)
    assert ("message_stop" if api == "messages" else "response.completed") in pieces[-2]
    if api == "messages":  # its first event says the prompt's tokens (it said 0: not counted yet)
        assert json.loads(pieces[0].split("data: ", 1)[1])["message"]["usage"]["input_tokens"] == 3
    # a refusal after the stream started: its error event ends it, of the type its status names (a 429
    # said api_error / server_error, so clients that retry on overload did not), in the API's words
    for status, kind in ((422, "invalid_request_error"), (429, "rate_limit_error" if api == "messages"
                                                           else "rate_limit_exceeded")):
        refused = read(Slow(refuse=status))
        assert first in refused[0]
        error = next(json.loads(p.split("data: ", 1)[1]) for p in refused if p.startswith("event: error"))
        got = error["error"] if api == "messages" else error
        assert (got["type"] if api == "messages" else got["code"], got["message"]) == (kind, "refused late: max_tokens")


def test_a_calls_own_tokens_do_not_ride_with_the_text_after_it():
    # the tokens that end a call (its closing tag) make no delta of their own: their log-probs went out
    # with the next text's, and with parallel_tool_calls false a whole dropped call's did (the Responses
    # message after a call then carried ~80 log-probs for 6 characters)
    texts = ["OK.", " ", "<tool_call>", '{"name": "f", "arguments": ', '{"a": 1}', "}", "</tool_call>", " then",
             "<tool_call>", '{"name": "f", "arguments": {"a": 2}}', "</tool_call>"]

    class Calling(_Answering):
        _oai_logprobs = Cls._oai_logprobs
        _token_bytes = staticmethod(lambda t: [])
        _token_text = staticmethod(str)

    fake = Calling(texts, "stop")
    for ev in fake.events:
        ev["logprob"] = -1.0
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    req = ChatRequest(messages=[{"role": "user", "content": "hi"}], stream=True, tools=tools, logprobs=True,
                      parallel_tool_calls=False)
    response = asyncio.run(Cls._tool_stream(fake, req, [([1, 2, 3], {"logprobs": True})], "chat-1", 0, 0))
    sent = [e["choices"][0] for e in response_events(response) if e != "[DONE]" and e["choices"]]
    then = next(c for c in sent if c["delta"].get("content", "").endswith(" then"))
    assert [t["token"] for t in then["logprobs"]["content"]] == ["17"]  # its own token (ids count from 10)
    (call,) = [c for c in sent if c["delta"].get("tool_calls")]
    assert [t["token"] for t in call["logprobs"]["content"]] == ["11", "12", "13", "14"]  # (its text: the call's)
    later = [t["token"] for c in sent[sent.index(then) + 1:] for t in (c["logprobs"] or {}).get("content", ())]
    assert later == []  # the dropped call's are nobody's
