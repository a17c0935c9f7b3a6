"""``MultiplexJobLogs``, the driver side: many log tails over one stream.

JobManager keeps one such stream per driver and opens a tail on it for each
log follower, so an idle follower costs the driver a task (a few KiB), not a
gRPC call of its own (~27 KiB). Each tail runs what a ``TailJobLogs`` call
would (``tail``, the servicer's) in a task of its own and sends a batch only
while the client has given the tail credit: a tail whose reader is slow
waits alone, the others go on. Every message out is a batch that used a
credit or a tail's end, so what waits to be sent is bounded by the credit
the client gave and by ``MAX_QUEUED`` (a client that stops reading the
whole stream stops every tail, and its opens wait too), plus one end per
open tail. A message carries at most about 1 MiB of lines (the kit splits
batches and long lines: ``convert.log_batches_pb``).

A tail's error ends that tail (its status in the end message, as the kit's
error layer would have reported the call); a malformed message from the
client ends the stream INVALID_ARGUMENT. The stream ends OK once the client
has half-closed and no tail is left; cancelled (the client left), it cancels
every tail.
"""

from __future__ import annotations

import asyncio
import collections
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from typing import Any

from google.rpc import status_pb2

from dlsched import errors
from dlsched.kit import rpc_errors
from dlsched.v1 import driver_service_pb2 as pb

log = logging.getLogger("dlsched.driver.logmux")

#: tails open at once on one stream (JobManager opens one per follower;
#: an idle tail costs the driver a few KiB)
MAX_TAILS = 20_000
#: most batches a tail may have outstanding (credit given and not used)
MAX_CREDIT = 1024
#: batches waiting to be sent on one stream: past this, tails wait for the
#: stream (its reader is slow as a whole), whatever credit they hold
MAX_QUEUED = 1024
METHOD = "/dlsched.v1.DriverService/MultiplexJobLogs"

Tailer = Callable[[pb.TailJobLogsRequest], AsyncIterator[pb.TailJobLogsResponse]]
_OK = status_pb2.Status(code=0)


class _Tail:
    __slots__ = ("credit", "more", "task")

    def __init__(self, credit: int) -> None:
        self.credit = credit
        self.more: asyncio.Future[None] | None = None  # set while it waits for credit
        self.task: asyncio.Task[None] | None = None

    def give(self, n: int) -> None:
        self.credit = min(self.credit + n, MAX_CREDIT)
        if self.more is not None and not self.more.done():
            self.more.set_result(None)


class LogMux:
    """One MultiplexJobLogs stream: ``run`` yields what to send."""

    def __init__(self, tail: Tailer) -> None:
        self._tail = tail
        self._tails: dict[int, _Tail] = {}
        self._last_id = 0
        self._client_done = False
        # Batches (each used a credit), ends, and what ends the stream:
        # None (done) or an exception (the client's malformed message).
        self._out: asyncio.Queue[pb.MultiplexJobLogsResponse | BaseException | None] = asyncio.Queue()
        # Tails (and the reader, before an open) waiting for the queue to be under
        # MAX_QUEUED, first come first woken: one per message sent, not all of them.
        self._waiters: collections.deque[asyncio.Future[None]] = collections.deque()

    async def run(self, requests: AsyncIterator[Any]) -> AsyncGenerator[pb.MultiplexJobLogsResponse, None]:
        reader = asyncio.create_task(self._read(requests))
        try:
            while True:
                item = await self._out.get()
                if self._out.qsize() < MAX_QUEUED:
                    self._wake_one()
                if item is None:
                    return
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            tasks = [t.task for t in self._tails.values() if t.task is not None]
            self._tails.clear()
            for task in (reader, *tasks):
                task.cancel()
            await asyncio.gather(reader, *tasks, return_exceptions=True)

    async def _room(self) -> None:
        """Until fewer than ``MAX_QUEUED`` messages wait to be sent."""
        while self._out.qsize() >= MAX_QUEUED:
            waiter = asyncio.get_running_loop().create_future()
            self._waiters.append(waiter)
            try:
                await waiter
            except asyncio.CancelledError:
                if waiter.done() and not waiter.cancelled():
                    self._wake_one()  # woken, then cancelled: the room goes to the next
                raise

    def _wake_one(self) -> None:
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return

    async def _read(self, requests: AsyncIterator[Any]) -> None:
        try:
            async for msg in requests:
                rpc_errors.refuse_undecodable(msg)
                if msg.WhichOneof("action") == "open":
                    # A client that does not read the stream opens nothing more: what
                    # waits to be sent stays under MAX_QUEUED plus one end per open tail.
                    await self._room()
                self._take(msg)
        except Exception as e:  # noqa: BLE001 - ends the stream (the error layer maps it)
            self._out.put_nowait(e)
            return
        self._client_done = True
        if not self._tails:
            self._out.put_nowait(None)

    def _take(self, msg: Any) -> None:
        action = msg.WhichOneof("action")
        tid = msg.tail_id
        if action == "open":
            if tid <= self._last_id:
                raise errors.InvalidArgument.for_field(
                    "tail_id", f"{tid}: must be greater than every tail id opened before on this stream")
            if not 1 <= msg.open.credit <= MAX_CREDIT:
                raise errors.InvalidArgument.for_field("open.credit", f"must be 1-{MAX_CREDIT}")
            self._last_id = tid
            if len(self._tails) >= MAX_TAILS:
                self._out.put_nowait(pb.MultiplexJobLogsResponse(tail_id=tid, end=rpc_errors.to_status(
                    errors.ResourceExhausted(f"more than {MAX_TAILS} tails open on one stream",
                                             reason="TOO_MANY_TAILS"))))
                return
            tail = self._tails[tid] = _Tail(msg.open.credit)
            tail.task = asyncio.create_task(self._run_tail(tid, tail, msg.open.request))
        elif action == "credit":
            found = self._tails.get(tid)
            if found is not None:  # else ended or closed: a credit in flight, not an error
                found.give(msg.credit)
        elif action == "close":
            closed = self._tails.pop(tid, None)
            if closed is not None and closed.task is not None:
                closed.task.cancel()  # sends nothing more for it, no end
                self._maybe_done()
        else:
            raise errors.InvalidArgument.for_field("action", "one of open, credit, close is required")

    async def _run_tail(self, tid: int, tail: _Tail, request: pb.TailJobLogsRequest) -> None:
        loop = asyncio.get_running_loop()
        end = _OK
        try:
            it = self._tail(request)
            try:
                async for batch in it:
                    while tail.credit <= 0:
                        tail.more = loop.create_future()
                        await tail.more
                        tail.more = None
                    await self._room()
                    tail.credit -= 1
                    self._out.put_nowait(pb.MultiplexJobLogsResponse(tail_id=tid, batch=batch))
            finally:
                aclose = getattr(it, "aclose", None)
                if aclose is not None:
                    await aclose()
        except asyncio.CancelledError as e:
            task = asyncio.current_task()
            if task is not None and task.cancelling():
                raise  # closed by the client, or the stream ends: nothing more is sent
            # a cancellation of something the tail awaited, not of the tail: it ends, and says so
            end = rpc_errors.status_for(errors.Unavailable(f"log tail interrupted: {e!r}"), METHOD)
        except Exception as e:  # noqa: BLE001 - reported as the tail's end, as the error layer would
            end = rpc_errors.status_for(e, METHOD)
        if self._tails.get(tid) is tail:
            del self._tails[tid]
            self._out.put_nowait(pb.MultiplexJobLogsResponse(tail_id=tid, end=end))
            self._maybe_done()

    def _maybe_done(self) -> None:
        if self._client_done and not self._tails:
            self._out.put_nowait(None)
