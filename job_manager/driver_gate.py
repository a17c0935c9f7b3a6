"""One cluster's background driver calls while its driver does not answer.

Every launch and stop that waits for a driver retries in a task of its own,
with backoff. While the driver is down (SIGSTOPped, restarting, not yet given
the cluster), thousands of queued launches would each read their job from
etcd, call the driver and log a warning every ``retry_max_seconds``: work in
proportion to the backlog, taken from SubmitJob and every other call. The
gate closes on the first failure that says the driver (not the job) cannot be
reached; then one call at a time probes it, with the gate's own backoff, and
the others wait without work until a probe (or any call) gets an answer, then
go on as before, through the cluster's launch slots.
"""

from __future__ import annotations

import asyncio
import contextlib
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
    WAIT = "wait"  # closed, another caller probes or the next probe is not due: ask again


class DriverGate:
    def __init__(self, initial_seconds: float, max_seconds: float) -> None:
        self._initial = initial_seconds
        self._max = max_seconds
        self._delay = initial_seconds
        self._next = 0.0  # monotonic time of the next probe
        self._probing = False
        self._open = asyncio.Event()
        self._open.set()
        self.reason = ""  # of the failure that closed it (a DRIVER_DOWN reason)
        self.message = ""

    @property
    def closed(self) -> bool:
        return not self._open.is_set()

    def failed(self, reason: str, message: str) -> None:
        """A call failed with ``reason``; the gate closes when it names the driver."""
        if reason not in DRIVER_DOWN:
            self.answered()
            return
        if self._open.is_set():
            self._open.clear()
            self._delay = self._initial
        elif self._probing:  # (calls in flight before the close fail too: they change nothing)
            self._delay = min(self._delay * 2, self._max)
        else:
            return
        self._next = time.monotonic() + self._delay
        self.reason, self.message = reason, message

    def answered(self) -> None:
        """The driver answered a call (success or the job's own error): the gate opens."""
        self._open.set()

    def probed(self) -> None:
        """The probe ``turn`` gave is over (whatever it found: ``failed``/``answered`` said it)."""
        self._probing = False

    def must_wait(self) -> bool:
        """Whether ``turn`` would WAIT now (closed, and a probe is out or not due)."""
        return not self._open.is_set() and (self._probing or time.monotonic() < self._next)

    async def turn(self, within: float) -> Turn:
        """GO when open; PROBE for one caller at a time once a probe is due; else WAIT after at
        most ``within`` seconds (or as soon as the gate opens: GO)."""
        if self._open.is_set():
            return Turn.GO
        now = time.monotonic()
        if not self._probing and now >= self._next:
            self._probing = True
            return Turn.PROBE
        wait = within if self._probing else min(within, self._next - now)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._open.wait(), max(wait, 0.001))
        return Turn.GO if self._open.is_set() else Turn.WAIT
