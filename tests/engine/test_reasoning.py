"""Reasoning models' thinking split from their answers (app.reasoning): where an answer starts (from its
prompt's end, the parser, a guide), each start's rule, and the same split of a streamed answer, piece by
piece, as of the whole."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from app.reasoning import (
    CONTENT,
    END,
    START,
    TAGGED,
    THINKING,
    ReasoningStream,
    reasoning_tokens,
    split,
    start_mode,
)


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


@pytest.mark.parametrize("parser", ["qwen3", "deepseek_r1"])
@pytest.mark.parametrize("prefill, expected", [
    ("The answer is", CONTENT),  # under deepseek_r1 it went on as thinking: the reply's text came as reasoning
    ("<think>\nFirst, the", THINKING),  # (under qwen3 the block it opened went on as content)
    ("<think>plan</think>\nSo", CONTENT),
])
def test_an_answer_that_carries_on_a_message_thinks_only_where_that_left_a_block_open(parser, prefill, expected):
    tail = "<｜Assistant｜>" + prefill if parser == "deepseek_r1" else "<|im_start|>assistant\n" + prefill
    assert start_mode(parser, tail, prefill) == expected
    assert start_mode(parser, tail[:-len(prefill)], "") == start_mode(parser, tail[:-len(prefill)])


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


def _thinking_tokens(pieces: list[str], mode: str) -> int:
    """Reference: the tokens whose text starts before the end of the thinking block (its closing tag
    included; the whole answer where it never closes), none where the answer does not think."""
    text = "".join(pieces)
    opened = text.lstrip()
    if mode == CONTENT or not (opened.startswith(START) or mode == THINKING):
        return 0
    body = len(text) - len(opened) + len(START) if opened.startswith(START) else 0
    end = text.find(END, body)
    if end < 0:
        return len(pieces)
    starts = [sum(map(len, pieces[:i])) for i in range(len(pieces))]
    return sum(start < end + len(END) for start in starts)


@settings(max_examples=400, deadline=None)
@given(mode=st.sampled_from([THINKING, TAGGED, CONTENT]),
       lead=st.sampled_from(["", " ", "\n\n", "<think>", "\n<think>\n", "<thi", "x"]),
       pieces=st.lists(st.sampled_from(PIECES), max_size=14))
def test_an_answers_thinking_tokens_are_those_up_to_its_closing_tag(mode, lead, pieces):
    # usage's completion_tokens_details.reasoning_tokens (the Responses API's output_tokens_details), each
    # piece a token's: streamed or whole, the same count
    tokens = [lead, *pieces]
    assert reasoning_tokens([(t, True) for t in tokens], mode) == _thinking_tokens(tokens, mode)
    # text that is no token's (held back, sent at the end) moves nothing
    assert reasoning_tokens([(t, True) for t in tokens] + [("", False)], mode) == _thinking_tokens(tokens, mode)


def test_thinking_tokens_of_typical_answers():
    qwen = ["<think>", "\n", "Plan", ".", "\n", "</think>", "\n\n", "Hi", "."]
    assert reasoning_tokens([(t, True) for t in qwen], TAGGED) == 6
    assert reasoning_tokens([(t, True) for t in qwen[5:]], THINKING) == 1  # the template opened the block
    assert reasoning_tokens([(t, True) for t in ["Hi", "."]], TAGGED) == 0
    assert reasoning_tokens([(t, True) for t in ["cut", " short"]], THINKING) == 2  # max_tokens inside it
