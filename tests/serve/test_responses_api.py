"""OpenAI's Responses API over real HTTP (2 replicas of the tiny model): through OpenAI's own client, the
same answers as the chat route, streamed as the API's events, tools, structured outputs and refusals."""

from __future__ import annotations

import json
import re
import time

import httpx
import pytest

from tests.serve.test_http_api import ADD, WEATHER, metrics

INSTRUCTIONS = "You are terse."
ASK = "Say hi to the quick brown fox."
MESSAGES = [{"role": "system", "content": INSTRUCTIONS}, {"role": "user", "content": ASK}]
FLAT_WEATHER = {"type": "function", **WEATHER["function"]}  # the Responses API's tools are flat
FLAT_ADD = {"type": "function", **ADD["function"]}


def _named_events(resp) -> list[tuple[str, dict]]:
    """(event name, data) of a Responses stream: every event is named, and its data says the same type."""
    out, name = [], None
    for line in resp.iter_lines():
        if line.startswith("event:"):
            name = line[6:].strip()
        elif line.startswith("data:"):
            data = json.loads(line[5:])
            assert data["type"] == name
            out.append((name, data))
    return out


def test_openai_client_responses_match_the_chat_answer(serve_app, client):
    openai = pytest.importorskip("openai")
    oc = openai.OpenAI(base_url=serve_app + "/v1", api_key="unused")
    chat = oc.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=6, temperature=0)
    r = oc.responses.create(model="tiny", input=ASK, instructions=INSTRUCTIONS, max_output_tokens=6, temperature=0)
    assert r.id.startswith("resp_") and r.object == "response"
    assert r.output_text == chat.choices[0].message.content
    assert r.status == ("incomplete" if chat.choices[0].finish_reason == "length" else "completed")
    assert r.usage.input_tokens == chat.usage.prompt_tokens and r.usage.output_tokens == chat.usage.completion_tokens
    (item,) = r.output
    assert item.type == "message" and item.role == "assistant" and item.status == r.status
    # streamed through the client: the API's events, in order, adding up to the same answer
    events = list(oc.responses.create(model="tiny", input=ASK, instructions=INSTRUCTIONS, max_output_tokens=6,
                                      temperature=0, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          f"response.{r.status}"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert len(deltas) > 1 and "".join(deltas) == r.output_text == events[-4].text
    final = events[-1].response
    assert final.output_text == r.output_text and final.usage.output_tokens == r.usage.output_tokens
    # a message list as input, with the same conversation, is the same prompt
    again = client.post("/v1/responses", json={"model": "tiny", "max_output_tokens": 1, "input": [
        {"role": "system", "content": INSTRUCTIONS}, {"type": "message", "role": "user",
                                                      "content": [{"type": "input_text", "text": ASK}]}]})
    assert again.status_code == 200, again.text
    assert again.json()["usage"]["input_tokens"] == chat.usage.prompt_tokens


def test_responses_function_calls_and_their_outputs(client):
    base = {"model": "tiny", "input": "Weather?", "max_output_tokens": 60, "temperature": 0,
            "tools": [FLAT_WEATHER, FLAT_ADD]}
    r = client.post("/v1/responses", json={**base, "tool_choice": {"type": "function", "name": "get_weather"}})
    assert r.status_code == 200, r.text
    (call,) = r.json()["output"]
    assert call["type"] == "function_call" and call["name"] == "get_weather" and call["status"] == "completed"
    assert call["id"].startswith("fc_") and call["call_id"].startswith("call_")
    args = json.loads(call["arguments"])
    assert args["city"] in ("Oslo", "Lima")
    # streamed: the call opens, its arguments come in pieces, and close whole
    with client.stream("POST", "/v1/responses", json={**base, "stream": True,
                                                      "tool_choice": {"type": "function", "name": "get_weather"}}) as s:
        events = _named_events(s)
    pieces = [d["delta"] for k, d in events if k == "response.function_call_arguments.delta"]
    assert len(pieces) > 3 and json.loads("".join(pieces)) == args
    (done,) = [d for k, d in events if k == "response.function_call_arguments.done"]
    assert done["arguments"] == "".join(pieces)
    added = next(d["item"] for k, d in events if k == "response.output_item.added")
    assert added["type"] == "function_call" and added["arguments"] == "" and added["status"] == "in_progress"
    assert events[-1][1]["response"]["output"][0]["arguments"] == call["arguments"]
    # the call and its output go back as input items: the template renders them as the chat route does
    history = [{"role": "user", "content": "Weather?"},
               {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": call["arguments"]},
               {"type": "function_call_output", "call_id": "c1", "output": "sunny"}]
    chat_history = [{"role": "user", "content": "Weather?"},
                    {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function", "function": {
                        "name": "get_weather", "arguments": call["arguments"]}}]},
                    {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]
    r = client.post("/v1/responses", json={**base, "input": history, "max_output_tokens": 2})
    chat = client.post("/v1/chat/completions", json={"messages": chat_history, "tools": [WEATHER, ADD], "max_tokens": 2})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["input_tokens"] == chat.json()["usage"]["prompt_tokens"]
    # a model that writes a Hermes call under tool_choice auto (held to one by a regex)
    hermes = r'Checking\.<tool_call>\{"name": "add", "arguments": \{"a": true\}\}</tool_call>'
    r = client.post("/v1/responses", json={**base, "guided_regex": hermes, "max_output_tokens": 100}).json()
    assert [o["type"] for o in r["output"]] == ["message", "function_call"]
    assert r["output"][0]["content"][0]["text"] == "Checking." and json.loads(r["output"][1]["arguments"]) == {"a": True}
    # streamed: the message is done before the call is added, whose arguments stream as they are written
    with client.stream("POST", "/v1/responses", json={**base, "guided_regex": hermes, "max_output_tokens": 100,
                                                      "stream": True}) as s:
        events = [json.loads(line[5:]) for line in s.iter_lines() if line.startswith("data:")]
    kinds = [e["type"] for e in events]
    assert kinds.index("response.output_text.done") < kinds.index("response.output_item.added", 3)
    args = [e["delta"] for e in events if e["type"] == "response.function_call_arguments.delta"]
    assert len(args) > 2 and json.loads("".join(args)) == {"a": True}
    assert json.loads(events[-1]["response"]["output"][1]["arguments"]) == {"a": True}


def test_responses_structured_output_logprobs_and_extensions(client):
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"], "additionalProperties": False}
    r = client.post("/v1/responses", json={"input": "Answer in JSON.", "max_output_tokens": 40, "text": {
        "format": {"type": "json_schema", "name": "answer", "schema": schema, "strict": True}}})
    assert r.status_code == 200, r.text
    body = r.json()
    assert isinstance(json.loads(body["output"][0]["content"][0]["text"])["ok"], bool)
    assert body["text"]["format"]["name"] == "answer"  # the request's settings come back
    # what agent SDKs send for reasoning models is taken (and echoed): the model thinks as its template has it
    r = client.post("/v1/responses", json={"input": "hi", "max_output_tokens": 2, "reasoning": {"effort": "low"}})
    assert r.status_code == 200 and r.json()["reasoning"]["effort"] == "low"
    r = client.post("/v1/responses", json={"input": ASK, "max_output_tokens": 4, "top_logprobs": 2, "temperature": 0,
                                           "include": ["message.output_text.logprobs"], "ignore_eos": True}).json()
    part = r["output"][0]["content"][0]
    assert len(part["logprobs"]) == 4 and all(len(lp["top_logprobs"]) == 2 for lp in part["logprobs"])
    # (an ignored EOS, or another special token, has a log-prob but no text)
    assert re.sub(r"<\|[a-z_]+\|>", "", "".join(lp["token"] for lp in part["logprobs"])) == part["text"]
    assert r["status"] == "incomplete" and r["incomplete_details"] == {"reason": "max_output_tokens"}
    assert r["output"][0]["status"] == "incomplete"
    # top_logprobs alone says how many, not whether: no log-probs without the include (as OpenAI)
    r = client.post("/v1/responses", json={"input": ASK, "max_output_tokens": 2, "top_logprobs": 2}).json()
    assert r["output"][0]["content"][0]["logprobs"] == []
    # without max_output_tokens the answer may take the room its context leaves, as chat's without max_tokens
    # (which stopped at 64)
    long = r"(Hello world\. ){60}"
    r = client.post("/v1/responses", json={"input": ASK, "guided_regex": long}).json()
    assert r["status"] == "completed" and r["usage"]["output_tokens"] > 64, r["usage"]
    assert r["output"][0]["content"][0]["text"] == "Hello world. " * 60
    chat = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": ASK}],
                                                     "guided_regex": long}).json()
    assert chat["choices"][0]["message"]["content"] == "Hello world. " * 60
    assert chat["usage"]["completion_tokens"] == r["usage"]["output_tokens"] > 64
    assert chat["choices"][0]["finish_reason"] == "stop"


@pytest.mark.parametrize("body,needle", [
    ({"input": "hi", "previous_response_id": "resp_1"}, "previous_response_id"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "only text parts"),
    ({"input": "hi", "tools": [{"type": "web_search"}]}, "only function tools"),
    ({"input": []}, "input"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "item_reference"),
    ({"input": "hi", "text": {"format": {"type": "grammar"}}}, "text.format"),
    ({"input": "hi", "tool_choice": "required"}, "tool_choice"),
    ({"input": "hi", "truncation": "auto"}, "truncation"),
    ({"input": "hi", "max_output_tokens": 0}, "max_output_tokens"),
    # refusals of the chat request made from it name this API's fields (its tools are flat)
    ({"input": "hi", "tools": [{"type": "function", "parameters": {"type": "object"}}]}, "tools[0].name: Field required"),
    ({"input": [{"type": "function_call", "call_id": "a", "name": "w", "arguments": "{}"},
                {"type": "function_call_output", "call_id": "a", "output": [{"type": "input_image"}]}]},
     "input[1].output[0]: only text parts"),
    ({"input": "hi", "text": {"format": {"type": "json_schema", "name": "x", "schema": 5}}},
     "text.format.schema must be a JSON schema"),
])
def test_responses_refusals_are_400s_in_openais_format(client, body, needle):
    r = client.post("/v1/responses", json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert needle in err["message"] and err["type"] == "invalid_request_error"
    assert client.post("/v1/responses", json={"input": "hi", "model": "other"}).status_code == 404


@pytest.mark.parametrize("path, body", [
    ("/v1/responses", {"input": ASK, "max_output_tokens": 1500}),
    ("/v1/messages", {"messages": [{"role": "user", "content": ASK}], "max_tokens": 1500})])
def test_a_translated_stream_left_mid_answer_frees_its_blocks(serve_app, client, path, body):
    """(The Responses and the Messages APIs' streams are the chat route's, translated.)"""
    aborted = metrics(client).get(("radixserve_requests_aborted_total", "all"), 0.0)
    body = {**body, "ignore_eos": True, "stream": True}
    with httpx.Client(base_url=serve_app, timeout=30) as c, c.stream("POST", path, json=body) as r:
        for lines, _ in enumerate(r.iter_lines()):
            if lines >= 12:
                break
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        m = metrics(client)
        if m[("radixserve_cache_blocks_in_use", "all")] == 0 and m[("radixserve_requests_aborted_total", "all")] > aborted:
            break
        time.sleep(0.5)
    assert m[("radixserve_cache_blocks_in_use", "all")] == 0 and m[("radixserve_running_requests", "all")] == 0
    assert m[("radixserve_requests_aborted_total", "all")] == aborted + 1


def test_text_parts_join_as_the_chat_routes_do():
    # they were joined with nothing: "Hello" and "world" became "Helloworld", another prompt than chat's
    from app.responses_api import _messages
    from app.schemas import ChatMessage

    parts = [{"type": "input_text", "text": "Hello"}, {"type": "input_text", "text": "world"}]
    (msg,) = _messages([{"role": "user", "content": parts}])
    chat = ChatMessage(role="user", content=[{"type": "text", "text": "Hello"}, {"type": "text", "text": "world"}])
    assert msg["content"] == chat.text("messages[0]") == "Hello\nworld"
