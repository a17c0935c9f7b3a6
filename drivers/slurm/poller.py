"""One poller per cluster: ONE ``squeue`` per interval for every tracked job.

Each round runs ``squeue --all --states=all --user=<ssh user> -O ...`` once
(every job of the user, finished ones included while slurmctld still holds
them, ``MinJobAge``; ``--all`` so that jobs in hidden partitions are not
mistaken for gone), and, only when some wanted job is not in that answer,
one follow-up for those: ``sacct`` for just them when the cluster has
accounting storage (slurmdbd answers it, not slurmctld, and keeps jobs past
``MinJobAge``), else ``scontrol --all --oneliner show job`` (all jobs the
controller holds). Watchers,
observations and log tails read the poller's results; they add no calls.

Pacing: round starts are at least ``interval`` apart, always, and the
interval is at least ``MIN_INTERVAL``, 2 s. Sites may hold each user to
about 2 controller RPCs per second (Slurm's ``rl_enable`` token bucket), and
one squeue costs slurmctld two (the job table, then the partition table;
sdiag shows it, ``--all`` or not), three with the follow-up; at 2 s the
poller takes 1 RPC/s (1.5 with a follow-up) whatever the number of jobs,
and leaves the rest to sbatch, scancel and the user's own commands.
``wake()`` (a launch, a stop) never adds a round: a poller with nothing to
do starts its next round at once, one that is polling keeps its schedule,
and any number of wakes before a round coalesce into it. ``fresh()`` waits
for the answer of the next round (adopting jobs after a restart), again
without a round of its own. ``charge()`` gives one round's slot to another
controller call of the same cost (the driver's capacity look-up,
``scontrol show nodes``, also two RPCs): the next round starts one interval
later, so the cluster's total stays at the poller's rate.

Health: each round's outcome (``last_round``: when it ended and its error)
is what the driver's GetClusterInfo reports while the poller is busy, so the
health check adds no controller call of its own.

A failed round (SSH down, slurmctld down: non-zero exit) changes no state:
the driver keeps every job's last known state and marks it stale. Each
round (failed or not) is one ``dlsched_driver_poll_duration_seconds{backend="slurm"}``
sample. The parsers below are pure and tested on recorded output.
"""

from __future__ import annotations

import asyncio
import calendar
import contextlib
import logging
import secrets
import shlex
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass

from dlsched.errors import DlschedError
from dlsched.kit import metrics
from dlsched.kit.parse import decimal
from drivers.common.registry import BackendUnavailable

log = logging.getLogger("dlsched.driver.slurm.poller")

#: The shortest interval between two rounds' starts, in seconds (see the module docstring).
MIN_INTERVAL = 2.0
#: squeue -O fields. The comment, which the job's owner sets (any text, '|' and newlines too), goes
#: last and is the only such field (a job's name is not asked for), at a fixed width: squeue pads or
#: cuts it to exactly ``COMMENT_WIDTH`` bytes, so each job is ``<fields>|<COMMENT_WIDTH bytes>|\n``
#: and a newline in a comment can never start a (forged) job of its own (``parse_squeue``).
SQUEUE_FIELDS = ("JobID", "State", "exit_code", "StartTime", "EndTime", "NodeList", "Reason",
                 "RestartCnt", "Comment")
#: longer than any comment dlsched writes (``dlsched-<63>.<attempt>.<64>``); longer ones are cut
COMMENT_WIDTH = 256


@dataclass(frozen=True)
class SlurmJob:
    """One job as Slurm reports it."""

    job_id: str
    state: str
    reason: str = ""
    exit_status: int | None = None  # raw wait status (squeue exit_code) already decoded to a code
    start_time: float | None = None
    end_time: float | None = None
    nodes: str = ""
    comment: str = ""
    restarts: int = 0  # times Slurm requeued it (RestartCnt / Restarts)


def squeue_command(user: str, name: str | None = None) -> str:
    """squeue, its output made ASCII byte for byte (``tr``: a comment's other bytes become '?'),
    so the comment's fixed width counts in characters too."""
    fmt = ",".join(f"{f}:|" for f in SQUEUE_FIELDS[:-1]) + f",{SQUEUE_FIELDS[-1]}:{COMMENT_WIDTH}|"
    cmd = f"squeue --noheader --all --states=all --user={shlex.quote(user)} -O {shlex.quote(fmt)}"
    if name:
        cmd += f" --name={shlex.quote(name)}"
    return f"o=$({cmd}) || exit $?; printf '%s\\n' \"$o\" | LC_ALL=C tr -c '\\n -~' '?'"


def scontrol_command() -> str:
    return "scontrol --all --oneliner show job"


#: sacct -o fields of the follow-up; the comment goes last, as in squeue.
SACCT_FIELDS = ("JobID", "State", "ExitCode", "Start", "End", "NodeList", "Reason", "Comment")


def sacct_command(ids: Iterable[str], delimiter: str = "|") -> str:
    """The jobs' allocations (not their steps) from the accounting database; with
    ``--jobs`` sacct looks back to the epoch, not just today. ``delimiter``: the poller's
    is new each call (``new_delimiter``), so no comment can hold it."""
    jobs = ",".join(sorted(i for i in ids if decimal(i)))
    return (f"sacct --noheader --parsable2 --allocations --jobs={jobs} "
            f"--delimiter={shlex.quote(delimiter)} -o {','.join(SACCT_FIELDS)}")


def new_delimiter() -> str:
    """A field delimiter no job can have put in its comment beforehand."""
    return f"@{secrets.token_hex(8)}@"


def parse_sacct(text: str, delimiter: str = "|") -> dict[str, SlurmJob]:
    """``sacct --parsable2 -o SACCT_FIELDS`` lines; ExitCode is ``code:signal``. A line without
    the delimiter continues the comment (the last field) of the line before it: with the
    poller's unguessable delimiter a comment's newline never starts a job. A job listed twice
    refuses the answer."""
    out: dict[str, SlurmJob] = {}
    n = len(SACCT_FIELDS)
    rows: list[list[str]] = []
    for line in text.splitlines():
        parts = line.split(delimiter, n - 1)
        if len(parts) == n:
            rows.append(parts)
        elif rows and len(parts) == 1:
            rows[-1][-1] += "\n" + line
    for parts in rows:
        if not decimal(parts[0].strip()):
            continue  # a step (123.batch), a heterogeneous component (123+0) or noise
        jid, state, code, start, end, nodes, reason = (p.strip() for p in parts[:n - 1])
        if jid in out:
            raise BackendUnavailable(f"sacct listed job {jid} twice")
        out[jid] = SlurmJob(job_id=jid, state=state, reason=reason, exit_status=_exit_code(code),
                            start_time=parse_time(start), end_time=parse_time(end), nodes=nodes,
                            comment=parts[n - 1].strip())
    return out


def _exit_code(value: str) -> int | None:
    """``2:0`` -> 2; ``0:9`` (killed by signal 9) -> 137."""
    code, _, sig = value.partition(":")
    if not decimal(code):
        return None
    return 128 + int(sig) if decimal(sig) and int(sig) and not int(code) else int(code)


def parse_time(value: str) -> float | None:
    v = value.strip()
    if not v or v in ("N/A", "NONE", "Unknown", "None", "(null)"):
        return None
    try:
        return float(calendar.timegm(time.strptime(v, "%Y-%m-%dT%H:%M:%S")))
    except ValueError:
        return None


def decode_wait_status(value: str) -> int | None:
    """squeue's ``exit_code`` is a raw wait status: 768 -> 3; killed by signal 9 -> 137."""
    v = value.strip()
    if not decimal(v):
        return None
    status = int(v)
    sig = status & 0x7F
    return 128 + sig if sig else (status >> 8) & 0xFF


def parse_squeue(text: str) -> dict[str, SlurmJob]:
    """``squeue_command``'s answer: each job ``<8 fields>|<COMMENT_WIDTH chars>|\n``, read by
    position, so a comment (newlines and '|' in it too) never shifts a field or adds a job. An
    answer out of that shape is refused whole (``BackendUnavailable``), never half believed."""
    out: dict[str, SlurmJob] = {}
    n = len(SQUEUE_FIELDS) - 1
    pos = 0
    while pos < len(text):
        if text[pos] == "\n":  # the empty answer's one newline
            pos += 1
            continue
        head: list[str] = []
        for _ in range(n):
            bar = text.find("|", pos)
            if bar < 0 or "\n" in text[pos:bar]:
                raise BackendUnavailable(f"squeue answered out of shape at byte {pos}")
            head.append(text[pos:bar].strip())
            pos = bar + 1
        comment, pos = text[pos:pos + COMMENT_WIDTH], pos + COMMENT_WIDTH
        if text[pos:pos + 2] != "|\n":
            raise BackendUnavailable(f"squeue answered out of shape at byte {pos}")
        pos += 2
        jid, state, code, start, end, nodes, reason, restarts = head
        if not decimal(jid):
            continue  # an array task (123_4) or a heterogeneous component: not ours
        if jid in out:
            if state.startswith("REVOKED"):
                continue  # --all lists a federated job's revoked sibling too; the live one wins
            if not out[jid].state.startswith("REVOKED"):
                raise BackendUnavailable(f"squeue listed job {jid} twice")
        out[jid] = SlurmJob(job_id=jid, state=state, reason=reason, exit_status=decode_wait_status(code),
                            start_time=parse_time(start), end_time=parse_time(end), nodes=nodes,
                            comment=comment.strip(),
                            restarts=int(restarts) if decimal(restarts) else 0)
    return out


def parse_scontrol_jobs(text: str) -> dict[str, SlurmJob]:
    """``scontrol --oneliner show job`` output: one ``Key=Value ...`` line per job. Each key is
    taken where it first appears (Slurm's own keys come before the free text a job sets: a
    ``Comment`` holding `` JobState=FAILED`` changes nothing), the comment is its first word
    (a dlsched comment has no space), and an answer naming a job twice (a comment with a
    newline and a forged line in it) is refused whole."""
    out: dict[str, SlurmJob] = {}
    for line in text.splitlines():
        kv = key_values(line, first=True)
        jid = kv.get("JobId", "")
        if not line.startswith("JobId=") or not decimal(jid):
            continue
        if jid in out:
            raise BackendUnavailable(f"scontrol listed job {jid} twice")
        exit_code = _exit_code(kv.get("ExitCode", ""))
        out[jid] = SlurmJob(job_id=jid, state=kv.get("JobState", ""), reason=kv.get("Reason", ""),
                            exit_status=exit_code, start_time=parse_time(kv.get("StartTime", "")),
                            end_time=parse_time(kv.get("EndTime", "")), nodes=kv.get("NodeList", ""),
                            comment=kv.get("Comment", "").split(" ", 1)[0],
                            restarts=int(r) if decimal(r := kv.get("Restarts", "")) else 0)
    return out


def key_values(line: str, first: bool = False) -> dict[str, str]:
    """Split ``A=1 B=x y C=2`` (values may hold spaces) into a dict; ``first``: a key seen again
    is text of the value before it, not a new value."""
    out: dict[str, str] = {}
    key = None
    for tok in line.strip().split(" "):
        k, sep, v = tok.partition("=")
        if sep and k and k.replace("/", "").replace(":", "").isalnum() and not (first and k in out):
            key = k
            out[key] = v
        elif key is not None and tok:
            out[key] += " " + tok
    return out


RunFn = Callable[[str], Awaitable[tuple[int, str, str]]]
Jobs = dict[str, SlurmJob]


class Poller:
    """Polls one cluster; ``on_round(jobs, error, complete)`` gets each round's answer.

    ``error`` is set when the round failed (nothing is known); ``complete``
    is false when the follow-up failed, so jobs missing from ``jobs`` are
    not known to be gone. ``jobs`` holds every job of the user squeue
    listed, plus what the follow-up found of the wanted ones.

    ``tracked()`` names the Slurm job ids that need news; with none (and no
    ``fresh()`` waiting, and ``watching()`` false: the driver has held jobs to
    watch) the poller issues nothing. ``interval`` is raised
    to ``floor``; tests pass a smaller floor and their own ``clock``.
    ``accounting()`` says whether the follow-up may be ``sacct``.
    ``rounds`` and ``last_round_commands`` count what the poller issued.
    """

    def __init__(self, run: RunFn, user: str, interval: float,
                 tracked: Callable[[], Iterable[str]],
                 on_round: Callable[[Jobs, str | None, bool], None], *,
                 floor: float = MIN_INTERVAL, clock: Callable[[], float] = time.monotonic,
                 accounting: Callable[[], bool] = lambda: False,
                 watching: Callable[[], bool] = lambda: False) -> None:
        self._run = run
        self._watching = watching
        self._accounting = accounting
        self._user = user
        if interval < floor:
            log.info("poll interval %gs raised to the floor, %gs", interval, floor)
        self.interval = max(floor, interval)
        self._tracked = tracked
        self._on_round = on_round
        self._clock = clock
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._last_start: float | None = None
        self._want: set[str] = set()
        self._waiters: list[asyncio.Future[Jobs | None]] = []
        self.rounds = 0
        self.last_round_commands = 0
        #: (monotonic end, error or None) of the last round that finished; None before one.
        self.last_round: tuple[float, DlschedError | None] | None = None

    @property
    def last_start(self) -> float | None:
        """When (``clock``) the round under way or the last one started; the pacing
        rule holds between these: each is at least ``interval`` after the one before."""
        return self._last_start

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._loop(), name=f"slurm-poller-{self._user}")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        self._resolve(self._waiters, None)
        self._waiters = []

    def wake(self) -> None:
        """There is news to fetch: poll as soon as the pacing allows (never sooner)."""
        self._wake.set()

    async def fresh(self, ids: Iterable[str] = ()) -> Jobs | None:
        """The answer of the next round that starts after this call (``ids`` join its
        follow-up); None when that round failed or the poller stopped."""
        if self._task is None:
            return None
        fut: asyncio.Future[Jobs | None] = asyncio.get_running_loop().create_future()
        self._want.update(ids)
        self._waiters.append(fut)
        self._wake.set()
        return await fut

    def charge(self) -> None:
        """Another controller call took a round's cost: the next round starts one interval later."""
        if self._last_start is not None:
            self._last_start = max(self._last_start, self._clock() - self.interval) + self.interval

    def busy(self) -> bool:
        """Whether rounds are running: some job is tracked or an answer is awaited."""
        return self._task is not None and self._busy()

    def _busy(self) -> bool:
        return bool(self._waiters) or any(True for _ in self._tracked()) or self._watching()

    async def _loop(self) -> None:
        while True:
            self._wake.clear()
            if not self._busy():
                # Idle: nothing is issued. A wake (or a look every interval) ends the wait.
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), self.interval)
                continue
            while self._last_start is not None:  # again after a sleep: a charge() may have moved it
                delay = self._last_start + self.interval - self._clock()
                if delay <= 0:
                    break
                await asyncio.sleep(delay)  # wakes meanwhile coalesce into the round below
            self._last_start = self._clock()
            waiters, self._waiters = self._waiters, []
            want, self._want = self._want, set()
            jobs: Jobs | None = None
            started = time.perf_counter()
            try:
                jobs = await self._round(want)
            except asyncio.CancelledError:
                self._waiters = waiters + self._waiters
                raise
            except Exception:  # a bad round must never end the poller
                log.exception("poll round failed")
            metrics.POLL_DURATION.labels("slurm").observe(time.perf_counter() - started)
            self._resolve(waiters, jobs)

    @staticmethod
    def _resolve(waiters: list[asyncio.Future[Jobs | None]], jobs: Jobs | None) -> None:
        for w in waiters:
            if not w.done():
                w.set_result(jobs)

    async def _round(self, want: set[str]) -> Jobs | None:
        wanted = set(self._tracked()) | want
        self.rounds += 1
        self.last_round_commands = 1
        try:
            rc, out, err = await self._run(squeue_command(self._user))
        except DlschedError as e:
            self.last_round = (self._clock(), e)
            self._on_round({}, f"{e.reason}: {e.message}", False)
            return None
        if rc != 0:
            error = f"squeue exited {rc}: {err.strip()[:300]}"
            self.last_round = (self._clock(), BackendUnavailable(error))
            self._on_round({}, error, False)
            return None
        try:
            jobs = parse_squeue(out)
        except DlschedError as e:  # out of shape: nothing in it is believed
            self.last_round = (self._clock(), e)
            self._on_round({}, f"{e.reason}: {e.message}", False)
            return None
        complete = True
        if missing := wanted - set(jobs):
            self.last_round_commands = 2
            sacct, delimiter = self._accounting(), new_delimiter()
            try:
                rc2, out2, _ = await self._run(sacct_command(missing, delimiter) if sacct else scontrol_command())
                found = (parse_sacct(out2, delimiter) if sacct else parse_scontrol_jobs(out2)) if rc2 == 0 else {}
            except DlschedError:
                rc2, found = 1, {}
            complete = rc2 == 0
            for jid, j in found.items():
                if jid in wanted and jid not in jobs:
                    jobs[jid] = j
        self.last_round = (self._clock(), None)
        self._on_round(jobs, None, complete)
        return jobs
