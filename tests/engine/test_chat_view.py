"""Keep-alives in a stream that goes quiet (app.chat_view.with_pings): pings while nothing comes, the
items all in order, and nothing cancelled that was still coming."""

from __future__ import annotations

import asyncio

from app.chat_view import with_pings


def test_pings_fill_the_silences_and_every_item_comes_in_order():
    closed = []

    async def slow():
        try:
            for i, wait in enumerate((0.0, 0.25, 0.0, 0.12)):
                await asyncio.sleep(wait)
                yield i
        finally:
            closed.append(True)

    async def main():
        return [x async for x in with_pings(slow(), 0.05, "ping")]

    got = asyncio.run(main())
    assert [x for x in got if x != "ping"] == [0, 1, 2, 3]
    assert got.index(1) - got.index(0) >= 3 and "ping" in got[got.index(2):]  # (0.25 s, then 0.12 s of quiet)
    assert closed == [True]


def test_a_reader_that_leaves_while_an_item_is_pending_ends_the_stream_it_reads():
    ended = []

    async def slow_forever():
        try:
            while True:
                await asyncio.sleep(0.3)
                yield "x"
        finally:
            ended.append(True)  # (the route's aborts run here: the engine requests end)

    async def main():
        pinged = with_pings(slow_forever(), 0.05, "ping")
        assert await pinged.__anext__() == "ping"  # an item is pending now
        await pinged.aclose()
        return list(ended)

    assert asyncio.run(main()) == [True]
