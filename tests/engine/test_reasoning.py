"""Reasoning models' thinking split from their answers (app.reasoning): each parser's rule, and the same
split of a streamed answer, piece by piece, as of the whole."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from app.reasoning import ReasoningStream, split


@pytest.mark.parametrize("parser, guided, text, expected", [
    ("qwen3", False, "<think>\nplan it\n</think>\n\nThe answer.", ("\nplan it\n", "The answer.")),
    ("qwen3", False, "The answer, no thinking.", ("", "The answer, no thinking.")),
    ("qwen3", False, "\n<think>cut short", ("cut short", "")),  # max_tokens inside the block
    ("qwen3", False, "a </think> b", ("", "a </think> b")),  # a closing tag alone opens nothing
    ("deepseek_r1", False, "plan it</think>\n\nThe answer.", ("plan it", "The answer.")),  # opened by the template
    ("deepseek_r1", False, "<think>plan it</think>The answer.", ("plan it", "The answer.")),
    ("deepseek_r1", False, "still thinking", ("still thinking", "")),
    ("deepseek_r1", True, "yes", ("", "yes")),  # a guided answer holds a block only if it opens one
    ("deepseek_r1", True, "<think>x</think>yes", ("x", "yes")),
    ("qwen3", False, "<think></think>", ("", "")),
])
def test_each_parser_splits_thinking_from_the_answer(parser, guided, text, expected):
    assert split(text, parser, guided) == expected


PIECES = ["<", "think", ">", "\n", "pl", "an", " <", "/th", "ink", ">", "\n\n", "A", "n", "swer", "</", "think>",
          " x", "a", "b", "<think>", "</"]


@settings(max_examples=300, deadline=None)
@given(parser=st.sampled_from(["qwen3", "deepseek_r1"]), guided=st.booleans(),
       lead=st.sampled_from(["", " ", "<think>", "\n<think>\n", "<thi", "x"]),
       pieces=st.lists(st.sampled_from(PIECES), max_size=14))
def test_a_streamed_answer_splits_as_the_whole_does(parser, guided, lead, pieces):
    stream = ReasoningStream(parser, guided)
    thinking, content = "", ""
    for piece in [lead, *pieces]:
        t, c = stream.feed(piece)
        thinking, content = thinking + t, content + c
    t, c = stream.finish()
    assert (thinking + t, content + c) == split(lead + "".join(pieces), parser, guided)
