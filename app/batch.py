"""Batch inference against a running service: ``radixserve batch`` (what ``ray job submit`` runs).

    ray job submit --address http://HEAD:8265 -- \\
        radixserve batch --input /data/prompts.jsonl --output /data/results.jsonl

Each input line is a JSON object with ``prompt`` (text or token ids) or ``messages`` (chat), an optional
``id`` (default: its line number) and any OpenAI sampling fields (``max_tokens``, ``temperature``,
``seed``, ``stop``, ...), which override the command's defaults. Each output line is one input's
``{"id", "output", "finish_reason", "usage"}`` or ``{"id", "error"}``, written as it completes; a line
refused before sending (not JSON, no prompt, an id used twice) gets ``{"line", "error"}``.

Lines are sent in prefix order (sorted by their text), not file order: prompts that share a prefix run
back to back, so the fleet computes the prefix once and keeps it while it is needed, even when its
caches cannot hold every prefix in the file at once. Run it again with the same ``--output`` to go on
after an interruption: answered ids are skipped, failed ones tried again (lines without an ``id`` are
known by their line number: give ids if the file may change between runs).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

RETRY_STATUS = {429, 502, 503, 504}  # the service is busy or a replica is restarting: try again


@dataclass
class Line:
    id: Any  # the line's ``id`` as given (any JSON value), else its line number
    body: dict  # the request without ``id``
    chat: bool

    def prefix_key(self) -> tuple:
        """Sort key that puts prompts sharing a prefix next to each other: texts and chats by their text,
        token ids among themselves, malformed prompts (the service will refuse them) last."""
        if self.chat:
            msgs = self.body.get("messages")
            if not isinstance(msgs, list):
                return (2, "")
            return (0, "\x00".join(f"{m.get('role')}\x01{_text(m.get('content'))}" for m in msgs
                                   if isinstance(m, dict)))
        p = self.body.get("prompt")
        if isinstance(p, list) and len(p) == 1 and isinstance(p[0], (str, list)):
            p = p[0]  # one prompt wrapped in a list, as OpenAI's client sends it
        if isinstance(p, str):
            return (0, p)
        if isinstance(p, list) and all(type(t) is int for t in p):
            return (1, tuple(p))
        return (2, "")


def _text(content: Any) -> str:
    """A message's text: a string, or the text parts of a list of content parts."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(x if isinstance(x, str) else str(x.get("text", "")) if isinstance(x, dict) else ""
                       for x in content)
    return ""


def id_key(rid: Any) -> str:
    """Ids compare as JSON values: 1 and "1" are different ids."""
    return json.dumps(rid, sort_keys=True, ensure_ascii=False)


@dataclass
class Plan:
    todo: list[Line] = field(default_factory=list)
    errors: list[dict] = field(default_factory=list)  # lines refused before sending
    skipped: int = 0  # answered by an earlier run


def read_lines(path: Path, done: set[str]) -> Plan:
    """Parse the input (JSONL, UTF-8); ``done``: id keys answered by an earlier run."""
    plan, seen = Plan(), set()  # id keys of this file's lines so far
    with path.open("rb") as f:
        for n, raw_bytes in enumerate(f, 1):
            try:
                raw = raw_bytes.decode("utf-8-sig" if n == 1 else "utf-8")
            except UnicodeDecodeError as e:
                plan.errors.append({"line": n, "error": f"not UTF-8 ({e.reason} at byte {e.start})"})
                continue
            if not raw.strip():
                continue
            try:
                obj = json.loads(raw)
            except json.JSONDecodeError as e:
                plan.errors.append({"line": n, "error": f"not JSON ({e.msg})"})
                continue
            if not isinstance(obj, dict) or ("prompt" in obj) == ("messages" in obj):
                plan.errors.append({"line": n, "error": "needs an object with `prompt` or `messages`"})
                continue
            rid = obj.pop("id", None)
            rid = n if rid is None else rid
            key = id_key(rid)
            if key in seen:
                plan.errors.append({"line": n, "error": f"id {key} is used by an earlier line"})
                continue
            seen.add(key)
            if key in done:
                plan.skipped += 1
            else:
                plan.todo.append(Line(rid, obj, "messages" in obj))
    return plan


def prefix_order(lines: list[Line]) -> list[Line]:
    return sorted(lines, key=Line.prefix_key)  # stable: equal prompts keep the file's order


class NotOurs(ValueError):
    """The output file holds something other than this command's records: it is not touched."""


def resume(output: Path) -> set[str]:
    """Id keys already answered in ``output``. Its failed records and a last line cut by an interruption
    are dropped (those lines are tried again); the file is rewritten line by line."""
    if not output.exists():
        return set()
    done: set[str] = set()
    tmp = output.with_name(output.name + ".tmp")
    with output.open(encoding="utf-8", errors="replace") as src, tmp.open("w", encoding="utf-8") as dst:
        cut = None  # an unreadable line: fine only as the last one
        for n, raw in enumerate(src, 1):
            if cut is not None:
                tmp.unlink()
                raise NotOurs(f"{output} line {cut} is not a result of `radixserve batch`; "
                              "pass another --output")
            try:
                rec = json.loads(raw)
            except json.JSONDecodeError:
                cut = n
                continue
            if not (isinstance(rec, dict) and "error" in rec and ("id" in rec or "line" in rec)
                    or isinstance(rec, dict) and "output" in rec and "id" in rec):
                tmp.unlink()
                raise NotOurs(f"{output} line {n} is not a result of `radixserve batch`; pass another --output")
            if "output" in rec and id_key(rec["id"]) not in done:
                done.add(id_key(rec["id"]))
                dst.write(raw if raw.endswith("\n") else raw + "\n")
    os.replace(tmp, output)
    return done


def _error_message(r: httpx.Response) -> str:
    try:
        body = r.json()
        err = body.get("error", body)
        msg = err.get("message", err) if isinstance(err, dict) else err
    except (ValueError, AttributeError):
        msg = r.text[:500]
    return f"HTTP {r.status_code}: {msg}"


async def _one(client: httpx.AsyncClient, line: Line, defaults: dict, retries: int) -> dict:
    body = {**defaults, **line.body, "stream": False}
    path = "/v1/chat/completions" if line.chat else "/v1/completions"
    for attempt in range(retries + 1):
        try:
            r = await client.post(path, json=body)
        except httpx.TransportError as e:
            problem = f"{type(e).__name__}: {e}"
        else:
            if r.status_code == 200:
                try:
                    out = r.json()
                    choice = out["choices"][0]
                    text = choice["message"]["content"] if line.chat else choice["text"]
                except (ValueError, LookupError, TypeError) as e:
                    return {"id": line.id, "error": f"unexpected answer ({type(e).__name__}): {r.text[:200]}"}
                return {"id": line.id, "output": text, "finish_reason": choice.get("finish_reason"),
                        "usage": out.get("usage")}
            problem = _error_message(r)
            if r.status_code not in RETRY_STATUS:
                break  # the request itself is wrong: trying again gives the same answer
        if attempt < retries:
            await asyncio.sleep(min(2.0 ** attempt, 30.0))
    return {"id": line.id, "error": problem}


async def run(args: argparse.Namespace, totals: dict) -> None:
    """Send the input's lines, write each result as it comes, and keep ``totals`` up to date (the caller
    still has them when the run is interrupted)."""
    output = Path(args.output)
    output.parent.mkdir(parents=True, exist_ok=True)
    done = resume(output)
    plan = read_lines(Path(args.input), done)
    todo = plan.todo if args.keep_order else prefix_order(plan.todo)
    totals.update({"sent": len(todo), "ok": 0, "failed": len(plan.errors), "skipped": plan.skipped,
                   "prompt_tokens": 0, "cached_tokens": 0, "completion_tokens": 0})
    t0 = time.perf_counter()
    with output.open("a", encoding="utf-8") as out:
        for rec in plan.errors:
            out.write(json.dumps(rec, ensure_ascii=False) + "\n")
        if todo:  # a finished job's rerun needs no service
            await _send(args, todo, out, totals)
    totals["wall_s"] = round(time.perf_counter() - t0, 3)
    totals["cached_share"] = round(totals["cached_tokens"] / max(totals["prompt_tokens"], 1), 4)


async def _send(args: argparse.Namespace, todo: list[Line], out, totals: dict) -> None:
    limits = httpx.Limits(max_connections=args.concurrency, max_keepalive_connections=args.concurrency)
    async with httpx.AsyncClient(base_url=args.url, timeout=args.request_timeout_s, limits=limits) as client:
        model = await _model(client, args.wait_s)
        defaults = {"model": model, "max_tokens": args.max_tokens, "temperature": args.temperature}
        bar = _progress(len(todo))
        queue = iter(todo)  # workers take the next line in order (no task per line)

        async def worker() -> None:
            for line in queue:
                try:
                    rec = await _one(client, line, defaults, args.retries)
                except Exception as e:  # noqa: BLE001 - one odd line must not end the job
                    rec = {"id": line.id, "error": f"{type(e).__name__}: {e}"}
                out.write(json.dumps(rec, ensure_ascii=False) + "\n")
                out.flush()
                bar.update(1)
                _count(totals, rec)

        try:
            await asyncio.gather(*(worker() for _ in range(min(args.concurrency, len(todo)))))
        finally:
            bar.close()


def _count(totals: dict, rec: dict) -> None:
    if "error" in rec:
        totals["failed"] += 1
        return
    totals["ok"] += 1
    usage = rec.get("usage") if isinstance(rec.get("usage"), dict) else {}
    details = usage.get("prompt_tokens_details") if isinstance(usage.get("prompt_tokens_details"), dict) else {}
    totals["prompt_tokens"] += usage.get("prompt_tokens") or 0
    totals["completion_tokens"] += usage.get("completion_tokens") or 0
    totals["cached_tokens"] += details.get("cached_tokens") or 0


async def _model(client: httpx.AsyncClient, wait_s: float) -> str:
    """The served model's name; waits up to ``wait_s`` for a service that is still starting."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            r = await client.get("/v1/models")
            if r.status_code == 200:
                return r.json()["data"][0]["id"]
            problem = _error_message(r)
        except httpx.TransportError as e:
            problem = f"{type(e).__name__}: {e}"
        if time.monotonic() >= deadline:
            raise ConnectionError(f"no service answering at {client.base_url} ({problem}); "
                                  "start one with `radixserve serve` or pass --url")
        await asyncio.sleep(1.0)


def _progress(total: int):
    try:
        from tqdm import tqdm

        return tqdm(total=total, unit="req", mininterval=2.0, file=sys.stderr)
    except ImportError:  # pragma: no cover - tqdm comes with transformers
        class _Quiet:
            def update(self, n):
                pass

            def close(self):
                pass

        return _Quiet()


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--input", required=True, help="JSONL file, one request per line")
    p.add_argument("--output", required=True, help="JSONL file of results (a rerun continues it)")
    p.add_argument("--url", default=os.environ.get("RADIXSERVE_URL", "http://127.0.0.1:8000"),
                   help="the service (default: $RADIXSERVE_URL or http://127.0.0.1:8000)")
    p.add_argument("--concurrency", type=int, default=32, help="requests in flight at once")
    p.add_argument("--max-tokens", type=int, default=256, help="default for lines without max_tokens")
    p.add_argument("--temperature", type=float, default=0.0, help="default for lines without temperature")
    p.add_argument("--keep-order", action="store_true", help="send in file order, not prefix order")
    p.add_argument("--retries", type=int, default=3, help="tries again after a 429/502/503/504 or a lost connection")
    p.add_argument("--request-timeout-s", type=float, default=600.0)
    p.add_argument("--wait-s", type=float, default=60.0, help="how long to wait for a service that is starting")


def main(args: argparse.Namespace) -> int:
    if args.concurrency < 1 or args.retries < 0 or args.max_tokens < 1:
        print("radixserve batch: --concurrency and --max-tokens must be at least 1, --retries at least 0",
              file=sys.stderr)
        return 2
    src, dst = Path(args.input), Path(args.output)
    if not src.is_file():
        print(f"radixserve batch: no input file {src}", file=sys.stderr)
        return 2
    if dst.exists() and dst.resolve() == src.resolve():
        print("radixserve batch: --output is the input file; pass another path", file=sys.stderr)
        return 2
    totals: dict = {}
    try:
        asyncio.run(run(args, totals))
    except (ConnectionError, NotOurs) as e:
        print(f"radixserve batch: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(json.dumps(totals))
        print(f"radixserve batch: interrupted; the answers so far are in {dst}: run the same command again "
              "to go on", file=sys.stderr)
        return 130
    print(json.dumps(totals))
    if totals["failed"]:
        print(f"radixserve batch: {totals['failed']} request(s) failed (see `error` in {dst}); "
              "run the same command again to retry them", file=sys.stderr)
        return 1
    return 0
