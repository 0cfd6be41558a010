"""Write small random-weight models to a local folder, loadable like any real checkpoint.

Nothing is downloaded: the tokenizer is byte-level (256 byte tokens plus a few specials, built with
the ``tokenizers`` library) and the weights are random with a larger init scale than usual, so greedy
decoding does not collapse into repeating one token (which would make equality tests meaningless).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

SPECIAL_TOKENS = ["<|bos|>", "<|eos|>", "<|pad|>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "<|{{ message['role'] }}|>{{ message['content'] }}<|end|>"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)

PRESETS: dict[str, dict] = {
    # The embedded default for serving and most tests: fast on two CPU cores.
    "tiny": dict(architecture="llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, vocab_size=320, max_position_embeddings=4096),
    # The benchmark model of the project's design notes.
    "bench": dict(architecture="llama", hidden_size=512, intermediate_size=1536, num_hidden_layers=8,
                  num_attention_heads=8, num_key_value_heads=2, vocab_size=32000, max_position_embeddings=8192),
    # For GPUs: a 0.85B-parameter Llama (3.4 GB on disk), big enough that prefill arithmetic shows
    "bench-1b": dict(architecture="llama", hidden_size=2048, intermediate_size=5632, num_hidden_layers=16,
                     num_attention_heads=16, num_key_value_heads=4, vocab_size=32000, max_position_embeddings=8192),
    # Sliding-window and Qwen variants, for architecture coverage in tests.
    "tiny-mistral": dict(architecture="mistral", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, vocab_size=320,
                         max_position_embeddings=4096, sliding_window=24),
    "tiny-qwen2": dict(architecture="qwen2", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, vocab_size=320, max_position_embeddings=4096),
    "tiny-qwen3": dict(architecture="qwen3", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=320,
                       max_position_embeddings=4096),
    # Further architectures the engine supports (engine.model_support), each checked against HF in tests.
    "tiny-gemma": dict(architecture="gemma", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=320,
                       max_position_embeddings=4096),
    # Gemma 2: alternating sliding and full layers, soft-capped attention scores and logits (caps far
    # below the real 50 and 30, so that random weights feel them)
    "tiny-gemma2": dict(architecture="gemma2", hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=320,
                        max_position_embeddings=4096, sliding_window=24, attn_logit_softcapping=1.5,
                        final_logit_softcapping=4.0, query_pre_attn_scalar=16,
                        layer_types=["sliding_attention", "full_attention", "sliding_attention"]),
    # Gemma 3's text model: sliding-window layers beside full-attention ones, each with its own RoPE
    "tiny-gemma3": dict(architecture="gemma3_text", hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=320,
                        max_position_embeddings=4096, sliding_window=24,
                        layer_types=["sliding_attention", "sliding_attention", "full_attention"]),
    "tiny-phi3": dict(architecture="phi3", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, vocab_size=320, max_position_embeddings=4096),
    "tiny-olmo2": dict(architecture="olmo2", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, vocab_size=320, max_position_embeddings=4096),
}


def build_tokenizer(vocab_size: int):
    """A byte-level BPE with no merges: every byte is one token, ids 0..255; specials follow."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    byte_to_char = _bytes_to_unicode()
    vocab = {byte_to_char[b]: b for b in range(256)}
    assert set(vocab) == set(alphabet)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIAL_TOKENS)
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


def write_model(path: str | Path, preset: str = "tiny", seed: int = 0, init_scale: float = 0.2) -> Path:
    """Create ``preset`` with random weights under ``path`` (config, safetensors, tokenizer)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose from {', '.join(PRESETS)}")
    spec = dict(PRESETS[preset])
    arch = spec.pop("architecture")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(spec["vocab_size"])
    config = AutoConfig.for_model(
        arch, **spec, initializer_range=init_scale, rms_norm_eps=1e-6, tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id, dtype="float32")
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    # written over another model (--force): its weights go first, or a stale shard index would name
    # files that are no longer there (or shards of the old model would stay beside the new one)
    for old in [*path.glob("*.safetensors"), path / "model.safetensors.index.json"]:
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
