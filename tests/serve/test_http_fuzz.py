"""Valid requests of every API, mutated at random (a field dropped, retyped, given an odd value, an unknown
field added), over real HTTP: each gets a 2xx or a 4xx with an error body in time, never a 5xx, a
hang or an error event in a stream, and afterwards every replica is idle with its KV blocks back."""

from __future__ import annotations

import copy
import json
import random
import re
import time

import httpx

from tests.serve.test_http_api import metrics

MODEL = "tiny"
ODD = [None, True, False, 0, -1, 1, 2**63, -2**63, 2**64, 1e308, -1e-9, 0.5, "", "x", "\x00", "é" * 50, "\ufffd",
       [], [None], [1, "a"], {}, {"a": 1}, [[]], [[1, 2]], "null", "NaN", [0, 0, 0], 100_000, 4096, -0.0]
SEEDS = {
    "/generate": {"inputs": "hello there", "parameters": {
        "max_new_tokens": 4, "temperature": 0.7, "top_p": 0.9, "stop": ["x"], "details": True,
        "decoder_input_details": True, "top_n_tokens": 2, "seed": 1, "repetition_penalty": 1.1, "do_sample": True,
        "grammar": {"type": "json", "value": {"type": "object"}}}},
    "/generate_stream": {"inputs": "hello", "parameters": {"max_new_tokens": 4, "details": True, "best_of": 1}},
    "/v1/completions": {"model": MODEL, "prompt": ["hi", "yo"], "max_tokens": 4, "n": 2, "logprobs": 2, "echo": True,
                        "stop": "\n", "temperature": 0.5, "seed": 3, "best_of": 2, "logit_bias": {"5": 1.0},
                        "presence_penalty": 0.5},
    "/v1/chat/completions": {
        "model": MODEL, "max_tokens": 4, "logprobs": True, "top_logprobs": 2, "n": 2,
        "messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": [{"type": "text", "text": "hi"}]}],
        "tools": [{"type": "function", "function": {"name": "f", "parameters": {
            "type": "object", "properties": {"a": {"type": "integer"}}}}}],
        "tool_choice": "auto", "response_format": {"type": "json_object"}},
    "/v1/responses": {"model": MODEL, "input": [{"role": "user", "content": "hi"}], "max_output_tokens": 4,
                      "instructions": "be brief", "text": {"format": {"type": "text"}}},
    "/v1/messages": {"model": MODEL, "max_tokens": 4, "system": "be brief", "stop_sequences": ["x"],
                     "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}], "temperature": 0.5},
    "/v1/messages/count_tokens": {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]},
    "/tokenize": {"model": MODEL, "prompt": "hello", "add_special_tokens": True},
    "/detokenize": {"model": MODEL, "tokens": [1, 2, 3]},
}
STREAMING = ("/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/messages")


def mutated(body: dict, rng: random.Random) -> dict:
    body = copy.deepcopy(body)
    paths: list[list] = []

    def walk(node, path):
        paths.append(path)
        for key, value in node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ():
            walk(value, [*path, key])

    walk(body, [])
    for _ in range(rng.randint(1, 3)):
        path = rng.choice(paths[1:])
        parent = body
        try:
            for key in path[:-1]:
                parent = parent[key]
            roll = rng.random()
            if roll < 0.7:
                parent[path[-1]] = copy.deepcopy(rng.choice(ODD))
            elif isinstance(parent, dict) and roll < 0.85:
                del parent[path[-1]]
            elif isinstance(parent, dict):
                parent[f"zz_{rng.randint(0, 9)}"] = copy.deepcopy(rng.choice(ODD))
        except (KeyError, IndexError, TypeError):  # an earlier mutation took this path away
            pass
    return body


def test_mutated_requests_get_an_answer_or_a_4xx_and_leave_the_replicas_whole(serve_app):
    rng = random.Random(20261204)
    statuses: dict[tuple[str, int], int] = {}
    wrong = []
    with httpx.Client(base_url=serve_app, timeout=60) as c:
        before = metrics(c)
        for _ in range(450):
            path = rng.choice(list(SEEDS))
            body = mutated(SEEDS[path], rng)
            if path in STREAMING and rng.random() < 0.3:
                body["stream"] = True
                if path.startswith("/v1/c") and rng.random() < 0.5:
                    body["stream_options"] = rng.choice([{"include_usage": True, "continuous_usage_stats": True}, {}, 1])
            raw = json.dumps(body)
            try:
                with c.stream("POST", path, content=raw, headers={"content-type": "application/json"}) as r:
                    text = r.read().decode("utf-8", "replace")
            except httpx.TimeoutException:
                wrong.append((path, "timeout", raw))
                continue
            statuses[(path, r.status_code)] = statuses.get((path, r.status_code), 0) + 1
            streamed = "text/event-stream" in r.headers.get("content-type", "")
            if r.status_code >= 500 or (r.status_code >= 400 and "error" not in text) or (
                    streamed and (re.search(r'"error":\s*[{"]', text) or "event: error" in text)):
                wrong.append((path, r.status_code, raw, text[:300]))
        assert not wrong, wrong[:5]
        # (a fuzz that only ever hit the validators would prove little: each API answered some)
        assert all(statuses.get((p, 200)) for p in SEEDS), statuses
        deadline = time.monotonic() + 30
        while True:  # the replicas' gauges reach the hub on their own beat
            now = metrics(c)
            idle = now[("radixserve_running_requests", "all")] == 0 and now[("radixserve_cache_blocks_in_use", "all")] == 0
            if idle or time.monotonic() > deadline:
                break
            time.sleep(1)
    assert idle, {k: v for k, v in now.items() if k[0] in ("radixserve_running_requests", "radixserve_cache_blocks_in_use")}
    assert now[("radixserve_requests_failed_total", "all")] == before[("radixserve_requests_failed_total", "all")]
