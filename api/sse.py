"""Server-sent events helpers shared by every streaming route.

``with_pings`` interleaves SSE comment lines (``: ping``, which every SSE client ignores; WHATWG HTML section
9.2.6) into a stream that has been silent for ``interval_s``: while a request waits in the queue or in a long
prefill, proxies in front (nginx ``proxy_read_timeout``, load balancers' idle timeouts) still see bytes and do not
cut the stream. llama.cpp's server does the same.
"""
from __future__ import annotations

import asyncio
from typing import AsyncIterator

PING = b": ping\n\n"


async def with_pings(events: AsyncIterator[bytes], interval_s: float) -> AsyncIterator[bytes]:
    """``events``' items unchanged, plus ``PING`` after every ``interval_s`` seconds in which ``events`` yielded
    nothing; ``interval_s`` <= 0: ``events`` as is. Closing (or cancelling) this generator closes ``events``.

    Usage: ``StreamingResponse(with_pings(my_events(), config.sse_ping_interval_s), media_type="text/event-stream")``.
    """
    if interval_s <= 0:
        async for item in events:
            yield item
        return
    source = events.__aiter__()
    pending: asyncio.Future | None = None
    try:
        while True:
            if pending is None:
                pending = asyncio.ensure_future(source.__anext__())
            done, _ = await asyncio.wait({pending}, timeout=interval_s)
            if not done:
                yield PING
                continue
            try:
                item = pending.result()
            except StopAsyncIteration:
                return
            finally:
                pending = None
            yield item
    finally:
        if pending is not None:
            pending.cancel()
            try:
                await pending
            except (asyncio.CancelledError, StopAsyncIteration):
                pass
        aclose = getattr(source, "aclose", None)
        if aclose is not None:
            await aclose()
