"""One cluster's background driver calls while its driver does not answer.

Every launch and stop that waits for a driver retries in a task of its own,
with backoff. While the driver is down (SIGSTOPped, restarting, not yet given
the cluster), thousands of queued launches would each read their job from
etcd, call the driver and log a warning every ``retry_max_seconds``: work in
proportion to the backlog, taken from SubmitJob and every other call. The
gate closes on the first failure that says the driver (not the job) cannot be
reached; then one call at a time probes it, with the gate's own backoff, and
the others wait, each on a future of its own (no timer, no wake-up) until a
probe (or any call) gets an answer, then go on as before, through the
cluster's launch slots. When a probe is due, one waiter (the longest waiting)
is woken to make it.
"""

from __future__ import annotations

import asyncio
import collections
import enum
import time

#: reasons that say the driver, or the way to it, is down: every job of the cluster would fail
#: alike (a job's own retryable failure, e.g. BACKEND_UNAVAILABLE for a Slurm job still ending,
#: does not close the gate: the driver answered)
DRIVER_DOWN = frozenset({"UNAVAILABLE", "DRIVER_UNAVAILABLE", "DRIVER_NOT_READY",
                         "CLUSTER_NOT_CONFIGURED", "CLUSTER_MANAGER_UNAVAILABLE"})


class Turn(enum.Enum):
    GO = "go"  # the driver answered last: call it
    PROBE = "probe"  # the gate is closed and this caller probes it (``DriverGate.probed`` after)


class DriverGate:
    def __init__(self, initial_seconds: float, max_seconds: float) -> None:
        self._initial = initial_seconds
        self._max = max_seconds
        self._delay = initial_seconds
        self._next = 0.0  # monotonic time of the next probe
        self._probing = False
        self._closed = False
        self._waiters: collections.deque[asyncio.Future[Turn]] = collections.deque()
        self._timer: asyncio.TimerHandle | None = None
        self.reason = ""  # of the failure that closed it (a DRIVER_DOWN reason)
        self.message = ""

    @property
    def closed(self) -> bool:
        return self._closed

    def failed(self, reason: str, message: str) -> None:
        """A call failed with ``reason``; the gate closes when it names the driver."""
        if reason not in DRIVER_DOWN:
            self.answered()
            return
        if not self._closed:
            self._closed = True
            self._delay = self._initial
        elif self._probing:  # (calls in flight before the close fail too: they change nothing)
            self._delay = min(self._delay * 2, self._max)
        else:
            return
        self._next = time.monotonic() + self._delay
        self.reason, self.message = reason, message
        self._arm()

    def answered(self) -> None:
        """The driver answered a call (success or the job's own error): the gate opens."""
        if not self._closed:
            return
        self._closed = False
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        while self._waiters:
            f = self._waiters.popleft()
            if not f.done():
                f.set_result(Turn.GO)

    def probed(self) -> None:
        """The probe ``turn`` gave is over (whatever it found: ``failed``/``answered`` said it)."""
        self._probing = False
        if self._closed:
            # A probe that made no call (its job gone, or etcd down before it): the next one
            # after the least delay, not at once (a chain of waiters each failing on etcd).
            self._next = max(self._next, time.monotonic() + self._initial)
            self._arm()

    def must_wait(self) -> bool:
        """Whether ``turn`` would wait now (closed, and a probe is out or not due)."""
        return self._closed and (self._probing or time.monotonic() < self._next)

    async def turn(self) -> Turn:
        """GO when open; PROBE for one caller at a time once a probe is due; else wait (without
        work) for one of the two."""
        if not self._closed:
            return Turn.GO
        if not self._probing and time.monotonic() >= self._next:
            self._probing = True
            return Turn.PROBE
        fut: asyncio.Future[Turn] = asyncio.get_running_loop().create_future()
        self._waiters.append(fut)
        try:
            return await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled() and fut.result() is Turn.PROBE:
                self.probed()  # elected, then cancelled: another waiter probes
            raise

    def _arm(self) -> None:
        """Elect a prober among the waiters once the next probe is due."""
        if self._timer is not None:
            self._timer.cancel()
        self._timer = asyncio.get_running_loop().call_at(
            asyncio.get_running_loop().time() + max(0.0, self._next - time.monotonic()), self._elect)

    def _elect(self) -> None:
        self._timer = None
        if not self._closed or self._probing:
            return
        while self._waiters:
            f = self._waiters.popleft()
            if not f.done():
                self._probing = True
                f.set_result(Turn.PROBE)
                return
