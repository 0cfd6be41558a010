"""HTTP API shapes: TGI's ``/generate`` family and OpenAI's completions/chat, plus warm-up.

Requests are validated here (types, ranges) and turned into the engine's neutral parameter dict;
anything the engine checks against the model (length limits, vocabulary) comes back as an error
that the ingress maps onto the same API's error format.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, field_validator, model_validator

from app.tool_calls import can_guide_arguments, named_schema, required_schema, template_tool_calls
from engine.sequence import GREEDY_BELOW, MAX_STOP_STRINGS, MAX_TOP_LOGPROBS, encodable

# a tenant's id, not data: each salt keeps its own trie on the replicas while it has cached blocks.
# Not empty (as vLLM): "" would read as unsalted in the hashes and the directory, and as a tenant elsewhere
MAX_CACHE_SALT_CHARS = 1024


MAX_NESTING = 100  # (deeper, the checks and templates that walk a body recursively would overflow Python's stack)


def _check_text(value: Any, path: str = "", depth: int = 0) -> None:
    """Strings must be valid Unicode: JSON can carry a lone surrogate (``"\\ud800"``), which no
    tokenizer can encode. Numbers must be finite (Python's JSON reads ``NaN``, which no answer that
    echoes a field, a tool's schema say, could write back). Nesting is bounded."""
    if isinstance(value, str):
        if not encodable(value):
            raise ValueError(f"{path or 'text'} is not valid Unicode (it holds a lone surrogate)")
    elif isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError(f"{path or 'a number'} must be a finite number, got {value}")
    elif isinstance(value, (list, dict)):
        if depth >= MAX_NESTING:
            raise ValueError(f"the body is nested more than {MAX_NESTING} levels deep")
        if isinstance(value, list):
            for i, v in enumerate(value):
                if isinstance(v, (str, list, dict, float)):  # not per token id: a 2 MB prompt of ids is 400k
                    _check_text(v, f"{path}[{i}]", depth + 1)
            return
        for k, v in value.items():
            if isinstance(k, str) and not encodable(k):
                raise ValueError("a field name is not valid Unicode (it holds a lone surrogate)")
            _check_text(v, f"{path}.{k}" if path else str(k), depth + 1)


class _Strict(BaseModel):
    # strict: "5" is not a number and true is not a count (clients that send them have a bug);
    # unknown fields are ignored, as TGI's and vLLM's servers do (OpenAI's clients send fields such as
    # "user" or "store" that change nothing here), except the ones in REFUSED below
    model_config = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _valid_unicode(cls, data: Any) -> Any:
        _check_text(data)
        return data


def content_text(content: Any, where: str, fields: Mapping[str, str], sep: str = "",
                 stand_in: str | None = None) -> str:
    """A message's content as text: a string, or a list of parts whose ``type`` is one of ``fields``, each
    holding its text under that field (``{"text": "text"}``: ``[{"type": "text", "text": ...}]``), joined
    by ``sep``. Other parts are refused, or stand as ``stand_in`` (a tool's image, say, that the model
    cannot see: a conversation that holds one must go on)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ValueError(f"{where} must be a string or a list of content parts")
    texts = []
    for i, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        kind = kind if isinstance(kind, str) else None  # (a list or an object is no type name)
        if kind in fields and isinstance(part.get(fields[kind]), str):
            texts.append(part[fields[kind]])
        elif kind in fields:
            raise ValueError(f"{where}[{i}].{fields[kind]} must be a string")
        elif stand_in is not None:
            texts.append(stand_in.format(kind=kind))
        else:
            raise ValueError(f"{where}[{i}]: only text parts ({', '.join(fields)}) are supported by this server, "
                             f"got {kind!r}")
    return sep.join(texts)


def _unsupported(name: str, value: Any, allowed: tuple = (None,)) -> None:
    if value not in allowed and value != [] and value != {}:
        raise ValueError(f"{name} is not supported by this server")


# Fields of OpenAI's API and of vLLM's extensions that would change the answer if honoured: refused by
# name rather than ignored (a client moving over from vLLM must not get unconstrained JSON silently).
# Each passes with the values that mean "not used" (what clients send for an unset option).
_OFF = (None, False, [], {}, "")
REFUSED: dict[str, tuple[str, tuple]] = {
    "functions": ("function calling", _OFF),
    "guided_whitespace_pattern": ("a whitespace pattern for guided decoding", _OFF),
    "use_beam_search": ("beam search", _OFF),
    "length_penalty": ("beam search", (None, 1, 1.0)),
    "logits_processors": ("logits processors", _OFF),
    "spaces_between_special_tokens": ("false", (None, True)),
    "chat_template": ("a chat template per request", _OFF),
    "documents": ("chat documents", _OFF),
    "mm_processor_kwargs": ("multimodal inputs", _OFF),
    "audio": ("audio output", _OFF),
    "web_search_options": ("web search", _OFF),
    "return_tokens_as_token_ids": ("return_tokens_as_token_ids", _OFF),
    "lora_request": ("LoRA adapters", _OFF),
}


def _refuse_named(data: Any, also: dict[str, tuple[str, tuple]] | None = None) -> None:
    if not isinstance(data, dict):
        return
    for name, (what, unused) in {**REFUSED, **(also or {})}.items():
        if name in data and not any(type(data[name]) is type(u) and data[name] == u or data[name] is u
                                    for u in unused):  # type too: 0 is not False
            raise ValueError(f"{name}: {what} is not supported by this server")
    if data.get("modalities") not in (None, ["text"]):
        raise ValueError("modalities: only [\"text\"] is supported by this server")


# ----------------------------------------------------------------------------- TGI
MAX_TOOLS = 128  # OpenAI's own limit
MAX_BEST_OF = 16  # TGI's --max-best-of is 2 by default; one replica runs them side by side


class TGIParameters(_Strict):
    max_new_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, gt=0)
    top_k: int | None = Field(None, gt=0)  # as TGI's router: 0 and -1 are refused, only None is "off"
    top_p: float | None = Field(None, gt=0, le=1)
    repetition_penalty: float | None = Field(None, gt=0)
    seed: int | None = Field(None, ge=0)
    stop: list[str] = Field(default_factory=list, max_length=MAX_STOP_STRINGS)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    truncate: int | None = Field(None, ge=1)  # keep only the last this many prompt tokens
    top_n_tokens: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)  # alternatives per token (details)
    do_sample: bool = False
    details: bool = False
    return_full_text: bool | None = None  # (TGI's is nullable: null is false)
    decoder_input_details: bool = False
    best_of: int | None = Field(None, ge=1, le=MAX_BEST_OF)  # sequences sampled; the likeliest is the answer
    watermark: bool = False
    grammar: Any = None
    typical_p: float | None = Field(None, gt=0, le=1)  # locally typical sampling (1.0: off)
    adapter_id: str | None = None
    cache_salt: str | None = Field(None, min_length=1, max_length=MAX_CACHE_SALT_CHARS)

    def samples(self) -> bool:
        """Whether the request samples: asked to, or any of TGI's filters set (a temperature too small to
        divide by is greedy in the engine)."""
        sample = (self.do_sample or self.temperature not in (None, 1.0) or self.top_k is not None
                  or self.top_p not in (None, 1.0) or self.typical_p not in (None, 1.0))
        return sample and (self.temperature or 1.0) >= GREEDY_BELOW

    @model_validator(mode="after")
    def _supported(self):
        if (self.best_of or 1) > 1:  # as TGI's router
            if not self.samples():
                raise ValueError("best_of > 1 needs sampling (do_sample, temperature, top_k, top_p or typical_p)")
            if self.seed is not None:
                raise ValueError("seed must not be set when best_of > 1 (each sequence draws with its own)")
        _unsupported("watermark", self.watermark, (False,))
        _tgi_guide(self.grammar)  # (raises for a malformed one)
        _unsupported("adapter_id (LoRA adapters)", self.adapter_id)
        self.details = self.details or self.decoder_input_details  # as TGI's router: the prompt's come in details
        return self


def _schema_text(schema: Any, what: str) -> str:
    """A JSON schema sent as an object or as its JSON text, as text."""
    if isinstance(schema, str):
        return schema
    if not isinstance(schema, dict):
        raise ValueError(f"{what} must be a JSON schema (an object)")
    return json.dumps(schema)


def _tgi_guide(grammar: Any, where: str = "grammar") -> tuple[str, str] | None:
    """TGI's ``grammar`` (``where``: its field): ``{"type": "json" | "json_object", "value": schema}``, ``{"type":
    "json_schema", "value": {"name": ..., "schema": schema}}`` or ``{"type": "regex", "value": "..."}``."""
    if grammar is None:
        return None
    kind = grammar.get("type") if isinstance(grammar, dict) else None
    value = grammar.get("value") if isinstance(grammar, dict) else None
    if kind in ("json", "json_object"):  # (TGI takes json_object as another name of json)
        return "json", _schema_text(value, f"{where}.value")
    if kind == "json_schema":
        return "json", _schema_text(value.get("schema") if isinstance(value, dict) else None, f"{where}.value.schema")
    if kind == "regex" and isinstance(value, str):
        return "regex", value
    raise ValueError(f'{where} must be {{"type": "json" | "json_object" | "json_schema" | "regex", "value": ...}}')


class TGIRequest(_Strict):
    inputs: str = Field(..., min_length=1)
    parameters: TGIParameters = Field(default_factory=TGIParameters)
    stream: bool = False
    add_special_tokens: bool = True  # (TGI's: false for a text that already holds them, a rendered chat's BOS)

    def sampling(self, max_new_tokens: int) -> dict[str, Any]:
        """The engine's sampling parameters (``max_new_tokens``: what the request asked for, cut to the room
        its context leaves)."""
        p = self.parameters
        sample = p.samples()
        return dict(max_new_tokens=max_new_tokens,
                    temperature=(p.temperature or 1.0) if sample else 0.0,
                    top_k=p.top_k or 0, top_p=p.top_p or 1.0, typical_p=p.typical_p or 1.0,
                    repetition_penalty=p.repetition_penalty or 1.0,
                    # TGI's frequency penalty: over prompt and output, per token of the context
                    frequency_penalty=p.frequency_penalty or 0.0, frequency_penalty_per_context=True,
                    top_logprobs=p.top_n_tokens or 0,
                    # a greedy answer has no seed to report; TGI keeps the stop sequence in the text
                    seed=p.seed if sample else None, stop=p.stop, include_stop_str_in_output=True, logprobs=True,
                    processed_logprobs=True,  # TGI reports the warped distribution's (temperature, top-k, ...)
                    # details.prefill: the prompt tokens' own log-probabilities
                    prompt_logprobs=0 if p.decoder_input_details else None, cache_salt=p.cache_salt,
                    guide=_tgi_guide(p.grammar))


TGI_FINISH = {"length": "length", "eos": "eos_token", "stop": "stop_sequence", "abort": "length"}


# ----------------------------------------------------------------------------- OpenAI
class StreamOptions(_Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: with include_usage, every chunk says the usage so far

    @model_validator(mode="before")
    @classmethod
    def _nulls_are_defaults(cls, data: Any) -> Any:  # (nullable in OpenAI's spec, as vLLM's)
        return {k: v for k, v in data.items() if v is not None} if isinstance(data, dict) else data


MAX_CHOICES = 128  # OpenAI's own limit on n
MAX_BAD_WORDS = 256

# OpenAI's spec makes these nullable and its client sends null for a None argument: null means the default
NULL_IS_DEFAULT = frozenset({"temperature", "top_p", "top_k", "min_p", "typical_p", "repetition_penalty", "prompt_logprobs", "truncate_prompt_tokens",
                             "allowed_token_ids", "bad_words", "best_of", "priority",
                             "tools", "tool_choice", "parallel_tool_calls", "n", "stream", "frequency_penalty", "presence_penalty",
                             "logprobs", "echo", "ignore_eos", "min_tokens", "include_stop_str_in_output",
                             "skip_special_tokens", "add_generation_prompt", "continue_final_message",
                             "add_special_tokens"})


class _OpenAICommon(_Strict):
    _also_refused: ClassVar[dict[str, tuple[str, tuple]]] = {}  # per API

    @model_validator(mode="before")
    @classmethod
    def _nulls_are_defaults(cls, data: Any) -> Any:
        _refuse_named(data, cls._also_refused)
        if isinstance(data, dict):
            data = {k: v for k, v in data.items() if not (v is None and k in NULL_IS_DEFAULT)}
        return data

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1)  # extension (vLLM's): 0 and vLLM's -1 are off
    min_p: float = Field(0.0, ge=0, le=1)  # extension (vLLM's): 0 is off
    typical_p: float = Field(1.0, gt=0, le=1)  # extension (TGI's parameter): 1 is off
    repetition_penalty: float | None = Field(None, gt=0)  # extension
    n: int = Field(1, ge=1, le=MAX_CHOICES)  # choices: one engine request each, side by side
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    logit_bias: dict[str, float] | None = None  # token id (as a string) -> bias in [-100, 100]
    user: str | None = None
    cache_salt: str | None = Field(None, min_length=1, max_length=MAX_CACHE_SALT_CHARS)  # tenant isolation (as vLLM's field)
    ignore_eos: bool = False  # extension (as vLLM's): generate max_tokens even past EOS
    # vLLM's: lower is admitted first (and preempted last) on a server started with --scheduling-policy
    # priority; any other value than 0 is refused on a first-come, first-served one
    priority: int = Field(0, ge=-(2**63), lt=2**63)
    # extensions, as vLLM's
    stop_token_ids: list[Annotated[int, Field(ge=0)]] | None = Field(None, max_length=64)
    min_tokens: int = Field(0, ge=0)
    # the prompt tokens' own log-probabilities, with this many alternatives each (vLLM's; its -1, the
    # whole vocabulary, is refused)
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    # vLLM's: only these tokens may be generated; these words may not be (tokenized here)
    allowed_token_ids: list[Annotated[int, Field(ge=0)]] | None = Field(None, max_length=1 << 18)
    bad_words: list[Annotated[str, Field(min_length=1)]] | None = Field(None, max_length=MAX_BAD_WORDS)
    # keep only the prompt's last this many tokens (vLLM's; -1: as many as max_input_tokens), as TGI's truncate
    truncate_prompt_tokens: int | None = Field(None, ge=-1)
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    response_format: dict[str, Any] | None = None  # text, json_object or json_schema
    # vLLM's guided decoding fields (its guided_decoding_backend is taken as any name: llguidance serves)
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    structured_outputs: dict[str, Any] | None = None  # vLLM's newer form of the same: json, regex, choice, ...

    @model_validator(mode="after")
    def _supported(self):
        self.guide()  # (raises for a malformed one)
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed with stream: true")
        if any(not w.strip() for w in self.bad_words or ()):
            raise ValueError("bad_words must not be blank")
        if self.truncate_prompt_tokens == 0:
            raise ValueError("truncate_prompt_tokens must be at least 1 (or -1: the longest prompt this server takes)")
        if self.prompt_logprobs is not None and self.stream:  # as vLLM
            raise ValueError("prompt_logprobs is not available with stream: true")
        asked = self.requested_max_tokens()
        if asked is not None and self.min_tokens > asked:
            raise ValueError(f"min_tokens ({self.min_tokens}) is more than max_tokens ({asked})")
        return self

    @field_validator("stop")
    @classmethod
    def _few_stops(cls, v: str | list[str] | None) -> str | list[str] | None:
        if isinstance(v, list) and len(v) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop sequences, got {len(v)}")
        return v

    @field_validator("logit_bias")
    @classmethod
    def _bias(cls, v: dict[str, float] | None) -> dict[str, float] | None:
        for k, b in (v or {}).items():
            if not (k.isascii() and k.isdigit()):  # int() would also take "²", " 5" or "1_0"
                raise ValueError(f"logit_bias keys must be token ids, got {k!r}")
            if len(k) > 9:  # past every vocabulary (and past 4,300 digits, past what int() converts)
                raise ValueError(f"logit_bias key {k[:12]}... ({len(k)} digits) is not a token id")
            if not -100 <= b <= 100:
                raise ValueError(f"logit_bias values must be in [-100, 100], got {b}")
        return v

    def guide(self) -> tuple[str, str] | None:
        """The structured output this request asks for, as the engine's (kind, text) guide (at most one)."""
        found: list[tuple[str, str]] = []
        rf = self.response_format
        if rf is not None:
            kind = rf.get("type")
            if kind in ("json", "regex") or (kind == "json_object" and rf.get("value") is not None):
                # TGI's form, as huggingface_hub's chat_completion sends it: {"type": "json", "value": schema}
                # (json_object an alias of json there), {"type": "regex", "value": ...}
                found.append(_tgi_guide(rf, "response_format"))
            elif kind == "json_object":
                found.append(("json", '{"type": "object"}'))
            elif kind == "json_schema" and "json_schema" not in rf and "value" in rf:
                # TGI's json_schema form: {"type": "json_schema", "value": {"name": ..., "schema": ...}}
                found.append(_tgi_guide(rf, "response_format"))
            elif kind == "json_schema":
                spec = rf.get("json_schema")
                schema = spec.get("schema") if isinstance(spec, dict) else None
                found.append(("json", _schema_text(schema, "response_format.json_schema.schema")))
            elif kind != "text":
                raise ValueError("response_format type must be text, json_object or json_schema (or TGI's json "
                                 "and regex, with a value)")
        so = dict(self.structured_outputs or {})
        if so.pop("json_object", False):
            found.append(("json", '{"type": "object"}'))
        for src in (so, {"json": self.guided_json, "regex": self.guided_regex, "choice": self.guided_choice,
                         "grammar": self.guided_grammar}):
            for key, value in src.items():
                if value is None or value is False:
                    continue
                if key == "json":
                    found.append(("json", _schema_text(value, "guided_json")))
                elif key == "choice" and isinstance(value, list) and all(isinstance(c, str) for c in value):
                    found.append(("choice", json.dumps(value)))
                elif key in ("regex", "grammar") and isinstance(value, str):
                    found.append((key, value))
                else:
                    raise ValueError(f"structured_outputs.{key} is not supported by this server" if src is so
                                     else f"guided_{key} has the wrong type")
        if len(found) > 1:
            raise ValueError("ask for one structured output at most (response_format, guided_* or structured_outputs)")
        return found[0] if found else None

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def sampling(self, max_new_tokens: int, logprobs: bool, top_logprobs: int = 0,
                 defaults: Mapping[str, float] | None = None) -> dict[str, Any]:
        """The engine's sampling parameters. ``defaults`` (the model's, ``app.sampling_defaults``) stand in
        for the sampling fields this request did not send (or sent as null where null means the default)."""
        own = {name: getattr(self, name) for name in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")}
        given = {**own, **{k: v for k, v in (defaults or {}).items() if k in own and k not in self.model_fields_set}}
        return dict(max_new_tokens=max_new_tokens, temperature=given["temperature"],
                    top_k=max(given["top_k"] or 0, 0),  # vLLM's -1 is off, as 0
                    top_p=given["top_p"], min_p=given["min_p"], typical_p=self.typical_p,
                    repetition_penalty=given["repetition_penalty"] or 1.0, seed=self.seed,
                    frequency_penalty=self.frequency_penalty, presence_penalty=self.presence_penalty,
                    logit_bias={int(k): b for k, b in (self.logit_bias or {}).items()},
                    stop=self.stop_list(), logprobs=logprobs, top_logprobs=top_logprobs,
                    cache_salt=self.cache_salt, priority=self.priority, ignore_eos=self.ignore_eos,
                    stop_token_ids=list(self.stop_token_ids or ()), min_tokens=self.min_tokens,
                    prompt_logprobs=self.prompt_logprobs, allowed_token_ids=list(self.allowed_token_ids or ()),
                    guide=self.guide(),
                    include_stop_str_in_output=self.include_stop_str_in_output,
                    skip_special_tokens=self.skip_special_tokens)


class CompletionRequest(_OpenAICommon):
    _also_refused: ClassVar[dict[str, tuple[str, tuple]]] = {"suffix": ("suffix (text after the insertion)", _OFF)}
    # one prompt (text or token ids) or a list of them, each answered with n choices
    prompt: str | list[int] | list[str] | list[list[int]] = Field(...)
    logprobs: int | None = Field(None, ge=0, le=5)  # with this many alternatives per token
    echo: bool = False
    # 0 with echo: the prompt alone, scored (its log-probs), nothing generated (OpenAI's legacy scoring)
    max_tokens: int | None = Field(None, ge=0)
    best_of: int | None = Field(None, ge=1, le=MAX_CHOICES)  # sequences drawn; the n likeliest are the choices
    add_special_tokens: bool = True  # extension (vLLM's): false leaves out the BOS a text prompt gets

    def echo_only(self) -> bool:
        """Whether the answer is the echoed prompt alone (``max_tokens: 0`` with ``echo``)."""
        return self.max_tokens == 0 and not self.max_completion_tokens

    @model_validator(mode="after")
    def _best_of_n(self):
        if self.echo_only() and not self.echo:
            raise ValueError("max_tokens 0 generates nothing: it is only taken with echo: true (the prompt, scored)")
        if self.echo_only() and self.min_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) is more than max_tokens (0)")
        if self.best_of is not None and self.best_of < self.n:
            raise ValueError(f"best_of ({self.best_of}) must be at least n ({self.n})")
        if (self.best_of or 1) > 1 and self.stream:
            raise ValueError("best_of > 1 is not available with stream: true")
        return self

    @field_validator("prompt")
    @classmethod
    def _non_empty(cls, v):
        many = isinstance(v, list) and bool(v) and isinstance(v[0], (str, list))
        if not v or (many and not all(v)):
            raise ValueError("prompt must not be empty" + (" (nor any prompt in its list)" if many else ""))
        if many and len(v) > MAX_CHOICES:
            raise ValueError(f"at most {MAX_CHOICES} prompts in one request, got {len(v)}")
        for ids in (v if many else [v]):  # (the vocabulary's bound is the engine's to check; a tokenizer
            if isinstance(ids, list) and not 0 <= min(ids) <= max(ids) < 2**31:  # overflows past these)
                raise ValueError("prompt token ids must be 0 or more (and under 2**31)")
        return v

    def prompts(self) -> list[str | list[int]]:
        """The prompts, one or more: a text or a list of token ids is one."""
        v = self.prompt
        return v if isinstance(v, list) and isinstance(v[0], (str, list)) else [v]


class ToolFunction(_Strict):
    name: str = Field(..., pattern=r"^[a-zA-Z0-9_.-]{1,64}$")  # OpenAI's names
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of its arguments
    strict: bool | None = None


class Tool(_Strict):
    type: Literal["function"]
    function: ToolFunction


class NamedToolChoice(_Strict):
    class _Name(_Strict):
        name: str

    type: Literal["function"]
    function: _Name


class HistoryToolCall(_Strict):
    """A tool call in a chat's history (an earlier assistant turn), as OpenAI's clients send it back."""

    class _Function(_Strict):
        name: str
        arguments: str | dict[str, Any]

    id: str | None = None
    type: Literal["function"] = "function"
    function: _Function


class ChatMessage(_Strict):
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict[str, Any]] | None = None  # none: an assistant turn of tool calls
    name: str | None = None  # the participant's (templates that know it render it)
    refusal: str | None = None  # an assistant answer that refused, as OpenAI sent it back: its text
    tool_calls: list[HistoryToolCall] | None = None
    tool_call_id: str | None = None  # a tool's answer: to which call
    # an earlier answer's thinking, as the reasoning parser gave it (vLLM's field; templates such as Qwen3's
    # render it for the turns after the last user message)
    reasoning_content: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _no_function_call(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("function_call"):  # OpenAI's older form of tool_calls
            raise ValueError("function_call (OpenAI's older form) is not supported: send tool_calls")
        return data

    @model_validator(mode="after")
    def _content_or_calls(self):
        if self.content is None and not (self.role == "assistant" and (self.tool_calls or self.refusal is not None)):
            raise ValueError(f"a {self.role} message needs content")
        if self.tool_calls and self.role != "assistant":
            raise ValueError("only assistant messages carry tool_calls")
        return self

    def for_template(self, where: str = "content") -> dict[str, Any]:
        """The message as chat templates read it ("developer" is OpenAI's newer name for the system role,
        which templates know: one they do not know is dropped (Qwen's) or rendered as a role the model
        never saw (Llama 3's)). ``where``: how an error names its content."""
        out: dict[str, Any] = {"role": "system" if self.role == "developer" else self.role, "content": self.text(where)}
        if self.content is None and self.refusal is not None:
            out["content"] = self.refusal
        if self.name is not None:
            out["name"] = self.name
        if self.tool_calls:
            out["tool_calls"] = template_tool_calls([c.model_dump() for c in self.tool_calls])
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        if self.reasoning_content is not None:
            out["reasoning_content"] = self.reasoning_content
        return out

    def text(self, where: str = "content") -> str:
        """Its text: a string, or its text parts (a refusal sent back counts as text) joined by a newline, as
        vLLM joins them; other parts are refused, naming the part."""
        return content_text(self.content, where, {"text": "text", "refusal": "refusal"}, "\n")


# what chat_template_kwargs may not set: apply_chat_template's own arguments, the request's fields, the
# template's functions and the tokenizer's special tokens
TEMPLATE_RESERVED = frozenset({
    "conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "padding", "truncation", "max_length", "return_tensors", "return_dict",
    "return_assistant_tokens_mask", "tokenizer_kwargs", "sanitize_control_tokens", "raise_exception",
    "strftime_now", "conversations", "bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token",
    "mask_token", "additional_special_tokens"})


class ChatPrompt(_Strict):
    """A chat rendered by the model's template: the messages and how their end is rendered."""

    messages: list[ChatMessage] = Field(..., min_length=1)
    # extensions, as vLLM's: end the prompt with the assistant's turn opening (default), or carry on
    # the last (assistant) message instead of starting a new one
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    # variables for the model's template (vLLM's field), e.g. Qwen3's {"enable_thinking": false}
    chat_template_kwargs: dict[str, Any] | None = None

    @field_validator("chat_template_kwargs")
    @classmethod
    def _template_variables(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:
        for key in v or {}:
            if not key.isidentifier() or key.startswith("_") or key in TEMPLATE_RESERVED:
                raise ValueError(f"chat_template_kwargs: {key!r} cannot be set (the request's own fields, the "
                                 "tokenizer's arguments and its special tokens are not template variables to override)")
        return v

    @model_validator(mode="after")
    def _tool_results_answer_calls(self):
        # OpenAI refuses a tool result that answers no call (templates would render it as if one was made);
        # ids are optional here (vLLM's), so only an id the history's calls do not have is refused
        ids: set[str] = set()
        called = False
        for i, m in enumerate(self.messages):
            if m.role == "assistant" and m.tool_calls:
                called = True
                ids.update(c.id for c in m.tool_calls if c.id is not None)
            elif m.role == "tool":
                if not called:
                    raise ValueError(f"messages[{i}]: a tool message answers a call, and no assistant message "
                                     "before it has tool_calls")
                if m.tool_call_id is not None and ids and m.tool_call_id not in ids:
                    raise ValueError(f"messages[{i}]: tool_call_id {m.tool_call_id!r} is not the id of a tool call "
                                     "made before it")
        return self

    @model_validator(mode="after")
    def _continued_turn(self):
        if self.continue_final_message:
            if self.add_generation_prompt:
                raise ValueError("continue_final_message needs add_generation_prompt: false")
            if self.messages[-1].role != "assistant":
                raise ValueError("continue_final_message needs the last message to be the assistant's")
        return self


class ChatRequest(_OpenAICommon, ChatPrompt):
    # vLLM's chat extras: the template adds the special tokens (true would add a second BOS); echo
    # would prepend the last message
    _also_refused: ClassVar[dict[str, tuple[str, tuple]]] = {
        "add_special_tokens": ("true in chat (the chat template adds the special tokens)", (None, False)),
        "echo": ("echo in chat", (None, False)), "best_of": ("best_of > 1 in chat", (None, 1))}
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: list[Tool] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    # what a tool that leaves strict unsaid is: chat's default, not strict; OpenAI's Responses API's is strict
    # (set by the route; a field of the request would show in what the template renders of the tools)
    _strict_unless_said: bool = PrivateAttr(default=False)

    @model_validator(mode="after")
    def _top_needs_logprobs(self):
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        names = [t.function.name for t in self.tools or ()]
        if len(set(names)) < len(names):  # (which one would a call, or a named tool_choice, mean?)
            raise ValueError(f"tool names must be unique: {sorted({n for n in names if names.count(n) > 1})}")
        return self

    @model_validator(mode="before")
    @classmethod
    def _tool_choice_needs_tools(cls, data: Any) -> Any:
        if isinstance(data, dict) and not data.get("tools") and data.get("tool_choice") not in (None, "none", "auto"):
            raise ValueError("tool_choice other than none or auto needs tools")
        return data

    def tool_mode(self) -> str:
        """How this request may call tools: "none", "auto" (the model decides; its calls are read from
        its text), "required" (one call at least) or "named" (that one function)."""
        if not self.tools or self.tool_choice == "none":
            return "none"
        if isinstance(self.tool_choice, NamedToolChoice):
            return "named"
        return self.tool_choice or "auto"

    def tools_strictness(self) -> list[tuple[str, dict[str, Any] | None, bool]]:
        """Each tool's (name, parameters, strict): as it says; unsaid, the route's default (the Responses
        API's strict holds only where a guide can hold the schema: unguided then, not refused)."""
        return [(t.function.name, t.function.parameters,
                 t.function.strict if t.function.strict is not None
                 else self._strict_unless_said and can_guide_arguments(t.function.parameters))
                for t in self.tools or ()]

    def named_tool(self) -> ToolFunction:
        name = self.tool_choice.function.name
        for t in self.tools:
            if t.function.name == name:
                return t.function
        raise ValueError(f"tool_choice names {name!r}, which is not one of the tools")

    def guide(self) -> tuple[str, str] | None:
        own = super().guide()
        mode = self.tool_mode()
        if mode not in ("named", "required"):
            return own
        # a response format holds a text answer, which a turn that must call a tool has none of: the calls
        # are guided (the OpenAI Agents SDK sends both, an output type with tool_choice required); a
        # guided_* of the request's own is one structured output too many
        extensions = (self.structured_outputs, self.guided_json, self.guided_regex, self.guided_choice,
                      self.guided_grammar)
        if own is not None and any(x is not None and x is not False for x in extensions):
            raise ValueError("ask for one structured output at most (a required or named tool_choice is one)")
        if mode == "named":
            return "json", named_schema(self.named_tool().parameters)
        return "json", required_schema([(t.function.name, t.function.parameters) for t in self.tools],
                                       self.parallel_tool_calls is not False)


# ----------------------------------------------------------------------------- tokenizer routes
class TGITokenizeRequest(_Strict):
    """TGI's ``/tokenize``: a generate request's body (of its parameters, truncate is used, as by TGI)."""

    inputs: str = Field(..., min_length=1)
    parameters: TGIParameters = Field(default_factory=TGIParameters)
    add_special_tokens: bool = True


class TokenizeRequest(_Strict):
    """vLLM's ``/tokenize`` of a text."""

    model: str | None = None
    prompt: str = Field(..., min_length=1)
    add_special_tokens: bool = True
    return_token_strs: bool = False


class ChatTokenizeRequest(ChatPrompt):
    """vLLM's ``/tokenize`` of a chat, rendered as ``/v1/chat/completions`` renders it (its tools too)."""

    model: str | None = None
    tools: list[Tool] | None = Field(None, max_length=MAX_TOOLS)
    return_token_strs: bool = False


class DetokenizeRequest(_Strict):
    model: str | None = None
    tokens: list[Annotated[int, Field(ge=0)]] = Field(..., max_length=1_000_000)


# ----------------------------------------------------------------------------- warm-up
class WarmupChat(ChatPrompt):
    """A chat's prefix to warm (its system prompt, its tools), rendered as the chat route renders it: a text
    is tokenized as a completion's prompt, and a chat template puts its own tokens first, so a warmed text
    is no chat's prefix. What the chats that start with it share, unless its end is asked for (the ingress's
    ``_warmed_chat``)."""

    add_generation_prompt: bool = False
    tools: list[Tool] | None = Field(None, max_length=MAX_TOOLS)


class WarmupRequest(_Strict):
    prefixes: list[str | list[int] | WarmupChat] = Field(..., min_length=1, max_length=256)
    cache_salt: str | None = Field(None, min_length=1, max_length=MAX_CACHE_SALT_CHARS)
