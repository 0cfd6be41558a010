"""Every endpoint over real HTTP against 2 replicas of the tiny model on a local Ray cluster."""

from __future__ import annotations

import json
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

PROMPT = "The quick brown fox jumps over the lazy dog. " * 3


def sse_events(resp: httpx.Response) -> list:
    out = []
    for line in resp.iter_lines():
        if line.startswith("data:"):
            data = line[5:].strip()
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


def metrics(client) -> dict[tuple[str, str], float]:
    text = client.get("/metrics").text
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, s.labels.get("replica", ""))] = s.value
    return out


def test_health_info_models(client):
    assert client.get("/health").json() == {"status": "ok"}
    info = client.get("/info").json()
    assert info["max_input_tokens"] == 1024 and info["block_size"] == 16 and info["prefix_caching"]
    assert info["model_type"] == "llama"
    models = client.get("/v1/models").json()
    assert models["data"][0]["id"] == "tiny"


def test_generate_and_stream_agree(client):
    body = {"inputs": PROMPT, "parameters": {"max_new_tokens": 12, "details": True}}
    r = client.post("/generate", json=body)
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["details"]["generated_tokens"] == len(out["details"]["tokens"]) <= 12
    assert out["details"]["finish_reason"] in ("length", "eos_token")
    with client.stream("POST", "/generate_stream", json=body) as resp:
        assert resp.status_code == 200
        assert resp.headers["content-type"].startswith("text/event-stream")
        events = sse_events(resp)
    assert all(ev["index"] == i for i, ev in enumerate(events))
    assert events[-1]["generated_text"] == "".join(ev["token"]["text"] for ev in events)
    assert events[-1]["generated_text"] == out["generated_text"]
    assert [ev["token"]["id"] for ev in events] == [t["id"] for t in out["details"]["tokens"]]


def test_openai_client_completions_chat_and_streaming(serve_app):
    openai = pytest.importorskip("openai")
    oc = openai.OpenAI(base_url=serve_app + "/v1", api_key="unused")
    c = oc.completions.create(model="tiny", prompt=PROMPT, max_tokens=8, temperature=0)
    assert c.choices[0].finish_reason in ("length", "stop") and c.usage.completion_tokens <= 8
    streamed = "".join(ch.choices[0].text for ch in oc.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=8, temperature=0, stream=True) if ch.choices)
    assert streamed == c.choices[0].text
    msgs = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Say hi."}]
    chat = oc.chat.completions.create(model="tiny", messages=msgs, max_tokens=6, temperature=0)
    assert chat.choices[0].message.role == "assistant"
    stream = oc.chat.completions.create(model="tiny", messages=msgs, max_tokens=6, temperature=0, stream=True,
                                        stream_options={"include_usage": True})
    chunks = list(stream)
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == chat.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == chat.usage.completion_tokens
    # the first token gets a chunk of its own even if its text is held back: TTFT is visible
    assert chunks[1].choices and chunks[1].choices[0].finish_reason is None


def test_cached_tokens_reported_and_metrics_show_hits(client):
    long_prompt = "A shared system prompt that is long enough to fill several blocks. " * 4
    before = metrics(client).get(("radixserve_prefix_cache_hits_total", "all"), 0.0)
    usages = []
    for _ in range(4):  # two replicas: at least one of them sees the prefix twice
        r = client.post("/v1/completions", json={"model": "tiny", "prompt": long_prompt, "max_tokens": 2,
                                                  "temperature": 0})
        usages.append(r.json()["usage"])
    assert max(u["prompt_tokens_details"]["cached_tokens"] for u in usages) >= 16 * 10
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        m = metrics(client)
        if m.get(("radixserve_prefix_cache_hits_total", "all"), 0.0) > before:
            break
        time.sleep(0.5)
    assert m[("radixserve_prefix_cache_hits_total", "all")] > before
    assert 0 < m[("radixserve_cache_hit_rate", "all")] <= 1
    assert m[("radixserve_cache_blocks_total", "all")] == 2 * 4096 // 16
    assert m[("radixserve_time_to_first_token_seconds_count", "all")] > 0
    replicas = {r for (name, r) in m if name == "radixserve_cache_blocks_total"}
    assert len(replicas - {"all"}) == 2


@pytest.mark.parametrize("path,body,status,needle", [
    ("/generate", {"inputs": ""}, 422, "inputs"),
    ("/generate", {"inputs": "hi", "parameters": {"max_new_tokens": "many"}}, 422, "max_new_tokens"),
    ("/generate", {"inputs": "hi", "parameters": {"temperature": -1}}, 422, "temperature"),
    ("/generate", {"inputs": "hi", "parameters": {"top_p": 2}}, 422, "top_p"),
    ("/generate", {"inputs": "x" * 1500}, 422, "max_input_tokens"),
    ("/generate", {"inputs": "hi", "parameters": {"max_new_tokens": 5000}}, 422, "max_total_tokens"),
    ("/generate_stream", {"inputs": "x" * 1500}, 422, "max_input_tokens"),
    ("/v1/completions", {"model": "tiny", "prompt": ""}, 400, "prompt"),
    ("/v1/completions", {"model": "nope", "prompt": "hi"}, 404, "nope"),
    ("/v1/completions", {"model": "tiny", "prompt": "hi", "n": 2}, 400, "n=1"),
    ("/v1/completions", {"model": "tiny", "prompt": [999999]}, 400, "vocabulary"),
    ("/v1/completions", {"model": "tiny", "prompt": "hi", "temperature": 5}, 400, "temperature"),
    ("/v1/chat/completions", {"model": "tiny", "messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "wizard", "content": "x"}]}, 400, "role"),
    ("/v1/chat/completions", {"model": "tiny", "stream": True, "max_tokens": 5000,
                              "messages": [{"role": "user", "content": "x"}]}, 400, "max_total_tokens"),
    ("/warmup", {"prefixes": []}, 422, "prefixes"),
])
def test_bad_input_gets_4xx_in_the_apis_format(client, path, body, status, needle):
    r = client.post(path, json=body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    msg = err["message"] if isinstance(err, dict) else err
    assert needle in msg
    if path.startswith("/v1/"):
        assert err["type"] == "invalid_request_error"
    else:
        assert r.json()["error_type"] == "validation"


def test_malformed_json_is_a_4xx(client):
    r = client.post("/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and "error" in r.json()
    r = client.post("/generate", content=b"[1,2", headers={"content-type": "application/json"})
    assert r.status_code == 422


def test_warmup_then_hit(client):
    prefix = "Warm this prefix up before anyone asks for it, please. " * 3
    r = client.post("/warmup", json={"prefixes": [prefix]})
    assert r.status_code == 200, r.text
    assert r.json()["cached_tokens"] >= 16 * 9


def test_disconnect_mid_stream_frees_blocks(serve_app, client):
    body = {"inputs": PROMPT, "parameters": {"max_new_tokens": 1500}}
    with httpx.Client(base_url=serve_app, timeout=30) as c, c.stream("POST", "/generate_stream", json=body) as r:
        for n, _ in enumerate(r.iter_lines()):
            if n >= 6:
                break  # leave mid-stream
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        m = metrics(client)
        if m[("radixserve_cache_blocks_in_use", "all")] == 0 and m[("radixserve_running_requests", "all")] == 0:
            break
        time.sleep(0.5)
    assert m[("radixserve_cache_blocks_in_use", "all")] == 0
    assert m[("radixserve_running_requests", "all")] == 0


def test_more_concurrent_streams_than_serve_default_are_all_served_at_once(serve_app):
    # Serve caps a deployment at 5 ongoing requests unless told otherwise: the 6th client would wait
    # for a whole answer before its first token
    import concurrent.futures as cf

    def one(i: int) -> tuple[float, float]:
        body = {"prompt": f"{i} " + PROMPT, "max_tokens": 200, "temperature": 0, "stream": True, "ignore_eos": True}
        t_first = None
        with httpx.stream("POST", serve_app + "/v1/completions", json=body, timeout=120) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if line.startswith("data:") and t_first is None:
                    t_first = time.monotonic()
        return t_first, time.monotonic()

    with cf.ThreadPoolExecutor(8) as ex:
        times = list(ex.map(one, range(8)))
    assert max(first for first, _ in times) < min(done for _, done in times)
