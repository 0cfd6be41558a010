"""Batch inference against a running service: ``radixserve batch`` (what ``ray job submit`` runs).

    ray job submit --address http://HEAD:8265 -- \\
        radixserve batch --input /data/prompts.jsonl --output /data/results.jsonl

Each input line is a JSON object with ``prompt`` (text or token ids) or ``messages`` (chat), an optional
``id`` and any OpenAI sampling fields (``max_tokens``, ``temperature``, ``seed``, ``stop``, ...), which
override the command's defaults (``null`` keeps them). Each output line is one input's
``{"id", "output", "finish_reason", "usage"}`` (and ``logprobs`` when asked for) or ``{"id", "error"}``,
written as it completes; a line without an ``id`` is named by ``"line"`` (its line number) instead, and
so is a line refused before sending (not JSON, no prompt, an id used twice).

A line may also come in OpenAI's batch format (what OpenAI's Batch API and ``vllm run-batch`` read):
``{"custom_id", "method": "POST", "url", "body"}`` with ``url`` one of ``/v1/chat/completions``,
``/v1/completions`` and ``/v1/responses``; its result is written in OpenAI's batch output format,
``{"id", "custom_id", "response": {"status_code", "request_id", "body"}, "error"}``, the whole answer
as the service gave it (``error`` is null when it answered 200, else ``{"code", "message"}``).

Lines are sent in prefix order (grouped by their text), not file order: prompts that share a prefix run
back to back, so the fleet computes the prefix once and keeps it while it is needed, even when its
caches cannot hold every prefix in the file at once. Run it again with the same ``--output`` to go on
after an interruption: answered lines are skipped, failed ones tried again (lines without an ``id`` are
known by their line number: give ids if the file may change between runs). Each result records a hash of
its input line (``request_hash``): a line whose request is not the one answered (another input written to
the same output, a line edited since) is answered again.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import errno
import fcntl
import functools
import hashlib
import json
import os
import re
import signal
import stat
import sys
import tempfile
import time
import uuid
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

import httpx
from tqdm import tqdm

from app.config import Settings, api_keys
from app.tool_calls import no_json_constant

RETRY_STATUS = {408, 429, 502, 503, 504}  # a timeout, the service is busy or a replica is restarting: try again
RETRY_WAITS_S = (1, 2, 4, 8, 16, 30)  # then 30 s each: the default 6 tries span a service restart
# a request that timed out (--request-timeout-s, or the service's 408) this many times is the line's failure:
# each try took the whole timeout (7 of 600 s: 70 minutes of one worker for one line)
TIMEOUT_TRIES = 2
# what says the service itself is gone (not this line's trouble: a timeout, a 429 or a proxy's 504)
GONE_STATUS = {502, 503}
GONE_ERRORS = (httpx.ConnectError, httpx.ConnectTimeout)
# a 503's code when the line was running as its engine failed: the line's own failure, not the service
# gone (it may be what failed the engine: every rerun would stop there); tried once more
ENGINE_FAILURE = "engine_failure"
LOOPBACK = {"127.0.0.1", "localhost", "::1"}
DEFAULT_MAX_TOKENS, DEFAULT_TEMPERATURE = 256, 0.0  # for lines of the command's own format that leave them unset
CONNECT_TIMEOUT_S = 10.0  # a try's wait for a connection (its answer may take --request-timeout-s)


CHAT, COMPLETIONS, RESPONSES = "/v1/chat/completions", "/v1/completions", "/v1/responses"
CAP_FIELDS = ("max_tokens", "max_output_tokens")  # a request's cap on its answer (the Responses API's name)
OPENAI_BATCH_URLS = (CHAT, COMPLETIONS, RESPONSES)  # what an OpenAI-format line may name as its url


@dataclass(slots=True)  # (a job may hold millions: no dict per line)
class Line:
    # {"id": the line's id as given (any JSON value)}, {"line": its number} without one, or an OpenAI-format
    # line's {"custom_id": ...}
    ref: dict
    # the request without ``id``; None once ``read_lines`` has its sort key: it is read again from the input
    # when it is sent (``request``), so a run holds its key and offset per line, not the file
    body: dict | None
    path: str  # its route: an OpenAI-format line's ``url``, else chat for ``messages``, completions for ``prompt``
    openai: bool = False  # an OpenAI-format line (its result is written in that format too)
    key: tuple = ()  # ``prefix_key`` of its body
    # where the line starts in the input, its length in bytes, its number and its bytes' CRC-32 (to read it
    # again: its own bytes, whatever follows them now)
    at: int = -1
    size: int = 0
    n: int = 0
    crc: int = 0
    digest: str = ""  # ``request_digest`` of the line: its result records it (see ``resume``)

    def __post_init__(self) -> None:
        if self.body is not None and not self.key:
            self.key = prefix_key(self.path, self.body)

    @property
    def chat(self) -> bool:
        return self.path == CHAT

    def request(self, src: BinaryIO) -> dict:
        """The request to send: its body, read again from the input ``src`` where ``read_lines`` let it go."""
        if self.body is not None:
            return self.body
        raw = os.pread(src.fileno(), self.size, self.at)  # (the file as it is now: not a buffer of it)
        if zlib.crc32(raw) != self.crc:
            raise InputChanged(f"line {self.n} of the input changed while this run was sending it: run again")
        return _request(json.loads(raw.decode("utf-8-sig" if self.at == 0 else "utf-8")), self.openai)


class InputChanged(Exception):
    """The input file was rewritten under the run (a line is no longer what it read)."""


def _request(obj: dict, openai: bool) -> dict:
    """A line's request: an OpenAI-format line's ``body``, else the line without its ``id``; null fields
    dropped (a null field means the default, as in OpenAI's API)."""
    body = obj["body"] if openai else {k: v for k, v in obj.items() if k != "id"}
    return {k: v for k, v in body.items() if v is not None}


# a sort key keeps the first this many characters of a prompt's text (or token ids) as they are, and 8 bytes
# (a hash) of every further chunk as long: lines that share a prefix sort together, as by the whole text (a
# shorter prefix than the first chunk too: a short system prompt), past that chunk at a sixteenth of its size
KEY_CHUNK_CHARS, KEY_CHUNK_IDS = 128, 32


def _chunked(pieces: Iterator[bytes]) -> bytes:
    return b"".join(hashlib.blake2b(p, digest_size=8).digest() for p in pieces)


def prefix_key(path: str, body: dict) -> tuple:
    """Sort key that puts prompts sharing a prefix next to each other: texts and chats by their text (its
    first ``KEY_CHUNK_CHARS`` characters, then a hash of each further chunk), token ids among themselves,
    malformed prompts (the service will refuse them) last. Lines that share the first chunk sort in no
    meaningful order after it (but together while they share chunks); lines of one prompt keep the file's."""
    text = None
    if path == RESPONSES:  # (its instructions come first in the prompt)
        given = body.get("input")
        msgs = [{"role": "user", "content": given}] if isinstance(given, str) else given
        if isinstance(msgs, list):
            head = f"system\x01{body['instructions']}\x00" if isinstance(body.get("instructions"), str) else ""
            text = head + _joined(msgs)
    elif path == CHAT:
        msgs = body.get("messages")
        if isinstance(msgs, list):
            text = _joined(msgs)
    else:
        p = body.get("prompt")
        if isinstance(p, list) and len(p) == 1 and isinstance(p[0], (str, list)):
            p = p[0]  # one prompt wrapped in a list, as OpenAI's client sends it
        if isinstance(p, str):
            text = p
        elif isinstance(p, list) and all(type(t) is int for t in p):
            if any(not -(2**63) <= t < 2**63 for t in p):
                return (2, b"", b"")
            ids = [t.to_bytes(8, "big", signed=True) for t in p]
            return (1, b"".join(ids[:KEY_CHUNK_IDS]), _chunked(b"".join(ids[i:i + KEY_CHUNK_IDS])
                                                              for i in range(KEY_CHUNK_IDS, len(ids), KEY_CHUNK_IDS)))
    if text is None:
        return (2, b"", b"")
    return (0, text[:KEY_CHUNK_CHARS].encode("utf-8", "surrogatepass"),
            _chunked(text[i:i + KEY_CHUNK_CHARS].encode("utf-8", "surrogatepass")
                     for i in range(KEY_CHUNK_CHARS, len(text), KEY_CHUNK_CHARS)))


def _joined(msgs: list) -> str:
    """A conversation's roles and texts, in order (a sort key)."""
    return "\x00".join(f"{m.get('role')}\x01{_text(m.get('content'))}" for m in msgs if isinstance(m, dict))


def _text(content: Any) -> str:
    """A message's text: a string, or the text parts of a list of content parts."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(x if isinstance(x, str) else str(x.get("text", "")) if isinstance(x, dict) else ""
                       for x in content)
    return ""


def request_digest(obj: Any) -> str:
    """A line's request as JSON (keys sorted, so not its spacing or key order; its null fields, and its
    body's, left out, as they are sent: null means the default), hashed: a rerun tells by it whether a
    recorded answer is to this line or to another that had its id or number (raises ValueError for what
    JSON cannot say)."""
    if isinstance(obj, dict):
        obj = {k: ({j: w for j, w in v.items() if w is not None} if k == "body" and isinstance(v, dict) else v)
               for k, v in obj.items() if v is not None}
    text = json.dumps(obj, ensure_ascii=False, allow_nan=False, sort_keys=True)
    return hashlib.blake2b(text.encode(), digest_size=8).hexdigest()


def command_flags(args: argparse.Namespace) -> dict:
    """The command's ``--max-tokens`` and ``--temperature``, where given."""
    return {k: v for k, v in (("max_tokens", args.max_tokens), ("temperature", args.temperature)) if v is not None}


def line_defaults(flags: dict, path: str, openai: bool) -> dict:
    """What the command fills in of a line's request where the line leaves it unset: its own defaults and
    the flags for a line of its format; the flags alone for an OpenAI-format line (as OpenAI's Batch API
    and vLLM's run-batch send it, the service's defaults otherwise); under the Responses API's name."""
    out = dict(flags) if openai else {"max_tokens": DEFAULT_MAX_TOKENS, "temperature": DEFAULT_TEMPERATURE, **flags}
    if path == RESPONSES:
        out = {("max_output_tokens" if k == "max_tokens" else k): v for k, v in out.items()}
    return out


def _takes(request: dict, name: str) -> bool:
    """Whether a request takes ``name`` from the command's defaults (a chat's max_completion_tokens wins)."""
    return name not in request and not (name == "max_tokens" and "max_completion_tokens" in request)


def applied_defaults(flags: dict, path: str, request: dict, openai: bool) -> dict:
    """The defaults a line's request takes from the flags (its own fields win), which its ``request_hash``
    includes: a rerun with another ``--max-tokens`` (answers cut at the first one's) sends those lines
    again. The command's own defaults are left out, as the hashes of earlier versions did."""
    given = line_defaults(flags, path, openai)
    built_in = {} if openai else line_defaults({}, path, False)
    return {k: v for k, v in given.items() if _takes(request, k) and (k not in built_in or built_in[k] != v)}


def _with_defaults(digest: str, applied: dict) -> str:
    return request_digest({"request": digest, "defaults": applied}) if applied else digest


def ref_key(ref: dict) -> str:
    """Ids compare as JSON values (1 and "1" differ), apart from the line numbers of lines without one."""
    if "custom_id" in ref:  # an OpenAI-format line (its record's "id" is the record's own)
        return "id " + json.dumps(ref["custom_id"], sort_keys=True, ensure_ascii=False)
    if "id" in ref:
        return "id " + json.dumps(ref["id"], sort_keys=True, ensure_ascii=False)
    return f"line {ref['line']}"


@dataclass
class Plan:
    todo: list[Line] = field(default_factory=list)
    errors: list[dict] = field(default_factory=list)  # lines refused before sending
    skipped: int = 0  # answered by an earlier run
    replaced: list[str] = field(default_factory=list)  # id keys answered before, to another request
    keys: set[str] = field(default_factory=set)  # id keys of the input's lines (refused ones too)


def read_lines(src: Path | BinaryIO, done: dict[str, str | None], flags: dict | None = None) -> Plan:
    """Parse the input (JSONL, UTF-8; a path, or the file open for reading, which the run then reads its
    lines from again); ``done``: id keys answered by an earlier run, with the digest of the request each
    answered (None: a record of a version that wrote none); ``flags``: the command's ``--max-tokens`` and
    ``--temperature`` where given (``applied_defaults``)."""
    if isinstance(src, Path):
        with src.open("rb") as f:
            return read_lines(f, done, flags)
    applied = functools.partial(applied_defaults, flags or {})
    plan = Plan()
    seen = plan.keys  # id keys of this file's lines so far
    src.seek(0)
    at = 0
    for n, raw_bytes in enumerate(src, 1):
        refused = len(plan.errors)
        line = _read_line(raw_bytes, n, plan, seen, done, applied)
        if len(plan.errors) > refused:  # refused now: an answer recorded under its number goes too (one a line)
            _refused_now(ref_key({"line": n}), plan, done)
        if line is not None:  # (its sort key made: the input keeps the rest until it is sent)
            line.body, line.at, line.size, line.n, line.crc = None, at, len(raw_bytes), n, zlib.crc32(raw_bytes)
            plan.todo.append(line)
        at += len(raw_bytes)
    return plan


def _read_line(raw_bytes: bytes, n: int, plan: Plan, seen: set[str], done: dict[str, str | None],
               applied: Callable[[str, dict, bool], dict]) -> Line | None:
    """Input line ``n``, to send; or None: refused (recorded in ``plan``), blank or answered before."""
    try:
        raw = raw_bytes.decode("utf-8-sig" if n == 1 else "utf-8")
    except UnicodeDecodeError as e:
        plan.errors.append({"line": n, "error": f"not UTF-8 ({e.reason} at byte {e.start})"})
        return None
    if not raw.strip():
        return None
    try:
        obj = json.loads(raw, parse_constant=no_json_constant)
        # a lone surrogate (\ud800) is no Unicode text; 1e999 reads as inf, which no JSON can say
        digest = request_digest(obj)
    except json.JSONDecodeError as e:
        plan.errors.append({"line": n, "error": f"not JSON ({e.msg})"})
        return None
    except RecursionError:  # (raised by json on arrays or objects nested past Python's recursion limit)
        plan.errors.append({"line": n, "error": "nested too deeply to read"})
        return None
    except UnicodeEncodeError:  # (before ValueError, which it is)
        plan.errors.append({"line": n, "error": "holds an escaped lone surrogate (\\ud800-\\udfff): not Unicode text"})
        return None
    except ValueError:
        plan.errors.append({"line": n, "error": "holds a number too large for JSON (such as 1e999)"})
        return None
    if isinstance(obj, dict) and ("custom_id" in obj or (obj.get("prompt") is None and obj.get("messages") is None
                                                         and ("url" in obj or "body" in obj))):
        return _openai_line(obj, n, plan, seen, done, digest, applied)
    # (a null prompt is no prompt: a null field means the default, as in OpenAI's API)
    if not isinstance(obj, dict) or (obj.get("prompt") is None) == (obj.get("messages") is None):
        named = {"id": obj["id"]} if isinstance(obj, dict) and obj.get("id") is not None else {}
        plan.errors.append({"line": n, **named, "error": "needs an object with one of `prompt` and `messages`"})
        if named and (key := ref_key(named)) not in seen:
            _refused_now(key, plan, done)
        return None
    rid = obj.get("id")
    ref = {"line": n} if rid is None else {"id": rid}
    key = ref_key(ref)
    if key in seen:
        plan.errors.append({"line": n, "error": f"{key} is used by an earlier line"})
        return None
    seen.add(key)
    request, path = _request(obj, openai=False), COMPLETIONS if obj.get("messages") is None else CHAT
    digest = _with_defaults(digest, applied(path, request, False))
    if _answered_before(key, digest, plan, done):
        return None
    return Line(ref, request, path, digest=digest)


def _refused_now(key: str, plan: Plan, done: dict[str, str | None]) -> None:
    """A line refused before sending that has an id: its id is the input's (a later line with it would be a
    second result for it), and an answer an earlier run recorded under it goes (one result a line)."""
    plan.keys.add(key)
    if key in done:
        plan.replaced.append(key)


def _answered_before(key: str, digest: str, plan: Plan, done: dict[str, str | None]) -> bool:
    """Whether an earlier run answered this line (skipped, and counted so); an answer recorded under its key
    to another request is not (the line goes out again, and that answer is dropped from the output)."""
    if key not in done:
        return False
    if done[key] in (None, digest):
        plan.skipped += 1
        return True
    plan.replaced.append(key)
    return False


def _openai_line(obj: dict, n: int, plan: Plan, seen: set[str], done: dict[str, str | None], digest: str,
                 applied: Callable[[str, dict, bool], dict]) -> Line | None:
    """An OpenAI-format line (``custom_id``, ``method``, ``url``, ``body``) to send, or None: refused
    (recorded in ``plan``, in that format) or answered by an earlier run."""
    ref = {"custom_id": obj.get("custom_id")}
    key = ref_key(ref)
    if key in seen:  # (its record names the line, not the id: one id, one result; OpenAI's shape otherwise)
        plan.errors.append({"line": n, **_openai_record({"custom_id": None}, None, None, {
            "code": "duplicate_custom_id", "message": f"line {n}: custom_id {obj['custom_id']!r} is used by an earlier line"})})
        return None
    problem = None
    if "custom_id" not in obj:  # (a line with a url or body and no prompt: OpenAI's format, its id left out)
        problem = "custom_id is required (a line of OpenAI's batch format)"
    elif not isinstance(obj["custom_id"], str) or not obj["custom_id"]:
        problem = "custom_id must be a non-empty string"
    elif obj.get("method", "POST") != "POST":
        problem = f"method must be POST, got {obj.get('method')!r}"
    elif obj.get("url") not in OPENAI_BATCH_URLS:
        problem = f"url must be one of {', '.join(OPENAI_BATCH_URLS)}, got {obj.get('url')!r}"
    elif not isinstance(obj.get("body"), dict):
        problem = "body must be the request, a JSON object"
    if problem:
        plan.errors.append(_openai_record(ref, None, None, {"code": "invalid_request", "message": f"line {n}: {problem}"}))
        if isinstance(obj.get("custom_id"), str):
            _refused_now(key, plan, done)
        return None
    seen.add(key)
    url = next(u for u in OPENAI_BATCH_URLS if u == obj["url"])  # (the constant: not a string per line)
    request = _request(obj, openai=True)
    digest = _with_defaults(digest, applied(url, request, True))
    if _answered_before(key, digest, plan, done):
        return None
    return Line(ref, request, url, openai=True, digest=digest)


def _openai_record(ref: dict, r: httpx.Response | None, body: Any, error: dict | None) -> dict:
    """A result in OpenAI's batch output format."""
    request_id = None if r is None else r.headers.get("x-request-id") or (
        body.get("id") if isinstance(body, dict) and isinstance(body.get("id"), str) else "")
    response = None if r is None else {"status_code": r.status_code, "request_id": request_id, "body": body}
    return {"id": f"batch_req_{uuid.uuid4().hex}", **ref, "response": response, "error": error}


def answered(rec: dict) -> bool:
    """Whether a result record holds an answer (else it records a failure, which a rerun tries again)."""
    if "custom_id" in rec:
        return rec.get("error") is None and (rec.get("response") or {}).get("status_code") == 200
    return "output" in rec


def prefix_order(lines: list[Line]) -> list[Line]:
    return sorted(lines, key=lambda line: line.key)  # stable: equal prompts keep the file's order


class Unauthorized(Exception):
    """The service refused the API key (or wants one): the run ends, as waiting will not change it."""

    @classmethod
    def at(cls, client: httpx.AsyncClient) -> Unauthorized:
        fix = "pass the right --api-key" if "authorization" in client.headers else "it needs --api-key"
        return cls(f"the service at {client.base_url} refused the API key: {fix} (or RADIXSERVE_API_KEY)")


class NotOurs(ValueError):
    """The output file holds something other than this command's records: it is not touched."""


def resume(output: Path, rewrite: bool = True, drop: frozenset[str] | set[str] = frozenset()
           ) -> dict[str, str | None]:
    """Id keys already answered in ``output``, each with the digest of the request it answered (None in a
    record without one). With ``rewrite``, its failed records, those of the keys in ``drop`` (answers to
    another request) and a last line cut by an interruption are dropped (those lines are tried again), line
    by line; without, it is only read (before the service is found: a run that cannot start leaves the
    file as it was)."""
    if not output.exists():
        return {}
    done: dict[str, str | None] = {}
    if rewrite and not os.access(output, os.W_OK):  # (the rewrite's file could be written, the answers not)
        raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(output))
    tmp = _private_twin(output) if rewrite else None
    try:
        with output.open(encoding="utf-8", errors="replace") as src, \
                (tmp.open("w", encoding="utf-8") if tmp else open(os.devnull, "w")) as dst:
            _keep_answered(output, src, dst, done, drop)
        if tmp:
            os.chmod(tmp, stat.S_IMODE(os.stat(output).st_mode))  # (once written: a read-only mode is kept)
            os.replace(tmp, output)
    finally:
        if tmp and tmp.exists():
            tmp.unlink()
    return done


def _private_twin(output: Path) -> Path:
    """A new empty file beside ``output``, created here and nowhere else, readable by its owner alone until
    it takes the output's permissions: a fixed name (``output.tmp``) was opened through whatever a user of
    the folder had put there (a symlink to another file, which the rewrite emptied and then renamed over
    the output), and with the umask's permissions (a 0600 output came back readable by all)."""
    fd, name = tempfile.mkstemp(dir=output.parent, prefix=f".{output.name}.", suffix=".tmp")
    os.close(fd)
    return Path(name)


def _keep_answered(output: Path, src, dst, done: dict[str, str | None], drop: frozenset[str] | set[str]) -> None:
    """Copy ``src``'s answered records to ``dst`` (each id once, none of ``drop``'s), their id keys and digests
    into ``done``; ``NotOurs`` for a file that is not a result of this command."""
    cut = None  # an unreadable line: fine only as the last one
    for n, raw in enumerate(src, 1):
        if cut is not None:
            raise NotOurs(f"{output} line {cut} is not a result of `radixserve batch`; pass another --output")
        try:
            rec = json.loads(raw)
        except json.JSONDecodeError:
            if raw.endswith("\n") or not raw.startswith("{"):  # an interruption cuts a record short
                raise NotOurs(f"{output} line {n} is not a result of `radixserve batch`; pass another "
                              "--output") from None
            cut = n
            continue
        if not (isinstance(rec, dict) and ("error" in rec or "output" in rec)
                and ("id" in rec or "line" in rec or "custom_id" in rec)):
            raise NotOurs(f"{output} line {n} is not a result of `radixserve batch`; pass another --output")
        key = ref_key(rec)
        if answered(rec) and key not in done and key not in drop:
            digest = rec.get("request_hash")
            done[key] = digest if isinstance(digest, str) else None
            dst.write(raw if raw.endswith("\n") else raw + "\n")


def _transport_problem(e: httpx.TransportError) -> str:
    """A failed call in one line (a timeout's own message is empty)."""
    what = str(e) or ("no answer within --request-timeout-s" if isinstance(e, httpx.TimeoutException) else "no connection")
    return f"{type(e).__name__}: {what}"


def _error_message(r: httpx.Response) -> str:
    try:
        body = r.json()
        err = body.get("error", body)
        msg = err.get("message", err) if isinstance(err, dict) else err
    except (ValueError, AttributeError):
        # not an API's JSON answer (an HTML page: a wrong --url, a proxy): its first line, not the page
        first = next((ln.strip() for ln in r.text.splitlines() if ln.strip()), "")
        msg = f"not an OpenAI-style API answer ({r.headers.get('content-type', 'no content type')}): {first[:120]}"
    return f"HTTP {r.status_code}: {msg}"


def _error_field(r: httpx.Response, name: str) -> Any:
    try:
        err = r.json().get("error")
        return err.get(name) if isinstance(err, dict) else None
    except (ValueError, AttributeError):
        return None


def _error_code(r: httpx.Response) -> str | None:
    return _error_field(r, "code")


def _error_param(r: httpx.Response) -> str | None:
    return _error_field(r, "param")


# this service's refusal of a cap past the room its prompt leaves (deployments.ingress._refuse_past_context)
PAST_ROOM = re.compile(r"prompt \((\d+)\) \+ max_new_tokens \(\d+\) = \d+ tokens, more than max_total_tokens \((\d+)\)")


def _room(r: httpx.Response) -> int | None:
    """The tokens a refused request's prompt leaves in the context, as this service's refusal says them."""
    found = PAST_ROOM.search(str(_error_field(r, "message") or ""))
    if found is None:
        return None
    room = int(found[2]) - int(found[1])
    return room if room > 0 else None


class ServiceGone(Exception):
    """A request found the service unreachable or unavailable through all its retries."""


def _answer(choice: dict, chat: bool) -> dict:
    """One choice of an answer as the output records it."""
    message = choice["message"] if chat else {}
    out = {"index": choice.get("index"), "output": message["content"] if chat else choice["text"],
           "finish_reason": choice.get("finish_reason")}
    for name in ("tool_calls", "reasoning_content"):  # (a chat answer's calls and thinking, when it has them)
        if message.get(name):
            out[name] = message[name]
    if choice.get("logprobs") is not None:
        out["logprobs"] = choice["logprobs"]
    return out


async def _one(client: httpx.AsyncClient, line: Line, request: dict, defaults: dict, retries: int
               ) -> tuple[dict, bool]:
    """The line's answer or error record, and whether a failure was transient (a rerun may answer it);
    ``ServiceGone`` when every try found the service unreachable
    (no connection) or without replicas (502/503): the line was not answered, a rerun sends it again.
    A line that times out or gets 429/504 each time is this line's failure, recorded as such (or a
    line too slow for --request-timeout-s would stop every rerun)."""
    # (sent whole, not streamed: a line's stream_options would be refused without its stream)
    body = {**defaults, **{k: v for k, v in request.items() if k != "stream_options"}, "stream": False}
    # a cap the line took from the command: past the room its prompt leaves in the context, the service
    # refuses it; the line then goes with that room as its cap, not failed for good (not without one: a
    # completion's default is OpenAI's 16 tokens)
    capped = [k for k in CAP_FIELDS if k in defaults and _takes(request, k)]
    gone, timeouts, attempt = True, 0, 0
    while attempt <= retries:
        r, code = None, None
        try:
            r = await client.post(line.path, json=body)
        except httpx.TransportError as e:
            problem = _transport_problem(e)
            code = "timeout" if isinstance(e, httpx.TimeoutException) else "connection_error"
            gone = gone and isinstance(e, GONE_ERRORS)
            timeouts += code == "timeout" and not isinstance(e, httpx.ConnectTimeout)
        else:
            if r.status_code == 401:
                raise Unauthorized.at(client)
            if r.status_code == 200:
                return _answer_record(line, r)
            problem = _error_message(r)
            engine_failed = r.status_code == 503 and _error_code(r) == ENGINE_FAILURE
            gone = gone and r.status_code in GONE_STATUS and not engine_failed
            if engine_failed and attempt >= 1:
                return _failure_record(line, problem, r), True
            if capped and r.status_code in (400, 422) and _error_param(r) in CAP_FIELDS and (room := _room(r)):
                body = {**body, **dict.fromkeys(capped, room)}
                capped = []
                continue  # at once: another request, not a try again
            if r.status_code not in RETRY_STATUS:  # a 4xx: the line itself is wrong and would fail again
                return _failure_record(line, problem, r), r.status_code >= 500  # a 500 may not
            timeouts += r.status_code == 408
        if timeouts >= TIMEOUT_TRIES:  # (each try took the whole timeout: a rerun, or a longer one, may do)
            break
        if attempt < retries:
            await asyncio.sleep(RETRY_WAITS_S[min(attempt, len(RETRY_WAITS_S) - 1)])
        attempt += 1
    if gone:
        raise ServiceGone(problem)
    return _failure_record(line, problem, r, code), True


def _answer_record(line: Line, r: httpx.Response) -> tuple[dict, bool]:
    """The record of a 200 answer (and False: not a failure), or of an answer that is not one (True)."""
    try:
        out = r.json()
        if line.openai:
            return _openai_record(line.ref, r, out, None), False
        answers = [_answer(c, line.chat) for c in out["choices"]]
        first = answers[0]
    except (ValueError, LookupError, TypeError, AttributeError) as e:
        return _failure_record(line, f"unexpected answer ({type(e).__name__}): {r.text[:200]}", r), True
    rec = {**line.ref, **{k: v for k, v in first.items() if k != "index"}, "usage": out.get("usage")}
    if len(answers) > 1:  # a line that asked for n of them: all, in order (the first also above)
        rec["choices"] = answers
    return rec, False


def _failure_record(line: Line, problem: str, r: httpx.Response | None, code: str | None = None) -> dict:
    """The record of a line that got no answer. In OpenAI's format, as OpenAI writes it: the service's
    answer, when there is one, is the ``response`` (its status and body) and ``error`` is null; without
    one, ``error`` says why (``code``: timeout, connection_error, ...)."""
    if not line.openai:
        return {**line.ref, "error": problem}
    if r is None:
        return _openai_record(line.ref, None, None, {"code": code or "batch_error", "message": problem})
    try:
        body = r.json()
    except ValueError:
        body = r.text[:1000]
    # a 200 that is no answer (a proxy's or login page): an error, or it would count as answered for good
    error = {"code": "invalid_response", "message": problem} if r.status_code == 200 else None
    return _openai_record(line.ref, r, body, error)


def output_path(given: str) -> Path:
    """--output; a symlink's target: the answers go to the file it names, rewritten and locked beside that
    file (a rerun's rewrite would replace the link with a plain file)."""
    path = Path(given)
    return Path(os.path.realpath(path)) if path.is_symlink() else path


async def run(args: argparse.Namespace, totals: dict) -> None:
    """Send the input's lines, write each result as it comes, and keep ``totals`` up to date (the caller
    still has them when the run is interrupted)."""
    output = output_path(args.output)
    # SIGTERM (`ray job stop`) ends the run as Ctrl-C does: by cancelling it, so every request task ends
    # where it is (raised from a signal handler, it surfaced in one of them as an unretrieved exception)
    terminated = _cancel_on_sigterm()
    try:
        await _run(args, totals, output)
    except asyncio.CancelledError:
        if terminated:
            raise Terminated from None
        raise
    finally:
        _leave_sigterm()


def _cancel_on_sigterm() -> list:
    """Cancel the running task on SIGTERM; returns a list that gets an item when it did."""
    seen: list = []
    task = asyncio.current_task()

    def on_term() -> None:
        seen.append(True)
        task.cancel()

    try:
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, on_term)
    except (NotImplementedError, RuntimeError, ValueError):  # not the main thread: leave signals alone
        pass
    return seen


def _leave_sigterm() -> None:
    with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
        asyncio.get_running_loop().remove_signal_handler(signal.SIGTERM)
        signal.signal(signal.SIGTERM, _interrupt)  # (main's own, until it restores the one before)


async def _run(args: argparse.Namespace, totals: dict, output: Path) -> None:
    # an output it could not rewrite (a read-only file, or a folder it may not make its new file in) is
    # refused now: found mid-run, it was reported as an interruption, to be run again to no avail
    for path, what in ((output, "write"), (output.parent, "make a file in")):
        if path.exists() and not os.access(path, os.W_OK | (os.X_OK if path.is_dir() else 0)):
            raise PermissionError(errno.EACCES, f"cannot {what} it ({os.strerror(errno.EACCES)})", str(path))
    done = resume(output, rewrite=False)
    # open once, for the whole run: its lines are read again from this file as they are sent (one moved or
    # replaced meanwhile, as an editor saves it, is still read as it was)
    with Path(args.input).open("rb") as src:
        await _run_input(args, totals, output, done, src)


async def _run_input(args: argparse.Namespace, totals: dict, output: Path, done: dict[str, str | None],
                     src: BinaryIO) -> None:
    plan = read_lines(src, done, command_flags(args))
    todo = plan.todo if args.keep_order else prefix_order(plan.todo)
    totals.update({"to_send": len(todo), "ok": 0, "failed": 0, "retryable": 0, "changed": 0, "refused": len(plan.errors),
                   "skipped": plan.skipped, "replaced": len(plan.replaced), "not_done": len(todo), "prompt_tokens": 0,
                   "cached_tokens": 0, "completion_tokens": 0, "_t0": time.perf_counter()})
    limits = httpx.Limits(max_connections=args.concurrency, max_keepalive_connections=args.concurrency)
    # a local service not via an HTTP_PROXY (httpx would send 127.0.0.1 there unless NO_PROXY says not to)
    local = (httpx.URL(args.url).host or "") in LOOPBACK
    # (a service's key list, OLD,NEW while clients move to a new key: the newest, its last)
    key = api_keys(args.api_key)[-1] if args.api_key else None
    auth = {"authorization": f"Bearer {key}"} if key else {}
    # (a connection that cannot be made takes at most 10 s a try, not the whole --request-timeout-s)
    timeout = httpx.Timeout(args.request_timeout_s, connect=min(CONNECT_TIMEOUT_S, args.request_timeout_s))
    async with httpx.AsyncClient(base_url=args.url, timeout=timeout, limits=limits, headers=auth,
                                 trust_env=not local) as client:
        # a finished job's rerun needs no service; any other finds it before the output is touched
        model = await _model(client, args.wait_s) if todo else ""
        workers = min(args.concurrency, await _service_limit(client) or args.concurrency) if todo else 0
        if todo and workers < args.concurrency:  # more would only be refused (429) and wait to try again
            print(f"radixserve batch: the service serves {workers} requests at once (its --max-concurrent-requests): "
                  f"sending {workers} at a time, not {args.concurrency}", file=sys.stderr)
        _say_other_answers(output, plan, done)  # (once the run goes on: one that cannot start changes nothing)
        resume(output, drop=set(plan.replaced))  # now the failed records go (their lines are sent again)
        with output.open("a", encoding="utf-8") as out:
            for rec in plan.errors:
                out.write(json.dumps(rec, ensure_ascii=False) + "\n")
            if todo:
                await _send(client, model, args, workers, todo, src, out, totals)


def _say_other_answers(output: Path, plan: Plan, done: dict[str, str | None]) -> None:
    """Warn of answers in the output that are not to this input's lines: the same output given another
    input (or lines edited since) would otherwise mix two jobs' answers without a word."""
    if plan.replaced:
        print(f"radixserve batch: {len(plan.replaced)} line(s) of the input are not the requests {output} answered under "
              f"their id or line number (first: {plan.replaced[0]}): they are sent again, and those answers "
              "dropped", file=sys.stderr)
    unchecked = sum(digest is None for digest in done.values())
    if unchecked:  # (kept as answered: their requests cannot be told from this input's)
        print(f"radixserve batch: {output} holds {unchecked} answer(s) recorded without request_hash (by an older "
              "version): taken as answers to the lines of their id or number, unchecked", file=sys.stderr)
    others = sum(key not in plan.keys for key in done)
    if others:
        print(f"radixserve batch: {output} holds {others} answer(s) to lines this input does not have: kept; pass "
              "another --output to start a new job's results", file=sys.stderr)


def summary(totals: dict) -> dict:
    """What the command prints at the end (also after an interruption)."""
    out = {k: v for k, v in totals.items() if not k.startswith("_")}
    if "_t0" in totals:
        out["wall_s"] = round(time.perf_counter() - totals["_t0"], 3)
        out["cached_share"] = round(totals["cached_tokens"] / max(totals["prompt_tokens"], 1), 4)
    return out


async def _send(client: httpx.AsyncClient, model: str, args: argparse.Namespace, workers: int, todo: list[Line],
                src: BinaryIO, out, totals: dict) -> None:
    """Send ``todo`` (read from the input ``src``) with ``workers`` workers. When a line finds the service gone through all its
    retries (about a minute), no new line is sent: the others would each wait as long for nothing."""
    flags = command_flags(args)
    bar = tqdm(total=len(todo), unit="req", mininterval=2.0, file=sys.stderr)
    queue = iter(todo)  # workers take the next line in order (no task per line)

    async def worker() -> None:
        for line in queue:
            if "_gone" in totals or "_unauthorized" in totals:
                return
            try:
                rec, transient = await _one(client, line, line.request(src),
                                            {"model": model, **line_defaults(flags, line.path, line.openai)}, args.retries)
            except InputChanged as e:  # (a rerun reads it again)
                rec, transient = _failure_record(line, str(e), None), True
                totals["changed"] += 1
            except OSError as e:  # the input could not be read again (a disk's or a share's error): a rerun may
                rec = _failure_record(line, f"could not read line {line.n} of the input again: {e}", None)
                transient = True
            except ServiceGone as e:
                totals.setdefault("_gone", str(e))  # this line is not written: a rerun sends it
                continue
            except Unauthorized as e:  # (a key rotated mid-run) not written either: every line would fail
                totals.setdefault("_unauthorized", e)
                continue
            except Exception as e:  # noqa: BLE001 - one odd line must not end the job (nor would a rerun help it)
                rec, transient = _failure_record(line, f"{type(e).__name__}: {e}", None), False
            rec["request_hash"] = line.digest
            try:
                text = record_text(rec)
            except ValueError:  # (another backend's answer: this service's escape both; a rerun may get another)
                rec = {**_failure_record(line, "the service's answer holds NaN, Infinity or an escaped lone surrogate, "
                                         "which a JSON line cannot", None, "invalid_response"), "request_hash": line.digest}
                text, transient = record_text(rec), True
            out.write(text)
            out.flush()
            bar.update(1)
            _count(totals, rec)
            totals["retryable"] += not answered(rec) and transient
            totals["not_done"] -= 1  # answered or recorded as failed: a rerun sends only the others

    tasks = [asyncio.ensure_future(worker()) for _ in range(min(workers, len(todo)))]
    try:
        await asyncio.gather(*tasks)
    finally:  # one worker's error (a full disk) ends the others too, before the output is closed under them
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        bar.close()
    if "_unauthorized" in totals:
        raise totals["_unauthorized"]


def record_text(rec: dict) -> str:
    """A result as its output line: strict JSON in UTF-8 (ValueError for NaN, or a lone surrogate, that an
    answer from another backend may hold)."""
    text = json.dumps(rec, ensure_ascii=False, allow_nan=False) + "\n"
    text.encode()
    return text


def _count(totals: dict, rec: dict) -> None:
    if not answered(rec):
        totals["failed"] += 1
        return
    totals["ok"] += 1
    answer = rec["response"]["body"] if "custom_id" in rec else rec
    usage = answer.get("usage") if isinstance(answer, dict) else None
    usage = usage if isinstance(usage, dict) else {}
    # (the Responses API names them input and output tokens)
    details = usage.get("prompt_tokens_details", usage.get("input_tokens_details"))
    details = details if isinstance(details, dict) else {}
    totals["prompt_tokens"] += usage.get("prompt_tokens", usage.get("input_tokens")) or 0
    totals["completion_tokens"] += usage.get("completion_tokens", usage.get("output_tokens")) or 0
    totals["cached_tokens"] += details.get("cached_tokens") or 0


async def _model(client: httpx.AsyncClient, wait_s: float) -> str:
    """The served model's name; waits up to ``wait_s`` for a service that is still starting."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            # (a listener that never answers must not hold this for --request-timeout-s)
            r = await client.get("/v1/models", timeout=max(5.0, deadline - time.monotonic()))
            if r.status_code == 401:
                raise Unauthorized.at(client)
            if r.status_code == 200:
                try:
                    return str(r.json()["data"][0]["id"])
                except (ValueError, LookupError, TypeError, AttributeError):  # a proxy's page, another API
                    problem = f"its /v1/models answer names no model: {r.text[:120]!r}"
            else:
                problem = _error_message(r)
        except httpx.TransportError as e:
            problem = _transport_problem(e)
        if time.monotonic() >= deadline:
            raise ConnectionError(f"no service answering at {client.base_url} ({problem}); "
                                  "start one with `radixserve serve` or pass --url")
        await asyncio.sleep(1.0)


async def _service_limit(client: httpx.AsyncClient) -> int | None:
    """The requests one ingress of the service takes at once before it answers 429, when it was started with
    --max-concurrent-requests (its /info says so); None for no limit, or a service that does not say."""
    try:
        r = await client.get("/info", timeout=CONNECT_TIMEOUT_S)
        limit = r.json().get("max_concurrent_requests_per_ingress") if r.status_code == 200 else None
    except (httpx.HTTPError, ValueError, AttributeError):  # another API's service, a proxy's page
        return None
    return limit if isinstance(limit, int) and not isinstance(limit, bool) and limit > 0 else None


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--input", required=True, help="JSONL file, one request per line")
    p.add_argument("--output", required=True, help="JSONL file of results (a rerun continues it)")
    p.add_argument("--url", default=os.environ.get("RADIXSERVE_URL", "http://127.0.0.1:8000"),
                   help="the service (default: $RADIXSERVE_URL or http://127.0.0.1:8000)")
    p.add_argument("--api-key", default=os.environ.get("RADIXSERVE_API_KEY"),
                   help="the service's API key, sent as Authorization: Bearer; of a comma-separated list, the last "
                        "(default: $RADIXSERVE_API_KEY)")
    p.add_argument("--concurrency", type=int, default=32, help="requests in flight at once (default: 32)")
    p.add_argument("--max-tokens", type=int, default=None,
                   help=f"for lines without max_tokens (default: {DEFAULT_MAX_TOKENS}; for OpenAI-format lines, the "
                   "service's)")
    p.add_argument("--temperature", type=float, default=None,
                   help=f"for lines without temperature (default: {DEFAULT_TEMPERATURE:g}; for OpenAI-format lines, "
                   "the service's)")
    p.add_argument("--keep-order", action="store_true", help="send in file order, not prefix order")
    p.add_argument("--retries", type=int, default=len(RETRY_WAITS_S),
                   help="tries again after a 408/429/502/503/504, a timeout or a lost connection, waiting "
                        f"{', '.join(map(str, RETRY_WAITS_S))} s, then 30 s each (default: {len(RETRY_WAITS_S)}, "
                        "about a minute: a service restart; a timeout or 408 is tried once more at most)")
    p.add_argument("--request-timeout-s", type=float, default=600.0, help="per request (default: 600)")
    p.add_argument("--wait-s", type=float, default=60.0,
                   help="how long to wait for a service that is starting (default: 60)")


def _flag_problems(args: argparse.Namespace) -> list[str]:
    """Each flag out of its range, by name; and a ``--url`` a client could not use as it is."""
    checks = [(args.concurrency >= 1, "--concurrency must be at least 1"),
              (args.max_tokens is None or args.max_tokens >= 1, "--max-tokens must be at least 1"),
              (args.retries >= 0, "--retries must be at least 0"),
              (args.temperature is None or 0 <= args.temperature <= 2, "--temperature must be in [0, 2]"),
              (args.request_timeout_s > 0, "--request-timeout-s must be positive"),
              (args.wait_s >= 0, "--wait-s must be at least 0")]
    problems = [what for ok, what in checks if not ok]
    url = args.url.rstrip("/")
    if not args.url.lower().startswith(("http://", "https://")):
        problems.append(f"--url {args.url!r} needs its scheme: http://{args.url}")
    elif url.endswith("/v1"):  # an OpenAI client's base URL: this command adds /v1 itself
        problems.append(f"--url is the service's address without /v1: {url[:-3]}")
    else:
        try:
            if not httpx.URL(url).host:
                problems.append(f"--url {args.url!r} names no host")
        except (httpx.InvalidURL, ValueError) as e:  # a bad port, a stray newline from a config file
            problems.append(f"--url {args.url!r} is not a URL ({e})")
    if args.api_key is not None and not (args.api_key.isascii() and args.api_key.isprintable()):
        problems.append("--api-key must be printable ASCII (it goes in an HTTP header)")
    return problems


def main(args: argparse.Namespace) -> int:
    if problems := _flag_problems(args):
        print(f"radixserve batch: {'; '.join(problems)}", file=sys.stderr)
        return 2
    if unknown := Settings.unknown_env(os.environ):  # a warning: the service's own settings may be set here too
        print(f"radixserve batch: ignoring {', '.join(unknown)}: no such setting (this command reads "
              "RADIXSERVE_URL and RADIXSERVE_API_KEY)", file=sys.stderr)
    src, dst = Path(args.input), output_path(args.output)
    problem = (f"{src} is a folder, not a file" if src.is_dir() else None if src.is_file() else f"no input file {src}")
    problem = problem or (f"--output {dst} is a folder; name a file" if dst.is_dir() else None)
    problem = problem or (None if dst.parent.is_dir() else f"--output: no folder {dst.parent}")
    if problem is None and dst.exists() and dst.resolve() == src.resolve():
        problem = "--output is the input file; pass another path"
    # (the run's own lock file beside the output, which it removes; its rewrite goes through a new file)
    lock = dst.with_name(dst.name + ".lock")
    if problem is None and lock.exists() and lock.resolve() == src.resolve():
        problem = f"the input is {lock.name}, a file this command writes beside --output {dst.name}; rename it"
    if problem:
        print(f"radixserve batch: {problem}", file=sys.stderr)
        return 2
    totals: dict = {}
    # SIGTERM (``ray job stop``, systemd) ends the run as Ctrl-C does: the answers so far stay, a summary
    try:
        before = signal.signal(signal.SIGTERM, _interrupt)
    except ValueError:  # not the main thread (called as a library): leave signals alone
        before = None
    try:
        with _only_writer(dst):
            asyncio.run(run(args, totals))
    except (ConnectionError, NotOurs, Unauthorized, BlockingIOError) as e:
        if isinstance(e, Unauthorized) and "_t0" in totals:  # mid-run: the summary, as at any other end
            print(json.dumps(summary(totals)))
        print(f"radixserve batch: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # a folder it may not write in, an input it may not read, a disk that filled up
        if "_t0" in totals:  # mid-run: the answers written so far stay, as after an interruption
            print(json.dumps(summary(totals)))
            print(f"radixserve batch: cannot write {e.filename or dst}: {e.strerror or e}; the answers so far "
                  f"are in {dst}: run the same command again to go on", file=sys.stderr)
        else:
            print(f"radixserve batch: {e.strerror or e}" + (f": {e.filename}" if e.filename else ""), file=sys.stderr)
        return 2
    except KeyboardInterrupt as e:
        print(json.dumps(summary(totals)))
        print(f"radixserve batch: interrupted; the answers so far are in {dst}: run the same command again "
              "to go on", file=sys.stderr)
        return 143 if isinstance(e, Terminated) else 130
    finally:
        if before is not None:
            signal.signal(signal.SIGTERM, before)
    print(json.dumps(summary(totals)))
    if "_gone" in totals:
        print(f"radixserve batch: the service stopped answering ({totals['_gone']}); {totals['not_done']} "
              f"line(s) were not answered: run the same command again to go on", file=sys.stderr)
        _say_failures(totals, dst)
        return 1
    return 1 if _say_failures(totals, dst) else 0


def _say_failures(totals: dict, dst: Path) -> bool:
    """Tell what failed and what to do about it; True if anything did."""
    lasting = totals["failed"] - totals["retryable"] + totals["refused"]
    if lasting:
        print(f"radixserve batch: {lasting} line(s) refused, by this command ({totals['refused']}: not sent) or "
              f"by the service (see `error` in {dst}): fix them in the input, and the same command sends "
              "them again", file=sys.stderr)
    changed = totals.get("changed", 0)
    if totals["retryable"] - changed:
        print(f"radixserve batch: {totals['retryable'] - changed} line(s) failed on timeouts, overload or server "
              f"errors (see `error` in {dst}): run the same command again to retry them", file=sys.stderr)
    if changed:
        print(f"radixserve batch: {changed} line(s) of the input changed while this run was sending them: run the "
              "same command again to send them as they are now", file=sys.stderr)
    return bool(lasting or totals["retryable"])


class Terminated(KeyboardInterrupt):
    """SIGTERM, handled as an interrupt."""


def _interrupt(*_) -> None:
    raise Terminated


@contextlib.contextmanager
def _only_writer(output: Path):
    """One run per output file at a time: a second would rewrite it under the first (resume)."""
    lock = output.with_name(output.name + ".lock")
    while True:
        # (not through a symlink someone put there: the lock is only ever this folder's own file)
        f = os.fdopen(os.open(lock, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW, 0o600), "a")
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.close()
            raise BlockingIOError(f"another run is writing {output}") from None
        # the run before may have removed the file between our open and our lock: a lock on a removed
        # file excludes no one (a third run would create and lock a new one), so lock the one there now
        try:
            current = os.stat(lock).st_ino == os.fstat(f.fileno()).st_ino
        except FileNotFoundError:
            current = False
        if current:
            break
        f.close()
    with f:
        try:
            yield
        finally:
            lock.unlink(missing_ok=True)


if __name__ == "__main__":  # ``python -m app.batch`` is ``radixserve batch``
    from app.cli import main as cli_main

    sys.exit(cli_main(["batch", *sys.argv[1:]]))
