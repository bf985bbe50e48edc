"""An awaitable's value from synchronous code (an ``async def`` approval or tool).

Guarantees: the awaitable runs on the event loop of the ``dispatch.aio``
caller that led here when that loop is running in another thread (so it can
use that loop's resources); otherwise on a loop of its own, in another thread
when this one is already running a loop. Never on a loop that is blocked
waiting for us (that would deadlock).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextvars
from typing import Any

__all__ = ["CALLER_LOOP", "await_from_sync"]

CALLER_LOOP: contextvars.ContextVar[asyncio.AbstractEventLoop | None] = contextvars.ContextVar(
    "dispatch_caller_loop", default=None)
"""Set by ``dispatch.aio`` around the threads it runs calls in (``to_thread`` copies it)."""


def await_from_sync(awaitable: Any) -> Any:
    """The value of an awaitable, from synchronous code: on the event loop of
    the ``dispatch.aio`` caller that brought us here when there is one, else
    on a loop of our own (in another thread if this one already runs one)."""
    loop = CALLER_LOOP.get()
    if loop is not None and loop.is_running():
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is not loop:
            return asyncio.run_coroutine_threadsafe(_as_coroutine(awaitable), loop).result()
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(_as_coroutine(awaitable))
    with concurrent.futures.ThreadPoolExecutor(1) as pool:  # this thread's loop is busy calling us
        return pool.submit(asyncio.run, _as_coroutine(awaitable)).result()


async def _as_coroutine(awaitable: Any) -> Any:
    return await awaitable
