"""Tool calling for the chat API, as vLLM does it: the model sees the tools through its chat template; a
named or required tool choice holds its answer to the tools' JSON schemas (guided decoding), and with
tool_choice auto the calls are read back out of the text in the format the model writes (``PARSERS``):
Hermes (``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``: Qwen 2.5/3, Hermes), Llama 3's JSON
(``{"name": ..., "parameters": {...}}`` as the whole answer, calls separated by ``;``) or Mistral's
(``[TOOL_CALLS][{"name": ..., "arguments": {...}}]``, or ``[TOOL_CALLS]name[ARGS]{...}`` in newer
tokenizers). Pure logic: no HTTP here."""

from __future__ import annotations

import hashlib
import json
import re
import secrets
import string
import urllib.parse
import uuid
from dataclasses import dataclass
from typing import Any

from engine.guided import (
    LENIENT_JSON_STYLE,
    MAX_GUIDE_CHARS,
    format_or_calls_grammar,
    lenient_schema_problem,
    tagged_calls_grammar,
    untagged_calls_grammar,
    walk_schema,
)

HERMES_OPEN, HERMES_CLOSE, MISTRAL_TAG, PYTHON_TAG = "<tool_call>", "</tool_call>", "[TOOL_CALLS]", "<|python_tag|>"
ANY_OBJECT = {"type": "object"}
_DECODER = json.JSONDecoder()


@dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI's API carries it

    def as_openai(self, id_style: str = "") -> dict[str, Any]:
        return {"id": new_call_id(id_style), "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


_ALNUM = string.ascii_letters + string.digits
_MISTRAL_ID = re.compile(r"[A-Za-z0-9]{9}")


def new_call_id(id_style: str = "") -> str:
    """A new call's id; ``id_style``: the server's tool call parser. Mistral's templates refuse any id but
    9 letters and digits (``raise_exception``), so the next turn, which sends the call back, would fail:
    there, ids are made so, as vLLM's mistral parser makes them; elsewhere OpenAI's ``call_...``."""
    if id_style == "mistral":
        return "".join(secrets.choice(_ALNUM) for _ in range(9))
    return f"call_{uuid.uuid4().hex[:24]}"


def template_call_ids(messages: list[dict[str, Any]], id_style: str) -> list[dict[str, Any]]:
    """A chat's messages (as templates read them) with their calls' ids as the model's template takes them:
    under the mistral parser, an id that is not 9 letters and digits (a client's own, another server's
    ``call_...``, an Anthropic ``toolu_...``) becomes 9 made from it, the same for a call and its answer,
    and the same at every turn (the prompt's prefix stays cached)."""
    if id_style != "mistral":
        return messages

    def short(call_id: Any) -> Any:
        if not isinstance(call_id, str) or _MISTRAL_ID.fullmatch(call_id):
            return call_id
        n = int.from_bytes(hashlib.blake2b(call_id.encode(), digest_size=8).digest(), "big")
        return "".join(_ALNUM[(n // len(_ALNUM) ** i) % len(_ALNUM)] for i in range(9))

    out = []
    for m in messages:
        m = dict(m)
        if m.get("tool_calls"):
            m["tool_calls"] = [{**c, "id": short(c.get("id"))} for c in m["tool_calls"]]
        if "tool_call_id" in m:
            m["tool_call_id"] = short(m["tool_call_id"])
        out.append(m)
    return out


def _arguments_schema(parameters: dict[str, Any] | None) -> dict[str, Any]:
    """A function's parameters' schema as its arguments' guide: arguments are a JSON object, also where the
    schema does not say so (``{"properties": ...}`` alone allowed 5 or a list)."""
    params = dict(parameters or ANY_OBJECT)
    params.setdefault("type", "object")
    return params


def can_guide_arguments(parameters: Any) -> bool:
    """Whether a guide can hold a call's arguments to ``parameters``, a function's schema (keywords llguidance
    does not implement let be); False for what is no schema (the request's own check refuses it)."""
    if not isinstance(parameters, (dict, type(None))):
        return False
    try:  # (as the calls' guide holds it: under the root's $defs, its $refs rebased there)
        calls, defs = _call_schemas([("f", parameters)], "arguments")
        return lenient_schema_problem({"anyOf": calls, "$defs": defs}) is None
    except (ValueError, RecursionError):
        return False


def named_schema(parameters: dict[str, Any] | None) -> str:
    """The guide of a call to one named function: its arguments, per its parameters' schema (keywords
    llguidance does not implement let be, as under ``strict_auto_guide``: pydantic's ``set[...]`` writes
    ``uniqueItems``, and such a tool was a 400)."""
    return json.dumps({"x-guidance": LENIENT_JSON_STYLE, **_arguments_schema(parameters)})


def _rebased(schema: Any, base: str) -> Any:
    """``schema`` with its local ``$ref``s (``#``, ``#/properties/..``, ``#/$defs/..``, percent-encoded or
    not) pointing into it from ``base``, a JSON pointer of the whole document (data, a ``const`` that
    holds ``{"$ref": ...}``, and names, a property named ``$ref``, are kept as they are)."""

    def rebase(node: dict[str, Any]) -> dict[str, Any]:
        ref = node.get("$ref")
        if isinstance(ref, str) and (ref == "#" or ref.startswith("#/")):  # ("#/%24defs/C" is "/$defs/C")
            return {**node, "$ref": base + urllib.parse.unquote(ref[1:])}
        return node  # (an anchor's, "#Query", names no place: it is found by its name wherever it is)

    # the schema's own $id would make its place the base of every $ref in it, the rebased ones too
    return walk_schema({k: v for k, v in schema.items() if k != "$id"} if isinstance(schema, dict) else schema, rebase)


def _call_schemas(tools: list[tuple[str, dict[str, Any] | None]], key: str) -> tuple[list[dict], dict[str, Any]]:
    """One schema per tool of a call to it (its name, and under ``key`` its arguments per its parameters'
    schema), and their definitions. Each parameters' schema sits whole in the root's ``$defs``, its own
    definitions with it, and its ``$ref``s rebased there: tools that name their definitions alike do not
    clash, and each is written once."""
    defs: dict[str, Any] = {}
    calls = []
    for i, (name, params) in enumerate(tools):
        params = _arguments_schema(params)
        for k in ("$defs", "definitions"):
            if not isinstance(params.get(k, {}), dict):
                raise ValueError(f"tool {name!r}: parameters.{k} must be an object")
        defs[f"radixserve-tool-{i}"] = _rebased(params, f"#/$defs/radixserve-tool-{i}")
        calls.append({"type": "object", "additionalProperties": False, "required": ["name", key],
                      "properties": {"name": {"const": name}, key: {"$ref": f"#/$defs/radixserve-tool-{i}"}}})
    return calls, defs


def required_schema(tools: list[tuple[str, dict[str, Any] | None]], parallel: bool) -> str:
    """The guide of ``tool_choice: required``: a list of calls (one at least; one at most unless
    ``parallel``), each a tool's name with arguments per its parameters' schema."""
    calls, defs = _call_schemas(tools, "parameters")
    root = {"type": "array", "minItems": 1, **({} if parallel else {"maxItems": 1}), "items": {"anyOf": calls},
            "x-guidance": LENIENT_JSON_STYLE}  # (as ``named_schema``)
    if defs:
        root["$defs"] = defs
    return json.dumps(root)


# the formats whose calls a guide can tell from text under ``auto``: tagged (Hermes) or the whole answer (Llama 3)
GUIDED_AUTO_PARSERS = ("hermes", "llama3_json")


def strict_auto_guide(tools: list[tuple[str, dict[str, Any] | None, bool]], parser: str, parallel: bool = True,
                      tag_ids: tuple[int | None, int | None] = (None, None), text_excludes: tuple[str, ...] = ()
                      ) -> tuple[str, str] | None:
    """The guide of ``tool_choice: auto`` where a tool is ``strict`` (name, parameters, strict): the answer is
    free text, but a call it begins is held to the tools' schemas (a strict tool's arguments to its
    parameters, another's to any object), as OpenAI holds strict tools; so a client that parses a strict
    call's arguments (the OpenAI SDK's ``parse``, pydantic tools) gets what they promise. For the Hermes
    format (calls tagged in running text) and Llama 3's (the answer is calls, or text that does not begin
    with ``{``: ``untagged_calls_grammar``); None for Mistral's, where no tool is strict, or the
    grammar is past ``MAX_GUIDE_CHARS`` (the calls then go unguided, as before). Not ``parallel``
    (``parallel_tool_calls: false``): one call at most. ``tag_ids``: ``<tool_call>`` and ``</tool_call>`` as
    the model's own tokens, where each is one; ``text_excludes``: the thinking tags, with a reasoning parser
    (``tagged_calls_grammar``). ValueError for a strict tool whose schema no guide can hold (keywords
    llguidance does not implement are let be), naming it."""
    if parser not in GUIDED_AUTO_PARSERS or not any(strict for _, _, strict in tools):
        return None
    if parser == "llama3_json":
        grammar = untagged_calls_grammar(_auto_call_schema(tools, "parameters"), parallel, None, text_excludes,
                                         PYTHON_TAG)
    else:
        grammar = tagged_calls_grammar(HERMES_OPEN, HERMES_CLOSE, _auto_call_schema(tools), parallel, tag_ids,
                                       text_excludes)
    return ("grammar", grammar) if len(grammar) <= MAX_GUIDE_CHARS else None


def _no_call_shape(answer_schema: dict) -> dict:
    """A format's schema whose objects no Llama 3 call also fits (a call names its arguments: "parameters"
    or "arguments"), where it is an object's and does not name those keys itself: through a format that
    took any object (``json_object``), a strict tool's call went unchecked."""
    props = answer_schema.get("properties", {})
    if answer_schema.get("type") != "object" or not isinstance(props, dict) or {"parameters", "arguments"} & set(props):
        return answer_schema
    return {**answer_schema, "properties": {**props, "parameters": False, "arguments": False}}


def _auto_call_schema(tools: list[tuple[str, dict[str, Any] | None, bool]], key: str = "arguments") -> dict:
    """A call's schema under ``tool_choice: auto``: a strict tool's arguments (under ``key``, as the format
    names them) held to its parameters, another's to any object. ValueError for a strict tool whose schema
    no guide can hold, naming it."""
    for i, (name, params, strict) in enumerate(tools):
        if strict and (problem := lenient_schema_problem(_arguments_schema(params))):
            raise ValueError(f"tools[{i}] ({name}): its strict parameters cannot be held to under tool_choice auto "
                             f"({problem}): fix the schema, or leave strict off")
    calls, defs = _call_schemas([(name, params if strict else None) for name, params, strict in tools], key)
    return {"anyOf": calls, **({"$defs": defs} if defs else {})}


def format_or_calls_guide(answer_schema: dict, tools: list[tuple[str, dict[str, Any] | None, bool]], parser: str,
                          parallel: bool = True, tag_ids: tuple[int | None, int | None] = (None, None)
                          ) -> tuple[str, str] | None:
    """The guide of ``tool_choice: auto`` beside a response format (``answer_schema``): the answer is that
    format's JSON, or tool calls (``_auto_call_schema``), as OpenAI's structured outputs with tools and
    Anthropic's ``output_config.format`` with tools take it; the format alone held the answer from its first
    token, and no tool could be called (agents that give an output type and tools never got a call). For
    the Hermes and Llama 3 formats (Mistral's calls follow its tag, whose form its tokenizer's version
    decides); None otherwise, or past ``MAX_GUIDE_CHARS``."""
    if parser not in GUIDED_AUTO_PARSERS:
        return None
    if parser == "llama3_json":
        grammar = untagged_calls_grammar(_auto_call_schema(tools, "parameters"), parallel, _no_call_shape(answer_schema))
    else:
        grammar = format_or_calls_grammar(answer_schema, HERMES_OPEN, HERMES_CLOSE, _auto_call_schema(tools),
                                          parallel, tag_ids)
    return ("grammar", grammar) if len(grammar) <= MAX_GUIDE_CHARS else None


def json_text(value: Any) -> str | None:
    """A value's JSON, its characters as they are; escaped where the model wrote a lone surrogate
    (``"\\ud83d"``), which is no Unicode text and would fail the response's encoding. None where it has
    none: a number past a float's range (``1e400`` reads as inf, which JSON cannot say), or nesting past
    Python's recursion limit."""
    try:
        text = json.dumps(value, ensure_ascii=False, allow_nan=False)
    except (ValueError, RecursionError):
        return None
    try:
        text.encode()
    except UnicodeEncodeError:
        return json.dumps(value, allow_nan=False)
    return text


def no_json_constant(name: str):
    """``json.loads``' ``parse_constant``: NaN and Infinity, which Python's parser takes, are no JSON."""
    raise json.JSONDecodeError(f"{name} is not a JSON number", name, 0)


def is_json_object(text: str) -> bool:
    """Whether ``text`` is a JSON object (Python's parser also takes NaN and Infinity, which JSON has not; a
    number past a float's range, ``1e400``, is JSON, kept as written)."""
    try:
        return isinstance(json.loads(text, parse_constant=no_json_constant), dict)
    except (ValueError, RecursionError):
        return False


def parse_required(text: str) -> list[ToolCall] | None:
    """The calls of a ``required`` answer (None: not a complete list of calls, e.g. cut by max_tokens)."""
    try:
        items = json.loads(text)
    except (ValueError, RecursionError):  # (a model can nest brackets past Python's recursion limit)
        return None
    if not isinstance(items, list) or not all(isinstance(i, dict) and isinstance(i.get("name"), str) for i in items):
        return None
    calls = [_call({"name": i["name"], "arguments": i.get("parameters", {})}, None) for i in items]
    return None if None in calls else calls


def parse_hermes(text: str, names: set[str]) -> tuple[str | None, list[ToolCall]]:
    """(the text around them, or None when nothing but calls; the calls) of an answer in which a model
    may have written Hermes-style tool calls: a tag, a JSON call, the closing tag (or the answer's end).
    A block that is not a JSON call of a known tool stays text. The call is read as JSON, so a closing
    tag inside one of its strings (an agent writing this very format) is its text, not its end."""
    calls: list[ToolCall] = []
    kept: list[str] = []
    at = search = 0
    while (start := text.find(HERMES_OPEN, search)) >= 0:
        search = start + len(HERMES_OPEN)
        found = _hermes_block(text, search, names)
        if found is None:
            continue
        call, end = found
        kept.append(text[at:start])
        at = search = end
        calls.append(call)
    if not calls:
        return text, []
    kept.append(text[at:])
    return _around_calls(kept), calls


def _hermes_block(text: str, at: int, names: set[str]) -> tuple[ToolCall, int] | None:
    """The call in a Hermes block whose body starts at ``at``, and where the block ends; None: no call."""
    at = _skip_space(text, at)
    try:
        obj, at = _DECODER.raw_decode(text, at)
    except (ValueError, RecursionError):
        return None
    call, at = _call(obj, names), _skip_space(text, at)
    # the closing tag, or the answer's end, in that tag too (max_tokens cut it: the start of a tag is no text)
    closed = text.startswith(HERMES_CLOSE, at) or (len(text) - at < len(HERMES_CLOSE) and HERMES_CLOSE.startswith(text[at:]))
    if call is None or not closed:
        return None
    return call, min(at + len(HERMES_CLOSE), len(text))


def _skip_space(text: str, at: int, sep: str = "") -> int:
    """Where the first character from ``at`` on that is neither whitespace nor ``sep`` is."""
    while at < len(text) and (text[at].isspace() or (sep and text[at] == sep)):
        at += 1
    return at


def _around_calls(kept: list[str]) -> str | None:
    """An answer's content, of the text it holds around its calls: the whitespace at its ends is the
    calls' (the text's own leading whitespace stays, as a stream sends it before a call may come)."""
    content = "".join(kept).rstrip()
    return (content if kept[0].strip() else content.lstrip()) or None


def _call(obj: Any, names: set[str] | None, name: str | None = None) -> ToolCall | None:
    """A call of a known tool (``names``; None: any) from its JSON (``name`` given apart: Mistral's newer
    format), else None. Its arguments must be an object, or JSON text of one (a client parses them into
    its function's keyword arguments); none at all, or null, are no arguments."""
    if name is not None:
        obj = {"name": name, "arguments": obj}
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or (names is not None and obj["name"] not in names):
        return None
    args = obj.get("arguments", obj.get("parameters"))
    if isinstance(args, str):  # (written as a JSON string: its text, if it holds an object)
        return ToolCall(obj["name"], _encodable(args)) if is_json_object(args) else None
    text = json_text({} if args is None else args) if isinstance(args, (dict, type(None))) else None
    return None if text is None else ToolCall(obj["name"], text)


def _encodable(text: str) -> str:
    """Arguments the model wrote as a JSON string: a lone surrogate in them (``"\\ud83d"`` in its JSON)
    became a character no response can encode (a 500); written back as its escape, it reads the same."""
    try:
        text.encode()
    except UnicodeEncodeError:
        return text.encode("utf-8", "backslashreplace").decode()
    return text


def _json_values(text: str, sep: str = "") -> list[Any] | None:
    """The JSON values ``text`` holds one after another (whitespace and ``sep`` between them), or None
    when any of it is not JSON."""
    values, at = [], 0
    while True:
        at = _skip_space(text, at, sep)
        if at == len(text):
            return values
        try:
            value, at = _DECODER.raw_decode(text, at)
        except (ValueError, RecursionError):
            return None
        values.append(value)


def parse_llama3_json(text: str, names: set[str]) -> tuple[str | None, list[ToolCall]]:
    """Llama 3.x's calls: the whole answer is one JSON call or several separated by ``;`` (after an
    optional ``<|python_tag|>``); anything else is text."""
    body = text.strip().removeprefix(PYTHON_TAG).strip()
    values = _json_values(body, ";") if body.startswith("{") else None
    # (a call names its arguments, as vLLM reads Llama's: an object with a "name" alone is an answer's JSON)
    calls = [_call(v, names) if isinstance(v, dict) and ("parameters" in v or "arguments" in v) else None
             for v in values or ()]
    if not calls or None in calls:
        return text, []
    return None, calls


_MISTRAL_NAMED = re.compile(r"\s*([A-Za-z0-9_.-]{1,64})\[ARGS\]")


def parse_mistral(text: str, names: set[str]) -> tuple[str | None, list[ToolCall]]:
    """Mistral's calls: the text before ``[TOOL_CALLS]`` is content; after it a JSON list of calls, or
    (newer tokenizers) ``name[ARGS]{...}`` per call, each after its own tag. Read JSON-aware: a tag
    inside an argument's string is text."""
    if MISTRAL_TAG not in text:
        return text, []
    content, _, rest = text.partition(MISTRAL_TAG)
    calls: list[ToolCall | None] = []
    at = 0
    while True:
        named = _MISTRAL_NAMED.match(rest, at)
        try:
            value, at = _DECODER.raw_decode(rest, _skip_space(rest, named.end() if named else at))
        except (ValueError, RecursionError):
            return text, []
        if named:
            calls.append(_call(value, names, named.group(1)))
        else:
            calls += [_call(v, names) for v in value] if isinstance(value, list) else [None]
        at = _skip_space(rest, at)
        if at == len(rest):
            break
        if not rest.startswith(MISTRAL_TAG, at):
            return text, []
        at += len(MISTRAL_TAG)
    if not calls or None in calls:
        return text, []
    return _around_calls([content]), calls


PARSERS = {"hermes": parse_hermes, "llama3_json": parse_llama3_json, "mistral": parse_mistral}


def template_tool_calls(calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A history's tool calls as chat templates read them: arguments as an object where they are JSON
    (templates write them with ``tojson``; a string would come out quoted)."""
    out = []
    for c in calls:
        fn = dict(c["function"])
        if isinstance(fn.get("arguments"), str):
            try:
                fn["arguments"] = json.loads(fn["arguments"])
            except (ValueError, RecursionError):
                pass  # not JSON: the template gets the text
        out.append({**c, "function": fn})
    return out
