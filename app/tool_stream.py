"""Tool calls read out of a chat answer while it streams (``tool_choice`` auto, or required): its text goes
out as content up to where a call may begin, a call's name as soon as its head is read, and its arguments
as the model writes them (their JSON text as written, which a client joins into the call's arguments), as
OpenAI's stream does. An agent writing a long argument (a file) shows it as it comes, not at the end.

A call in a shape the head rules do not know (its arguments before its name, its arguments as a JSON
string, a tool that does not exist) is held and read whole when it ends, by the parsers of
``app.tool_calls``: for the calls a model writes well-formed, what the stream says is what the whole
answer's parse says. What it cannot take back: a call whose head was read is a call, even if what follows
breaks it (cut by max_tokens: its arguments stay unfinished, and the finish reason says so). An answer that
is not streamed is read by the same rules (``read_answer``), so a client gets the same calls either way.
Pure logic: no HTTP here."""

from __future__ import annotations

import json
import re
from typing import Any

from app.reasoning import partial_tail
from app.tool_calls import (
    HERMES_CLOSE,
    HERMES_OPEN,
    MISTRAL_TAG,
    PARSERS,
    PYTHON_TAG,
    ToolCall,
    is_json_object,
    new_call_id,
    parse_required,
)

# a call object's head, up to where its arguments start: '{"name": "NAME", "arguments": ' (or "parameters")
_OBJECT = r'\{\s*"name"\s*:\s*"(?P<name>(?:[^"\\]|\\.)*)"\s*,\s*"(?:arguments|parameters)"\s*:\s*(?=\S)'
_HEADS = {  # (a region's first call, a later call in the same region)
    "hermes": (re.compile(r"\s*" + _OBJECT), None),
    # (Llama's parse takes any run of ';' and whitespace between calls, none at all too)
    "llama3_json": (re.compile(rf"\s*(?:{re.escape(PYTHON_TAG)})?\s*" + _OBJECT), re.compile(r"[\s;]*" + _OBJECT)),
    "required": (re.compile(r"\s*\[\s*" + _OBJECT), re.compile(r"\s*,\s*" + _OBJECT)),
    # Mistral's newer tokenizers write name[ARGS]{...} after each tag; older ones a list after one tag
    "mistral": (re.compile(r"\s*(?:(?P<named>[A-Za-z0-9_.-]{1,64})\[ARGS\]\s*(?=\S)|\[\s*" + _OBJECT + ")"),
                re.compile(r"\s*,\s*" + _OBJECT)),
}
_OPENERS = {"hermes": HERMES_OPEN, "mistral": MISTRAL_TAG}  # (the others' answers are their calls)
_LIST_END = re.compile(r"\s*\]")
_SPACE = re.compile(r"\s*")


class JsonEnd:
    """Where a JSON object or array ends, read as its text grows (strings and nesting followed). A closer
    of the wrong kind (``{"a": 1]``) ends it too, and marks it ``broken``."""

    _OUTSIDE = re.compile(r'[\[\]{}"]')
    _INSIDE = re.compile(r'["\\]')

    def __init__(self, start: int, depth: int = 0):
        self.at, self.in_string, self.broken = start, False, False
        self.closers = ["}"] * depth  # (what is already open when it starts: the rest of a call's object)
        self.end: int | None = None

    def feed(self, text: str) -> int | None:
        """Where in ``text`` the value ends (just past it), or None while it is open."""
        if self.end is not None:
            return self.end
        at = self.at
        while True:
            m = (self._INSIDE if self.in_string else self._OUTSIDE).search(text, at)
            if m is None:
                self.at = len(text)
                return None
            c, at = m.group(), m.end()
            if c == "\\":
                if at == len(text):  # (what it escapes is not here yet)
                    self.at = m.start()
                    return None
                at += 1
            elif c == '"':
                self.in_string = not self.in_string
            elif c in "{[":
                self.closers.append("}" if c == "{" else "]")
            else:
                self.broken = self.broken or c != self.closers[-1]
                self.closers.pop()
                if not self.closers:
                    self.at = self.end = at
                    return at


class ToolCallStream:
    """One answer's stream: ``feed`` each piece of its content as it comes and ``finish`` at its end; both
    give the OpenAI chat deltas to send (``{"content": ...}`` or ``{"tool_calls": [...]}``). ``parser``:
    one of ``app.tool_calls.PARSERS`` (tool_choice auto), or "required" (the guided list of calls)."""

    def __init__(self, parser: str, names: set[str], id_style: str = ""):
        self.parser, self.names, self.id_style = parser, names, id_style  # (id_style: see new_call_id)
        self.opener = _OPENERS.get(parser)
        self.text = ""
        self.sent = 0  # content is decided up to here (sent, or whitespace dropped around calls)
        self.at = 0  # where the current state reads on
        self.block = 0  # where the call (or held text) being read began
        self.state = "text" if self.opener else "head"
        self.first = True  # the next head is its region's first
        self.in_list = parser == "required"
        self.args: JsonEnd | None = None
        self.args_at = 0  # where the current call's arguments begin
        self.held_object: JsonEnd | None = None  # where a held Hermes block's JSON ends
        self.calls = 0
        self.cut = False  # the last call's arguments never ended
        self.open_at_end = False  # the answer ended where a call may have begun (a tag's start, a call's head)
        self.broken = False  # some call's arguments closed with the wrong bracket: not JSON
        self.first_broken = False  # the first call's were
        self.head_room = 96 + 2 * max((len(n) for n in names), default=0)  # (past it, no head is coming)
        self.pending: list[str] = []  # whitespace not sent yet: it goes out before more text, if any comes
        self.said = False  # whether any content went out
        self.out: list[dict[str, Any]] = []

    def feed(self, piece: str) -> list[dict[str, Any]]:
        text, self.text = self.text, ""  # (its one reference: CPython then grows it in place, not copied per piece)
        text += piece
        self.text = text
        self._advance(final=False)
        return self._take()

    def finish(self) -> list[dict[str, Any]]:
        self._advance(final=True)
        return self._take()

    def finish_reason(self, engine: str, first_only: bool = False) -> str:
        """The choice's finish reason: "tool_calls" when it made calls, but for one cut short. ``first_only``:
        only the first call is sent (parallel_tool_calls false), so only it counts (the others' ends do not:
        a call after it cut short by max_tokens is not sent)."""
        if first_only and self.calls > 1:  # (a later call began: the first one's arguments ended)
            return engine if self.first_broken else "tool_calls"
        if first_only:
            return "tool_calls" if self.calls and not (self.cut or self.broken) else engine
        # max_tokens that cut the answer where another call may have begun cut that call: the calls are
        # not all there, whatever the text held back became
        cut = self.cut or (self.open_at_end and engine == "length")
        return "tool_calls" if self.calls and not (cut or self.broken) else engine

    def _take(self) -> list[dict[str, Any]]:
        out, self.out = self.out, []
        return out

    def _advance(self, final: bool) -> None:
        step = {"text": self._text, "head": self._head, "args": self._args, "tail": self._tail,
                "held": self._held, "done": lambda final: False}
        while step[self.state](final):
            pass

    # the states: each reads on from self.at, and says whether it moved to another state

    def _text(self, final: bool) -> bool:
        if final and self.opener is not None and partial_tail(self.text[self.at:], self.opener):
            self.open_at_end = True  # (it ended in what may have been a call's tag)
        if self.opener is None or final:  # (no more calls can begin: a plain answer, or the end)
            self._content(len(self.text), final)
            return False
        at = self.text.find(self.opener, self.at)
        if at < 0:  # up to where the tag may begin: the part of it that the text ends with waits
            upto = len(self.text) - partial_tail(self.text, self.opener)
            self.at = max(self.at, upto)
            self._content(upto, final)
            return False
        self._content(at, final=False)
        self.sent = self.block = at
        self.at, self.state, self.first = at + len(self.opener), "head", True
        return True

    def _head(self, final: bool) -> bool:
        if self.parser == "hermes" and self.text[self.at:].lstrip()[:1] not in ("", "{"):
            return self._to("text")  # (no JSON object after the tag: no call, the tag is text; sent stays before it)
        first, later = _HEADS[self.parser]
        m = (first if self.first else later).match(self.text, self.at) if (self.first or later) else None
        if m is not None:
            named = m.groupdict().get("named")
            name = named or _json_string(m.group("name"))
            args_at = m.end()
            if name not in self.names or self.text[args_at] != "{":
                return self._to("held")
            self.in_list = self.in_list or (self.parser == "mistral" and named is None)
            self._call_start(name)
            self.args, self.at, self.state, self.args_at = JsonEnd(args_at), args_at, "args", args_at
            return True
        if self.in_list and not self.first and (end := _LIST_END.match(self.text, self.at)):
            self.in_list = False
            self.sent = self.at = end.end()
            return self._to("text" if self.opener else "done")
        rest = self.text[self.at:self.at + self.head_room + 1]
        if self.parser == "llama3_json" and self.first and _plain_answer(rest):
            self.opener = None  # an answer that is no call: all of it is content
            return self._to("text")
        if final and not self.first and self.parser == "llama3_json" and not rest.strip(" \t\n\r;"):
            return self._to("done")  # (separators after the last call)
        if final and self.in_list:
            self.cut = True  # a list of calls the answer never closed: cut short
        if final and ((self.first and self.opener is not None)  # (right after a call's tag: a head was coming)
                      or (not self.first and rest.strip() and _could_be_later_head(rest, self.parser))):
            self.open_at_end = True
        if final or len(rest) > self.head_room or (self.opener == HERMES_OPEN and HERMES_CLOSE in rest) \
                or (not self.first and rest.strip() and not _could_be_later_head(rest, self.parser)):
            return self._to("held")
        return False

    def _args(self, final: bool) -> bool:
        end = self.args.feed(self.text)
        upto = len(self.text) if end is None else end
        if upto > self.at:
            self._call_args(self.text[self.at:upto])
            self.at = upto
        if end is None:
            self.cut = final
            return False
        # (balanced brackets are not JSON yet: NaN, 01, a trailing comma; such a call is no call to run)
        broken = self.args.broken or not is_json_object(self.text[self.args_at:end])
        self.broken = self.broken or broken
        self.first_broken = self.first_broken or (broken and self.calls == 1)
        self.args = JsonEnd(end, depth=1)  # the rest of the call's object (keys after its arguments too)
        self.state = "tail"
        return True

    def _tail(self, final: bool) -> bool:
        """What closes a call after its arguments: Hermes's closing tag; in a list or Llama's calls, the
        object's brace (the next head reads what separates them); Mistral's named calls, nothing."""
        if self.parser == "hermes":
            if self.args is not None:  # (the rest of the object first: a tag in its strings is text)
                end = self.args.feed(self.text)
                if end is None:
                    self.cut = final
                    return False
                self.at, self.args = end, None
            at = _SPACE.match(self.text, self.at).end()
            tag = self.text[at:at + len(HERMES_CLOSE)]
            if tag == HERMES_CLOSE:
                self.sent = self.at = at + len(HERMES_CLOSE)
                return self._to("text")
            if HERMES_CLOSE.startswith(tag):
                if not final:  # (the tag may be coming)
                    return False
                if tag:  # cut inside its closing tag (max_tokens): the call ended, the tag's start is no text
                    self.sent = self.at = at + len(tag)
                    return self._to("text")
            # something else follows the call's object (prose, the next call's tag), as the whole parse
            # reads it: the call ends with its object, and the answer's text goes on from there
            self.sent = self.at
            return self._to("text")
        if self.parser == "mistral" and not self.in_list:
            self.sent = self.at
            return self._to("text")
        end = self.args.feed(self.text)
        if end is None:
            self.cut = final  # (the answer ended inside the call's object)
            return False
        self.at = self.block = end
        self.first = False
        return self._to("head")

    def _held(self, final: bool) -> bool:
        """A call that is read whole: a Hermes block when it closes, the others' calls at the end."""
        end = len(self.text)
        if self.parser == "hermes":
            if (end := self._hermes_end(final)) is None:
                return False
        elif not final:
            return False
        content, calls = _reread(self.text[self.block:end], self.parser, self.names, continued=not self.first)
        if calls and content:  # (a tag before a call in one block: the tag is text)
            if self.text.startswith(content, self.block):
                self.sent = self.block
                self._content(self.block + len(content), final=False)
                self.pending.append(_SPACE.match(self.text, self.block + len(content)).group())
            else:
                self._emit_content(content)
                self.said = True
        for call in calls:
            self._call_start(call.name, call.arguments)
        self.at, self.held_object = end, None
        self.sent = end if calls else self.block
        if not calls and self.parser != "hermes":  # (no call after all: from where it began, the rest is content)
            self.opener = None
        return self._to("done" if calls and self.parser != "hermes" else "text")

    def _hermes_end(self, final: bool) -> int | None:
        """Where a held Hermes block ends: past the first closing tag after its JSON object (one inside the
        object's strings is its text), or after the tag itself where the object never closes, or at the
        answer's end; None while that is not known yet."""
        if self.held_object is None:
            self.held_object = JsonEnd(_SPACE.match(self.text, self.at).end())
        closed = self.held_object.feed(self.text)
        if closed is None and not final:
            return None
        at = self.text.find(HERMES_CLOSE, self.at if closed is None else closed)
        if at >= 0:
            return at + len(HERMES_CLOSE)
        if final:
            self.open_at_end = self.open_at_end or closed is None  # (it ended inside what may have been a call)
            return len(self.text)
        return None

    def _to(self, state: str) -> bool:
        self.state = state
        return True

    # what goes out

    def _content(self, upto: int, final: bool) -> None:
        """Text up to ``upto`` as content. Whitespace waits for text after it: an answer with calls drops
        it at its ends, where the whole parse strips its content."""
        new = self.text[self.sent:upto]
        self.sent = max(self.sent, upto)
        whole = final and not self.calls  # (an answer without calls is its text, as it is)
        body = new if whole else new.rstrip()
        if not body:  # (pieces kept, not joined per piece: a long run of whitespace stays linear)
            self.pending.append(new)
            if not whole:
                return
        body = "".join(self.pending) + body
        self.pending = [] if whole else [new[len(new.rstrip()):]]
        if self.calls and not self.said:
            body = body.lstrip()
        if body:
            self._emit_content(body)
            self.said = True

    def _emit_content(self, text: str) -> None:
        if self.out and "content" in self.out[-1]:
            self.out[-1]["content"] += text
        else:
            self.out.append({"content": text})

    def _call_start(self, name: str, arguments: str = "") -> None:
        self.out.append({"tool_calls": [{"index": self.calls, "id": new_call_id(self.id_style), "type": "function",
                                         "function": {"name": name, "arguments": arguments}}]})
        self.calls += 1

    def _call_args(self, text: str) -> None:
        last = self.out[-1]["tool_calls"][0] if self.out and "tool_calls" in self.out[-1] else None
        if last is not None and last["index"] == self.calls - 1:
            last["function"]["arguments"] += text
        else:
            self.out.append({"tool_calls": [{"index": self.calls - 1, "function": {"arguments": text}}]})


def read_answer(parser: str, text: str, names: set[str], first_only: bool = False, engine: str = ""
                ) -> tuple[str | None, list[ToolCall], bool]:
    """A whole answer read as its stream is (so a client gets the same calls either way): its content
    (None: nothing but calls), its calls (``first_only``: the first alone), and whether they are complete
    (False: the last was cut short, or some call's arguments broke, or ``engine``'s finish reason, length,
    cut the answer where another call may have begun; the finish reason then stays the engine's, as the
    stream's does)."""
    reader = ToolCallStream(parser, names)
    calls: list[ToolCall] = []
    content: list[str] = []
    for delta in reader.feed(text) + reader.finish():
        content.append(delta.get("content", ""))
        for c in delta.get("tool_calls", ()):
            if c["index"] == len(calls):
                calls.append(ToolCall(c["function"]["name"], ""))
            calls[c["index"]].arguments += c["function"]["arguments"]
    if not calls:
        return text, [], True
    complete = reader.finish_reason(engine, first_only) == "tool_calls"
    return "".join(content) or None, calls[:1] if first_only else calls, complete


def _json_string(raw: str) -> str | None:
    try:
        return json.loads(f'"{raw}"')
    except ValueError:
        return None


def _plain_answer(rest: str) -> bool:
    """Whether a Llama 3 answer's start rules out a call (its calls are whole answers)."""
    head = rest.lstrip()
    return bool(head) and not head.startswith(("{", PYTHON_TAG)) and not PYTHON_TAG.startswith(head)


def _could_be_later_head(rest: str, parser: str) -> bool:
    """Whether what follows a call may still be a separator and another call (or a list's end)."""
    head = rest.lstrip()
    return head[0] in {"llama3_json": ";{", "required": ",]", "mistral": ",]"}.get(parser, "")


def _reread(text: str, parser: str, names: set[str], continued: bool) -> tuple[str | None, list[ToolCall]]:
    """A held call's text read whole by the answer's own parser: (the text around its calls; the calls,
    none when it is text). ``continued``: it follows calls of the same list (or Llama's ``;``), whose
    opening it lacks."""
    if continued:  # the separator it starts with stands for the list's opening
        text = {"required": "[", "mistral": "[TOOL_CALLS]["}.get(parser, "") + (
            text.lstrip(" \t\n\r;") if parser == "llama3_json" else text.lstrip()[1:])
    if parser == "required":
        return None, parse_required(text) or []
    return PARSERS[parser](text, names)
