"""The ingress's token texts and streamed log-probs, without Serve (its methods on a stand-in)."""

from __future__ import annotations

import asyncio
import json

from app.config import Settings
from deployments.ingress import Ingress, _anchor_token
from tests.sp_tokenizer import sentencepiece_like

IngressClass = Ingress.func_or_class


class Tokens:
    """What the token-text methods read of the ingress."""

    _token_text = IngressClass._token_text
    _listed_token = IngressClass._listed_token
    _token_bytes = IngressClass._token_bytes
    _oai_logprobs = IngressClass._oai_logprobs
    _alternatives = IngressClass._alternatives
    _openai_stream = IngressClass._openai_stream
    _choices = IngressClass._choices
    model_name = "m"
    settings = Settings()

    def __init__(self, tokenizer, byte_level: bool = False):
        self.tokenizer, self._byte_level = tokenizer, byte_level
        self._anchor = _anchor_token(tokenizer, byte_level)
        self._special = frozenset(tokenizer.all_special_ids)
        self._text_cache, self._bytes_cache = {}, {}


def test_log_prob_token_texts_keep_their_leading_space():
    """Decoded alone, a SentencePiece token lost its space: the listed tokens of " Paris is." joined to
    "Parisis.", against text offsets that counted the spaces."""
    ing = Tokens(sentencepiece_like())
    assert [ing._listed_token(t) for t in (6, 5, 7)] == [" Paris", " is", "."]
    assert ing._token_text(2) == "</s>" and ing._token_bytes(6) == list(b" Paris")


def test_streamed_text_offsets_never_pass_the_text_a_stop_string_cut():
    """A token's offset goes out with the chunk whose text reaches it: sent earlier, tokens whose text a
    stop string later cut pointed past the end ("hello world", stop "lo w": offsets 4 and 5 of "hel")."""
    ing = Tokens(sentencepiece_like())
    texts = ["", "", "", "h", "e", "l", ""]  # the engine holds back 3 characters (the stop string's 4 - 1)
    events = [{"token_id": 10, "text": t, "text_offset": i, "logprob": -1.0, "top_logprobs": [],
               "finished": i == 6, "finish_reason": "stop" if i == 6 else None, "replica": "A"}
              for i, t in enumerate(texts)]

    async def stream(ids, params, aborts=None, sibling=False):
        async def rest():
            for ev in events[1:]:
                yield ev
        return events[0], rest()

    ing._stream = stream

    class Req:
        stream_options = None
        n = 1

    async def go() -> list[dict]:
        resp = await ing._openai_stream([([1], {"logprobs": True})], "id", 0, "text_completion", Req(), [""])
        out = []
        async for part in resp.body_iterator:
            part = part.decode() if isinstance(part, bytes) else part
            if part.startswith("data: {"):
                out.append(json.loads(part[6:])["choices"][0])
        return out

    chunks = asyncio.run(go())
    text = "".join(c["text"] for c in chunks)
    offsets = [o for c in chunks if c["logprobs"] for o in c["logprobs"]["text_offset"]]
    assert text == "hel" and len(offsets) == 7
    assert offsets == sorted(offsets) and max(offsets) <= len(text), offsets
    # each chunk carries the tokens whose text starts in its own text (the last one, the rest)
    sent = 0
    for c in chunks[:-1]:
        mine = c["logprobs"]["text_offset"] if c["logprobs"] else []
        assert all(sent <= o < sent + len(c["text"]) for o in mine), (sent, c)
        sent += len(c["text"])


def test_choices_that_started_end_at_once_when_a_later_one_is_refused():
    """n choices: the first starts alone, the others side by side; when one of those is refused (or its
    replica fails), the ones already started are aborted then, not when the garbage collector finds
    their unread streams (their engines would generate on meanwhile)."""
    from deployments.ingress import ApiError

    ing = Tokens(sentencepiece_like())
    aborted, calls = [], []

    async def stream(ids, params, aborts=None, sibling=False):
        calls.append(params["seed"])
        if params["seed"] == 12:  # the third choice: refused after the fourth has started
            await asyncio.sleep(0.05)
            raise ApiError(422, "refused")
        aborts.append(lambda seed=params["seed"]: aborted.append(seed))

        async def rest():
            yield {"finished": True}
        return {"token_id": 1}, rest()

    ing._stream = stream
    ing._stream_alone = lambda ids, params, aborts, sibling=False: stream(ids, params, aborts, sibling)
    try:
        asyncio.run(ing._choices([([1], {"seed": 10})], 4, stream=True))
        raise AssertionError("the refusal did not reach the caller")
    except ApiError:
        pass
    assert calls[0] == 10 and sorted(calls) == [10, 11, 12, 13]  # the first alone, then the rest
    assert sorted(aborted) == [10, 11, 13]  # every choice that had started


def test_an_answer_holding_a_lone_surrogate_goes_out_escaped_not_as_a_server_error():
    # (the Messages API reads a call's arguments back into its input: a model's "\ud83d" becomes the character)
    from deployments.ingress import _EscapedJSON

    assert json.loads(_EscapedJSON({"input": {"s": "\ud83d"}}).body) == {"input": {"s": "\ud83d"}}
    assert _EscapedJSON({"s": "é"}).body == '{"s":"é"}'.encode()


def test_completions_alternatives_always_name_the_token_itself():
    """OpenAI's completions top_logprobs: the `logprobs` likeliest tokens and the chosen one (up to
    logprobs + 1 entries), a dict even for logprobs 0. They were the alternatives alone (a token less
    likely than them had no entry), and null for logprobs 0."""
    ing = Tokens(sentencepiece_like())
    events = [{"token_id": 6, "logprob": -3.0, "top_logprobs": [(5, -0.5), (7, -1.0)], "text_offset": 0},  # not best
              {"token_id": 5, "logprob": -0.5, "top_logprobs": [(5, -0.5), (7, -1.0)], "text_offset": 6}]
    lp = ing._oai_logprobs(events, False, 2)
    assert lp["top_logprobs"] == [{" is": -0.5, ".": -1.0, " Paris": -3.0}, {" is": -0.5, ".": -1.0}]
    assert ing._oai_logprobs(events, False, 0)["top_logprobs"] == [{" Paris": -3.0}, {" is": -0.5}]
