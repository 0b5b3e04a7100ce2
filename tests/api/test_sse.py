"""api/sse.py: SSE comment pings on a silent stream."""
from __future__ import annotations

import asyncio

from api.sse import PING, with_pings


def test_a_silent_stream_gets_pings_between_its_items_which_pass_unchanged():
    async def scenario():
        release = asyncio.Event()

        async def events():
            yield b"data: 1\n\n"
            await release.wait()   # a long prefill: nothing to send
            yield b"data: 2\n\n"

        got = []
        async for item in with_pings(events(), 0.02):
            got.append(item)
            if got.count(PING) == 3:
                release.set()
        return got

    got = asyncio.run(asyncio.wait_for(scenario(), 10))   # without pings it would wait forever
    assert got == [b"data: 1\n\n", PING, PING, PING, b"data: 2\n\n"]


def test_interval_zero_sends_no_pings():
    async def scenario():
        async def events():
            await asyncio.sleep(0.05)
            yield b"data: 1\n\n"

        return [item async for item in with_pings(events(), 0)]

    assert asyncio.run(scenario()) == [b"data: 1\n\n"]


def test_closing_the_pinged_stream_closes_the_source_while_it_waits():
    async def scenario():
        closed = asyncio.Event()

        async def events():
            try:
                yield b"data: 1\n\n"
                await asyncio.Event().wait()   # never comes
                yield b"never"
            finally:
                closed.set()

        stream = with_pings(events(), 0.01)
        assert await stream.__anext__() == b"data: 1\n\n"
        assert await stream.__anext__() == PING
        await stream.aclose()   # the client went away
        return closed.is_set()

    assert asyncio.run(scenario())
