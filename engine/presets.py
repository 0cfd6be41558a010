"""The small random-weight models ``radixserve init-model`` writes (``engine.model_init``): the embedded
default, the benchmarks' models, and one tiny model of each architecture the engine supports, which the
tests check against transformers. Plain data, so the command line lists them without importing torch."""

from __future__ import annotations

# what every tiny model shares: fast on two CPU cores, a vocabulary just past the byte tokenizer
_TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=320, max_position_embeddings=4096)
_MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64)  # Qwen's names for the experts
_GROUPS = ["sliding_attention", "sliding_attention", "full_attention"]


def _tiny(architecture: str, **overrides) -> dict:
    """``init_scale`` (an override) widens the random weights where greedy decoding would otherwise
    repeat a few tokens, which would make equality with transformers prove little."""
    return dict(architecture=architecture, **{**_TINY, **overrides})


PRESETS: dict[str, dict] = {
    # The embedded default for serving and most tests.
    "tiny": _tiny("llama"),
    # The benchmark model of the project's design notes.
    "bench": dict(architecture="llama", hidden_size=512, intermediate_size=1536, num_hidden_layers=8,
                  num_attention_heads=8, num_key_value_heads=2, vocab_size=32000, max_position_embeddings=8192),
    # For GPUs: a 0.85B-parameter Llama (3.4 GB on disk), big enough that prefill arithmetic shows
    "bench-1b": dict(architecture="llama", hidden_size=2048, intermediate_size=5632, num_hidden_layers=16,
                     num_attention_heads=16, num_key_value_heads=4, vocab_size=32000, max_position_embeddings=8192),
    # One per supported architecture (engine.model_support), each checked against transformers in tests.
    "tiny-mistral": _tiny("mistral", sliding_window=24),  # every layer slides
    "tiny-qwen2": _tiny("qwen2"),
    "tiny-qwen3": _tiny("qwen3", head_dim=16),
    "tiny-gemma": _tiny("gemma", head_dim=16),
    # Gemma 2: alternating sliding and full layers, soft-capped attention scores and logits (caps far
    # below the real 50 and 30, so that random weights feel them)
    "tiny-gemma2": _tiny("gemma2", num_hidden_layers=3, head_dim=16, sliding_window=24, attn_logit_softcapping=1.5,
                         final_logit_softcapping=4.0, query_pre_attn_scalar=16,
                         layer_types=["sliding_attention", "full_attention", "sliding_attention"]),
    # Gemma 3's text model: sliding-window layers beside full-attention ones, each with its own RoPE
    "tiny-gemma3": _tiny("gemma3_text", num_hidden_layers=3, head_dim=16, sliding_window=24, layer_types=_GROUPS),
    "tiny-phi3": _tiny("phi3"),
    "tiny-olmo2": _tiny("olmo2"),
    "tiny-olmo": _tiny("olmo"),
    "tiny-olmo3": _tiny("olmo3", num_hidden_layers=3, sliding_window=24, layer_types=_GROUPS, init_scale=0.4),
    "tiny-phi": _tiny("phi", num_key_value_heads=4, init_scale=0.4),  # Phi-2: partial rotary, parallel blocks
    "tiny-granite": _tiny("granite", attention_multiplier=0.2, embedding_multiplier=3.0, residual_multiplier=0.5,
                          logits_scaling=2.0),
    "tiny-starcoder2": _tiny("starcoder2", sliding_window=24),
    "tiny-smollm3": _tiny("smollm3", num_hidden_layers=4),  # every fourth layer without RoPE
    "tiny-cohere": _tiny("cohere"),
    "tiny-cohere2": _tiny("cohere2", num_hidden_layers=4, sliding_window=24),  # a full layer every fourth, no RoPE there
    "tiny-glm4": _tiny("glm4", head_dim=16),
    "tiny-ernie4_5": _tiny("ernie4_5", head_dim=16),
    "tiny-seed_oss": _tiny("seed_oss", head_dim=16),
    "tiny-arcee": _tiny("arcee"),
    "tiny-exaone4": _tiny("exaone4", num_hidden_layers=4, sliding_window=24, init_scale=0.4),  # sliding layers, then a full one
    "tiny-hunyuan_v1_dense": _tiny("hunyuan_v1_dense", head_dim=16),
    "tiny-ministral": _tiny("ministral", num_hidden_layers=3, head_dim=16, sliding_window=24, layer_types=_GROUPS),
    "tiny-helium": _tiny("helium", head_dim=16),
    # Mixtures of experts: the experts run as transformers computes them (grouped, the same per token
    # whatever else is in the batch)
    "tiny-mixtral": _tiny("mixtral", num_local_experts=4, num_experts_per_tok=2),
    "tiny-qwen2_moe": _tiny("qwen2_moe", **_MOE, shared_expert_intermediate_size=64),
    "tiny-qwen3_moe": _tiny("qwen3_moe", head_dim=16, **_MOE),
    "tiny-olmoe": _tiny("olmoe", num_experts=4, num_experts_per_tok=2),
    "tiny-phimoe": _tiny("phimoe", num_local_experts=4, num_experts_per_tok=2),
    "tiny-granitemoe": _tiny("granitemoe", num_local_experts=4, num_experts_per_tok=2),
    "tiny-glm4_moe": _tiny("glm4_moe", head_dim=16, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
                           first_k_dense_replace=1, n_group=1, topk_group=1),
    "tiny-ernie4_5_moe": _tiny("ernie4_5_moe", head_dim=16, moe_num_experts=4, moe_k=2, moe_intermediate_size=64),
}
