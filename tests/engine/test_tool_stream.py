"""Tool calls read out of an answer while it streams (app.tool_stream): for well-formed calls, in any
chunking, the stream says what the whole answer's parse says, and a call's arguments go out as they come."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from app.tool_calls import PARSERS, parse_required
from app.tool_stream import JsonEnd, ToolCallStream, read_answer

NAMES = {"get_weather", "add", "write_file"}


def streamed(parser: str, pieces: list[str], names: set[str] = NAMES) -> tuple[str | None, list[tuple[str, str]], list]:
    """(content, [(name, arguments)], every delta) of an answer fed in ``pieces``."""
    s = ToolCallStream(parser, names)
    deltas = [d for p in pieces for d in s.feed(p)] + s.finish()
    content, calls = "", []
    for d in deltas:
        content += d.get("content", "")
        for c in d.get("tool_calls", ()):
            if "id" in c:  # a call's first delta: its id, type and name
                assert c["index"] == len(calls) and c["type"] == "function" and c["id"].startswith("call_")
                calls.append([c["function"]["name"], ""])
            assert c["index"] == len(calls) - 1, "arguments go to the call being read"
            calls[-1][1] += c["function"]["arguments"]
    return content or None, [tuple(c) for c in calls], deltas


def whole(parser: str, text: str) -> tuple[str | None, list[tuple[str, object]]]:
    if parser == "required":
        calls = parse_required(text) or []
        content = None if calls else text
    else:
        content, calls = PARSERS[parser](text, NAMES)
    return content, [(c.name, json.loads(c.arguments)) for c in calls]


def same_as_whole(parser: str, text: str, pieces: list[str]) -> list:
    content, calls, deltas = streamed(parser, pieces)
    assert (content, [(n, json.loads(a)) for n, a in calls]) == whole(parser, text)
    return deltas


def chunked(text: str, cuts: list[int]) -> list[str]:
    at = sorted({min(c, len(text)) for c in cuts} | {0, len(text)})
    return [text[a:b] for a, b in zip(at, at[1:], strict=False)]


# (a call's strings may hold its format's tags: an agent writing this very format)
json_scalars = st.none() | st.booleans() | st.integers() | st.text(max_size=8) | st.sampled_from(
    ["</tool_call>", "[TOOL_CALLS]", "x[ARGS]"])
json_values = st.recursive(json_scalars, lambda inner: st.lists(inner, max_size=3)
                           | st.dictionaries(st.text(max_size=5), inner, max_size=3), max_leaves=8)
arguments = st.dictionaries(st.text(max_size=6), json_values, max_size=4)
names = st.sampled_from(sorted(NAMES))
words = st.text(st.sampled_from(list("ab {}[]\"\\<>;,\n")), max_size=12)
spaces = st.sampled_from(["", " ", "\n", "\n\n"])
# keys after the arguments (Mistral Nemo's template writes an "id" there)
extras = st.sampled_from(["", ', "id": "abc123xyz"', ', "id": {"n": [1, "}"]}', ', "id": "</tool_call>"'])
# text a Hermes answer may hold: words, or the tag named in prose (a block that is no call)
prose = words.filter(lambda w: "<" not in w) | st.sampled_from(["the <tool_call> tag ", "<tool_call>", " <tool_call>\n"])


def call_object(name: str, args: dict, key: str, sp: str, extra: str = "") -> str:
    return f'{{"name": "{name}",{sp}"{key}":{sp}{json.dumps(args, indent=1 if sp else None)}{extra}{sp}}}'


@st.composite
def answers(draw, parser: str) -> str:
    calls = draw(st.lists(st.tuples(names, arguments, spaces, extras), min_size=1, max_size=3))
    if parser == "hermes":
        out = draw(prose)
        for name, args, sp, extra in calls:
            out += f"<tool_call>{sp}{call_object(name, args, 'arguments', sp, extra)}{sp}</tool_call>"
            out += draw(prose)
        return out
    if parser == "mistral_named":
        head = draw(words.filter(lambda w: "[" not in w))
        return head + "".join(f"[TOOL_CALLS]{n}[ARGS]{sp}{json.dumps(a)}{sp}" for n, a, sp, _ in calls)
    key = "parameters" if parser != "mistral" else "arguments"
    objects = [call_object(n, a, key, sp, x if parser != "required" else "") for n, a, sp, x in calls]
    if parser == "llama3_json":  # (any run of ';' and whitespace between calls, or none; one after them too)
        seps = draw(st.lists(st.sampled_from([" ; ", ";", "\n", ";;", "", "; "]), min_size=len(objects),
                             max_size=len(objects)))
        return draw(st.sampled_from(["", "<|python_tag|>"])) + "".join(o + sep for o, sep in zip(
            objects, seps, strict=True)).rstrip(" ;\n") + draw(st.sampled_from(["", ";", " ;\n"]))
    if parser == "mistral":
        return draw(words.filter(lambda w: "[" not in w)) + "[TOOL_CALLS][" + ", ".join(objects) + "]"
    return "[" + ", ".join(objects) + "]"  # required


@pytest.mark.parametrize("parser", ["hermes", "mistral", "mistral_named", "llama3_json", "required"])
@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_a_streamed_answer_says_what_its_whole_parse_says(parser, data):
    text = data.draw(answers(parser))
    cuts = data.draw(st.lists(st.integers(0, len(text)), max_size=20))
    parser = "mistral" if parser == "mistral_named" else parser
    same_as_whole(parser, text, chunked(text, cuts))
    deltas = same_as_whole(parser, text, list(text))  # one character at a time
    assert all("tool_calls" not in d or len(d["tool_calls"]) == 1 for d in deltas)


def test_a_calls_arguments_stream_as_the_model_writes_them():
    text = ('I will write it. <tool_call>\n{"name": "write_file", "arguments": {"path": "a.py", "text": '
            '"print(\\"}\\")\\n"}}\n</tool_call>')
    content, calls, deltas = streamed("hermes", list(text))
    assert content == "I will write it."
    assert calls == [("write_file", '{"path": "a.py", "text": "print(\\"}\\")\\n"}')]
    pieces = [d["tool_calls"][0]["function"]["arguments"] for d in deltas if "tool_calls" in d]
    assert pieces[0] == "{" and len(pieces) == len(calls[0][1])  # the name with the first character, then each
    # the name goes out before the arguments are whole
    s = ToolCallStream("hermes", NAMES)
    (first,) = s.feed('<tool_call>{"name": "add", "arguments": {"a')
    assert first["tool_calls"][0]["function"] == {"name": "add", "arguments": '{"a'}
    assert s.feed('": 1}}</tool_call>') == [{"tool_calls": [{"index": 0, "function": {"arguments": '": 1}'}}]}]
    assert s.finish() == [] and s.finish_reason("stop") == "tool_calls"


def test_whitespace_around_calls_goes_as_the_whole_parse_strips_it():
    for text in ("Hi <tool_call>{\"name\": \"add\", \"arguments\": {}}</tool_call> there\n",
                 "\n<tool_call>{\"name\": \"add\", \"arguments\": {}}</tool_call>\n\nDone.",
                 "<tool_call>{\"name\": \"add\", \"arguments\": {}}</tool_call>\n<tool_call>{\"name\": \"add\", "
                 "\"arguments\": {}}</tool_call>\n", "  no calls at all  \n"):
        same_as_whole("hermes", text, list(text))
        same_as_whole("hermes", text, [text])


@pytest.mark.parametrize("parser,text", [
    ("hermes", '<tool_call>{"arguments": {"a": 1}, "name": "add"}</tool_call> after'),  # arguments first
    ("hermes", 'x <tool_call>{"name": "add", "arguments": "{\\"a\\": 1}"}</tool_call>'),  # arguments as a string
    ("hermes", '<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call> text'),  # no such tool
    ("hermes", "<tool_call>{oops</tool_call> and <tool_call>"),  # not JSON, and a tag at the end
    ("hermes", 'a <tool_call>{"name": "add", "arguments": {"a": 1}}'),  # never closed
    ("mistral", '[TOOL_CALLS][{"arguments": {}, "name": "add"}]'),
    ("mistral", "Sure [TOOL_CALLS]nope"),
    ("llama3_json", '{"parameters": {"a": 1}, "name": "add"}'),
    ("llama3_json", "Hello, {not a call}"),
    ("llama3_json", '{"name": "add", "parameters": {"a": 1}}; {"parameters": {}, "name": "add"}'),
    ("required", '[{"name": "add", "parameters": {}}, {"parameters": {"a": 2}, "name": "get_weather"}]'),
])
def test_calls_in_shapes_without_a_head_are_held_and_read_whole(parser, text):
    same_as_whole(parser, text, list(text))
    same_as_whole(parser, text, [text])


def test_a_call_cut_short_stays_unfinished_and_the_finish_reason_says_so():
    s = ToolCallStream("hermes", NAMES)
    deltas = s.feed('<tool_call>{"name": "add", "arguments": {"a": [1, ') + s.finish()
    assert deltas[0]["tool_calls"][0]["function"] == {"name": "add", "arguments": '{"a": [1, '}
    assert s.finish_reason("length") == "length"
    # a list of calls cut after a whole call: more may have followed
    for parser, text in [("required", '[{"name": "add", "parameters": {"a": 1}}'),
                         ("required", '[{"name": "add", "parameters": {"a": 1}}, {"na'),
                         ("mistral", '[TOOL_CALLS][{"name": "add", "arguments": {"a": 1}}')]:
        s = ToolCallStream(parser, NAMES)
        deltas = s.feed(text) + s.finish()
        assert [c["function"]["name"] for d in deltas for c in d.get("tool_calls", ()) if "id" in c] == ["add"]
        assert s.finish_reason("length") == "length"
    s = ToolCallStream("required", NAMES)
    s.feed('[{"name": "add", "parameters": {"a": 1}}]')
    assert s.finish() == [] and s.finish_reason("stop") == "tool_calls"
    # a Hermes call cut after its arguments, inside its object; one whose arguments close with the wrong bracket
    for text, engine in [('<tool_call>{"name": "add", "arguments": {"a": 1}', "length"),
                         ('<tool_call>{"name": "add", "arguments": {"a": 1]}</tool_call>', "stop")]:
        s = ToolCallStream("hermes", NAMES)
        s.feed(text)
        s.finish()
        assert s.finish_reason(engine) == engine
    # balanced brackets that are no JSON: said complete (tool_calls), an agent loop ran them on a parse of
    # its own ({"a": NaN} in Python, {} where a client read what it could)
    for args in ("{\"a\": NaN}", "{\"a\": 01}", "{\"a\": 1,}", "{'a': True}", "{a: 1}", "{\"a\": \"x\ny\"}"):
        for parser, text in [("hermes", f'<tool_call>{{"name": "add", "arguments": {args}}}</tool_call>'),
                             ("llama3_json", f'{{"name": "add", "parameters": {args}}}'),
                             ("required", f'[{{"name": "add", "parameters": {args}}}]')]:
            assert read_answer(parser, text, NAMES)[2] is False, (parser, text)
    assert read_answer("hermes", '<tool_call>{"name": "add", "arguments": {"a": 1e400}}</tool_call>', NAMES)[2]
    # written as a JSON string: the string's text must be a JSON object too (NaN made a call)
    text = '<tool_call>{"name": "add", "arguments": "{\\"a\\": NaN}"}</tool_call>'
    assert read_answer("hermes", text, NAMES)[1] == []


def test_max_tokens_that_cut_where_another_call_may_begin_cut_the_calls():
    # a whole call, then max_tokens inside the next one's tag or head: it said tool_calls (the Messages API
    # tool_use, Responses completed), and an agent ran the first call as if the turn were over
    whole = '<tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>'
    for later in ("vfs<too", "\n<tool_call>", '<tool_call>\n{"name": "ad', '<tool_call>\n{"na'):
        for engine, said in (("length", "length"), ("stop", "tool_calls"), ("eos", "tool_calls")):
            s = ToolCallStream("hermes", NAMES)
            s.feed(whole + later)
            s.finish()
            assert s.finish_reason(engine) == said, (later, engine)
            _, calls, complete = read_answer("hermes", whole + later, NAMES, engine=engine)
            assert complete is (said == "tool_calls") and len(calls) == 1, (later, engine)
            assert s.finish_reason(engine, first_only=True) == "tool_calls"  # (only the first is sent)
    # the other formats: inside the next call's head (Llama's after its ';', Mistral's after its tag)
    for parser, text in [("llama3_json", '{"name": "add", "parameters": {"a": 1}}; {"na'),
                         ("llama3_json", '{"name": "add", "parameters": {"a": 1}}; {"name": "ad'),
                         ("mistral", '[TOOL_CALLS]add[ARGS]{"a": 1}[TOOL_CALLS]ad'),
                         ("mistral", '[TOOL_CALLS]add[ARGS]{"a": 1}[TOOL_CALLS]')]:
        for engine, said in (("length", "length"), ("eos", "tool_calls")):
            s = ToolCallStream(parser, NAMES)
            s.feed(text)
            s.finish()
            assert s.finish_reason(engine) == said, (parser, text, engine)
            assert read_answer(parser, text, NAMES, engine=engine)[2] is (said == "tool_calls"), (parser, text)
    # a call whose closing tag alone was cut is whole, as before; so is text after it that begins no tag
    for text in (whole[:-5], whole + " done.", whole[:-12] + "\n"):
        s = ToolCallStream("hermes", NAMES)
        s.feed(text)
        s.finish()
        assert s.finish_reason("length") == "tool_calls", text


def test_with_one_call_sent_only_that_calls_end_says_the_finish_reason():
    # parallel_tool_calls false sends the first call alone: a second cut short by max_tokens (or broken)
    # made the answer "length" though its one call was whole, and an agent loop did not run it
    whole = '<tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>'
    for later, engine in [('<tool_call>{"name": "add", "arguments": {"a": [1, ', "length"),
                          ('<tool_call>{"name": "add", "arguments": {"a": 1]}</tool_call>', "stop")]:
        for first_only, said in ((False, engine), (True, "tool_calls")):
            s = ToolCallStream("hermes", NAMES)
            s.feed(whole + later)
            s.finish()
            assert s.finish_reason(engine, first_only) == said
            _, calls, complete = read_answer("hermes", whole + later, NAMES, first_only)
            assert complete is (said == "tool_calls") and len(calls) == (1 if first_only else 2)
    # the first call's own end still counts
    s = ToolCallStream("hermes", NAMES)
    s.feed('<tool_call>{"name": "add", "arguments": {"a": 1]}</tool_call>' + whole)
    s.finish()
    assert s.finish_reason("stop", first_only=True) == "stop"
    assert read_answer("hermes", whole[:-20], NAMES, first_only=True)[2] is False  # (one call, cut short)


def test_a_tag_named_in_prose_is_text_at_once():
    s = ToolCallStream("hermes", NAMES)
    sent = s.feed("Qwen marks calls with a <tool_call> tag. " + "More words. " * 20)
    assert "".join(d["content"] for d in sent).startswith("Qwen marks calls with a <tool_call> tag. More words.")
    for text in ('<tool_call> x <tool_call>{"name": "add", "arguments": {}}</tool_call> Done',
                 'Use the <tool_call> tag. <tool_call>{"name": "add", "arguments": {}}</tool_call> Done',
                 '<tool_call>{"name": "nope", "arguments": {}} <tool_call>{"name": "add", "arguments": {}}</tool_call> x'):
        same_as_whole("hermes", text, list(text))
        same_as_whole("hermes", text, [text])


def test_an_answer_cut_inside_a_calls_closing_tag_sends_no_piece_of_the_tag():
    # max_tokens cut "</tool_call>": its start went out as content ("Sure.</tool"), streamed or not; a
    # call held to be read whole (its arguments as a JSON string) was no call at all, its block all text
    for args in ('{"a": 1}', '"{\\"a\\": 1}"'):
        for cut in range(1, len("</tool_call>")):
            text = f'Sure.<tool_call>{{"name": "add", "arguments": {args}}}' + "</tool_call>"[:cut]
            for pieces in ([text], list(text)):
                content, calls, _ = streamed("hermes", pieces)
                assert (content, [(n, json.loads(a)) for n, a in calls]) == ("Sure.", [("add", {"a": 1})]), text
            assert whole("hermes", text) == ("Sure.", [("add", {"a": 1})])
            assert read_answer("hermes", text, NAMES)[2]  # (its arguments are whole: a call to run)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from(["<tool_call>", "</tool_call>", '{"name": "add", "arguments": ', "{", "}", '"',
                                 "\\", "[TOOL_CALLS]", "add[ARGS]", "[", "]", ",", ";", " ", "x", "<|python_tag|>",
                                 '{"name": "add", "parameters": ']), max_size=12),
       st.sampled_from(["hermes", "mistral", "llama3_json", "required"]))
def test_whatever_a_model_writes_the_stream_never_raises_and_its_deltas_are_well_formed(pieces, parser):
    streamed(parser, pieces)
    text = "".join(pieces)
    if parser in ("hermes", "mistral") and ("<tool_call>" if parser == "hermes" else "[TOOL_CALLS]") not in text:
        assert streamed(parser, pieces)[0] == (text or None)  # no tag: all of it is content


def test_where_json_values_end():
    for text, end in [('{"a": "}"}tail', 10), ('[1, [2], {"b": "\\""}] x', 21), ('{"a": "\\\\"}', 11)]:
        assert JsonEnd(0).feed(text) == end
        scan = JsonEnd(0)  # the same, read a character at a time
        assert next(k for k in range(1, len(text) + 1) if scan.feed(text[:k]) is not None) == end
    assert JsonEnd(0).feed('{"a": "b\\') is None
    mismatched = JsonEnd(0)
    assert mismatched.feed('{"a": 1]') == 8 and mismatched.broken and not JsonEnd(0).broken


@pytest.mark.parametrize("parser,text,content,calls", [
    # a held call (its arguments first) whose strings hold the closing tag: the block ends after its object
    ("hermes", '<tool_call>{"arguments": {"x": "</tool_call>"}, "name": "add"}</tool_call>', None,
     [("add", '{"x": "</tool_call>"}')]),
    # no closing tag after a call's object: the call ends there (the next call, or prose, was swallowed)
    ("hermes", '<tool_call>{"name": "add", "arguments": {"a": 1}}\n<tool_call>{"name": "get_weather", '
     '"arguments": {"c": "x"}}</tool_call>', None, [("add", '{"a": 1}'), ("get_weather", '{"c": "x"}')]),
    ("hermes", '<tool_call>{"name": "add", "arguments": {"a": 1}}\nNow I wait.', "Now I wait.", [("add", '{"a": 1}')]),
    # prose after a Llama call (the whole parse made it all text, where the stream had sent the call)
    ("llama3_json", '{"name": "add", "parameters": {"a": 1}}\n\nI called add.', "I called add.", [("add", '{"a": 1}')]),
    # arguments as the model wrote them (read and written again, 1e400 was "Infinity", no JSON)
    ("hermes", '<tool_call>{"name": "add", "arguments": {"a": 1e400, "b": 0.30000000000000000004}}</tool_call>',
     None, [("add", '{"a": 1e400, "b": 0.30000000000000000004}')]),
])
def test_a_whole_answer_makes_the_calls_its_stream_makes(parser, text, content, calls):
    got_content, got_calls, complete = read_answer(parser, text, NAMES)
    assert (got_content, [(c.name, c.arguments) for c in got_calls], complete) == (content, calls, True)
    for pieces in (list(text), [text]):
        assert streamed(parser, pieces)[:2] == (content, calls)


fragments = st.sampled_from(['<tool_call>', '</tool_call>', '{"name": "add", "arguments": ', '{"arguments": {"a": 1}, '
                             '"name": "add"}', '{"a": 1}', "}", "{", "]", "[", '"', "\\", " ", "\n", "text", ";", ",",
                             "[TOOL_CALLS]", "add[ARGS]", "<|python_tag|>", '"</tool_call>"', "1e400",
                             '{"name": "get_weather", "parameters": {"c": "x"}}'])


@pytest.mark.parametrize("parser", ["hermes", "mistral", "llama3_json", "required"])
@settings(max_examples=200, deadline=None)
@given(parts=st.lists(fragments, max_size=10), cuts=st.lists(st.integers(0, 200), max_size=8))
def test_whatever_a_model_writes_its_stream_in_any_pieces_says_what_the_whole_answer_says(parser, parts, cuts):
    text = "".join(parts)
    content, calls, _ = read_answer(parser, text, NAMES)
    for pieces in (chunked(text, cuts), list(text)):
        got_content, got_calls, _ = streamed(parser, pieces)
        assert got_calls == [(c.name, c.arguments) for c in calls]
        if calls:
            assert got_content == content
