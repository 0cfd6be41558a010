"""Anthropic's Messages API (``POST /v1/messages``, what Anthropic's SDKs and Claude Code send) as a view of
the chat route, as ``app.responses_api`` is of OpenAI's Responses API: a request becomes a chat request
(``MessagesRequest.chat_body``), and the chat stream's chunks the Messages API's events (``MessageEvents``),
or, unstreamed, the message they add up to."""

from __future__ import annotations

import json
import math
from typing import Any, ClassVar

from pydantic import Field

from app.chat_view import ChatView, ChunkEvents, sse_event
from app.json_prefix import JsonObjectPrefix
from app.schemas import _OFF, MAX_TOOLS, content_text
from engine.sequence import MAX_STOP_STRINGS

REFUSED = {
    "mcp_servers": ("MCP servers", _OFF),
    "container": ("code execution containers", _OFF),
}
# the error types of Anthropic's API, by HTTP status
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 504: "timeout_error",
               529: "overloaded_error"}
BLOCKS_SEP = "\n\n"  # between the text blocks of one turn (Claude Code's system prompt and reminders come as several)
# what stands for a block the model cannot read inside a tool's result (an image a tool opened)
STAND_IN = "[a {kind} block, which this server's model cannot read]"


def error_body(status: int, message: str) -> dict[str, Any]:
    """An error in Anthropic's format."""
    kind = ERROR_TYPES.get(400 if status == 422 else status, "api_error" if status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


def _text(content: Any, where: str, stand_in: str | None = None) -> str:
    """A system prompt's or a tool result's content as text: a string, or text blocks."""
    return content_text(content, where, {"text": "text"}, BLOCKS_SEP, stand_in)


def _chat_messages(messages: list[Any]) -> list[dict[str, Any]]:
    """Anthropic's turns as chat messages: an assistant turn's ``tool_use`` blocks become its tool calls (and
    its ``thinking`` its reasoning_content), a user turn's ``tool_result`` blocks tool messages before its text.
    Consecutive turns of one role are one turn, as Anthropic combines them (a template that wants the roles
    to alternate refused them, and another showed two user turns)."""
    out: list[dict[str, Any]] = []
    used: set[str] = set()  # the tool_use ids so far: a tool_result answers one of them
    # each turn's role, and its texts, calls, tool results and thoughts, merged with the turn before of its role
    turns: list[tuple[str, list[str], list[dict[str, Any]], list[dict[str, Any]], list[str]]] = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        role = m.get("role") if isinstance(m, dict) else None
        if role not in ("user", "assistant"):
            raise ValueError(f"{where}.role must be user or assistant, got {role!r}")
        if not turns or turns[-1][0] != role:
            turns.append((role, [], [], [], []))
        _, texts, calls, results, thoughts = turns[-1]
        content = m.get("content")
        if isinstance(content, str):
            texts.append(content)
            continue
        if not isinstance(content, list):
            raise ValueError(f"{where}.content must be a string or a list of content blocks")
        for j, block in enumerate(content):
            kind = block.get("type") if isinstance(block, dict) else None
            at = f"{where}.content[{j}]"
            if kind == "text":
                if not isinstance(block.get("text"), str):
                    raise ValueError(f"{at}.text must be a string")
                texts.append(block["text"])
            elif kind == "tool_use" and role == "assistant":
                if not isinstance(block.get("id"), str) or not isinstance(block.get("name"), str):
                    raise ValueError(f"{at}: a tool_use block needs an id and a name")
                used.add(block["id"])
                calls.append({"id": block["id"], "type": "function", "function": {
                    "name": block["name"], "arguments": json.dumps(block.get("input") or {})}})
            elif kind == "tool_result" and role == "user":
                if not isinstance(block.get("tool_use_id"), str):
                    raise ValueError(f"{at}: a tool_result block needs a tool_use_id")
                if block["tool_use_id"] not in used:
                    raise ValueError(f"{at}: no tool_use block before it has id {block['tool_use_id']!r}")
                result = _text(block.get("content"), f"{at}.content", STAND_IN)
                results.append({"role": "tool", "tool_call_id": block["tool_use_id"],
                                "content": f"Error: {result}" if block.get("is_error") else result})
            elif kind in ("thinking", "redacted_thinking") and role == "assistant":
                if isinstance(block.get("thinking"), str):  # (a redacted one has nothing to show a template)
                    thoughts.append(block["thinking"])
            else:
                raise ValueError(f"{at}: {kind!r} blocks are not supported by this server in a {role} turn (text, "
                                 "tool_use and thinking in the assistant's, text and tool_result in the user's are)")
    for role, texts, calls, results, thoughts in turns:
        if role == "assistant":
            msg: dict[str, Any] = {"role": "assistant", "content": BLOCKS_SEP.join(texts) if texts or not calls else None}
            if calls:
                msg["tool_calls"] = calls
            if thoughts:
                msg["reasoning_content"] = BLOCKS_SEP.join(thoughts)
            out.append(msg)
        else:
            out += results
            if texts or not results:
                out.append({"role": "user", "content": BLOCKS_SEP.join(texts)})
    return out


class MessagesRequest(ChatView):
    _refused_here: ClassVar[dict[str, tuple[str, tuple]]] = REFUSED

    model: str | None = None
    # (required, as Anthropic's API has it; 0: the prompt goes into the prefix cache, and nothing is generated)
    max_tokens: int = Field(..., ge=0)
    messages: list[Any] = Field(..., min_length=1)
    system: str | list[Any] | None = None
    stop_sequences: list[str] | None = Field(None, max_length=MAX_STOP_STRINGS)
    temperature: float | None = Field(None, ge=0, le=1)
    top_p: float | None = Field(None, gt=0, le=1)
    stream: bool = False
    tools: list[dict[str, Any]] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: dict[str, Any] | None = None
    metadata: dict[str, Any] | None = None
    # taken, not a knob: a model thinks as its template has it (--reasoning-parser splits it out)
    thinking: dict[str, Any] | None = None
    service_tier: str | None = None
    # {"format": {"type": "json_schema", "schema": ...}, "effort": ...}: the format is held to (the effort,
    # like thinking, is taken, not a knob); output_format: the same format, as the older clients send it
    output_config: dict[str, Any] | None = None
    output_format: dict[str, Any] | None = None

    def chat_body(self) -> dict[str, Any]:
        """The chat request this one asks for (validated by ``ChatRequest``)."""
        msgs = _chat_messages(self.messages)
        if self.system:
            msgs.insert(0, {"role": "system", "content": _text(self.system, "system")})
        # (max_tokens is the route's default, cut to the room the context leaves: Claude Code asks for 32,000)
        body: dict[str, Any] = {"messages": msgs, "stream": self.stream, **self.extensions()}
        last = msgs[-1]
        if last["role"] == "assistant" and not last.get("tool_calls") and not last.get("content") \
                and not last.get("reasoning_content") and len(msgs) > 1:
            msgs.pop()  # an empty last turn (Anthropic allows it) is no prefill: carried on, a template that trims
            last = msgs[-1]  # its content lost the newline after the turn's header (Llama 3, Gemma)
        if last["role"] == "assistant" and not last.get("tool_calls"):
            body.update(add_generation_prompt=False, continue_final_message=True)  # a prefill: carried on
        if self.stream:
            body["stream_options"] = {"include_usage": True}
        if self.stop_sequences:
            body["stop"] = self.stop_sequences
        for name in ("temperature", "top_p"):
            if getattr(self, name) is not None:
                body[name] = getattr(self, name)
        if self.tools:
            body["tools"] = [_chat_tool(t, i) for i, t in enumerate(self.tools)]
        if self.tool_choice is not None:
            body.update(_chat_tool_choice(self.tool_choice))
        fmt = (self.output_config or {}).get("format") or self.output_format
        if fmt is not None:
            if not isinstance(fmt, dict) or fmt.get("type") != "json_schema" or not isinstance(fmt.get("schema"), dict):
                raise ValueError("output_config.format must be {\"type\": \"json_schema\", \"schema\": {...}}")
            body["response_format"] = {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt["schema"]}}
        return body


def _chat_tool(tool: dict[str, Any], i: int) -> dict[str, Any]:
    if tool.get("type") not in (None, "custom") or not isinstance(tool.get("name"), str):
        raise ValueError(f"tools[{i}]: only custom tools (name, description, input_schema) are supported by this "
                         f"server, got {tool.get('type')!r}")
    fn = {"name": tool["name"], "parameters": tool.get("input_schema") or {"type": "object"}}
    if tool.get("description") is not None:
        fn["description"] = tool["description"]
    if tool.get("strict") is not None:  # (Anthropic's structured outputs: its input held to the schema)
        fn["strict"] = tool["strict"]
    return {"type": "function", "function": fn}


def _chat_tool_choice(choice: dict[str, Any]) -> dict[str, Any]:
    kind = choice.get("type")
    out: dict[str, Any] = {}
    if kind in ("auto", "none"):
        out["tool_choice"] = kind
    elif kind == "any":
        out["tool_choice"] = "required"
    elif kind == "tool" and isinstance(choice.get("name"), str):
        out["tool_choice"] = {"type": "function", "function": {"name": choice["name"]}}
    else:
        raise ValueError("tool_choice type must be auto, any, none or tool (with a name)")
    if choice.get("disable_parallel_tool_use"):
        out["parallel_tool_calls"] = False
    return out


# ----------------------------------------------------------------------------- answers
def _usage(chat_usage: dict[str, Any] | None) -> dict[str, Any]:
    """Anthropic's usage: its input tokens leave out the ones read from the (prefix) cache."""
    u = chat_usage or {}
    cached = (u.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return {"input_tokens": u.get("prompt_tokens", 0) - cached, "cache_read_input_tokens": cached,
            "cache_creation_input_tokens": 0, "output_tokens": u.get("completion_tokens", 0)}


def _stop(finish: str | None, stop_reason: Any) -> tuple[str, str | None]:
    """Anthropic's stop_reason and stop_sequence of a chat choice's finish and stop reasons."""
    if finish == "length":
        return "max_tokens", None
    if finish == "tool_calls":
        return "tool_use", None
    if isinstance(stop_reason, str):
        return "stop_sequence", stop_reason
    return "end_turn", None


def _finite(text: str) -> float | None:
    """A JSON number as a float; None past a float's range (``1e400``): JSON has no inf to answer with."""
    value = float(text)
    return value if math.isfinite(value) else None


def _loads(text: str) -> Any:
    """JSON as an answer can carry it again: numbers past a float's range, and the NaN and Infinity
    that Python's parser takes, read as null (the answer would fail to render: a 500)."""
    return json.loads(text, parse_float=_finite, parse_constant=lambda _: None)


def _input(arguments: str) -> dict[str, Any]:
    """A tool_use block's input: its arguments' object; of arguments cut short by max_tokens, what they
    hold so far, as Anthropic's SDKs read a stream's ``input_json_delta``s."""
    try:
        value = _loads(arguments)
    except RecursionError:  # (nested past Python's recursion limit)
        return {}
    except ValueError:
        value = _partial_json(arguments)
    return value if isinstance(value, dict) else {}


def _partial_json(text: str) -> Any:
    """JSON cut short as a partial parser reads it: the longest prefix that ends after a whole value, with
    its open objects and arrays closed (an unfinished string or key is left out); None: no such prefix."""
    closers: list[str] = []
    cuts: list[tuple[int, str]] = []  # (a prefix's end, what closes it)
    in_string = escaped = False
    for i, c in enumerate(text):
        if in_string:
            if escaped:
                escaped = False
            elif c == "\\":
                escaped = True
            elif c == '"':
                in_string = False
                cuts.append((i + 1, "".join(reversed(closers))))
            continue
        if c == '"':
            in_string = True
            continue
        if c in "{[":
            closers.append("}" if c == "{" else "]")
        elif c in "}]" and closers:
            closers.pop()
        elif not (c.isdigit() or c in "el") or text[i + 1:i + 2] in tuple("0123456789.eE+-"):
            continue  # (a number, true, false or null may end here; one that goes on does not)
        cuts.append((i + 1, "".join(reversed(closers))))
    for end, close in reversed(cuts[-64:]):  # (a key's end fails, and the value before it is tried)
        try:
            return _loads(text[:end] + close)
        except (ValueError, RecursionError):
            continue
    return None


def message_object(rid: str, model: str, content: list[dict[str, Any]], stop: tuple[str | None, str | None],
                   usage: dict[str, Any]) -> dict[str, Any]:
    return {"id": rid, "type": "message", "role": "assistant", "model": model, "content": content,
            "stop_reason": stop[0], "stop_sequence": stop[1], "usage": usage}


def _cut(stop: tuple[str, str | None], usage: dict[str, Any], asked: int) -> tuple[str, str | None]:
    """An answer stopped short of max_tokens by the room its context left says so."""
    if stop[0] == "max_tokens" and usage["output_tokens"] < asked:
        return "model_context_window_exceeded", None
    return stop


class MessageEvents(ChunkEvents):
    """A chat stream's chunks as the Messages API's events: ``start`` before the first chunk, ``chunk`` for
    each, ``end`` after the last (or ``fail``). Content blocks come one after another, each stopped before
    the next starts."""

    CHAT_FIELDS: ClassVar[dict[str, str]] = {"tools.*.parameters": "tools.*.input_schema", "stop": "stop_sequences"}
    CHAT_TEXT: ClassVar[dict[str, str]] = {"response_format.json_schema.schema": "output_config.format.schema",
                                           "response_format": "output_config.format"}

    PING = 'event: ping\ndata: {"type":"ping"}\n\n'  # (Anthropic's own keep-alive)

    def __init__(self, rid: str, model: str, asked: int, named_tool: bool = False):
        """``named_tool``: tool_choice names the tool; the chat route then ends its call with "stop", as
        OpenAI's does, where Anthropic's says tool_use."""
        self.rid, self.model, self.asked, self.named_tool = rid, model, asked, named_tool
        self.index = -1  # the open block's (-1: none yet)
        self.kind: str | None = None  # its type, while open
        self.calls: dict[int, int] = {}  # the chat delta's tool call index -> block index
        self.stop: tuple[str, str | None] = ("end_turn", None)
        self.content: list[dict[str, Any]] = []  # the blocks so far, as the whole message has them
        # a tool_use block's arguments as they were sent: while what came so far still reads as JSON
        self.arguments: dict[int, list[str]] = {}
        self.readers: dict[int, JsonObjectPrefix] = {}  # (whether they do, per block)
        self.message: dict[str, Any] | None = None

    @staticmethod
    def _event(kind: str, **fields: Any) -> str:
        return sse_event(kind, {"type": kind, **fields})

    def prompt_tokens(self, prompt: int, cached: int) -> None:
        self.usage = self._usage({"prompt_tokens": prompt, "completion_tokens": 0,
                             "prompt_tokens_details": {"cached_tokens": cached}})

    def start(self) -> list[str]:
        # (with the prompt's tokens when they are known: clients that track the context read them here)
        usage = self.usage or _usage(None)
        return [self._event("message_start", message=message_object(self.rid, self.model, [], (None, None), usage))]

    def _open(self, block: dict[str, Any]) -> list[str]:
        out = self._close()
        self.index += 1
        self.kind = block["type"]
        out.append(self._event("content_block_start", index=self.index, content_block=block))
        self.content.append(dict(block))
        return out

    def _close(self) -> list[str]:
        if self.kind is None:
            return []
        self.kind = None
        return [self._event("content_block_stop", index=self.index)]

    _usage = staticmethod(_usage)

    def chunk(self, chunk: dict[str, Any]) -> list[str]:
        out = super().chunk(chunk)
        if self.asked == 0 and self.usage is not None:  # (the one token the engine drew is no answer's)
            self.usage = {**self.usage, "output_tokens": 0}
        return out

    def _delta(self, choice: dict[str, Any], delta: dict[str, Any]) -> list[str]:
        if self.asked == 0:  # a cache warm-up (max_tokens 0): the prompt was the work, no answer is
            self.stop = ("max_tokens", None)
            return []
        out: list[str] = []
        for kind, text, field in (("thinking", delta.get("reasoning_content"), "thinking"),
                                  ("text", delta.get("content"), "text")):
            if not text:
                continue
            if self.kind != kind:
                out += self._open({"type": kind, field: "", **({"signature": ""} if kind == "thinking" else {})})
            out.append(self._event("content_block_delta", index=self.index,
                                   delta={"type": f"{kind}_delta", field: text}))
            self.content[self.index][field] += text
        for call in delta.get("tool_calls") or ():
            k = call.get("index", 0)
            fn = call.get("function") or {}
            if k not in self.calls:
                out += self._open({"type": "tool_use", "id": call["id"],
                                   "name": fn.get("name", ""), "input": {}})
                self.calls[k] = self.index
            at = self.calls[k]
            sent = self.arguments.setdefault(at, [])
            # (whitespace before the object says nothing, and a partial parser reads it as no JSON)
            piece = (fn.get("arguments") or "") if sent else (fn.get("arguments") or "").lstrip()
            if piece and self.readers.setdefault(at, JsonObjectPrefix()).ok:
                # Anthropic's SDKs parse the deltas' sum at each one: a piece past which it is no JSON
                # would raise there, so the block keeps what read and its input is that
                if self.readers[at].feed(piece):
                    out.append(self._event("content_block_delta", index=at,
                                           delta={"type": "input_json_delta", "partial_json": piece}))
                    sent.append(piece)
        if choice.get("finish_reason"):
            self.stop = _stop(choice["finish_reason"], choice.get("stop_reason"))
        return out

    def end(self) -> list[str]:
        out = self._close()
        # (other calls say tool_use only as the chat route's tool_calls: one whose arguments broke off or
        # did not parse ends as the chat's does, so an agent loop does not run it)
        if self.calls and self.named_tool and self.stop[0] == "end_turn":
            self.stop = ("tool_use", None)
        usage = self.usage or _usage(None)
        stop = _cut(self.stop, usage, self.asked)
        out.append(self._event("message_delta", delta={"stop_reason": stop[0], "stop_sequence": stop[1]}, usage=usage))
        out.append(self._event("message_stop"))
        for at, pieces in self.arguments.items():
            self.content[at]["input"] = _input("".join(pieces))
        self.message = message_object(self.rid, self.model, self.content, stop, usage)
        return out

    def final(self) -> dict[str, Any]:
        assert self.message is not None, "final() comes after end()"
        return self.message

    def fail(self, message: str, status: int = 500, code: str | None = None) -> list[str]:
        """The event that ends a stream whose request failed or was refused (``status``: the HTTP status
        it would have had before the stream started, which names its type; an overload is Anthropic's 529)."""
        return [self._event("error", error=error_body(529 if code == "overloaded" else status, message)["error"])]


class MessagesCountRequest(MessagesRequest):
    """``/v1/messages/count_tokens``: a request without max_tokens."""

    max_tokens: int = Field(1, ge=1)
