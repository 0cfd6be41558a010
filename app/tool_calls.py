"""Tool calling for the chat API, as vLLM does it: the model sees the tools through its chat template; a
named or required tool choice holds its answer to the tools' JSON schemas (guided decoding), and with
tool_choice auto the calls are read back out of the text in the Hermes format (``<tool_call>{"name": ...,
"arguments": {...}}</tool_call>``, what Qwen 2.5/3 and Hermes models write). Pure logic: no HTTP here."""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)
ANY_OBJECT = {"type": "object"}


@dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI's API carries it

    def as_openai(self, index: int | None = None) -> dict[str, Any]:
        out = {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
               "function": {"name": self.name, "arguments": self.arguments}}
        return out if index is None else {"index": index, **out}


def named_schema(parameters: dict[str, Any] | None) -> str:
    """The guide of a call to one named function: its arguments, per its parameters' schema."""
    return json.dumps(parameters or ANY_OBJECT)


def required_schema(tools: list[tuple[str, dict[str, Any] | None]], parallel: bool) -> str:
    """The guide of ``tool_choice: required``: a list of calls (one at least; one at most unless
    ``parallel``), each a tool's name with arguments per its parameters' schema. The schemas' own
    definitions (``$defs``, where pydantic puts nested models) move to the root, where their ``$ref``s
    point; two tools defining one name differently cannot share it (``ValueError``)."""
    defs: dict[str, Any] = {}
    calls = []
    for name, params in tools:
        params = dict(params or ANY_OBJECT)
        for key in ("$defs", "definitions"):
            for def_name, schema in (params.pop(key, None) or {}).items():
                if defs.setdefault(def_name, schema) != schema:
                    raise ValueError(f"tools define {def_name!r} differently: tool_choice required cannot hold both")
        calls.append({"type": "object", "additionalProperties": False, "required": ["name", "parameters"],
                      "properties": {"name": {"const": name}, "parameters": params}})
    root = {"type": "array", "minItems": 1, **({} if parallel else {"maxItems": 1}), "items": {"anyOf": calls}}
    if defs:  # (both spellings of the refs find them)
        root["$defs"] = root["definitions"] = defs
    return json.dumps(root)


def parse_required(text: str) -> list[ToolCall] | None:
    """The calls of a ``required`` answer (None: not a complete list of calls, e.g. cut by max_tokens)."""
    try:
        items = json.loads(text)
    except ValueError:
        return None
    if not isinstance(items, list) or not all(isinstance(i, dict) and isinstance(i.get("name"), str) for i in items):
        return None
    return [ToolCall(i["name"], json.dumps(i.get("parameters", {}), ensure_ascii=False)) for i in items]


def parse_hermes(text: str, names: set[str]) -> tuple[str | None, list[ToolCall]]:
    """(the text around them, or None when nothing but calls; the calls) of an answer in which a model
    may have written Hermes-style tool calls. A block that is not a JSON call of a known tool stays text."""
    calls: list[ToolCall] = []
    kept: list[str] = []
    at = 0
    for m in _HERMES.finditer(text):
        call = _hermes_call(m.group(1), names)
        if call is None:
            continue
        kept.append(text[at:m.start()])
        at = m.end()
        calls.append(call)
    if not calls:
        return text, []
    kept.append(text[at:])
    return "".join(kept).strip() or None, calls


def _hermes_call(body: str, names: set[str]) -> ToolCall | None:
    try:
        obj = json.loads(body)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or obj["name"] not in names:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    return ToolCall(obj["name"], args if isinstance(args, str) else json.dumps(args, ensure_ascii=False))


def template_tool_calls(calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A history's tool calls as chat templates read them: arguments as an object where they are JSON
    (templates write them with ``tojson``; a string would come out quoted)."""
    out = []
    for c in calls:
        fn = dict(c["function"])
        if isinstance(fn.get("arguments"), str):
            try:
                fn["arguments"] = json.loads(fn["arguments"])
            except ValueError:
                pass  # not JSON: the template gets the text
        out.append({**c, "function": fn})
    return out
