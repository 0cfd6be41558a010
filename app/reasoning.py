"""Reasoning models' thinking, split from their answers (``--reasoning-parser``): the text of a
``<think>...</think>`` block becomes the chat message's ``reasoning_content`` (a Responses ``reasoning``
item), what follows it the content.

Where an answer starts is decided per request (``start_mode``), from the prompt first: a prompt that ends
in an open ``<think>`` (QwQ, Qwen3 thinking-only models, DeepSeek-R1's templates) has the answer think
until ``</think>``; one that ends in a closed block (Qwen3's ``enable_thinking: false``) has no thinking.
An answer that carries on an assistant's message (``continue_final_message``, a Messages API prefill)
thinks only if that message left a block open. Otherwise the parser says:

- ``qwen3``: an answer that opens with ``<think>`` thinks until ``</think>``; any other is all content.
- ``deepseek_r1``: the answer thinks from its start until ``</think>``, and one cut short before it is
  all thinking.

An opening tag the model writes where the prompt opened the block is dropped. An answer held to a guide
(a schema, a regex) thinks first where it can: its guide waits for ``</think>`` (the ingress sets the
engine's ``guide_after``), else it holds the answer from its first token (``TAGGED``: it then thinks only
if the guide writes a block). Thinking that is only whitespace (an empty block)
is none. The tags are read in the text, so they must be ordinary tokens (as in Qwen3 and DeepSeek-R1),
not special ones that the detokenizer leaves out. ``ReasoningStream`` splits an answer as it streams,
with the same result as ``split`` of the whole answer.
"""

from __future__ import annotations

START, END = "<think>", "</think>"
# how an answer starts: thinking (until </think>), tagged (thinking only if it opens with <think>), content
THINKING, TAGGED, CONTENT = "thinking", "tagged", "content"


def start_mode(parser: str, prompt_tail: str, prefill: str | None = None) -> str:
    """How an answer to a prompt ending in ``prompt_tail`` (its last tokens' text) starts; ``prefill``: the
    assistant message it carries on (continue_final_message), whose own text says it: it thinks on only
    where that left a block open (else "The answer is" went on as thinking under deepseek_r1)."""
    if prefill and prefill.strip():  # (an empty one: the answer starts as any other)
        return THINKING if prefill.rfind(START) > prefill.rfind(END) else CONTENT
    tail = prompt_tail.rstrip()
    if tail.endswith(END):
        return CONTENT
    if tail.endswith(START) or parser == "deepseek_r1":
        return THINKING
    return TAGGED


def partial_tail(text: str, tag: str) -> int:
    """How many of ``text``'s last characters could begin ``tag`` (held back until the next ones tell)."""
    at = text.find(tag[0], max(0, len(text) - len(tag) + 1))
    while at >= 0 and not tag.startswith(text[at:]):
        at = text.find(tag[0], at + 1)
    return 0 if at < 0 else len(text) - at


def split(text: str, mode: str, final: bool = True) -> tuple[str, str]:
    """(thinking, content) of ``text``, an answer (``final``) or its start so far, as an answer that starts
    in ``mode`` (``start_mode``); thinking is "" when there is none. Of an answer's start, both are what
    may be sent already: each only grows as the answer does, up to what ``split`` of the whole gives."""
    if mode == CONTENT:
        return "", text
    opened = text.lstrip()
    if not final and START.startswith(opened) and opened != START:
        return "", ""  # (nothing but the start of an opening tag yet, or nothing at all)
    if opened.startswith(START):
        body = opened[len(START):]
    elif mode == THINKING:
        body = text
    else:
        return "", text
    end = body.find(END)
    thinking = body if end >= 0 or final else body[:len(body) - partial_tail(body, END)]
    if end >= 0:
        thinking = body[:end]
    thinking = thinking if thinking.strip() else ""  # (an empty block, or its start: none yet)
    return thinking, body[end + len(END):].lstrip() if end >= 0 else ""


def reasoning_tokens(pieces: list[tuple[str, bool]], mode: str) -> int:
    """How many of an answer's tokens are its thinking, as it starts in ``mode``: ``pieces``, its text in
    order, each with whether it is a token's."""
    stream = ReasoningStream(mode)
    for text, token in pieces:
        stream.feed(text, token)
    stream.finish()
    return stream.reasoning_tokens


class ReasoningStream:
    """``split`` of an answer as its text comes: ``feed`` each piece, ``finish`` at its end; each gives
    the (thinking, content) text to send now. Each piece costs its own length, not the answer's: after
    the start, only a held-back tail (a tag in the making, thinking that is whitespace so far) is kept."""

    def __init__(self, mode: str):
        self.mode = mode
        self.state = "start" if mode != CONTENT else "content"
        self.text = ""  # while the start is undecided (a few characters)
        self.held = ""  # thinking not sent yet: whitespace so far, or what may begin </think>
        self.thought = False  # whether any thinking was sent
        # whether content may go as it comes: an answer without thinking does; after </think> its leading
        # whitespace is left out first
        self.answered = mode == CONTENT
        self.tokens = 0  # tokens fed (``token``)
        self.reasoning_tokens = 0  # of them, the thinking's: up to the one that ends it (OpenAI's usage)
        self._ended = False  # this piece ended the thinking

    def feed(self, piece: str, token: bool = False) -> tuple[str, str]:
        """The (thinking, content) of ``piece`` to send now; ``token``: the piece is a token's (counted)."""
        out = self._feed(piece)
        if token:
            self.tokens += 1
            if self.state == "thinking" or self._ended:
                self.reasoning_tokens = self.tokens
        self._ended = False
        return out

    def _feed(self, piece: str) -> tuple[str, str]:
        if self.state == "start":
            self.text += piece
            opened = self.text.lstrip()
            if START.startswith(opened) and opened != START:
                return "", ""  # (nothing but the start of an opening tag yet, or nothing at all)
            if opened.startswith(START):
                self.state, piece = "thinking", opened[len(START):]
            elif self.mode == THINKING:
                self.state, piece = "thinking", self.text
            else:
                self.state, self.answered = "content", True
                return "", self.text
        if self.state == "thinking":
            return self._think(piece)
        return "", self._answer(piece)

    def _think(self, piece: str) -> tuple[str, str]:
        text = self.held + piece
        end = text.find(END)
        if end >= 0:
            self.state, self.held, self._ended = "content", "", True
            return self._thought(text[:end]), self._answer(text[end + len(END):])
        keep = partial_tail(text, END)
        send, self.held = text[:len(text) - keep], text[len(text) - keep:]
        if not self.thought and not send.strip():  # whitespace only so far: none yet
            self.held = send + self.held
            return "", ""
        return self._thought(send), ""

    def _thought(self, text: str) -> str:
        if not self.thought and not text.strip():
            return ""
        self.thought = True
        return text

    def _answer(self, piece: str) -> str:
        if not self.answered:
            piece = piece.lstrip()
            self.answered = bool(piece)
        return piece

    def finish(self) -> tuple[str, str]:
        if self.state == "start":  # (a few characters: the whole answer's split)
            self.state = "done"
            thought, content = split(self.text, self.mode)
            if thought or self.mode == THINKING:  # (the template opened the block: all of it is in there)
                self.reasoning_tokens = self.tokens
            return thought, content
        if self.state == "thinking":  # cut short inside the block: what was held is thinking too
            held, self.held = self.held, ""
            return self._thought(held), ""
        return "", ""
