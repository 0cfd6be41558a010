"""Reasoning models' thinking, split from their answers (``--reasoning-parser``): the text of a
``<think>...</think>`` block becomes the chat message's ``reasoning_content`` (a Responses ``reasoning``
item), what follows it the content.

- ``qwen3``: an answer that opens with ``<think>`` thinks until ``</think>``; any other is all content
  (Qwen3 with thinking on writes the opening tag, with ``enable_thinking: false`` its template writes an
  empty block into the prompt).
- ``deepseek_r1``: the answer thinks from its start until ``</think>`` (the template opened the block in
  the prompt; an opening tag the model writes anyway is dropped), and one cut short before it is all
  thinking. An answer held to a guide (a schema, a regex) thinks only where it opens with ``<think>``,
  as under ``qwen3``: the guide shaped it from its first token, so it holds a block only if it asked for one.

The tags are read in the text, so they must be ordinary tokens (as in Qwen3 and DeepSeek-R1), not
special ones that the detokenizer leaves out. ``ReasoningStream`` splits an answer as it streams, with
the same result as ``split`` of the whole answer.
"""

from __future__ import annotations

START, END = "<think>", "</think>"
REASONING_PARSERS = ("none", "qwen3", "deepseek_r1")


def _partial_tail(text: str, tag: str) -> int:
    """How many of ``text``'s last characters could begin ``tag`` (held back until the next ones tell)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


def split(text: str, parser: str, guided: bool = False, final: bool = True) -> tuple[str, str]:
    """(thinking, content) of ``text``, an answer (``final``) or its start so far; thinking is "" when
    there is none. Of an answer's start, both are what may be sent already: each only grows as the
    answer does, up to what ``split`` of the whole answer gives."""
    opened = text.lstrip()
    if not final and START.startswith(opened) and opened != START:
        return "", ""  # (nothing but the start of an opening tag yet, or nothing at all)
    if opened.startswith(START):
        body = opened[len(START):]
    elif parser == "deepseek_r1" and not guided:
        body = text
    else:
        return "", text
    end = body.find(END)
    if end < 0:
        return (body if final else body[:len(body) - _partial_tail(body, END)]), ""
    return body[:end], body[end + len(END):].lstrip()


class ReasoningStream:
    """``split`` of an answer as its text comes: ``feed`` each piece, ``finish`` at its end; each gives
    the (thinking, content) text to send now."""

    def __init__(self, parser: str, guided: bool = False):
        self.parser, self.guided = parser, guided
        self.text = ""
        self.sent = ("", "")

    def _step(self, final: bool) -> tuple[str, str]:
        thinking, content = split(self.text, self.parser, self.guided, final)
        (t0, c0) = self.sent
        self.sent = (thinking, content)
        return thinking[len(t0):], content[len(c0):]

    def feed(self, piece: str) -> tuple[str, str]:
        self.text += piece
        return self._step(final=False)

    def finish(self) -> tuple[str, str]:
        return self._step(final=True)
