"""``radixserve batch`` (what ``ray job submit`` runs) over real HTTP against the session's service:
every line answered or refused with a reason, prefix order, and a rerun that continues."""

from __future__ import annotations

import json
import time

import pytest

from app.batch import CHAT, COMPLETIONS, Line, NotOurs, prefix_order, read_lines, ref_key, resume
from app.cli import main as cli
from app.local_redis import free_port

SYS_A = "You are a helpful assistant for the billing team; answer in one short sentence. " * 3
SYS_B = "You translate the user's words into formal English, keeping every name as it is. " * 3


def test_prefix_order_puts_shared_prefixes_together():
    lines = [Line({"id": 1}, {"prompt": SYS_A + "q1"}, COMPLETIONS), Line({"id": 2}, {"prompt": SYS_B + "q1"}, COMPLETIONS),
             Line({"id": 3}, {"prompt": SYS_A + "q2"}, COMPLETIONS), Line({"id": 4}, {"prompt": [5, 6, 7]}, COMPLETIONS),
             Line({"id": 5}, {"messages": [{"role": "system", "content": SYS_B}]}, CHAT),
             Line({"id": 6}, {"prompt": [SYS_B + "q2"]}, COMPLETIONS), Line({"id": 7}, {"prompt": [5, 6]}, COMPLETIONS),
             Line({"id": 8}, {"prompt": None}, COMPLETIONS), Line({"id": 9}, {"messages": None}, CHAT),
             Line({"id": 10}, {"prompt": ["two", "prompts"]}, COMPLETIONS), Line({"id": 11}, {"prompt": SYS_A + "q3"}, COMPLETIONS),
             Line({"id": 12}, {"messages": [{"role": "system", "content": [{"type": "text", "text": SYS_B}]},
                                    {"role": "user", "content": "x"}]}, CHAT)]
    order = [x.ref["id"] for x in prefix_order(lines)]

    def together(*ids: int) -> bool:
        at = sorted(order.index(i) for i in ids)
        return at == list(range(at[0], at[0] + len(ids)))

    # malformed prompts (refused by the service) do not stop the rest from being sorted
    assert together(1, 3, 11) and together(2, 6)
    assert together(5, 12)  # content parts sort by their text
    assert together(4, 7) and order.index(4) < order.index(8)  # token ids sort among themselves
    assert order[-3:] == [8, 9, 10]
    # ids past 64 bits (the service refuses them) sort with the malformed: they ended the run, a traceback
    assert prefix_order([Line({"id": 0}, {"prompt": [2**70]}, COMPLETIONS), lines[0]])[0].ref == {"id": 1}
    # a system prompt shorter than the key's first chunk groups its lines too (they were scattered)
    short = [Line({"id": i}, {"messages": [{"role": "system", "content": "Be brief." if i % 2 else "Be kind."},
                                            {"role": "user", "content": f"question {i} " * (i + 1)}]}, CHAT)
             for i in range(8)]
    assert [x.ref["id"] % 2 for x in prefix_order(short)] in ([0] * 4 + [1] * 4, [1] * 4 + [0] * 4)
    # one prompt's lines keep the file's order
    same = [Line({"id": i}, {"prompt": SYS_A + "q"}, COMPLETIONS) for i in range(5)]
    assert [x.ref["id"] for x in prefix_order(same[::-1])] == [4, 3, 2, 1, 0]


def test_input_lines_ids_and_encodings(tmp_path):
    src = tmp_path / "in.jsonl"
    src.write_bytes(b"\xef\xbb\xbf" + b"\n".join([
        json.dumps({"prompt": "first line, after a byte order mark"}).encode(),
        json.dumps({"id": 1, "prompt": "the number 1: the first line's own id"}).encode(),
        json.dumps({"id": "1", "prompt": "the string 1: another id"}).encode(),
        json.dumps({"id": None, "prompt": "no id: line 4", "max_tokens": None}).encode(),
        json.dumps({"id": 4, "prompt": "the number 4: not line 4"}).encode(),
        b'{"prompt": "bad \xff byte"}',
        json.dumps({"id": "caf\u00e9", "prompt": "d\u00e9j\u00e0 vu"}, ensure_ascii=False).encode()]) + b"\n")
    plan = read_lines(src, done={ref_key({"line": 4}): None})
    assert [x.ref for x in plan.todo] == [{"line": 1}, {"id": 1}, {"id": "1"}, {"id": 4}, {"id": "café"}]
    assert all(x.body is None for x in plan.todo)  # the input keeps them: each is read again as it is sent
    with src.open("rb") as f:
        assert [x.request(f) for x in plan.todo[::-1]][-1] == {"prompt": "first line, after a byte order mark"}
        assert plan.todo[4].request(f) == {"prompt": "d\u00e9j\u00e0 vu"}
    assert plan.skipped == 1
    assert [(e["line"], e["error"].split(" (")[0]) for e in plan.errors] == [(6, "not UTF-8")]
    dup = tmp_path / "dup.jsonl"
    write(dup, [{"id": "x", "prompt": "a"}, {"id": "x", "prompt": "b"}, {"prompt": "a", "messages": []},
                {"prompt": None}, {"prompt": "a", "messages": None}])  # null is no prompt: refused, not sent
    plan = read_lines(dup, {})
    assert [e["error"] for e in plan.errors] == [
        'id "x" is used by an earlier line'] + ["needs an object with one of `prompt` and `messages`"] * 2
    assert [e.get("id") for e in plan.errors] == [None, None, None]
    write(dup, [{"id": "q7", "prompt": "a", "messages": []}])  # refused, yet named by its id too
    assert read_lines(dup, {}).errors == [{"line": 1, "id": "q7", "error": "needs an object with one of `prompt` and `messages`"}]
    assert [(x.ref, x.chat) for x in plan.todo] == [({"id": "x"}, False), ({"line": 5}, False)]
    # null fields mean the default
    with src.open("rb") as f:
        assert read_lines(src, {}).todo[3].request(f) == {"prompt": "no id: line 4"}
    # OpenAI-format lines: one result per custom_id, even when the line that repeats it is malformed too
    openai = tmp_path / "openai.jsonl"
    write(openai, [{"custom_id": "r1", "url": "/v1/embeddings", "body": {}},
                   {"custom_id": "r1", "url": "/v1/nope", "body": {}},
                   {"custom_id": "r2", "method": "POST", "url": "/v1/responses", "body": {"input": "x", "seed": None}}])
    plan = read_lines(openai, {})
    assert [e["custom_id"] or e["line"] for e in plan.errors] == ["r1", 2]
    # answered before, refused now: that answer goes (one result a custom_id)
    assert read_lines(openai, {ref_key({"custom_id": "r1"}): "0" * 16}).replaced == [ref_key({"custom_id": "r1"})]
    with openai.open("rb") as f:
        assert [(x.ref, x.path, x.request(f)) for x in plan.todo] == [({"custom_id": "r2"}, "/v1/responses", {"input": "x"})]


def test_resume_keeps_answers_drops_failures_and_a_cut_last_line(tmp_path):
    out = tmp_path / "out.jsonl"
    out.write_text("\n".join([json.dumps({"id": 1, "output": "a"}), json.dumps({"id": 2, "error": "HTTP 503"}),
                              json.dumps({"line": 7, "error": "not JSON"}), json.dumps({"id": "x", "output": "b"}),
                              json.dumps({"line": 1, "output": "c"}), '{"id": 3, "outp']))
    assert resume(out) == {ref_key({"id": 1}): None, ref_key({"id": "x"}): None, ref_key({"line": 1}): None}
    assert [json.loads(x).get("id") for x in out.read_text().splitlines()] == [1, "x", None]
    foreign = tmp_path / "notes.jsonl"
    foreign.write_text('{"id": 1, "output": "a"}\nsomething else\n{"id": 2, "output": "b"}\n')
    with pytest.raises(NotOurs):
        resume(foreign)
    assert foreign.read_text().count("\n") == 3  # untouched
    # only a record cut short can end the file unreadable: not a note, nor any other one-line file
    for text in ('{"id": 1, "output": "a"}\nhand-written note\n', "my important notes, no newline",
                 '{"id": 1, "output": "a"}\n{"id": 2, "outp\n'):
        foreign.write_text(text)
        with pytest.raises(NotOurs):
            resume(foreign)
        assert foreign.read_text() == text


def test_batch_refuses_its_input_as_output_and_a_finished_job_needs_no_service(tmp_path, capsys, monkeypatch):
    src = tmp_path / "in.jsonl"
    write(src, [{"id": "q", "prompt": "hi"}])
    assert cli(["batch", "--input", str(src), "--output", str(src)]) == 2
    assert "input file" in capsys.readouterr().err and src.read_text().strip()
    out = tmp_path / "out.jsonl"
    write(out, [{"id": "q", "output": "hello"}])
    dead = f"http://127.0.0.1:{free_port()}"
    # a misspelt variable is named (the service's own settings may be set in the same shell: not those)
    monkeypatch.setenv("RADIXSERVE_ULR", dead)
    monkeypatch.setenv("RADIXSERVE_MAX_BATCH_TOTAL_TOKENS", "4096")
    assert cli(["batch", "--input", str(src), "--output", str(out), "--url", dead, "--wait-s", "0"]) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out)["skipped"] == 1
    assert "ignoring RADIXSERVE_ULR: no such setting" in captured.err and "MAX_BATCH" not in captured.err
    assert "requests at once" not in captured.err  # (nothing to send: it said the service took 0 at once)


def write(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))


def read(path) -> tuple[dict[str, dict], dict[int, str]]:
    """Answers by id (each id once), and the errors of lines refused before sending, by line number."""
    recs = [json.loads(x) for x in path.read_text().splitlines()]
    by_id = {r["id"]: r for r in recs if "id" in r}
    assert len(by_id) == sum("id" in r for r in recs), "an id was written twice"
    return by_id, {r["line"]: r["error"] for r in recs if "line" in r}


def test_batch_answers_every_line_and_a_rerun_retries_only_the_failures(serve_app, tmp_path, capsys):
    a = [{"id": f"a{i}", "prompt": SYS_A + f"Question {i}?"} for i in range(4)]
    b = [{"id": f"b{i}", "prompt": SYS_B + f"Sentence {i}.", "max_tokens": 3} for i in range(3)]
    rows = [a[0], b[0], a[1], b[1], a[2], b[2], a[3]]  # the groups interleave, as in a real file
    rows += [{"id": "chat", "messages": [{"role": "system", "content": SYS_A}, {"role": "user", "content": "Hi"}]},
             {"id": "ids", "prompt": [72, 101, 108, 108, 111] * 10, "temperature": 0.7, "seed": 3},
             {"id": "tool", "messages": [{"role": "user", "content": "Add."}], "max_tokens": 40,
              "tool_choice": {"type": "function", "function": {"name": "add"}},
              "tools": [{"type": "function", "function": {"name": "add", "parameters": {
                  "type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}}}]},
             "",  # blank lines are skipped
             "{not json",
             {"id": "toolong", "prompt": "x" * 1500},  # over the service's max_input_tokens: a 400
             {"id": "a0", "prompt": "the same id again"},
             {"id": "neither", "text": "no prompt"}]
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    write(src, rows)
    argv = ["batch", "--input", str(src), "--output", str(out), "--url", serve_app, "--max-tokens", "4",
            "--concurrency", "4"]
    assert cli(argv) == 1  # some lines failed
    captured = capsys.readouterr()
    totals = json.loads(captured.out.strip().splitlines()[-1])
    got, refused = read(out)
    ok = {f"a{i}" for i in range(4)} | {f"b{i}" for i in range(3)} | {"chat", "ids", "tool"}
    assert {k for k, r in got.items() if "output" in r} == ok
    assert totals["ok"] == 10 and totals["skipped"] == 0
    # a chat answer's calls are in its record (its content is null)
    assert got["tool"]["output"] is None and got["tool"]["tool_calls"][0]["function"]["name"] == "add"
    assert totals["refused"] == 3 and totals["failed"] == 1 and totals["retryable"] == 0  # 3 not sent, 1 a 400
    assert "fix them in the input" in captured.err and "retry" not in captured.err  # they would fail again
    assert "HTTP 400" in got["toolong"]["error"] and "max_input_tokens" in got["toolong"]["error"]
    assert "not JSON" in refused[12] and "earlier line" in refused[14] and "`prompt` and `messages`" in refused[15]
    assert all(got[f"b{i}"]["usage"]["completion_tokens"] <= 3 for i in range(3))
    assert all(got[f"a{i}"]["usage"]["completion_tokens"] <= 4 for i in range(4))
    # each group's system prompt is computed once: its later lines hit the cache (the order itself is
    # checked above; this service's pools are big enough to hold both groups in any order)
    assert totals["cached_tokens"] >= 16 * 5 * 4, totals

    # the user fixes the long line and runs the same command: answered ids are not sent again
    rows[rows.index({"id": "toolong", "prompt": "x" * 1500})] = {"id": "toolong", "prompt": "now short"}
    write(src, rows)
    assert cli(argv) == 1  # the malformed lines still fail
    totals = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert totals["skipped"] == 10 and totals["to_send"] == 1 and totals["ok"] == 1
    got, refused = read(out)
    assert sorted(refused) == [12, 14, 15]
    assert "output" in got["toolong"] and {k for k, r in got.items() if "output" in r} == ok | {"toolong"}


def test_openai_batch_format_in_and_out_and_a_rerun_sends_only_the_failures(serve_app, tmp_path, capsys):
    """Lines in OpenAI's batch format (OpenAI's Batch API, ``vllm run-batch``): each goes to its url, and
    its result is written in OpenAI's batch output format, the whole answer as the service gave it."""
    def req(cid, url, body, method="POST"):
        return {"custom_id": cid, "method": method, "url": url, "body": body}
    rows = [req("chat-1", "/v1/chat/completions", {"messages": [{"role": "system", "content": SYS_A},
                                                                {"role": "user", "content": "Hi"}], "max_tokens": 3}),
            req("comp-1", "/v1/completions", {"prompt": SYS_A + "Question?", "n": 2}),
            req("resp-1", "/v1/responses", {"instructions": SYS_A, "input": "Hello", "max_output_tokens": 2}),
            req("too-long", "/v1/completions", {"prompt": "x" * 1500}),  # over max_input_tokens: a 400
            req("bad-url", "/v1/embeddings", {"input": "x"}),
            req("chat-1", "/v1/completions", {"prompt": "the same custom_id again"}),
            {"id": "own-format", "prompt": "Hi", "max_tokens": 2}]  # the two formats may share a file
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    write(src, rows)
    argv = ["batch", "--input", str(src), "--output", str(out), "--url", serve_app, "--max-tokens", "4"]
    assert cli(argv) == 1
    totals = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert (totals["ok"], totals["failed"], totals["refused"]) == (4, 1, 2), totals
    recs = [json.loads(x) for x in out.read_text().splitlines()]
    by_cid = {r["custom_id"]: r for r in recs if "custom_id" in r and r["response"] is not None}
    assert all(r["id"].startswith("batch_req_") for r in recs if "custom_id" in r)
    chat = by_cid["chat-1"]["response"]
    assert chat["status_code"] == 200 and chat["body"]["object"] == "chat.completion"
    assert chat["body"]["usage"]["completion_tokens"] <= 3 and by_cid["chat-1"]["error"] is None
    comp = by_cid["comp-1"]["response"]["body"]
    assert len(comp["choices"]) == 2 and comp["usage"]["completion_tokens"] <= 8  # --max-tokens as its default
    resp = by_cid["resp-1"]["response"]["body"]
    assert resp["object"] == "response" and resp["usage"]["output_tokens"] <= 2
    long = by_cid["too-long"]  # (as OpenAI writes an HTTP failure: the answer, and no error of its own)
    assert long["response"]["status_code"] == 400 and long["error"] is None
    assert "max_input_tokens" in long["response"]["body"]["error"]["message"]
    (bad_url,) = [r for r in recs if r.get("custom_id") == "bad-url"]
    assert bad_url["response"] is None and bad_url["error"]["code"] == "invalid_request"
    assert "url must be one of" in bad_url["error"]["message"]
    # one result per custom_id: the line that repeats one is named by its number
    assert sum(r.get("custom_id") == "chat-1" for r in recs) == 1
    (dup,) = [r for r in recs if r.get("line") == 6]  # (in OpenAI's shape, its custom_id null)
    assert dup["custom_id"] is None and dup["response"] is None and dup["error"]["code"] == "duplicate_custom_id"
    assert "used by an earlier line" in dup["error"]["message"]
    assert chat["request_id"]  # (Serve's x-request-id; without one, the answer's own id)
    assert any(r.get("id") == "own-format" and "output" in r for r in recs)
    assert totals["prompt_tokens"] > 0 and totals["cached_tokens"] > 0  # (the Responses API's usage counts too)
    # fixed and run again: only the failed line is sent
    rows[3] = req("too-long", "/v1/completions", {"prompt": "now short"})
    write(src, rows)
    assert cli(argv) == 1  # the two malformed lines still fail
    totals = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert (totals["skipped"], totals["to_send"], totals["ok"]) == (4, 1, 1), totals
    recs = [json.loads(x) for x in out.read_text().splitlines()]
    assert [r["response"]["status_code"] for r in recs if r.get("custom_id") == "too-long"] == [200]


def test_batch_without_a_service_says_so(tmp_path, capsys):
    src = tmp_path / "in.jsonl"
    write(src, [{"prompt": "hi"}])
    url = f"http://127.0.0.1:{free_port()}"
    assert cli(["batch", "--input", str(src), "--output", str(tmp_path / "o.jsonl"), "--url", url,
                "--wait-s", "0"]) == 2
    assert "no service answering" in capsys.readouterr().err
    assert not (tmp_path / "o.jsonl").exists()  # nothing was sent: no output to clean up
    # a rerun that finds no service leaves the last run's records as they were (failures included)
    earlier = tmp_path / "earlier.jsonl"
    write(earlier, [{"line": 1, "error": "HTTP 503: no replica"}, {"line": 2, "output": "x"}])
    before = earlier.read_text()
    write(src, [{"prompt": "hi"}, {"prompt": "there"}])
    assert cli(["batch", "--input", str(src), "--output", str(earlier), "--url", url, "--wait-s", "0"]) == 2
    assert earlier.read_text() == before
    assert cli(["batch", "--input", str(tmp_path / "missing.jsonl"), "--output", str(tmp_path / "o.jsonl")]) == 2
    # bad settings and a missing output folder are refused before anything is sent or made
    for extra, said in ((["--temperature", "-1"], "--temperature must be in [0, 2]"),
                        (["--request-timeout-s", "0"], "--request-timeout-s must be positive"),
                        (["--url", "127.0.0.1:8000"], "needs its scheme: http://127.0.0.1:8000"),
                        (["--url", "http://127.0.0.1:8000/v1/"], "without /v1: http://127.0.0.1:8000"),
                        # (these were tracebacks, exit 1: a bad port, a config file's newline, no host, a key
                        # no HTTP header can carry)
                        (["--url", "http://localhost:80a"], "is not a URL (Invalid port"),
                        (["--url", "http://127.0.0.1:8000\n"], "is not a URL"),
                        (["--url", "http://"], "names no host"),
                        (["--api-key", "clé"], "--api-key must be printable ASCII")):
        assert cli(["batch", "--input", str(src), "--output", str(tmp_path / "o.jsonl"), *extra]) == 2
        err = capsys.readouterr().err
        assert said in err and "--wait-s" not in err, err  # the flag that is wrong, not the whole list
    assert cli(["batch", "--input", str(src), "--output", str(tmp_path / "no" / "such" / "o.jsonl")]) == 2
    assert "no folder" in capsys.readouterr().err and not (tmp_path / "no").exists()


class _DownService:
    """A real HTTP server that names its model, then answers every request ``status`` (503: replicas
    gone; 504: a proxy that gave up on this one request; 200: an answer)."""

    def __init__(self, status: int = 503, code: str | None = None, models: dict | None = None, on_post=None,
                 answer=None):
        self.status, self.code, self.models = status, code, models or {"data": [{"id": "m"}]}
        self.posts, self.on_post = 0, on_post  # (called with each request's body)
        self.answer = answer  # body -> a 200's text (default: "ok" as a completion)
        self.keys: set[str | None] = set()  # the Authorization headers the posts carried

    def __enter__(self):
        status, code, models, service = self.status, self.code, self.models, self

        import http.server
        import threading

        class H(http.server.BaseHTTPRequestHandler):
            def _send(self, code, body, ctype="application/json"):
                data = body.encode()
                self.send_response(code)
                self.send_header("content-type", ctype)
                self.send_header("content-length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                self._send(200, json.dumps(models))

            def do_POST(self):
                body = self.rfile.read(int(self.headers["content-length"]))
                service.posts += 1
                service.keys.add(self.headers.get("authorization"))
                if service.on_post is not None:
                    service.on_post(json.loads(body))
                if status == 200:  # a fast service: an answer at once (or the status and text ``answer`` gives)
                    given = service.answer(json.loads(body)) if service.answer else json.dumps(
                        {"choices": [{"text": "ok", "finish_reason": "length"}],
                         "usage": {"prompt_tokens": 2, "completion_tokens": 1}})
                    self._send(*(given if isinstance(given, tuple) else (200, given)))
                    return
                self._send(status, json.dumps({"error": {"message": "no replica" if status == 503 else "timeout",
                                                         "code": code}}))

            def log_message(self, *_):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), H)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def __exit__(self, *exc):
        self.server.shutdown()


def test_batch_stops_sending_when_the_service_is_gone(tmp_path, capsys):
    # each line would retry for about a minute by default: a dead service must not cost that per line
    src, out = tmp_path / "in.jsonl", tmp_path / "o.jsonl"
    write(src, [{"id": i, "prompt": f"line {i}"} for i in range(40)])
    with _DownService() as url:
        t0 = time.monotonic()
        code = cli(["batch", "--input", str(src), "--output", str(out), "--url", url, "--retries", "1",
                    "--concurrency", "2"])
        assert time.monotonic() - t0 < 20
    assert code == 1
    captured = capsys.readouterr()
    assert "stopped answering" in captured.err and "no replica" in captured.err
    totals = json.loads(captured.out.strip().splitlines()[-1])
    assert totals["not_done"] == 40 and totals["ok"] == 0
    assert out.read_text() == ""  # no line was answered, none is marked failed: a rerun sends them all
    # a 504 (or a read timeout) is that line's failure, not the service's: recorded, and the run goes on
    with _DownService(504) as url:
        code = cli(["batch", "--input", str(src), "--output", str(out), "--url", url, "--retries", "0",
                    "--concurrency", "8"])
    assert code == 1
    captured = capsys.readouterr()
    totals = json.loads(captured.out.strip().splitlines()[-1])
    assert totals["failed"] == totals["retryable"] == 40 and totals["not_done"] == 0
    assert "run the same command again to retry them" in captured.err
    assert all("HTTP 504" in json.loads(x)["error"] for x in out.read_text().splitlines())


def test_of_a_services_key_list_the_batch_sends_the_newest(tmp_path):
    # RADIXSERVE_API_KEY=OLD,NEW while clients move to NEW: the service takes either, not the list
    src, out = tmp_path / "in.jsonl", tmp_path / "o.jsonl"
    write(src, [{"id": i, "prompt": f"line {i}"} for i in range(3)])
    service = _DownService(200)
    with service as url:
        code = cli(["batch", "--input", str(src), "--output", str(out), "--url", url, "--api-key", "old-key, new-key"])
    assert code == 0 and service.keys == {"Bearer new-key"}


def test_a_key_refused_mid_run_ends_the_run_without_marking_lines_failed(tmp_path, capsys):
    """The service was redeployed with another key while the job ran: its model list still came (this
    stand-in needs no key for it), then every request gets 401. Recording each line as failed would
    only make the rerun send them all again; the run stops at once instead, exit 2, output untouched."""
    src, out = tmp_path / "in.jsonl", tmp_path / "o.jsonl"
    write(src, [{"id": i, "prompt": f"line {i}"} for i in range(40)])
    with _DownService(401) as url:
        t0 = time.monotonic()
        code = cli(["batch", "--input", str(src), "--output", str(out), "--url", url, "--api-key", "old",
                    "--concurrency", "2"])
        assert time.monotonic() - t0 < 10
    captured = capsys.readouterr()
    assert code == 2 and "refused the API key: pass the right --api-key" in captured.err
    totals = json.loads(captured.out.strip().splitlines()[-1])  # the summary, as at any other end
    assert totals["ok"] == 0 and totals["not_done"] == 40
    assert out.read_text() == ""


def test_a_line_that_failed_its_engine_is_its_own_failure_and_a_408_is_retried(tmp_path, capsys):
    """A 503 for a request that was running when its engine failed (it may be what failed it) is that
    line's failure after one more try: taken for the service being gone, it stopped the job there, and
    every rerun (same prefix order) stopped at the same line. Serve's own timeout (408) is retried."""
    src, out = tmp_path / "in.jsonl", tmp_path / "o.jsonl"
    write(src, [{"id": i, "prompt": f"line {i}"} for i in range(3)])
    with _DownService(503, code="engine_failure") as url, _DownService(408) as slow:
        code = cli(["batch", "--input", str(src), "--output", str(out), "--url", url, "--retries", "3",
                    "--concurrency", "1"])
        assert code == 1
        captured = capsys.readouterr()
        totals = json.loads(captured.out.strip().splitlines()[-1])
        assert totals["failed"] == totals["retryable"] == 3 and totals["not_done"] == 0, captured
        assert "stopped answering" not in captured.err
        out.unlink()
        code = cli(["batch", "--input", str(src), "--output", str(out), "--url", slow, "--retries", "1"])
    assert code == 1 and "run the same command again" in capsys.readouterr().err
    assert all("HTTP 408" in json.loads(x)["error"] for x in out.read_text().splitlines())


def test_batch_refuses_lines_it_could_not_send_and_says_what_it_cannot_open(tmp_path, capsys):
    src = tmp_path / "in.jsonl"
    src.write_text('{"id": "\\ud800", "prompt": "a"}\n{"prompt": "\\udfff"}\n{"prompt": "a", "temperature": NaN}\n'
                   '{"prompt": "fine"}\n{"id": 1e999, "prompt": "a"}\n')
    plan = read_lines(src, {})
    assert [x.ref for x in plan.todo] == [{"line": 4}]
    assert [e["line"] for e in plan.errors] == [1, 2, 3, 5] and "NaN" in plan.errors[2]["error"]
    assert all("lone surrogate" in e["error"] for e in plan.errors[:2]), plan.errors[:2]
    assert "1e999" in plan.errors[3]["error"]
    # a lock file it cannot create (here a folder in its way): one line, not a traceback
    (tmp_path / "o.jsonl.lock").mkdir()
    assert cli(["batch", "--input", str(src), "--output", str(tmp_path / "o.jsonl")]) == 2
    assert "o.jsonl.lock" in capsys.readouterr().err
    # a 200 that names no model (another API, a proxy's page) is not this service
    with _DownService(models={"data": []}) as url:
        assert cli(["batch", "--input", str(src), "--output", str(tmp_path / "p.jsonl"), "--url", url,
                    "--wait-s", "0"]) == 2
    assert "names no model" in capsys.readouterr().err


def test_the_local_service_is_not_reached_through_an_http_proxy(tmp_path, capsys, monkeypatch):
    src, out = tmp_path / "in.jsonl", tmp_path / "o.jsonl"
    write(src, [{"prompt": "hi"}])
    monkeypatch.setenv("HTTP_PROXY", f"http://127.0.0.1:{free_port()}")  # nothing listens there
    monkeypatch.setenv("http_proxy", f"http://127.0.0.1:{free_port()}")
    monkeypatch.delenv("NO_PROXY", raising=False)
    monkeypatch.delenv("no_proxy", raising=False)
    with _DownService(200) as url:
        assert cli(["batch", "--input", str(src), "--output", str(out), "--url", url, "--wait-s", "0"]) == 0


def test_only_one_run_holds_the_output_even_when_the_last_one_removed_its_lock(tmp_path, monkeypatch):
    """A run that ends removes its lock file: one that opened it just before, and locked it just after,
    held a lock on a removed file, and a third run made a new one: two runs rewrote one output."""
    import fcntl

    from app import batch

    out = tmp_path / "o.jsonl"
    lock = tmp_path / "o.jsonl.lock"
    real, calls = fcntl.flock, []

    def flock(f, op):
        calls.append(op)
        if len(calls) == 1:
            lock.unlink()  # the run before ends between our open and our lock
        return real(f, op)

    monkeypatch.setattr(batch.fcntl, "flock", flock)
    with batch._only_writer(out):
        assert lock.exists()
        monkeypatch.setattr(batch.fcntl, "flock", real)
        with pytest.raises(BlockingIOError), batch._only_writer(out):
            pass
    assert len(calls) == 2 and not lock.exists()


def test_a_chat_answers_calls_and_thinking_are_in_its_record():
    from app.batch import _answer

    call = {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": "{}"}}
    choice = {"index": 0, "finish_reason": "tool_calls",
              "message": {"role": "assistant", "content": None, "tool_calls": [call], "reasoning_content": "hm"}}
    assert _answer(choice, chat=True) == {"index": 0, "output": None, "finish_reason": "tool_calls",
                                          "tool_calls": [call], "reasoning_content": "hm"}
    assert _answer({"index": 0, "text": "x", "finish_reason": "stop"}, chat=False) == {
        "index": 0, "output": "x", "finish_reason": "stop"}


def test_python_m_app_batch_is_the_batch_command(tmp_path):
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "app.batch", "--input", str(tmp_path / "none.jsonl"), "--output",
                        str(tmp_path / "o.jsonl")], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "none.jsonl" in r.stderr, (r.returncode, r.stderr[-500:])


def test_an_error_page_that_is_not_an_api_answer_is_reported_in_one_line():
    import httpx

    from app.batch import _error_message

    page = httpx.Response(404, text="<html>\n<body><h1>Not Found</h1>" + "x" * 5000, headers={"content-type": "text/html"})
    msg = _error_message(page)  # (a wrong --url: the whole page used to be the line's error)
    assert msg.startswith("HTTP 404: not an OpenAI-style API answer (text/html): <html>") and len(msg) < 200


def test_sigterm_ends_a_run_with_its_summary_and_no_traceback(tmp_path):
    """`ray job stop` sends SIGTERM: raised from a signal handler it once surfaced in a request's task,
    and a 100-line traceback followed the summary."""
    import signal
    import subprocess
    import sys

    src, out = tmp_path / "in.jsonl", tmp_path / "o.jsonl"
    write(src, [{"id": i, "prompt": f"line {i}"} for i in range(100_000)])
    for _ in range(3):  # (where the signal lands varies: busy in the requests' own code is the case)
        start = out.stat().st_size if out.exists() else 0
        with _DownService(200) as url:
            proc = subprocess.Popen([sys.executable, "-m", "app.cli", "batch", "--input", str(src), "--output",
                                     str(out), "--url", url, "--concurrency", "64"], stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, text=True)
            while not out.exists() or out.stat().st_size < start + 20_000:  # answering
                assert proc.poll() is None
                time.sleep(0.2)
            proc.send_signal(signal.SIGTERM)
            stdout, stderr = proc.communicate(timeout=30)
        assert proc.returncode == 143, stderr[-2000:]
        assert json.loads(stdout.strip().splitlines()[-1])["ok"] > 0
        assert "Traceback" not in stderr and "never retrieved" not in stderr, stderr[-3000:]
        assert "interrupted; the answers so far are in" in stderr
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    assert len({r["id"] for r in lines}) == len(lines)  # each answer once, across the three runs


def test_an_output_that_cannot_grow_ends_the_run_with_its_summary_and_a_rerun_goes_on(tmp_path):
    """A disk that fills up mid-run (here a file-size limit): the summary and what to do, not a bare
    error; the answers written so far stay, a line cut short included, and the same command goes on."""
    import resource
    import signal
    import subprocess
    import sys

    def small_files():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # (a write past the limit fails instead of killing)
        resource.setrlimit(resource.RLIMIT_FSIZE, (4000, 4000))

    src, out = tmp_path / "in.jsonl", tmp_path / "o.jsonl"
    write(src, [{"id": i, "prompt": f"line {i}"} for i in range(200)])
    command = [sys.executable, "-m", "app.cli", "batch", "--input", str(src), "--output", str(out), "--concurrency", "4"]
    with _DownService(200) as url:
        r = subprocess.run([*command, "--url", url], capture_output=True, text=True, timeout=60, preexec_fn=small_files)
        assert r.returncode == 2, r.stderr[-2000:]
        assert "cannot write" in r.stderr and "run the same command again" in r.stderr, r.stderr[-2000:]
        totals = json.loads(r.stdout.strip().splitlines()[-1])
        assert 0 < totals["ok"] < 200 and totals["not_done"] == 200 - totals["ok"], totals
        assert 0 < out.stat().st_size <= 4000
        r = subprocess.run([*command, "--url", url], capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stderr[-2000:]
    ids = [json.loads(x)["id"] for x in out.read_text().splitlines()]
    assert sorted(ids) == list(range(200))  # each answer once


def test_a_200_that_is_no_answer_is_a_failure_a_rerun_sends_again():
    """A proxy's or login page with status 200: in OpenAI's format its record had error null and counted
    as answered (every rerun skipped the line); a choice that is no object was a lasting failure."""
    import httpx

    from app.batch import _answer_record, answered

    page = httpx.Response(200, text="<html>sign in</html>")
    line = Line({"custom_id": "a"}, {"model": "m", "prompt": "hi"}, COMPLETIONS, openai=True)
    rec, transient = _answer_record(line, page)
    assert transient and not answered(rec) and rec["error"]["code"] == "invalid_response", rec
    assert rec["response"]["status_code"] == 200  # the page is kept, as OpenAI keeps a response
    odd = httpx.Response(200, json={"choices": [1]})
    rec, transient = _answer_record(Line({"id": 1}, {"prompt": "hi"}, COMPLETIONS), odd)
    assert transient and not answered(rec) and "unexpected answer" in rec["error"], rec


def test_wait_s_bounds_the_wait_for_a_listener_that_never_answers(tmp_path, capsys):
    """The model-list request took --request-timeout-s (600 s by default) per try."""
    import socket

    src = tmp_path / "in.jsonl"
    write(src, [{"prompt": "hi"}])
    with socket.socket() as listener:  # accepts connections (the kernel does) and never answers
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)
        url = f"http://127.0.0.1:{listener.getsockname()[1]}"
        t0 = time.monotonic()
        code = cli(["batch", "--input", str(src), "--output", str(tmp_path / "o.jsonl"), "--url", url,
                    "--wait-s", "0", "--request-timeout-s", "40"])
        assert time.monotonic() - t0 < 20
    assert code == 2 and "no service answering" in capsys.readouterr().err


def test_lines_are_read_again_as_they_are_sent_and_one_rewritten_meanwhile_is_sent_by_a_rerun(tmp_path, capsys):
    src, out = tmp_path / "in.jsonl", tmp_path / "o.jsonl"
    write(src, [{"id": i, "prompt": f"line {i}"} for i in range(6)])
    sent: list[str] = []

    def rewrite_once(body: dict) -> None:  # (an editor saving the file while the job runs)
        sent.append(body["prompt"])
        if len(sent) == 1:
            write(src, [{"id": i, "prompt": f"line {i}, edited"} for i in range(6)])

    with _DownService(200, on_post=rewrite_once) as url:
        assert cli(["batch", "--input", str(src), "--output", str(out), "--url", url, "--concurrency", "1"]) == 1
        captured = capsys.readouterr()
        totals = json.loads(captured.out.strip().splitlines()[-1])
        assert (totals["ok"], totals["failed"], totals["retryable"]) == (1, 5, 5), totals
        errors = [r["error"] for r in map(json.loads, out.read_text().splitlines()) if "error" in r]
        assert len(errors) == 5 and all("changed while this run was sending it" in e for e in errors)
        assert "5 line(s) of the input changed" in captured.err and "timeouts" not in captured.err
        assert cli(["batch", "--input", str(src), "--output", str(out), "--url", url, "--concurrency", "1"]) == 0
    records = [json.loads(x) for x in out.read_text().splitlines()]
    assert sorted(r["id"] for r in records) == list(range(6)) and all("output" in r for r in records)
    # what the file said when each went; line 0, answered before its edit, is answered again as it is now
    assert len(sent) == 7 and sum(p.endswith("edited") for p in sent) == 6, sent


def test_a_line_that_times_out_twice_is_its_failure_not_retries_times_the_timeout(tmp_path, capsys):
    # a line past --request-timeout-s waits the whole timeout at each try: 7 of 600 s by default
    src, out = tmp_path / "in.jsonl", tmp_path / "o.jsonl"
    write(src, [{"id": 0, "prompt": "a long answer"}])
    slow, busy = _DownService(200, on_post=lambda _: time.sleep(1.5)), _DownService(408)
    with slow as url:
        assert cli(["batch", "--input", str(src), "--output", str(out), "--url", url, "--retries", "6",
                    "--request-timeout-s", "0.5"]) == 1
    assert slow.posts == 2 and "ReadTimeout" in json.loads(out.read_text())["error"]
    out.unlink()
    with busy as url:  # the service's own timeout, the same
        assert cli(["batch", "--input", str(src), "--output", str(out), "--url", url, "--retries", "6"]) == 1
    assert busy.posts == 2
    assert "run the same command again" in capsys.readouterr().err


def test_the_input_is_read_as_it_was_opened_appended_to_or_replaced_meanwhile(tmp_path, capsys):
    # a last line without a newline read again after the file grew had one (its CRC differed): it was
    # recorded as changed; an input moved away after the start (or replaced, as an editor saves) failed the
    # run with "cannot write <input>"
    src, out = tmp_path / "in.jsonl", tmp_path / "o.jsonl"
    src.write_text("\n".join(json.dumps({"id": i, "prompt": f"line {i}"}) for i in range(4)))  # no last newline

    def change(body: dict) -> None:
        if body["prompt"] == "line 0":
            with src.open("a") as f:
                f.write("\n" + json.dumps({"id": 9, "prompt": "appended"}) + "\n")
            src.rename(tmp_path / "moved.jsonl")
            write(src, [{"id": i, "prompt": "replaced"} for i in range(4)])

    with _DownService(200, on_post=change) as url:
        assert cli(["batch", "--input", str(src), "--output", str(out), "--url", url, "--concurrency", "1",
                    "--keep-order"]) == 0, capsys.readouterr().err
    assert sorted(r["id"] for r in map(json.loads, out.read_text().splitlines()) if "output" in r) == [0, 1, 2, 3]


def test_an_input_named_as_the_runs_own_files_is_refused(tmp_path, capsys):
    # the run removes <output>.lock: such an input was destroyed
    out = tmp_path / "o.jsonl"
    write(out, [{"id": 0, "output": "x"}])
    for own in ("o.jsonl.lock",):
        src = tmp_path / own
        write(src, [{"id": 1, "prompt": "hi"}])
        assert cli(["batch", "--input", str(src), "--output", str(out), "--wait-s", "0"]) == 2
        assert f"the input is {own}" in capsys.readouterr().err and src.exists()


def test_a_host_that_stops_taking_connections_costs_the_connect_timeout_not_the_request_timeout(
        tmp_path, capsys, monkeypatch):
    # a dead node behind a firewall: each try waited the whole --request-timeout-s to connect
    import socket

    from app import batch

    async def model(client, wait_s):
        return "m"

    monkeypatch.setattr(batch, "_model", model)
    monkeypatch.setattr(batch, "CONNECT_TIMEOUT_S", 0.5)
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(0)
    port = listener.getsockname()[1]
    fillers = []
    for _ in range(8):  # a full accept queue: further connections are never made
        c = socket.socket()
        c.setblocking(False)
        c.connect_ex(("127.0.0.1", port))
        fillers.append(c)
    src, out = tmp_path / "in.jsonl", tmp_path / "o.jsonl"
    write(src, [{"id": 0, "prompt": "hi"}])
    t0 = time.monotonic()
    try:
        rc = cli(["batch", "--input", str(src), "--output", str(out), "--url", f"http://127.0.0.1:{port}",
                  "--retries", "1", "--request-timeout-s", "60"])
    finally:
        for c in [*fillers, listener]:
            c.close()
    assert rc == 1 and "ConnectTimeout" in capsys.readouterr().err
    assert time.monotonic() - t0 < 15  # two tries of 0.5 s and a 1 s wait (was two of 60 s)


def test_a_rerun_over_a_read_only_output_is_refused_by_its_name_and_leaves_it_as_it_was():
    # the rewrite's file took the output's 0444 before it was written: PermissionError on a temp file's
    # name (and, before that, a rerun made a 0444 output 0644 and wrote on); run as a user who is not root
    import os
    import shutil
    import subprocess
    import sys
    import tempfile
    from pathlib import Path

    folder = Path(tempfile.mkdtemp())  # (pytest's tmp_path is under a folder only root may enter)
    try:
        out = folder / "o.jsonl"
        write(out, [{"id": 0, "output": "x"}, {"id": 1, "error": "busy"}])
        before = out.read_text()
        out.chmod(0o444)
        # (root may write a 0444 file: the child leaves root once it has imported what it runs)
        code = ("import os, sys; from pathlib import Path; from app.batch import resume\n"
                "if os.geteuid() == 0:\n    os.setgid(65534); os.setuid(65534)\n"
                "try:\n    resume(Path(sys.argv[1]))\nexcept PermissionError as e:\n    print('refused', e.filename)")
        if os.geteuid() == 0:
            os.chown(folder, 65534, 65534)
            os.chown(out, 65534, 65534)
        got = subprocess.run([sys.executable, "-c", code, str(out)], capture_output=True, text=True,
                             cwd=os.getcwd(), timeout=60)
        assert got.stdout.strip() == f"refused {out}", (got.stdout, got.stderr)
        assert out.read_text() == before and oct(out.stat().st_mode & 0o777) == "0o444"
        assert [p.name for p in folder.iterdir()] == ["o.jsonl"]
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def test_a_rerun_rewrites_its_output_through_a_file_of_its_own_with_the_outputs_permissions(tmp_path):
    # it truncated <output>.tmp through whatever was there (a symlink another user of the folder planted:
    # their target emptied, then renamed over the output), and the output came back with the umask's mode
    import os
    import stat

    from app.batch import _only_writer, resume

    out, victim = tmp_path / "o.jsonl", tmp_path / "victim.txt"
    write(out, [{"id": 0, "output": "x"}, {"id": 1, "error": "busy"}])
    out.chmod(0o600)
    victim.write_text("precious\n")
    (tmp_path / "o.jsonl.tmp").symlink_to(victim)
    (tmp_path / "o.jsonl.lock").symlink_to(victim)
    assert resume(out) == {"id 0": None}
    assert victim.read_text() == "precious\n" and not out.is_symlink()
    assert [json.loads(line)["id"] for line in out.read_text().splitlines()] == [0]
    assert stat.S_IMODE(os.stat(out).st_mode) == 0o600
    assert sorted(p.name for p in tmp_path.iterdir()) == ["o.jsonl", "o.jsonl.lock", "o.jsonl.tmp", "victim.txt"]
    with pytest.raises(OSError):  # nor is the lock taken through a symlink
        with _only_writer(out):
            pass
    assert victim.read_text() == "precious\n"


def test_a_line_nested_past_the_recursion_limit_is_refused_for_itself_alone(tmp_path):
    from app.batch import read_lines

    src = tmp_path / "in.jsonl"
    deep = "[" * 100_000 + "]" * 100_000
    src.write_text('{"id": "a", "prompt": "x"}\n' + deep + '\n{"id": "b", "prompt": "y"}\n')
    plan = read_lines(src, {})
    assert plan.errors == [{"line": 2, "error": "nested too deeply to read"}]


def test_a_streamed_lines_stream_options_are_dropped_with_its_stream(tmp_path, capsys):
    # the batch sends each line whole: with stream false the service refuses stream_options, so such a line
    # failed at every run
    src, out = tmp_path / "in.jsonl", tmp_path / "o.jsonl"
    write(src, [{"id": 0, "prompt": "hi", "stream": True, "stream_options": {"include_usage": True}}])
    sent: list[dict] = []
    with _DownService(200, on_post=sent.append) as url:
        assert cli(["batch", "--input", str(src), "--output", str(out), "--url", url]) == 0
    assert sent[0]["stream"] is False and "stream_options" not in sent[0], sent
    assert json.loads(out.read_text())["output"] == "ok"


def test_an_output_given_as_a_symlink_is_written_where_it_points_and_stays_a_link(tmp_path, capsys):
    # a rerun's rewrite replaced the link with a plain file (the answers left the file it named), and its
    # lock was taken beside the link: a run through the link and one through the file wrote together
    src, target, link = tmp_path / "in.jsonl", tmp_path / "data" / "o.jsonl", tmp_path / "o.jsonl"
    target.parent.mkdir()
    write(src, [{"id": 0, "prompt": "a"}, {"id": 1, "prompt": "b"}])
    write(target, [{"id": 0, "output": "old"}, {"id": 1, "error": "busy"}])
    link.symlink_to(target)
    with _DownService(200) as url:
        assert cli(["batch", "--input", str(src), "--output", str(link), "--url", url]) == 0
    assert link.is_symlink() and link.resolve() == target
    records = {r["id"]: r for r in map(json.loads, target.read_text().splitlines())}
    assert records[0]["output"] == "old" and records[1]["output"] == "ok", records
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data", "in.jsonl", "o.jsonl"]


def test_a_line_the_input_cannot_give_again_is_a_failure_a_rerun_retries(tmp_path, capsys, monkeypatch):
    # an I/O error reading a line again (a share that went away) was a lasting failure: no rerun sent it
    import errno
    import os

    src, out = tmp_path / "in.jsonl", tmp_path / "o.jsonl"
    write(src, [{"id": 0, "prompt": "a"}])
    real = os.pread
    failing = {"left": 1}

    def flaky_pread(fd, n, at):
        if failing["left"]:
            failing["left"] -= 1
            raise OSError(errno.EIO, "Input/output error")
        return real(fd, n, at)

    monkeypatch.setattr(os, "pread", flaky_pread)
    with _DownService(200) as url:
        assert cli(["batch", "--input", str(src), "--output", str(out), "--url", url]) == 1
        rec = json.loads(out.read_text())
        assert "could not read line 1 of the input again" in rec["error"], rec
        assert "run the same command again" in capsys.readouterr().err
        assert cli(["batch", "--input", str(src), "--output", str(out), "--url", url]) == 0
    assert json.loads(out.read_text())["output"] == "ok"


def test_openai_format_lines_keep_the_services_defaults_unless_the_command_sets_them(tmp_path, capsys):
    """A file made for OpenAI's Batch API (or vllm run-batch) leaves max_tokens and temperature to the
    service: the command's own defaults (256 tokens, greedy) cut its long answers and overrode the
    service's sampling defaults."""
    src, out = tmp_path / "in.jsonl", tmp_path / "o.jsonl"
    write(src, [{"custom_id": "oa", "method": "POST", "url": "/v1/completions", "body": {"model": "m", "prompt": "a"}},
                {"id": "own", "prompt": "b"}])
    for extra, expected in (([], {"oa": {}, "own": {"max_tokens": 256, "temperature": 0.0}}),
                            (["--max-tokens", "7", "--temperature", "0.5"],
                             {"oa": {"max_tokens": 7, "temperature": 0.5}, "own": {"max_tokens": 7, "temperature": 0.5}})):
        sent: list[dict] = []
        out.unlink(missing_ok=True)
        with _DownService(200, on_post=sent.append) as url:
            assert cli(["batch", "--input", str(src), "--output", str(out), "--url", url, *extra]) == 0
        by_prompt = {b["prompt"]: {k: b[k] for k in ("max_tokens", "temperature") if k in b} for b in sent}
        assert by_prompt == {"a": expected["oa"], "b": expected["own"]}, (extra, sent)


def test_a_reused_output_answers_the_new_inputs_lines_not_the_old_ones(tmp_path, capsys):
    """The same --output given another input (or lines edited since): a line was known by its id or line
    number alone, so the new input's lines were skipped as answered, exit 0, the old input's answers kept."""
    a, b, out = tmp_path / "a.jsonl", tmp_path / "b.jsonl", tmp_path / "results.jsonl"
    write(a, [{"prompt": "a1"}, {"prompt": "a2"}, {"id": "q", "prompt": "aq"}, {"prompt": "a4"}])
    write(b, [{"prompt": "b1"}, {"prompt": "a2"}, {"id": "q", "prompt": "bq"}])
    sent: list[str] = []
    service = _DownService(200, on_post=lambda body: sent.append(body["prompt"]),
                           answer=lambda body: json.dumps({"choices": [{"text": "to " + body["prompt"]}]}))
    with service as url:
        assert cli(["batch", "--input", str(a), "--output", str(out), "--url", url]) == 0
        capsys.readouterr()
        assert cli(["batch", "--input", str(b), "--output", str(out), "--url", url]) == 0
        captured = capsys.readouterr()
        assert sorted(sent[4:]) == ["b1", "bq"]  # line 2 is the same request: its answer stands
        totals = json.loads(captured.out)
        assert (totals["to_send"], totals["skipped"], totals["replaced"]) == (2, 1, 2), totals
        assert "2 line(s) of the input are not the requests" in captured.err
        assert "holds 1 answer(s) to lines this input does not have" in captured.err  # a's line 4
        recs = [json.loads(x) for x in out.read_text().splitlines()]
        by_key = {ref_key(r): r["output"] for r in recs}
        assert len(recs) == len(by_key) == 4, recs  # one answer a key: the old ones went
        assert by_key == {"line 1": "to b1", "line 2": "to a2", 'id "q"': "to bq", "line 4": "to a4"}
        # its rerun has nothing to send; formatting, key order and null fields are no other request
        write(b, ['{"prompt":"b1"}', {"prompt": "a2", "temperature": None}, {"prompt": "bq", "id": "q"}])
        assert cli(["batch", "--input", str(b), "--output", str(out), "--url", url]) == 0
        assert json.loads(capsys.readouterr().out)["to_send"] == 0 and len(sent) == 6
        # a line answered, then edited into one refused before sending: one result for it, the refusal
        write(b, ['{"prompt":"b1"}', {"prompt": "a2"}, {"promt": "bq", "id": "q"}])
        assert cli(["batch", "--input", str(b), "--output", str(out), "--url", url]) == 1
        captured = capsys.readouterr()
        assert json.loads(captured.out)["replaced"] == 1 and "lines this input does not have" not in captured.err.split(
            "holds 1 answer(s) to lines")[0], captured.err
        recs = [json.loads(x) for x in out.read_text().splitlines()]
        assert [r for r in recs if r.get("id") == "q"] == [{"line": 3, "id": "q", "error": "needs an object with one of "
                                                            "`prompt` and `messages`"}], recs
        # an answer written by an older version (no request_hash) is kept as answered, and said to be unchecked
        write(out, [{"line": 1, "output": "old"}])
        assert cli(["batch", "--input", str(b), "--output", str(out), "--url", url, "--wait-s", "0"]) == 1
        assert "1 answer(s) recorded without request_hash" in capsys.readouterr().err and len(sent) == 7
    # a run that cannot start (no service) changes nothing, and says it replaces nothing
    write(out, [{"line": 1, "output": "x", "request_hash": "0" * 16}])
    before = out.read_text()
    write(b, [{"prompt": "changed"}])
    dead = f"http://127.0.0.1:{free_port()}"
    assert cli(["batch", "--input", str(b), "--output", str(out), "--url", dead, "--wait-s", "0"]) == 2
    assert "sent again" not in capsys.readouterr().err and out.read_text() == before
    # an OpenAI-format line is known by its custom_id and its request alike
    line = {"custom_id": "r", "method": "POST", "url": "/v1/completions", "body": {"prompt": "x"}}
    write(a, [line])
    write(b, [{**line, "body": {"prompt": "y"}}])
    sent.clear()
    with _DownService(200, on_post=lambda body: sent.append(body["prompt"])) as url:
        for src in (a, a, b):
            assert cli(["batch", "--input", str(src), "--output", str(out), "--url", url]) == 0
    assert sent == ["x", "y"]
    (rec,) = [json.loads(x) for x in out.read_text().splitlines() if '"custom_id"' in x]
    assert rec["request_hash"] and set(rec) == {"id", "custom_id", "response", "error", "request_hash"}


def test_an_answer_no_json_line_can_hold_is_that_lines_failure_and_the_job_goes_on(tmp_path, capsys):
    """Another backend's answer with NaN or an escaped lone surrogate: the surrogate ended the job with a
    traceback at the write (every rerun at the same line), NaN went into the output as invalid JSON."""
    src, out = tmp_path / "in.jsonl", tmp_path / "o.jsonl"
    write(src, [{"id": i, "prompt": p} for i, p in enumerate(["fine", "nan", "surrogate", "after"])])
    answers = {"fine": '"ok"', "after": '"ok"', "nan": "NaN", "surrogate": '"x\\ud83d"'}

    def answer(body):
        return '{"choices": [{"text": ' + answers[body["prompt"]] + ', "finish_reason": "stop"}]}'

    with _DownService(200, answer=answer) as url:
        code = cli(["batch", "--input", str(src), "--output", str(out), "--url", url, "--keep-order",
                    "--concurrency", "1"])
    captured = capsys.readouterr()
    assert code == 1, captured.err
    totals = json.loads(captured.out)
    assert (totals["ok"], totals["failed"], totals["retryable"], totals["not_done"]) == (2, 2, 2, 0), totals
    assert "run the same command again to retry them" in captured.err  # (the input is not at fault)
    def strict(constant):
        raise AssertionError(f"{constant} in the output: no JSON")

    recs = {r["id"]: r for r in (json.loads(x, parse_constant=strict) for x in out.read_text().splitlines())}
    assert recs[0]["output"] == recs[3]["output"] == "ok"
    assert all("NaN, Infinity or an escaped lone surrogate" in recs[i]["error"] for i in (1, 2)), recs


def test_an_output_it_may_not_write_is_refused_before_anything_is_sent(tmp_path, capsys, monkeypatch):
    # found by the rewrite after the service was asked: reported as an interruption, "run the same command
    # again", which failed the same way (checked here by os.access, as root may write a read-only file)
    import os

    src, out = tmp_path / "in.jsonl", tmp_path / "o.jsonl"
    write(src, [{"id": 0, "prompt": "a"}])
    write(out, [{"id": 9, "output": "x"}])
    service = _DownService(200)
    for denied in (out, tmp_path):
        real = os.access
        monkeypatch.setattr(os, "access", lambda p, mode, real=real, denied=denied: False if str(p) == str(denied)
                            else real(p, mode))
        with service as url:
            assert cli(["batch", "--input", str(src), "--output", str(out), "--url", url]) == 2
        captured = capsys.readouterr()
        assert captured.out == "" and f"Permission denied): {denied}" in captured.err, captured
        assert "run the same command again" not in captured.err and service.posts == 0
        monkeypatch.setattr(os, "access", real)


def test_a_line_refused_now_drops_the_answer_its_line_number_had(tmp_path, capsys):
    """Only a refused line with an id dropped its earlier answer: one known by its number (broken JSON now,
    a key misspelt) kept it beside the refusal, two results for one line, and a rerun said it was another
    input's."""
    src, out = tmp_path / "in.jsonl", tmp_path / "o.jsonl"
    write(src, [{"prompt": "a1"}, {"prompt": "a2"}, {"id": "x", "prompt": "a3"}])
    with _DownService(200) as url:
        assert cli(["batch", "--input", str(src), "--output", str(out), "--url", url]) == 0
        write(src, [{"promt": "a1"}, '{"prompt": "a2"', {"id": "x", "prompt": "a3"}])
        capsys.readouterr()
        assert cli(["batch", "--input", str(src), "--output", str(out), "--url", url]) == 1
    captured = capsys.readouterr()
    assert json.loads(captured.out)["replaced"] == 2 and "lines this input does not have" not in captured.err
    recs = [json.loads(x) for x in out.read_text().splitlines()]
    assert sorted(ref_key(r) for r in recs) == ['id "x"', "line 1", "line 2"]
    assert all("error" in r for r in recs if "line" in r)


def test_a_rerun_with_another_max_tokens_sends_the_lines_that_took_it(tmp_path, capsys):
    """The request_hash was the line's alone: answers cut at --max-tokens 8 stood when the same command ran
    again with --max-tokens 1024 (nothing sent, exit 0). The command's own defaults stay out of the hash,
    so the answers of earlier versions, and of a run that spelt them out, still stand."""
    src, out = tmp_path / "in.jsonl", tmp_path / "o.jsonl"
    write(src, [{"id": "takes", "prompt": "a"}, {"id": "own", "prompt": "b", "max_tokens": 3},
                {"custom_id": "oa", "method": "POST", "url": "/v1/responses", "body": {"input": "c"}}])
    sent: list[dict] = []
    with _DownService(200, on_post=sent.append) as url:
        for flags, expected in ((["--max-tokens", "8"], {"a", "b", "c"}), (["--max-tokens", "8"], set()),
                                (["--max-tokens", "1024"], {"a", "c"}), ([], {"a", "c"}),
                                (["--max-tokens", "256", "--temperature", "0"], {"c"}), ([], {"c"})):
            sent.clear()
            assert cli(["batch", "--input", str(src), "--output", str(out), "--url", url, *flags]) in (0, 1)
            capsys.readouterr()
            assert {b.get("prompt") or b.get("input") for b in sent} == expected, (flags, sent)
    assert [b.get("max_output_tokens") for b in sent] == [None]  # the service's own default for that API


def test_a_cap_the_line_took_from_the_command_past_its_prompts_room_goes_and_the_room_is_its_cap(tmp_path, capsys):
    """Every line of the command's format went with max_tokens 256 (or --max-tokens): a prompt within that
    of the context was refused (prompt + max_tokens past max_total_tokens) for good, though the line asked
    for nothing wrong; it is sent again with the room its prompt leaves as its cap."""
    src, out = tmp_path / "in.jsonl", tmp_path / "o.jsonl"
    write(src, [{"id": "long", "prompt": "long"}, {"id": "asked", "prompt": "long", "max_tokens": 400},
                {"custom_id": "oa", "method": "POST", "url": "/v1/completions", "body": {"prompt": "long"}},
                {"method": "POST", "url": "/v1/completions", "body": {"prompt": "no custom_id"}}])
    sent: list[dict] = []

    def answer(body: dict):  # (a 300-token prompt in a 512-token context, as this service refuses it)
        sent.append(body)
        if body.get("max_tokens", 16) > 212:
            return 422, json.dumps({"error": {"message": f"prompt (300) + max_new_tokens ({body['max_tokens']}) = "
                                              f"{300 + body['max_tokens']} tokens, more than max_total_tokens (512)",
                                              "param": "max_tokens"}})
        return json.dumps({"choices": [{"text": "cut at the room", "finish_reason": "length"}]})

    with _DownService(200, answer=answer) as url:
        assert cli(["batch", "--input", str(src), "--output", str(out), "--url", url, "--max-tokens", "300"]) == 1
    capsys.readouterr()
    recs = {r.get("id") if "custom_id" not in r else r["custom_id"]: r for r in map(json.loads, out.read_text().splitlines())}
    assert recs["long"]["output"] == "cut at the room"  # its own format's cap went
    assert recs["oa"]["response"]["status_code"] == 200  # the flag's cap went
    assert "max_total_tokens" in recs["asked"]["error"]  # its own cap: the line's fault, as the service said
    # sent again with the room as its cap (without one, a completion's default is OpenAI's 16 tokens)
    assert sorted(b.get("max_tokens") for b in sent if b["prompt"] == "long") == [212, 212, 300, 300, 400]
    # an OpenAI-format line without its custom_id is refused in that format, saying so
    assert "custom_id is required" in recs[None]["error"]["message"]
