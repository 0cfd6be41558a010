"""Tool calls read out of a model's text (Hermes format) and out of a required tool choice's JSON, and a
chat history's calls as templates read them."""

from __future__ import annotations

import json
import re

import pytest
from pydantic import ValidationError

from app.messages_api import _input as message_input
from app.schemas import ChatRequest
from app.tool_calls import parse_hermes, parse_required, required_schema, template_tool_calls
from engine.guided import grammar_text

NAMES = {"get_weather", "add"}


def test_hermes_calls_are_read_and_the_text_around_them_kept():
    text = ('Let me check. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
            '<tool_call>{"name": "add", "arguments": "{\\"a\\": 1}"}</tool_call> done')
    content, calls = parse_hermes(text, NAMES)
    assert content == "Let me check.  done"
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Oslo"}), ("add", {"a": 1})]
    # only calls: no content; a last block the model ended before closing still counts
    content, calls = parse_hermes('<tool_call>{"name": "add", "arguments": {"a": 2}}', NAMES)
    assert content is None and calls[0].name == "add"
    # not a call of a known tool, or not JSON: text, as it came
    for text in ('<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>', "<tool_call>{oops</tool_call>", "plain",
                 '<tool_call>{"name": ["add"], "arguments": {}}</tool_call>', "<tool_call>[1]</tool_call>"):
        assert parse_hermes(text, NAMES) == (text, [])


def test_a_required_choices_answer_is_a_list_of_calls():
    calls = parse_required('[{"name": "add", "parameters": {"a": 1, "b": 2}}, {"name": "get_weather", "parameters": {}}]')
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("add", {"a": 1, "b": 2}), ("get_weather", {})]
    assert parse_required('[{"name": "add", "parameters": {"a"') is None  # cut short by max_tokens
    assert parse_required('{"name": "add"}') is None
    # its guide compiles, one call at most without parallel calls
    schema = json.loads(required_schema([("add", {"type": "object"}), ("get_weather", None)], parallel=False))
    assert schema["maxItems"] == 1 and len(schema["items"]["anyOf"]) == 2
    grammar_text("json", json.dumps(schema))
    # tools whose schemas define their parts ($defs, as pydantic writes nested models): refs still resolve
    loc = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}}}
    with_defs = {"type": "object", "properties": {"at": {"$ref": "#/$defs/Loc"}}, "$defs": {"Loc": loc}}
    grammar_text("json", required_schema([("get_weather", with_defs), ("add", with_defs)], parallel=True))
    # a keyword llguidance does not implement (pydantic's set[...]) is let be, as under auto with strict tools
    # (a named or required tool with one was a 400)
    from app.tool_calls import named_schema

    tags = {"type": "object", "properties": {"tags": {"type": "array", "items": {"type": "string"}, "uniqueItems": True}}}
    grammar_text("json", required_schema([("tag", tags)], parallel=True))
    grammar_text("json", named_schema(tags))


def test_history_calls_reach_the_template_with_object_arguments():
    calls = template_tool_calls([{"id": "1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1}'}},
                                 {"id": "2", "type": "function", "function": {"name": "add", "arguments": "not json"}}])
    assert calls[0]["function"]["arguments"] == {"a": 1} and calls[1]["function"]["arguments"] == "not json"


TOOLS = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]


@pytest.mark.parametrize("body,needle", [
    ({"tool_choice": "required"}, "needs tools"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "sub"}}}, "not one of the tools"),
    ({"tools": TOOLS, "tool_choice": "required", "guided_regex": "a+"}, "one structured output"),
    ({"tools": [{"type": "function", "function": {"name": "has space"}}]}, "name"),
    ({"messages": [{"role": "assistant", "function_call": {"name": "add", "arguments": "{}"}}]}, "function_call"),
    ({"messages": [{"role": "tool", "tool_call_id": "1"}]}, "needs content"),
    ({"messages": [{"role": "user", "content": "x"}, {"role": "tool", "content": "sunny"}]}, "no assistant message"),
    ({"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "tool_calls": [
        {"id": "c1", "function": {"name": "add", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c2", "content": "3"}]}, "'c2' is not the id of a tool call"),
    ({"messages": [{"role": "user", "content": "x", "tool_calls": [
        {"type": "function", "function": {"name": "add", "arguments": "{}"}}]}]}, "only assistant"),
])
def test_bad_tool_requests_are_refused(body, needle):
    with pytest.raises(ValidationError, match=needle):
        ChatRequest.model_validate({"messages": [{"role": "user", "content": "x"}], **body})


def test_a_response_format_beside_a_tool_choice_that_must_call_gives_way_to_the_calls():
    """A turn that must call a tool has no text answer for a format to hold: refused before, though OpenAI
    takes both, and its Agents SDK sends an output type with tool_choice required."""
    for choice in ("required", {"type": "function", "function": {"name": "add"}}):
        req = ChatRequest.model_validate({"messages": [{"role": "user", "content": "x"}], "tools": TOOLS,
                                          "tool_choice": choice, "response_format": {"type": "json_object"}})
        kind, schema = req.guide()
        assert kind == "json" and schema != '{"type": "object"}', schema  # the calls' guide, not the format's
        assert "add" in schema or choice != "required"


def test_tool_results_answer_the_calls_before_them():
    call = {"role": "assistant", "tool_calls": [{"id": "c1", "function": {"name": "add", "arguments": "{}"}}]}
    later = {"role": "assistant", "tool_calls": [{"id": "c2", "function": {"name": "add", "arguments": "{}"}}]}
    no_id = {"role": "assistant", "tool_calls": [{"function": {"name": "add", "arguments": "{}"}}]}
    for messages in ([call, {"role": "tool", "tool_call_id": "c1", "content": "3"}],
                     [call, {"role": "tool", "content": "3"}],  # ids are optional (templates without them)
                     [no_id, {"role": "tool", "tool_call_id": "anything", "content": "3"}],
                     [call, {"role": "tool", "tool_call_id": "c1", "content": "3"}, later,
                      {"role": "tool", "tool_call_id": "c1", "content": "3 again"}]):
        ChatRequest.model_validate({"messages": [{"role": "user", "content": "x"}, *messages]})


def test_tool_modes():
    def mode(**kw):
        return ChatRequest.model_validate({"messages": [{"role": "user", "content": "x"}], **kw}).tool_mode()
    assert mode() == "none" and mode(tools=TOOLS) == "auto" and mode(tools=TOOLS, tool_choice="none") == "none"
    assert mode(tools=TOOLS, tool_choice="required") == "required"
    assert mode(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "add"}}) == "named"


def test_llama3_json_calls():
    from app.tool_calls import parse_llama3_json

    content, calls = parse_llama3_json('<|python_tag|>{"name": "add", "parameters": {"a": 1}}; '
                                       '{"name": "get_weather", "parameters": {"city": "Lima"}}', NAMES)
    assert content is None and [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("add", {"a": 1}), ("get_weather", {"city": "Lima"})]
    for text in ('The answer is {"name": "add"}', '{"name": "add", "parameters": {}} and more',
                 '{"name": "rm", "parameters": {}}', '{"name": "add", "parameters": {"a": '):
        assert parse_llama3_json(text, NAMES) == (text, [])


def test_mistral_calls_old_and_new_format():
    from app.tool_calls import parse_mistral

    content, calls = parse_mistral('Sure. [TOOL_CALLS][{"name": "add", "arguments": {"a": 2}}, '
                                   '{"name": "get_weather", "arguments": {}}]', NAMES)
    assert content == "Sure." and [c.name for c in calls] == ["add", "get_weather"]
    content, calls = parse_mistral('[TOOL_CALLS]add[ARGS]{"a": 3}[TOOL_CALLS]get_weather[ARGS]{"city": "Oslo"}', NAMES)
    assert content is None and [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("add", {"a": 3}), ("get_weather", {"city": "Oslo"})]
    # a tag inside an argument's string is text, in either format
    content, calls = parse_mistral('[TOOL_CALLS]add[ARGS]{"note": "[TOOL_CALLS]x[ARGS]"} [TOOL_CALLS][{"name": '
                                   '"add", "arguments": {"s": "]"}}]', NAMES)
    assert [json.loads(c.arguments) for c in calls] == [{"note": "[TOOL_CALLS]x[ARGS]"}, {"s": "]"}]
    for text in ("no calls", '[TOOL_CALLS][{"name": "rm", "arguments": {}}]', "[TOOL_CALLS]add[ARGS]{oops",
                 '[TOOL_CALLS]add[ARGS]{"a": 1} trailing', "[TOOL_CALLS]add[ARGS]{}[TOOL_CALLS]", "[TOOL_CALLS][]"):
        assert parse_mistral(text, NAMES) == (text, [])


@pytest.mark.parametrize("parser,text,sent", [
    ("hermes", "Let me see", "Let me see"), ("hermes", "Let me see <tool", "Let me see"), ("hermes", "ok <tool_call>{", "ok"),
    ("hermes", "a <tool_cal", "a"), ("mistral", "Sure [TOOL_", "Sure"), ("mistral", "[TOOL_CALLS][", ""),
    ("llama3_json", "Hello there", "Hello there"), ("llama3_json", ' {"name"', ""), ("llama3_json", "<|pyth", ""),
    ("llama3_json", "", "")])
def test_what_streams_before_a_call_could_begin(parser, text, sent):
    from app.tool_stream import ToolCallStream

    assert "".join(d["content"] for d in ToolCallStream(parser, NAMES).feed(text)) == sent


def test_what_a_model_or_client_could_send_never_raises():
    from app.tool_calls import parse_llama3_json, parse_mistral

    deep = "[" * 5000  # past Python's recursion limit in json
    assert parse_hermes("<tool_call>" + deep, NAMES) == ("<tool_call>" + deep, [])
    assert parse_llama3_json("{" + '"a":' + deep, NAMES)[1] == []
    assert parse_mistral("[TOOL_CALLS]" + deep, NAMES)[1] == []
    assert parse_required(deep) is None
    assert template_tool_calls([{"function": {"name": "add", "arguments": deep}}])[0]["function"]["arguments"] == deep
    with pytest.raises(ValueError, match="must be an object"):
        required_schema([("add", {"type": "object", "$defs": [1]})], parallel=True)
    # JSON that decodes but does not encode again (nesting just under the decoder's limit, on Python 3.11)
    # is no call; where this Python encodes it too (3.12, seen on a GPU machine), it is a call of it
    nested = "[" * 991 + "]" * 991
    calls = parse_hermes('<tool_call>{"name": "add", "arguments": {"a": ' + nested + "}}</tool_call>", NAMES)[1]
    try:
        json.dumps({"a": json.loads(nested)})
    except RecursionError:
        assert calls == []
    else:
        assert [c.name for c in calls] == ["add"] and json.loads(calls[0].arguments) == {"a": json.loads(nested)}
    # arguments cut short: what they hold so far, or nothing where the parser's recursion limit is past
    deep_input = '{"a": ' * 2000
    try:
        json.loads(deep_input)
    except RecursionError:
        assert message_input(deep_input) == {}
    except ValueError:  # (Python 3.12 parses this deep: the input is the nested objects so far)
        assert isinstance(message_input(deep_input)["a"]["a"], dict)


def test_arguments_that_are_not_an_object_make_no_call():
    """A client parses a call's arguments into its function's keyword arguments: a string that is not JSON,
    a list or a number reached it as they were (``"not json"``), and ``1e400`` as ``Infinity``, no JSON."""
    from app.tool_calls import parse_mistral

    for args in ('"not json"', "[1, 2]", "3", '"[1]"', "{\"a\": 1e400}"):
        text = f'<tool_call>{{"name": "add", "arguments": {args}}}</tool_call>'
        assert parse_hermes(text, NAMES) == (text, []), args
    assert parse_mistral('[TOOL_CALLS]add[ARGS]"x"', NAMES)[1] == []
    # no arguments, or null: none; an object written as a JSON string: its text as written
    for args, expected in (("null", "{}"), ('"{\\"a\\": 1}"', '{"a": 1}')):
        _, calls = parse_hermes(f'<tool_call>{{"name": "add", "arguments": {args}}}</tool_call>', NAMES)
        assert [c.arguments for c in calls] == [expected], args
    assert [c.arguments for c in parse_hermes('<tool_call>{"name": "add"}</tool_call>', NAMES)[1]] == ["{}"]


def test_a_lone_surrogate_a_model_escapes_in_its_arguments_stays_escaped():
    from app.tool_calls import parse_mistral

    for text in ('<tool_call>{"name": "add", "arguments": {"s": "\\ud83d"}}</tool_call>',
                 '[TOOL_CALLS]add[ARGS]{"s": "\\ud83d"}',
                 # arguments written as a JSON string (whose JSON escapes the escape): they were kept as
                 # decoded, the character itself, and the unstreamed answer was a 500
                 '<tool_call>{"name": "add", "arguments": "{\\"s\\": \\"\\ud83d\\"}"}</tool_call>'):
        parse = parse_hermes if text.startswith("<") else parse_mistral
        arguments = parse(text, NAMES)[1][0].arguments
        arguments.encode()  # (a response's encoding would fail on the character itself)
        assert json.loads(arguments) == {"s": "\ud83d"}
    # other characters go as they are
    assert parse_hermes('<tool_call>{"name": "add", "arguments": {"s": "é"}}</tool_call>', NAMES)[1][0].arguments \
        == '{"s": "é"}'
    assert parse_required('[{"name": "add", "parameters": {"s": "\\udc00"}}]')[0].arguments == '{"s": "\\udc00"}'


def test_required_and_named_guides_keep_each_tools_own_refs_and_object_arguments(make_engine):
    # required put each tool's schema under the list's items: its "$ref": "#" (a tree) then meant the list,
    # and "#/properties/a" nothing (a 400); a schema without "type" allowed arguments like 5
    from app.tool_calls import named_schema

    guides = make_engine("tiny").guides
    tok = guides._tokenizer

    def allows(schema: str, value) -> bool:
        ids = tok.encode(json.dumps(value), add_special_tokens=False)
        return guides.matcher("json", schema).validate_tokens(ids) == len(ids)

    tree = {"type": "object", "properties": {"v": {"type": "integer"}, "kids": {"type": "array", "items": {"$ref": "#"}}},
            "required": ["v"]}
    pointer = {"type": "object", "properties": {"a": {"type": "string", "maxLength": 3}, "b": {"$ref": "#/properties/a"}}}
    untyped = {"properties": {"city": {"type": "string"}}, "required": ["city"]}
    required = required_schema([("tree", tree), ("p", pointer), ("n", untyped)], parallel=True)
    assert allows(required, [{"name": "tree", "parameters": {"v": 1, "kids": [{"v": 2, "kids": []}]}}])
    assert allows(required, [{"name": "p", "parameters": {"a": "xyz", "b": "abc"}}])
    assert not allows(required, [{"name": "p", "parameters": {"a": "xyz", "b": "abcd"}}])
    assert allows(required, [{"name": "n", "parameters": {"city": "Oslo"}}])
    assert not allows(required, [{"name": "n", "parameters": 5}])
    assert not allows(named_schema(untyped), 5) and allows(named_schema(untyped), {"city": "x"})
    # each tool keeps its own definitions: two that name theirs alike were refused ("define 'Loc'
    # differently"), every schema was written twice (under $defs and definitions: forty ordinary tools
    # passed the guide's size limit), a percent-encoded pointer was a 400, and data that looks like a
    # ref (a const) was rewritten
    loc = {"type": "object", "properties": {"at": {"$ref": "#/$defs/Loc"}}, "$defs": {"Loc": {"type": "string"}}}
    num = {"type": "object", "properties": {"at": {"$ref": "#/definitions/Loc"}}, "definitions": {"Loc": {"type": "integer"}}}
    pct = {"type": "object", "properties": {"c": {"$ref": "#/%24defs/C"}}, "$defs": {"C": {"type": "string", "maxLength": 2}}}
    const = {"type": "object", "properties": {"k": {"const": {"$ref": "#/x"}}}, "required": ["k"]}
    # (and a property named as data, "default", is a schema: its ref was left pointing at the root)
    named = {"type": "object", "properties": {"default": {"$ref": "#/$defs/M"}}, "$defs": {"M": {"enum": ["a"]}}}
    tools = [("loc", loc), ("num", num), ("pct", pct), ("const", const), ("named", named)]
    required = required_schema(tools, parallel=True)
    big = {"type": "object", "$defs": {f"D{i}": {"type": "string", "description": "x" * 200} for i in range(20)},
           "properties": {f"p{i}": {"$ref": f"#/$defs/D{i}"} for i in range(20)}}
    assert len(required_schema([("big", big)], parallel=True)) < 1.2 * len(json.dumps(big))
    assert allows(required, [{"name": "loc", "parameters": {"at": "Oslo"}}, {"name": "num", "parameters": {"at": 3}}])
    assert not allows(required, [{"name": "num", "parameters": {"at": "Oslo"}}])
    assert allows(required, [{"name": "pct", "parameters": {"c": "ab"}}])
    assert not allows(required, [{"name": "pct", "parameters": {"c": "abc"}}])
    assert allows(required, [{"name": "const", "parameters": {"k": {"$ref": "#/x"}}}])
    assert allows(required, [{"name": "named", "parameters": {"default": "a"}}])
    assert not allows(required, [{"name": "named", "parameters": {"default": "b"}}])


def test_under_the_mistral_parser_call_ids_are_what_mistral_templates_take():
    # Mistral's templates raise unless a call's id is 9 letters and digits: an agent's second turn, which
    # sends back the call_... id it was given (or its own ids), failed under --tool-call-parser mistral
    from app.tool_calls import ToolCall, new_call_id, template_call_ids
    from app.tool_stream import ToolCallStream, read_answer

    nine = re.compile(r"[A-Za-z0-9]{9}")
    assert nine.fullmatch(new_call_id("mistral")) and new_call_id("mistral") != new_call_id("mistral")
    assert new_call_id("hermes").startswith("call_") and new_call_id().startswith("call_")
    assert nine.fullmatch(ToolCall("add", "{}").as_openai("mistral")["id"])
    text = '[TOOL_CALLS][{"name": "add", "arguments": {"a": 1}}]'
    s = ToolCallStream("mistral", NAMES, "mistral")
    heads = [c for d in s.feed(text) + s.finish() for c in d.get("tool_calls", ()) if "id" in c]
    assert len(heads) == 1 and nine.fullmatch(heads[0]["id"])
    assert read_answer("mistral", text, NAMES)[1][0].name == "add"
    # a history's ids: each maps to 9 of its own, a call and its answer alike, the same at every turn;
    # ids already in that form, and other parsers' histories, are left as they are
    history = [{"role": "user", "content": "x"},
               {"role": "assistant", "content": None, "tool_calls": [
                   {"id": "call_0a1aa25b59794ddabb6db155", "type": "function", "function": {"name": "add", "arguments": {}}},
                   {"id": "toolu_01A", "type": "function", "function": {"name": "add", "arguments": {}}},
                   {"id": "abcDEF123", "type": "function", "function": {"name": "add", "arguments": {}}}]},
               {"role": "tool", "tool_call_id": "call_0a1aa25b59794ddabb6db155", "content": "1"},
               {"role": "tool", "tool_call_id": "toolu_01A", "content": "2"},
               {"role": "tool", "tool_call_id": "abcDEF123", "content": "3"}]
    mapped = template_call_ids(history, "mistral")
    ids = [c["id"] for c in mapped[1]["tool_calls"]]
    assert all(nine.fullmatch(i) for i in ids) and len(set(ids)) == 3 and ids[2] == "abcDEF123"
    assert [m["tool_call_id"] for m in mapped[2:]] == ids
    assert template_call_ids(history, "mistral") == mapped and history[2]["tool_call_id"].startswith("call_")
    assert template_call_ids(history, "hermes") is history
