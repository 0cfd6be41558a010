"""What the routes of other APIs that the chat route answers share (app.responses_api, app.messages_api):
their requests become chat requests, and a chat stream's chunks become their events."""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
from collections.abc import AsyncIterator, Callable
from typing import Any, ClassVar

from pydantic import Field, PrivateAttr, model_validator

from app.schemas import MAX_CACHE_SALT_CHARS, _refuse_named, _Strict

# the chat route's extensions (vLLM's) that the other APIs' requests take as well: checked there
EXTENSIONS = ("seed", "cache_salt", "top_k", "min_p", "repetition_penalty", "ignore_eos", "guided_json",
              "guided_regex", "guided_choice", "guided_grammar", "structured_outputs", "chat_template_kwargs")


class ChatView(_Strict):
    """A request of another API that the chat route answers (app.responses_api, app.messages_api): its own
    fields refused by name, null as "not set" for every field, and checked by making its chat request."""

    _refused_here: ClassVar[dict[str, tuple[str, tuple]]] = {}

    @model_validator(mode="before")
    @classmethod
    def _nulls_unset(cls, data: Any) -> Any:
        _refuse_named(data, cls._refused_here)
        return {k: v for k, v in data.items() if v is not None} if isinstance(data, dict) else data

    _chat: dict[str, Any] = PrivateAttr(default_factory=dict)

    # the extensions (EXTENSIONS), and the scheduling priority
    seed: int | None = None
    cache_salt: str | None = Field(None, min_length=1, max_length=MAX_CACHE_SALT_CHARS)
    priority: int = 0
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    structured_outputs: dict[str, Any] | None = None
    chat_template_kwargs: dict[str, Any] | None = None

    def extensions(self) -> dict[str, Any]:
        """The chat request's fields of the extensions this one sets, and its priority."""
        return {"priority": self.priority, **{k: getattr(self, k) for k in EXTENSIONS if getattr(self, k) is not None}}

    @model_validator(mode="after")
    def _well_formed(self):
        self._chat = self.chat_body()  # (raises for what cannot become a chat request)
        return self

    def chat(self) -> dict[str, Any]:
        """The chat request, as made when this one was checked."""
        return dict(self._chat)

    def chat_body(self) -> dict[str, Any]:
        """The chat request this one asks for (validated by ``ChatRequest``)."""
        raise NotImplementedError


def sse_event(kind: str, data: dict[str, Any]) -> str:
    """A server-sent event named ``kind`` (the Responses and Messages APIs name each of theirs)."""
    return f"event: {kind}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n"


class ChunkEvents:
    """A chat stream's chunks as another API's events: ``start`` before the first chunk, ``chunk`` for each
    (its choice's delta goes to ``_delta``, its usage to ``usage`` through ``_usage``), ``end`` after the last,
    or ``fail``; ``PING`` keeps an idle stream open. ``final`` (after ``end``) is the whole answer as the API
    gives it unstreamed: an answer that is not streamed is made from its chat stream too, so it says what
    the stream says (the blocks after a tool call in their order, the log-probs of the text alone)."""

    usage: dict[str, Any] | None = None  # the answer's, in the API's own terms (``_usage`` of the chat route's)
    PING = ": ping\n\n"  # (an SSE comment: clients skip it)
    _usage: Callable[[dict[str, Any]], dict[str, Any]]

    # a chat request's field -> this API's name for it, where the two differ (its refusals name this API's
    # fields: a client never sent the chat route's ``tools[0].function.parameters``)
    CHAT_FIELDS: ClassVar[dict[str, str]] = {}
    TOOLS_STRICT_UNLESS_SAID: ClassVar[bool] = False  # (a tool's strict left out: ChatRequest.tools_strictness)

    @classmethod
    def own_location(cls, loc: tuple) -> tuple:
        """A chat request field's location (a validation error's ``loc``) in this API's request: a tool's
        ``function`` level goes (these APIs' tools are flat), then the first renamed prefix of the rest."""
        if len(loc) > 2 and loc[0] == "tools" and loc[2] == "function":
            loc = loc[:2] + loc[3:]
        elif len(loc) > 1 and loc[:2] == ("tool_choice", "function"):
            loc = loc[:1] + loc[2:]
        for k in range(len(loc), 0, -1):
            renamed = cls.CHAT_FIELDS.get(".".join("*" if isinstance(x, int) else str(x) for x in loc[:k]))
            if renamed is not None:  # (its "*"s are the location's indexes, in order)
                indexes = iter(x for x in loc[:k] if isinstance(x, int))
                return tuple(next(indexes) if part == "*" else part for part in renamed.split(".")) + loc[k:]
        return loc

    # the chat fields a refusal's own text names (a model validator's: its error has no location), as this
    # API names them
    CHAT_TEXT: ClassVar[dict[str, str]] = {}

    @classmethod
    def own_text(cls, message: str) -> str:
        for chat, own in sorted(cls.CHAT_TEXT.items(), key=lambda kv: -len(kv[0])):  # (longest first)
            message = re.sub(rf"(?<![\w.]){re.escape(chat)}(?!\w)", own, message)
        return message

    def prompt_tokens(self, prompt: int, cached: int) -> None:
        """The prompt's tokens, and the prefix cache's share of them, known before the first chunk (an API
        whose first event says them keeps them)."""

    def _delta(self, choice: dict[str, Any], delta: dict[str, Any]) -> list[str]:
        raise NotImplementedError

    def final(self) -> dict[str, Any]:
        raise NotImplementedError

    def chunk(self, chunk: dict[str, Any]) -> list[str]:
        out: list[str] = []
        if chunk.get("usage"):
            self.usage = self._usage(chunk["usage"])
        for choice in chunk.get("choices") or ():
            out += self._delta(choice, choice.get("delta") or {})
        return out


async def with_pings(items: AsyncIterator[Any], every_s: float | None, ping: Any) -> AsyncIterator[Any]:
    """``items``, with ``ping`` put in whenever none came for ``every_s`` (a long prefill, text held back
    while a tool call may be starting; None: never): proxies that cut idle streams keep them. The pending
    item is awaited on, never cancelled: cancelling it would close ``items`` mid-answer."""
    pending: asyncio.Future | None = None
    try:
        while True:
            if pending is None:
                pending = asyncio.ensure_future(items.__anext__())
            done, _ = await asyncio.wait({pending}, timeout=every_s)
            if not done:
                yield ping
                continue
            try:
                item = pending.result()
            except StopAsyncIteration:
                return
            finally:
                pending = None
            yield item
    finally:
        if pending is not None:  # (the reader left while one was pending)
            pending.cancel()
            with contextlib.suppress(BaseException):
                await pending
