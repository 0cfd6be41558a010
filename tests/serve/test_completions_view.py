"""The completions route without Serve: the ingress's own method over fake engine events and the tiny
model's byte-level tokenizer (byte b is token b), for what only shows with odd prompts: echoed offsets
inside characters, an echo with no text, best_of's usage."""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import re
import threading

import pytest
from pydantic import ValidationError

from app.config import Settings
from app.schemas import ChatRequest, CompletionRequest
from deployments.ingress import Ingress, _anchor_token, _sanitize_option
from engine.model_init import build_tokenizer
from tests.serve.helpers import response_events

Cls = Ingress.func_or_class
TOK = build_tokenizer(320)


class _Ingress(Cls):
    def __del__(self):  # (Serve's wrapper closes an ASGI app that a stand-in never started)
        pass

BOS = TOK.convert_tokens_to_ids("<|bos|>")


def ingress(cached: list[int] | None = None):
    """The route's ingress, whose engine answers "ok" (cut to max_new_tokens) to every choice (choice j of
    a prompt found ``cached[j]`` of its tokens cached; its tokens likelier the later it was drawn)."""
    ing = object.__new__(_Ingress)
    ing._stop, ing.settings, ing.model_name, ing.tokenizer = threading.Event(), Settings(), "m", TOK
    ing.sampling_defaults, ing._tokenizer_thread, ing._max_token_chars = {}, concurrent.futures.ThreadPoolExecutor(1), 20
    ing._info = {"max_total_tokens": 4096, "max_input_tokens": 4000, "vocab_size": 320, "block_size": 16}
    ing._text_cache, ing._bytes_cache, ing._special = {}, {}, frozenset(TOK.all_special_ids)
    ing._byte_level = True
    ing._anchor = _anchor_token(TOK, True)
    ing._sanitize = _sanitize_option(TOK)

    drawn: dict[tuple, int] = {}  # choices started per prompt so far

    async def stream(ids, params, aborts=None, sibling=False):  # (Serve's calls; _choices is the ingress's own)
        j = drawn[tuple(ids)] = drawn.get(tuple(ids), -1) + 1
        events = [{"token_id": t, "text": chr(t), "logprob": -1.0 + j * 0.1, "top_logprobs": [], "text_offset": i,
                   "finished": i == last, "finish_reason": "length" if i == last else None, "stop_reason": None,
                   "num_prompt_tokens": len(ids), "num_cached_tokens": (cached or [0] * (j + 1))[j],
                   "num_output_tokens": i + 1, "replica": "A"}
                  for last in [min(params["max_new_tokens"], 2) - 1] for i, t in enumerate(b"ok"[:last + 1])]
        if params.get("prompt_logprobs") is not None:
            events[0]["prompt_logprobs"] = [None] + [(-2.0, 1, []) for _ in ids[1:]]

        async def rest():
            for ev in events[1:]:
                yield ev
        return events[0], rest()
    ing._stream = ing._stream_alone = stream
    return ing


def complete(ing, body: dict) -> dict:
    return json.loads(asyncio.run(Cls.completions(ing, CompletionRequest.model_validate(body))).body)


def read_stream(response) -> list[dict]:
    return [e for e in response_events(response) if e != "[DONE]"]


def test_an_echoed_token_inside_a_character_starts_where_the_character_does():
    # token-id prompts (no tokenizer offsets) counted each byte of a character as one: "x" pointed at "€",
    # and the prompt's "y" shared its offset with the answer's "o"
    for prompt in (list("éx€y".encode()), "éx€y"):
        choice = complete(ingress(), {"prompt": prompt, "logprobs": 0, "echo": True, "max_tokens": 2})["choices"][0]
        assert choice["text"] == "éx€yok"
        assert choice["logprobs"]["text_offset"] == [0, 0, 1, 2, 2, 2, 3, 4, 5], prompt


def test_an_echo_of_a_prompt_with_no_text_streams_its_tokens_too():
    # ([BOS] alone decodes to ""): the stream left out the echo chunk, and the prompt's log-probs with it
    body = {"prompt": [BOS], "logprobs": 1, "echo": True, "max_tokens": 2}
    whole = complete(ingress(), body)["choices"][0]["logprobs"]["tokens"]
    chunks = read_stream(asyncio.run(Cls.completions(ingress(), CompletionRequest.model_validate({**body, "stream": True}))))
    streamed = [t for c in chunks for ch in c["choices"] if ch["logprobs"] for t in ch["logprobs"]["tokens"]]
    assert streamed == whole == ["<|bos|>", "o", "k"]


def test_best_of_counts_the_cache_its_first_draw_found():
    # the draws after the first find the prompt that one computed: usage took the likeliest draw's count
    body = {"prompt": "a prompt", "best_of": 3, "n": 1, "temperature": 1.0}
    usage = complete(ingress(cached=[0, 7, 7]), body)["usage"]
    assert usage["prompt_tokens_details"]["cached_tokens"] == 0 and usage["completion_tokens"] == 2


def test_max_tokens_zero_answers_the_echoed_prompt_scored_and_nothing_more():
    # OpenAI's legacy scoring (and vLLM's): the engine runs one token for the prompt's log-probs; the
    # answer leaves it out, in its text, its log-probs, its usage and its finish reason
    body = {"prompt": "hi", "max_tokens": 0, "echo": True, "logprobs": 1, "n": 2}
    answer = complete(ingress(), body)
    assert [c["text"] for c in answer["choices"]] == ["hi", "hi"]
    assert {c["finish_reason"] for c in answer["choices"]} == {"length"}
    lp = answer["choices"][0]["logprobs"]
    assert lp["tokens"] == ["h", "i"] and lp["token_logprobs"] == [None, -2.0]  # (the byte tokenizer: no BOS)
    assert answer["usage"]["completion_tokens"] == 0 and answer["usage"]["prompt_tokens"] == 2
    chunks = read_stream(asyncio.run(Cls.completions(ingress(), CompletionRequest.model_validate(
        {**body, "n": 1, "stream": True, "stream_options": {"include_usage": True}}))))
    choices = [ch for c in chunks for ch in c["choices"]]
    assert "".join(ch["text"] for ch in choices) == "hi" and choices[-1]["finish_reason"] == "length"
    assert [t for ch in choices if ch["logprobs"] for t in ch["logprobs"]["tokens"]] == lp["tokens"]
    assert chunks[-1]["usage"]["completion_tokens"] == 0


def test_max_tokens_zero_is_taken_only_to_score_an_echoed_prompt():
    assert CompletionRequest.model_validate({"prompt": "x", "max_tokens": 0, "echo": True}).echo_only()
    assert not CompletionRequest.model_validate({"prompt": "x", "max_tokens": 1, "echo": True}).echo_only()
    for body, says in (({"prompt": "x", "max_tokens": 0}, "only taken with echo"),
                       ({"prompt": "x", "max_tokens": 0, "echo": True, "min_tokens": 1}, "more than max_tokens (0)"),
                       ({"prompt": "x", "max_tokens": -1, "echo": True}, "greater than or equal to 0")):
        with pytest.raises(ValidationError, match=re.escape(says)):
            CompletionRequest.model_validate(body)
    with pytest.raises(ValidationError, match="greater than or equal to 1"):  # (chat has no such use for it)
        ChatRequest.model_validate({"messages": [{"role": "user", "content": "x"}], "max_tokens": 0})


def test_without_max_tokens_a_completion_asks_for_at_most_openais_16():
    # a model whose generation_config says max_new_tokens 2048 made a bare completion run to 2048, where
    # vLLM takes the smaller of that and OpenAI's 16 (a smaller one still wins)
    for model_says, asked in ((2048, 16), (5, 5), (None, 16)):
        ing = ingress()
        ing.sampling_defaults = {} if model_says is None else {"max_new_tokens": model_says}
        seen = []
        stream = ing._stream

        async def spy(ids, params, aborts=None, sibling=False, stream=stream, seen=seen):
            seen.append(params["max_new_tokens"])
            return await stream(ids, params, aborts, sibling)
        ing._stream = ing._stream_alone = spy
        complete(ing, {"prompt": "hi"})
        assert seen == [asked], model_says


def test_without_max_tokens_a_chat_answer_may_fill_the_room_its_context_leaves():
    # chat stopped at 64 tokens (finish "length") unless the client set max_tokens: OpenAI's, vLLM's and
    # TGI's run to the room the context leaves (the model's generation_config max_new_tokens still wins)
    for model_says, room_left in ((300, False), (None, True)):
        ing = ingress()
        ing.sampling_defaults = {} if model_says is None else {"max_new_tokens": model_says}
        seen, counted = [], [0]
        stream = ing._stream

        async def spy(ids, params, aborts=None, sibling=False, stream=stream, seen=seen):
            seen.append(params["max_new_tokens"])
            return await stream(ids, params, aborts, sibling)
        ing._stream = ing._stream_alone = spy
        req = ChatRequest.model_validate({"messages": [{"role": "user", "content": "hi"}]})
        asyncio.run(Cls._chat(ing, req, ing.sampling_defaults.get("max_new_tokens", 10**9), counted))
        asyncio.run(Cls.chat(ing, req))
        assert seen[0] == seen[1] == (ing._info["max_total_tokens"] - counted[0] if room_left else model_says)


def test_under_the_mistral_parser_a_chat_sends_back_the_ids_it_was_given():
    # the check of Mistral's templates (Mistral 7B v0.3, Mistral Small): with --tool-call-parser mistral the
    # second turn of every agent loop, which sends back the call_... id it was given, was a 422
    import copy
    ing = ingress()
    ing.settings.tool_call_parser = "mistral"
    ing.tokenizer = copy.copy(TOK)
    ing.tokenizer.chat_template = (
        "{%- for m in messages %}{%- for tc in m.tool_calls or [] %}{%- if tc.id|length != 9 %}"
        "{{- raise_exception('Tool call IDs should be alphanumeric strings with length 9!') }}{%- endif %}"
        "{%- endfor %}{{ m.role }}: {{ m.content }} {{ m.tool_call_id }}\n{%- endfor %}")
    call = {"id": "call_0a1aa25b59794ddabb6db155", "type": "function", "function": {"name": "add", "arguments": "{}"}}
    req = ChatRequest.model_validate({"messages": [
        {"role": "user", "content": "x"}, {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": call["id"], "content": "42"}]})
    text = TOK.decode(asyncio.run(Cls._chat_ids(ing, req)))
    assert re.search(r"tool: 42 [A-Za-z0-9]{9}$", text), text
    ing.settings.tool_call_parser = "hermes"
    with pytest.raises(Exception, match="length 9"):  # (the template's own check: this test can fail)
        asyncio.run(Cls._chat_ids(ing, req))


def test_tgi_add_special_tokens_and_truncate_as_tgi_reads_them():
    # TGI's add_special_tokens (false: a text already rendered with its BOS) was ignored, /tokenize
    # ignored truncate, and a truncate past max_input_tokens was taken (after tokenizing the whole text)
    import copy

    from tokenizers import processors

    from app.schemas import TGIRequest, TGITokenizeRequest
    from deployments.ingress import ApiError

    ing = ingress()
    ing.tokenizer = copy.deepcopy(TOK)  # (one that adds a BOS, as Llama's)
    ing.tokenizer.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single="<|bos|> $A", special_tokens=[("<|bos|>", BOS)])
    plain = ing.tokenizer("hello", add_special_tokens=False)["input_ids"]
    with_bos = ing.tokenizer("hello")["input_ids"]
    assert with_bos != plain  # (this tokenizer adds a BOS: the test can fail)
    for add, expected in ((True, with_bos), (False, plain)):
        req = TGIRequest.model_validate({"inputs": "hello", "add_special_tokens": add})
        assert asyncio.run(Cls._tgi_ids(ing, req)) == expected
        tok = TGITokenizeRequest.model_validate({"inputs": "hello", "add_special_tokens": add,
                                                 "parameters": {"truncate": 2}})
        assert [t["id"] for t in json.loads(asyncio.run(Cls.tokenize(ing, tok)).body)] == expected[-2:]
    with pytest.raises(ApiError, match="must be strictly positive and less than 4000"):
        asyncio.run(Cls._tgi_ids(ing, TGIRequest.model_validate({"inputs": "x", "parameters": {"truncate": 4001}})))
