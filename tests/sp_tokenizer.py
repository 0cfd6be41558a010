"""A SentencePiece-style tokenizer (Llama 2, Mistral), built offline: its decoder strips the leading space
of a text, which the tiny model's byte-level tokenizer never does."""

from __future__ import annotations

from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

VOCAB = ["<unk>", "<s>", "</s>", "▁The", "▁capital", "▁is", "▁Paris", ".", "▁a", "▁city", "a"]
BYTE0 = len(VOCAB)  # then Llama 2's byte-fallback pieces <0x00>..<0xFF>: byte b is token BYTE0 + b
VOCAB += [f"<0x{b:02X}>" for b in range(256)]


def sentencepiece_like() -> PreTrainedTokenizerFast:
    t = Tokenizer(models.WordLevel({w: i for i, w in enumerate(VOCAB)}, unk_token="<unk>"))
    t.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    # what Llama 2's tokenizer.json decodes with: pieces' ▁ to spaces, then the text's first space off
    t.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                   decoders.Strip(" ", 1, 0)])
    return PreTrainedTokenizerFast(tokenizer_object=t, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
