"""HTTP API shapes: TGI's ``/generate`` family and OpenAI's completions/chat, plus warm-up.

Requests are validated here (types, ranges) and turned into the engine's neutral parameter dict;
anything the engine checks against the model (length limits, vocabulary) comes back as an error
that the ingress maps onto the same API's error format.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from engine.sequence import MAX_TOP_LOGPROBS


def _encodable(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _check_text(value: Any, path: str = "") -> None:
    """Strings must be valid Unicode: JSON can carry a lone surrogate (``"\\ud800"``), which no
    tokenizer can encode."""
    if isinstance(value, str):
        if not _encodable(value):
            raise ValueError(f"{path or 'text'} is not valid Unicode (it holds a lone surrogate)")
    elif isinstance(value, list):
        for i, v in enumerate(value):
            if isinstance(v, (str, list, dict)):  # not per token id: a 2 MB prompt of ids is 400k of them
                _check_text(v, f"{path}[{i}]")
    elif isinstance(value, dict):
        for k, v in value.items():
            if isinstance(k, str) and not _encodable(k):
                raise ValueError("a field name is not valid Unicode (it holds a lone surrogate)")
            _check_text(v, f"{path}.{k}" if path else str(k))


class _Strict(BaseModel):
    # strict: "5" is not a number and true is not a count (clients that send them have a bug);
    # unknown fields are ignored, as OpenAI's and TGI's servers do
    model_config = ConfigDict(extra="ignore", strict=True)

    @model_validator(mode="before")
    @classmethod
    def _valid_unicode(cls, data: Any) -> Any:
        _check_text(data)
        return data


def _unsupported(name: str, value: Any, allowed: tuple = (None,)) -> None:
    if value not in allowed and value != [] and value != {}:
        raise ValueError(f"{name} is not supported by this server")


# ----------------------------------------------------------------------------- TGI
class TGIParameters(_Strict):
    max_new_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, gt=0)
    top_k: int | None = Field(None, gt=0)
    top_p: float | None = Field(None, gt=0, le=1)
    repetition_penalty: float | None = Field(None, gt=0)
    seed: int | None = Field(None, ge=0)
    stop: list[str] = Field(default_factory=list, max_length=16)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    truncate: int | None = Field(None, ge=1)  # keep only the last this many prompt tokens
    top_n_tokens: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)  # alternatives per token (details)
    do_sample: bool = False
    details: bool = False
    return_full_text: bool = False
    decoder_input_details: bool = False
    best_of: int | None = Field(None, ge=1)
    watermark: bool = False
    grammar: Any = None
    typical_p: float | None = None
    adapter_id: str | None = None
    cache_salt: str | None = None

    @model_validator(mode="after")
    def _supported(self):
        _unsupported("decoder_input_details", self.decoder_input_details, (False,))
        _unsupported("best_of > 1", self.best_of, (None, 1))
        _unsupported("watermark", self.watermark, (False,))
        _unsupported("grammar (constrained decoding)", self.grammar)
        _unsupported("typical_p", self.typical_p, (None, 1.0))
        _unsupported("adapter_id (LoRA adapters)", self.adapter_id)
        return self


class TGIRequest(_Strict):
    inputs: str = Field(..., min_length=1)
    parameters: TGIParameters = Field(default_factory=TGIParameters)
    stream: bool = False

    def sampling(self, default_max_new_tokens: int) -> dict[str, Any]:
        p = self.parameters
        sample = p.do_sample or p.temperature not in (None, 1.0) or p.top_k is not None or p.top_p is not None
        return dict(max_new_tokens=p.max_new_tokens or default_max_new_tokens,
                    temperature=(p.temperature or 1.0) if sample else 0.0,
                    top_k=p.top_k or 0, top_p=p.top_p or 1.0, repetition_penalty=p.repetition_penalty or 1.0,
                    frequency_penalty=p.frequency_penalty or 0.0, top_logprobs=p.top_n_tokens or 0,
                    seed=p.seed, stop=p.stop, logprobs=True, cache_salt=p.cache_salt)


TGI_FINISH = {"length": "length", "eos": "eos_token", "stop": "stop_sequence", "abort": "length"}


# ----------------------------------------------------------------------------- OpenAI
class StreamOptions(_Strict):
    include_usage: bool = False


# OpenAI's spec makes these nullable and its client sends null for a None argument: null means the default
NULL_IS_DEFAULT = frozenset({"temperature", "top_p", "n", "stream", "frequency_penalty", "presence_penalty",
                             "logprobs", "echo", "ignore_eos"})


class _OpenAICommon(_Strict):
    @model_validator(mode="before")
    @classmethod
    def _nulls_are_defaults(cls, data: Any) -> Any:
        if isinstance(data, dict):
            data = {k: v for k, v in data.items() if not (v is None and k in NULL_IS_DEFAULT)}
        return data

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int | None = Field(None, ge=0)  # extension (vLLM has it too)
    repetition_penalty: float | None = Field(None, gt=0)  # extension
    n: int = Field(1, ge=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    logit_bias: dict[str, float] | None = None  # token id (as a string) -> bias in [-100, 100]
    user: str | None = None
    cache_salt: str | None = None  # tenant isolation of the prefix cache (as vLLM's field)
    ignore_eos: bool = False  # extension (as vLLM's): generate max_tokens even past EOS
    # accepted only with the values that mean "not used": anything else is refused, not ignored
    best_of: int | None = None
    tools: list[Any] | None = None
    functions: list[Any] | None = None
    tool_choice: Any = None
    response_format: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _supported(self):
        _unsupported("best_of > 1", self.best_of, (None, 1))
        _unsupported("tool calling (tools)", self.tools)
        _unsupported("function calling (functions)", self.functions)
        _unsupported("tool_choice", self.tool_choice, (None, "none", "auto"))
        if self.response_format is not None and self.response_format.get("type") != "text":
            raise ValueError("response_format other than {\"type\": \"text\"} is not supported by this server")
        return self

    @field_validator("logit_bias")
    @classmethod
    def _bias(cls, v: dict[str, float] | None) -> dict[str, float] | None:
        for k, b in (v or {}).items():
            if not (k.isascii() and k.isdigit()):  # int() would also take "²", " 5" or "1_0"
                raise ValueError(f"logit_bias keys must be token ids, got {k!r}")
            if not -100 <= b <= 100:
                raise ValueError(f"logit_bias values must be in [-100, 100], got {b}")
        return v

    @field_validator("n")
    @classmethod
    def _one_choice(cls, v: int) -> int:
        if v != 1:
            raise ValueError("only n=1 is supported")
        return v

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def sampling(self, max_new_tokens: int, logprobs: bool, top_logprobs: int = 0) -> dict[str, Any]:
        return dict(max_new_tokens=max_new_tokens, temperature=self.temperature, top_k=self.top_k or 0,
                    top_p=self.top_p, repetition_penalty=self.repetition_penalty or 1.0, seed=self.seed,
                    frequency_penalty=self.frequency_penalty, presence_penalty=self.presence_penalty,
                    logit_bias={int(k): b for k, b in (self.logit_bias or {}).items()},
                    stop=self.stop_list(), logprobs=logprobs, top_logprobs=top_logprobs,
                    cache_salt=self.cache_salt, ignore_eos=self.ignore_eos)


class CompletionRequest(_OpenAICommon):
    # one prompt: text or token ids; OpenAI's client also wraps one in a list ([text], [[ids]])
    prompt: str | list[int] | list[str] | list[list[int]] = Field(...)
    logprobs: int | None = Field(None, ge=0, le=5)  # with this many alternatives per token
    echo: bool = False
    suffix: str | None = None

    @model_validator(mode="after")
    def _no_suffix(self):
        _unsupported("suffix", self.suffix, (None, ""))
        if self.echo and self.logprobs is not None:
            raise ValueError("echo with logprobs (the prompt's log-probabilities) is not supported by this server")
        return self

    @field_validator("prompt", mode="after")
    @classmethod
    def _one_prompt(cls, v):
        if isinstance(v, list) and v and isinstance(v[0], (str, list)):
            if len(v) != 1:
                raise ValueError("one prompt per request (a batch of prompts is not supported)")
            v = v[0]
        return v

    @field_validator("prompt")
    @classmethod
    def _non_empty(cls, v):
        if (isinstance(v, str) and not v) or (isinstance(v, list) and not v):
            raise ValueError("prompt must not be empty")
        return v


class ChatMessage(_Strict):
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict[str, Any]]

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        parts = []
        for part in self.content:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ValueError("only text content parts are supported")
            parts.append(part["text"])
        return "".join(parts)


class ChatRequest(_OpenAICommon):
    messages: list[ChatMessage] = Field(..., min_length=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)

    @model_validator(mode="after")
    def _top_needs_logprobs(self):
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        return self


# ----------------------------------------------------------------------------- warm-up
class WarmupRequest(_Strict):
    prefixes: list[str | list[int]] = Field(..., min_length=1, max_length=256)
    cache_salt: str | None = None
