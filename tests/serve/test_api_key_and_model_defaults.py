"""A service started with ``--api-key``, ``--scheduling-policy priority``, ``--reasoning-parser qwen3`` and
``--max-concurrent-requests 2``,
of a model whose ``generation_config.json`` declares a sampling default (top_k 1, greedy), over real HTTP:
who gets in, what a request that leaves sampling unset gets, that a priority is served, and thinking
split from answers."""

from __future__ import annotations

import json
import shutil
import time

import httpx
import pytest

from app.cli import main as cli
from bench.http_load import wait_healthy

ROUTE = "/ktest"
KEY = "rs-test-key-0123456789"
NEW_KEY = "rs-next-key-9876543210"  # a second key, as while clients move to a new one
AUTH = {"authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def keyed(serve_app, model_dir, redis_server, tmp_path_factory):
    from ray import serve

    from app.config import Settings
    from app.main import build_app

    folder = tmp_path_factory.mktemp("keyed") / "tiny-top-k-1"
    shutil.copytree(model_dir("tiny"), folder)
    gc = json.loads((folder / "generation_config.json").read_text())
    (folder / "generation_config.json").write_text(json.dumps({**gc, "top_k": 1, "max_new_tokens": 5}))
    settings = Settings(model_id=str(folder), num_replicas=1, replica_num_cpus=1, max_batch_total_tokens=2048,
                        redis_url=redis_server.url, api_key=f"{KEY}, {NEW_KEY}", deployment_name="ktest",
                        scheduling_policy="priority", reasoning_parser="qwen3", model_aliases="claude-haiku-4-5, gpt-x",
                        max_concurrent_requests=2)
    serve.run(build_app(settings), name="ktest", route_prefix=ROUTE)
    url = serve_app + ROUTE
    wait_healthy(url, timeout=120)  # /health needs no key
    yield url
    serve.delete("ktest")


def test_an_api_key_guards_every_route_but_health_and_metrics(keyed):
    with httpx.Client(base_url=keyed, timeout=60) as c:
        assert c.get("/health").status_code == 200
        assert c.get("/metrics").status_code == 200
        tgi = c.post("/generate", json={"inputs": "hi", "parameters": {"max_new_tokens": 2}})
        assert tgi.status_code == 401 and tgi.json()["error_type"] == "authentication", tgi.text
        assert tgi.headers["www-authenticate"] == "Bearer"
        for headers in ({}, {"authorization": f"Bearer {KEY[:-1]}"}, {"authorization": f"Bearer {KEY}x"},
                        {"authorization": KEY}, {"authorization": f"Basic {KEY}"},
                        {"authorization": f"Bearer {KEY},{NEW_KEY}"}, {"authorization": f"Bearer {NEW_KEY[1:]}"}):
            r = c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2}, headers=headers)
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", (headers, r.text)
        for method, path in (("GET", "/info"), ("GET", "/v1/models"), ("POST", "/warmup"), ("GET", "/nope")):
            assert c.request(method, path).status_code == 401, path  # nothing about the service without the key
        assert c.get("/v1/models", headers=AUTH).json()["data"][0]["id"] == "tiny-top-k-1"
        assert c.get("/v1/models", headers={"authorization": f"Bearer {NEW_KEY}"}).status_code == 200
        r = c.post("/generate", json={"inputs": "hi", "parameters": {"max_new_tokens": 2}},
                   headers={"authorization": f"bearer {KEY}"})  # the scheme's case does not matter
        assert r.status_code == 200, r.text
    import anthropic  # Anthropic's client sends the key as x-api-key, and gets its refusal in its format
    ac = anthropic.Anthropic(base_url=keyed, api_key=KEY)
    assert ac.messages.create(model="tiny-top-k-1", max_tokens=2, messages=[{"role": "user", "content": "hi"}]).usage
    # --model-aliases: the names Claude Code sends are this model's too; answers name the served model
    m = ac.messages.create(model="claude-haiku-4-5", max_tokens=2, messages=[{"role": "user", "content": "hi"}])
    assert m.model == "tiny-top-k-1"
    models = httpx.get(keyed + "/v1/models", headers=AUTH).json()["data"]
    assert [x["id"] for x in models] == ["tiny-top-k-1", "claude-haiku-4-5", "gpt-x"]
    assert httpx.get(keyed + "/v1/models/gpt-x", headers=AUTH).json()["root"] == "tiny-top-k-1"
    with pytest.raises(anthropic.NotFoundError, match="model-aliases"):
        ac.messages.create(model="claude-opus", max_tokens=2, messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=keyed, api_key="wrong").messages.create(
            model="tiny-top-k-1", max_tokens=2, messages=[{"role": "user", "content": "hi"}])
    from openai import OpenAI  # what OpenAI's client sends

    out = OpenAI(base_url=keyed + "/v1", api_key=KEY).completions.create(model="tiny-top-k-1", prompt="hi", max_tokens=3)
    assert out.usage.completion_tokens == 3


def test_openai_routes_take_what_a_request_leaves_unset_from_the_models_generation_config(keyed):
    """--sampling-defaults model (the default): the model declares top_k 1 and max_new_tokens 5, so an
    OpenAI request that sets no top_k samples greedily at any seed, one that sets it samples as asked,
    and one without max_tokens gets 5; TGI's routes keep TGI's."""
    with httpx.Client(base_url=keyed, timeout=60, headers=AUTH) as c:
        assert c.get("/info").json()["sampling_defaults"] == {"top_k": 1, "max_new_tokens": 5}
        prompt = "Epsilon prompt for the sampling defaults, a few words long. "

        def text(**kw) -> str:
            r = c.post("/v1/completions", json={"prompt": prompt, "max_tokens": 12, **kw})
            assert r.status_code == 200, r.text
            return r.json()["choices"][0]["text"]

        def tgi(**parameters) -> str:
            r = c.post("/generate", json={"inputs": prompt, "parameters": {"max_new_tokens": 12, **parameters}})
            assert r.status_code == 200, r.text
            return r.json()["generated_text"]

        greedy = text(temperature=0)
        assert [text(seed=s) for s in range(3)] == [greedy] * 3
        assert any(text(seed=s, top_k=0) != greedy for s in range(3))
        # its max_new_tokens is the default max_tokens (OpenAI's would be 16 for completions)
        r = c.post("/v1/completions", json={"prompt": prompt, "ignore_eos": True}).json()
        assert r["usage"]["completion_tokens"] == 5
        assert tgi() == greedy  # TGI's default: greedy
        assert any(tgi(do_sample=True, seed=s) != greedy for s in range(3))  # no top_k 1 there


def test_a_priority_server_serves_each_requests_priority(keyed):
    """(The order it sets is the engine's, tested in tests/engine/test_scheduler_priority.py; a first-come
    server's 400 for the same field is in test_http_api.py.)"""
    with httpx.Client(base_url=keyed, timeout=60, headers=AUTH) as c:
        assert c.get("/info").json()["scheduling_policy"] == "priority"
        for path, body in (("/v1/completions", {"prompt": "hi"}),
                           ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "stream": True})):
            for priority in (-3, 0, 7):
                r = c.post(path, json={**body, "max_tokens": 2, "priority": priority})
                assert r.status_code == 200, r.text
                assert r.text.count('"finish_reason":"length"') + r.text.count('"finish_reason": "length"') == 1


# the tiny model writes what a regex holds it to: here a reasoning model's thinking, then its answer
THINKING = r"<think>\nPlan: [a-z]{3,8}\.\n</think>\n\nHello[a-z ]{2,6}\."


def _sse_data(resp) -> list[dict]:
    return [json.loads(line[5:]) for line in resp.iter_lines() if line.startswith("data:") and "[DONE]" not in line]


def test_thinking_is_split_from_the_answer_whole_and_streamed(keyed):
    chat = {"messages": [{"role": "user", "content": "Greet me."}], "max_tokens": 60, "guided_regex": THINKING}
    with httpx.Client(base_url=keyed, timeout=60, headers=AUTH) as c:
        msg = c.post("/v1/chat/completions", json=chat).json()["choices"][0]["message"]
        assert msg["reasoning_content"].startswith("\nPlan: ") and msg["content"].startswith("Hello")
        assert "<think>" not in msg["content"] and "</think>" not in msg["reasoning_content"]
        with c.stream("POST", "/v1/chat/completions", json={**chat, "stream": True}) as s:
            deltas = [e["choices"][0]["delta"] for e in _sse_data(s) if e["choices"]]
        assert "".join(d.get("reasoning_content", "") for d in deltas) == msg["reasoning_content"]
        assert "".join(d.get("content") or "" for d in deltas) == msg["content"]
        assert sum(bool(d.get("reasoning_content")) for d in deltas) > 3  # it streams, as the answer does
        # usage counts the thinking's tokens (OpenAI's completion_tokens_details), streamed or not
        greedy = {**chat, "temperature": 0}
        usage = c.post("/v1/chat/completions", json=greedy).json()["usage"]
        thought = usage["completion_tokens_details"]["reasoning_tokens"]
        assert 0 < thought < usage["completion_tokens"], usage
        with c.stream("POST", "/v1/chat/completions", json={**greedy, "stream": True,
                                                            "stream_options": {"include_usage": True}}) as s:
            assert _sse_data(s)[-1]["usage"]["completion_tokens_details"] == {"reasoning_tokens": thought}
        responses = c.post("/v1/responses", json={"input": "Greet me.", "max_output_tokens": 60, "temperature": 0,
                                                  "guided_regex": THINKING}).json()["usage"]
        assert responses["output_tokens_details"] == {"reasoning_tokens": thought}
        # a prompt whose template closed the thinking block (enable_thinking false) has no thinking
        closed = c.post("/v1/chat/completions", json={**chat, "chat_template_kwargs": {"enable_thinking": False}})
        assert "reasoning_content" not in closed.json()["choices"][0]["message"]
        assert closed.json()["usage"]["completion_tokens_details"] == {"reasoning_tokens": 0}
        assert closed.json()["choices"][0]["message"]["content"].startswith("<think>")
        # an answer that opens no thinking block is all content (a JSON one, say; the guide could wait for
        # a block the model opens, as the next test shows: here it may not)
        plain = c.post("/v1/chat/completions", json={**chat, "guided_regex": "Hi[a-z]{2}",
                                                      "bad_words": ["<think>"]}).json()["choices"][0]
        assert "reasoning_content" not in plain["message"] and plain["message"]["content"].startswith("Hi")
        # a tool call after the thinking is read from the answer, not from the thought
        call = r'<think>\nUse add\.\n</think>\n\n<tool_call>\{"name": "add", "arguments": \{"a": true\}\}</tool_call>'
        tools = {"tools": [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}],
                 "guided_regex": call, "max_tokens": 100}
        msg = c.post("/v1/chat/completions", json={**chat, **tools}).json()["choices"][0]["message"]
        assert msg["reasoning_content"] == "\nUse add.\n" and msg["tool_calls"][0]["function"]["name"] == "add"
        with c.stream("POST", "/v1/chat/completions", json={**chat, **tools, "stream": True}) as s:
            deltas = [e["choices"][0]["delta"] for e in _sse_data(s) if e["choices"]]
        assert "".join(d.get("reasoning_content", "") for d in deltas) == "\nUse add.\n"
        calls = [c for d in deltas for c in d.get("tool_calls", ())]
        assert [c["function"]["name"] for c in calls if "name" in c["function"]] == ["add"]
        with c.stream("POST", "/v1/chat/completions", json={**chat, **tools, "stream": True,
                                                            "stream_options": {"include_usage": True}}) as s:
            usage = _sse_data(s)[-1]["usage"]
        assert 0 < usage["completion_tokens_details"]["reasoning_tokens"] < usage["completion_tokens"]
        assert "".join(c["function"]["arguments"] for c in calls) == '{"a": true}'
        # the Responses API: a reasoning item before the message
        body = {"input": "Greet me.", "max_output_tokens": 60, "guided_regex": THINKING}
        out = c.post("/v1/responses", json=body).json()["output"]
        assert [o["type"] for o in out] == ["reasoning", "message"]
        assert out[0]["content"][0]["text"].startswith("\nPlan: ")
        with c.stream("POST", "/v1/responses", json={**body, "stream": True}) as s:
            events = _sse_data(s)
        thought = "".join(e["delta"] for e in events if e["type"] == "response.reasoning_text.delta")
        (done,) = [e for e in events if e["type"] == "response.reasoning_text.done"]
        assert thought == done["text"] and thought.startswith("\nPlan: ")
        final = events[-1]["response"]["output"]
        assert [o["type"] for o in final] == ["reasoning", "message"] and final[1]["content"][0]["text"].startswith("Hello")


def test_batch_sends_the_key_and_says_at_once_when_it_has_none(keyed, tmp_path, capsys):
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps({"id": i, "prompt": f"line {i}", "max_tokens": 2, "n": i + 1}) + "\n"
                           for i in range(3)))
    out = tmp_path / "out.jsonl"
    t0 = time.monotonic()
    assert cli(["batch", "--input", str(src), "--output", str(out), "--url", keyed, "--wait-s", "30"]) == 2
    assert "needs --api-key" in capsys.readouterr().err
    assert time.monotonic() - t0 < 15  # a refusal is no service still starting: no waiting for it
    assert cli(["batch", "--input", str(src), "--output", str(out), "--url", keyed, "--api-key", "wrong"]) == 2
    assert "refused the API key" in capsys.readouterr().err
    assert cli(["batch", "--input", str(src), "--output", str(out), "--url", keyed, "--api-key", KEY]) == 0
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    assert sorted(r["id"] for r in rows) == [0, 1, 2] and all("error" not in r for r in rows), rows
    by_id = {r["id"]: r for r in rows}
    assert "choices" not in by_id[0] and [len(by_id[i]["choices"]) for i in (1, 2)] == [2, 3]  # n > 1: all of them
    assert [c["index"] for c in by_id[2]["choices"]] == [0, 1, 2] and "index" not in by_id[2]
    assert by_id[2]["choices"][0]["output"] == by_id[2]["output"] and by_id[2]["usage"]["completion_tokens"] == 6


def test_a_guided_answer_thinks_before_its_guide_holds_it(keyed):
    """As vLLM has it: a schema (or a tool call) holds the answer after the thinking, not the thinking."""
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    body = {"messages": [{"role": "user", "content": "Is it?"}], "max_tokens": 40, "logprobs": True,
            "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}}
    with httpx.Client(base_url=keyed, timeout=60, headers=AUTH) as c:
        start, end = c.post("/tokenize", json={"prompt": "<think></think>"}).json()["tokens"][-2:]

        def ask(**kw) -> tuple[dict, list[str]]:
            r = c.post("/v1/chat/completions", json={**body, **kw})
            assert r.status_code == 200, r.text
            choice = r.json()["choices"][0]
            return choice["message"], [t["token"] for t in choice["logprobs"]["content"]]

        # the model may open the thinking (Qwen3's template leaves it to it; its tags are one token each,
        # as this model's are): here it does, and the schema holds what follows the block
        msg, tokens = ask(logit_bias={str(start): 100, str(end): 50}, bad_words=["<think><think>"])
        assert tokens[:2] == ["<think>", "</think>"] and json.loads(msg["content"]) in ({"ok": True}, {"ok": False})
        # not opened: guided from the first token
        msg, tokens = ask(logit_bias={str(start): -100})
        assert tokens[0] == "{" and "ok" in json.loads(msg["content"]) and "reasoning_content" not in msg
        # the template opened it (an assistant prefill here): the guide waits for its end
        prefill = {"messages": [*body["messages"], {"role": "assistant", "content": "<think>"}],
                   "add_generation_prompt": False, "continue_final_message": True}
        msg, tokens = ask(**prefill, logit_bias={str(end): 100})
        assert tokens[0] == "</think>" and "ok" in json.loads(msg["content"])
        # a prefill that thought already and left its block open: the answer thinks on (the prompt's end
        # alone said "tagged": its "</think>" went out as content)
        open_block = {**prefill, "messages": [*body["messages"], {"role": "assistant", "content": "<think>\nplan"}]}
        msg, tokens = ask(**open_block, logit_bias={str(end): 100})
        assert tokens[0] == "</think>" and "ok" in json.loads(msg["content"]), (msg, tokens)
        # a named tool's arguments too; an answer that never ends its thinking makes no call
        tools = {"tools": [{"type": "function", "function": {"name": "f", "parameters": schema}}],
                 "tool_choice": {"type": "function", "function": {"name": "f"}}}
        msg, _ = ask(**prefill, **tools, logit_bias={str(end): 100}, response_format=None)
        assert "ok" in json.loads(msg["tool_calls"][0]["function"]["arguments"])
        msg, _ = ask(**prefill, **tools, logit_bias={str(end): -100}, response_format=None, max_tokens=4)
        assert "tool_calls" not in msg and msg["reasoning_content"]
        # a strict tool under auto guides the calls after the thinking: its free text could write the tags,
        # so it was taken for a guide that holds the thinking too, and the end tag, one added token of this
        # model's, was masked there: the answer could never end its thinking
        strict = {"tools": [{"type": "function", "function": {"name": "f", "parameters": schema, "strict": True}}]}
        msg, tokens = ask(**prefill, **strict, logit_bias={str(end): 100}, response_format=None, max_tokens=8)
        assert tokens[0] == "</think>" and "reasoning_content" not in msg, (msg, tokens)
        msg, tokens = ask(**strict, logit_bias={str(start): 100, str(end): 50}, bad_words=["<think><think>"],
                          response_format=None, max_tokens=8)
        assert tokens[:2] == ["<think>", "</think>"], tokens  # (the model may open it: Qwen3's template)


def test_a_request_past_max_concurrent_requests_gets_429_until_a_place_frees(keyed):
    long = {"model": "tiny-top-k-1", "prompt": "hi", "max_tokens": 1500, "ignore_eos": True, "stream": True}
    with httpx.Client(base_url=keyed, timeout=60, headers=AUTH) as c:
        assert c.get("/info").json()["max_concurrent_requests"] == 2
        with c.stream("POST", "/v1/completions", json=long) as s1, c.stream("POST", "/v1/completions", json=long) as s2:
            assert s1.status_code == 200 and s2.status_code == 200
            lines = [s.iter_lines() for s in (s1, s2)]  # (kept: an iterator let go of closes its stream)
            first = [next(it) for it in lines]  # both are generating
            assert all(x.startswith("data:") for x in first), first
            r = c.post("/generate", json={"inputs": "hi", "parameters": {"max_new_tokens": 2}})
            assert r.status_code == 429 and r.json() == {"error": "Model is overloaded", "error_type": "overloaded"}
            assert r.headers["retry-after"] == "1"
            assert c.post("/tokenize", json={"inputs": "hi"}).status_code == 200  # no generation: not limited
            oai = c.post("/v1/completions", json={"model": "tiny-top-k-1", "prompt": "hi", "max_tokens": 2})
            assert oai.status_code == 429 and oai.json()["error"]["code"] == "overloaded", oai.text
            rest = [line for line in lines[0] if line.startswith("data:")]  # an admitted stream goes on to its end
            assert rest[-1] == "data: [DONE]" and '"finish_reason":"length"' in rest[-2].replace(" ", ""), rest[-2:]
        deadline = time.monotonic() + 30  # s2's client left: its place comes back once Serve ends it
        while (r := c.post("/generate", json={"inputs": "hi", "parameters": {"max_new_tokens": 2}})).status_code == 429:
            assert time.monotonic() < deadline, "the places of finished and abandoned streams never came back"
            time.sleep(0.2)
        assert r.status_code == 200, r.text
        deadline = time.monotonic() + 15  # the ingress's heartbeat brings its count to the metrics hub
        while (refused := _overloaded_total(c.get("/metrics").text)) < 2 and time.monotonic() < deadline:
            time.sleep(0.5)
    assert refused >= 2


def _overloaded_total(text: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == "radixserve_requests_overloaded_total" and s.labels.get("replica") == "all")


def test_batch_sends_no_more_at_once_than_the_services_limit(keyed, tmp_path, capsys):
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("".join(json.dumps({"id": i, "prompt": f"line {i}", "max_tokens": 2}) + "\n" for i in range(6)))
    assert cli(["batch", "--input", str(src), "--output", str(out), "--url", keyed, "--api-key", KEY,
                "--concurrency", "16"]) == 0
    assert "sending 2 at a time, not 16" in capsys.readouterr().err
    assert sorted(json.loads(x)["id"] for x in out.read_text().splitlines()) == list(range(6))
