"""Guided decoding (structured outputs): a request's tokens are held to a JSON schema, a regular
expression, a list of choices or a grammar. llguidance (Rust, no other dependency) keeps each request's
parser state and says which tokens may come next; the sampler masks the rest, and a request ends once
its grammar is complete."""

from __future__ import annotations

import functools
import json
import os
import re
import threading
from typing import Any

import torch

# a request's guide: (kind, text). "json": a JSON schema as text ('{"type": "object"}' for any object),
# "regex": a regular expression the whole answer matches, "choice": a JSON list of strings, "grammar": a
# Lark or GBNF grammar (llguidance's syntax)
GUIDE_KINDS = ("json", "regex", "choice", "grammar")
MAX_GUIDE_CHARS = 1 << 16  # a schema or grammar larger than this is refused before it is compiled
# separators as Python's json.dumps writes them and no other whitespace between tokens: flexible whitespace
# lets a model pad its answer with newlines up to its token limit, a known failure of JSON modes
JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
LENIENT_JSON_STYLE = {**JSON_STYLE, "lenient": True}  # keywords llguidance does not implement are let be
CHECKED_GUIDES = 256  # guides whose check is remembered


class GuideError(ValueError):
    """A guide that cannot be compiled (a bad schema, regex or grammar): the request is refused."""


def _llguidance():
    try:
        import llguidance
        import llguidance.hf
    except ImportError as e:  # pragma: no cover - a dependency of the package
        raise GuideError(f"guided decoding needs the llguidance package ({e})") from None
    return llguidance


def grammar_text(kind: str, text: str) -> str:
    """llguidance's grammar of a guide, checked (``GuideError`` says what is wrong with it)."""
    if kind not in GUIDE_KINDS:
        raise GuideError(f"unknown guide kind {kind!r} (one of {', '.join(GUIDE_KINDS)})")
    if not isinstance(text, str) or not text:
        raise GuideError(f"the {kind} guide must be a non-empty text")
    if len(text) > MAX_GUIDE_CHARS:
        raise GuideError(f"the {kind} guide has {len(text)} characters, more than {MAX_GUIDE_CHARS}")
    if kind in ("json", "choice"):
        try:
            value = json.loads(text)
        except ValueError as e:
            raise GuideError(f"the {kind} guide is not JSON: {e}") from None
        except RecursionError:
            raise GuideError(f"the {kind} guide is nested too deeply") from None
        if kind == "choice" and (not isinstance(value, list) or not value or not all(isinstance(c, str) for c in value)):
            raise GuideError("the choice guide must be a non-empty list of strings")
        if kind == "json" and not isinstance(value, dict):
            raise GuideError("the JSON schema must be an object")
        if kind == "json":
            try:  # (a schema given as a string skips the body's nesting bound: json reads deeper than these walk)
                text = json.dumps(_styled(value))
            except RecursionError:
                raise GuideError(f"the {kind} guide is nested too deeply") from None
    llg = _llguidance()
    try:
        grammar = llg.grammar_from("json_schema" if kind == "json" else kind, text)
    except Exception as e:  # noqa: BLE001 - its parse errors come as several exception types
        raise GuideError(f"the {kind} guide cannot be compiled: {_first_line(e)}") from None
    problem = llg.LLMatcher.validate_grammar(grammar)
    if problem:
        raise GuideError(f"the {kind} guide cannot be compiled: {_first_line(problem)}")
    return grammar


_BOUNDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")
_COUNTS = ("minLength", "maxLength", "minItems", "maxItems", "minProperties", "maxProperties")
SCHEMA_DATA_KEYS = ("const", "enum", "default", "examples")  # data, not schemas: kept as they are
# keywords whose object maps names (a property's, a definition's) to schemas: a property named "default"
# or "enum" is a schema like any other
NAMED_SCHEMAS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas", "dependencies")
WIDEST_BOUND = 2**63 - 2  # past it llguidance cannot write a number range (int64's bounds, 1e20, float32's)


def walk_schema(schema, visit):
    """``schema`` rebuilt bottom up: each schema in it (an object in a schema's place) goes through ``visit``
    once the schemas inside it have; names (a property's) and data (``const``, ``enum``, ``default``,
    ``examples``) are kept as they are."""
    if isinstance(schema, list):
        return [walk_schema(v, visit) for v in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for key, v in schema.items():
        if key in SCHEMA_DATA_KEYS:
            out[key] = v
        elif key in NAMED_SCHEMAS and isinstance(v, dict):
            out[key] = {name: walk_schema(sub, visit) for name, sub in v.items()}
        else:
            out[key] = walk_schema(v, visit)
    return visit(out)


def _loosened_one(schema: dict) -> dict:
    out = {}
    for key, v in schema.items():
        numeric = isinstance(v, (int, float)) and not isinstance(v, bool)
        if key in _BOUNDS and numeric and (v if key.endswith("aximum") else -v) > WIDEST_BOUND:
            continue  # (one that holds numbers in, a minimum past int64's largest, is kept: llguidance refuses it)
        if key in _COUNTS and isinstance(v, float) and v.is_integer():
            v = int(v)
        out[key] = v
    return out


def _loosened(schema):
    """A JSON schema as llguidance compiles it: a numeric bound that lets past ``WIDEST_BOUND`` (int64's, as
    OpenAPI tools declare them) left out, as no answer comes near it, and a count written as a float (5.0) as the
    integer it is. llguidance refused both: a valid tool was a 400."""
    return walk_schema(schema, _loosened_one)


def _styled(schema: dict) -> dict:
    """A JSON guide's schema, loosened (``_loosened``), in ``JSON_STYLE`` unless it sets its own ``x-guidance``."""
    schema = _loosened(schema)
    return schema if "x-guidance" in schema else {**schema, "x-guidance": JSON_STYLE}


def _tag(text: str, token_id: int | None) -> str:
    """A call tag in a grammar: its text, or the model's own token where it is one (see tagged_calls_grammar)."""
    return json.dumps(text) if token_id is None else f"<[{token_id}]>"


def tagged_calls_grammar(open_tag: str, close_tag: str, call_schema: dict, parallel: bool = True,
                         tag_ids: tuple[int | None, int | None] = (None, None), text_excludes: tuple[str, ...] = ()
                         ) -> str:
    """A grammar (llguidance's Lark) of an answer that may call tools as it goes: free text, in which each
    ``open_tag`` begins a call held to ``call_schema`` (a JSON schema) up to its ``close_tag``. The text
    itself cannot hold ``open_tag`` otherwise: a call begun is a call, whole (strict tools under
    ``tool_choice: auto``). A call's JSON may sit on lines of its own, as Hermes templates show it. Not
    ``parallel``: one call at most. ``tag_ids``: the tags' token ids where each is one added token of the
    model's (Qwen's): llguidance reads such a token as special, which free text never allows, so the grammar
    names it by its id (the spelled-out tag is no call then, and no text either). ``text_excludes``: other
    tags the text may not hold (thinking's, so a guide that waits for the end of the thinking does: one
    whose text could write the tag itself would hold the thinking too, from the first token). Keywords of
    the schema llguidance does not implement are let be (``lenient``)."""
    schema = {**_loosened(call_schema), "x-guidance": LENIENT_JSON_STYLE}
    excluded = "|".join(_escaped(tag) for tag in (open_tag, *text_excludes))
    open_id, close_id = tag_ids
    close = _tag(close_tag, close_id)
    rest = f"/[ \\n]{{0,2}}/ call_body /[ \\n]{{0,2}}/ {close}"
    return "\n".join([
        "%llguidance {}",
        f"start: call{'*' if parallel else '?'} TEXT",
        *([f"call: call_open {rest}", f"call_open[lazy]: TEXT {json.dumps(open_tag)}"]  # (the text ends where the tag begins)
          if open_id is None else [f"call: TEXT {_tag(open_tag, open_id)} {rest}"]),
        f"call_body: %json {json.dumps(schema)}",
        f"TEXT: /(.|\\n)*/ & ~/(.|\\n)*({excluded})(.|\\n)*/"])


def format_or_calls_grammar(answer_schema: dict, open_tag: str, close_tag: str, call_schema: dict,
                            parallel: bool = True, tag_ids: tuple[int | None, int | None] = (None, None)) -> str:
    """A grammar of an answer held to a format (``answer_schema``, a JSON schema) that may call tools
    instead (``tool_choice: auto`` beside a response format, as OpenAI's and Anthropic's take it): either
    that JSON, or tagged calls each held to ``call_schema`` (``tagged_calls_grammar``'s tags; not
    ``parallel``: one call), with no text around them but a line break or two (a thinking model's answer
    begins with them after its ``</think>``, and white space without end would let a model pad the answer
    up to its token limit)."""
    call = {**_loosened(call_schema), "x-guidance": LENIENT_JSON_STYLE}
    open_, close = _tag(open_tag, tag_ids[0]), _tag(close_tag, tag_ids[1])
    return "\n".join([
        "%llguidance {}",
        f"start: /[ \\n]{{0,2}}/ answer | call{'+' if parallel else ''} /[ \\n]{{0,2}}/",
        f"answer: %json {json.dumps(_styled(answer_schema))}",
        f"call: /[ \\n]{{0,2}}/ {open_} /[ \\n]{{0,2}}/ call_body /[ \\n]{{0,2}}/ {close}",
        f"call_body: %json {json.dumps(call)}"])


def untagged_calls_grammar(call_schema: dict, parallel: bool = True, answer_schema: dict | None = None,
                           text_excludes: tuple[str, ...] = (), skipped: str = "") -> str:
    """A grammar of an answer that is either JSON calls, each held to ``call_schema`` and separated by
    ``;`` (Llama 3's format: a call is the whole answer, untagged; not ``parallel``: one call), or else
    ``answer_schema``'s JSON (a response format beside the tools) or, without one, free text that does not
    begin with ``{`` (which the parser would read as a call; ``text_excludes``: tags the text may not
    hold, as ``tagged_calls_grammar``'s; ``skipped``: a tag the parser skips before calls, Llama's
    ``<|python_tag|>``, which the text may not begin with either). A line break or two may stand around
    either. (The text's white space is any, as the parser's ``str.strip`` skips.)"""
    call = {**_loosened(call_schema), "x-guidance": LENIENT_JSON_STYLE}
    gap = "/[ \\n]{0,2}/"
    excluded = "|".join(_escaped(tag) for tag in text_excludes)
    space = "[\\s\\x1c-\\x1f]"  # (what Python's str.strip skips: llguidance's \\s has no \\x1c-\\x1f)
    text = f"/{space}*[^{{\\s\\x1c-\\x1f](.|\\n)*/" + (f" & ~/(.|\\n)*({excluded})(.|\\n)*/" if excluded else "") \
        + (f" & ~/{space}*{_escaped(skipped)}(.|\\n)*/" if skipped else "")
    more = f' ({gap} ";" {gap} call)*' if parallel else ""
    return "\n".join([
        "%llguidance {}",
        f"start: {gap} calls {gap} | " + ("answer" if answer_schema is not None else "TEXT?"),
        f"calls: call{more}",
        f"call: %json {json.dumps(call)}",
        f"answer: {gap} %json {json.dumps(_styled(answer_schema))}" if answer_schema is not None else f"TEXT: {text}"])


def _escaped(tag: str) -> str:
    """``tag`` as a literal inside a grammar's regular expression."""
    return "".join(f"\\{c}" if c in r".^$*+?()[]{}|\/" else c for c in tag)


def lenient_schema_problem(schema: dict) -> str | None:
    """Why llguidance cannot hold a JSON to ``schema`` even leniently (an invalid type, a ``$ref`` to
    nothing, a regex it cannot run), in a line; None where it can."""
    return _schema_problem(json.dumps({**_loosened(schema), "x-guidance": LENIENT_JSON_STYLE}, sort_keys=True))


@functools.lru_cache(maxsize=256)  # (a client sends its tools with every request)
def _schema_problem(text: str) -> str | None:
    llg = _llguidance()
    try:
        problem = llg.LLMatcher.validate_grammar(llg.grammar_from("json_schema", text))
    except Exception as e:  # noqa: BLE001 - its parse errors come as several exception types
        problem = str(e)
    if not problem:
        return None
    first = _first_line(problem).split(" | ")[0]  # (not the grammar's lines it quotes)
    return re.sub(r"^at \d+\(\d+\): (failed to compile JSON schema: )?", "", first).strip()


def _first_line(e: object) -> str:
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    return " ".join(lines[:2]) if lines else type(e).__name__


class Guides:
    """One engine's guided decoding: its tokenizer as llguidance reads it, made when the engine starts
    (a second or so for a large vocabulary: not in a request's way), with the engine's end-of-sequence
    ids, which end a complete guide; and the matchers of its requests."""

    def __init__(self, tokenizer, vocab_size: int, eos_ids: set[int]):
        self._ll_tokenizer, self._problem = None, None
        self._tokenizer = tokenizer
        # guides checked lately -> their compiled matcher, in its start state: a request's guide is checked
        # as it arrives, and its matcher is a copy of it (compiling a large schema takes a second or more,
        # which the engine thread would spend again for each request of it, holding every other one)
        self._checked: dict[tuple[str, str], Any] = {}
        # checks run in the replica's validation threads and in the engine's thread: one at a time in here
        self._checked_lock = threading.Lock()
        try:
            ends = sorted(t for t in eos_ids if t < len(tokenizer))  # (ids past the tokenizer's vocabulary: no text)
            self._ll_tokenizer = _llguidance().hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=ends or None)
        except Exception as e:  # noqa: BLE001 - llguidance reads fast (tokenizers) tokenizers only
            self._problem = f"guided decoding cannot read this model's tokenizer: {_first_line(e)}"

    def check(self, kind: str, text: str):
        """The guide's matcher in its start state (not to be advanced: ``matcher`` copies it), compiled and
        checked against this model's tokenizer (``GuideError``: why it cannot be used). Safe beside the
        engine's thread, so a bad guide is refused before it is queued."""
        key = (kind, text)
        with self._checked_lock:
            if (known := self._checked.pop(key, None)) is not None:
                self._checked[key] = known  # (to the newest end: the guides in use are the ones kept)
                return known
        grammar = grammar_text(kind, text)
        if self._ll_tokenizer is None:
            raise GuideError(self._problem)
        llg = _llguidance()
        problem = llg.LLMatcher.validate_grammar(grammar, self._ll_tokenizer)
        if problem:
            raise GuideError(f"the {kind} guide cannot be used: {_first_line(problem)}")
        first = llg.LLMatcher(self._ll_tokenizer, grammar)
        first.compute_bitmask()  # a guide whose language is empty says so at its first mask
        if first.is_error():  # (it would allow only the end: an empty answer, finish "stop")
            raise GuideError(f"the {kind} guide matches no text (llguidance: {first.get_error().strip().splitlines()[0]})")
        with self._checked_lock:  # (compiled outside it: two threads may check one new guide at once)
            if key not in self._checked and len(self._checked) >= CHECKED_GUIDES:
                self._checked.pop(next(iter(self._checked)))  # (the least recently used; a dict keeps its order)
            self._checked[key] = first
        return first

    def _spelt(self, matcher, text: str) -> list[int] | None:
        """``text`` spelt out in tokens (no added tokens), where a guide's parser state may go on with it."""
        ids = self._ll_tokenizer.greedy_tokenize(text)
        return ids if ids and matcher.validate_tokens(ids) == len(ids) else None

    def allows_text(self, matcher, text: str) -> bool:
        """Whether a guide's parser state may go on with ``text`` (spelt out: no added tokens)."""
        return self._spelt(matcher, text) is not None

    def consume_text(self, matcher, text: str) -> bool:
        """Advance a guide past ``text`` (spelt out); False where it does not allow it (nothing consumed)."""
        ids = self._spelt(matcher, text)
        if ids is not None:
            matcher.consume_tokens(ids)
        return ids is not None

    def step(self, matcher, token: int) -> bool:
        """Advance a request's guide past ``token``; True once the guide is complete. ``GuideError`` where
        its parser broke off (a grammar whose strings never end, ``a: "x" a``, runs into llguidance's limits
        only as it goes): the request ends with that error, not as a complete answer. An added token
        (Qwen's ``<think>``, ``<tool_call>``) is read by its text: where a guide's text is such a token's,
        llguidance's mask allows that token, but its parser takes only the spelling."""
        if not (self._ll_tokenizer.is_special_token(token) and not matcher.validate_tokens([token])
                and self.consume_text(matcher, self._tokenizer.decode([token]))):
            matcher.consume_token(token)
        if matcher.is_error():
            raise GuideError(f"the guide cannot go on: {_first_line(matcher.get_error())}")
        return matcher.is_stopped()

    def matcher(self, kind: str, text: str, start=None):
        """A fresh parser state for one request's guide (``start``: its start state, if ``check`` gave it)."""
        m = (start or self.check(kind, text)).deep_copy()
        if m.is_error():
            raise GuideError(f"the {kind} guide cannot be used: {_first_line(m.get_error())}")
        return m


_BITS: dict[torch.device, torch.Tensor] = {}  # 0..31 on each device (not copied there at every row)
_EXECUTORS: list = []  # llguidance's thread pool, made on first use
PARALLEL_MASKS = True  # (bench.guided_bench turns it off to compare)


def allowed_bits(matchers: list, vocab_size: int, pinned: bool = False) -> torch.Tensor:
    """The tokens each matcher allows next, one bit per token (32 to an int32), a row each, on the host.
    Several are computed at once on llguidance's threads (it releases the GIL): a step's guided requests
    waited for each other's masks in turn, and a costly guide (nested counts) held every one of them up.
    ``pinned``: page-locked, for a copy to the GPU that need not wait for the step's kernels."""
    bitmask = torch.full((len(matchers), (vocab_size + 31) // 32), -1, dtype=torch.int32, pin_memory=pinned)
    row_bytes = bitmask.shape[1] * bitmask.element_size()
    if len(matchers) == 1 or not PARALLEL_MASKS or len({id(m) for m in matchers}) < len(matchers):
        for i, m in enumerate(matchers):  # (one alone: no hand-off to the pool; one twice: not in parallel)
            m.unsafe_compute_mask_ptr(bitmask.data_ptr() + i * row_bytes, row_bytes)
        return bitmask
    if not _EXECUTORS:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 2)
        _EXECUTORS.append(_llguidance().LLExecutor(min(32, max(2, cores))))
    _EXECUTORS[0].unsafe_compute_mask_ptr([(m, i) for i, m in enumerate(matchers)], bitmask.data_ptr(), row_bytes,
                                          len(matchers))
    return bitmask


def mask_disallowed(row: torch.Tensor, matcher=None, bits: torch.Tensor | None = None) -> torch.Tensor:
    """``row`` (one request's logits) with the tokens its guide does not allow next at -inf: ``bits``, its
    row of ``allowed_bits``, or the matcher's own computed now. The bits are unpacked where the row is
    (llguidance's own unpacking goes through torch.compile, which a CPU replica would wait on)."""
    v = row.shape[-1]
    cuda = row.device.type == "cuda"
    bitmask = allowed_bits([matcher], v, pinned=cuda)[0] if bits is None else bits
    shifts = _BITS.get(row.device)
    if shifts is None:
        shifts = _BITS[row.device] = torch.arange(32, dtype=torch.int32, device=row.device)
    allowed = ((bitmask.to(row.device, non_blocking=cuda).unsqueeze(1) >> shifts) & 1).flatten()[:v].bool()
    return row.masked_fill_(~allowed, float("-inf"))
