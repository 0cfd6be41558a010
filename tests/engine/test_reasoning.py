"""Reasoning models' thinking split from their answers (app.reasoning): where an answer starts (from its
prompt's end, the parser, a guide), each start's rule, and the same split of a streamed answer, piece by
piece, as of the whole."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from app.reasoning import CONTENT, TAGGED, THINKING, ReasoningStream, split, start_mode


@pytest.mark.parametrize("parser, tail, expected", [
    ("qwen3", "<|im_start|>assistant\n", TAGGED),  # Qwen3: the model writes <think> if it thinks
    ("qwen3", "<|im_start|>assistant\n<think>\n", THINKING),  # QwQ, Qwen3 thinking-only: the prompt opened it
    ("qwen3", "assistant\n<think>\n\n</think>\n\n", CONTENT),  # enable_thinking: false
    ("deepseek_r1", "<｜Assistant｜>", THINKING),
    ("deepseek_r1", "<｜Assistant｜><think>\n", THINKING),
    ("deepseek_r1", "</think>", CONTENT),
])
def test_where_an_answer_starts(parser, tail, expected):
    assert start_mode(parser, tail) == expected


@pytest.mark.parametrize("mode, text, expected", [
    (TAGGED, "<think>\nplan it\n</think>\n\nThe answer.", ("\nplan it\n", "The answer.")),
    (TAGGED, "The answer, no thinking.", ("", "The answer, no thinking.")),
    (TAGGED, "\n<think>cut short", ("cut short", "")),  # max_tokens inside the block
    (TAGGED, "a </think> b", ("", "a </think> b")),  # a closing tag alone opens nothing
    (TAGGED, "<think>\n\n</think>\n\nHi", ("", "Hi")),  # an empty block is no thinking
    (THINKING, "plan it</think>\n\nThe answer.", ("plan it", "The answer.")),  # opened by the template
    (THINKING, "<think>plan it</think>The answer.", ("plan it", "The answer.")),  # (a second opening dropped)
    (THINKING, "still thinking", ("still thinking", "")),
    (THINKING, "\n\n", ("", "")),
    (CONTENT, "<think>x</think>yes", ("", "<think>x</think>yes")),
])
def test_each_start_splits_thinking_from_the_answer(mode, text, expected):
    assert split(text, mode) == expected


PIECES = ["<", "think", ">", "\n", "pl", "an", " <", "/th", "ink", ">", "\n\n", "A", "n", "swer", "</", "think>",
          " x", "a", "b", "<think>", "</", " "]


@settings(max_examples=400, deadline=None)
@given(mode=st.sampled_from([THINKING, TAGGED, CONTENT]),
       lead=st.sampled_from(["", " ", "\n\n", "<think>", "\n<think>\n", "<thi", "x"]),
       pieces=st.lists(st.sampled_from(PIECES), max_size=14))
def test_a_streamed_answer_splits_as_the_whole_does(mode, lead, pieces):
    stream = ReasoningStream(mode)
    thinking, content = "", ""
    for piece in [lead, *pieces]:
        t, c = stream.feed(piece)
        thinking, content = thinking + t, content + c
    t, c = stream.finish()
    assert (thinking + t, content + c) == split(lead + "".join(pieces), mode)
