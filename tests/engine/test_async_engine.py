"""The async wrapper: concurrent streams, cancellation aborts, errors reach the caller."""

from __future__ import annotations

import asyncio
import threading

import pytest

from engine.async_engine import AsyncEngine, EngineDeadError
from engine.llm_engine import RequestError
from engine.sequence import SamplingParams

PROMPT = list(range(40, 110))


async def _drain(stream) -> None:
    async for _ in stream:
        pass


def test_concurrent_streams_match_the_sync_engine(make_engine):
    eng = make_engine("tiny")
    expect = eng.generate([PROMPT, PROMPT[:30]], SamplingParams(max_new_tokens=12, ignore_eos=True))
    ae = AsyncEngine(eng)

    async def collect(prompt):
        toks, text, last = [], "", None
        async for ev in ae.generate(prompt, SamplingParams(max_new_tokens=12, ignore_eos=True)):
            if ev.token_id is not None:
                toks.append(ev.token_id)
            text += ev.text
            last = ev
        return toks, last

    async def main():
        return await asyncio.gather(collect(PROMPT), collect(PROMPT[:30]))

    try:
        (a, la), (b, lb) = asyncio.run(main())
        assert a == expect[0].output_ids and b == expect[1].output_ids
        assert la.finish_reason == "length" and la.num_output_tokens == 12
        assert la.num_cached_tokens == 64  # the sync run above cached this prompt
        ae.call(lambda e: e.check_invariants())
    finally:
        ae.shutdown()


def test_cancelled_consumer_aborts_and_frees_blocks(make_engine):
    eng = make_engine("tiny", prefix_caching=False)
    ae = AsyncEngine(eng)

    async def main():
        got = 0
        async for _ in ae.generate(PROMPT, SamplingParams(max_new_tokens=2000, ignore_eos=True)):
            got += 1
            if got == 3:
                break  # the client went away
        for _ in range(100):
            await asyncio.sleep(0.02)
            if ae.call(lambda e: e.kv.allocator.num_free == e.kv.allocator.num_blocks):
                return True
        return False

    try:
        assert asyncio.run(main())
        assert ae.call(lambda e: len(e.requests)) == 0
    finally:
        ae.shutdown()


def test_bad_request_raises_before_streaming(make_engine):
    ae = AsyncEngine(make_engine("tiny"))
    try:
        with pytest.raises(RequestError, match="empty"):
            asyncio.run(_drain(ae.generate([], SamplingParams())))
    finally:
        ae.shutdown()


def test_a_request_id_in_use_is_refused_and_the_first_stream_goes_on(make_engine):
    # the second stream used to take over the first one's queue: the first then hung for good
    ae = AsyncEngine(make_engine("tiny"))

    async def first(running: asyncio.Event):
        events = []
        async for ev in ae.generate(PROMPT, SamplingParams(max_new_tokens=1000, ignore_eos=True), request_id="same"):
            events.append(ev)
            running.set()
        return events

    async def main():
        running = asyncio.Event()  # (a sleep instead let a fast machine finish the first before the second came)
        task = asyncio.create_task(first(running))
        await asyncio.wait_for(running.wait(), 60)
        with pytest.raises(RequestError, match="already in use"):
            await _drain(ae.generate(PROMPT, SamplingParams(max_new_tokens=5), request_id="same"))
        return await asyncio.wait_for(task, 60)

    try:
        events = asyncio.run(main())
        assert events[-1].finish_reason == "length" and events[-1].num_output_tokens == 1000
    finally:
        ae.shutdown()


def test_an_id_whose_request_the_engine_still_holds_is_refused(make_engine):
    # the first consumer left; until its abort is handled the engine still runs that request, and a
    # new stream under its id would receive its last events
    eng = make_engine("tiny")
    # (added before the engine thread starts: the engine is not thread-safe; long, so it still runs)
    eng.add_request(PROMPT, SamplingParams(max_new_tokens=2000, ignore_eos=True), request_id="held")
    ae = AsyncEngine(eng)
    try:
        with pytest.raises(RequestError, match="already in use"):
            asyncio.run(_drain(ae.generate(PROMPT, SamplingParams(max_new_tokens=2), request_id="held")))
    finally:
        ae.shutdown()


def test_an_id_freed_while_its_last_event_is_on_the_way_gets_only_its_own_events(make_engine):
    """The engine drops a finished request before the step's events go out; a consumer that leaves in
    between frees the id, and a new stream under it used to receive the old request's last event (and
    end on it, its own request never served)."""
    import time

    eng = make_engine("tiny")
    step, ended = eng.step, threading.Event()

    def slow_step():  # a long step right after "same" finished: the window, held open
        events = step()
        if any(ev.finished and ev.request_id == "same" for ev in events) and not ended.is_set():
            ended.set()
            time.sleep(0.5)
        return events

    eng.step = slow_step
    ae = AsyncEngine(eng)

    async def consume(prompt: list[int], n: int) -> list:
        return [ev async for ev in ae.generate(prompt, SamplingParams(max_new_tokens=n, ignore_eos=True),
                                               request_id="same")]

    async def main():
        first = asyncio.create_task(consume([5] * 10, 3))
        while not ended.is_set():
            await asyncio.sleep(0.001)
        first.cancel()  # its client leaves just as its request ends in the engine
        await asyncio.gather(first, return_exceptions=True)
        return await asyncio.wait_for(consume([7] * 40, 20), 60)

    try:
        events = asyncio.run(main())
        assert events[-1].finish_reason == "length" and events[-1].num_prompt_tokens == 40
        assert len([ev for ev in events if ev.token_id is not None]) == 20
    finally:
        ae.shutdown()
    assert not ae._owners


@pytest.mark.parametrize("bad", [dict(top_k=2.5, temperature=1.0), dict(top_logprobs=2.5, logprobs=True),
                                 dict(seed=1.5), dict(stop=[5]), dict(temperature="hot"), dict(logprobs="yes"),
                                 dict(logit_bias={3: "x"}), dict(stop_token_ids=(1,)), dict(cache_salt=7),
                                 dict(max_new_tokens=True), dict(cache_salt=""), dict(cache_salt="\ud800")])
def test_a_mistyped_parameter_is_refused_and_does_not_reach_the_shared_step(make_engine, bad):
    # the HTTP schemas type these; a Ray handle or library caller may not, and a float top_k used to
    # fail inside the step every request shares: the engine stopped and every stream on it ended
    eng = make_engine("tiny")
    with pytest.raises(RequestError, match="must be"):
        eng.validate(PROMPT, SamplingParams(**bad))


def test_shutdown_ends_open_streams(make_engine):
    ae = AsyncEngine(make_engine("tiny"))

    async def main():
        events = []
        async for ev in ae.generate(PROMPT, SamplingParams(max_new_tokens=100000 // 100, ignore_eos=True)):
            events.append(ev)
            if len(events) == 2:
                asyncio.get_running_loop().run_in_executor(None, ae.shutdown)
        return events[-1]

    last = asyncio.run(asyncio.wait_for(main(), 30))
    # a stream cut short is an error, not a normal "length" finish the client would take as complete
    assert last.finished and last.finish_reason == "error" and "shutting down" in last.error
    assert last.error_kind == "unavailable"
    with pytest.raises(EngineDeadError):
        ae.call(lambda e: 1)


def test_engine_crash_answers_every_waiter(make_engine):
    """A step that raises fails the running request, the one waiting for a place and the one still in the
    inbox (no hang), and returns every block to the pool."""
    eng = make_engine("tiny", max_num_seqs=1)
    gate, entered = threading.Event(), threading.Event()

    calls = []

    def failing_forward(*args, **kwargs):  # (the third step: by then the second request waits in the engine)
        calls.append(1)
        if len(calls) < 3:
            return real_forward(*args, **kwargs)
        entered.set()
        gate.wait(10)
        raise RuntimeError("device-side assert")

    real_forward, eng.runner.forward = eng.runner.forward, failing_forward
    ae = AsyncEngine(eng)

    async def consume(prompt):
        async for ev in ae.generate(prompt, SamplingParams(max_new_tokens=4)):
            if ev.finished:
                return ev

    async def main():
        a = asyncio.create_task(consume(PROMPT))
        c = asyncio.create_task(consume(PROMPT[:60]))  # (one running at a time: it waits)
        await asyncio.get_running_loop().run_in_executor(None, entered.wait, 10)
        b = asyncio.create_task(consume(PROMPT[:50]))  # arrives while the failing step runs
        await asyncio.sleep(0.2)
        gate.set()
        return await asyncio.wait_for(asyncio.gather(a, b, c), 10)

    la, lb, lc = asyncio.run(main())
    for last in (la, lb, lc):
        assert last.finish_reason == "error" and "device-side assert" in last.error
    # the one running may be what crashed the engine: not to be retried elsewhere; the others may be
    assert (la.error_kind, lb.error_kind, lc.error_kind) == ("engine", "unavailable", "unavailable")
    assert la.token_id is None and len(calls) == 3  # (A had run two steps)
    assert not ae.alive
    assert eng.requests == {} and eng.kv.allocator.num_in_use == 0
    eng.runner.forward = real_forward

    async def late():
        async for _ in ae.generate(PROMPT, SamplingParams(max_new_tokens=4)):
            pass

    with pytest.raises(EngineDeadError):
        asyncio.run(late())


def test_a_steps_events_reach_their_loop_in_one_hand_off(make_engine):
    """One cross-thread call per step and consumer loop, not one per token event."""
    eng = make_engine("tiny")
    ae = AsyncEngine(eng)
    calls = []

    async def main():
        loop = asyncio.get_running_loop()
        real = loop.call_soon_threadsafe

        def counting(cb, *args, **kw):
            calls.append(cb)
            return real(cb, *args, **kw)

        loop.call_soon_threadsafe = counting
        params = SamplingParams(max_new_tokens=10, ignore_eos=True)
        streams = [ae.generate(PROMPT[i:], params) for i in range(4)]

        async def count(stream) -> int:
            return sum([1 async for _ in stream])

        return await asyncio.gather(*(count(s) for s in streams))

    try:
        events = sum(asyncio.run(main()))
    finally:
        ae.shutdown()
    assert events >= 40 and len(calls) <= eng.stats.steps + 1 < events, (len(calls), eng.stats.steps, events)


def test_a_stream_whose_loop_closed_frees_its_request_and_its_id(make_engine):
    import time

    eng = make_engine("tiny")
    ae = AsyncEngine(eng)
    loop = asyncio.new_event_loop()
    stream = ae.generate(PROMPT, SamplingParams(max_new_tokens=200, ignore_eos=True), request_id="X")
    loop.run_until_complete(stream.__anext__())  # one event, then its loop is gone without closing it
    loop.close()
    deadline = time.monotonic() + 10
    while ("X" in ae._streams or eng.requests) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert "X" not in ae._streams and eng.kv.allocator.num_in_use == 0

    async def again():  # the id is free again
        async for ev in ae.generate(PROMPT, SamplingParams(max_new_tokens=2), request_id="X"):
            if ev.finished:
                return ev

    assert asyncio.run(again()).finish_reason == "length"
    ae.shutdown()


def test_a_fault_of_ours_while_adding_a_request_is_logged_counted_and_frees_what_it_took(make_engine, monkeypatch,
                                                                                       caplog):
    """A bug past the request's checks (a generator, a guide matcher) answered a bare 503 of str(e), with no
    traceback anywhere and no failure counted; the engine goes on."""
    import engine.llm_engine as llm_engine

    eng = make_engine("tiny")
    real = llm_engine.make_generator
    monkeypatch.setattr(llm_engine, "make_generator", lambda seed: (_ for _ in ()).throw(KeyError("cuda:0")))
    ae = AsyncEngine(eng)

    async def last(params):
        async for ev in ae.generate(PROMPT, params):
            if ev.finished:
                return ev

    try:
        with caplog.at_level("ERROR", logger="engine.async_engine"):
            ev = asyncio.run(last(SamplingParams(max_new_tokens=3, temperature=0.7, seed=1)))
        assert ev.error_kind == "engine" and ev.error == "engine failure: KeyError: 'cuda:0'"
        assert "could not be added" in caplog.text and "KeyError" in caplog.text
        assert eng.stats.requests_failed == eng.stats.requests_finished == 1  # (failed ones are ended ones too)
        assert eng.requests == {} and eng.kv.allocator.num_in_use == 0
        monkeypatch.setattr(llm_engine, "make_generator", real)
        assert asyncio.run(last(SamplingParams(max_new_tokens=3))).finish_reason == "length"
    finally:
        ae.shutdown()


def test_a_sequence_shows_no_prompt_in_its_repr():
    """An error's message that holds a Sequence (an abort after a crash) logged its whole prompt and settings."""
    from engine.sequence import Sequence

    seq = Sequence("r1", [104, 117, 110, 116, 101, 114, 50], SamplingParams(stop=["SECRET"]))
    assert repr(seq) == "Sequence('r1', WAITING, 7 prompt tokens, 0 generated)" and "SECRET" not in repr(seq)
