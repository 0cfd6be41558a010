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
# tokens a character's bytes take at most (UTF-8's 4, one a token at the least)
MAX_CHAR_TOKENS = 4


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


def _prompt_context(tokenizer, prompt: list[int], skip: bool) -> int:
    """How far back in the prompt the first output text is decoded from (``-k``), or 0 when the prompt
    ends mid-character (a token-id prompt cut anywhere): its bytes would merge with the output's, and the
    output's text would lose them (it is then decoded after a guard token). A window that starts inside a
    character renders U+FFFD there (a byte-fallback decoder: for its whole byte run), so it moves back to
    the character's start first."""
    k = min(PROMPT_CONTEXT, len(prompt))
    text = _decode(tokenizer, prompt[-k:], skip)
    while text.startswith("\ufffd") and k < min(PROMPT_CONTEXT + 3, len(prompt)):  # (a character: 4 bytes at most)
        k += 1
        text = _decode(tokenizer, prompt[-k:], skip)
    return 0 if text.endswith("\ufffd") else -k


def guard_ids(tokenizer) -> list[int]:
    """Token ids of a plain letter, to decode other tokens after (the text they render there starts with
    the letter's: SentencePiece decoders strip a text's leading space, so a token decoded alone loses its
    own); none where the tokenizer renders it otherwise."""
    try:
        ids = tokenizer.encode("a", add_special_tokens=False)
    except Exception:  # noqa: BLE001 - an odd tokenizer: texts as decoded alone
        return []
    return ids if _decode(tokenizer, ids + ids).startswith(_decode(tokenizer, ids) or "\ufffd") else []


def _before_last_bytes(tokenizer, seq: Sequence, upto: int, skip: bool) -> int:
    """Where the last 3 output tokens before ``upto`` that render bytes begin (skipped special tokens
    render none, and may sit inside a character); ``read_offset`` where they are not found within a few
    dozen tokens back."""
    special = getattr(tokenizer, "_radixserve_special_ids", None)
    if special is None:
        special = tokenizer._radixserve_special_ids = frozenset(getattr(tokenizer, "all_special_ids", ()) or ())
    head, kept = upto, 0
    while kept < MAX_CHAR_TOKENS - 1:
        head -= 1
        if head < seq.read_offset or upto - head > 64:
            return seq.read_offset
        kept += not (skip and seq.output_ids[head] in special)
    return head


def _text_before(tokenizer, seq: Sequence, skip: bool) -> bool:
    """Whether text stands before the output not yet rendered: output text, or the prompt's (a space that a
    SentencePiece decoder strips at a text's start shows after either, as a plain decode of the whole gives)."""
    return bool(seq.text) or bool(_decode(tokenizer, seq.prompt_ids[-PROMPT_CONTEXT:], skip))


def _extend(tokenizer, seq: Sequence, upto: int, final: bool) -> int | None:
    if upto <= seq.read_offset:
        return None
    skip = seq.params.skip_special_tokens
    if seq.read_offset == 0 and seq.prefix_offset == 0 and seq.prompt_ids:
        seq.prefix_offset = _prompt_context(tokenizer, seq.prompt_ids, skip)
    if seq.read_offset == seq.prefix_offset == 0 and seq.prompt_ids:  # a prompt that ends mid-character
        lead = guard_ids(tokenizer)  # (decoded alone, a SentencePiece text loses its first space)
    else:
        lead = _window(seq, seq.prefix_offset, seq.read_offset)
    prefix_text = _decode(tokenizer, lead, skip)
    if not prefix_text and lead and seq.read_offset > 0 and seq.prefix_offset >= 0 and _text_before(tokenizer, seq, skip):
        # output already sent that renders nothing at a text's start (a SentencePiece space, stripped
        # there): after a guard token it shows, so a byte run it begins that an invalid byte turns to
        # U+FFFD is seen to change (its space was sent again, as U+FFFD)
        lead = guard_ids(tokenizer) + lead
        prefix_text = _decode(tokenizer, lead, skip)
    new_text = _decode(tokenizer, lead + seq.output_ids[seq.read_offset:upto], skip)
    if not new_text.startswith(prefix_text):
        # a byte-fallback decoder (SentencePiece: Llama 2, Mistral) renders a run of byte pieces that holds
        # an invalid byte as U+FFFD per byte, the characters of the run already sent included: render the
        # new tokens after a guard token instead, which no byte run reaches
        lead = guard_ids(tokenizer)
        prefix_text = _decode(tokenizer, lead, skip)
        new_text = _decode(tokenizer, lead + seq.output_ids[seq.read_offset:upto], skip)
    if not final and new_text == prefix_text:
        # tokens that render nothing (skipped special tokens: an EOS under ignore_eos, a chat template's
        # markers): passed over as if sent, or every later token decoded the whole run again (quadratic)
        seq.prefix_offset, seq.read_offset = seq.read_offset, upto
        return None
    if not (final or (len(new_text) > len(prefix_text) and not new_text.endswith("\ufffd"))):
        if not final and upto - seq.read_offset > MAX_CHAR_TOKENS:
            # bytes that never form a character (a run of stray bytes): a character that may still complete
            # spans the last 3 tokens that render bytes, so what comes before them is final as it renders,
            # where it and the rest, each rendered apart, make the whole (not where a token that renders
            # nothing, a skipped special, sits inside a character: U+FFFD for one byte or two hid that);
            # held, the whole run was decoded again at each token, quadratic, and no text went out
            head = _before_last_bytes(tokenizer, seq, upto, skip)
            guard = guard_ids(tokenizer)
            rest = _decode(tokenizer, guard + seq.output_ids[head:upto], skip)[len(_decode(tokenizer, guard, skip)):]
            if head > seq.read_offset and \
                    _decode(tokenizer, lead + seq.output_ids[seq.read_offset:head], skip) + rest == new_text:
                _extend(tokenizer, seq, head, final=True)
                return len(seq.text)
        return None
    start = len(seq.text)
    if upto - seq.read_offset > 1:
        # tokens were held back: the text they render without the newest one and the text with it
        # agree up to where the newest one's own characters start (after an invalid byte's U+FFFD; at
        # the start of a character it completes)
        before = _decode(tokenizer, lead + seq.output_ids[seq.read_offset:upto - 1], skip)
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
