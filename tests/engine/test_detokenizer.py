"""Incremental detokenization with a SentencePiece-style tokenizer (see tests.sp_tokenizer)."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.detokenizer import find_stop, flush_text, update_text
from engine.sequence import SamplingParams, Sequence
from tests.sp_tokenizer import BYTE0, sentencepiece_like


@pytest.fixture(scope="module")
def sp_tokenizer():
    return sentencepiece_like()


def _generate(tok, prompt: list[int], output: list[int]) -> Sequence:
    seq = Sequence("r", prompt, SamplingParams())
    for t in output:
        seq.output_ids.append(t)
        update_text(tok, seq)
    flush_text(tok, seq, len(seq.output_ids))
    return seq


def test_the_first_token_keeps_its_space_after_the_prompt(sp_tokenizer):
    """Decoded alone, the first token lost its space: a completion read "The capital isParis."."""
    prompt = sp_tokenizer("The capital is", add_special_tokens=False)["input_ids"]
    seq = _generate(sp_tokenizer, prompt, [6, 7, 5, 8, 9])
    assert seq.text == " Paris. is a city"
    assert sp_tokenizer.decode(prompt) + seq.text == sp_tokenizer.decode(prompt + seq.output_ids)
    # a prompt of one token, and one that ends with BOS (a chat template's), start the text the same way
    assert _generate(sp_tokenizer, [3], [6]).text == " Paris"
    assert _generate(sp_tokenizer, [1], [6, 7]).text == "Paris."  # nothing before it: as decode gives it


def test_a_stop_string_with_a_leading_space_matches_at_the_start(sp_tokenizer):
    seq = Sequence("r", [3, 4, 5], SamplingParams(stop=[" Paris"]))
    seq.output_ids.append(6)
    update_text(sp_tokenizer, seq)
    assert find_stop(seq, 0) and seq.text == ""


def test_a_prompt_that_ends_mid_character_leaves_the_output_its_bytes(loaded):
    """A token-id prompt cut inside a character (a client continuing an answer that stopped there): the
    output's bytes merged with the prompt's, and its text lost them ("好x" for "��好x")."""
    tok = loaded("tiny").tokenizer  # byte-level: one token a byte
    ids = list("ab你好x".encode())
    for cut in range(2, len(ids)):
        seq = _generate(tok, ids[:cut], ids[cut:])
        assert seq.text == tok.decode(ids[cut:]), cut


def _bytes(text: str) -> list[int]:
    return [BYTE0 + b for b in text.encode()]


def test_a_character_cut_short_renders_its_own_bytes_only(sp_tokenizer):
    """Llama 2's byte-fallback decoder renders a byte run that holds an invalid byte as U+FFFD per byte,
    the run's complete characters included: a request cut inside a second emoji ended "city😀�����" (the
    sent emoji's four bytes again, as U+FFFD, and the cut one's two)."""
    cut = _bytes("😀")[:2]
    assert _generate(sp_tokenizer, [1], [9, *_bytes("😀"), *cut]).text == "city😀" + sp_tokenizer.decode(cut)
    # mid-answer, followed by a piece with its own space
    seq = _generate(sp_tokenizer, [1], [9, *_bytes("😀"), *cut, 9])
    assert seq.text == "city😀" + sp_tokenizer.decode(cut) + " city"


def test_a_space_byte_sent_before_an_invalid_byte_is_not_sent_again(sp_tokenizer):
    """A space as a byte piece renders nothing at a text's start (SentencePiece strips it there): the run
    it begins, made U+FFFD per byte by an invalid byte after it, looked unchanged, and the space already
    sent came again as U+FFFD ("city ��", the invalid byte's one U+FFFD and the space's)."""
    assert _generate(sp_tokenizer, [1], [9, *_bytes(" "), BYTE0 + 0xFF]).text == "city \ufffd"
    assert _generate(sp_tokenizer, [1], [9, *_bytes("  "), BYTE0 + 0xFF, 9]).text == "city  \ufffd city"


def test_a_prompt_window_that_starts_inside_a_character_still_gives_the_first_token_its_space(sp_tokenizer):
    """The last five prompt tokens of "is€€" start inside the first €, and the byte-fallback decoder
    rendered them all as U+FFFD: taken for a prompt that ends mid-character, the prompt was left out and
    the first token lost its space ("Paris", and a stop string " Paris" missed)."""
    prompt = [1, 5, *_bytes("€€")]
    assert _generate(sp_tokenizer, prompt, [6, 6]).text == " Paris Paris"
    seq = Sequence("r", prompt, SamplingParams(stop=[" Paris"]))
    seq.output_ids.append(6)
    update_text(sp_tokenizer, seq)
    assert find_stop(seq, 0) and seq.text == ""
    # a prompt that does end inside a character leaves its bytes out of the output's text, not the space
    assert _generate(sp_tokenizer, [1, 5, *_bytes("€€")[:-1]], [6]).text == " Paris"
    assert _generate(sp_tokenizer, [1, 5, *_bytes("€€")[:-1]], [_bytes("€")[-1], 6]).text == "\ufffd Paris"


# whole pieces, the special tokens and whole characters spelled in byte pieces (an invalid byte run is
# rendered apart from what was sent before it, by design: see the test above)
SP_UNITS = [[i] for i in range(3, 11)] + [[1], [2]] + [[BYTE0 + b for b in c.encode()] for c in "A é中"]


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(units=st.lists(st.sampled_from(SP_UNITS), max_size=12), skip=st.booleans())
def test_streamed_text_joins_the_prompt_as_decoding_them_together_gives(sp_tokenizer, units, skip):
    prompt = [3, 4, 5]
    out = [t for u in units for t in u]
    seq = Sequence("r", prompt, SamplingParams(skip_special_tokens=skip))
    for t in out:
        seq.output_ids.append(t)
        update_text(sp_tokenizer, seq)
    flush_text(sp_tokenizer, seq, len(out))

    def decode(ids):
        return sp_tokenizer.decode(ids, skip_special_tokens=skip, clean_up_tokenization_spaces=False)

    assert decode(prompt) + seq.text == decode(prompt + out)


def _longest_decode(tok, monkeypatch) -> list[int]:
    """The most token ids one ``tok.decode`` call is given from now on (a one-item list, updated)."""
    longest = [0]
    decode = tok.decode

    def measured(ids, *args, **kwargs):
        longest[0] = max(longest[0], len(ids))
        return decode(ids, *args, **kwargs)

    monkeypatch.setattr(tok, "decode", measured)
    return longest


def test_a_run_of_tokens_that_render_nothing_is_decoded_once(sp_tokenizer, monkeypatch):
    """An EOS under ignore_eos (skipped special tokens) renders nothing: each later token decoded the whole
    run again, quadratic in it (with the tiny model's tokenizer, 8,192 EOS took 4.2 s of the engine thread; now 0.22 s)."""
    seq = Sequence("r", [3, 4, 5], SamplingParams())
    longest = _longest_decode(sp_tokenizer, monkeypatch)
    for t in [6] + [2] * 300 + [9]:
        seq.output_ids.append(t)
        update_text(sp_tokenizer, seq)
    assert seq.text == " Paris city" and longest[0] <= 8


def test_bytes_that_never_form_a_character_stream_out_in_bounded_windows(monkeypatch):
    """A run of stray bytes (a logit_bias on byte 0x80, a model writing noise) left the text ending in
    U+FFFD at every token: the whole run was decoded again each time (quadratic, on the engine thread all
    requests share) and no text went out until the end."""
    from engine.model_init import build_tokenizer

    tok = build_tokenizer(300)  # (byte-level: ids 0-255 are the bytes)
    decode = tok.decode
    longest = _longest_decode(tok, monkeypatch)
    output = [0x80] * 2000 + list("中".encode()) + [0x41]
    seq = Sequence("r", [0x41, 0x42], SamplingParams())
    for t in output:
        seq.output_ids.append(t)
        update_text(tok, seq)
        if len(seq.output_ids) == 2000:
            assert len(seq.text) >= 1996  # (sent as it came, all but a character's bytes)
    flush_text(tok, seq, len(output))
    assert seq.text == decode(output) and seq.text.endswith("\ufffd中A") and longest[0] <= 16


def test_no_space_comes_before_the_first_word_where_nothing_rendered_before_it(sp_tokenizer):
    """A prompt that renders no text (only BOS) and an output that begins with a skipped special token:
    the first word got a leading space that a plain decode of the whole does not give."""
    for prompt, output in (([1], [5]), ([1], [1, 5]), ([1], [2, 5])):
        assert _generate(sp_tokenizer, prompt, output).text == sp_tokenizer.decode(prompt + output, skip_special_tokens=True)


def test_skipped_special_tokens_inside_a_character_do_not_split_it():
    """The stray-byte windows took a character's lead byte and a skipped special (an EOS under ignore_eos)
    for final where three more such specials came before its other bytes: the emoji came out as U+FFFD."""
    from engine.model_init import build_tokenizer

    tok = build_tokenizer(300)
    eos = tok.convert_tokens_to_ids("<|eos|>")
    for specials in range(1, 6):
        output = [0xF0] + [eos] * specials + [0x9F, 0x98, 0x80] + list(b" ok")
        seq = Sequence("r", [0x41], SamplingParams())
        sent = ""
        for t in output:
            seq.output_ids.append(t)
            update_text(tok, seq)
            assert seq.text.startswith(sent)  # (nothing taken back)
            sent = seq.text
        flush_text(tok, seq, len(output))
        assert seq.text == tok.decode(output, skip_special_tokens=True) == "😀 ok", specials
