"""HTTP ingress (FastAPI in Serve; no `from __future__ import annotations`: FastAPI reads the
body models from real annotations): TGI and OpenAI APIs over the LLM deployment.

Validates with pydantic, tokenizes once, sends token ids through the LLM handle, and streams
server-sent events. Errors use each API's own format: TGI ``{"error", "error_type"}`` with 422,
OpenAI ``{"error": {"message", "type", "param", "code"}}`` with 400/404. A client that goes away
mid-stream cancels its request, which aborts it in the engine and frees its blocks.
"""


import asyncio
import codecs
import concurrent.futures
import contextlib
import functools
import hashlib
import hmac
import inspect
import json
import logging
import os
import re
import secrets
import sys
import threading
import time
import uuid
import weakref
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from pydantic import ValidationError
from ray import serve
from ray.exceptions import TaskCancelledError
from ray.serve import context as serve_context
from starlette.exceptions import HTTPException as StarletteHTTPException

from app.chat_view import ChunkEvents, with_pings
from app.config import Settings, api_keys
from app.messages_api import (
    MessageEvents,
    MessagesCountRequest,
    MessagesRequest,
    error_body,
)
from app.reasoning import CONTENT, END, START, TAGGED, ReasoningStream, reasoning_tokens, split, start_mode
from app.responses_api import ResponseEvents, ResponsesRequest
from app.sampling_defaults import read_sampling_defaults
from app.schemas import (
    MAX_BEST_OF,
    TGI_FINISH,
    ChatMessage,
    ChatPrompt,
    ChatRequest,
    ChatTokenizeRequest,
    CompletionRequest,
    DetokenizeRequest,
    TGIRequest,
    TGITokenizeRequest,
    TokenizeRequest,
    WarmupChat,
    WarmupRequest,
)
from app.tool_calls import (
    HERMES_CLOSE,
    HERMES_OPEN,
    ToolCall,
    format_or_calls_guide,
    new_call_id,
    strict_auto_guide,
    template_call_ids,
)
from app.tool_stream import ToolCallStream, read_answer
from cache.hashing import block_hashes
from deployments.cors import Cors
from deployments.logs import show_our_info_logs
from deployments.metrics import HubClient, render
from engine.detokenizer import guard_ids
from engine.sequence import MAX_STOP_STRINGS
from routing import in_process
from routing.prefix_router import avoid_replica, request_ended

log = logging.getLogger("radixserve.ingress")

# TGI v3 generates in chunks of this many tokens: a max_new_tokens past the context's room is taken when the
# first chunk fits, and the answer ends with the context (finish 'length')
TGI_GENERATION_CHUNK = 1024
HEALTH_TIMEOUT_S = 3.0
# replicas report every second, between engine steps (deployments.llm_server): room for long CPU steps
HEALTHY_WITHIN_S = 10.0
HEARTBEAT_S = 0.5  # how often an ingress replica asks the hub whether to drain
# after the hub restarted, /metrics answers 503 this long: every ingress offers the view it last rendered
# at its next heartbeat, and until the newest is in, a scrape could read counters lower than another
# ingress's last scrape showed, which Prometheus takes for a reset (a failed scrape is only a gap)
METRICS_SETTLE_S = 3 * HEARTBEAT_S
DRAIN_LEASE_S = 10.0  # a drain lasts this long past its last renewal (the CLI renews it while it drains)
ZERO_CHECK_S = 2.0  # how long /health keeps Serve's word that the LLM deployment is idle at zero replicas
ZERO_OK_STATUSES = frozenset({"HEALTHY", "UPSCALING", "DOWNSCALING"})
VERSION = "0.1.0"
# what clients send when they do not know the model's name: TGI's own clients send "tgi" (TGI's server
# ignores the field), huggingface_hub's InferenceClient "dummy"; any other name must be the served one
PLACEHOLDER_MODELS = frozenset({"tgi", "dummy"})

# no 307 from "/generate/" to "/generate": the redirect's address comes from the client's Host header
# (wrong behind a proxy) and most clients do not follow it for a POST; an unknown path is a 404
app = FastAPI(title="RadixServe", version=VERSION, redirect_slashes=False)


def _byte_level_table() -> dict[str, int]:
    """GPT-2's byte-level BPE alphabet: printable character -> the byte it stands for."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), 256))
    chars, n = {}, 0
    for b in range(256):
        if b in keep:
            chars[chr(b)] = b
        else:
            chars[chr(256 + n)] = b
            n += 1
    return chars


_BYTE_DECODER = _byte_level_table()


def _sanitize_option(tokenizer) -> dict[str, bool]:
    """``apply_chat_template``'s option that encodes control tokens typed into messages as text (and the
    tokenizer's control tokens for it, where its files do not list them)."""
    try:
        has = "sanitize_control_tokens" in inspect.signature(tokenizer.apply_chat_template).parameters
    except (TypeError, ValueError):
        has = False
    if not has:
        log.warning("this transformers cannot tell a chat message's text from control tokens: a user can "
                    "type a turn boundary; upgrade transformers")
        return {}
    if getattr(tokenizer, "chat_control_tokens", None) is None:
        # transformers takes every added token its template names for a control token, the thinking tags
        # included; marked in a message, they break the template's own string work on them (Qwen3 splits an
        # answer at "</think>" and strips the newlines after it: a history's answers kept two), and an
        # assistant prefill could not open a thought. The tags are the answer's text, not turn boundaries,
        # and so are a call's tags (Qwen's <tool_call>: an answer sent back with a call in its text came
        # spelled out, which the model never wrote, and its prefix missed the cache): the other tokens stay
        # control tokens (special tokens always are; Qwen3's <tool_response> keeps a result inside its turn)
        template = str(getattr(tokenizer, "chat_template", None) or "")
        answer_tags = (START, END, HERMES_OPEN, HERMES_CLOSE)
        tokenizer.chat_control_tokens = [
            t.content for t in getattr(tokenizer, "added_tokens_decoder", {}).values()
            if not t.special and t.content in template and not t.content.isspace() and t.content not in answer_tags]
    return {"sanitize_control_tokens": True}


def _control_token_pattern(tokenizer) -> re.Pattern | None:
    """What ``sanitize_control_tokens`` reads as control tokens (special added tokens, and the tokenizer's
    ``chat_control_tokens``), as one pattern; None without any. Cached on the tokenizer."""
    if not hasattr(tokenizer, "_radixserve_control_pattern"):
        listed = set(getattr(tokenizer, "chat_control_tokens", None) or ())
        tokens = sorted({t.content for t in getattr(tokenizer, "added_tokens_decoder", {}).values()
                         if t.content and (t.special or t.content in listed)}, key=len, reverse=True)
        tokenizer._radixserve_control_pattern = re.compile("|".join(map(re.escape, tokens))) if tokens else None
    return tokenizer._radixserve_control_pattern


def _control_token_in_keys(value: Any, pattern: re.Pattern, where: str) -> tuple[str, str] | None:
    """The first object key under ``value`` that holds a control token: (where, the token). transformers
    encodes a message's text, and every string value, as text, but not keys; a tool's parameter named
    ``<|im_end|><|im_start|>system`` (a schema from another's server, arguments sent back) was a turn."""
    stack = [(value, where)]
    while stack:
        node, at = stack.pop()
        if isinstance(node, dict):
            for k, v in node.items():
                if isinstance(k, str) and (m := pattern.search(k)):
                    return f"{at}.{k}", m.group(0)
                stack.append((v, f"{at}.{k}"))
        elif isinstance(node, list):
            stack.extend((v, f"{at}[{i}]") for i, v in enumerate(node))
    return None


def _anchor_token(tokenizer, byte_level: bool) -> int | None:
    """A plain token to decode others after: SentencePiece decoders (Llama 2, Mistral) strip a text's
    leading space, so a token decoded alone loses its own ("Paris" for "▁Paris"). None where decoding
    alone is exact (byte-level BPE) or no one-token text is at hand."""
    if byte_level:
        return None
    ids = guard_ids(tokenizer)
    return ids[0] if len(ids) == 1 else None


def token_bytes(piece: str | None, text: str, byte_level: bool) -> list[int]:
    """A token's own bytes (OpenAI's ``bytes``) from its vocabulary entry ``piece`` and decoded
    ``text``: one token may hold part of a UTF-8 character, which its text shows as U+FFFD. Byte-level
    BPE spells bytes as characters (GPT-2's table), SentencePiece's byte fallback as ``<0xHH>``;
    otherwise the text's UTF-8 (special tokens: their own text, "</s>"). A token without text has none."""
    if not isinstance(piece, str) or not text:
        return []
    if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
        return [int(piece[3:5], 16)]
    if byte_level and all(c in _BYTE_DECODER for c in piece):
        return [_BYTE_DECODER[c] for c in piece]
    return list(text.encode())


class InFlight:
    """ASGI middleware: POST requests this process is still answering, from their last request body byte
    to their last response byte (a stream included), so a drain waits for what is tokenized or queued,
    not only for engine work, but not for a client still trickling its upload. While draining it refuses
    new POSTs with 503 before anything reads them (a bad body included), and past --max-concurrent-requests
    new generation requests with 429 once their body is in."""

    count = 0
    draining = False  # set by Ingress.drain and by the hub's word (one ingress process per replica)
    # --max-concurrent-requests (set by Ingress.__init__): the generation requests this process answers
    # at once, counted from their last body byte (uploads that stall hold no place: TGI too reads the body
    # before its semaphore); one more is refused then (429) instead of waiting in line
    limit: int | None = None
    admitted = 0

    def __init__(self, asgi_app):
        self.app = asgi_app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope.get("method") != "POST":
            return await self.app(scope, receive, send)
        if InFlight.draining:
            return await _error_response(Request(scope), _shutting_down())(scope, receive, send)
        await self._counted(scope, receive, send, limited=_route_path(scope) not in UNLIMITED_PATHS)

    async def _counted(self, scope, receive, send, limited: bool):
        counted = admitted = refused = False
        body_at = 0.0
        status = 0
        whole = False  # the response's last byte went out (not so for a client that left mid-stream)
        answered = [False]  # set by the handler once an engine's first token came (ENGINE_ANSWERED)
        token = in_process.ENGINE_ANSWERED.set(answered)

        async def received():
            nonlocal counted, body_at, admitted, refused
            message = await receive()
            if not counted and message["type"] == "http.request" and not message.get("more_body", False):
                if limited and InFlight.limit is not None:
                    if InFlight.admitted >= InFlight.limit:
                        # fail the body read: the handler never runs, its error answer is replaced below
                        in_process.ROUTED["requests_overloaded"] += 1
                        refused = True
                        raise _Overloaded
                    InFlight.admitted += 1
                    admitted = True
                counted = True
                InFlight.count += 1
                body_at = time.monotonic()
                # (the handler's task reads the body: the value is its own from here on)
                in_process.REQUEST_START.set(body_at)
            return message

        async def sent(message):
            nonlocal status, whole
            if refused:
                return
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)
            whole = message["type"] == "http.response.body" and not message.get("more_body", False)

        try:
            await self.app(scope, received, sent)
        except _Overloaded:
            pass
        finally:
            in_process.ENGINE_ANSWERED.reset(token)
            if admitted:
                InFlight.admitted -= 1
            if counted:
                InFlight.count -= 1
                if answered[0] and status == 200 and whole:  # a generation answered in full (a stream too)
                    in_process.INGRESS_E2E.observe(time.monotonic() - body_at)
        if refused:
            await _error_response(Request(scope), _overloaded())(scope, receive, send)


class ApiError(Exception):
    def __init__(self, status: int, message: str, kind: str = "validation", code: str | None = None,
                 param: str | None = None, overflow: tuple[int, int] | None = None):
        super().__init__(message)
        self.status, self.message, self.kind, self.code, self.param = status, message, kind, code, param
        self.overflow = overflow  # a prompt past the context: (its tokens, at least; the most it may have)


# A request past the context's room: OpenAI's code for it, which clients (LangChain, litellm) read to
# shorten the conversation; Anthropic's clients read its own words instead (see _error_response)
CONTEXT_EXCEEDED = "context_length_exceeded"


# A 503's ``code`` when the request was running as its engine failed: not retried here (it may be what
# failed it), and a client should not take it for the service being gone (batch records the line's failure)
ENGINE_FAILURE = "engine_failure"


def _shutting_down() -> ApiError:
    return ApiError(503, "the server is shutting down: retry on another instance", "unavailable")


# what --max-concurrent-requests leaves out: no generation behind them, answered at once
UNLIMITED_PATHS = frozenset({"/tokenize", "/detokenize", "/v1/messages/count_tokens"})
OVERLOADED = "overloaded"
RETRY_AFTER_S = 1  # an overloaded answer's Retry-After: the OpenAI and Anthropic clients wait that long


def _overloaded() -> ApiError:
    return ApiError(429, "Model is overloaded", OVERLOADED, code=OVERLOADED)  # (TGI's words)


class PayloadLimit:
    """ASGI middleware: a body over ``max_bytes`` gets 413 before it is parsed or tokenized (a 10 MB
    prompt used to hold the ingress for seconds only to be refused as too long)."""

    max_bytes = 2_000_000  # set from the settings by Ingress.__init__ (one ingress per process)

    def __init__(self, asgi_app):
        self.app = asgi_app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        limit = PayloadLimit.max_bytes
        declared = dict(scope.get("headers") or ()).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            return await _error_response(Request(scope), _too_large(limit))(scope, receive, send)
        seen, over = 0, False

        async def counted():  # a chunked body declares no length: count it as it arrives
            nonlocal seen, over
            try:
                message = await receive()
            except TaskCancelledError:
                # Serve's receive raises this once the client is gone: say so the ASGI way, or each
                # ordinary disconnect leaves a 70-line "Task exception was never retrieved" in the log
                return {"type": "http.disconnect"}
            if message["type"] == "http.request" and not over:
                seen += len(message.get("body", b""))
                if seen > limit:
                    # fail the body read: the handler never runs (a valid start of a body must not run
                    # with the rest cut off), and its error answer is replaced by the 413 below
                    over = True
                    raise _TooLarge
            return message

        async def unless_over(message):
            if not over:
                await send(message)

        try:
            await self.app(scope, counted, unless_over)
        except _TooLarge:
            pass
        if over:
            await _error_response(Request(scope), _too_large(limit))(scope, receive, send)


class _TooLarge(Exception):
    pass


class _Overloaded(Exception):
    pass


class JsonOnly:
    """ASGI middleware: a POST whose Content-Type says it is not JSON gets 415 (FastAPI would answer
    that the body "should be a valid dictionary": ``curl -d`` without a header sends a form type). A
    missing Content-Type is read as JSON."""

    def __init__(self, asgi_app):
        self.app = asgi_app

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope.get("method") == "POST" and _route_path(scope) in JSON_POST_PATHS:
            headers = scope.get("headers") or []
            ctype = dict(headers).get(b"content-type")
            if ctype is None:  # FastAPI would not parse it at all
                scope = {**scope, "headers": [*headers, (b"content-type", b"application/json")]}
            else:
                kind = ctype.split(b";", 1)[0].strip().lower()
                if kind != b"application/json" and not kind.endswith(b"+json"):
                    err = ApiError(415, "the request body must be JSON, sent with Content-Type: application/json "
                                        f"(got {ctype.decode('latin-1')!r})", "validation",
                                   code="unsupported_media_type")
                    return await _error_response(Request(scope), err)(scope, receive, send)
        return await self.app(scope, receive, send)


# The routes that take a JSON body by POST (below, in Ingress); other paths answer 404 or 405 whatever
# the body's type. (Serve wraps the class's routes in its own router, so app.routes does not list them.)
JSON_POST_PATHS = frozenset({"/", "/generate", "/generate_stream", "/v1/completions", "/v1/chat/completions", "/v1/responses",
                             "/v1/messages", "/v1/messages/count_tokens",
                             "/warmup", "/tokenize", "/detokenize"})


def _too_large(limit: int) -> ApiError:
    return ApiError(413, f"the request body is larger than the server's payload limit of {limit} bytes",
                    "validation", code="payload_too_large")


LOOPBACK_HOSTS = frozenset({"localhost", "127.0.0.1", "::1"})


def _is_loopback(host: str) -> bool:
    return host in LOOPBACK_HOSTS or host.startswith("127.") or host.endswith(".localhost")


def _origin_allowed(origin: bytes, host: bytes, loopback: bool) -> bool:
    """Whether a browser's request from a page of ``origin`` (the Origin header) may act on this service,
    reached as ``host`` (the Host header): a page of an origin ``--cors-allow-origin`` lists, or one of this
    service's own origin (its /docs page), named by a loopback name where the request came in on loopback
    (``loopback``)."""
    text = origin.decode("latin-1").strip().lower()
    if "*" in Cors.origins or text in Cors.origins:
        return True
    scheme, sep, netloc = text.partition("://")
    if not sep or scheme not in ("http", "https") or netloc != host.decode("latin-1").strip().lower():
        return False  # another site (or "null": a sandboxed frame, a file)
    name = netloc[1:].partition("]")[0] if netloc.startswith("[") else netloc.rpartition(":")[0] or netloc
    return not loopback or _is_loopback(name)


class CrossSite:
    """ASGI middleware: a request a web page of another site sends (a browser names the page's origin in
    ``Origin`` on every POST) is refused, 403, unless ``--cors-allow-origin`` lists that origin. Such a
    request needs no preflight when its body has no Content-Type (which reads as JSON here): any page the
    operator opened could run generations, warm-ups that mark its prompts hot in the directory, on a
    service without ``--api-key``. A page of a name that a rebinding DNS points at 127.0.0.1 is the
    service's own origin to the browser: a request that came in on loopback (the connection's local address,
    which Serve's proxy passes on) must name a loopback host."""

    # where a request does not say its connection's local address: whether the service listens on loopback
    # (set from the settings by Ingress.__init__)
    loopback = True

    def __init__(self, asgi_app):
        self.app = asgi_app

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope.get("method") not in ("GET", "HEAD", "OPTIONS"):
            headers = scope.get("headers") or ()
            origin = next((v for k, v in headers if k == b"origin"), None)
            server = scope.get("server")
            loopback = _is_loopback(str(server[0])) if server else CrossSite.loopback
            if origin is not None and not _origin_allowed(origin, next((v for k, v in headers if k == b"host"), b""),
                                                          loopback):
                err = ApiError(403, f"requests from web pages of another site ({origin.decode('latin-1')}) are "
                                    "refused: list the page's origin in --cors-allow-origin to allow them",
                               "authentication", code="cross_origin_request")
                return await _error_response(Request(scope), err)(scope, receive, send)
        return await self.app(scope, receive, send)


class ApiKey:
    """ASGI middleware: with ``--api-key`` set, every request but a liveness probe, a Prometheus scrape and
    a browser's preflight must carry ``Authorization: Bearer <key>`` (what OpenAI's and Hugging Face's
    clients send) or ``x-api-key: <key>`` (Anthropic's), else 401 in the API's error format."""

    keys: tuple[bytes, ...] = ()  # the keys' SHA-256, set from the settings by Ingress.__init__ (one ingress per process)
    OPEN_PATHS = frozenset({"/health", "/metrics"})

    def __init__(self, asgi_app):
        self.app = asgi_app

    async def __call__(self, scope, receive, send):
        keys = ApiKey.keys
        if (not keys or scope["type"] != "http" or scope.get("method") == "OPTIONS"
                or _route_path(scope) in ApiKey.OPEN_PATHS):
            return await self.app(scope, receive, send)
        # the first Authorization header, as Starlette reads it
        sent = next((v for k, v in scope.get("headers") or () if k == b"authorization"), b"")
        scheme, token = (*sent.split(None, 1), b"", b"")[:2]  # "Bearer <key>", any whitespace between
        if scheme.lower() != b"bearer":  # Anthropic's clients send the key alone, as x-api-key
            token = next((v for k, v in scope.get("headers") or () if k == b"x-api-key"), None)
        # digests compared in constant time, each key's: how long a refusal takes says nothing of the keys,
        # their lengths included, nor of which one came closest
        if token is not None:
            digest = hashlib.sha256(token.strip()).digest()
            if sum(hmac.compare_digest(digest, key) for key in keys):
                return await self.app(scope, receive, send)
        err = ApiError(401, "a valid API key is required: send it as the header Authorization: Bearer <key> "
                            "(or x-api-key: <key>)",
                       "authentication", code="invalid_api_key")
        response = _error_response(Request(scope), err)
        response.headers["www-authenticate"] = "Bearer"
        return await response(scope, receive, send)


# Starlette runs the last one added first: CORS (its headers go on every answer, refusals too, and a
# browser's preflight is answered there), other sites' pages, the API key, the size check, the drain check
# and in-flight count, then the content type.
app.add_middleware(JsonOnly)
app.add_middleware(InFlight)
app.add_middleware(PayloadLimit)
app.add_middleware(ApiKey)
app.add_middleware(CrossSite)
app.add_middleware(Cors)


def _route_path(scope) -> str:
    """The path below the application's route prefix: Serve passes the full path, the prefix as root_path
    (an application mounted at /b answered its OpenAI routes' errors in TGI's format)."""
    path, root = scope.get("path", ""), scope.get("root_path", "")
    if root and path.startswith(root) and path[len(root):len(root) + 1] in ("", "/"):
        return path[len(root):] or "/"
    return path


PING_EVERY_S = 10.0  # an idle stream of another API's view gets a keep-alive this often
ANTHROPIC_PATHS = ("/v1/messages", "/v1/messages/count_tokens")


def _is_openai(request: Request) -> bool:
    return _route_path(request.scope).startswith("/v1/")


class _EscapedJSON(JSONResponse):
    """A JSON answer whose values a model's JSON made (a tool call's input, read back from its arguments):
    a lone surrogate it wrote (``"\\ud83d"``) is no Unicode text, so such an answer goes out ASCII-escaped."""

    def render(self, content: Any) -> bytes:
        try:
            return super().render(content)
        except UnicodeEncodeError:
            return json.dumps(content, allow_nan=False, separators=(",", ":")).encode()


def _client_message(err: ApiError) -> str:
    """An error's message in the APIs' own terms."""
    return err.message.replace("max_new_tokens", "max_tokens")  # (the engine's name for it)


def _error_response(request: Request, err: ApiError) -> JSONResponse:
    message = _client_message(err)
    headers = {"retry-after": str(RETRY_AFTER_S)} if err.kind == OVERLOADED else None
    if _route_path(request.scope) in ANTHROPIC_PATHS:  # Anthropic's format, on its routes
        # (Anthropic's API says overloaded with its 529)
        status = 529 if err.kind == OVERLOADED else 400 if err.status == 422 else err.status
        if err.overflow is not None:  # in Anthropic's words, which its clients read (Claude Code compacts on them)
            message = f"prompt is too long: {err.overflow[0]} tokens > {err.overflow[1]} maximum"
        return JSONResponse(error_body(status, message), status_code=status, headers=headers)
    if _is_openai(request):
        etype = "invalid_request_error" if err.status < 500 and err.kind != OVERLOADED else "server_error"
        body = {"error": {"message": message, "type": etype, "param": err.param, "code": err.code}}
        status = 400 if err.status == 422 else err.status
        return JSONResponse(body, status_code=status, headers=headers)
    # TGI answers a failed generation 424 (a 503 invites a retry, and the request may be what failed it);
    # an engine that never took the request stays 503
    status = 424 if err.kind == "generation" and err.code == ENGINE_FAILURE else err.status
    return JSONResponse({"error": err.message, "error_type": err.kind}, status_code=status, headers=headers)


@app.exception_handler(ApiError)
async def _api_error(request: Request, err: ApiError):
    if err.status >= 500:  # (ours, not the client's: one line each, found by the client's request id)
        log.warning("request %s: %s %s answered %d (%s): %s", _serve_request_id() or "-", request.method,
                    request.url.path, err.status, err.code or err.kind, err.message[:300])
    return _error_response(request, err)


_ID_CHARS = re.compile(r"[^A-Za-z0-9._:-]")


def _serve_request_id() -> str:
    """This HTTP request's id in Serve (a client's ``x-request-id``, which Serve answers with), made safe to
    log and short; "" outside a request."""
    return _ID_CHARS.sub("", serve_context._get_serve_request_context().request_id or "")[:64]


def _engine_request_id() -> str:
    """An engine request's id: the HTTP request's, so its replica's and engine's log lines are found by the
    id its client has, and one of its own (its choices, a retry and a client's reused id stay apart)."""
    own = uuid.uuid4().hex
    return f"{http}-{own[:12]}" if (http := _serve_request_id()) else own


@app.exception_handler(StarletteHTTPException)
async def _http_error(request: Request, exc: StarletteHTTPException):
    """Unknown paths, wrong methods, unreadable bodies: in the API's own error format too."""
    kind = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "validation")
    message = {404: f"no such endpoint: {request.method} {request.url.path}",
               405: f"{request.method} is not allowed on {request.url.path}"}.get(exc.status_code, str(exc.detail))
    status = exc.status_code
    if status == 400 and "parsing the body" in str(exc.detail):
        message, status = _unparsable(exc.__cause__), 422  # as every other invalid body (OpenAI routes: 400)
    response = _error_response(request, ApiError(status, message, kind, code=kind))
    response.headers.update(exc.headers or {})  # a 405's Allow: the methods the path takes
    return response


def _unparsable(cause: BaseException | None) -> str:
    """Why the JSON parser gave up on a body (FastAPI reports only that it did)."""
    why = "it must be UTF-8 encoded JSON"
    if isinstance(cause, UnicodeDecodeError):
        why = "it is not UTF-8 encoded"
    elif isinstance(cause, RecursionError):
        why = "it is nested too deeply"
    elif isinstance(cause, ValueError) and "digits" in str(cause):
        why = "a number in it has too many digits"
    return f"the request body could not be parsed as JSON: {why}"


def _loc(loc: tuple) -> list[str]:
    """An error's field path without FastAPI's "body" and pydantic's union-member tags ("str", "list[int]")."""
    out = []
    for x in loc:
        x = str(x)
        if x == "body" or x in ("str", "int", "float", "bool", "dict", "list") or "[" in x or x.startswith("function-"):
            continue
        out.append(f"[{x}]" if x.isdigit() else x)
    return out


@app.exception_handler(RequestValidationError)
async def _validation_error(request: Request, exc: RequestValidationError):
    parts, param = [], None
    for e in exc.errors():
        if e.get("type") == "json_invalid":
            pos = next((x for x in e.get("loc", ()) if isinstance(x, int)), None)
            err = (e.get("ctx") or {}).get("error", "")
            parts.append(f"the body is not valid JSON{f' (at character {pos})' if pos is not None else ''}"
                         f"{f': {err}' if err else ''}")
            continue
        loc = _loc(e.get("loc", ()))
        if loc and param is None:
            param = loc[0]
        msg = str(e.get("msg", "")).removeprefix("Value error, ")
        if not loc and e.get("type") == "missing":
            msg = "the request body is missing (a JSON object is expected)"
        parts.append(f"{'.'.join(loc).replace('.[', '[')}: {msg}" if loc else msg)
    return _error_response(request, ApiError(422, "; ".join(dict.fromkeys(parts)) or "invalid request", param=param))


def _sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"  # "data: " as OpenAI, vLLM and TGI frame it


# Helpers sit above the class: serve.ingress captures the module's globals when it wraps it.
async def _chain(first: dict, rest: AsyncIterator[dict]) -> AsyncIterator[dict]:
    yield first
    async for ev in rest:
        yield ev


def _prompt_only(ev: dict) -> dict:
    """An event of a request run only to score its prompt (completions' ``max_tokens: 0`` with ``echo``:
    the engine generates one token, which the answer leaves out): its token, as if none was drawn."""
    if ev.get("error"):
        return ev
    return {**ev, "token_id": None, "text": "", "logprob": None, "top_logprobs": None, "text_offset": 0,
            "num_output_tokens": 0, "stop_reason": None, "finish_reason": "length" if ev["finished"] else None}


async def _prompt_only_rest(rest: AsyncIterator[dict]) -> AsyncIterator[dict]:
    async for ev in rest:
        yield _prompt_only(ev)


def _replica_header(events: list[dict]) -> dict[str, str]:
    """Which replica served the request (debugging, and the routing tests)."""
    return {"x-radixserve-replica": str(events[-1].get("replica", ""))}


# an event stream's headers: no cache or proxy (nginx) may hold its events back to send them in a batch
UNBUFFERED = {"cache-control": "no-cache", "x-accel-buffering": "no"}


def _stream_headers(first: dict) -> dict[str, str]:
    """A stream's: which replica, and its prompt's tokens and how many of them the prefix cache served (known
    at the first token: the Messages API's first event says them)."""
    return {**_replica_header([first]), **UNBUFFERED, "x-radixserve-prompt-tokens": str(first.get("num_prompt_tokens", 0)),
            "x-radixserve-cached-tokens": str(first.get("num_cached_tokens", 0))}


def _distinct_tokens(prefixes: list[list[int]], block_size: int, vocab_size: int) -> int:
    """KV tokens ``prefixes`` take in a radix cache: blocks they share count once. ``ApiError`` for an
    id outside the vocabulary (the hashes pack ids as 32-bit numbers: they are checked first)."""
    bad = next((t for p in prefixes for t in p if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise ApiError(422, f"token id {bad} is outside the vocabulary (0..{vocab_size - 1})", param="prefixes")
    blocks: set[int] = set()
    for p in prefixes:
        blocks.update(block_hashes(p, block_size, "warmup"))
    return len(blocks) * block_size + sum(len(p) % block_size for p in prefixes)


def _seeded(params: dict[str, Any]) -> dict[str, Any]:
    """A sampled TGI request without a seed gets one drawn here, so its details can report the seed that
    reproduces it (as TGI's do); greedy ones report none."""
    if params["temperature"] > 0 and params["seed"] is None:
        params["seed"] = secrets.randbits(63)
    return params


def _likeliest(runs: list[list[dict]], n: int, per_token: bool = False) -> list[list[dict]]:
    """The ``n`` of these sequences (each its events) whose tokens are likeliest together (the largest sum
    of log-probabilities, vLLM's; ``per_token``: the largest mean, TGI's), likeliest first; ties keep
    their order."""
    def score(events: list[dict]) -> float:
        lps = [ev["logprob"] for ev in events if ev.get("token_id") is not None and ev.get("logprob") is not None]
        return sum(lps) / max(len(lps), 1) if per_token else sum(lps)
    return sorted(runs, key=score, reverse=True)[:n]


def _oai_finish(reason: str | None) -> str:
    return "length" if reason in ("length", "abort", None) else "stop"


def _error_text(e: BaseException) -> str:
    """An exception from a replica as a user-facing line: its last line, without "module.Class: "."""
    text = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
    head, sep, rest = text.partition(": ")
    return rest if sep and "." in head and " " not in head else text


def _usage(finals: list[dict], n: int = 1, reasoning: list[int] | None = None, firsts: list[dict] | None = None
           ) -> dict:
    """OpenAI ``usage`` of the last events of a request's choices, ``n`` per prompt in prompt order: each
    prompt counts once, and its cached part is what its first choice found (the others then find what
    that one computed; ``firsts``: the last events of the choices started first, where the answer ordered
    them otherwise). ``reasoning``: each choice's thinking tokens, under a reasoning parser."""
    firsts = finals[::n] if firsts is None else firsts
    p, c = sum(ev["num_prompt_tokens"] for ev in firsts), sum(ev["num_output_tokens"] for ev in finals)
    out = {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c,
           "prompt_tokens_details": {"cached_tokens": sum(ev["num_cached_tokens"] for ev in firsts)}}
    if reasoning is not None:
        out["completion_tokens_details"] = {"reasoning_tokens": sum(reasoning)}
    return out


def _sse_data(piece: str) -> list[str]:
    """The ``data`` of each server-sent event in ``piece`` (one or more events of ours, each one line)."""
    return [line[5:].strip() for line in piece.split("\n") if line.startswith("data:")]


def _running_usage(ev: dict) -> dict:
    """vLLM's ``continuous_usage_stats``: a choice's usage so far, from its last event."""
    p, c = ev.get("num_prompt_tokens", 0), ev.get("num_output_tokens", 0)
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}


def _before_tokens(first: dict) -> dict:
    """A choice's usage before its first token's chunk (its role, an echoed prompt): its prompt alone."""
    return {"num_prompt_tokens": first.get("num_prompt_tokens", 0)}


def _continuous_usage(req) -> bool:
    return bool(req.stream_options and req.stream_options.include_usage and req.stream_options.continuous_usage_stats)


def _failed(ev: dict, running: bool) -> ApiError:
    """The error of a request whose event ``ev`` says it failed: the request's own (refused, or its guide
    broke off) is a 422; any other a 503, said to be an engine failure where the engine had taken it
    (``running``, or an engine that failed at its first token), so it is not retried: it may be the cause."""
    if ev.get("error_kind") == "validation":
        return ApiError(422, ev["error"], "validation")
    engine = running or ev.get("error_kind") == "engine"
    return ApiError(503, ev["error"], "generation", code=ENGINE_FAILURE if engine else None)


def _oai_stream_error(ev: dict) -> str:
    """How an OpenAI stream ends when its request failed mid-answer (the error event ``ev``): the error,
    then ``[DONE]`` as every stream ends (as vLLM's do), so a client reading to ``[DONE]`` knows the stream
    is over. Its engine's failure is a server error; a guide that broke off, the request's own."""
    if ev.get("error_kind") == "validation":
        error = {"message": ev["error"], "type": "invalid_request_error", "param": None, "code": None}
    else:
        error = {"message": ev["error"], "type": "server_error", "param": None, "code": ENGINE_FAILURE}
    return _sse({"error": error}) + "data: [DONE]\n\n"


def _prompt_logprobs_of(events: list[dict]) -> list | None:
    """The engine's ``prompt_logprobs`` among a request's events (on its first token's), if asked for."""
    return next((ev["prompt_logprobs"] for ev in events if ev.get("prompt_logprobs") is not None), None)


def _engine_prompt_logprobs(events: list[dict], n: int) -> list:
    """The engine's ``prompt_logprobs`` of a request's events: one per prompt token (a 503 if missing)."""
    plps = _prompt_logprobs_of(events)
    if plps is None or len(plps) != n:
        raise ApiError(503, "the engine returned no prompt log-probabilities", "generation", code=ENGINE_FAILURE)
    return plps


@dataclass
class _StreamedChoice:
    """One choice of an OpenAI stream: its echoed prompt, its token events since its last chunk (for their
    log-probs; tokens without text are coalesced), the characters it has sent, and whether its first
    token is still due."""

    index: int
    prefix: str = ""
    unsent: list[dict] = field(default_factory=list)
    sent: int = 0
    first_token: bool = True
    thinking: ReasoningStream | None = None  # a chat answer's thinking, split as it streams (app.reasoning)
    latest: dict = field(default_factory=dict)  # its last event: the usage so far (continuous_usage_stats)


def _validated_chat(body: dict[str, Any], api: type[ChunkEvents]) -> ChatRequest:
    """A chat request made from another API's (its refusals are 400s in that API's format, naming its fields)."""
    try:
        return ChatRequest.model_validate(body)
    except ValidationError as e:
        raise RequestValidationError([{**err, "loc": api.own_location(tuple(err.get("loc", ()))),
                                       "msg": api.own_text(str(err.get("msg", "")))} for err in e.errors()]) from None


def _in_own_terms(e: ApiError, api: type[ChunkEvents]) -> ApiError:
    """A refusal of the chat request made from another API's, its ``param`` named as that API names it."""
    if e.param is not None:
        e.param = ".".join(str(x) for x in api.own_location((e.param,)))
    return e


def _tag_tokens(tokenizer, tags: tuple[str, ...], keep_special: bool = False) -> dict[str, int | None]:
    """The tags (thinking's, Hermes calls') that are text in an answer (ordinary tokens, or text the model
    spells out), each with its token id where it is one token: a guide can wait only for what it can read,
    and names a tag that is one added token by its id. ``keep_special``: special tokens are text too (an
    auto-tool answer keeps them: some Hermes fine-tunes make their call tags special)."""
    out: dict[str, int | None] = {}
    for tag in tags:
        ids = tokenizer.encode(tag, add_special_tokens=False)
        if tokenizer.decode(ids, skip_special_tokens=not keep_special) == tag:
            out[tag] = ids[0] if len(ids) == 1 else None
    return out


def _split_piece(thinking: ReasoningStream | None, ev: dict) -> tuple[str, str]:
    """(thinking, content) text of a token event to send now (all content without a reasoning parser)."""
    if thinking is None:
        return "", ev["text"]
    thought, piece = thinking.feed(ev["text"], token=ev.get("token_id") is not None)
    if ev["finished"]:
        more_thought, more = thinking.finish()
        thought, piece = thought + more_thought, piece + more
    return thought, piece


def _choice_params(params: dict[str, Any], n: int) -> list[dict[str, Any]]:
    """One engine request per choice; with a seed, choice i samples with seed + i (as vLLM), so each is
    reproducible alone, and the n draws differ."""
    if n == 1 or params.get("seed") is None:
        return [params] * n
    return [{**params, "seed": (params["seed"] + i) - (2**64 if params["seed"] + i >= 2**64 else 0)}
            for i in range(n)]


async def _all(aws) -> list:
    """``asyncio.gather``, but a failure cancels the rest (their requests are aborted in the engines)."""
    tasks = [asyncio.ensure_future(a) for a in aws]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        tasks.clear()  # the error's traceback holds this frame: let the tasks' results go
        raise


async def _merged(streams: list[AsyncIterator[dict]]) -> AsyncIterator[tuple[int, dict]]:
    """(choice, event) from several streams as their events come; closing it cancels those still running."""
    if len(streams) == 1:  # the common case, without a task and a queue per token
        async for ev in streams[0]:
            yield 0, ev
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, stream: AsyncIterator[dict]) -> None:
        try:
            async for ev in stream:
                queue.put_nowait((i, ev))
        except Exception as e:  # noqa: BLE001 - handed to the reader, which raises it
            queue.put_nowait((i, e))
        finally:
            queue.put_nowait((i, None))

    tasks = [asyncio.ensure_future(pump(i, st)) for i, st in enumerate(streams)]
    try:
        running = len(tasks)
        while running:
            i, ev = await queue.get()
            if ev is None:
                running -= 1
            elif isinstance(ev, Exception):
                raise ev
            else:
                yield i, ev
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


@serve.deployment(ray_actor_options={"num_cpus": 0})
@serve.ingress(app)
class Ingress:
    first_token_ping_s = PING_EVERY_S  # how long another API's stream waits for its first token to start

    def __init__(self, llm_handle, settings: dict[str, Any], scales_to_zero: bool = False):
        from transformers import AutoTokenizer

        show_our_info_logs()
        self.settings = Settings(**settings)
        self.scales_to_zero = scales_to_zero  # the LLM deployment autoscales with min_replicas 0
        self.llm = llm_handle
        self.model_name = self.settings.model_name()
        self.tokenizer = AutoTokenizer.from_pretrained(self.settings.resolved_model_id(), local_files_only=True)
        self._think_tokens = _tag_tokens(self.tokenizer, (START, END))
        calls = _tag_tokens(self.tokenizer, (HERMES_OPEN, HERMES_CLOSE), keep_special=True)
        self._hermes_ids = (calls.get(HERMES_OPEN), calls.get(HERMES_CLOSE))
        # the OpenAI routes' defaults for what a request leaves unset (app.sampling_defaults)
        self.sampling_defaults = (read_sampling_defaults(self.settings.resolved_model_id())
                                  if self.settings.sampling_defaults == "model" else {})
        if self.sampling_defaults:
            log.info("OpenAI requests that leave them unset sample with the model's generation_config.json: %s "
                     "(--sampling-defaults api: OpenAI's)", self.sampling_defaults)
        # tokenizing a long prompt takes the CPU for a while: one worker thread does it, so the event
        # loop keeps streaming other users' tokens and answering /health meanwhile
        self._tokenizer_thread = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="tokenizer")
        PayloadLimit.max_bytes = self.settings.payload_limit
        InFlight.limit = self.settings.max_concurrent_requests
        ApiKey.keys = tuple(hashlib.sha256(k.encode()).digest() for k in api_keys(self.settings.api_key or "") if k)
        Cors.origins = tuple(self.settings.cors_allow_origin)
        CrossSite.loopback = _is_loopback(self.settings.host)
        # no token covers more characters than the longest vocabulary entry: bounds a text's token count
        self._max_token_chars = max((len(k) for k in self.tokenizer.get_vocab()), default=1)
        self._info: dict[str, Any] | None = None
        self._hub = HubClient(self.settings.deployment_name)
        # every ingress replica hears of a drain and tells its requests in flight through the hub: the
        # CLI's drain reaches all of them, not only the one a handle call lands on
        self._replica_id = serve.get_replica_context().replica_id.unique_id
        self._drained_until = float("-inf")  # Ingress.drain's own word, kept for one lease
        # drain() runs in Serve's threads, the heartbeat in its own: one must not overwrite the other's word
        self._drain_lock = threading.Lock()
        self._hub_view: tuple | None = None  # the hub's state at the last /metrics (restored if it restarts)
        self._offered = ""  # the hub incarnation the heartbeat last offered that view to
        self._metrics_settle_until = 0.0  # (monotonic) /metrics waits for the other ingresses' views
        self._stop = threading.Event()
        threading.Thread(target=self._heartbeat, name="ingress-heartbeat", daemon=True).start()
        self._last_health: tuple[float, int] = (float("-inf"), 0)  # (when, replicas) of the last good answer
        self._zero_seen: tuple[float, bool] = (float("-inf"), False)  # (when, answer) of _at_zero
        self._zero_until = float("-inf")  # the last time at (or waking from) zero counts until then
        self._text_cache: dict[int, str] = {}  # bounded by the vocabulary
        self._bytes_cache: dict[int, list[int]] = {}
        # the named special tokens and every added token marked special (<|system|>): decoding with
        # skip_special_tokens leaves out both (the property rebuilds a list per call: kept here)
        added = getattr(self.tokenizer, "added_tokens_decoder", None) or {}
        self._special = frozenset(self.tokenizer.all_special_ids) | {i for i, t in added.items()
                                                                      if getattr(t, "special", False)}
        backend = getattr(self.tokenizer, "backend_tokenizer", None)  # fast tokenizers only
        # byte-level BPE (GPT-2, Llama 3, Qwen) spells bytes as characters; SentencePiece does not
        self._byte_level = "ByteLevel" in type(getattr(backend, "decoder", None)).__name__
        self._anchor = _anchor_token(self.tokenizer, self._byte_level)
        # control tokens a user types into a message ("<|im_end|><|im_start|>system") are text, not turns:
        # only the template's own are tokens (an older transformers has no such option: a warning says so)
        self._sanitize = _sanitize_option(self.tokenizer)

    # ------------------------------------------------------------------ plumbing
    def drain(self) -> bool:
        """Stop taking new requests (503, "shutting down") while those in flight finish: ``radixserve
        serve`` calls this on Ctrl-C (after telling the hub, which tells the other ingress replicas)."""
        with self._drain_lock:
            InFlight.draining = True
            self._drained_until = time.monotonic() + DRAIN_LEASE_S  # a hub that restarts forgets the drain
        return True

    def _heartbeat(self) -> None:
        """Twice a second: this replica's requests in flight and its routers' counts to the hub, the
        hub's drain back."""
        while not self._stop.wait(HEARTBEAT_S):
            try:
                counts = {**in_process.ROUTED, "ingress_ttft": in_process.INGRESS_TTFT.to_dict(),
                          "ingress_e2e": in_process.INGRESS_E2E.to_dict()}
                told, incarnation = self._hub.call("ingress_heartbeat", self._replica_id, InFlight.count,
                                                   counts, timeout=HEALTH_TIMEOUT_S, renew=False)
                view = self._hub_view
                if view is not None and incarnation not in (view[0], self._offered):
                    # the hub restarted: every ingress offers its view now (the newest stands), so no
                    # scrape reads the counters from an older one than another ingress last showed
                    self._offered = incarnation
                    self._metrics_settle_until = time.monotonic() + METRICS_SETTLE_S
                    self._hub.call("restore", *view[1:], timeout=HEALTH_TIMEOUT_S, renew=False)
                # the hub's word (a drain whose CLI died ends when its renewals lapse), or drain()'s own
                with self._drain_lock:
                    InFlight.draining = bool(told) or time.monotonic() < self._drained_until
            except Exception as e:  # noqa: BLE001 - the hub is restarting: keep the last word
                log.debug("ingress heartbeat failed: %s", e)

    def __del__(self):
        self._stop.set()  # no heartbeat after Serve stops this replica (it would find no hub)

    def _failure(self, e: BaseException) -> str:
        if InFlight.draining:
            return "the server shut down before the request finished"
        return f"engine failure: {type(e).__name__}"

    async def info_cached(self) -> dict[str, Any]:
        if self._info is None:
            try:
                self._info = await self.llm.info.remote()
            except Exception as e:  # noqa: BLE001 - a replica failed: the API's 503, not a plain-text 500
                raise ApiError(503, f"cannot reach the model: {_error_text(e)}", "unavailable") from None
        return self._info

    async def _refuse_past_context(self, n: int, max_new: Any) -> None:
        """The engine's own length checks, in its order, before routing: the router counts max_new_tokens as
        work (a refused 10**300 erased a replica's real load in its float arithmetic). A prompt over
        max_input_tokens is its own fault, not max_tokens' (the sum's refusal blamed max_tokens)."""
        info = await self.info_cached()
        if n > info["max_input_tokens"]:
            raise ApiError(422, f"the prompt has {n} tokens, more than max_input_tokens ({info['max_input_tokens']})",
                           code=CONTEXT_EXCEEDED, overflow=(n, info["max_input_tokens"]))
        if isinstance(max_new, int) and not isinstance(max_new, bool):
            limit = info["max_total_tokens"]
            if n + max_new > limit:
                raise ApiError(422, f"prompt ({n}) + max_new_tokens ({max_new}) = {n + max_new} tokens, more than "
                                    f"max_total_tokens ({limit})", param="max_tokens", code=CONTEXT_EXCEEDED)

    async def _off_loop(self, fn, *args, **kwargs):
        return await asyncio.get_running_loop().run_in_executor(self._tokenizer_thread,
                                                                functools.partial(fn, *args, **kwargs))

    async def _refuse_overlong(self, chars: int, param: str | None = None) -> None:
        """Refuse a text that must have more than ``max_input_tokens`` tokens before tokenizing it (2 MB
        take the one tokenizer thread for seconds, and every other request waits behind it). The bound
        is loose (twice the longest vocabulary entry per token, for normalizers), so it never refuses a
        text that would fit."""
        limit = (await self.info_cached())["max_input_tokens"]
        if chars > 2 * limit * self._max_token_chars:
            raise ApiError(422, f"the prompt has more tokens than max_input_tokens ({limit}): "
                                f"{chars} characters", param=param, code=CONTEXT_EXCEEDED,
                           overflow=(max(chars // (2 * self._max_token_chars), limit + 1), limit))

    async def _tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return await self._off_loop(lambda: list(self.tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"]))

    def _detok(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def _token_text(self, tid: int) -> str:
        """One token's text, cached: log-probs ask for it up to 21 times per generated token. A special
        token shows its own text ("</s>"), as in TGI's details."""
        got = self._text_cache.get(tid)
        if got is None:
            got = self.tokenizer.decode([tid], skip_special_tokens=False)
            if self._anchor is not None and tid not in self._special:  # its own leading space too
                head = self.tokenizer.decode([self._anchor], skip_special_tokens=False)
                joined = self.tokenizer.decode([self._anchor, tid], skip_special_tokens=False)
                if joined.startswith(head):
                    got = joined[len(head):]
            self._text_cache[tid] = got
        return got

    def _listed_token(self, tid: int) -> str:
        """A token as completions' ``tokens`` and ``top_logprobs`` keys name it: its text, or, for one that
        holds part of a UTF-8 character (shown as U+FFFD), its bytes as OpenAI writes them
        ("bytes:\\xe2\\x80"), and one with no text at all (an id past the tokenizer's vocabulary, in a
        model's padded embedding) as vLLM names tokens by id ("token_id:300"): the alternatives are keyed by
        these names, and such tokens would collide."""
        text = self._token_text(tid)
        if not text:
            return f"token_id:{tid}"
        if "\ufffd" not in text:
            return text
        raw = bytes(self._token_bytes(tid))
        try:
            raw.decode()
            return text  # a real U+FFFD in the vocabulary
        except UnicodeDecodeError:
            return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)

    def _token_bytes(self, tid: int) -> list[int]:
        got = self._bytes_cache.get(tid)
        if got is None:
            got = token_bytes(self.tokenizer.convert_ids_to_tokens(tid), self._token_text(tid), self._byte_level)
            self._bytes_cache[tid] = got
        return got

    async def _stream(self, ids: list[int], params: dict[str, Any], aborts: list | None = None,
                      sibling: bool = False) -> tuple[dict, AsyncIterator[dict]]:
        """Start a request; returns its first event and an iterator over the rest. A refused
        request raises ``ApiError`` here, before any response byte is sent. ``aborts`` gets a call that
        ends the request while the rest is not being read yet (once; later, closing the rest does).
        ``sibling``: a later choice of a prompt this call's first choice computed (``LLMServer.generate``)."""
        started = in_process.REQUEST_START.get() or time.monotonic()
        await self._refuse_past_context(len(ids), params.get("max_new_tokens"))
        for attempt in range(2):  # a replica or engine that fails before the first token: retry once
            request_id = _engine_request_id()
            flags = {"sibling": True} if sibling else {}  # (routers read the positional arguments)
            gen = self.llm.options(stream=True).generate.remote(ids, params, request_id, **flags)
            it = gen.__aiter__()

            def cancel(gen=gen, request_id=request_id, generated: int = 0) -> None:
                gen.cancel()
                request_ended(request_id, generated)  # the router counts what it cost, not max_new_tokens

            try:
                first = await it.__anext__()
            except StopAsyncIteration:
                cancel()
                raise ApiError(503, "the engine ended the request without an answer", "generation") from None
            except asyncio.CancelledError:  # the client left while the request waited for its first token
                cancel()
                raise
            except Exception as e:  # noqa: BLE001 - a replica or engine failure: not the client's fault
                cancel()
                log.warning("replica call failed (attempt %d): %s", attempt + 1, e)
                if attempt == 1 or InFlight.draining:
                    raise ApiError(503, self._failure(e), "generation") from None
                continue
            if first.get("error_kind") == "unavailable" and attempt == 0 and not InFlight.draining:
                # its engine had stopped or was stopping before it ran this request: nothing was sent
                # yet, and the request did not cause it (one that was running when an engine crashed
                # is not retried: it may be what crashed it)
                cancel()
                log.warning("replica %s failed before the first token: %s", first.get("replica"), first["error"])
                if first.get("replica"):
                    avoid_replica(first["replica"])  # until Serve's health check replaces it
                continue
            break
        if first.get("token_id") is not None:
            in_process.INGRESS_TTFT.observe(time.monotonic() - started)
            if (answered := in_process.ENGINE_ANSWERED.get()) is not None:
                answered[0] = True
        if first.get("error"):
            cancel()
            raise _failed(first, running=False)

        started = False

        async def rest() -> AsyncIterator[dict]:
            nonlocal started
            started = True  # from here its finally ends the request, however the generator goes
            done = first.get("finished", False)
            generated = int(first.get("token_id") is not None)
            try:
                while not done:
                    try:
                        ev = await it.__anext__()
                    except StopAsyncIteration:
                        return
                    except Exception as e:  # noqa: BLE001 - the replica died mid-request
                        log.warning("replica failed mid-request: %s", e)
                        done = True
                        yield {"error": self._failure(e), "finished": True}
                        return
                    done = ev.get("finished", False)
                    generated += ev.get("token_id") is not None
                    yield ev
            finally:
                if not done:
                    cancel(generated=generated)  # client gone or failure: abort in the engine
                else:  # the router counts what it really cost, not its max_new_tokens
                    request_ended(request_id, generated)

        events = rest()

        def never_read(generated: int = int(first.get("token_id") is not None)) -> None:
            # a generator that never started has no finally to run: a client that left before the
            # response began to stream would leave its request generating to max_tokens (one that
            # started is closed by asyncio, after this runs: its finally knows how many tokens it got)
            if not started:
                cancel(generated=generated)

        abort = weakref.finalize(events, never_read)
        abort.atexit = False
        if aborts is not None:
            aborts.append(abort)
        return first, events

    async def _collect(self, ids: list[int], params: dict[str, Any]) -> list[dict]:
        return await self._drain(*await self._stream(ids, params))

    async def _choices(self, jobs: list[tuple[list[int], dict[str, Any]]], n: int, stream: bool,
                       prompt_only: bool = False, field: str = "n"
                       ) -> list[tuple[dict, AsyncIterator[dict]]] | list[list[dict]]:
        """``n`` choices of each prompt of ``jobs`` (its ids and sampling parameters), one engine request
        each, prompt by prompt: started (``stream``: their first events and the rest) or run to the end
        (their events). A prompt's first choice starts before its others, so the prompt is cached (and
        the router knows where) when they start, side by side: they find it there and compute only its
        last block. A choice that fails or is refused ends them all. ``prompt_only``: the requests score
        their prompts, and their events leave out the token each generates (``_prompt_only``)."""
        most = self.settings.max_ongoing_requests
        if len(jobs) * n > most:  # the rest would queue in Serve, and a stream's headers wait for every first token
            # (``field``: the request's field that asked for them, "best_of" where it draws more than n)
            what = f"{field} ({n})" if len(jobs) == 1 else f"{len(jobs)} prompts x {field} ({n})"
            raise ApiError(422, f"{what} is more than one replica runs at once (max_ongoing_requests {most}); "
                                "ask for fewer choices", param=field if len(jobs) == 1 else "prompt")
        each = [_choice_params(params, n) for _, params in jobs]
        aborts: list = []

        def start(ids: list[int], params: dict[str, Any], alone: bool, sibling: bool = False):
            return (self._stream_alone(ids, params, aborts, sibling=sibling) if alone
                    else self._stream(ids, params, aborts, sibling=sibling))

        try:
            firsts = await _all(start(ids, ps[0], len(jobs) > 1) for (ids, _), ps in zip(jobs, each, strict=True))
            others = iter(await _all(start(ids, p, True, sibling=True)
                                     for (ids, _), ps in zip(jobs, each, strict=True) for p in ps[1:]))
        except BaseException:  # those that started end now, not when the garbage collector finds them
            for abort in aborts:
                abort()
            raise
        started = [s for first in firsts for s in (first, *(next(others) for _ in range(n - 1)))]
        if prompt_only:
            started = [(_prompt_only(first), _prompt_only_rest(rest)) for first, rest in started]
        return started if stream else await _all(self._drain(first, rest) for first, rest in started)

    async def _stream_alone(self, ids: list[int], params: dict[str, Any], aborts: list, sibling: bool = False
                            ) -> tuple[dict, AsyncIterator[dict]]:
        """``_stream`` under a Serve request id of its own (in this task's copy of Serve's request context).
        The calls of one HTTP request share its id, and Serve's router (2.60) indexes pending calls by
        it: a second call routed while one with its id is pending is never assigned a replica."""
        ctx = serve_context._get_serve_request_context()
        serve_context._serve_request_context.set(replace(ctx, _internal_request_id=uuid.uuid4().hex))
        return await self._stream(ids, params, aborts, sibling=sibling)

    async def _drain(self, first: dict, rest: AsyncIterator[dict]) -> list[dict]:
        events = [first]
        async for ev in rest:
            events.append(ev)
        if events[-1].get("error"):  # it failed while running: its guide, its engine, or its replica's process
            raise _failed(events[-1], running=True)
        return events

    def _check_model(self, name: str | None, placeholders: bool = True) -> None:
        if (name is not None and name != self.model_name and name not in self.settings.model_aliases
                and not (placeholders and name in PLACEHOLDER_MODELS)):
            raise ApiError(404, f"The model `{name}` does not exist (this server serves `{self.model_name}`; "
                                "its --model-aliases option adds other names).",
                           code="model_not_found", param="model")

    # ------------------------------------------------------------------ TGI
    async def _tgi_ids(self, req: TGIRequest) -> list[int]:
        if not req.parameters.truncate:  # with truncate, a long text is fine: its end is kept
            await self._refuse_overlong(len(req.inputs), "inputs")
        t = req.parameters.truncate
        if t and t > (limit := (await self.info_cached())["max_input_tokens"]):  # (TGI's check and words)
            raise ApiError(422, f"`truncate` must be strictly positive and less than {limit}. Given: {t}",
                           param="truncate")
        ids = await self._tokenize(req.inputs, req.add_special_tokens)
        return ids[-t:] if t else ids  # TGI's truncate keeps the end of the prompt

    def _tgi_finish(self, ev: dict) -> str:
        """TGI's finish reason of a request's last event: a complete guide ended it as its EOS would (TGI's
        grammars only mask tokens, and the end is the model's EOS), not as a stop sequence."""
        if ev["finish_reason"] == "stop" and ev.get("stop_reason") is None:
            return "eos_token"
        return TGI_FINISH.get(ev["finish_reason"], "length")

    def _tgi_token(self, ev: dict) -> dict:
        """A TGI token entry of a token event, the same in ``details.tokens`` and in stream events: its
        text is the event's, so the texts of the entries that are not ``special`` add up to
        ``generated_text``, as TGI's clients add them (a character split over tokens comes whole with its
        last one). A special token (EOS) shows its own text, as special, unless its event carries the
        answer's held-back end (text kept for a stop string, a cut character): that text is the answer's,
        so its entry is not special (a client that skips special entries lost it)."""
        tok = ev.get("token_id")
        special = (tok in self._special if tok is not None else True) and not ev["text"]
        shown = self._token_text(tok) if special and tok is not None else ev["text"]
        return {"id": tok if tok is not None else -1, "text": shown, "logprob": ev.get("logprob"), "special": special}

    def _tgi_top(self, ev: dict) -> list[dict]:
        return [{"id": t, "text": self._token_text(t), "logprob": lp, "special": t in self._special}
                for t, lp in ev.get("top_logprobs") or ()]

    def _tgi_prefill(self, ids: list[int], events: list[dict]) -> list[dict]:
        """``details.prefill`` (with ``decoder_input_details``): each prompt token with its log-probability,
        null for the first, as TGI writes it; else empty."""
        plps = _prompt_logprobs_of(events)
        if plps is None:
            return []
        return [{"id": t, "text": self._token_text(t), "logprob": None if e is None else e[0]}
                for t, e in zip(ids, plps, strict=True)]

    async def _tgi_answer(self, req: TGIRequest) -> tuple[dict[str, Any], dict[str, str]]:
        """``/generate``'s answer body and headers (``POST /`` wraps the same body in a list). With
        ``best_of``, the likeliest of that many sampled sequences is the answer and, with ``details``, the
        others come in ``details.best_of_sequences``, as TGI gives them."""
        ids = await self._tgi_ids(req)
        params = _seeded(req.sampling(await self._tgi_max_new_tokens(req, ids)))
        best_of = req.parameters.best_of or 1
        if best_of == 1:
            events = await self._collect(ids, params)
            return (self._tgi_sequence(req, ids, events, params["seed"], events[-1]["num_cached_tokens"]),
                    _replica_header(events))
        drawn = await self._choices([(ids, params)], best_of, stream=False, field="parameters.best_of")
        seeds = {id(run): p["seed"] for run, p in zip(drawn, _choice_params(params, best_of), strict=True)}
        runs = _likeliest(drawn, best_of, per_token=True)
        # what the cache held for the request: the first draw's find (the others find its prompt)
        out = self._tgi_sequence(req, ids, runs[0], seeds.get(id(runs[0])), drawn[0][-1]["num_cached_tokens"])
        if req.parameters.details:
            out["details"]["best_of_sequences"] = [
                {"generated_text": seq["generated_text"], **seq["details"]}
                for seq in (self._tgi_sequence(req, ids, run, seeds.get(id(run)), None) for run in runs[1:])]
        return out, _replica_header(runs[0])

    def _tgi_sequence(self, req: TGIRequest, ids: list[int], events: list[dict], seed: int | None,
                      cached: int | None) -> dict[str, Any]:
        """One generated sequence as TGI writes it: its text and, with ``details``, the rest (``cached``:
        what the cache held for the request, said in its own answer; None in ``best_of_sequences``)."""
        text = "".join(ev["text"] for ev in events)
        out: dict[str, Any] = {"generated_text": (req.inputs + text) if req.parameters.return_full_text else text}
        if req.parameters.details:
            toks = [ev for ev in events if ev.get("token_id") is not None]
            out["details"] = {
                "finish_reason": self._tgi_finish(events[-1]),
                "generated_tokens": len(toks), "seed": seed, "prefill": self._tgi_prefill(ids, events),
                **({"cached_tokens": cached} if cached is not None else {}),
                "tokens": [self._tgi_token(ev) for ev in toks]}
            if req.parameters.top_n_tokens:
                out["details"]["top_tokens"] = [self._tgi_top(ev) for ev in toks]
        return out

    @app.post("/generate")
    async def generate(self, req: TGIRequest):
        out, headers = await self._tgi_answer(req)
        return JSONResponse(out, headers=headers)

    @app.post("/")
    async def tgi_compat(self, req: TGIRequest):
        """TGI's route at the root, which its clients (``text_generation``, ``huggingface_hub``) post
        to: a stream when ``stream`` is true, else a list holding the one ``/generate`` answer. As TGI's
        route for a text-generation model (``/info``'s pipeline tag), an unset ``return_full_text`` is true:
        ``huggingface_hub``'s ``text_generation`` leaves it unset, and TGI gives it the prompt and its answer."""
        if req.parameters.return_full_text is None:
            req = req.model_copy(update={"parameters": req.parameters.model_copy(update={"return_full_text": True})})
        if req.stream:
            return await self.generate_stream(req)
        out, headers = await self._tgi_answer(req)
        return JSONResponse([out], headers=headers)

    @app.post("/generate_stream")
    async def generate_stream(self, req: TGIRequest):
        if req.parameters.decoder_input_details:  # as TGI: its stream events have no place for them
            raise ApiError(422, "`decoder_input_details` == true is not supported when streaming tokens",
                           param="decoder_input_details")
        if (req.parameters.best_of or 1) > 1:
            raise ApiError(422, "`best_of` != 1 is not supported when streaming tokens", param="best_of")
        ids = await self._tgi_ids(req)
        params = _seeded(req.sampling(await self._tgi_max_new_tokens(req, ids)))
        first, rest = await self._stream(ids, params)

        async def body():
            text, n = "", 1  # (TGI numbers a stream's tokens from 1)
            async for ev in _chain(first, rest):
                if ev.get("error"):  # (a guide that broke off is the request's: validation, as unstreamed)
                    kind = "validation" if ev.get("error_kind") == "validation" else "generation"
                    yield _sse({"error": ev["error"], "error_type": kind})
                    return
                if ev.get("token_id") is None and not ev["finished"]:
                    continue
                text += ev["text"]
                msg = {"index": n, "token": self._tgi_token(ev), "generated_text": None, "details": None}
                if req.parameters.top_n_tokens:
                    msg["top_tokens"] = self._tgi_top(ev)
                n += 1
                if ev["finished"]:
                    msg["generated_text"] = (req.inputs + text) if req.parameters.return_full_text else text
                    if req.parameters.details:  # TGI sends them only when asked
                        msg["details"] = {"finish_reason": self._tgi_finish(ev),
                                          "generated_tokens": ev["num_output_tokens"], "seed": params["seed"],
                                          "input_length": ev["num_prompt_tokens"]}
                yield _sse(msg)

        return StreamingResponse(body(), media_type="text/event-stream", headers=_stream_headers(first))

    @app.api_route("/info", methods=["GET", "HEAD"])
    async def info(self):
        i = await self.info_cached()
        # the model and limits, shared by every replica; not one replica's own (its id, its warm-up
        # report: /metrics has those per replica), which this cache would keep after the replica is gone
        # (with the fields of TGI's own /info that its clients read; "router" is TGI's name for its router)
        return {**{k: v for k, v in i.items() if k not in ("replica", "warmup")}, "served_model_name": self.model_name,
                "router": "text-generation-router", "request_router": self.settings.router, "version": VERSION,
                "sha": None, "model_sha": None, "model_pipeline_tag": "text-generation", "docker_label": None,
                # TGI's field: the limit that answers 429 (per ingress replica), else what the replicas take
                "max_concurrent_requests": (self.settings.max_concurrent_requests
                                            or self.settings.max_ongoing_requests * await self._live_replicas()),
                "max_best_of": MAX_BEST_OF, "max_stop_sequences": MAX_STOP_STRINGS, "validation_workers": 1,
                "max_client_batch_size": 1, "max_ongoing_requests_per_replica": self.settings.max_ongoing_requests,
                "max_concurrent_requests_per_ingress": self.settings.max_concurrent_requests,  # (null: no limit)
                "sampling_defaults": self.sampling_defaults}

    async def _live_replicas(self) -> int:
        """The LLM replicas whose engines reported lately (at least one): the count /health took within the
        last second, else a new one. The ingress is not given the fleet's size (a change would restart it,
        and autoscaling changes it); its settings' num_replicas is always the default, 1."""
        at, live = self._last_health
        if time.monotonic() - at > 1.0:
            try:
                live = await self._hub.acall("fresh", HEALTHY_WITHIN_S, timeout=HEALTH_TIMEOUT_S, create=False)
                self._last_health = (time.monotonic(), live)
            except Exception:  # noqa: BLE001 - the hub is restarting: the last count stands
                pass
        return max(1, live)

    @app.api_route("/health", methods=["GET", "HEAD"])
    async def health(self):
        """200 while some replica's engine is alive, busy or not: each replica reports to the metrics
        hub every second only while its engine thread answers. Asking a replica instead would queue
        behind its ``max_ongoing_requests`` and fail a saturated, healthy service."""
        if InFlight.draining:
            raise _shutting_down()
        try:
            live = await self._hub.acall("fresh", HEALTHY_WITHIN_S, timeout=HEALTH_TIMEOUT_S,
                                         create=not InFlight.draining)
            self._last_health = (time.monotonic(), live)
        except Exception as e:  # noqa: BLE001 - the hub is gone, restarting, or hung (it gets restarted)
            at, live = self._last_health
            if time.monotonic() - at > HEALTHY_WITHIN_S:  # the last count is too old to vouch for
                raise ApiError(503, f"cannot tell: {_error_text(e) or 'timed out'}", "unhealthy") from None
        if not live and not await self._at_zero():
            raise ApiError(503, f"no replica's engine has reported in the last {HEALTHY_WITHIN_S:.0f} s "
                                "(starting up, or failed and being replaced)", "unhealthy")
        return JSONResponse({"status": "ok", "replicas": live})

    async def _at_zero(self) -> bool:
        """No replica because autoscaling (``min_replicas`` 0) took them all away is idle, not down: a
        request starts one, so a load balancer must keep sending them (a 503 would keep the service at
        zero for good). So is the cold start such a request sets off, and the way back to zero: a load
        balancer that took the service out while a request woke it would hold back the next ones for
        the whole start-up. Serve's controller knows which it is; its answer is kept for a few seconds.
        A replica that has just started reports within a second: until then (at most as long as a report
        may take) the wake-up it ended still counts."""
        at, answer = self._zero_seen
        if time.monotonic() - at >= ZERO_CHECK_S:
            try:
                answer = await asyncio.wait_for(asyncio.to_thread(self._llm_at_zero), HEALTH_TIMEOUT_S)
            except Exception:  # noqa: BLE001 - cannot tell: report what is known, no live replica
                answer = False
            self._zero_seen = (time.monotonic(), answer)
            if answer:
                self._zero_until = time.monotonic() + HEALTHY_WITHIN_S
        return answer or time.monotonic() < self._zero_until

    def _llm_at_zero(self) -> bool:
        app = serve.get_replica_context().app_name
        dep = serve.status().applications[app].deployments[f"{self.settings.deployment_name}-llm"]
        # HEALTHY (or scaling) with no replica at all: the target is zero; a failed or updating
        # deployment with none is down or starting
        if str(getattr(dep.status, "value", dep.status)) not in ZERO_OK_STATUSES:
            return False
        states = dep.replica_states
        # min_replicas 0 and none running: one starting (a request woke the deployment) or stopping
        return not states or (self.scales_to_zero and not states.get("RUNNING"))

    # ------------------------------------------------------------------ OpenAI
    def _model_card(self, name: str | None = None) -> dict[str, Any]:
        return {"id": name or self.model_name, "object": "model", "created": 0, "owned_by": "radixserve",
                **({"root": self.model_name} if name and name != self.model_name else {})}

    @app.api_route("/v1/models", methods=["GET", "HEAD"])
    async def models(self):
        # the served name first (what clients that take the first model use), then its aliases
        return {"object": "list", "data": [self._model_card(n) for n in (self.model_name, *self.settings.model_aliases)]}

    @app.api_route("/v1/models/{model:path}", methods=["GET", "HEAD"])
    async def model(self, model: str):
        self._check_model(model, placeholders=False)  # the placeholders requests may name ("tgi") are no model
        return self._model_card(model)

    async def _max_tokens(self, req, ids: list[int], default: int) -> int:
        """What the client asked for; else the default, cut to the room the context leaves (a long
        prompt without max_tokens is not an error)."""
        asked = req.requested_max_tokens()
        if asked:
            return asked
        return await self._within_room(ids, max(default, req.min_tokens))  # (a min_tokens past it: the engine says so)

    async def _tgi_max_new_tokens(self, req: TGIRequest, ids: list[int]) -> int:
        """As TGI v3's router: without max_new_tokens (or null), all the room the context leaves after the
        prompt ``ids``; one past that room is cut to it if its first chunk fits (TGI goes on chunk by chunk
        until the context is full), else refused in TGI's words."""
        asked = req.parameters.max_new_tokens
        if asked is not None:
            limit = (await self.info_cached())["max_total_tokens"]
            if len(ids) + min(asked, TGI_GENERATION_CHUNK) > limit:
                raise ApiError(422, f"`inputs` tokens + `max_new_tokens` must be <= {limit}. Given: {len(ids)} "
                                    f"`inputs` tokens and {asked} `max_new_tokens`", param="max_new_tokens")
        return await self._within_room(ids, asked or sys.maxsize)

    async def _within_room(self, ids: list[int], tokens: int) -> int:
        """``tokens`` new tokens, cut to the room the context leaves after the prompt ``ids`` (at least one:
        a prompt that leaves none is refused, saying so)."""
        room = (await self.info_cached())["max_total_tokens"] - len(ids)
        return max(1, min(tokens, room))

    def _oai_logprobs(self, events: list[dict], chat: bool, top: int, prefix: int = 0, end: int | None = None
                      ) -> dict | None:
        """OpenAI ``logprobs`` of these token events (chat: ``content`` entries; completions: lists, with
        each token's ``text_offset`` in the returned text: after a ``prefix`` of that many characters (an
        echoed prompt), at most ``end`` once the text's length is known)."""
        toks = [ev for ev in events if ev.get("token_id") is not None]
        if chat:
            def entry(t: int, lp: float) -> dict:
                return {"token": self._token_text(t), "logprob": lp, "bytes": self._token_bytes(t)}
            return {"content": [{**entry(ev["token_id"], ev["logprob"]),
                                 "top_logprobs": [entry(t, lp) for t, lp in (ev.get("top_logprobs") or ())[:top]]}
                                for ev in toks]}
        return {"tokens": [self._listed_token(ev["token_id"]) for ev in toks],
                "token_logprobs": [ev["logprob"] for ev in toks],
                "top_logprobs": [self._alternatives(ev["token_id"], ev["logprob"], ev.get("top_logprobs") or (), top)
                                 for ev in toks],
                "text_offset": [prefix + ev["text_offset"] if end is None else min(prefix + ev["text_offset"], end)
                                for ev in toks]}

    def _vllm_prompt_logprobs(self, ids: list[int], events: list[dict], top: int | None) -> list | None:
        """vLLM's ``prompt_logprobs``: per prompt token (None for the first) its own entry and its ``top``
        best alternatives, keyed by token id, each with its log-probability, rank and text; None when not
        asked for."""
        if top is None:
            return None
        plps = _engine_prompt_logprobs(events, len(ids))

        def entry(lp: float, rank: int, t: int) -> dict:
            return {"logprob": lp, "rank": rank, "decoded_token": self._token_text(t)}
        return [None if e is None else {**{str(t): entry(lp, r, t) for r, (t, lp) in enumerate(e[2][:top], 1)},
                                        str(tid): entry(e[0], e[1], tid)}
                for tid, e in zip(ids, plps, strict=True)]

    def _prompt_logprobs(self, ids: list[int], events: list[dict], top: int, length: int,
                         offsets: list[int] | None = None) -> dict:
        """Completions' ``logprobs`` lists of an echoed prompt, from the engine's ``prompt_logprobs`` (on
        its first token's event): the first token has none. A token's ``text_offset`` is where its text
        starts in the echoed prompt of ``length`` characters: ``offsets`` (the tokenizer's, for a text),
        else counted from the tokens' own bytes (special tokens have none there; a leading space the
        decoded prompt does not start with, SentencePiece's, neither)."""
        plps = _engine_prompt_logprobs(events, len(ids))
        if offsets is None:  # counted in characters of the tokens' bytes: a token inside a character
            offsets, at = [], 0  # starts where that character does
            text = codecs.getincrementaldecoder("utf-8")("replace")
            for t in ids:
                offsets.append(min(at, length))
                own = b"" if t in self._special else bytes(self._token_bytes(t))
                if at == 0 and own.startswith(b" ") and not self._detok([t]).startswith(" "):
                    own = own[1:]  # (SentencePiece's: the decoded prompt does not start with its space)
                at += len(text.decode(own))
        return {"tokens": [self._listed_token(t) for t in ids],
                "token_logprobs": [None if e is None else e[0] for e in plps],
                "top_logprobs": [None if e is None else self._alternatives(t, e[0], e[2], top)
                                 for t, e in zip(ids, plps, strict=True)],
                "text_offset": offsets}

    def _alternatives(self, token: int, logprob: float, best: Sequence[tuple[int, float]], top: int) -> dict:
        """A completions ``top_logprobs`` entry: the ``top`` likeliest tokens, and the token itself where it
        is not among them (OpenAI's: up to logprobs + 1 entries; vLLM's too)."""
        out = {self._listed_token(t): lp for t, lp in best[:top]}
        out.setdefault(self._listed_token(token), logprob)
        return out

    @app.post("/v1/completions")
    async def completions(self, req: CompletionRequest):
        self._check_model(req.model)
        prompts = req.prompts()
        for p in prompts:
            if isinstance(p, str) and not req.truncate_prompt_tokens:  # (a long text is fine: its end is kept)
                await self._refuse_overlong(len(p), "prompt")
        top = req.logprobs or 0
        jobs, prefixes, offsets = [], [], []
        # OpenAI's 16 without max_tokens, or less where the model's generation_config says less (as vLLM)
        default = min(16, self.sampling_defaults.get("max_new_tokens", 16))
        for p in prompts:
            full = p if isinstance(p, list) else await self._tokenize(p, req.add_special_tokens)
            ids = await self._truncated(full, req.truncate_prompt_tokens)
            whole_text = isinstance(p, str) and len(ids) == len(full)  # (not cut: the text is the prompt)
            # (scoring the prompt alone: the engine generates one token, which the answer leaves out)
            params = req.sampling(1 if req.echo_only() else await self._max_tokens(req, ids, default),
                                  logprobs=req.logprobs is not None, top_logprobs=top, defaults=self.sampling_defaults)
            params["bad_words_ids"] = await self._bad_words_ids(req.bad_words)
            if req.echo and req.logprobs is not None:  # the echoed prompt's tokens come with theirs
                params["prompt_logprobs"] = max(top, req.prompt_logprobs or 0)
            jobs.append((ids, params))
            # (a truncated text echoes what is left of it)
            prefixes.append((p if whole_text else self._detok(ids)) if req.echo else "")
            offsets.append(await self._text_offsets(p, ids, req.add_special_tokens)
                           if req.echo and req.logprobs is not None and whole_text else None)
        rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        if req.stream:
            return await self._openai_stream(jobs, rid, created, "text_completion", req, prefixes, top, offsets,
                                             prompt_only=req.echo_only())
        def choice(i: int, events: list[dict]) -> dict:  # n per prompt, in prompt order (as OpenAI numbers them)
            prefix = prefixes[i // req.n]
            text = prefix + "".join(ev["text"] for ev in events)
            logprobs = self._oai_logprobs(events, False, top, len(prefix), len(text)) if req.logprobs is not None else None
            if logprobs is not None and req.echo:
                echoed = self._prompt_logprobs(jobs[i // req.n][0], events, top, len(prefix), offsets[i // req.n])
                logprobs = {k: None if v is None else echoed[k] + v for k, v in logprobs.items()}
            return {"text": text, "logprobs": logprobs,
                    "prompt_logprobs": self._vllm_prompt_logprobs(jobs[i // req.n][0], events, req.prompt_logprobs)}

        drawn = max(req.best_of or 1, req.n)
        if drawn > req.n:  # the likeliest n of best_of, each prompt's in its own order
            for _, params in jobs:
                params["logprobs"] = True  # (to rank them; left out of the answer unless asked for)
        runs = await self._choices(jobs, drawn, stream=False, prompt_only=req.echo_only(),
                                   field="best_of" if drawn > req.n else "n")
        firsts = [runs[k * drawn][-1] for k in range(len(jobs))]  # (what each prompt's first draw found cached)
        if drawn > req.n:
            runs = [run for k in range(len(jobs)) for run in _likeliest(runs[k * drawn:(k + 1) * drawn], req.n)]
        return self._openai_answer(runs, req.n, rid, created, "text_completion", choice, firsts=firsts)

    @app.post("/v1/chat/completions")
    async def chat(self, req: ChatRequest):
        # without max_tokens, as OpenAI, vLLM and TGI: up to the room the context leaves (or the model's own default)
        return await self._chat(req, self.sampling_defaults.get("max_new_tokens", sys.maxsize))

    async def _chat(self, req: ChatRequest, default: int, counted: list[int] | None = None):
        """A chat answer (a stream with ``stream``); ``default``: its max_tokens when it sets none (at most
        the room its context leaves). ``counted`` gets the prompt's length once it is tokenized."""
        self._check_model(req.model)
        ids = await self._truncated(await self._chat_ids(req, overlong=not req.truncate_prompt_tokens),
                                    req.truncate_prompt_tokens)
        if counted is not None:
            counted[0] = len(ids)
        top = req.top_logprobs or 0
        params = req.sampling(await self._max_tokens(req, ids, default), logprobs=req.logprobs,
                              top_logprobs=top, defaults=self.sampling_defaults)
        params["bad_words_ids"] = await self._bad_words_ids(req.bad_words)
        strict = False  # whether the guide is strict tools' (its own structured output guides otherwise)
        if req.tool_mode() == "auto" and self.settings.tool_call_parser != "none":
            params["skip_special_tokens"] = False  # (a call's tag may be a special token: [TOOL_CALLS])
            if params.get("guide") is None:
                params["guide"] = self._strict_tools_guide(req, params)
                strict = params["guide"] is not None
            elif params["guide"][0] == "json":  # a response format: the answer is in it, or calls tools
                params["guide"] = self._strict_tools_guide(req, params, answer=params["guide"][1]) or params["guide"]
        rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        tools = req.tool_mode() != "none"
        prefill = req.messages[-1].text() if req.continue_final_message else None
        mode = self._thinking_mode(ids, params, prefill)
        if strict and params.get("guide_after"):
            # it waits for the end of the thinking: its free text may not write the tags (a guide that can
            # write one holds the thinking too, from the first token, and a tag that is one added token is
            # masked in free text: the thinking never ended); one that does not wait keeps them (spelled-out
            # tags: thinking is the guide's to write then)
            params["guide"] = self._strict_tools_guide(req, params, thinking=True)
        if req.stream and tools:  # the calls are known once the answer is whole
            return await self._tool_stream(req, [(ids, params)], rid, created, top, mode)
        if req.stream:
            return await self._openai_stream([(ids, params)], rid, created, "chat.completion.chunk", req, [""], top,
                                             thinking=mode)
        def choice(i: int, events: list[dict]) -> dict:
            message, finish = self._assistant_message(req, events, mode)
            return {"message": message, "logprobs": self._oai_logprobs(events, True, top) if req.logprobs else None,
                    **({"finish_reason": finish} if finish else {})}

        runs = await self._choices([(ids, params)], req.n, stream=False)
        reasoning = None if mode is None else [
            reasoning_tokens([(ev["text"], ev.get("token_id") is not None) for ev in events], mode) for events in runs]
        return self._openai_answer(runs, req.n, rid, created, "chat.completion", choice,
                                   {"prompt_logprobs": self._vllm_prompt_logprobs(ids, runs[0], req.prompt_logprobs)},
                                   reasoning)

    def _strict_tools_guide(self, req: ChatRequest, params: dict[str, Any], thinking: bool = False,
                            answer: str | None = None) -> tuple[str, str] | None:
        """Where a tool of an auto-tool answer is strict, the guide that holds each call the answer begins
        (``strict_auto_guide``; ``thinking``: one that waits for the end of the thinking, whose text holds no
        thinking tag); beside a response format (``answer``, its JSON schema), the guide of an answer in it or
        of calls (``format_or_calls_guide``). None beside what a guide would change: under ignore_eos an EOS
        where a guide is complete ends the answer (this one is, wherever no call is open); a stop token that
        is a special token would be masked (llguidance allows only the end tokens it is given); min_tokens and
        allowed_token_ids the engine refuses beside a guide."""
        # (beside a format nothing changes: its own guide does all that already)
        if answer is None and any(params.get(k) for k in ("ignore_eos", "min_tokens", "allowed_token_ids",
                                                           "stop_token_ids")):
            return None
        tools = req.tools_strictness()
        parser, parallel = self.settings.tool_call_parser, req.parallel_tool_calls is not False
        if answer is not None:
            try:
                answer_schema = json.loads(answer)
            except (ValueError, RecursionError):
                return None  # (the format's own check says what is wrong with it)
            if not isinstance(answer_schema, dict):
                return None
        try:
            if answer is not None:
                return format_or_calls_guide(answer_schema, tools, parser, parallel, self._hermes_ids)
            return strict_auto_guide(tools, parser, parallel, self._hermes_ids, (START, END) if thinking else ())
        except ValueError as e:
            raise ApiError(422, str(e), param="tools") from None
        except RecursionError:  # (a format nested past what the walks take: its own check refuses it)
            return None

    @app.post("/v1/responses")
    async def responses(self, req: ResponsesRequest):
        """OpenAI's Responses API, answered by the chat route (``app.responses_api``)."""
        self._check_model(req.model)
        rid = f"resp_{uuid.uuid4().hex}"
        # without max_output_tokens, as OpenAI's: up to the room the context leaves (or the model's own default)
        return await self._chat_view(req.chat(), self.sampling_defaults.get("max_new_tokens", sys.maxsize),
                                     ResponseEvents(req, rid, int(time.time()), self.model_name), req.stream)

    @app.post("/v1/messages")
    async def messages(self, req: MessagesRequest):
        """Anthropic's Messages API, answered by the chat route (``app.messages_api``)."""
        self._check_model(req.model)
        rid = f"msg_{uuid.uuid4().hex}"
        named = (req.tool_choice or {}).get("type") == "tool"
        # max_tokens 0 (Anthropic's cache pre-warming): the prompt is computed, one token drawn and left out
        return await self._chat_view(req.chat(), max(req.max_tokens, 1),
                                     MessageEvents(rid, self.model_name, req.max_tokens, named), req.stream)

    @app.post("/v1/messages/count_tokens")
    async def count_message_tokens(self, req: MessagesCountRequest):
        """Anthropic's token count of a request: its prompt's tokens as the chat route renders them."""
        self._check_model(req.model)
        body = {**req.chat(), "stream": False}  # (a count streams nothing: a stream field is ignored)
        body.pop("stream_options", None)
        chat = _validated_chat(body, MessageEvents)
        return {"input_tokens": len(await self._chat_ids(chat, overlong=False))}

    async def _chat_view(self, body: dict[str, Any], default: int, events: ChunkEvents, stream: bool):
        """The chat route's answer to ``body`` in another API's shape: ``events`` (``start``, ``chunk``,
        ``end``, ``fail``) makes its stream of the chat stream's chunks; unstreamed, the answer is what they
        add up to (``final``), so both say the same. ``default``: max_tokens when the body sets none. A stream
        whose first token takes longer than PING_EVERY_S (a queue, a long prefill) starts without it and
        pings while it waits, as Anthropic's API does, so proxies that cut idle streams keep it; a refusal
        then comes as the stream's error event (before, it is the HTTP error it always is)."""
        body = {**body, "stream": True, "stream_options": {"include_usage": True}}
        counted = [0]
        chat = _validated_chat(body, type(events))
        chat._strict_unless_said = type(events).TOOLS_STRICT_UNLESS_SAID
        pending = asyncio.ensure_future(self._chat(chat, default, counted))
        try:
            if stream and not (await asyncio.wait({pending}, timeout=self.first_token_ping_s))[0]:
                return StreamingResponse(self._late_view(pending, events, counted), media_type="text/event-stream",
                                         headers=UNBUFFERED)
            answer = await pending  # (refusals raise here, before any byte)
        except ApiError as e:
            raise _in_own_terms(e, type(events)) from None
        except BaseException:
            pending.cancel()  # (the client left while it waited: its requests end)
            raise
        replica = {k: v for k, v in answer.headers.items() if k == "x-radixserve-replica"}
        failed: list[dict[str, Any]] = []
        translated = self._translated(answer, events, stream, failed)
        if stream:
            return StreamingResponse(translated, media_type="text/event-stream", headers={**replica, **UNBUFFERED})
        async with contextlib.aclosing(translated) as unsent:
            async for _ in unsent:
                pass
        if failed:  # (nothing was sent: the API's error, as the chat route's whole answer gives it)
            error = failed[0]
            if error.get("type") == "invalid_request_error":
                raise ApiError(422, error.get("message") or "the request failed", "validation")
            raise ApiError(503, error.get("message") or "the request failed", "generation", code=error.get("code"))
        return _EscapedJSON(events.final(), headers=replica)

    @staticmethod
    async def _translated(answer: StreamingResponse, events: ChunkEvents, stream: bool, failed: list[dict[str, Any]],
                          started: bool = False) -> AsyncIterator[str]:
        """``_chat_view``'s events of the chat route's streamed ``answer`` (``failed`` gets its error, if any;
        ``started``: ``events.start`` was sent)."""
        events.prompt_tokens(int(answer.headers.get("x-radixserve-prompt-tokens", 0)),
                             int(answer.headers.get("x-radixserve-cached-tokens", 0)))
        # (closing the chunks ends the requests; the pings' reader closes first, with what it awaits)
        async with contextlib.aclosing(answer.body_iterator) as chunks, \
                contextlib.aclosing(with_pings(chunks, PING_EVERY_S if stream else None, None)) as pinged:
            for ev in () if started else events.start():
                yield ev
            try:
                done = False
                async for piece in pinged:
                    if piece is None:  # nothing for a while: a keep-alive
                        yield events.PING
                        continue
                    # (a piece may hold several events: an error comes with its [DONE])
                    for data in _sse_data(piece):
                        if done := data == "[DONE]":
                            break
                        chunk = json.loads(data)
                        if error := chunk.get("error"):
                            failed.append(error)
                            # (the request's own error, a guide that cannot go on, is no server error: of
                            # the type a refusal before the stream has)
                            status = 422 if error.get("type") == "invalid_request_error" else 500
                            for ev in events.fail(error.get("message") or "the request failed", status):
                                yield ev
                            return
                        for ev in events.chunk(chunk):
                            yield ev
                    if done:
                        break
            except Exception as e:  # noqa: BLE001 - a client waits for the stream's last event: it gets one
                log.exception("stream of %s failed", type(events).__name__)
                failed.append({"message": _error_text(e), "code": ENGINE_FAILURE})
                for ev in events.fail(_error_text(e)):
                    yield ev
                return
        for ev in events.end():
            yield ev

    async def _late_view(self, pending: asyncio.Future, events: ChunkEvents, counted: list[int]) -> AsyncIterator[str]:
        """``_chat_view``'s stream started before its first token: pings until the chat route answers.
        ``counted``: the prompt's length, known by now (its cached share is not: the end says it)."""
        taken = False
        try:
            events.prompt_tokens(counted[0], 0)
            for ev in events.start():
                yield ev
            while not (await asyncio.wait({pending}, timeout=self.first_token_ping_s))[0]:
                yield events.PING
            try:
                answer = pending.result()
            except ApiError as e:  # a refusal: of the type its HTTP status would have named
                for ev in events.fail(_client_message(e), e.status, e.code):
                    yield ev
                return
            except Exception as e:  # noqa: BLE001 - a client waits for the stream's last event: it gets one
                log.exception("stream of %s failed", type(events).__name__)
                for ev in events.fail(_error_text(e)):
                    yield ev
                return
            taken = True
            async with contextlib.aclosing(self._translated(answer, events, True, [], started=True)) as translated:
                async for ev in translated:
                    yield ev
        finally:
            if not pending.done():
                pending.cancel()  # the client left while it waited: its requests end
            elif not taken and not pending.cancelled() and pending.exception() is None:
                await pending.result().body_iterator.aclose()  # (left as the answer came)

    def _thinking_mode(self, ids: list[int], params: dict[str, Any], prefill: str | None = None) -> str | None:
        """How a chat answer starts (app.reasoning.start_mode) under the reasoning parser, from the end of
        its prompt: a template may open (or close) the thinking block there. None: no parser. A guided
        answer (a schema, a tool call) thinks first, as vLLM has it: its guide waits for the end tag (one
        that may or may not open the block waits only if its first token is the start tag, a token of its
        own), else it is guided from its first token and thinks only if the guide asks for it. ``prefill``:
        the assistant message the answer carries on (``start_mode``)."""
        parser = self.settings.reasoning_parser
        if parser == "none":
            return None
        mode = start_mode(parser, self.tokenizer.decode(ids[-32:]), prefill)
        if params.get("guide") is None or mode == CONTENT:
            return mode
        opener = self._think_tokens.get(START)
        if END not in self._think_tokens or (mode == TAGGED and opener is None):
            return TAGGED  # (guided from its first token: it thinks only if its guide writes a block)
        params["guide_after"] = END
        if mode == TAGGED:
            params["guide_opener"] = opener
        return mode

    def _assistant_message(self, req: ChatRequest, events: list[dict], thinking_mode: str | None = None
                           ) -> tuple[dict[str, Any], str | None]:
        """A chat choice's message, with its thinking split out (``thinking_mode``: app.reasoning), the tool
        calls its answer makes (app.tool_calls), and the finish reason those calls give it (None: the engine's)."""
        text = "".join(ev["text"] for ev in events)
        thinking = ""
        if thinking_mode is not None:
            thinking, text = split(text, thinking_mode)
        mode = req.tool_mode()
        content: str | None = text
        calls: list[ToolCall] = []
        complete = True
        if mode == "named":  # the answer is the arguments (cut short only by max_tokens; none: it never
            content, calls = None, [ToolCall(req.named_tool().name, text)] if text else []  # ended thinking)
        elif mode == "required" or (mode == "auto" and self.settings.tool_call_parser != "none"):
            parser = "required" if mode == "required" else self.settings.tool_call_parser
            # (parallel_tool_calls false: one call at most; the required guide allows only one)
            content, calls, complete = read_answer(parser, text, {t.function.name for t in req.tools},
                                                   first_only=req.parallel_tool_calls is False,
                                                   engine=events[-1].get("finish_reason") or "")
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if thinking:
            message["reasoning_content"] = thinking
            message["content"] = content or None  # (all thinking: no answer yet, as vLLM says it)
        if calls:
            message["tool_calls"] = [c.as_openai(self.settings.tool_call_parser) for c in calls]
        return message, "tool_calls" if calls and complete and mode != "named" else None

    async def _tool_stream(self, req: ChatRequest, jobs, rid: str, created: int, top: int,
                           thinking_mode: str | None = None) -> StreamingResponse:
        """A chat stream of a request that may call tools, in OpenAI's ``tool_calls`` deltas: a named
        function's arguments stream as they come; with tool_choice auto (under a tool call parser) or
        required, each call's name as soon as it is read and its arguments as they are written, and the
        answer's other text as content (``app.tool_stream``)."""
        started = await self._choices(jobs, req.n, stream=True)
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        continuous = _continuous_usage(req)
        # each choice's last event: its usage so far (continuous_usage_stats), and at the end its usage
        latest = [_before_tokens(first) for first, _ in started]
        mode, parser = req.tool_mode(), self.settings.tool_call_parser
        names = {t.function.name for t in req.tools}

        def chunk(index: int, delta: dict, finish: str | None = None, events: list[dict] | None = None,
                  **extra: Any) -> str:
            logprobs = self._oai_logprobs(events, True, top) if req.logprobs and events else None
            usage = _running_usage(latest[index]) if continuous else None
            return _sse({"id": rid, "object": "chat.completion.chunk", "created": created, "model": self.model_name,
                         "choices": [{"index": index, "delta": delta, "finish_reason": finish, "logprobs": logprobs,
                                      **extra}], **({"usage": usage} if include_usage else {})})

        def reader() -> ToolCallStream | None:
            if mode == "required":
                return ToolCallStream("required", names, parser)
            return ToolCallStream(parser, names, parser) if mode == "auto" and parser != "none" else None

        async def body():
            named_sent = [False] * len(started)  # whether a named call's first delta (its id and name) is out
            unsent: list[list[dict]] = [[] for _ in started]  # token events whose log-probs are not out yet
            thinking = [ReasoningStream(thinking_mode) if thinking_mode else None for _ in started]
            calls = [reader() for _ in started]
            for i in range(len(started)):
                yield chunk(i, {"role": "assistant", "content": ""})
            async with contextlib.aclosing(_merged([_chain(first, rest) for first, rest in started])) as events:
                async for i, ev in events:
                    if ev.get("error"):
                        yield _oai_stream_error(ev)
                        return
                    latest[i] = ev
                    if ev.get("token_id") is not None:
                        unsent[i].append(ev)
                    thought, piece = _split_piece(thinking[i], ev)
                    if thought:
                        yield chunk(i, {"reasoning_content": thought}, events=unsent[i])
                        unsent[i] = []
                    if mode == "named":  # (the answer is the arguments)
                        head = {} if named_sent[i] else {"id": new_call_id(parser), "type": "function"}
                        fn = {} if named_sent[i] else {"name": req.named_tool().name}
                        deltas = [{"tool_calls": [{"index": 0, **head, "function": {**fn, "arguments": piece}}]}] \
                            if piece else []  # (none at all where the answer never ended its thinking)
                        named_sent[i] = named_sent[i] or bool(deltas)
                    elif calls[i] is not None:
                        past_args = calls[i].state in ("tail", "done")  # (a call's end: its closing tag)
                        deltas = calls[i].feed(piece) + (calls[i].finish() if ev["finished"] else [])
                        if req.parallel_tool_calls is False:  # one call at most: the later ones are not sent
                            kept = [d for d in deltas if all(c["index"] == 0 for c in d.get("tool_calls", ()))]
                            past_args, deltas = past_args or len(kept) < len(deltas), kept
                        if past_args and not deltas:  # a call's end, or a call not sent: its tokens are not
                            unsent[i] = []  # the log-probs of the text after it
                    else:
                        deltas = [{"content": piece}] if piece else []
                    for delta in deltas:
                        yield chunk(i, delta, events=unsent[i])
                        unsent[i] = []
                    if ev["finished"]:
                        finish = _oai_finish(ev["finish_reason"])
                        if calls[i] is not None:
                            finish = calls[i].finish_reason(finish, first_only=req.parallel_tool_calls is False)
                        yield chunk(i, {}, finish, events=unsent[i], stop_reason=ev.get("stop_reason"))
            if include_usage:
                yield self._usage_event(rid, "chat.completion.chunk", created, latest, req.n,
                                        None if thinking_mode is None else [t.reasoning_tokens for t in thinking])
            yield "data: [DONE]\n\n"

        return StreamingResponse(body(), media_type="text/event-stream", headers=_stream_headers(started[0][0]))

    def _usage_event(self, rid: str, obj: str, created: int, finals: list[dict], n: int,
                     reasoning: list[int] | None = None) -> str:
        """A stream's last chunk before ``[DONE]`` with ``stream_options.include_usage``: no choices, the usage."""
        return _sse({"id": rid, "object": obj, "created": created, "model": self.model_name, "choices": [],
                     "usage": _usage(finals, n, reasoning)})

    def _openai_answer(self, runs: list[list[dict]], n: int, rid: str, created: int, obj: str, choice,
                       extra: dict | None = None, reasoning: list[int] | None = None,
                       firsts: list[dict] | None = None) -> JSONResponse:
        """A whole OpenAI answer of its choices' events (``n`` per prompt): ``choice(i, events)`` gives the
        API's own fields of choice ``i``, ``extra`` its own top-level ones; the index, the finish reason and
        the envelope are the same."""
        choices = [{"index": i, **choice(i, events)} for i, events in enumerate(runs)]
        for c, events in zip(choices, runs, strict=True):  # (last, as OpenAI writes it; a choice may say its own)
            c["finish_reason"] = c.pop("finish_reason", None) or _oai_finish(events[-1]["finish_reason"])
            c["stop_reason"] = events[-1].get("stop_reason")  # vLLM's: the stop string or token id that ended it
        return JSONResponse({"id": rid, "object": obj, "created": created, "model": self.model_name,
                             "choices": choices, "usage": _usage([events[-1] for events in runs], n, reasoning, firsts),
                             **(extra or {})},
                            headers=_replica_header(runs[0]))

    async def _bad_words_ids(self, words: list[str] | None) -> list[list[int]]:
        """vLLM's ``bad_words`` as token sequences the engine bans: each word as it starts a text and, where
        the tokenizer gives a word after a space other tokens, as it follows a space."""
        if not words:
            return []

        def encode() -> list[list[int]]:
            out: list[list[int]] = []
            for word in words:
                bare = word.lstrip()
                for text in (bare, " " + bare):
                    ids = list(self.tokenizer(text, add_special_tokens=False)["input_ids"])
                    if ids and ids not in out:
                        out.append(ids)
            return out
        return await self._off_loop(encode)

    async def _text_offsets(self, text: str, ids: list[int], add_special_tokens: bool) -> list[int] | None:
        """Where each of a text's tokens starts in it, as the tokenizer maps them (None: the tokenizer
        cannot say, or ``ids`` are not that text's tokens, e.g. truncated)."""
        def spans() -> list[int] | None:
            try:
                enc = self.tokenizer(text, add_special_tokens=add_special_tokens, return_offsets_mapping=True)
            except (NotImplementedError, ValueError, TypeError):  # a slow tokenizer has no offsets
                return None
            if list(enc["input_ids"]) != ids:
                return None
            return [start for start, _ in enc["offset_mapping"]]
        return await self._off_loop(spans)

    async def _truncated(self, ids: list[int], keep: int | None) -> list[int]:
        """The prompt's last ``keep`` tokens (vLLM's truncate_prompt_tokens; -1: max_input_tokens)."""
        if not keep:
            return ids
        if keep == -1:
            keep = (await self.info_cached())["max_input_tokens"]
        return ids[-keep:]

    async def _chat_ids(self, req: ChatPrompt, overlong: bool = True) -> list[int]:
        """The token ids of a chat as the model's template renders it (``overlong``: a text too long to be
        a prompt is refused before it is rendered)."""
        if not getattr(self.tokenizer, "chat_template", None):
            raise ApiError(400, "this model has no chat template; use /v1/completions")
        try:
            msgs = template_call_ids([m.for_template(f"messages[{i}].content") for i, m in enumerate(req.messages)],
                                     self.settings.tool_call_parser)
            if overlong:
                await self._refuse_overlong(sum(len(m["content"]) for m in msgs), "messages")
        except ValueError as e:
            raise ApiError(422, str(e), param="messages") from None
        # the tools, through its template: with tool_choice none too (as vLLM by default), so the model
        # knows them and the prompt starts as the turns that may call them (one cached prefix)
        tools = {"tools": [t.model_dump(exclude_none=True) for t in req.tools]} if getattr(req, "tools", None) else {}
        if self._sanitize and (pattern := _control_token_pattern(self.tokenizer)) is not None:
            for name, value in (("messages", msgs), *tools.items()):
                if found := _control_token_in_keys(value, pattern, name):
                    raise ApiError(422, f"{found[0][:200]}: a key holds the model's control token {found[1]!r}, "
                                        "which a chat template cannot show as text", param=name)
        try:
            enc = await self._off_loop(self.tokenizer.apply_chat_template, msgs, tokenize=True,
                                       add_generation_prompt=req.add_generation_prompt,
                                       continue_final_message=req.continue_final_message, **tools,
                                       **(req.chat_template_kwargs or {}), **self._sanitize)
        except Exception as e:  # noqa: BLE001 - the template refused these messages (raise_exception, ...)
            raise ApiError(422, f"the model's chat template cannot render these messages: {_error_text(e)}",
                           param="messages") from None
        return list(enc["input_ids"] if hasattr(enc, "keys") else enc)

    # ------------------------------------------------------------------ tokenizer
    @app.post("/tokenize")
    async def tokenize(self, req: TGITokenizeRequest | TokenizeRequest | ChatTokenizeRequest):
        """TGI's (a generate request's body: each token with its span of the text) or vLLM's (a prompt, or
        messages as chat renders them: the ids and their count), told apart by the body's fields."""
        if isinstance(req, TGITokenizeRequest):
            if not getattr(self.tokenizer, "is_fast", False):
                raise ApiError(501, "this model's tokenizer does not give character offsets (it is not a fast "
                                    "tokenizer): use {\"prompt\": ...} for the ids alone", "tokenizer")
            def answer() -> _EscapedJSON:  # (made and rendered off the event loop: 2 MB of text is a million
                enc = self.tokenizer(req.inputs, return_offsets_mapping=True,  # entries, a second of work)
                                     add_special_tokens=req.add_special_tokens)
                pairs = list(zip(enc["input_ids"], enc["offset_mapping"], strict=True))
                t = req.parameters.truncate  # (as the prompt a generate request with it would have)
                return _EscapedJSON([{"id": tid, "text": req.inputs[a:b], "start": a, "stop": b}
                                     for tid, (a, b) in (pairs[-t:] if t else pairs)])
            return await self._off_loop(answer)
        self._check_model(req.model)
        if isinstance(req, ChatTokenizeRequest):
            ids = await self._chat_ids(req)
        else:
            ids = await self._tokenize(req.prompt, req.add_special_tokens)
        limit = (await self.info_cached())["max_total_tokens"]
        return await self._off_loop(lambda: JSONResponse({  # (off the loop too: 2 MB of ids took it for seconds)
            "count": len(ids), "max_model_len": limit, "tokens": ids,
            "token_strs": self.tokenizer.convert_ids_to_tokens(ids) if req.return_token_strs else None}))

    @app.post("/detokenize")
    async def detokenize(self, req: DetokenizeRequest):
        """vLLM's: the text of token ids, special tokens included."""
        self._check_model(req.model)
        vocab = (await self.info_cached())["vocab_size"]
        bad = next((t for t in req.tokens if t >= vocab), None)
        if bad is not None:
            raise ApiError(422, f"token id {bad} is outside the vocabulary (0..{vocab - 1})", param="tokens")
        return {"prompt": await self._off_loop(self.tokenizer.decode, req.tokens, skip_special_tokens=False)}

    async def _openai_stream(self, jobs, rid, created, obj, req, prefixes: list[str], top: int = 0,
                             offsets: list | None = None, thinking: str | None = None, prompt_only: bool = False):
        """An OpenAI stream (completions, or chat without tools); ``thinking``: how a chat answer starts
        under the reasoning parser (app.reasoning), None without one; ``prompt_only``: as ``_choices``."""
        started = await self._choices(jobs, req.n, stream=True, prompt_only=prompt_only)
        chat = obj == "chat.completion.chunk"
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        want_logprobs = jobs[0][1]["logprobs"]
        echo_ids = [ids for ids, _ in jobs] if jobs[0][1].get("prompt_logprobs") is not None else None
        continuous = _continuous_usage(req)

        def chunk(st: _StreamedChoice, text: str | None, finish: str | None, role: bool = False) -> dict:
            c = _chunk(st.index, text, finish, role)
            if continuous:
                c["usage"] = _running_usage(st.latest)
            st.sent += len(text or "")
            if want_logprobs and st.unsent:  # the last chunk knows the text's length: a stop string left out
                # a token goes with the chunk that sends the start of its text (a stop string cuts at or
                # after what was sent, so its text_offset is final then); later ones wait for their text.
                # (Under a reasoning parser a chat's content is not its whole text: its tokens go as they come)
                ready = len(st.unsent) if st.thinking is not None or finish else next(
                    (i for i, ev in enumerate(st.unsent) if len(st.prefix) + ev["text_offset"] >= st.sent), len(st.unsent))
                if ready:
                    c["choices"][0]["logprobs"] = self._oai_logprobs(st.unsent[:ready], chat, top, len(st.prefix),
                                                                     st.sent if finish else None)
                    del st.unsent[:ready]
            return c

        def _chunk(index: int, text: str | None, finish: str | None, role: bool = False) -> dict:
            if chat:
                delta: dict[str, Any] = {"role": "assistant", "content": ""} if role else {}  # (as OpenAI's)
                if text:
                    delta["content"] = text
                c = {"index": index, "delta": delta, "finish_reason": finish, "logprobs": None}
            else:
                c = {"index": index, "text": text or "", "finish_reason": finish, "logprobs": None}
            # (with include_usage, every chunk but the last says usage: null, as OpenAI's)
            return {"id": rid, "object": obj, "created": created, "model": self.model_name, "choices": [c],
                    **({"usage": None} if include_usage else {})}

        async def body():
            states = [_StreamedChoice(i, prefixes[i // req.n], thinking=ReasoningStream(thinking) if thinking else None,
                                      latest=_before_tokens(started[i][0])) for i in range(len(started))]
            for st in states:
                if chat:
                    yield _sse(chunk(st, "", None, role=True))
                elif st.prefix or (want_logprobs and echo_ids):  # (an echo of no text still has its tokens)
                    c = chunk(st, st.prefix, None)
                    if want_logprobs and echo_ids:  # the echoed prompt's own log-probabilities
                        c["choices"][0]["logprobs"] = self._prompt_logprobs(
                            echo_ids[st.index // req.n], [started[st.index][0]], top, len(st.prefix),
                            offsets[st.index // req.n] if offsets else None)
                    yield _sse(c)
            finals: dict[int, dict] = {}
            async with contextlib.aclosing(_merged([_chain(first, rest) for first, rest in started])) as events:
                async for i, ev in events:
                    if ev.get("error"):  # one choice failed: the others end with it (closing the merge)
                        yield _oai_stream_error(ev)
                        return
                    st = states[i]
                    st.latest = ev
                    # the first token is sent even while its text is held back (a partial UTF-8 character,
                    # a stop string in the making), so clients see generation start: a true TTFT; later
                    # tokens without text are not sent (each chunk costs a trip through Serve's proxy)
                    if ev.get("token_id") is not None:
                        st.unsent.append(ev)
                    if ev["text"] or ev["finished"] or (st.first_token and ev.get("token_id") is not None):
                        st.first_token = False
                        thought, piece = _split_piece(st.thinking, ev)
                        c = chunk(st, piece, _oai_finish(ev["finish_reason"]) if ev["finished"] else None)
                        if thought:
                            c["choices"][0]["delta"]["reasoning_content"] = thought
                        if ev["finished"]:
                            c["choices"][0]["stop_reason"] = ev.get("stop_reason")
                        yield _sse(c)
                    elif st.thinking is not None and ev.get("token_id") is not None:
                        st.thinking.feed("", token=True)  # (not sent, but counted: usage's reasoning tokens)
                    if ev["finished"]:
                        finals[i] = ev
            if include_usage and len(finals) == len(states):
                reasoning = None if thinking is None else [st.thinking.reasoning_tokens for st in states]
                yield self._usage_event(rid, obj, created, [finals[i] for i in range(len(states))], req.n, reasoning)
            yield "data: [DONE]\n\n"

        return StreamingResponse(body(), media_type="text/event-stream", headers=_stream_headers(started[0][0]))

    # ------------------------------------------------------------------ RadixServe's own
    @app.post("/warmup")
    async def warmup(self, req: WarmupRequest):
        for p in req.prefixes:
            if isinstance(p, str):
                await self._refuse_overlong(len(p), "prefixes")
        prefixes = [p if isinstance(p, list) else await self._warmed_chat(p, i) if isinstance(p, WarmupChat)
                    else await self._tokenize(p) for i, p in enumerate(req.prefixes)]
        if any(not p for p in prefixes):
            raise ApiError(422, "prefixes must not be empty", param="prefixes")
        info = await self.info_cached()
        if not info.get("prefix_caching", True):
            raise ApiError(422, "the prefix cache is off on this service (--no-prefix-caching): there is nothing "
                                "to warm", param="prefixes")
        # each one is checked before any is sent: a refusal after the first were warmed changed the caches
        i = max(range(len(prefixes)), key=lambda j: len(prefixes[j]))  # (one at least: the schema's)
        if len(prefixes[i]) > info["max_input_tokens"]:
            raise ApiError(422, f"prefixes[{i}] has {len(prefixes[i])} tokens, more than max_input_tokens "
                                f"({info['max_input_tokens']})", param="prefixes")
        total = await self._off_loop(_distinct_tokens, prefixes, info["block_size"], info["vocab_size"])  # 2 MB of ids: not on the loop
        pool = info["max_batch_total_tokens"]
        if total > pool:  # the later ones would evict the earlier ones: work for nothing
            raise ApiError(422, f"the prefixes total {total} tokens, more than one replica's KV pool holds "
                                f"({pool}): warm fewer or shorter ones", param="prefixes")
        try:
            out = await self.llm.warmup.remote(prefixes, req.cache_salt)
        except Exception as e:  # noqa: BLE001 - the replica failed
            raise ApiError(503, _error_text(e), "generation") from None
        if out.get("error"):
            refused = out.get("error_kind") == "validation"
            raise ApiError(422 if refused else 503, out["error"], "validation" if refused else "generation")
        return out

    async def _warmed_chat(self, p: WarmupChat, i: int) -> list[int]:
        """The tokens the requests that go on from ``p``'s messages (and tools) share, as the chat route renders
        them. Messages that end with a user or tool turn: up to where the answer begins (the request of those
        messages, and its later turns); others (a system prompt, a history that ends with the assistant): what
        the requests of the next user turn share (two different ones rendered). Rendered alone they may be no
        request's start: a template may put the system prompt inside a user turn (Gemma; Mistral's last),
        end a history with an EOS no request has (Phi-3), or want a user turn for the tools (Llama 3.1).
        ``i``: its place, for refusals."""
        if not getattr(self.tokenizer, "chat_template", None):
            raise ApiError(422, f"prefixes[{i}]: this model has no chat template: send the prefix as text or token "
                                "ids", param="prefixes")
        try:
            if p.add_generation_prompt or p.continue_final_message:  # (its end asked for: as it is)
                return await self._chat_ids(p)
            if p.messages[-1].role in ("user", "tool"):  # (the same messages with and without the answer's start)
                variants = [p.model_copy(update={"add_generation_prompt": True}), p]
            else:
                variants = [p.model_copy(update={
                    "messages": [*p.messages, ChatMessage.model_validate({"role": "user", "content": probe})],
                    "add_generation_prompt": True}) for probe in ("A", "Z")]
            renders = [await self._chat_ids(v) for v in variants]
        except ApiError as e:
            raise ApiError(e.status, f"prefixes[{i}]: {e.message}", e.kind, param="prefixes") from None
        shared = len(os.path.commonprefix(renders))  # (of lists too, as of strings)
        if shared == 0:
            raise ApiError(422, f"prefixes[{i}]: under this model's chat template the requests that go on from these "
                                "messages share no tokens", param="prefixes")
        return renders[0][:shared]

    @app.api_route("/metrics", methods=["GET", "HEAD"])
    async def metrics(self):
        try:
            create = not InFlight.draining  # (a hub removed with the application stays removed)
            snaps, retired, incarnation, by_replica, merged = await self._hub.acall(
                "export_state", timeout=HEALTH_TIMEOUT_S, create=create)
            if self._hub_view is not None and incarnation != self._hub_view[0]:
                # the hub restarted empty: give it back the last view, so "all" counters do not drop
                if incarnation != self._offered:  # (else the heartbeat saw it first, and set the wait)
                    self._metrics_settle_until = time.monotonic() + METRICS_SETTLE_S
                if await self._hub.acall("restore", *self._hub_view[1:], timeout=HEALTH_TIMEOUT_S):
                    snaps, retired, incarnation, by_replica, merged = await self._hub.acall(
                        "export_state", timeout=HEALTH_TIMEOUT_S)
            self._hub_view = (incarnation, snaps, by_replica, merged)
        except Exception as e:  # noqa: BLE001 - the hub is gone or slow: say so in the API's format
            raise ApiError(503, f"metrics unavailable: {_error_text(e) or 'timed out'}", "unavailable") from None
        if time.monotonic() < self._metrics_settle_until:
            raise ApiError(503, "metrics unavailable: restoring the counters after the metrics hub restarted; "
                                "retry in a second", "unavailable")
        return PlainTextResponse(render(snaps, retired), media_type="text/plain; version=0.0.4")
