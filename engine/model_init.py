"""Write small random-weight models to a local folder, loadable like any real checkpoint.

Nothing is downloaded: the tokenizer is byte-level (256 byte tokens plus a few specials, built with
the ``tokenizers`` library) and the weights are random with a larger init scale than usual, so greedy
decoding does not collapse into repeating one token (which would make equality tests meaningless).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from engine.model_loader import TOKENIZER_FILES
from engine.presets import PRESETS

# what a model folder holds beside its weights and config.json that another model's could leave behind
OLD_MODEL_FILES = ("model.safetensors.index.json", "generation_config.json", "chat_template.jinja", "chat_template.json",
                   *TOKENIZER_FILES)
SPECIAL_TOKENS = ["<|bos|>", "<|eos|>", "<|pad|>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]
# a reasoning model's tags, one ordinary (not special) added token each, as in Qwen3's and DeepSeek-R1's
# tokenizers: their text stays in the answer, where the reasoning parser reads it
THINK_TOKENS = ["<think>", "</think>"]
# tools and tool calls as Hermes-style templates (Qwen's) write them, so tool calling is tested end to end
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% if tools %}<|system|>Tools:{% for tool in tools %} {{ tool['function'] | tojson }}{% endfor %}<|end|>{% endif %}"
    "{% for message in messages %}"
    "<|{{ message['role'] }}|>{{ message['content'] }}"
    "{% for call in message.get('tool_calls', []) %}<tool_call>{{ call['function'] | tojson }}</tool_call>{% endfor %}"
    "<|end|>"
    "{% endfor %}"
    # (as Qwen3's: enable_thinking false writes an empty thinking block, so the answer starts after it)
    "{% if add_generation_prompt %}<|assistant|>"
    "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{% endif %}{% endif %}"
)


def build_tokenizer(vocab_size: int):
    """A byte-level BPE with no merges: every byte is one token, ids 0..255; specials follow, then the
    thinking tags."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    byte_to_char = _bytes_to_unicode()
    vocab = {byte_to_char[b]: b for b in range(256)}
    assert set(vocab) == set(alphabet)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIAL_TOKENS)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in THINK_TOKENS])
    if tok.get_vocab_size() > vocab_size:
        raise ValueError(f"vocab_size {vocab_size} is smaller than the byte tokenizer ({tok.get_vocab_size()})")
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|bos|>", eos_token="<|eos|>",
                                   pad_token="<|pad|>", chat_template=CHAT_TEMPLATE,
                                   model_max_length=1 << 20)


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map (what ByteLevel uses)."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    chars = keep[:]
    n = 0
    for b in range(256):
        if b not in keep:
            keep.append(b)
            chars.append(256 + n)
            n += 1
    return dict(zip(keep, map(chr, chars), strict=True))


def write_model(path: str | Path, preset: str = "tiny", seed: int = 0, init_scale: float | None = None) -> Path:
    """Create ``preset`` with random weights under ``path`` (config, safetensors, tokenizer); their
    scale is ``init_scale``, else the preset's, else 0.2."""
    from transformers import AutoConfig, AutoModelForCausalLM

    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose from {', '.join(PRESETS)}")
    spec = dict(PRESETS[preset])
    arch = spec.pop("architecture")
    preset_scale = spec.pop("init_scale", None)
    init_scale = init_scale if init_scale is not None else preset_scale or 0.2
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(spec["vocab_size"])
    config = AutoConfig.for_model(
        arch, **spec, initializer_range=init_scale, rms_norm_eps=1e-6, tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id, dtype="float32")
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    # written over another model (--force): its files go first, or a stale shard index would name files
    # that are no longer there, and its tokenizer's leftovers (special_tokens_map.json, added_tokens.json,
    # a chat template) would change the new tokenizer's BOS, EOS and template
    for old in [*path.glob("*.safetensors"), *(path / name for name in OLD_MODEL_FILES)]:
        old.unlink(missing_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    (path / "radixserve.json").write_text(json.dumps({"preset": preset, "seed": seed}))
    return path


def default_model_dir() -> Path:
    """Where the embedded default (tiny) model lives: ``$RADIXSERVE_HOME/models/tiny``."""
    import os

    home = Path(os.environ.get("RADIXSERVE_HOME", Path.home() / ".cache" / "radixserve"))
    return home / "models" / "tiny"


def ensure_default_model() -> Path:
    """Create the built-in tiny model on first use; later calls reuse it."""
    path = default_model_dir()
    if not (path / "config.json").exists() or not (path / "radixserve.json").exists():
        write_model(path, "tiny")
    return path
