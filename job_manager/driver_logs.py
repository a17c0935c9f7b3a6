"""Log tails of one driver over one ``MultiplexJobLogs`` stream (JobManager's side).

Every StreamJobLogs follower needs a tail of its job's logs from the driver.
A gRPC call per follower cost JobManager ~29 KiB per idle follower (a
grpc.aio client stream); a tail on the shared stream costs a small object.
Flow control is per tail: a tail holds at most ``CREDIT`` batches the
follower has not taken, and gives credit back as it takes them (half a
window at a time), so a slow follower never stalls another's lines.

The stream is opened on the first tail and kept; when it fails (the driver
restarted, the connection dropped) each of its tails ends with the stream's
error after the batches it already holds, and the next tail opens a new
stream. ``DriverClient.tail_logs`` retries a tail that failed UNAVAILABLE
before its first batch (as the service config retries a TailJobLogs call),
and falls back to TailJobLogs calls for a driver that does not serve
MultiplexJobLogs (an older one during an upgrade).
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc

from dlsched import errors
from dlsched.kit import rpc_errors
from dlsched.v1 import driver_service_pb2 as drv_pb2

log = logging.getLogger("job_manager.driver_logs")

#: batches a tail may hold that its follower has not taken
CREDIT = 8
#: tails per stream: past it another stream is opened (a driver takes 20,000)
TAILS_PER_STREAM = 10_000
#: how long a driver found without MultiplexJobLogs is served by TailJobLogs
#: calls before it is asked again (an upgrade rolling through its replicas)
UNSUPPORTED_SECONDS = 300.0
_DONE = object()
_EXPIRED = object()
#: what ``Tail.next`` returns when its timeout passed with nothing (no entries)
IDLE = drv_pb2.TailJobLogsResponse()


def _expire(waiter: asyncio.Future[object]) -> None:
    if not waiter.done():
        waiter.set_result(_EXPIRED)


class MultiplexUnsupported(Exception):  # noqa: N818 - a signal, not an error the caller sees
    """The driver does not serve MultiplexJobLogs."""


class Tail:
    """One tail: ``next()`` gives its batches, then None at its end (or raises its error)."""

    __slots__ = ("_stream", "_id", "_batches", "_waiter", "_end", "_taken")

    def __init__(self, stream: _Stream, tail_id: int) -> None:
        self._stream, self._id = stream, tail_id
        self._batches: list[drv_pb2.TailJobLogsResponse] = []
        self._waiter: asyncio.Future[object] | None = None
        self._end: object = None  # _DONE, or the exception it ended with
        self._taken = 0

    def _push(self, batch: drv_pb2.TailJobLogsResponse) -> bool:
        """Hold ``batch``; False when that is more than the credit given (the
        driver broke the protocol: the tail is ended and closed)."""
        if len(self._batches) >= CREDIT:
            self.close()
            self._end = errors.Unavailable("the driver sent log batches past the tail's credit",
                                           reason="LOG_STREAM_PROTOCOL")
            self._wake()
            return False
        self._batches.append(batch)
        self._wake()
        return True

    def _finish(self, end: object) -> None:
        self._end = end
        self._wake()

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    async def next(self, idle: float = 0.0) -> drv_pb2.TailJobLogsResponse | None:
        """The next batch; None at the tail's end (its error raised instead, if
        it failed); ``IDLE`` (no entries) when ``idle`` (> 0) seconds pass
        without one, which leaves the tail as it was."""
        while not self._batches:
            if self._end is _DONE:
                return None
            if isinstance(self._end, BaseException):
                raise self._end
            loop = asyncio.get_running_loop()
            self._waiter = waiter = loop.create_future()
            timer = loop.call_later(idle, _expire, waiter) if idle > 0 else None
            try:
                await waiter
            finally:
                self._waiter = None
                if timer is not None:
                    timer.cancel()
            if waiter.result() is _EXPIRED and not self._batches and self._end is None:
                return IDLE
        batch = self._batches.pop(0)
        self._taken += 1
        if self._end is None and self._taken >= CREDIT // 2:
            self._stream.send(drv_pb2.MultiplexJobLogsRequest(tail_id=self._id, credit=self._taken))
            self._taken = 0
        return batch

    def close(self) -> None:
        """Stops the tail (the driver stops reading for it); idempotent."""
        if self._end is None:
            self._end = _DONE
            if self._stream.tails.pop(self._id, None) is not None:
                self._stream.send(drv_pb2.MultiplexJobLogsRequest(tail_id=self._id, close=True))
                self._stream.idle()
        self._batches.clear()


class _Stream:
    """One MultiplexJobLogs call and the tails open on it."""

    def __init__(self, stub: Any, on_idle: Callable[[_Stream], None] | None = None) -> None:
        self.tails: dict[int, Tail] = {}
        self.ended = False
        self.unsupported = False
        self._last_id = 0
        self._on_idle = on_idle  # told when its last tail closes
        # What to send; None ends the requests (the call's request task returns).
        self._outbox: asyncio.Queue[drv_pb2.MultiplexJobLogsRequest | None] = asyncio.Queue()
        self._call = stub.MultiplexJobLogs(self._requests())
        self._reader = asyncio.create_task(self._read())

    def open(self, request: drv_pb2.TailJobLogsRequest) -> Tail:
        self._last_id += 1
        tail = self.tails[self._last_id] = Tail(self, self._last_id)
        self.send(drv_pb2.MultiplexJobLogsRequest(
            tail_id=self._last_id, open=drv_pb2.OpenTail(request=request, credit=CREDIT)))
        return tail

    def send(self, msg: drv_pb2.MultiplexJobLogsRequest) -> None:
        if not self.ended:
            self._outbox.put_nowait(msg)

    async def _requests(self) -> AsyncIterator[drv_pb2.MultiplexJobLogsRequest]:
        while (msg := await self._outbox.get()) is not None:
            yield msg

    def idle(self) -> None:
        if not self.tails and self._on_idle is not None:
            self._on_idle(self)

    async def _read(self) -> None:
        # Each tail ends with an exception of its own (one shared by every
        # follower would carry all their frames, and their tracebacks mixed).
        end: Callable[[], BaseException] = lambda: errors.Unavailable(  # noqa: E731
            "the driver ended the log stream", reason="LOG_STREAM_ENDED")
        try:
            async for resp in self._call:
                tail = self.tails.get(resp.tail_id)
                if tail is None:
                    continue  # closed meanwhile
                kind = resp.WhichOneof("event")
                if kind == "batch":
                    tail._push(resp.batch)  # noqa: SLF001 - the stream feeds its tails
                elif kind == "end":
                    del self.tails[resp.tail_id]
                    tail._finish(_DONE if resp.end.code == 0  # noqa: SLF001
                                 else rpc_errors.from_status(resp.end))
                    self.idle()  # its last tail: an extra or retired stream ends
                # else: a message this JobManager does not know (a newer driver): skipped
        except grpc.RpcError as e:
            if e.code() == grpc.StatusCode.UNIMPLEMENTED and isinstance(
                    (first := rpc_errors.from_rpc_error(e)), errors.Unimplemented) \
                    and first.reason == "UNIMPLEMENTED":  # no ErrorInfo: gRPC's "method not found"
                self.unsupported = True
                end = MultiplexUnsupported
            else:
                end = functools.partial(rpc_errors.from_rpc_error, e)
        except asyncio.CancelledError:
            end = lambda: errors.Unavailable("log stream closed", reason="LOG_STREAM_ENDED")  # noqa: E731
            raise
        except Exception as e:  # noqa: BLE001 - e.g. an end status that does not decode
            log.warning("log stream of a driver failed: %r", e)
            end = lambda: errors.Unavailable(  # noqa: E731
                "the driver's log stream failed", reason="LOG_STREAM_ENDED")
        finally:
            self.ended = True
            self._outbox.put_nowait(None)
            self._call.cancel()  # ended already, or the driver must stop every tail
            for tail in self.tails.values():
                tail._finish(end())  # noqa: SLF001
            self.tails.clear()

    def shut(self) -> None:
        """End the call now (its reader ends the tails)."""
        self.ended = True
        self._outbox.put_nowait(None)
        self._call.cancel()
        self._reader.cancel()

    async def close(self) -> None:
        self.shut()
        await asyncio.gather(self._reader, return_exceptions=True)


class LogMux:
    """The tails of one driver, on the streams open now: one, or another per
    ``TAILS_PER_STREAM`` tails; a failed stream is replaced by the next open."""

    def __init__(self, stub: Any) -> None:
        self._stub = stub
        self._streams: list[_Stream] = []
        self._unsupported_until = 0.0
        self._closed = False
        self._retired = False

    @property
    def unsupported(self) -> bool:
        """Whether tails go by TailJobLogs calls for now (the driver lacked MultiplexJobLogs)."""
        return asyncio.get_running_loop().time() < self._unsupported_until

    def mark_unsupported(self) -> None:
        """A tail ended MultiplexUnsupported: TailJobLogs calls for a while."""
        self._unsupported_until = asyncio.get_running_loop().time() + UNSUPPORTED_SECONDS

    def open(self, request: drv_pb2.TailJobLogsRequest) -> Tail:
        if self._closed:
            raise errors.Unavailable("JobManager is shutting down", reason="SHUTTING_DOWN")
        self._streams = [st for st in self._streams if not st.ended]
        stream = next((st for st in self._streams if len(st.tails) < TAILS_PER_STREAM), None)
        if stream is None:
            stream = _Stream(self._stub, self._idle)
            self._streams.append(stream)
        return stream.open(request)

    def _idle(self, stream: _Stream) -> None:
        """A stream's last tail closed: an extra one (past the first) or, once
        its client was retired (a renewed certificate), every one is ended."""
        if self._retired or (self._streams and stream is not self._streams[0]):
            stream.shut()

    def retire(self) -> None:
        """New tails go elsewhere: streams end as their last tail closes."""
        self._retired = True
        for stream in self._streams:
            if not stream.tails:
                stream.shut()

    async def close(self) -> None:
        self._closed = True
        streams, self._streams = self._streams, []
        await asyncio.gather(*(st.close() for st in streams), return_exceptions=True)
