"""HTTP API shapes: TGI's ``/generate`` family and OpenAI's completions/chat, plus warm-up.

Requests are validated here (types, ranges) and turned into the engine's neutral parameter dict;
anything the engine checks against the model (length limits, vocabulary) comes back as an error
that the ingress maps onto the same API's error format.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator


class _Strict(BaseModel):
    model_config = ConfigDict(extra="ignore")


# ----------------------------------------------------------------------------- TGI
class TGIParameters(_Strict):
    max_new_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, gt=0)
    top_k: int | None = Field(None, gt=0)
    top_p: float | None = Field(None, gt=0, le=1)
    repetition_penalty: float | None = Field(None, gt=0)
    seed: int | None = Field(None, ge=0)
    stop: list[str] = Field(default_factory=list, max_length=16)
    do_sample: bool = False
    details: bool = False
    return_full_text: bool = False
    decoder_input_details: bool = False
    cache_salt: str | None = None


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
                    seed=p.seed, stop=p.stop, logprobs=True, cache_salt=p.cache_salt)


TGI_FINISH = {"length": "length", "eos": "eos_token", "stop": "stop_sequence", "abort": "length"}


# ----------------------------------------------------------------------------- OpenAI
class StreamOptions(_Strict):
    include_usage: bool = False


class _OpenAICommon(_Strict):
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
    user: str | None = None
    cache_salt: str | None = None  # tenant isolation of the prefix cache (as vLLM's field)
    ignore_eos: bool = False  # extension (as vLLM's): generate max_tokens even past EOS

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

    def sampling(self, default_max_new_tokens: int, logprobs: bool) -> dict[str, Any]:
        return dict(max_new_tokens=self.max_completion_tokens or self.max_tokens or default_max_new_tokens,
                    temperature=self.temperature, top_k=self.top_k or 0, top_p=self.top_p,
                    repetition_penalty=self.repetition_penalty or 1.0, seed=self.seed, stop=self.stop_list(),
                    logprobs=logprobs, cache_salt=self.cache_salt, ignore_eos=self.ignore_eos)


class CompletionRequest(_OpenAICommon):
    prompt: str | list[int] = Field(...)
    logprobs: int | None = Field(None, ge=0, le=5)
    echo: bool = False

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


# ----------------------------------------------------------------------------- warm-up
class WarmupRequest(_Strict):
    prefixes: list[str | list[int]] = Field(..., min_length=1, max_length=256)
    cache_salt: str | None = None
