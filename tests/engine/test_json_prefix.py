"""app.json_prefix against a real partial JSON parser (jiter, the one Anthropic's Python SDK reads
input_json_delta with): every start of a JSON object is taken, and what it takes that parser reads."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from app.json_prefix import JsonObjectPrefix

jiter = pytest.importorskip("jiter")

scalars = st.none() | st.booleans() | st.integers(-10**6, 10**6) | st.floats(allow_nan=False, allow_infinity=False) \
    | st.text(max_size=8)
values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=5), inner,
                                                                                          max_size=4), max_leaves=12)
objects = st.dictionaries(st.text(max_size=5), values, max_size=5)
texts = st.builds(lambda obj, compact, ascii_: json.dumps(obj, separators=(",", ":") if compact else None,
                                                          ensure_ascii=ascii_, indent=None), objects, st.booleans(),
                  st.booleans())


def _taken(text: str) -> int:
    """How many of ``text``'s characters are taken, fed one at a time."""
    reader = JsonObjectPrefix()
    for i, c in enumerate(text):
        if not reader.feed(c):
            return i
    return len(text)


def _jiter_reads(text: str) -> bool:
    try:
        jiter.from_json(text.encode(), partial_mode=True)
    except ValueError:
        return False
    return True


@settings(max_examples=300, deadline=None)
@given(texts)
def test_every_start_of_a_json_object_is_taken(text):
    assert _taken(text) == len(text)
    assert _taken(text + " \n") == len(text) + 2 and _taken(text + "x") == len(text)  # (nothing after it)


@settings(max_examples=500, deadline=None)
@given(texts, st.integers(0, 10**6), st.text(alphabet='{}[]:,"\\ -.0123456789eEtrufalsnNIiy\n\x01xu', min_size=1,
                                             max_size=3))
def test_what_is_taken_a_partial_parser_reads(text, at, junk):
    at %= len(text) + 1
    broken = text[:at] + junk + text[at:]
    taken = _taken(broken)
    for end in sorted({taken // 2, taken}):
        if end:
            assert _jiter_reads(broken[:end]), broken[:end]


@pytest.mark.parametrize("text, taken", [
    ('{"a": 1, oops}', 9), ('{"a": 01}', 7), ('{"a": 1.}', 8), ('{"a": -}', 7), ('{"a": tx', 7),
    ('{"a": [1,]}', 9), ('{"a": 1]', 7), ('{"a": "x\ny"}', 8), ('{"a": "\\q"}', 8), ('{"a": "\\u00g"}', 11),
    ('{"a": "\\udc00"}', 12), ('{"a": "\\ud800x"}', 13), ('{"a": "\\ud800\\udc00"}', 21),  # (surrogates: pairs)
    # (no JSON, though jiter takes them: Anthropic's TypeScript client JSON.parses what it has, and raised)
    ('{"a": NaN, "b": 1}', 6), ('{"a": 1, "b": -Infinity}', 15), ('{"a": Infinity}', 6),
    (' {"a": 1}', 0), ('[1]', 0), ('{}', 2), ('{"a": {}, "b": []}', 18), ('{"a": 1e+5, "b": -0.5E3}', 24),
])
def test_where_a_text_stops_being_the_start_of_a_json_object(text, taken):
    assert _taken(text) == taken
