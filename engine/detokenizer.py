"""Incremental detokenization for streaming, with exact stop-string cuts.

Text is emitted only once it is stable: a token that ends in the middle of a UTF-8 character
(byte-level tokenizers) yields nothing until the character completes, and the tail that could still
grow into a stop string is held back until it cannot.
"""

from __future__ import annotations

from engine.sequence import Sequence


def _decode(tokenizer, ids: list[int]) -> str:
    return tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)


def update_text(tokenizer, seq: Sequence) -> None:
    """Extend ``seq.text`` with what the newest output token completes."""
    ids = seq.output_ids
    prefix_text = _decode(tokenizer, ids[seq.prefix_offset:seq.read_offset])
    new_text = _decode(tokenizer, ids[seq.prefix_offset:])
    if len(new_text) > len(prefix_text) and not new_text.endswith("\ufffd"):
        seq.text += new_text[len(prefix_text):]
        seq.prefix_offset, seq.read_offset = seq.read_offset, len(ids)


def find_stop(seq: Sequence) -> bool:
    """Cut ``seq.text`` at the first stop string; True when one was found."""
    stops = seq.params.stop
    if not stops:
        return False
    longest = max(map(len, stops))
    start = max(0, seq.sent_text_len - longest + 1)
    hits = [i for i in (seq.text.find(s, start) for s in stops) if i >= 0]
    if not hits:
        return False
    seq.text = seq.text[: min(hits)]
    return True


def take_delta(seq: Sequence, final: bool) -> str:
    """The text not yet sent; while running, hold back what could start a stop string."""
    end = len(seq.text)
    if not final and seq.params.stop:
        end -= max(map(len, seq.params.stop)) - 1
    if end <= seq.sent_text_len:
        return ""
    delta = seq.text[seq.sent_text_len:end]
    seq.sent_text_len = end
    return delta
