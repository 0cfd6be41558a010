"""Anthropic's Messages API pieces that need no server: turns as chat messages, chat answers as messages,
and chat chunks as the API's events (the HTTP side is tests/serve/test_messages_api.py)."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from app.messages_api import MessageEvents, MessagesRequest
from app.schemas import ChatRequest


def test_turns_become_a_chat_with_calls_results_and_thinking():
    req = MessagesRequest.model_validate({"max_tokens": 5, "system": [{"type": "text", "text": "Be brief."}], "messages": [
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": [{"type": "thinking", "thinking": "Ask the tool.", "signature": "x"},
                                          {"type": "text", "text": "Checking."},
                                          {"type": "tool_use", "id": "t1", "name": "w", "input": {"city": "Oslo"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "sunny"},
                                     {"type": "text", "text": "And tomorrow?", "cache_control": {"type": "ephemeral"}}]}],
        "tools": [{"name": "w", "input_schema": {"type": "object"}}],
        "tool_choice": {"type": "any", "disable_parallel_tool_use": True}})
    body = req.chat_body()
    assert [m["role"] for m in body["messages"]] == ["system", "user", "assistant", "tool", "user"]
    turn = body["messages"][2]
    assert turn["content"] == "Checking." and turn["reasoning_content"] == "Ask the tool."
    assert json.loads(turn["tool_calls"][0]["function"]["arguments"]) == {"city": "Oslo"}
    assert body["messages"][3] == {"role": "tool", "tool_call_id": "t1", "content": "sunny"}
    assert body["tool_choice"] == "required" and body["parallel_tool_calls"] is False
    ChatRequest.model_validate(body)


def test_several_text_blocks_tool_errors_and_images_a_tool_opened():
    """What Claude Code sends: a system prompt and reminders in several blocks, a failed tool, an image a
    tool read (which stands as a note: the conversation goes on)."""
    req = MessagesRequest.model_validate({"max_tokens": 5, "system": [
        {"type": "text", "text": "You are a coding agent."}, {"type": "text", "text": "Be brief.",
                                                             "cache_control": {"type": "ephemeral"}}], "messages": [
        {"role": "user", "content": [{"type": "text", "text": "<system-reminder>x</system-reminder>"},
                                     {"type": "text", "text": "Open the logo."}]},
        {"role": "assistant", "content": [{"type": "thinking", "thinking": "Read it."},
                                          {"type": "tool_use", "id": "t1", "name": "Read", "input": {}},
                                          {"type": "thinking", "thinking": "And the other."},
                                          {"type": "tool_use", "id": "t2", "name": "Read", "input": {}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "t1", "content": [{"type": "image", "source": {}}]},
            {"type": "tool_result", "tool_use_id": "t2", "content": "no such file", "is_error": True}]}]})
    msgs = req.chat_body()["messages"]
    assert msgs[0]["content"] == "You are a coding agent.\n\nBe brief."
    assert msgs[1]["content"] == "<system-reminder>x</system-reminder>\n\nOpen the logo."
    assert msgs[2]["reasoning_content"] == "Read it.\n\nAnd the other."
    assert msgs[3]["content"] == "[a image block, which this server's model cannot read]"
    assert msgs[4]["content"] == "Error: no such file"


@pytest.mark.parametrize("body", [
    {"messages": [{"role": "user", "content": "x"}]},  # max_tokens is required
    {"max_tokens": 5, "messages": [{"role": "system", "content": "x"}]},
    {"max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "tool_use", "id": "a", "name": "w"}]}]},
    {"max_tokens": 5, "messages": [{"role": "user", "content": "x"}], "tool_choice": {"type": "tool"}},
    {"max_tokens": 5, "messages": [{"role": "user", "content": "x"}], "output_config": {"format": {"type": "xml"}}},
    {"max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "a"}]}]},
])
def test_malformed_requests_are_refused(body):
    with pytest.raises(ValidationError):
        MessagesRequest.model_validate(body)


def _whole(deltas: list[dict], finish: str, stop_reason=None, asked: int = 3, named: bool = False) -> dict:
    """The message a chat stream of ``deltas`` adds up to (what an unstreamed answer is)."""
    ev = MessageEvents("msg_1", "m", asked, named)
    ev.prompt_tokens(10, 8)
    ev.start()
    for delta in deltas:
        ev.chunk({"choices": [{"index": 0, "delta": delta, "finish_reason": None}]})
    ev.chunk({"choices": [{"index": 0, "delta": {}, "finish_reason": finish, "stop_reason": stop_reason}]})
    ev.chunk({"choices": [], "usage": {"prompt_tokens": 10, "completion_tokens": 3, "total_tokens": 13,
                                       "prompt_tokens_details": {"cached_tokens": 8}}})
    ev.end()
    return ev.final()


@pytest.mark.parametrize("finish, stop_reason, expected", [
    ("stop", None, ("end_turn", None)), ("stop", "\n\n", ("stop_sequence", "\n\n")), ("stop", 7, ("end_turn", None)),
    ("length", None, ("max_tokens", None))])
def test_why_a_message_stopped(finish, stop_reason, expected):
    m = _whole([{"content": "Hi"}], finish, stop_reason)
    assert (m["stop_reason"], m["stop_sequence"]) == expected
    assert m["usage"] == {"input_tokens": 2, "cache_read_input_tokens": 8, "cache_creation_input_tokens": 0,
                          "output_tokens": 3}
    # cut short by the room the context left, not by max_tokens (3 tokens of the 4 asked)
    cut = _whole([{"content": "Hi"}], finish, stop_reason, asked=4)
    assert cut["stop_reason"] == ("model_context_window_exceeded" if finish == "length" else expected[0])


def test_a_named_tools_call_stops_for_tool_use():
    call = {"index": 0, "id": "call_1", "type": "function", "function": {"name": "w", "arguments": "{\"a\": 1}"}}
    m = _whole([{"reasoning_content": "Hm"}, {"tool_calls": [call]}], "stop", named=True)
    assert [b["type"] for b in m["content"]] == ["thinking", "tool_use"] and m["content"][1]["input"] == {"a": 1}
    assert m["stop_reason"] == "tool_use"
    # a stop sequence inside the named call's arguments cut it: that is why it stopped
    m = _whole([{"tool_calls": [{**call, "function": {"name": "w", "arguments": "{\"a\": \""}}]}], "stop", "STOP",
               named=True)
    assert (m["stop_reason"], m["stop_sequence"]) == ("stop_sequence", "STOP")


def test_a_call_the_chat_route_does_not_end_for_stops_as_the_chat_does():
    # arguments that do not parse (the chat's finish is "stop", not "tool_calls"): it said tool_use, and
    # an agent loop ran the tool on an input the model never wrote
    call = {"index": 0, "id": "call_1", "type": "function", "function": {"name": "w", "arguments": "{\"a\": [1}}"}}
    assert _whole([{"tool_calls": [call]}], "stop")["stop_reason"] == "end_turn"
    assert _whole([{"tool_calls": [call]}], "stop", "STOP")["stop_sequence"] == "STOP"
    assert _whole([{"tool_calls": [call]}], "tool_calls")["stop_reason"] == "tool_use"


def test_a_whole_message_keeps_its_blocks_in_the_order_the_model_wrote_them():
    # text after a tool call: the whole answer joined it into one text block before the call, where
    # the stream had a text block after it
    call = {"index": 0, "id": "call_1", "type": "function", "function": {"name": "w", "arguments": "{\"a\": 1}"}}
    m = _whole([{"content": "A."}, {"tool_calls": [call]}, {"content": " B."}], "tool_calls")
    assert [(b["type"], b.get("text")) for b in m["content"]] == [("text", "A."), ("tool_use", None), ("text", " B.")]
    assert m["content"][1] == {"type": "tool_use", "id": "call_1", "name": "w", "input": {"a": 1}}


def _events(lines: list[str]) -> list[dict]:
    return [json.loads(line.split("data: ", 1)[1]) for line in lines]


def test_a_stream_of_thinking_text_and_a_call():
    ev = MessageEvents("msg_1", "m", 9)
    lines = ev.start()
    for delta in ({"role": "assistant", "content": ""}, {"reasoning_content": "Plan."}, {"content": "Let me "},
                  {"content": "check."}, {"tool_calls": [{"index": 0, "id": "call_1", "function": {"name": "w", "arguments": "{\"a\""}}]},
                  {"tool_calls": [{"index": 0, "function": {"arguments": ": 1}"}}]}):
        lines += ev.chunk({"choices": [{"index": 0, "delta": delta, "finish_reason": None}]})
    lines += ev.chunk({"choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls", "stop_reason": None}]})
    lines += ev.chunk({"choices": [], "usage": {"prompt_tokens": 4, "completion_tokens": 9, "total_tokens": 13}})
    events = _events(lines + ev.end())
    kinds = [e["type"] for e in events]
    assert kinds == ["message_start", "content_block_start", "content_block_delta", "content_block_stop",
                     "content_block_start", "content_block_delta", "content_block_delta", "content_block_stop",
                     "content_block_start", "content_block_delta", "content_block_delta", "content_block_stop",
                     "message_delta", "message_stop"]
    starts = [e["content_block"]["type"] for e in events if e["type"] == "content_block_start"]
    assert starts == ["thinking", "text", "tool_use"]
    assert [e["index"] for e in events if e["type"] == "content_block_stop"] == [0, 1, 2]
    deltas = [e["delta"] for e in events if e["type"] == "content_block_delta"]
    assert deltas[0] == {"type": "thinking_delta", "thinking": "Plan."}
    assert "".join(d.get("partial_json", "") for d in deltas) == "{\"a\": 1}"
    assert events[-2]["delta"] == {"stop_reason": "tool_use", "stop_sequence": None}
    assert events[-2]["usage"]["output_tokens"] == 9


def test_a_tool_use_cut_short_keeps_the_input_it_has_as_the_sdk_reads_the_stream():
    # unstreamed its input was {} where Anthropic's SDK, reading the stream's partial JSON, had {"a": 1}
    call = {"index": 0, "id": "call_1", "type": "function", "function": {"name": "w", "arguments": '{"a": 1, "b": "x'}}
    m = _whole([{"tool_calls": [call]}], "length")
    assert m["content"][0]["input"] == {"a": 1} and m["stop_reason"] == "max_tokens"
    jiter = pytest.importorskip("jiter")  # (the SDK's own partial parser)
    from app.messages_api import _input

    whole = '{"path": "a.py", "n": [1, 2.5, -3e2, true, null], "o": {"k": "v\\"w", "e": {}}, "z": false, "q": [[1], [2]]}'
    for cut in range(len(whole) + 1):
        expected = jiter.from_json(whole[:cut].encode(), partial_mode=True) if cut else {}
        assert _input(whole[:cut]) == (expected if isinstance(expected, dict) else {}), whole[:cut]


@pytest.mark.parametrize("finish", ["tool_calls", "length"])
def test_a_tool_use_whose_numbers_json_cannot_carry_reads_them_as_null_and_stops_at_a_nan(finish):
    # a model's 1e400 became inf in the input, and the unstreamed answer failed to render: a 500. NaN and
    # Infinity are no JSON: Anthropic's TypeScript client JSON.parses the streamed arguments, and raised at
    # them, so the block keeps what came before (unstreamed too: the same input)
    pieces = ['{"a": 1e400, ', '"c": [2.5], ', '"b": NaN, "d": 7}'] if finish == "length" else ['{"a": 1e400, "c": [2.5]}']
    call = {"index": 0, "id": "call_1", "type": "function", "function": {"name": "w"}}
    m = _whole([{"tool_calls": [{**call, "function": {**call["function"], "arguments": p}}]} for p in pieces], finish)
    assert m["content"][0]["input"] == {"a": None, "c": [2.5]}
    json.dumps(m, allow_nan=False)  # (as the answer renders)


def test_a_stream_refused_late_for_overload_says_overloaded_as_before_the_stream():
    # before the stream an overload is Anthropic's 529 overloaded_error; refused after its start (a ping
    # went out first) it was a rate_limit_error, which the SDK retries as another kind of failure
    ev = MessageEvents("msg_1", "m", 9)
    kinds = [json.loads(ev.fail("busy", 429, code)[0].split("data: ", 1)[1])["error"]["type"]
             for code in ("overloaded", None)]
    assert kinds == ["overloaded_error", "rate_limit_error"]


def test_a_chat_fields_location_is_named_as_each_api_names_it():
    from app.responses_api import ResponseEvents

    assert MessageEvents.own_location(("tools", 2, "function", "parameters", "type")) == ("tools", 2, "input_schema", "type")
    assert MessageEvents.own_location(("tools", 0, "function", "name")) == ("tools", 0, "name")
    assert MessageEvents.own_location(("stop", 3)) == ("stop_sequences", 3)
    assert MessageEvents.own_location(("max_tokens",)) == ("max_tokens",)
    assert ResponseEvents.own_location(("max_tokens",)) == ("max_output_tokens",)
    assert ResponseEvents.own_location(("tools", 1, "function", "parameters")) == ("tools", 1, "parameters")
    assert ResponseEvents.own_location(("response_format", "json_schema")) == ("text", "format", "json_schema")
    assert ResponseEvents.own_location(("tool_choice", "function", "name")) == ("tool_choice", "name")
    assert ResponseEvents.own_location(("messages", 0, "content")) == ("messages", 0, "content")
    # and a refusal's own text (a model validator's error has no location)
    assert ResponseEvents.own_text("response_format.json_schema.schema must be a JSON schema; max_tokens (0)") == \
        "text.format.schema must be a JSON schema; max_output_tokens (0)"
    assert ResponseEvents.own_text("min_tokens (3) is more than max_tokens (2)") == \
        "min_tokens (3) is more than max_output_tokens (2)"  # (not a field that ends in it)


def test_max_tokens_0_warms_the_cache_and_answers_nothing():
    """Anthropic's cache pre-warming (max_tokens 0) was refused: the engine computes the prompt and draws
    one token, which the answer leaves out, streamed or not."""
    ev = MessageEvents("msg_1", "m", asked=0)
    ev.prompt_tokens(10, 8)
    sse = ev.start()
    sse += ev.chunk({"choices": [{"index": 0, "delta": {"content": "x"}, "finish_reason": None}]})
    sse += ev.chunk({"choices": [{"index": 0, "delta": {}, "finish_reason": "length"}]})
    sse += ev.chunk({"choices": [], "usage": {"prompt_tokens": 10, "completion_tokens": 1, "total_tokens": 11,
                                              "prompt_tokens_details": {"cached_tokens": 8}}})
    sse += ev.end()
    m = ev.final()
    assert m["content"] == [] and m["stop_reason"] == "max_tokens" and m["usage"]["output_tokens"] == 0
    assert m["usage"]["cache_read_input_tokens"] == 8
    assert not any("content_block" in e for e in sse)


@pytest.mark.parametrize("last", ["", [], [{"type": "text", "text": ""}]])
def test_an_empty_last_assistant_turn_is_no_prefill(last):
    """Anthropic allows the last assistant turn to be empty; carried on as a prefill, a template that trims
    its content (Llama 3, Gemma) lost the newline after the turn's header."""
    req = MessagesRequest.model_validate({"max_tokens": 5, "messages": [
        {"role": "user", "content": "Hi"}, {"role": "assistant", "content": last}]})
    body = req.chat_body()
    assert [m["role"] for m in body["messages"]] == ["user"] and not body.get("continue_final_message")
    prefill = MessagesRequest.model_validate({"max_tokens": 5, "messages": [
        {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Sure"}]}).chat_body()
    assert prefill["continue_final_message"] and prefill["messages"][-1]["content"] == "Sure"
