"""Which model configs the engine computes correctly, decided from ``config.json`` alone (so the command
line refuses the rest before it starts anything, and a replica refuses them before it serves wrong
tokens). Each architecture here is checked against transformers' own ``generate`` in
``tests/engine/test_hf_equivalence.py``."""

from __future__ import annotations

from engine.config import ConfigError, request_limits

SUPPORTED = ("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text", "phi3", "olmo2", "olmo", "olmo3",
             "phi", "granite", "starcoder2", "smollm3", "cohere", "cohere2", "glm4", "ernie4_5", "seed_oss", "arcee",
             "exaone4", "hunyuan_v1_dense", "ministral", "helium",
             # mixtures of experts
             "mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "phimoe", "granitemoe", "glm4_moe", "ernie4_5_moe")
LAYER_KINDS = ("full_attention", "sliding_attention")  # config.json layer_types the engine computes
LONGROPE = ("longrope", "su")  # "su": its older name in Phi-3 configs


def _rope_scaling(config) -> dict:
    """The parameters of the model's RoPE scaling (transformers 5 keeps them in ``rope_parameters``, older
    configs in ``rope_scaling``; models whose layers differ, such as Gemma 3, keep one set per layer kind);
    empty for plain RoPE."""
    for name in ("rope_parameters", "rope_scaling"):
        params = getattr(config, name, None)
        if not isinstance(params, dict):
            continue
        per_kind = [v for k, v in params.items() if k in LAYER_KINDS and isinstance(v, dict)]
        for p in per_kind or [params]:
            kind = p.get("rope_type") or p.get("type")
            if kind and kind != "default":
                return p
    return {}


def rope_type(config) -> str | None:
    """The RoPE scaling type; None for plain RoPE."""
    p = _rope_scaling(config)
    return str(p.get("rope_type") or p.get("type")) if p else None


def kv_heads(config) -> int:
    return getattr(config, "num_key_value_heads", None) or config.num_attention_heads


def head_dim(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def _window(config) -> int | None:
    window = getattr(config, "sliding_window", None)
    if window is None or getattr(config, "use_sliding_window", True) is False:
        return None
    return binding_window(int(window), config)


def binding_window(window: int | None, config) -> int | None:
    """A window that masks something: one as long as the model's context (Phi-3.5-MoE's 131072, Phi-3's
    262144) lets every query see every key the engine serves it, as no window does."""
    context = model_context(config)
    return None if window is None or (context is not None and window >= context) else window


def layer_windows(config, num_layers: int) -> tuple[int | None, ...]:
    """Each layer's attention window in tokens (None: it sees the whole context), from ``layer_types``
    where the config has them (Gemma 3, Qwen2's ``max_window_layers``), else one window for all."""
    window = _window(config)
    types = getattr(config, "layer_types", None)
    if not types or window is None:
        return (window,) * num_layers
    return tuple(window if t == "sliding_attention" else None for t in types)


def sliding_window(config) -> int | None:
    """The window of a model whose every layer slides, else None (a model whose layers differ keeps its
    whole context: its full-attention layers read it all; see ``layer_windows``)."""
    windows = set(layer_windows(config, getattr(config, "num_hidden_layers", 1)))
    return windows.pop() if len(windows) == 1 else None


class UnsupportedModel(ConfigError):
    """A model (or a model with these limits) the engine would compute wrongly."""


def model_context(config) -> int | None:
    """The longest sequence the model was built for (``max_position_embeddings``), if it says; with YaRN
    RoPE scaling, what the scaling reaches (its original context times its factor, as vLLM takes it: Qwen3
    says 40960 positions and, with the YaRN its card gives, serves 131072). YaRN's frequencies are fixed,
    so a position past ``max_position_embeddings`` is computed as any other."""
    n = getattr(config, "max_position_embeddings", None)
    p = _rope_scaling(config)
    if (p.get("rope_type") or p.get("type")) == "yarn" and p.get("original_max_position_embeddings") and p.get("factor"):
        n = max(int(n or 0), int(p["original_max_position_embeddings"] * p["factor"]))
    return int(n) if n else None


def _longrope_switch(config) -> int | None:
    """Where ``longrope`` RoPE changes to its long factors, for models that use it."""
    if rope_type(config) not in LONGROPE:
        return None
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    switch = params.get("original_max_position_embeddings") or getattr(config, "original_max_position_embeddings", None)
    return int(switch) if switch else None


def serving_limits(config, max_input_tokens: int | None, max_total_tokens: int | None, pool_tokens: int | None
                   ) -> tuple[int, int]:
    """(max input, max total) tokens per request for this model: ``engine.config.request_limits`` within
    the model's context, or below its ``longrope`` switch when not set; ``UnsupportedModel`` for a
    model (or a ``max_total_tokens``) the engine would compute wrongly."""
    problem = unsupported(config, max_total_tokens)
    if problem:
        raise UnsupportedModel(problem)
    context = model_context(config)
    switch = _longrope_switch(config)
    if switch and max_total_tokens is None:  # the default stays where transformers never switches
        context = min(context or switch, switch)
    return request_limits(max_input_tokens, max_total_tokens, context, pool_tokens)


def unsupported_type(kind) -> str:
    return (f"model type {kind!r} is not supported (the engine runs {', '.join(SUPPORTED)}); other "
            "architectures need attention features it does not implement")


# what a compressed-tensors config may say of the weights (groups of quantized ones, a sparse layout, a
# transform applied to them): with any of these they are not plain
_WEIGHT_SCHEMES = ("config_groups", "sparsity_config", "transform_config")


def quantizes_weights(quant) -> bool:
    """False for a quantization_config that only names fp8 KV-cache scales (llm-compressor's
    ``kv_cache_scheme`` with no weight scheme): the weights are plain, the scales the engine's to read."""
    q = quant if isinstance(quant, dict) else getattr(quant, "to_dict", lambda: {})()
    return not (q.get("kv_cache_scheme") and not any(q.get(k) for k in _WEIGHT_SCHEMES))


def unsupported(config, max_total_tokens: int | None = None) -> str | None:
    """Why the engine cannot serve this model (one line), or None. ``max_total_tokens``: the longest
    sequence asked for, if set (the default limits stay within what works)."""
    kind = getattr(config, "model_type", None)
    if kind not in SUPPORTED:
        return unsupported_type(kind)
    if (quant := getattr(config, "quantization_config", None)) and quantizes_weights(quant):
        method = quant.get("quant_method") if isinstance(quant, dict) else getattr(quant, "quant_method", None)
        # transformers would need the method's own kernels, and none is checked against this engine
        return (f"quantized weights (quantization_config: {method or 'unknown'}) are not supported: serve the "
                "bf16/fp16 checkpoint")
    types = set(getattr(config, "layer_types", None) or ())
    if types - set(LAYER_KINDS):
        return f"layer types {sorted(types - set(LAYER_KINDS))} are not supported (only {', '.join(LAYER_KINDS)})"
    if getattr(config, "use_bidirectional_attention", False):
        return "bidirectional attention (use_bidirectional_attention) is not supported: the engine generates causally"
    rope = rope_type(config)
    if rope in LONGROPE:
        # transformers picks the short or long factors from the longest position in the whole batch,
        # so a short prompt batched with a long one would change its answer; below the switch it never does
        switch = _longrope_switch(config)
        if not switch:
            return f"RoPE scaling {rope!r} without original_max_position_embeddings is not supported"
        if max_total_tokens is not None and max_total_tokens > switch:
            return (f"RoPE scaling {rope!r} switches to its long factors past {switch} tokens, per batch in "
                    f"transformers; serve it with max_total_tokens at most {switch} (the default)")
    return None
