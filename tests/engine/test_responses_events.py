"""The Responses API's pieces that need no server: input items as chat messages, and chat chunks as
the API's events (the HTTP side is tests/serve/test_responses_api.py)."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from app.responses_api import ResponseEvents, ResponsesRequest
from app.schemas import ChatRequest


def _events(lines: list[str]) -> list[dict]:
    return [json.loads(line.split("data: ", 1)[1]) for line in lines]


def test_input_items_become_one_chat_with_each_turns_calls_together():
    req = ResponsesRequest.model_validate({"instructions": "Be brief.", "input": [
        {"role": "user", "content": "Weather in Oslo and Lima?"},
        {"type": "reasoning", "id": "rs_1", "summary": []},  # sent back as it came: left out
        {"role": "assistant", "content": [{"type": "output_text", "text": "Checking."}]},
        {"type": "function_call", "call_id": "a", "name": "w", "arguments": "{\"city\": \"Oslo\"}"},
        {"type": "function_call", "call_id": "b", "name": "w", "arguments": "{\"city\": \"Lima\"}"},
        {"type": "function_call_output", "call_id": "a", "output": "sunny"},
        {"type": "function_call_output", "call_id": "b", "output": [{"type": "input_text", "text": "rain"}]},
    ]})
    body = req.chat_body()
    msgs = body["messages"]
    assert [m["role"] for m in msgs] == ["system", "user", "assistant", "tool", "tool"]
    assert msgs[2]["content"] == "Checking." and [c["id"] for c in msgs[2]["tool_calls"]] == ["a", "b"]
    assert msgs[4] == {"role": "tool", "tool_call_id": "b", "content": "rain"}
    ChatRequest.model_validate(body)  # what the chat route takes
    # instructions and a system message in the input make one system turn; refusals sent back are text
    req = ResponsesRequest.model_validate({"instructions": "Be brief.", "input": [
        {"role": "developer", "content": "Use metric units."},
        {"role": "assistant", "content": [{"type": "refusal", "refusal": "I cannot."}]}]})
    assert req.chat_body()["messages"] == [{"role": "system", "content": "Be brief.\n\nUse metric units."},
                                           {"role": "assistant", "content": "I cannot."}]
    # a call after a tool's output is a new assistant turn
    req = ResponsesRequest.model_validate({"input": [
        {"type": "function_call", "call_id": "a", "name": "w", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "a", "output": "x"},
        {"type": "function_call", "call_id": "b", "name": "w", "arguments": "{}"}]})
    assert [m["role"] for m in req.chat_body()["messages"]] == ["assistant", "tool", "assistant"]


@pytest.mark.parametrize("body", [{"input": [{"type": "function_call", "name": "w"}]}, {"input": [{"role": "tool",
                                  "content": "x"}]}, {"input": [{"type": "reasoning"}]}, {"input": "hi", "background": True},
                                  {"input": [{"type": "reasoning", "summary": [{"type": "summary_text", "text": None}]}]},
                                  {"input": [{"type": "reasoning", "content": 5}]},
                                  {"input": [{"type": "function_call", "call_id": "a", "name": "w", "arguments": "{}"},
                                             {"type": "function_call_output", "call_id": "b", "output": "x"}]}])
def test_malformed_inputs_are_refused(body):
    with pytest.raises(ValidationError):
        ResponsesRequest.model_validate(body)


def _chunk(delta: dict | None = None, finish: str | None = None, **extra) -> dict:
    return {"choices": [{"index": 0, "delta": delta or {}, "finish_reason": finish}] if delta is not None or finish
            else [], **extra}


def test_a_stream_of_text_then_a_call_then_more_text():
    ev = ResponseEvents(ResponsesRequest.model_validate({"input": "x"}), "resp_1", 0, "m")
    lines = ev.start()
    for c in (_chunk({"role": "assistant", "content": ""}), _chunk({"content": "Let me "}), _chunk({"content": "see."}),
              _chunk({"tool_calls": [{"index": 0, "id": "call_1", "type": "function",
                                      "function": {"name": "w", "arguments": "{\"a\""}}]}),
              _chunk({"tool_calls": [{"index": 0, "function": {"arguments": ": 1}"}}]}),
              _chunk({"content": " Done."}), _chunk({}, "tool_calls"),
              _chunk(usage={"prompt_tokens": 5, "completion_tokens": 7, "total_tokens": 12,
                            "prompt_tokens_details": {"cached_tokens": 2}})):
        lines += ev.chunk(c)
    lines += ev.end()
    events = _events(lines)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    added = [(e["output_index"], e["item"]["type"]) for e in events if e["type"] == "response.output_item.added"]
    assert added == [(0, "message"), (1, "function_call"), (2, "message")]  # text after a call: a message of its own
    # each item is done before the next is added (a client may run a call as soon as it is done)
    opened_closed = [(e["type"].rsplit(".", 1)[1], e["output_index"]) for e in events
                     if e["type"] in ("response.output_item.added", "response.output_item.done")]
    assert opened_closed == [("added", 0), ("done", 0), ("added", 1), ("done", 1), ("added", 2), ("done", 2)]
    final = events[-1]
    assert final["type"] == "response.completed"
    out = final["response"]["output"]
    assert out[0]["content"][0]["text"] == "Let me see." and out[2]["content"][0]["text"] == " Done."
    assert out[1]["arguments"] == "{\"a\": 1}" and out[1]["call_id"] == "call_1"
    assert all(item["status"] == "completed" for item in out)
    assert final["response"]["usage"] == {"input_tokens": 5, "input_tokens_details": {"cached_tokens": 2, "cache_write_tokens": 0},
                                          "output_tokens": 7, "output_tokens_details": {"reasoning_tokens": 0},
                                          "total_tokens": 12}
    # each event shows its item as it was then; a message's text part is added by an event of its own
    first_added = next(e for e in events if e["type"] == "response.output_item.added")
    assert first_added["item"]["content"] == [] and first_added["item"]["status"] == "in_progress"
    call_done = next(e for e in events if e["type"] == "response.output_item.done" and e["output_index"] == 1)
    assert call_done["item"]["arguments"] == "{\"a\": 1}" and call_done["item"]["status"] == "completed"


@pytest.mark.parametrize("tool_choice, finish, stop_reason, status", [
    ("auto", "tool_calls", None, "completed"),
    ("auto", "stop", None, "incomplete"),  # arguments that do not parse: the chat route does not end for it
    ("auto", "stop", "STOP", "incomplete"),  # a stop string in its arguments cut it
    ({"type": "function", "name": "w"}, "stop", None, "completed"),  # a named tool's answer ends as OpenAI's
    ({"type": "function", "name": "w"}, "stop", "STOP", "incomplete"),
    ("auto", "length", None, "incomplete")])
def test_a_call_the_answer_ends_in_is_completed_only_when_whole(tool_choice, finish, stop_reason, status):
    # an agent loop runs the completed calls: one cut short said completed, with arguments like {"a": "
    req = ResponsesRequest.model_validate({"input": "x", "tool_choice": tool_choice,
                                           "tools": [{"type": "function", "name": "w"}]})
    ev = ResponseEvents(req, "resp_1", 0, "m")
    ev.start()
    ev.chunk(_chunk({"tool_calls": [{"index": 0, "id": "call_1", "type": "function",
                                     "function": {"name": "w", "arguments": "{\"a\": \""}}]}))
    ev.chunk({"choices": [{"index": 0, "delta": {}, "finish_reason": finish, "stop_reason": stop_reason}]})
    ev.end()
    assert [item["status"] for item in ev.final()["output"]] == [status]


def test_an_empty_answer_still_has_its_message_and_a_failure_ends_the_stream():
    req = ResponsesRequest.model_validate({"input": "x", "max_output_tokens": 3})
    ev = ResponseEvents(req, "resp_1", 0, "m")
    events = _events(ev.start() + ev.chunk(_chunk({}, "length")) + ev.end())
    assert [e["type"] for e in events][2:] == ["response.output_item.added", "response.content_part.added",
                                               "response.output_text.done", "response.content_part.done",
                                               "response.output_item.done", "response.incomplete"]
    assert events[-1]["response"]["incomplete_details"] == {"reason": "max_output_tokens"}
    assert events[-1]["response"]["output"][0]["status"] == "incomplete"  # the item cut short says so too
    ev = ResponseEvents(req, "resp_2", 0, "m")
    events = _events(ev.start() + ev.chunk(_chunk({"content": "a"})) + ev.fail("boom"))
    assert [e["type"] for e in events][-2:] == ["error", "response.failed"]
    assert events[-1]["response"]["error"] == {"code": "server_error", "message": "boom"}  # (the API's code)
    # what was written before the failure is in it (an open item's pieces are joined when it is shown)
    ev = ResponseEvents(req, "resp_3", 0, "m")
    events = _events(ev.start() + ev.chunk(_chunk({"content": "a"})) + ev.chunk(_chunk({"content": "b"})) + ev.fail("x"))
    assert events[-1]["response"]["output"][0]["content"][0]["text"] == "ab"


def test_thinking_streams_as_a_reasoning_item_before_the_message():
    ev = ResponseEvents(ResponsesRequest.model_validate({"input": "x"}), "resp_1", 0, "m")
    lines = ev.start()
    for c in (_chunk({"reasoning_content": "Plan"}), _chunk({"reasoning_content": " it."}), _chunk({"content": "Hi."}),
              _chunk({}, "stop")):
        lines += ev.chunk(c)
    events = _events(lines + ev.end())
    kinds = [e["type"] for e in events]
    assert kinds[2:] == ["response.output_item.added", "response.content_part.added", "response.reasoning_text.delta",
                         "response.reasoning_text.delta", "response.reasoning_text.done", "response.content_part.done",
                         "response.output_item.done", "response.output_item.added", "response.content_part.added",
                         "response.output_text.delta", "response.output_text.done", "response.content_part.done",
                         "response.output_item.done", "response.completed"]
    reasoning, message = events[-1]["response"]["output"]
    assert reasoning["type"] == "reasoning" and reasoning["content"] == [{"type": "reasoning_text", "text": "Plan it."}]
    assert message["content"][0]["text"] == "Hi."
    # only thinking (cut short): the answer still has its (empty) message
    ev = ResponseEvents(ResponsesRequest.model_validate({"input": "x"}), "resp_2", 0, "m")
    events = _events(ev.start() + ev.chunk(_chunk({"reasoning_content": "Hmm"})) + ev.chunk(_chunk({}, "length")) + ev.end())
    assert [o["type"] for o in events[-1]["response"]["output"]] == ["reasoning", "message"]
    assert events[-1]["type"] == "response.incomplete"


def test_a_reasoning_item_goes_back_with_the_turn_after_it_and_logprobs_are_the_contents():
    req = ResponsesRequest.model_validate({"input": [
        {"role": "user", "content": "Weather?"},
        {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "Ask it."}]},
        {"type": "function_call", "call_id": "a", "name": "w", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "a", "output": "sun"}]})
    msgs = req.chat_body()["messages"]
    assert msgs[1]["reasoning_content"] == "Ask it." and msgs[1]["tool_calls"][0]["id"] == "a"
    assert ChatRequest.model_validate(req.chat_body()).messages[1].for_template()["reasoning_content"] == "Ask it."
    # the answer's log-probs are its content's, whole or streamed: not the thinking's, nor its tags'
    tokens = ["<think>", "Hm", "</think>", "\n\n", "Hi", "."]
    entries = [{"token": t, "logprob": -1.0, "bytes": [], "top_logprobs": []} for t in tokens]
    ev = ResponseEvents(req, "resp_2", 0, "m")
    lines = ev.start()
    for delta, ents in (({}, entries[:1]), ({"reasoning_content": "Hm"}, entries[1:2]),
                        ({"content": "Hi"}, entries[2:5]), ({"content": "."}, entries[5:])):
        lines += ev.chunk({"choices": [{"index": 0, "delta": delta, "finish_reason": None,
                                        "logprobs": {"content": ents}}]})
    streamed = _events(lines + ev.end())[-1]["response"]["output"][1]["content"][0]["logprobs"]
    assert [e["token"] for e in streamed] == ["\n\n", "Hi", "."]
    assert ev.final()["output"][1]["content"][0]["logprobs"] == streamed  # (unstreamed: what the stream adds up to)


def test_streamed_logprobs_keep_the_tokens_whose_text_came_later_as_the_whole_answer_has_them():
    # the first token's text held back (half a character) and the EOS come in chunks without text: their
    # entries were dropped from the stream, so its bytes no longer made up the text
    req = ResponsesRequest.model_validate({"input": "x"})
    entries = [{"token": t, "logprob": -1.0, "bytes": b, "top_logprobs": []}
               for t, b in (("\ufffd", [240, 159]), ("\ufffd", [152, 128]), ("!", [33]), ("<|eos|>", []))]
    ev = ResponseEvents(req, "resp_2", 0, "m")
    lines = ev.start()
    for delta, ents, finish in (({"role": "assistant", "content": ""}, [], None), ({}, entries[:1], None),
                                ({"content": "\U0001F600"}, entries[1:2], None), ({"content": "!"}, entries[2:3], None),
                                ({}, entries[3:], "stop")):
        lines += ev.chunk({"choices": [{"index": 0, "delta": delta, "finish_reason": finish,
                                        "logprobs": {"content": ents}}]})
    events = _events(lines + ev.end())
    deltas = [e for e in events if e["type"] == "response.output_text.delta"]
    assert [d["logprobs"] for d in deltas] == [entries[:2], entries[2:3]]  # each with its text
    assert bytes(b for d in deltas for e in d["logprobs"] for b in e["bytes"]).decode() == "\U0001F600!"
    done = next(e for e in events if e["type"] == "response.output_text.done")
    assert done["logprobs"] == entries and events[-1]["response"]["output"][0]["content"][0]["logprobs"] == entries


def test_the_final_response_is_what_the_openai_sdk_types_require():
    types = pytest.importorskip("openai.types.responses")
    ev = ResponseEvents(ResponsesRequest.model_validate({"input": "x"}), "resp_1", 0, "m")
    lines = ev.start() + ev.chunk(_chunk({"role": "assistant", "content": "Hi"})) + ev.chunk(_chunk({}, "stop"))
    lines += ev.chunk(_chunk(usage={"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7,
                                    "prompt_tokens_details": {"cached_tokens": 0}}))
    final = _events(lines + ev.end())[-1]["response"]
    types.Response.model_validate(final)  # strictly (the SDK itself parses leniently): every required field


def test_an_answer_without_text_keeps_its_eos_log_prob_streamed_as_whole():
    # the message opened at the end (no text came) cleared the held entries first: logprobs [] streamed
    req = ResponsesRequest.model_validate({"input": "x"})
    eos = [{"token": "<|eos|>", "logprob": -0.5, "bytes": [], "top_logprobs": []}]
    ev = ResponseEvents(req, "resp_2", 0, "m")
    lines = ev.start() + ev.chunk({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                                "finish_reason": None, "logprobs": {"content": []}}]})
    lines += ev.chunk({"choices": [{"index": 0, "delta": {}, "finish_reason": "stop", "logprobs": {"content": eos}}]})
    streamed = _events(lines + ev.end())[-1]["response"]["output"][0]["content"][0]["logprobs"]
    assert streamed == eos


@pytest.mark.parametrize("first, second", [('{"a": NaN}', '{"a": 1}'), ('{"a": 1}', '{"a": NaN}')])
def test_a_call_whose_arguments_broke_is_incomplete_when_done_and_the_others_are_not(first, second):
    # only the last call was looked at: a broken first call ({"a": NaN}) was done as completed, and a client
    # that runs each call as it is done ran it (the final response then said incomplete); and then every call
    # of such an answer was incomplete, a whole one too
    from app.tool_stream import ToolCallStream

    req = ResponsesRequest.model_validate({"input": "x", "tools": [{"type": "function", "name": "add"}]})
    stream = ToolCallStream("hermes", {"add"})
    deltas = stream.feed(f'<tool_call>{{"name": "add", "arguments": {first}}}</tool_call>\n'
                         f'<tool_call>{{"name": "add", "arguments": {second}}}</tool_call>') + stream.finish()
    ev = ResponseEvents(req, "resp_1", 0, "m")
    lines = ev.start()
    for d in deltas:
        lines += ev.chunk(_chunk(d))
    finish = stream.finish_reason("stop")
    assert finish == "stop"  # (the chat route ends for no call when one broke)
    lines += ev.chunk({"choices": [{"index": 0, "delta": {}, "finish_reason": finish, "stop_reason": None}]})
    lines += ev.end()
    expected = [(args, "completed" if args == '{"a": 1}' else "incomplete") for args in (first, second)]
    assert [(item["arguments"], item["status"]) for item in ev.final()["output"]] == expected
    done = [e["item"] for e in _events(lines) if e["type"] == "response.output_item.done"]
    assert [(item["arguments"], item["status"]) for item in done] == expected  # as the final response says


def test_thinking_cut_by_max_output_tokens_is_incomplete_and_a_failures_code_is_one_of_openais():
    req = ResponsesRequest.model_validate({"input": "x", "max_output_tokens": 3})
    ev = ResponseEvents(req, "resp_1", 0, "m")
    ev.start()
    ev.chunk(_chunk({"reasoning_content": "Let me"}))
    ev.chunk(_chunk({}, "length"))
    ev.end()
    assert [(item["type"], item["status"]) for item in ev.final()["output"]] == [
        ("reasoning", "incomplete"), ("message", "incomplete")]
    # the response's error code is of the SDK's list (an internal one, or invalid_request_error, is not);
    # the error event may say more
    for status, code, said, listed in ((429, "overloaded", "overloaded", "rate_limit_exceeded"),
                                       (422, None, "invalid_request_error", "invalid_prompt"),
                                       (503, "engine_failure", "engine_failure", "server_error")):
        ev = ResponseEvents(req, "resp_2", 0, "m")
        error, failed = _events(ev.start() + ev.fail("no", status, code))[-2:]
        assert error["code"] == said and failed["response"]["error"]["code"] == listed


def test_a_function_tool_without_strict_is_strict_as_openais_responses_take_it():
    """OpenAI's Responses API holds a function's calls to its schema unless it says strict false (chat's
    default is the other way); a schema no guide can hold stays unguided rather than refused. The tools the
    template renders stay as the client sent them (the same prompt as the chat route's)."""
    params = {"type": "object", "properties": {"a": {"type": "integer"}}}

    def strict(tool: dict, route_default: bool = True) -> bool:
        body = ResponsesRequest.model_validate({"input": "x", "tools": [{"type": "function", "name": "f", **tool}]}).chat_body()
        chat = ChatRequest.model_validate(body)
        chat._strict_unless_said = route_default and ResponseEvents.TOOLS_STRICT_UNLESS_SAID
        assert ("strict" in body["tools"][0]["function"]) is (tool.get("strict") is not None)
        return chat.tools_strictness()[0][2]

    assert strict({"parameters": params}) is True and strict({"parameters": params, "strict": None}) is True
    assert strict({}) is True  # (no parameters: any object)
    assert strict({"parameters": params, "strict": False}) is False
    assert strict({"parameters": {"type": "object", "properties": {"a": {"type": "bogus"}}}}) is False
    assert strict({"parameters": params}, route_default=False) is False  # (the chat route's default)


def test_thinking_of_a_turn_cut_short_is_not_a_later_answers():
    req = ResponsesRequest.model_validate({"input": [
        {"role": "user", "content": "first"}, {"type": "reasoning", "summary": [{"type": "summary_text", "text": "T1"}]},
        {"role": "user", "content": "second"}, {"role": "assistant", "content": "answer to second"}]})
    assert "reasoning_content" not in req.chat_body()["messages"][-1]


def test_a_prompt_past_the_context_says_so_in_the_failed_response_too():
    """Codex reads a stream's failure from response.failed alone, and compacts its history on OpenAI's
    context_length_exceeded there; a refusal that came after a late start said invalid_prompt."""
    ev = ResponseEvents(ResponsesRequest.model_validate({"input": "x", "stream": True}), "resp_1", 0, "m")
    events = _events(ev.start() + ev.fail("too long", 400, "context_length_exceeded"))
    assert events[-1]["response"]["error"]["code"] == events[-2]["code"] == "context_length_exceeded"
    ev = ResponseEvents(ResponsesRequest.model_validate({"input": "x", "stream": True}), "resp_2", 0, "m")
    assert _events(ev.start() + ev.fail("bad", 400))[-1]["response"]["error"]["code"] == "invalid_prompt"


def test_thinking_before_a_call_that_joins_its_turns_text_stays_with_that_turn():
    """Codex sends reasoning, a preamble message, reasoning, then the call: the call joins the message's
    turn, and the second thinking went to the next answer instead."""
    req = ResponsesRequest.model_validate({"input": [
        {"role": "user", "content": "fix it"},
        {"type": "reasoning", "summary": [{"type": "summary_text", "text": "R1"}]},
        {"role": "assistant", "content": "Looking."},
        {"type": "reasoning", "summary": [{"type": "summary_text", "text": "R2"}]},
        {"type": "function_call", "call_id": "c1", "name": "read", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "code"},
        {"role": "assistant", "content": "Done."}]})
    msgs = req.chat_body()["messages"]
    assert msgs[1]["reasoning_content"] == "R1\n\nR2" and [c["id"] for c in msgs[1]["tool_calls"]] == ["c1"]
    assert "reasoning_content" not in msgs[-1]


def test_the_responses_route_makes_tools_strict_unless_said_and_the_messages_route_does_not():
    """The route sets the default on the chat request it makes (no service test sent a tool without strict)."""
    import asyncio

    from app.messages_api import MessageEvents, MessagesRequest
    from deployments.ingress import ApiError, Ingress

    class Route:
        _chat_view, first_token_ping_s = Ingress.func_or_class._chat_view, 10.0

        async def _chat(self, req, default, counted):
            self.seen = req.tools_strictness()
            raise ApiError(400, "enough")

    params = {"type": "object", "properties": {"a": {"type": "integer"}}}
    route = Route()
    req = ResponsesRequest.model_validate({"input": "x", "tools": [{"type": "function", "name": "f", "parameters": params}]})
    with pytest.raises(ApiError):
        asyncio.run(route._chat_view(req.chat(), 16, ResponseEvents(req, "resp_1", 0, "m"), False))
    assert route.seen == [("f", params, True)]
    msg = MessagesRequest.model_validate({"max_tokens": 5, "messages": [{"role": "user", "content": "x"}],
                                          "tools": [{"name": "f", "input_schema": params}]})
    with pytest.raises(ApiError):
        asyncio.run(route._chat_view(msg.chat(), 16, MessageEvents(msg, "msg_1", "m"), False))
    assert route.seen == [("f", params, False)]
