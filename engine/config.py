"""Engine configuration: TGI's flag names, validated once at start-up."""

from __future__ import annotations

from dataclasses import dataclass, fields

from cache.kv_pool import KV_DTYPES

DTYPES = ("auto", "float32", "bfloat16", "float16")
ATTENTION_BACKENDS = ("auto", "sdpa", "flash")
SCHEDULING_POLICIES = ("fcfs", "priority")


class ConfigError(ValueError):
    """A setting that cannot work; raised at start-up with the reason."""


def request_limits(max_input_tokens: int | None, max_total_tokens: int | None, context: int | None,
                   pool_tokens: int | None = None) -> tuple[int, int]:
    """(max input, max total) tokens per request: the settings, else the model's context (and one
    less for the input), and no more than the KV pool holds (``pool_tokens``, in whole blocks: every
    token of a request has its block there, sliding window or not); ``ConfigError`` if they exceed the
    context or the pool, or leave no room to generate. Without a context or a pool: 4096."""
    if max_total_tokens and context and max_total_tokens > context:
        raise ConfigError(f"max_total_tokens ({max_total_tokens}) is more than the model's context ({context} tokens, "
                          "max_position_embeddings or what its YaRN RoPE scaling reaches)")
    if max_total_tokens and pool_tokens and max_total_tokens > pool_tokens:
        raise ConfigError(f"max_total_tokens ({max_total_tokens}) is more than the KV pool holds ({pool_tokens} tokens, "
                          "max_batch_total_tokens in whole blocks): such a request could never run")
    bounds = [b for b in (context, pool_tokens) if b]
    total = max_total_tokens or (min(bounds) if bounds else 4096)
    inp = max_input_tokens or total - 1
    if inp >= total:
        source = "" if max_total_tokens or total != pool_tokens else ", the KV pool's size"
        raise ConfigError(f"max_input_tokens ({inp}) must be below max_total_tokens ({total}{source})")
    return inp, total


@dataclass
class EngineConfig:
    model_id: str
    max_batch_prefill_tokens: int = 4096  # tokens prefilled per step (chunks longer prompts)
    # tokens of one prompt prefilled per step: a long prompt goes in chunks, so the requests that
    # share its steps (decodes, cache hits with a short uncached tail) are not held up for its length
    max_prefill_chunk_tokens: int = 512
    max_batch_total_tokens: int | None = None  # KV pool size in tokens; None: from memory fraction
    kv_memory_fraction: float = 0.3  # share of free device memory for the pool when the above is unset
    max_input_tokens: int | None = None  # default: max_total_tokens - 1
    max_total_tokens: int | None = None  # prompt + generated; default: model's max_position_embeddings
    max_num_seqs: int = 256  # running sequences at once
    # which waiting request is admitted first and which running one gives way when the pool runs dry:
    # fcfs (arrival) or priority (each request's ``priority``, lower first, then arrival; vLLM's policy)
    scheduling_policy: str = "fcfs"
    block_size: int = 16
    prefix_caching: bool = True
    window_size: int | None = None  # default: the model's sliding_window, if any
    kv_cache_dtype: str = "auto"
    dtype: str = "auto"  # auto: bfloat16 on CUDA, float32 on CPU
    device: str = "auto"  # auto: cuda when available
    attention_backend: str = "auto"  # auto: vllm_flash_attn on CUDA when importable, else SDPA
    # steps run as CUDA graphs, by their token count (a decode step: one per sequence): these sizes are
    # captured (TGI's list, up to 128 tokens for the short prefill chunks of cached prompts; empty: none)
    cuda_graphs: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64, 128)
    seed: int = 0
    num_threads: int | None = None  # torch intra-op threads on CPU
    cache_namespace: str | None = None  # seeds the block hashes (router and replicas must agree); default: model_id

    def validate(self) -> EngineConfig:
        def positive(name: str, value: int | None, allow_none: bool = True) -> None:
            if value is None and allow_none:
                return
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ConfigError(f"{name} must be a positive integer, got {value!r}")

        for name in ("max_batch_prefill_tokens", "max_prefill_chunk_tokens", "max_num_seqs", "block_size"):
            positive(name, getattr(self, name), allow_none=False)
        for name in ("max_batch_total_tokens", "max_input_tokens", "max_total_tokens", "window_size",
                     "num_threads"):
            positive(name, getattr(self, name))
        if self.kv_cache_dtype not in KV_DTYPES:
            raise ConfigError(f"kv_cache_dtype must be one of {', '.join(KV_DTYPES)}, got {self.kv_cache_dtype!r}")
        if self.dtype not in DTYPES:
            raise ConfigError(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ConfigError(f"scheduling_policy must be one of {', '.join(SCHEDULING_POLICIES)}, "
                              f"got {self.scheduling_policy!r}")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ConfigError(f"attention_backend must be one of {', '.join(ATTENTION_BACKENDS)}")
        self.cuda_graphs = tuple(self.cuda_graphs)
        if any(not isinstance(b, int) or isinstance(b, bool) or b <= 0 for b in self.cuda_graphs):
            raise ConfigError(f"cuda_graphs must list positive batch sizes (none: no graphs), got {list(self.cuda_graphs)}")
        if not 0 < self.kv_memory_fraction <= 1:
            raise ConfigError(f"kv_memory_fraction must be in (0, 1], got {self.kv_memory_fraction}")
        if self.max_batch_total_tokens is not None and self.max_batch_total_tokens < self.block_size:
            raise ConfigError("max_batch_total_tokens must hold at least one block "
                              f"({self.block_size} tokens), got {self.max_batch_total_tokens}")
        pool = self.pool_tokens()
        if self.max_total_tokens is not None or pool is not None:
            # the context is only known at load; what the settings alone fix is checked here
            request_limits(self.max_input_tokens, self.max_total_tokens, None, pool)
        return self

    def pool_tokens(self) -> int | None:
        """The KV pool set by ``max_batch_total_tokens``, in whole blocks (None: sized from memory)."""
        n = self.max_batch_total_tokens
        return n // self.block_size * self.block_size if n else None

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in fields(cls)]
