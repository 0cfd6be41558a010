"""A request's state inside the engine, and its sampling parameters."""

from __future__ import annotations

import enum
import math
import time
from dataclasses import dataclass, field

from cache.radix import Node


class SamplingError(ValueError):
    """Invalid sampling parameters: the request is refused with this message."""


# Temperatures below this sample greedily: dividing logits by a tinier one overflows float32 to inf,
# and softmax of inf is NaN (vLLM draws the same line).
GREEDY_BELOW = 1e-5
MAX_TOP_LOGPROBS = 20
# every stop string is looked for after every token, on the engine thread all requests share: 60,000
# of them made one request's neighbours 10x slower (TGI allows 4 by default, OpenAI 4)
MAX_STOP_STRINGS = 16


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def encodable(text: str) -> bool:
    """Whether ``text`` is valid Unicode: JSON and Python strings can hold a lone surrogate, which no
    tokenizer, nor the cache's hashes, can encode."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


@dataclass
class SamplingParams:
    max_new_tokens: int = 64
    temperature: float = 0.0  # 0: greedy
    top_k: int = 0  # 0: off
    top_p: float = 1.0
    min_p: float = 0.0  # drop tokens less likely than min_p x the best one's probability (0: off)
    typical_p: float = 1.0  # TGI's (and HF's) locally typical sampling: 1.0 is off
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop_token_ids: list[int] = field(default_factory=list)  # end the request (not part of its text)
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False
    min_tokens: int = 0  # no EOS, stop token or stop string before this many tokens (vLLM's field)
    include_stop_str_in_output: bool = False  # keep the stop string that ended the text
    skip_special_tokens: bool = True  # leave special tokens out of the text
    logprobs: bool = False
    top_logprobs: int = 0  # alternatives reported per generated token (needs logprobs)
    # log-probabilities of the distribution a sampled token was drawn from, after temperature and the
    # top-k/top-p/typical-p/min-p filters (TGI's; a filtered token's is -inf), instead of the model's
    # (OpenAI's and vLLM's default). Greedy tokens report the model's either way
    processed_logprobs: bool = False
    # the prompt tokens' own log-probabilities, with this many alternatives each (None: none). The
    # prompt is then computed whole, not found in the prefix cache: a cached block has no logits
    prompt_logprobs: int | None = None
    # OpenAI's penalties on tokens generated so far: logit -= frequency x count + presence x (count > 0)
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    # TGI's frequency penalty instead (its HeterogeneousFrequencyPenaltyLogitsProcessor): the count is over
    # the whole context, prompt and generated tokens, and divided by its length, so logit -= frequency x
    # count / (prompt + generated so far); presence_penalty stays OpenAI's
    frequency_penalty_per_context: bool = False
    logit_bias: dict[int, float] = field(default_factory=dict)  # token id -> added to its logit
    allowed_token_ids: list[int] = field(default_factory=list)  # only these may be generated (vLLM's; []: any)
    # token sequences that must not be generated (vLLM's bad_words, tokenized): the last token of one is
    # banned where the generated tokens end with the rest of it
    bad_words_ids: list[list[int]] = field(default_factory=list)
    guide: tuple[str, str] | None = None  # structured output: (kind, text), see engine.guided
    # a reasoning model's structured output (vLLM's): the guide holds the answer after its thinking, from
    # the token after the one whose text completes ``guide_after`` (the end tag). With ``guide_opener``
    # (the start tag's token), only an answer whose first token is that one thinks; any other is guided
    # from its first token, where the opener is allowed besides what the guide allows (a guide that
    # writes the start tag itself holds the thinking block too: guided from the first token)
    guide_after: str | None = None
    guide_opener: int | None = None
    cache_salt: str | None = None
    # vLLM's: lower runs first under the "priority" scheduling policy (ties: first come); 0 under "fcfs"
    priority: int = 0

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW

    @property
    def adjusts_logits(self) -> bool:
        return (self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0 or self.presence_penalty != 0.0
                or bool(self.logit_bias) or bool(self.allowed_token_ids) or bool(self.bad_words_ids)
                or self.guide is not None)

    def validate(self) -> SamplingParams:
        # types first: the HTTP schemas check them, but a Ray handle or library caller passes anything,
        # and a float top_k or a non-string stop would fail inside a step shared by every request
        for name in ("top_k", "top_logprobs", "priority") + (("seed",) if self.seed is not None else ()):
            if not _is_int(getattr(self, name)):
                raise SamplingError(f"{name} must be an integer, got {getattr(self, name)!r}")
        for name in ("temperature", "top_p", "min_p", "typical_p", "repetition_penalty", "frequency_penalty",
                     "presence_penalty"):
            if not _is_number(getattr(self, name)):
                raise SamplingError(f"{name} must be a number, got {getattr(self, name)!r}")
            try:  # (as a float: an int past int64, say 10**30, fails to convert inside a step)
                setattr(self, name, float(getattr(self, name)))
            except OverflowError:
                raise SamplingError(f"{name} must be a finite number, got {getattr(self, name)!r}") from None
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens", "logprobs",
                     "processed_logprobs", "frequency_penalty_per_context"):
            if not isinstance(getattr(self, name), bool):
                raise SamplingError(f"{name} must be true or false, got {getattr(self, name)!r}")
        if not isinstance(self.stop, list) or any(not isinstance(s, str) for s in self.stop):
            raise SamplingError("stop must be a list of strings")
        if not isinstance(self.stop_token_ids, list):
            raise SamplingError("stop_token_ids must be a list of token ids")
        if not isinstance(self.logit_bias, dict) or any(not _is_number(b) for b in self.logit_bias.values()):
            raise SamplingError("logit_bias must be a map of token ids to numbers")
        if self.guide is not None and (not isinstance(self.guide, (tuple, list)) or len(self.guide) != 2
                                       or not all(isinstance(x, str) for x in self.guide)):
            raise SamplingError("guide must be a (kind, text) pair")
        if self.guide_after is not None and (self.guide is None or not isinstance(self.guide_after, str)
                                             or not self.guide_after):
            raise SamplingError("guide_after must be a non-empty string, with a guide")
        if self.guide_opener is not None and (self.guide_after is None or not _is_int(self.guide_opener)
                                              or self.guide_opener < 0):
            raise SamplingError("guide_opener must be a token id, with guide_after")
        if not isinstance(self.allowed_token_ids, list) or any(not _is_int(t) or t < 0 for t in self.allowed_token_ids):
            raise SamplingError("allowed_token_ids must be a list of token ids")
        if not isinstance(self.bad_words_ids, list) or any(
                not isinstance(w, list) or not w or any(not _is_int(t) or t < 0 for t in w) for w in self.bad_words_ids):
            raise SamplingError("bad_words_ids must be a list of non-empty lists of token ids")
        if self.cache_salt is not None and (not isinstance(self.cache_salt, str) or not self.cache_salt
                                            or not encodable(self.cache_salt)):
            raise SamplingError(f"cache_salt must be a non-empty string of valid Unicode, got {self.cache_salt!r}")
        if not _is_int(self.max_new_tokens) or self.max_new_tokens < 1:
            raise SamplingError(f"max_new_tokens must be a positive integer, got {self.max_new_tokens!r}")
        if self.seed is not None and not -(2**63) <= self.seed < 2**64:  # what a torch generator takes
            raise SamplingError(f"seed must be a 64-bit integer, got {self.seed}")
        if not 0.0 <= self.temperature < math.inf:
            raise SamplingError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise SamplingError(f"top_k must be >= 0, got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise SamplingError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0.0 <= self.min_p <= 1.0:
            raise SamplingError(f"min_p must be in [0, 1], got {self.min_p}")
        if not 0.0 < self.typical_p <= 1.0:
            raise SamplingError(f"typical_p must be in (0, 1], got {self.typical_p}")
        if not 0.0 < self.repetition_penalty < math.inf:
            raise SamplingError(f"repetition_penalty must be a finite number > 0, got {self.repetition_penalty}")
        for name in ("frequency_penalty", "presence_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise SamplingError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if any(not -100.0 <= b <= 100.0 for b in self.logit_bias.values()):
            raise SamplingError("logit_bias values must be in [-100, 100]")
        if self.prompt_logprobs is not None and (not _is_int(self.prompt_logprobs)
                                                 or not 0 <= self.prompt_logprobs <= MAX_TOP_LOGPROBS):
            raise SamplingError(f"prompt_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {self.prompt_logprobs!r}")
        if not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
            raise SamplingError(f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {self.top_logprobs}")
        if any(not s for s in self.stop):
            raise SamplingError("stop strings must not be empty")
        if len(self.stop) > MAX_STOP_STRINGS:
            raise SamplingError(f"at most {MAX_STOP_STRINGS} stop strings, got {len(self.stop)}")
        if not _is_int(self.min_tokens) or not 0 <= self.min_tokens <= self.max_new_tokens:
            raise SamplingError(f"min_tokens must be in [0, max_new_tokens ({self.max_new_tokens})], "
                                f"got {self.min_tokens!r}")
        if any(not _is_int(t) or t < 0 for t in self.stop_token_ids):
            raise SamplingError("stop_token_ids must be token ids (integers >= 0)")
        return self


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


# a prompt token's log-probability under the model given the tokens before it, its rank there (1: the
# most likely token), and the most likely alternatives, best first (token id, log-probability)
PromptLogprob = tuple[float, int, list[tuple[int, float]]]


@dataclass
class TokenEvent:
    """What one step produced for one request (streamed to its consumer)."""

    request_id: str
    token_id: int | None
    text: str
    logprob: float | None
    finished: bool
    finish_reason: str | None = None  # "length" | "stop" | "eos" | "abort" | "error"
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    num_output_tokens: int = 0
    error: str | None = None
    # "unavailable": the engine never took the request (it had stopped or was stopping), so another
    # replica may run it; "engine": it failed while the engine ran it (it may be the cause: no retry)
    error_kind: str | None = None
    top_logprobs: list[tuple[int, float]] | None = None  # the most likely alternatives, best first
    # where the token's text starts in the request's whole text (not where this event's text starts:
    # text that might begin a stop string is held back), at most the final text's length
    text_offset: int = 0
    # on the first token's event of a request that asked for them: each prompt token's log-probability
    # and best alternatives, None for the first (nothing comes before it)
    prompt_logprobs: list[PromptLogprob | None] | None = None
    stop_reason: str | int | None = None  # on the last event: the stop string or stop token id that ended it


@dataclass(eq=False)
class Sequence:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    arrival: float = field(default_factory=time.monotonic)
    output_ids: list[int] = field(default_factory=list)
    status: Status = Status.WAITING
    # KV bookkeeping
    block_table: list[int] = field(default_factory=list)  # cached blocks first, then private ones
    num_cached_blocks: int = 0  # leading block_table entries owned by the radix cache
    own_cached_blocks: int = 0  # cached blocks it held when last released (taken back on re-admission)
    lock_node: Node | None = None  # deepest cache node this sequence holds locked
    num_computed: int = 0  # tokens whose KV is in the pool
    # stats
    num_cached_prompt_tokens: int = 0  # prompt tokens served by the prefix cache (first admission)
    admitted_once: bool = False
    preemptions: int = 0
    first_token_time: float | None = None
    last_token_time: float | None = None
    finish_reason: str | None = None
    generator: object | None = None  # torch.Generator for seeded sampling
    # counts of every token of the context (prompt and output) on the logits' device, kept up to date by
    # the sampler for the penalties that read the whole context: counting it again each step was O(context)
    context_counts: object | None = None  # engine.sampler.TokenCounts
    output_counts: object | None = None  # the same of its output alone (OpenAI's penalties)
    # its logit_bias and allowed_token_ids as tensors on the logits' device, made once (rebuilt from lists
    # at every token, 262k allowed ids cost 16 ms a step, for every request of the batch)
    fixed_tensors: tuple | None = None
    # (a weak reference to a running sequence, tokens, what it had computed when last seen): waiting for
    # that prefill to compute its first ``tokens``, which this one shares (see Scheduler.schedule): not
    # matched against the cache until then, nor once a step passes in which it computed nothing
    # (weak: a finished one is not kept alive by the requests behind it)
    waits_on: tuple[object, int, int] | None = None
    waited_in_vain: bool = False  # it waited for a prefill that then stood still: it waits for none again
    queue_order: int = 0  # when the scheduler first took it: ties between equal priorities go to the earlier
    held: bool = False  # in Scheduler.held: long, found while every long-prompt slot was taken
    held_mark: tuple | None = None  # where its match ended then (KVManager.match_mark); None: held unmatched
    ends: tuple[int, ...] = ()  # token ids that would end it (EOS, stop tokens): banned before min_tokens,
    # and while a guided answer still thinks (its guide waits for the end tag)
    prefill_only: bool = False  # warm-up: compute the prompt's KV, generate nothing
    sibling: bool = False  # a later choice of one client call's prompt (see LLMEngine.add_request)
    prompt_logprobs: list[PromptLogprob | None] | None = None  # as far as computed (params.prompt_logprobs)
    matcher: object | None = None  # its guide's parser state (engine.guided), for a guided request
    # while the guide waits (SamplingParams.guide_after): "opener" before the first token, "marker" while
    # the answer thinks; None once it holds the answer
    guide_wait: str | None = None
    # incremental detokenization: offsets into output_ids; a negative prefix_offset reaches back into the
    # prompt's last tokens (see engine.detokenizer)
    prefix_offset: int = 0
    read_offset: int = 0
    text: str = ""
    sent_text_len: int = 0

    def __repr__(self) -> str:  # (not its prompt, text or settings: an error's message reaches the logs)
        return (f"Sequence({self.request_id!r}, {self.status.name}, {len(self.prompt_ids)} prompt tokens, "
                f"{len(self.output_ids)} generated)")

    @property
    def tokens(self) -> list[int]:
        return self.prompt_ids + self.output_ids if self.output_ids else self.prompt_ids

    def token_range(self, start: int, end: int | None = None) -> list[int]:
        """``tokens[start:end]`` without building ``tokens`` (a decode step reads one token of a long context)."""
        n = len(self.prompt_ids)
        end = self.num_tokens if end is None else end
        if end <= n:
            return self.prompt_ids[start:end]
        if start >= n:
            return self.output_ids[start - n:end - n]
        return self.prompt_ids[start:] + self.output_ids[:end - n]

    @property
    def wants_prompt_logprobs(self) -> bool:
        """Its prompt's log-probabilities are asked for and not all known yet (a preempted request that
        has them all may take its prompt from the cache again)."""
        return self.params.prompt_logprobs is not None and len(self.prompt_logprobs or ()) < len(self.prompt_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def num_uncomputed(self) -> int:
        return self.num_tokens - self.num_computed

    @property
    def private_blocks(self) -> list[int]:
        return self.block_table[self.num_cached_blocks:]
