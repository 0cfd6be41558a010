"""OpenAI's Responses API (``POST /v1/responses``) as a view of the chat route: a request becomes a chat
request (``ResponsesRequest.chat_body``), and the chat stream's chunks the Responses API's events
(``ResponseEvents``), or, unstreamed, the response object they add up to.
Nothing is stored: ``previous_response_id`` is refused, and a client sends the whole conversation as
``input`` (function calls and their outputs included), as it does with ``store: false``."""

from __future__ import annotations

import json
import uuid
from typing import Any, ClassVar, Literal

from pydantic import Field

from app.chat_view import ChatView, ChunkEvents, sse_event
from app.reasoning import END
from app.schemas import _OFF, MAX_TOOLS, content_text
from app.tool_calls import is_json_object
from engine.sequence import MAX_TOP_LOGPROBS

LOGPROBS_INCLUDE = "message.output_text.logprobs"
# fields that need what this server does not keep or run: refused by name rather than ignored
REFUSED = {
    "previous_response_id": ("stored responses (send the whole conversation as input)", _OFF),
    "conversation": ("stored conversations (send the whole conversation as input)", _OFF),
    "background": ("background responses", _OFF),
    "prompt": ("stored prompt templates", _OFF),
    "max_tool_calls": ("max_tool_calls", _OFF),
}


def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


# the Responses API's text parts, by the field that holds their text (a refusal: an earlier answer, sent back)
TEXT_FIELDS = {"input_text": "text", "output_text": "text", "text": "text", "refusal": "refusal"}


def _part_text(content: Any, where: str) -> str:
    """A message's or a tool output's content (``where``: its location) as text: a string, or a list of text parts."""
    return content_text(content, where, TEXT_FIELDS, "\n")  # (as the chat route joins them)


def _messages(items: list[Any]) -> list[dict[str, Any]]:
    """Input items as chat messages: messages, function calls (an assistant turn's tool_calls) and their
    outputs (tool messages); a reasoning item, which a client sends back as it got it, goes with the assistant
    turn after it (its ``reasoning_content``, which templates such as Qwen3's render)."""
    out: list[dict[str, Any]] = []
    thought = None  # a reasoning item's text, for the assistant turn after it (templates may render it)
    called: set[str] = set()  # the call ids so far: an output answers one of them
    for i, item in enumerate(items):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise ValueError(f"{where} must be an object")
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise ValueError(f"{where}.role must be user, assistant, system or developer, got {role!r}")
            out.append({"role": role, "content": _part_text(item.get("content"), f"{where}.content")})
            if role == "assistant" and thought:
                out[-1]["reasoning_content"] = thought
            thought = None  # (a turn cut after its thinking: that thinking is no later answer's)
        elif kind == "function_call":
            name, args, call_id = item.get("name"), item.get("arguments"), item.get("call_id")
            if not isinstance(name, str) or not isinstance(args, str) or not isinstance(call_id, str):
                raise ValueError(f"{where}: a function_call needs call_id, name and arguments as strings")
            call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": args}}
            called.add(call_id)
            last = out[-1] if out else None
            if last is not None and last["role"] == "assistant" and "tool_call_id" not in last:
                last.setdefault("tool_calls", []).append(call)  # the same turn's text, or its other calls
            else:
                last = {"role": "assistant", "content": None, "tool_calls": [call]}
                out.append(last)
            if thought:  # (a turn may think again before its call: Codex's reasoning, text, reasoning, call)
                last["reasoning_content"] = "\n\n".join(filter(None, (last.get("reasoning_content"), thought)))
            thought = None
        elif kind == "function_call_output":
            if not isinstance(item.get("call_id"), str):
                raise ValueError(f"{where}: a function_call_output needs a call_id")
            if item["call_id"] not in called:
                raise ValueError(f"{where}: no function_call before it has call_id {item['call_id']!r}")
            out.append({"role": "tool", "tool_call_id": item["call_id"],
                        "content": _part_text(item.get("output"), f"{where}.output")})
            thought = None  # (thinking before a call's output is no later answer's)
        elif kind == "reasoning":
            parts = item.get("content") or item.get("summary") or []
            if not isinstance(parts, list) or not all(isinstance(p, dict) and isinstance(p.get("text", ""), str)
                                                      for p in parts):
                raise ValueError(f"{where}: a reasoning item's content and summary must be lists of text parts")
            thought = "".join(p.get("text", "") for p in parts) or None
        else:
            raise ValueError(f"{where}: items of type {kind!r} are not supported by this server (messages, "
                             "function_call and function_call_output are)")
    return out


class ResponsesRequest(ChatView):
    _refused_here: ClassVar[dict[str, tuple[str, tuple]]] = REFUSED

    model: str | None = None
    input: str | list[Any] = Field(..., min_length=1)
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    include: list[str] | None = None
    stream: bool = False
    tools: list[dict[str, Any]] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: dict[str, Any] | None = None
    truncation: Literal["disabled"] | None = None  # "auto" would drop the conversation's start
    # taken and echoed, not a knob: a model thinks as its template has it (--reasoning-parser splits it out)
    reasoning: dict[str, Any] | None = None
    store: bool | None = None  # nothing is stored either way
    metadata: dict[str, str] | None = None
    user: str | None = None
    stop: str | list[str] | None = None  # (an extension too)

    def wants_logprobs(self) -> bool:
        return LOGPROBS_INCLUDE in (self.include or ())  # (top_logprobs only says how many alternatives)

    def chat_body(self) -> dict[str, Any]:
        """The chat request this one asks for (validated by ``ChatRequest``)."""
        msgs = _messages([{"role": "user", "content": self.input}] if isinstance(self.input, str) else self.input)
        if self.instructions and msgs and msgs[0]["role"] in ("system", "developer"):
            msgs[0] = {"role": "system", "content": f"{self.instructions}\n\n{msgs[0]['content']}"}  # one system turn
        elif self.instructions:
            msgs.insert(0, {"role": "system", "content": self.instructions})
        if not msgs:
            raise ValueError("input holds no message")
        body: dict[str, Any] = {"messages": msgs, "stream": self.stream, **self.extensions()}
        if self.stream:
            body["stream_options"] = {"include_usage": True}  # for the final response's usage
        if self.max_output_tokens is not None:
            body["max_tokens"] = self.max_output_tokens
        for name in ("temperature", "top_p", "parallel_tool_calls", "stop"):
            if getattr(self, name) is not None:
                body[name] = getattr(self, name)
        if self.wants_logprobs():
            body["logprobs"], body["top_logprobs"] = True, self.top_logprobs or 0
        if self.tools:
            body["tools"] = [_chat_tool(t, i) for i, t in enumerate(self.tools)]
        if self.tool_choice is not None:
            body["tool_choice"] = _chat_tool_choice(self.tool_choice)
        fmt = (self.text or {}).get("format")
        if fmt is not None:
            body["response_format"] = _chat_format(fmt)
        return body


def _chat_tool(tool: dict[str, Any], i: int) -> dict[str, Any]:
    if tool.get("type") != "function":
        raise ValueError(f"tools[{i}]: only function tools are supported by this server, got {tool.get('type')!r}")
    fn = {k: tool[k] for k in ("name", "description", "parameters", "strict") if tool.get(k) is not None}
    return {"type": "function", "function": fn}


def _chat_tool_choice(choice: str | dict[str, Any]) -> str | dict[str, Any]:
    if isinstance(choice, str):
        return choice
    if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
        raise ValueError("tool_choice must be none, auto, required or {\"type\": \"function\", \"name\": ...}")
    return {"type": "function", "function": {"name": choice["name"]}}


def _chat_format(fmt: Any) -> dict[str, Any]:
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind in ("text", "json_object"):
        return {"type": kind}
    if kind == "json_schema":
        spec = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
        return {"type": "json_schema", "json_schema": spec}
    raise ValueError("text.format type must be text, json_object or json_schema")


# ----------------------------------------------------------------------------- answers
def _usage(chat_usage: dict[str, Any] | None) -> dict[str, Any] | None:
    if not chat_usage:
        return None
    cached = (chat_usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    # (cache_write_tokens: OpenAI's writes for its extended prompt caching, which this server has not; its
    # SDK's type requires the field)
    return {"input_tokens": chat_usage["prompt_tokens"],
            "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": 0},
            "output_tokens": chat_usage["completion_tokens"],
            "output_tokens_details": {"reasoning_tokens": (chat_usage.get("completion_tokens_details") or {}).get(
                "reasoning_tokens", 0)},
            "total_tokens": chat_usage["total_tokens"]}


def response_object(req: ResponsesRequest, rid: str, created: int, model: str, status: str,
                    output: list[dict[str, Any]], usage: dict[str, Any] | None = None,
                    error: dict[str, Any] | None = None) -> dict[str, Any]:
    """A response object: what the request asked for, echoed, and what came of it."""
    return {
        "id": rid, "object": "response", "created_at": created, "status": status, "model": model,
        "error": error,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
        "output": output, "parallel_tool_calls": req.parallel_tool_calls is not False,
        "previous_response_id": None, "store": False,
        "reasoning": {"effort": (req.reasoning or {}).get("effort"), "summary": (req.reasoning or {}).get("summary")},
        "temperature": req.temperature, "top_p": req.top_p, "top_logprobs": req.top_logprobs,
        "text": {"format": {"type": "text"}, **(req.text or {})},
        "tool_choice": req.tool_choice or "auto", "tools": req.tools or [], "truncation": "disabled",
        "usage": usage, "user": req.user, "metadata": req.metadata or {},
    }


def _message_item(text: str, logprobs: list[dict[str, Any]], status: str = "completed") -> dict[str, Any]:
    return {"type": "message", "id": _new_id("msg"), "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs}]}


def _reasoning_item(text: str, status: str = "completed") -> dict[str, Any]:
    return {"type": "reasoning", "id": _new_id("rs"), "status": status, "summary": [],
            "content": [{"type": "reasoning_text", "text": text}]}


def _call_item(call: dict[str, Any], status: str = "completed") -> dict[str, Any]:
    fn = call.get("function") or {}
    return {"type": "function_call", "id": _new_id("fc"), "call_id": call["id"],
            "name": fn.get("name", ""), "arguments": fn.get("arguments", ""), "status": status}


class _AfterThinking:
    """Which of an answer's log-prob entries are its content's: those after the token that completes
    ``</think>`` (an answer with thinking; the chat route gives every token's)."""

    def __init__(self) -> None:
        self.text, self.done = "", False

    def keep(self, entries: list[dict[str, Any]]) -> list[dict[str, Any]]:
        if self.done:
            return entries
        for i, entry in enumerate(entries):
            self.text = (self.text + str(entry.get("token", "")))[-2 * len(END):]
            if END in self.text:
                self.done = True
                return entries[i + 1:]
        return []


class ResponseEvents(ChunkEvents):
    """A chat stream's chunks as the Responses API's events (server-sent, each named by its type and
    numbered): ``start`` before the first chunk, ``chunk`` for each, ``end`` after the last (or ``fail``).
    Items come one after another: each is done before the next is added (text that a model writes after a
    tool call is a message of its own)."""

    CHAT_FIELDS: ClassVar[dict[str, str]] = {"max_tokens": "max_output_tokens", "response_format": "text.format"}
    TOOLS_STRICT_UNLESS_SAID = True  # (OpenAI's Responses API: a function is strict unless it says strict false)
    CHAT_TEXT: ClassVar[dict[str, str]] = {"response_format.json_schema.schema": "text.format.schema",
                                           "response_format": "text.format", "max_tokens": "max_output_tokens"}

    def __init__(self, req: ResponsesRequest, rid: str, created: int, model: str):
        self.req, self.rid, self.created, self.model = req, rid, created, model
        self.seq = 0
        self.output: list[dict[str, Any]] = []
        self.open_at: int | None = None  # output index of the item being written
        self.pieces: list[str] = []  # its text or arguments since the last flush (a dict's string grown by
        # += is copied whole each time: quadratic in a long answer, on the event loop)
        self.calls: dict[int, int] = {}  # the chat delta's tool call index -> output index
        self.finish: str | None = None
        self.stop_string = False  # a stop string ended the answer
        self.thought: _AfterThinking | None = None  # once the answer thinks: its content's log-probs
        # log-probs of tokens whose text has not come yet (a character's first bytes, a stop string in the
        # making, the ending token): they go with the next text, or into the message when it closes
        self.held: list[dict[str, Any]] = []
        self.response: dict[str, Any] | None = None

    def _event(self, kind: str, **fields: Any) -> str:
        self.seq += 1
        return sse_event(kind, {"type": kind, "sequence_number": self.seq - 1, **fields})

    def _flush(self) -> None:
        """Join the open item's pieces into it."""
        if self.open_at is None or not self.pieces:
            return
        item, joined, self.pieces = self.output[self.open_at], "".join(self.pieces), []
        if item["type"] == "function_call":
            item["arguments"] += joined
        else:
            item["content"][0]["text"] += joined

    def _response(self, status: str, error: dict[str, Any] | None = None) -> dict[str, Any]:
        self._flush()
        return response_object(self.req, self.rid, self.created, self.model, status, self.output, self.usage, error)

    def start(self) -> list[str]:
        return [self._event("response.created", response=self._response("in_progress")),
                self._event("response.in_progress", response=self._response("in_progress"))]

    _usage = staticmethod(_usage)

    def _delta(self, choice: dict[str, Any], delta: dict[str, Any]) -> list[str]:
        out: list[str] = []
        logprobs = (choice.get("logprobs") or {}).get("content") or []
        if delta.get("reasoning_content"):
            out += self._text(delta["reasoning_content"], [], "reasoning")
            if self.thought is None:  # (what was held before is the thinking's start: <think>, say)
                self.thought = _AfterThinking()
                logprobs, self.held = self.held + logprobs, []
        if self.thought is not None:
            logprobs = self.thought.keep(logprobs)
        if delta.get("content"):
            out += self._text(delta["content"], self.held + logprobs)
            self.held = []
        elif not delta.get("tool_calls"):
            self.held += logprobs
        for call in delta.get("tool_calls") or ():
            out += self._call(call)
        if choice.get("finish_reason"):
            self.finish, self.stop_string = choice["finish_reason"], isinstance(choice.get("stop_reason"), str)
        return out

    def _open(self, item: dict[str, Any]) -> list[str]:
        out = self._close()  # the item before is done first
        if item["type"] == "function_call":
            self.held = []  # (a tool call's tokens are not a message's text)
        self.open_at = len(self.output)
        self.output.append(item)
        if item["type"] == "function_call":
            out.append(self._event("response.output_item.added", output_index=self.open_at, item=_copy(item)))
            return out
        # a message's or a thought's text part is added by an event of its own, after the item
        out.append(self._event("response.output_item.added", output_index=self.open_at, item=_copy({**item, "content": []})))
        out.append(self._event("response.content_part.added", item_id=item["id"], output_index=self.open_at,
                               content_index=0, part=_copy(item["content"][0])))
        return out

    def _text(self, text: str, logprobs: list[dict[str, Any]], kind: str = "message") -> list[str]:
        """Text of the answer (``message``) or of its thinking (``reasoning``), in the item open for it."""
        out = []
        if self.open_at is None or self.output[self.open_at]["type"] != kind:
            out += self._open(_message_item("", [], "in_progress") if kind == "message"
                              else _reasoning_item("", "in_progress"))
        item = self.output[self.open_at]
        part = item["content"][0]
        self.pieces.append(text)
        if kind == "reasoning":
            out.append(self._event("response.reasoning_text.delta", item_id=item["id"], output_index=self.open_at,
                                   content_index=0, delta=text))
            return out
        part["logprobs"] += logprobs
        out.append(self._event("response.output_text.delta", item_id=item["id"], output_index=self.open_at,
                               content_index=0, delta=text, logprobs=logprobs))
        return out

    def _call(self, call: dict[str, Any]) -> list[str]:
        out = []
        k = call.get("index", 0)
        if k not in self.calls:  # (a call's first delta names it; its arguments may come in later ones)
            out += self._open(_call_item({**call, "function": {**(call.get("function") or {}), "arguments": ""}},
                                         "in_progress"))
            self.calls[k] = self.open_at
        at = self.calls[k]
        item = self.output[at]
        args = (call.get("function") or {}).get("arguments") or ""
        if args:
            if at == self.open_at:
                self.pieces.append(args)
            else:  # (a call already closed: rare, not a stream's shape)
                item["arguments"] += args
            out.append(self._event("response.function_call_arguments.delta", item_id=item["id"], output_index=at,
                                   delta=args))
        return out

    def _close(self, status: str | None = None) -> list[str]:
        if self.open_at is None:
            return []
        self._flush()
        at, self.open_at = self.open_at, None
        item = self.output[at]
        if status is None:  # the next item began: this one is done, a call whole only if its arguments are JSON
            # (a client may run a call as soon as it is done: not one whose arguments broke)
            whole = item["type"] != "function_call" or is_json_object(item["arguments"])
            status = "completed" if whole else "incomplete"
        item["status"] = status
        if item["type"] == "function_call":
            return [self._event("response.function_call_arguments.done", item_id=item["id"], output_index=at,
                                arguments=item["arguments"]),
                    self._event("response.output_item.done", output_index=at, item=_copy(item))]
        part = item["content"][0]
        if item["type"] == "message":
            part["logprobs"] += self.held  # the answer's last tokens without text (its EOS): as unstreamed
            self.held = []
        done = (self._event("response.reasoning_text.done", item_id=item["id"], output_index=at, content_index=0,
                            text=part["text"]) if item["type"] == "reasoning" else
                self._event("response.output_text.done", item_id=item["id"], output_index=at, content_index=0,
                            text=part["text"], logprobs=part["logprobs"]))
        return [done,
                self._event("response.content_part.done", item_id=item["id"], output_index=at, content_index=0,
                            part=_copy(part)),
                self._event("response.output_item.done", output_index=at, item=_copy(item))]

    def end(self) -> list[str]:
        status = "incomplete" if self.finish == "length" else "completed"
        out = []
        if status == "incomplete" and self.open_at is not None and self.output[self.open_at]["type"] == "reasoning":
            out += self._close(status)  # thinking cut by max_output_tokens
        # an answer with no text (only thinking, or nothing) still has its message
        if not any(item["type"] != "reasoning" for item in self.output):
            out += self._open(_message_item("", [], "in_progress"))
        self._flush()
        last = self.output[self.open_at] if self.open_at is not None else None
        # a call the answer ends in is whole when the chat route ends for it, or the answer ends on its own
        # after it (not cut by a stop string in its arguments: an agent loop must not run that) with a named
        # tool's arguments or arguments that are JSON (the chat route ends for no call when another one broke);
        # an earlier call was done, and said so, when the next item began (see _close)
        whole = self.finish == "tool_calls" or (
            self.finish == "stop" and not self.stop_string and last is not None
            and (isinstance(self.req.tool_choice, dict) or is_json_object(last.get("arguments", ""))))
        cut = last is not None and last["type"] == "function_call" and not whole
        out += self._close("incomplete" if cut else status)
        self.response = self._response(status)
        out.append(self._event(f"response.{status}", response=self.response))
        return out

    def final(self) -> dict[str, Any]:
        assert self.response is not None, "final() comes after end()"
        return self.response

    def fail(self, message: str, status: int = 500, code: str | None = None) -> list[str]:
        """The events that end a stream whose request failed or was refused (``status``: the HTTP status it
        would have had before the stream started; ``code``: the error's own, if it has one)."""
        # the response's error takes a code of OpenAI's list (its SDK's type), by status; the error event
        # may say more (``overloaded``, ``engine_failure``)
        listed = "server_error" if status >= 500 else "rate_limit_exceeded" if status == 429 else "invalid_prompt"
        if code == "context_length_exceeded":  # (OpenAI's own, which Codex reads there to compact its history)
            listed = code
        code = code or ("invalid_request_error" if listed == "invalid_prompt" else listed)
        return [self._event("error", code=code, message=message, param=None),
                self._event("response.failed", response=self._response("failed", {"code": listed, "message": message}))]


def _copy(obj: dict[str, Any]) -> dict[str, Any]:
    return json.loads(json.dumps(obj))  # an event shows the item as it was then, not as it grows
