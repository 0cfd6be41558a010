"""Incremental detokenization for streaming, with exact stop-string cuts.

Text is emitted only once it is stable: a token that ends in the middle of a UTF-8 character
(byte-level tokenizers) yields nothing until the character completes, and the tail that could still
grow into a stop string is held back until it cannot.
"""

from __future__ import annotations

import os

from engine.sequence import Sequence


def _decode(tokenizer, ids: list[int], skip_special: bool = True) -> str:
    return tokenizer.decode(ids, skip_special_tokens=skip_special, clean_up_tokenization_spaces=False)


# prompt tokens the first output tokens are decoded after: SentencePiece decoders (Llama 2, Mistral) strip
# the leading space of a text, so a first token decoded alone lost its own ("Paris", not " Paris")
PROMPT_CONTEXT = 5


def _window(seq: Sequence, start: int, end: int) -> list[int]:
    """``output_ids[start:end]``, where a negative ``start`` begins that many tokens back in the prompt."""
    if start >= 0:
        return seq.output_ids[start:end]
    return seq.prompt_ids[len(seq.prompt_ids) + start:] + seq.output_ids[:end]


def update_text(tokenizer, seq: Sequence) -> int | None:
    """Extend ``seq.text`` with what the newest output token completes. Returns where in the text that
    token's own characters start, when it completed any (see ``_extend``)."""
    return _extend(tokenizer, seq, len(seq.output_ids), final=False)


def flush_text(tokenizer, seq: Sequence, upto: int) -> int | None:
    """At the end of a request: render ``output_ids[:upto]`` completely. Bytes held back for a
    character that never completed become U+FFFD, as a plain ``decode`` of the tokens gives them.
    Returns where token ``upto - 1``'s own characters start, as ``update_text``."""
    return _extend(tokenizer, seq, upto, final=True)


def _extend(tokenizer, seq: Sequence, upto: int, final: bool) -> int | None:
    if upto <= seq.read_offset:
        return None
    skip = seq.params.skip_special_tokens
    # the first text is decoded after the prompt's end, unless that ends mid-character (a token-id prompt
    # cut anywhere): its bytes would merge with the output's, and the output's text would lose them
    if seq.read_offset == 0 and seq.prefix_offset == 0 and seq.prompt_ids:
        k = min(PROMPT_CONTEXT, len(seq.prompt_ids))
        if not _decode(tokenizer, seq.prompt_ids[-k:], skip).endswith("\ufffd"):
            seq.prefix_offset = -k
    prefix_text = _decode(tokenizer, _window(seq, seq.prefix_offset, seq.read_offset), skip)
    new_text = _decode(tokenizer, _window(seq, seq.prefix_offset, upto), skip)
    if not (final or (len(new_text) > len(prefix_text) and not new_text.endswith("\ufffd"))):
        return None
    start = len(seq.text)
    if upto - seq.read_offset > 1:
        # tokens were held back: the text they render without the newest one and the text with it
        # agree up to where the newest one's own characters start (after an invalid byte's U+FFFD; at
        # the start of a character it completes)
        before = _decode(tokenizer, _window(seq, seq.prefix_offset, upto - 1), skip)
        same = len(os.path.commonprefix([before, new_text]))
        start += max(0, same - len(prefix_text))
    seq.text += new_text[len(prefix_text):]
    seq.prefix_offset, seq.read_offset = seq.read_offset, upto
    return min(start, len(seq.text))


def find_stop(seq: Sequence, after: int) -> str | None:
    """Cut ``seq.text`` at the first stop string that ends past ``after`` (the text's length before the
    newest token: an older one was seen then, or came before ``min_tokens`` and does not count); that
    stop string, when one was found. While running, ``take_delta`` holds back enough that such a stop
    string was never sent."""
    stops = seq.params.stop
    if not stops:
        return None
    hits = [(i, i + len(s), s) for i, s in ((seq.text.find(s, max(0, after - len(s) + 1)), s) for s in stops) if i >= 0]
    if not hits:
        return None
    at, end, stop = min(hits)
    seq.text = seq.text[: end if seq.params.include_stop_str_in_output else at]
    return stop


def take_delta(seq: Sequence, final: bool) -> str:
    """The text not yet sent; while running, hold back what could start a stop string (unless the stop
    string stays in the output: a cut then always ends past the text checked so far, so none is needed)."""
    end = len(seq.text)
    if not final and seq.params.stop and not seq.params.include_stop_str_in_output:
        end -= max(map(len, seq.params.stop)) - 1
    if end <= seq.sent_text_len:
        return ""
    delta = seq.text[seq.sent_text_len:end]
    seq.sent_text_len = end
    return delta
