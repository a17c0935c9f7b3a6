"""Heartbeats on streams that may be quiet for long (StreamJobLogs).

A heartbeat is sent when nothing was for ``every`` seconds, and it never
cancels the step it waits on (a driver's log call, a wait for a launch).
``waiting`` beats while one awaitable runs (a task, for that wait only);
``with_heartbeats`` beats while a source generator is quiet (a task for its
pending step). A follower's tail beats without either: its own timeout
(``driver_logs.Tail.next``), so an idle follower holds no task.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Awaitable, Callable
from typing import TypeVar

_T = TypeVar("_T")


async def waiting(aw: Awaitable[_T], every: float, result: list[_T]) -> AsyncGenerator[None, None]:
    """Awaits ``aw``, yielding (None) each time ``every`` seconds pass
    without it done; then appends its result to ``result`` (or raises its
    error). ``every`` <= 0: no beats. Closing this cancels ``aw``."""
    if every <= 0:
        result.append(await aw)
        return
    task = asyncio.ensure_future(aw)
    try:
        while True:
            done, _ = await asyncio.wait((task,), timeout=every)
            if done:
                result.append(task.result())
                return
            yield None
    finally:
        if not task.done():
            task.cancel()
            await asyncio.wait((task,))
            if not task.cancelled():
                task.exception()  # retrieved: the caller left, nothing to raise to



async def with_heartbeats(source: AsyncGenerator[_T, None], every: float,
                          beat: Callable[[], _T | None]) -> AsyncGenerator[_T, None]:
    """The items of ``source``, plus ``beat()`` (unless None) whenever
    nothing was sent for ``every`` seconds; ``every`` <= 0 adds nothing.

    A heartbeat never cancels the source's pending step (a driver's log call,
    a watch queue): one task awaits it across heartbeats. Closing this closes
    the source (cancellation reaches it where it waits)."""
    step: asyncio.Future[_T] | None = None
    try:
        if every <= 0:
            async for item in source:
                yield item
            return
        while True:
            if step is None:
                step = asyncio.ensure_future(source.__anext__())
            done, _ = await asyncio.wait((step,), timeout=every)
            if not done:
                hb = beat()
                if hb is not None:
                    yield hb
                continue
            finished, step = step, None
            try:
                item = finished.result()
            except StopAsyncIteration:
                return
            yield item
    finally:
        if step is not None:
            step.cancel()
            await asyncio.wait((step,))
            if not step.cancelled():
                step.exception()  # retrieved: the source's own error is not ours to raise here
        await source.aclose()


