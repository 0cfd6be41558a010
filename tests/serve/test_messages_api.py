"""Anthropic's Messages API over real HTTP (2 replicas of the tiny model): through Anthropic's own client,
the same answers as the chat route, streamed as the API's events, tools, token counts and errors in
Anthropic's format."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.serve.test_http_api import WEATHER

anthropic = pytest.importorskip("anthropic")

SYSTEM = "You are terse."
ASK = "Say hi to the quick brown fox."
TOOL = {"name": "get_weather", "description": WEATHER["function"]["description"],
        "input_schema": WEATHER["function"]["parameters"]}


@pytest.fixture(scope="module")
def ac(serve_app):
    return anthropic.Anthropic(base_url=serve_app, api_key="unused")


def test_anthropic_client_messages_match_the_chat_answer(ac, client):
    chat = client.post("/v1/chat/completions", json={"messages": [{"role": "system", "content": SYSTEM},
                                                                  {"role": "user", "content": ASK}],
                                                     "max_tokens": 6, "temperature": 0}).json()
    greedy = {"temperature": 0}  # (this client no longer takes sampling settings; the API still does)
    m = ac.messages.create(model="tiny", max_tokens=6, system=SYSTEM, extra_body=greedy,
                           messages=[{"role": "user", "content": ASK}])
    assert m.id.startswith("msg_") and m.role == "assistant" and m.type == "message"
    assert [b.type for b in m.content] == ["text"] and m.content[0].text == chat["choices"][0]["message"]["content"]
    assert m.stop_reason == ("max_tokens" if chat["choices"][0]["finish_reason"] == "length" else "end_turn")
    # its input tokens leave out the ones read from the prefix cache, as Anthropic counts them
    assert m.usage.input_tokens + m.usage.cache_read_input_tokens == chat["usage"]["prompt_tokens"]
    assert m.usage.cache_read_input_tokens > 0 and m.usage.output_tokens == chat["usage"]["completion_tokens"]
    # streamed through the client's own helper: the same text, and a final message it accumulates
    with ac.messages.stream(model="tiny", max_tokens=6, system=SYSTEM, extra_body=greedy,
                            messages=[{"role": "user", "content": ASK}]) as s:
        pieces = list(s.text_stream)
        final = s.get_final_message()
    assert len(pieces) > 1 and "".join(pieces) == m.content[0].text == final.content[0].text
    assert final.stop_reason == m.stop_reason and final.usage.output_tokens == m.usage.output_tokens
    assert final.usage.input_tokens == m.usage.input_tokens - (final.usage.cache_read_input_tokens
                                                               - m.usage.cache_read_input_tokens)
    # the first event already says the prompt's tokens (clients that track their context read them there)
    with httpx.stream("POST", str(ac.base_url).rstrip("/") + "/v1/messages", json={
            "model": "tiny", "max_tokens": 3, "stream": True, "system": SYSTEM,
            "messages": [{"role": "user", "content": ASK}]}) as r:
        first = json.loads(next(line for line in r.iter_lines() if line.startswith("data:"))[5:])
    usage = first["message"]["usage"]
    assert first["type"] == "message_start" and usage["output_tokens"] == 0
    assert usage["input_tokens"] + usage["cache_read_input_tokens"] == chat["usage"]["prompt_tokens"]
    count = ac.messages.count_tokens(model="tiny", system=SYSTEM, messages=[{"role": "user", "content": ASK}])
    assert count.input_tokens == chat["usage"]["prompt_tokens"]
    # a stream field (sent as to /v1/messages) is ignored: it was refused, as if stream_options came without it
    streamed = httpx.post(str(ac.base_url).rstrip("/") + "/v1/messages/count_tokens", json={
        "model": "tiny", "stream": True, "system": SYSTEM, "messages": [{"role": "user", "content": ASK}]})
    assert streamed.status_code == 200 and streamed.json() == {"input_tokens": count.input_tokens}, streamed.text


def test_anthropic_tools_whole_and_streamed_and_their_results(ac, client):
    kw = {"model": "tiny", "max_tokens": 60, "extra_body": {"temperature": 0}, "tools": [TOOL],
          "tool_choice": {"type": "tool", "name": "get_weather"}, "messages": [{"role": "user", "content": "Weather?"}]}
    m = ac.messages.create(**kw)
    (use,) = m.content
    assert use.type == "tool_use" and use.name == "get_weather" and m.stop_reason == "tool_use"
    assert use.input["city"] in ("Oslo", "Lima")
    with ac.messages.stream(**kw) as s:
        final = s.get_final_message()  # (the client parses the input_json_delta pieces)
    assert final.content[0].input == use.input and final.stop_reason == "tool_use"
    # tool_choice auto, a model that writes a Hermes call (held to one by a regex): its input streams as
    # the model writes it, after the text before it
    hermes = r'Checking\.<tool_call>\{"name": "get_weather", "arguments": \{"city": "Oslo", "days": 2\}\}</tool_call>'
    auto = {**kw, "tool_choice": {"type": "auto"}, "extra_body": {"guided_regex": hermes}, "max_tokens": 100}
    with ac.messages.stream(**auto) as s:
        events = list(s)
        final = s.get_final_message()
    assert [b.type for b in final.content] == ["text", "tool_use"] and final.content[0].text == "Checking."
    assert final.content[1].input == {"city": "Oslo", "days": 2} and final.stop_reason == "tool_use"
    assert sum(e.type == "content_block_delta" and e.delta.type == "input_json_delta" for e in events) > 2
    # the call and its result go back as the next turns: the template renders them as the chat route does
    history = [{"role": "user", "content": "Weather?"},
               {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "get_weather",
                                                  "input": use.input}]},
               {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1",
                                             "content": [{"type": "text", "text": "sunny"}]}]}]
    count = ac.messages.count_tokens(model="tiny", tools=[TOOL], messages=history)
    chat_history = [{"role": "user", "content": "Weather?"},
                    {"role": "assistant", "content": None, "tool_calls": [{"id": "t1", "type": "function", "function": {
                        "name": "get_weather", "arguments": json.dumps(use.input)}}]},
                    {"role": "tool", "tool_call_id": "t1", "content": "sunny"}]
    chat = client.post("/v1/chat/completions", json={"messages": chat_history, "tools": [WEATHER], "max_tokens": 1})
    assert count.input_tokens == chat.json()["usage"]["prompt_tokens"]
    m = ac.messages.create(model="tiny", max_tokens=3, tools=[TOOL], messages=history)
    assert m.usage.output_tokens >= 1
    # a structured output, as this client asks for one
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    m = ac.messages.create(model="tiny", max_tokens=40, messages=[{"role": "user", "content": "JSON?"}],
                           output_config={"format": {"type": "json_schema", "schema": schema}, "effort": "low"})
    assert isinstance(json.loads(m.content[0].text)["ok"], bool)


@pytest.mark.parametrize("body,status,kind,needle", [
    ({"messages": [{"role": "user", "content": "hi"}]}, 400, "invalid_request_error", "max_tokens"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, 400,
     "invalid_request_error", "'image' blocks"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": "hi"}],
      "tools": [{"type": "web_search_20250305", "name": "web_search"}]}, 400, "invalid_request_error", "custom tools"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": "hi"}], "mcp_servers": [{"url": "x"}]}, 400,
     "invalid_request_error", "MCP"),
    ({"max_tokens": 5, "model": "other", "messages": [{"role": "user", "content": "hi"}]}, 404, "not_found_error",
     "other"),
    ({"max_tokens": 5, "temperature": 1.5, "messages": [{"role": "user", "content": "hi"}]}, 400,
     "invalid_request_error", "temperature"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "text", "text": None}]}]}, 400,
     "invalid_request_error", "content[0].text must be a string"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": "hi"}], "tools": [
        {"name": "f", "input_schema": {"type": "object"}}, {"name": "f", "input_schema": {"type": "object"}}]}, 400,
     "invalid_request_error", "tool names must be unique"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": "hi"}], "tools": [{"name": "f", "input_schema": "x"}]},
     400, "invalid_request_error", "tools[0].input_schema: Input should be a valid dictionary"),
])
def test_anthropic_errors_come_in_anthropics_format(client, body, status, kind, needle):
    r = client.post("/v1/messages", json=body)
    assert r.status_code == status, r.text
    err = r.json()
    assert err["type"] == "error" and err["error"]["type"] == kind and needle in err["error"]["message"], err


def test_the_anthropic_client_raises_its_own_errors(ac):
    with pytest.raises(anthropic.BadRequestError, match="tool_result"):
        ac.messages.create(model="tiny", max_tokens=5, messages=[{"role": "assistant", "content": [
            {"type": "tool_result", "tool_use_id": "x", "content": "y"}]}])
    with pytest.raises(anthropic.NotFoundError):
        ac.messages.create(model="claude-opus", max_tokens=5, messages=[{"role": "user", "content": "hi"}])


def test_max_tokens_past_the_context_is_cut_to_it_and_an_assistant_turn_is_carried_on(ac, client):
    """Claude Code asks for 32,000 tokens whatever the model: the answer takes the room its context leaves,
    and says that is why it stopped."""
    long = "x" * 990  # (a token a character): about 1,000 of this server's 2,048
    m = ac.messages.create(model="tiny", max_tokens=5000, messages=[{"role": "user", "content": long}],
                           extra_body={"ignore_eos": True})
    assert m.stop_reason == "model_context_window_exceeded"
    assert m.usage.input_tokens + m.usage.cache_read_input_tokens + m.usage.output_tokens == 2048
    # a last assistant turn is a prefill: the answer carries it on (no new turn is opened)
    turns = [{"role": "user", "content": "Name a color."}, {"role": "assistant", "content": "The color is"}]
    count = ac.messages.count_tokens(model="tiny", messages=turns).input_tokens
    carried = client.post("/tokenize", json={"messages": turns, "add_generation_prompt": False,
                                             "continue_final_message": True}).json()["count"]
    assert count == carried
    assert ac.messages.create(model="tiny", max_tokens=3, messages=turns).usage.output_tokens >= 1


@pytest.mark.parametrize("pieces", [['{"location": ', '"Paris"', ', oops', '"unit": "c"}'],
                                    [" ", ' {"location": ', '"Paris"}']])  # (whitespace before: no JSON yet)
def test_streamed_tool_arguments_that_stop_reading_as_json_do_not_break_the_client(pieces):
    # auto tool calls stream their arguments as the model writes them: a piece past which they were no JSON
    # went out as input_json_delta, and Anthropic's client raised at it ("Unable to parse tool parameter JSON")
    from app.messages_api import MessageEvents

    events = MessageEvents("msg_1", "tiny", asked=64)
    sse = events.start()
    head = {"index": 0, "id": "call_1", "type": "function"}
    for i, piece in enumerate(pieces):
        fn = {"name": "get_weather", "arguments": piece} if i == 0 else {"arguments": piece}
        sse += events.chunk({"choices": [{"index": 0, "delta": {"tool_calls": [{**head, "function": fn}]}}]})
    sse += events.chunk({"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}],
                         "usage": {"prompt_tokens": 5, "completion_tokens": 9}})
    sse += events.end()
    body = "".join(sse).encode()
    try:  # the client's own HTTP library: httpx2 in its newer versions
        import httpx2
    except ImportError:
        httpx2 = httpx
    transport = httpx2.MockTransport(lambda _: httpx2.Response(200, content=body,
                                                             headers={"content-type": "text/event-stream"}))
    client = anthropic.Anthropic(base_url="http://test", api_key="unused", http_client=httpx2.Client(transport=transport))
    with client.messages.stream(model="tiny", max_tokens=64, messages=[{"role": "user", "content": "hi"}]) as s:
        got = s.get_final_message()
    (block,) = got.content
    assert block.type == "tool_use" and block.input == {"location": "Paris"}
    assert events.final()["content"][0]["input"] == block.input  # the unstreamed answer says the same


def test_max_tokens_0_puts_the_prompt_in_the_cache_and_answers_nothing(ac):
    # Anthropic's cache pre-warming: refused with a 400 (ge=1), on a server built around its prefix cache
    system = "You warm the cache for the requests after you, a prompt long enough for several blocks. " * 3
    m = ac.messages.create(model="tiny", max_tokens=0, system=system, messages=[{"role": "user", "content": "Hi"}])
    assert m.content == [] and m.stop_reason == "max_tokens" and m.usage.output_tokens == 0
    after = ac.messages.create(model="tiny", max_tokens=2, system=system, messages=[{"role": "user", "content": "Yo"}])
    assert after.usage.cache_read_input_tokens > 0


def test_consecutive_turns_of_one_role_are_one_turn_as_anthropic_combines_them():
    """Each turn was its own chat message: a template that wants the roles to alternate (Gemma's, Llama 2's)
    refused the request, and another showed the model two user turns."""
    from app.messages_api import MessagesRequest

    use = {"type": "tool_use", "id": "t1", "name": "get_weather", "input": {"city": "Oslo"}}
    req = MessagesRequest(max_tokens=4, messages=[
        {"role": "user", "content": "Weather?"}, {"role": "user", "content": [{"type": "text", "text": "In Oslo."}]},
        {"role": "assistant", "content": "Looking."}, {"role": "assistant", "content": [use]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "Sunny"}]},
        {"role": "user", "content": "Thanks."}])
    msgs = req.chat_body()["messages"]
    assert [m["role"] for m in msgs] == ["user", "assistant", "tool", "user"]
    assert msgs[0]["content"] == "Weather?\n\nIn Oslo." and msgs[1]["content"] == "Looking."
    assert [c["id"] for c in msgs[1]["tool_calls"]] == ["t1"] and msgs[3]["content"] == "Thanks."
