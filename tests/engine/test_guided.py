"""Guided decoding: a random-weight model's answers held to a JSON schema, a regular expression, a list
of choices or a grammar, greedy and sampled, ending where the guide is complete; bad guides refused."""

from __future__ import annotations

import asyncio
import itertools
import json
import re
import sys
import threading
import time
import types

import pytest
import torch

from engine import guided
from engine.guided import GuideError, grammar_text
from engine.llm_engine import RequestError
from engine.sequence import SamplingParams

PROMPT = list(range(40, 110))
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["n", "kind"],
          "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}, "kind": {"enum": ["a", "bb"]}}}


def _texts(eng, guide, n=4, **kw):
    params = [SamplingParams(max_new_tokens=60, guide=guide, temperature=t, seed=i, **kw)
              for i, t in enumerate([0.0] + [1.0] * (n - 1))]
    seqs = eng.generate([PROMPT] * n, params)
    return [eng.tokenizer.decode(s.output_ids, skip_special_tokens=True) for s in seqs], seqs


@pytest.mark.parametrize("preset", ["tiny", "tiny-qwen3"])
def test_json_schema_answers_parse_and_follow_it(make_engine, preset):
    eng = make_engine(preset)
    texts, seqs = _texts(eng, ("json", json.dumps(SCHEMA)))
    for text, seq in zip(texts, seqs, strict=True):
        value = json.loads(text)
        assert set(value) == {"n", "kind"} and 0 <= value["n"] <= 99 and value["kind"] in ("a", "bb")
        assert seq.finish_reason in ("stop", "eos")  # ended by its guide, not by the length limit
    free = eng.generate([PROMPT], SamplingParams(max_new_tokens=20))[0]
    with pytest.raises(ValueError):  # (the same model unguided: not JSON)
        json.loads(eng.tokenizer.decode(free.output_ids, skip_special_tokens=True))


def test_any_json_object_regex_choice_and_grammar(make_engine):
    eng = make_engine("tiny")
    # (keys of any length would run a random model's answers to their token limit)
    short_keys = {"type": "object", "patternProperties": {"^[a-z]{1,3}$": {"type": "boolean"}},
                  "additionalProperties": False, "maxProperties": 2}
    texts, _ = _texts(eng, ("json", json.dumps(short_keys)), n=3)
    assert all(isinstance(json.loads(t), dict) and t.startswith('{"') for t in texts), texts
    texts, seqs = _texts(eng, ("regex", r"[ab]{3}-[0-9]{2}"))
    assert all(re.fullmatch(r"[ab]{3}-[0-9]{2}", t) for t in texts), texts
    assert all(s.finish_reason == "stop" for s in seqs)
    texts, _ = _texts(eng, ("choice", json.dumps(["yes", "no", "maybe so"])), n=6)
    assert set(texts) <= {"yes", "no", "maybe so"}
    texts, _ = _texts(eng, ("grammar", 'start: "x" ("+" "x")* "=" /[0-9]/'))
    assert all(re.fullmatch(r"x(\+x)*=[0-9]", t) for t in texts), texts
    # a guided request beside unguided ones: each keeps its own
    seqs = eng.generate([PROMPT, PROMPT], [SamplingParams(max_new_tokens=8, guide=("regex", "z+")),
                                           SamplingParams(max_new_tokens=8, ignore_eos=True)])
    assert set(eng.tokenizer.decode(seqs[0].output_ids, skip_special_tokens=True)) == {"z"}
    assert len(seqs[1].output_ids) == 8


@pytest.mark.parametrize("guide,needle", [(("json", "{not json"), "not JSON"), (("json", "[1]"), "must be an object"),
                                          (("regex", "[a-"), "cannot be compiled"), (("choice", "[]"), "non-empty list"),
                                          (("grammar", "start: missing_rule"), "cannot be compiled"),
                                          (("xml", "<a/>"), "unknown guide kind"),
                                          # a RecursionError reached the ingress as a replica failure (503)
                                          (("json", '{"default": ' + "[" * 30000 + "]" * 30000 + "}"), "nested too deeply"),
                                          (("choice", "[" * 30000 + "]" * 30000), "nested too deeply")])
def test_bad_guides_are_refused_with_the_reason(make_engine, guide, needle):
    with pytest.raises(GuideError, match=needle):
        grammar_text(*guide)
    eng = make_engine("tiny")
    with pytest.raises(RequestError, match=needle):
        eng.add_request(PROMPT, SamplingParams(guide=guide))
    assert not eng.has_work()


def test_a_schema_string_nested_past_what_the_walks_take_is_refused_at_every_depth():
    """A schema sent as a string skips the body's nesting bound: at depths json reads but the schema's
    walks do not, a RecursionError reached the replica's caller (a retried 503), not a 400."""
    for depth in range(250, 800, 10):
        with pytest.raises(GuideError, match="nested too deeply|cannot be compiled"):
            grammar_text("json", '{"anyOf":[' * depth + '{"type":"string"}' + "]}" * depth)


def test_a_guide_ends_at_any_of_the_engines_end_tokens_and_cannot_be_contradicted(make_engine):
    import torch

    from engine.guided import Guides, mask_disallowed

    eng = make_engine("tiny")
    eos = next(iter(eng.eos_ids))
    end_of_turn = eng.tokenizer.convert_tokens_to_ids("<|end|>")  # (as generation_config lists one)
    guides = Guides(eng.tokenizer, eng.vocab_size, {eos, end_of_turn, 300})  # (300: past the tokenizer's ids)
    m = guides.matcher("regex", "a")
    m.consume_token(eng.tokenizer.convert_tokens_to_ids("a"))
    allowed = torch.isfinite(mask_disallowed(torch.zeros(eng.vocab_size), m)).nonzero().flatten().tolist()
    assert allowed == sorted({eos, end_of_turn})
    for kw, needle in ((dict(min_tokens=2), "min_tokens"), (dict(allowed_token_ids=[97]), "allowed_token_ids")):
        with pytest.raises(RequestError, match=needle):
            eng.add_request(PROMPT, SamplingParams(guide=("regex", "a+"), **kw))
    # a bad word the guide needs yields to it (with no token left, the draw would be token 0)
    brace = eng.tokenizer.convert_tokens_to_ids("{")
    texts, _ = _texts(eng, ("json", json.dumps(SCHEMA)), n=2, bad_words_ids=[[brace]])
    assert all(set(json.loads(t)) == {"n", "kind"} for t in texts)
    # an EOS that completes the guide ends the answer under ignore_eos too, as no text (it was written into it)
    eos = eng.tokenizer.eos_token_id
    for skip in (True, False):
        seq = eng.generate([PROMPT], SamplingParams(max_new_tokens=10, guide=("regex", "[0-9]+"), ignore_eos=True,
                                                    skip_special_tokens=skip, logit_bias={eos: 100.0}))[0]
        assert seq.output_ids[-1] == eos and re.fullmatch("[0-9]+", seq.text), (seq.text, seq.output_ids)
        assert seq.finish_reason == "eos"
    # also under a repetition penalty, which made the guide's -inf a finite -3.4e38 for the tokens the
    # prompt holds: the structure lost, a forbidden token was drawn and the request failed
    a = eng.tokenizer.convert_tokens_to_ids("a")
    for penalty in (1.0, 1.3):
        seq = eng.generate([PROMPT], SamplingParams(max_new_tokens=5, guide=("regex", "a"), bad_words_ids=[[a]],
                                                    repetition_penalty=penalty))[0]
        assert seq.output_ids[:1] == [a] and seq.finish_reason in ("stop", "eos"), (penalty, seq.finish_reason)


def test_a_guided_request_preempted_mid_answer_keeps_to_its_guide(make_engine):
    # a pool of 8 blocks for two 70-token prompts and their answers: one is preempted and computes its
    # context again; its guide's state (which follows the generated tokens) must not be replayed
    eng = make_engine("tiny", max_batch_total_tokens=128, max_prefill_chunk_tokens=32)
    guide = ("regex", "[ab]{30}-[0-9]{5}")
    seqs = eng.generate([[7] * 60, PROMPT], [SamplingParams(max_new_tokens=40, ignore_eos=True),
                                             SamplingParams(max_new_tokens=40, guide=guide, temperature=1.0, seed=2)])
    assert seqs[1].preemptions > 0
    assert re.fullmatch("[ab]{30}-[0-9]{5}", eng.tokenizer.decode(seqs[1].output_ids, skip_special_tokens=True))


def test_a_reasoning_models_guide_waits_for_the_end_of_its_thinking(make_engine):
    eng = make_engine("tiny")
    # the tiny tokenizer's tags are one ordinary added token each, as Qwen3's <think> and </think> are
    start, end = (eng.tokenizer.convert_tokens_to_ids(t) for t in ("<think>", "</think>"))
    guide = ("json", json.dumps(SCHEMA))

    def answer(**kw):
        seq = eng.generate([PROMPT], SamplingParams(**{"max_new_tokens": 60, "guide": guide, **kw}))[0]
        return eng.tokenizer.decode(seq.output_ids), seq

    # the prompt opened the thinking: the guide waits for its end tag (forced first here), then holds the rest
    text, seq = answer(guide_after="</think>", logit_bias={end: 100.0})
    assert text.startswith("</think>") and set(json.loads(text.removeprefix("</think>"))) == {"n", "kind"}
    assert seq.finish_reason in ("stop", "eos")
    # (without waiting, the guide rules the end tag out from the first token)
    text, _ = answer(logit_bias={end: 100.0})
    assert text.startswith("{") and set(json.loads(text)) == {"n", "kind"}
    # what it thinks before the end tag is free: not JSON
    text, seq = answer(guide_after="</think>", logit_bias={end: -100.0}, max_new_tokens=12)
    assert seq.finish_reason == "length" and not text.startswith("{")
    # it may open the thinking or not (guide_opener): opened, it thinks; not opened, it is guided at once
    text, _ = answer(guide_after="</think>", guide_opener=start, logit_bias={start: 100.0, end: 50.0},
                     bad_words_ids=[[start, start]])
    assert text.startswith("<think></think>") and set(json.loads(text[15:])) == {"n", "kind"}
    text, seq = answer(guide_after="</think>", guide_opener=start, logit_bias={start: -100.0, end: 100.0})
    assert text.startswith("{") and set(json.loads(text)) == {"n", "kind"} and seq.guide_wait is None
    # a guide that writes a tag itself holds the thinking block too, from its first token (the tag's
    # token read by its text, as the guide spells it)
    block = r"<think>\nPlan: [a-z]{3}\.\n</think>\n\nok"
    text, seq = answer(guide=("regex", block), guide_after="</think>", guide_opener=start, logit_bias={start: 100.0})
    assert re.fullmatch(block, text) and seq.output_ids[0] == start and seq.finish_reason == "stop"
    text, seq = answer(guide=("regex", "</think>ok"), guide_after="</think>", logit_bias={end: -100.0})
    assert text == "</think>ok" and seq.output_ids[0] == end  # (the prompt opened it; the guide closes it)
    # the token that completes the end tag may carry text after it: the guide reads that too
    text, _ = answer(guide=("regex", ">ok"), guide_after="</think", logit_bias={end: 100.0})
    assert text == "</think>ok"
    # and where the guide cannot start with that text, the request fails as a guide that broke off (it
    # ended 'stop', as if complete, with no JSON in its answer)
    rid = eng.add_request(PROMPT, SamplingParams(max_new_tokens=60, guide=guide, guide_after="</think",
                                                 logit_bias={end: 100.0}))
    last = [ev for _ in iter(eng.has_work, False) for ev in eng.step() if ev.request_id == rid][-1]
    assert last.finish_reason == "error" and last.error_kind == "validation"
    assert last.error == "the guide cannot go on: the text after '</think' is not what it allows: '>'"
    # it cannot end while it thinks (an end token, however likely): its answer comes, or max_tokens cuts it
    eos = next(iter(eng.eos_ids))
    text, seq = answer(guide_after="</think>", logit_bias={eos: 100.0, end: -100.0}, max_new_tokens=8)
    assert seq.finish_reason == "length" and eos not in seq.output_ids and seq.guide_wait == "marker"
    text, seq = answer(guide_after="</think>", logit_bias={eos: 100.0, end: 20.0})
    assert set(json.loads(text.split("</think>", 1)[1])) == {"n", "kind"} and seq.finish_reason in ("stop", "eos")
    with pytest.raises(RequestError, match="guide_after"):
        eng.add_request(PROMPT, SamplingParams(guide_after="</think>"))
    for bad in (10**6, eng.tokenizer.eos_token_id):  # (a token without text opens nothing)
        with pytest.raises(RequestError, match="not a token with text"):
            eng.add_request(PROMPT, SamplingParams(guide=guide, guide_after="</think>", guide_opener=bad))


def test_a_guide_reads_an_added_token_by_its_text(make_engine):
    eng = make_engine("tiny")  # (llguidance's mask allows <think> where the guide's text is its, its parser only the spelling)
    seq = eng.generate([PROMPT], SamplingParams(max_new_tokens=30, guide=("regex", r"<think>[a-z]{2}</think>!")))[0]
    assert re.fullmatch(r"<think>[a-z]{2}</think>!", eng.tokenizer.decode(seq.output_ids)), seq.output_ids
    assert eng.tokenizer.convert_tokens_to_ids("<think>") in seq.output_ids and seq.finish_reason == "stop"


@pytest.mark.parametrize("guide", [("json", '{"$ref": "#"}'), ("regex", "[^\\x00-\\U0010FFFF]")])
def test_a_guide_that_matches_no_text_is_refused(make_engine, guide):
    # it allowed only the end: an empty answer, finish "eos", as if complete
    eng = make_engine("tiny")
    with pytest.raises(RequestError, match="matches no text"):
        eng.add_request(PROMPT, SamplingParams(guide=guide))
    assert not eng.has_work()


def test_a_guide_that_breaks_off_ends_its_request_with_the_error_and_the_others_go_on(make_engine):
    # strings that never end: llguidance gives up as it goes; the answer ended "x", finish "stop", no error
    eng = make_engine("tiny")
    broken = eng.add_request(PROMPT, SamplingParams(max_new_tokens=20, guide=("grammar", 'start: a\na: "x" a')))
    other = eng.add_request(PROMPT, SamplingParams(max_new_tokens=6, ignore_eos=True))
    ends = {}
    while eng.has_work():
        ends.update((ev.request_id, ev) for ev in eng.step() if ev.finished)
    assert ends[broken].finish_reason == "error" and ends[broken].error_kind == "validation"
    assert ends[broken].error.startswith("the guide cannot go on")
    assert ends[other].finish_reason == "length" and ends[other].error is None
    eng.check_invariants()


def _stub_guides(monkeypatch, size: int):
    """Guides whose compile step is free (llguidance stubbed out): only the cache of checked guides runs."""
    class Matcher:
        def __init__(self, *a):
            pass

        def compute_bitmask(self):
            pass

        def deep_copy(self):
            return self

        def is_error(self):
            return False

        @staticmethod
        def validate_grammar(*a):
            return None
    monkeypatch.setattr(guided, "CHECKED_GUIDES", size)
    monkeypatch.setattr(guided, "_llguidance", lambda: types.SimpleNamespace(LLMatcher=Matcher))
    monkeypatch.setattr(guided, "grammar_text", lambda kind, text: text)
    g = object.__new__(guided.Guides)
    g._checked, g._checked_lock, g._ll_tokenizer, g._problem = {}, threading.Lock(), object(), None
    return g


def test_the_checked_guides_keep_the_ones_in_use(monkeypatch):
    g = _stub_guides(monkeypatch, 3)
    for text in ("a", "b", "c", "a", "d"):  # "a" used again: "b" is the least recently used
        g.check("regex", text)
    assert list(g._checked) == [("regex", "c"), ("regex", "a"), ("regex", "d")]


def test_a_guide_is_compiled_once_and_each_request_gets_a_copy(monkeypatch):
    # each request's matcher compiled its schema again, on the engine thread: 1.5 s for a deeply nested one,
    # every other request held meanwhile, and again at each request of it
    g = _stub_guides(monkeypatch, 8)
    made = []
    stub = guided._llguidance().LLMatcher
    monkeypatch.setattr(guided, "_llguidance", lambda: types.SimpleNamespace(
        LLMatcher=type("Counted", (stub,), {"__init__": lambda self, *a: made.append(self)})))
    g.check("regex", "a+")
    copies = [g.matcher("regex", "a+") for _ in range(3)]
    assert len(made) == 1 and all(isinstance(m, stub) for m in copies)


def test_schemas_with_int64_bounds_or_float_counts_compile_and_keep_their_data(make_engine):
    # OpenAPI tools declare int64 bounds; llguidance cannot write those ranges (nor 1e20's), and wants its
    # counts as integers: valid schemas were a 400
    from engine.guided import _loosened

    guides = make_engine("tiny").guides
    for schema in ({"type": "integer", "minimum": -(2**63), "maximum": 2**63 - 1}, {"type": "number", "maximum": 1e20},
                   {"type": "object", "properties": {"n": {"type": "number", "minimum": -3.4e38}}},
                   {"type": "string", "maxLength": 5.0},
                   # properties named as data keywords are schemas too (they were kept whole: still a 400)
                   *({"type": "object", "properties": {name: {"type": "integer", "minimum": -(2**63), "maximum": 2**63 - 1}},
                      "required": [name]} for name in ("default", "enum", "const", "examples"))):
        guides.check("json", json.dumps(schema))
    kept = {"type": "object", "properties": {"maximum": {"type": "integer", "maximum": 9}},
            "const": {"maximum": 1e30}, "enum": [{"maxLength": 5.0}]}
    assert _loosened(kept) == kept
    # a bound past int64 that holds numbers in is kept, and llguidance refuses it: dropped, any integer
    # passed "at least 1e19" (0, 8209, ...)
    for tight in ({"type": "integer", "minimum": 10**19}, {"type": "number", "exclusiveMaximum": -1e20}):
        assert _loosened(tight) == tight
        with pytest.raises(GuideError):
            guides.check("json", json.dumps(tight))
    m = guides.matcher("json", json.dumps({"type": "string", "maxLength": 2.0}))
    ids = guides._tokenizer.encode('"abc"', add_special_tokens=False)
    assert m.validate_tokens(ids) < len(ids)  # the count still holds


def test_copies_of_one_guide_advance_apart(make_engine):
    eng = make_engine("tiny")
    a, b = (eng.guides.matcher("regex", "ab|ac") for _ in range(2))
    x, y = (eng.tokenizer.encode(c, add_special_tokens=False) for c in ("a", "b"))
    a.consume_tokens(x)
    assert a.validate_tokens(y) == 1 and b.validate_tokens(y) == 0 and b.validate_tokens(x) == 1


def test_guides_checked_from_several_threads_at_once_never_fail(monkeypatch):
    # a replica checks guides in its validation threads while its engine thread makes matchers: the
    # shared cache of checked guides raised "dictionary changed size during iteration" (a 503)
    g = _stub_guides(monkeypatch, 64)
    errors: list[BaseException] = []
    counter = itertools.count()
    stop = time.monotonic() + 1.5

    def run(calls) -> None:
        while time.monotonic() < stop:
            try:
                calls(next(counter))
            except Exception as e:  # noqa: BLE001 - what the test looks for
                errors.append(e)
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads often, to meet the interleavings
    try:
        threads = [threading.Thread(target=run, args=(lambda i: g.check("regex", f"y{i}"),)) for _ in range(2)]
        threads.append(threading.Thread(target=run, args=(lambda i: g.matcher("regex", f"y{max(0, i - 62)}"),)))
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(old)
    assert not errors, errors[:3]


def test_a_guide_checked_before_it_is_queued_is_not_compiled_again_on_the_engine_thread(make_engine):
    # the async engine compiles a guide on a worker thread, then the engine's thread took it from the cache of
    # checked guides: had 256 others pushed it out meanwhile (a burst of one-off schemas), it was compiled
    # again there, every other request held while it did
    from engine.async_engine import AsyncEngine

    eng = make_engine("tiny")
    real_validate, real_check = eng.validate, eng.guides.check
    compiled_on: list[str] = []

    def validate(*a, **kw):
        start = real_validate(*a, **kw)
        eng.guides._checked.clear()  # (as if 256 other guides came through)
        return start

    def check(kind, text):
        if (kind, text) not in eng.guides._checked:
            compiled_on.append(threading.current_thread().name)
        return real_check(kind, text)

    eng.validate, eng.guides.check = validate, check
    ae = AsyncEngine(eng)

    async def run():
        params = SamplingParams(max_new_tokens=4, guide=("regex", "[ab]{3}"))
        return "".join([ev.text async for ev in ae.generate([5, 6, 7, 8], params)])

    try:
        assert len(asyncio.run(run())) == 3
    finally:
        ae.shutdown()
    assert len(compiled_on) == 1 and compiled_on[0] != "radixserve-engine", compiled_on  # (a worker's)


ADD = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"], "additionalProperties": False}


def test_strict_tools_under_auto_leave_the_text_free_and_hold_each_call_it_begins(make_engine):
    """A strict tool under tool_choice auto: a call's arguments were the model's own, and a broken one
    crashed the OpenAI SDK's parse of a strict tool's call (json.loads) in the client."""
    from app.tool_calls import strict_auto_guide

    assert strict_auto_guide([("add", ADD, False)], "hermes") is None  # no strict tool: unguided, as before
    assert strict_auto_guide([("add", ADD, True)], "mistral") is None  # (its calls are not tagged in text)
    huge = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(3000)}}
    assert strict_auto_guide([("add", huge, True)], "hermes") is None  # past MAX_GUIDE_CHARS: unguided
    guide = strict_auto_guide([("add", ADD, True), ("note", {"type": "object"}, False)], "hermes")
    eng = make_engine("tiny")
    ok = {"Just text, <b>no</b> call.": True,
          'Hi <tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>': True,
          'a <tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call> b <tool_call>{"name": "note", '
          '"arguments": {"x": [1]}}</tool_call>': True,  # (a strict tool's schema; the other's any object)
          '<tool_call>{"name": "add", "arguments": {"a": 1,}}</tool_call>': False,
          '<tool_call>{"name": "add", "arguments": {"b": 1}}</tool_call>': False,
          '<tool_call>{"name": "sub", "arguments": {}}</tool_call>': False}
    for text, allowed in ok.items():
        m = eng.guides.matcher(*guide)
        assert eng.guides.consume_text(m, text) is allowed, text
    # parallel_tool_calls false: one call at most (the text after it is free, a second tag is not)
    one = strict_auto_guide([("add", ADD, True)], "hermes", parallel=False)
    call = '<tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>'
    assert eng.guides.consume_text(eng.guides.matcher(*one), f"x {call} then text")
    assert not eng.guides.consume_text(eng.guides.matcher(*one), f"x {call} {call}")
    # what the engine's sampler sees: where the model would break a call, its token is masked
    comma, brace = (eng.tokenizer.encode(c, add_special_tokens=False)[0] for c in (",", "}"))
    m = eng.guides.matcher(*guide)
    row = guided.mask_disallowed(torch.zeros(eng.vocab_size), m)
    assert row[comma] == 0 and row[brace] == 0  # free text: anything
    assert eng.guides.consume_text(m, 'Hi <tool_call>{"name": "add", "arguments": {"a": 1')
    row = guided.mask_disallowed(torch.zeros(eng.vocab_size), m)
    assert row[comma] == float("-inf") and row[brace] == 0


def test_a_response_format_beside_tools_under_auto_holds_the_answer_or_lets_it_call(make_engine):
    """tool_choice auto with a response format (OpenAI's structured outputs with tools, Anthropic's
    output_config.format with tools, as agent frameworks send an output type and tools): the format held the
    answer from its first token, and no tool could ever be called."""
    from app.tool_calls import format_or_calls_guide

    answer = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
              "additionalProperties": False}
    assert format_or_calls_guide(answer, [("add", ADD, False)], "mistral") is None  # (its calls are not tagged)
    guide = format_or_calls_guide(answer, [("add", ADD, True), ("note", {"type": "object"}, False)], "hermes")
    eng = make_engine("tiny")
    call = '<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>'
    ok = {'{"city": "Oslo"}': True, call: True,
          '\n\n{"city": "Oslo"}': True,  # (a thinking model's answer after its </think>)
          '\n\n\n{"city": "Oslo"}': False,
          call + ' <tool_call>{"name": "note", "arguments": {"x": [1]}}</tool_call>\n': True,
          '{"town": "Oslo"}': False,  # the format's schema
          '<tool_call>{"name": "add", "arguments": {"b": 1}}</tool_call>': False,  # a strict tool's
          "Just text.": False, 'Sure: ' + call: False}  # no text beside the answer or the calls
    for text, allowed in ok.items():
        assert eng.guides.consume_text(eng.guides.matcher(*guide), text) is allowed, text
    one = format_or_calls_guide(answer, [("add", ADD, True)], "hermes", parallel=False)
    assert not eng.guides.consume_text(eng.guides.matcher(*one), call + call)


def test_llama3_json_calls_under_auto_are_guided_as_the_parser_reads_them(make_engine):
    """Llama 3's calls are the whole answer, untagged: a strict tool's call went unguided under auto, and
    beside a response format no call could begin. What the guide takes, the parser reads the same way:
    calls as calls, everything else as text (or the format's JSON)."""
    from app.tool_calls import format_or_calls_guide, parse_llama3_json, strict_auto_guide

    tools = [("add", ADD, True), ("note", {"type": "object"}, False)]
    eng = make_engine("tiny")
    call, other = '{"name": "add", "parameters": {"a": 1}}', '{"name": "note", "parameters": {"x": [1]}}'
    auto = strict_auto_guide(tools, "llama3_json")
    cases = {call: True, f"{call}; {other}": True, f"\n{call}\n": True, "Just text {with braces}.": True,
             '{"name": "add", "parameters": {"b": 1}}': False,  # (a strict tool's schema)
             '{"name": "sub", "parameters": {}}': False, '{"city": "Oslo"}': False,  # (a call begun is a call)
             '\r\u2003{"name": "add"': False, '<|python_tag|>{"name": "add"': False,  # (what the parser skips,
             '\x1c{"name": "add"': False}  # \x1c-\x1f too, which llguidance's \s has not)
    for text, allowed in cases.items():
        assert eng.guides.consume_text(eng.guides.matcher(*auto), text) is allowed, text
        if allowed:
            content, calls = parse_llama3_json(text, {"add", "note"})
            assert (content is None) is text.strip().startswith("{"), text
    assert eng.guides.matcher(*auto).is_accepting()  # (an empty answer is text too)
    one = strict_auto_guide(tools, "llama3_json", parallel=False)
    assert not eng.guides.consume_text(eng.guides.matcher(*one), f"{call}; {call}")

    answer = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
              "additionalProperties": False}
    both = format_or_calls_guide(answer, tools, "llama3_json")
    cases = {'{"city": "Oslo"}': True, "\n\n" + '{"city": "Oslo"}': True, call: True, f"{call};{other}": True,
             '{"town": "Oslo"}': False, "Just text.": False, '{"name": "add", "parameters": {"b": 1}}': False}
    for text, allowed in cases.items():
        assert eng.guides.consume_text(eng.guides.matcher(*both), text) is allowed, text
    assert parse_llama3_json('{"city": "Oslo"}', {"add", "note"}) == ('{"city": "Oslo"}', [])
    # a format that takes any object (json_object) took a call-shaped one past the strict tool's schema; and
    # an answer's object with a "name" alone was read as a call with no arguments
    any_object = format_or_calls_guide({"type": "object"}, tools, "llama3_json")
    for text, allowed in {'{"name": "add", "parameters": {"b": 1}}': False, call: True, '{"x": [1]}': True,
                          '{"name": "add"}': True}.items():
        assert eng.guides.consume_text(eng.guides.matcher(*any_object), text) is allowed, text
    assert parse_llama3_json('{"name": "add"}', {"add", "note"}) == ('{"name": "add"}', [])


def test_a_strict_call_opens_with_the_models_own_tag_token_where_it_has_one(model_dir):
    """Qwen's <tool_call> and </tool_call> are added tokens, which llguidance reads as special: free text
    never allows them, so under a grammar that spelled the tags out a Qwen model could call no tool."""
    from transformers import AutoTokenizer

    from app.tool_calls import strict_auto_guide
    from deployments.ingress import _tag_tokens

    tok = AutoTokenizer.from_pretrained(model_dir("tiny"))
    tok.add_tokens(["<tool_call>", "</tool_call>"])  # (as Qwen's: added, not special)
    tags = _tag_tokens(tok, ("<tool_call>", "</tool_call>"))
    open_id, close_id = tags["<tool_call>"], tags["</tool_call>"]
    assert None not in (open_id, close_id)
    eos = tok.convert_tokens_to_ids("<|eos|>")
    guides = guided.Guides(tok, len(tok), {eos})
    guide = strict_auto_guide([("add", ADD, True)], "hermes", tag_ids=(open_id, close_id))

    def allowed(m, token: int) -> bool:
        return bool(torch.isfinite(guided.mask_disallowed(torch.zeros(len(tok)), m)[token]))

    m = guides.matcher(*guide)
    assert allowed(m, open_id) and allowed(m, eos)
    assert guides.consume_text(m, "Sure. ") and allowed(m, open_id)
    assert not guides.step(m, open_id) and not m.is_error()
    assert guides.consume_text(m, '\n{"name": "add", "arguments": {"a": 1}}\n')
    assert allowed(m, close_id) and not allowed(m, eos)  # (a call begun ends whole)
    guides.step(m, close_id)
    assert not m.is_error() and allowed(m, eos) and allowed(m, open_id)
    # the tag spelled out is no call then, and no text either (the parser would read it as one)
    m = guides.matcher(*guide)
    assert not guides.consume_text(m, 'x <tool_call>{"name": "add", "arguments": {"a": 1,}}</tool_call>')


def test_a_strict_guide_waits_for_the_end_of_the_thinking_and_names_special_call_tags(make_engine, model_dir):
    """Its free text could write </think> itself, so the engine took it for a guide that holds the thinking
    too: it guided from the first token, and a model whose </think> is one added token (masked in free
    text) could never end its thinking. And a Hermes fine-tune whose call tags are special tokens could
    call no tool: its tags were spelled out."""
    from transformers import AutoTokenizer

    from app.tool_calls import strict_auto_guide
    from deployments.ingress import _tag_tokens

    eng = make_engine("tiny")
    for excludes, wait in (((), None), (("<think>", "</think>"), "marker")):
        guide = strict_auto_guide([("add", ADD, True)], "hermes", text_excludes=excludes)
        rid = eng.add_request(PROMPT, SamplingParams(max_new_tokens=4, guide=guide, guide_after="</think>"))
        assert eng.requests[rid].guide_wait == wait, excludes
        eng.abort(rid)
    tok = AutoTokenizer.from_pretrained(model_dir("tiny"))
    tok.add_tokens(["<tool_call>", "</tool_call>"], special_tokens=True)
    assert _tag_tokens(tok, ("<tool_call>",)) == {}  # (as text with special tokens skipped, it is none)
    assert _tag_tokens(tok, ("<tool_call>",), keep_special=True) == {"<tool_call>": tok.convert_tokens_to_ids("<tool_call>")}


def test_a_steps_guides_are_masked_together_as_each_alone(make_engine):
    """A step's guided requests get their masks from llguidance's threads at once (they waited for each
    other's in turn): the same bits as each computed alone, one matcher twice included."""
    eng = make_engine("tiny")
    ms = [eng.guides.matcher("regex", "(ab){3}c"), eng.guides.matcher("json", '{"type": "object"}'),
          eng.guides.matcher("choice", '["yes", "no"]')]
    assert eng.guides.consume_text(ms[0], "ab") and eng.guides.consume_text(ms[1], '{"k": ')
    v = eng.vocab_size
    together = guided.allowed_bits(ms, v)
    alone = torch.stack([guided.allowed_bits([m], v)[0] for m in ms])
    assert torch.equal(together, alone) and len({tuple(r.tolist()) for r in alone}) == 3
    assert torch.equal(guided.allowed_bits([ms[0], ms[2], ms[0]], v), alone[[0, 2, 0]])
    row = guided.mask_disallowed(torch.zeros(v), bits=together[2])
    assert torch.equal(row, guided.mask_disallowed(torch.zeros(v), ms[2]))


def test_a_strict_tools_schema_with_its_own_id_or_anchors_is_held_where_the_guide_places_it(make_engine):
    """The calls' guide places each tool's schema under its root's $defs and rebases its $refs there: a
    schema's own $id made those resolve inside the schema (a 4xx for a valid tool), and an anchor's ref
    ("#A") became a pointer to nowhere. Whether a schema can be held is judged as placed."""
    from app.tool_calls import can_guide_arguments, strict_auto_guide

    with_id = {"$id": "https://example.com/s.json", "type": "object", "properties": {"a": {"$ref": "#/$defs/A"}},
               "required": ["a"], "$defs": {"A": {"type": "integer"}}}
    anchored = {"type": "object", "properties": {"a": {"$ref": "#A"}}, "required": ["a"],
                "$defs": {"x": {"$anchor": "A", "type": "integer"}}}
    eng = make_engine("tiny")
    for schema in (with_id, anchored):
        assert can_guide_arguments(schema)
        guide = strict_auto_guide([("f", schema, True)], "hermes")
        assert eng.guides.consume_text(eng.guides.matcher(*guide), '<tool_call>{"name": "f", "arguments": {"a": 1}}</tool_call>')
        assert not eng.guides.consume_text(eng.guides.matcher(*guide), '<tool_call>{"name": "f", "arguments": {"a": "x"}}')
    assert not can_guide_arguments({"type": "object", "$defs": 5}) and not can_guide_arguments([1])
