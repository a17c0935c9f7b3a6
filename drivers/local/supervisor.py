"""``python -m drivers.local.supervisor ATTEMPT_DIR``: runs one job attempt, outliving the driver.

The local driver starts one supervisor per attempt, detached (a session of
its own, no pipe to the driver, re-parented to init when the driver dies),
so a driver that is killed or restarted leaves its jobs running. The
supervisor reads the plan from the attempt's ``record.json``, starts every
process in exec form in a session of its own (its pid is the id of a
process group that holds everything it forks), with its own environment
(the driver's, which it inherited) plus the planner's variables plus the
user's; it reads each process's stdout and stderr pipes and appends every
line to the process's log files as ``<unix-nanos> <text>``; it applies the
run mode's success rule, a failure's stop of the others, the time limit and
a TerminateJob's stop (``machine.JobMachine``), kills what a process left
behind in its session when it exits, and writes ``status.json`` (whole) on
every change. A stop request is ``stop.json`` (``attempt.ask_stop``),
noticed on SIGUSR1 and at least every ``STOP_POLL_SECONDS``.

It is a child subreaper (PR_SET_CHILD_SUBREAPER): a descendant that left its
session (setsid, a daemon) comes to it, not to init, once its parent ended.
Such escapees get a stop's SIGTERM and SIGKILL with the rest, and SIGKILL once
the job has ended (nothing of a job outlives it, as in Slurm's cgroup or a
pod); the ended ones are reaped after a SIGCHLD, at most every ``REAP_SECONDS``.

It exits once the job has ended and every pipe is drained, after writing
the last status; ``supervisor.lock`` (handed over locked by the driver) is
released by its exit. If the attempt's directory disappears (the state dir
was removed) it kills the job and exits. SIGTERM (a host shutdown) stops the
job like the time limit does (FAILED, reason ``SupervisorLost``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import json
import logging
import os
import signal
import sys
import time
from collections.abc import Sequence
from typing import TextIO

from drivers.common import planner
from drivers.common import procfs as proctable
from drivers.common.base import LogStream
from drivers.local import attempt, render, states
from drivers.local.logs import LineWriter
from drivers.local.machine import JobMachine

log = logging.getLogger("dlsched.driver.local.supervisor")

#: how often the stop file and the attempt directory are checked without a wake-up
STOP_POLL_SECONDS = 0.2
#: how long pipes may stay open once every process has ended (a descendant that escaped its session)
DRAIN_SECONDS = 5.0
#: how often at most, while the job runs, the supervisor reaps the orphans that came to it and ended
REAP_SECONDS = 2.0
#: passes over /proc that SIGKILL escapees at the end (each kill may orphan another generation)
ESCAPEE_PASSES = 5


class _Pipes(asyncio.SubprocessProtocol):
    """Feeds one process's pipes to its log files and reports its exit at once."""

    def __init__(self, sup: Supervisor, i: int) -> None:
        self._sup, self._i = sup, i
        self._writers: dict[int, LineWriter | None] = {}
        self._transport: asyncio.SubprocessTransport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # Opened only once the process exists, so a failed spawn leaks nothing.
        self._transport = transport  # type: ignore[assignment]
        p = self._sup.plan.processes[self._i]
        for fd, stream in ((1, LogStream.STDOUT), (2, LogStream.STDERR)):
            try:
                self._writers[fd] = LineWriter(p.log_path(stream))
            except OSError as e:
                log.warning("cannot open log %s: %s", p.log_path(stream), e)
                self._writers[fd] = None

    def pipe_data_received(self, fd: int, data: bytes | str) -> None:
        w = self._writers.get(fd)
        if w is None:
            return
        try:
            w.feed(data if isinstance(data, bytes) else data.encode(), time.time_ns())
        except OSError as e:  # disk full, files removed: keep draining the pipe
            log.warning("log write failed: %s", e)
            self._writers[fd] = None

    def pipe_connection_lost(self, fd: int, exc: Exception | None) -> None:
        w = self._writers.pop(fd, None)
        if w is not None:
            with contextlib.suppress(OSError):
                w.close(time.time_ns())
        if fd in (1, 2):
            self._sup.pipe_closed()

    def process_exited(self) -> None:
        rc = self._transport.get_returncode() if self._transport is not None else None
        self._sup.exited(self._i, rc, self._transport.get_pid() if self._transport is not None else None)


class Supervisor:
    """One job attempt's processes, from spawn to the last drained pipe."""

    def __init__(self, adir: str, plan: render.LocalPlan, grace: float) -> None:
        self.adir = adir
        self.plan = plan
        self.grace = grace
        self.machine = JobMachine(plan)
        self.transports: list[asyncio.SubprocessTransport | None] = [None] * len(plan.processes)
        self.open_pipes = 1  # the launch itself holds one until every process is started
        self.kill_handle: asyncio.TimerHandle | None = None
        self.kill_deadline: float | None = None
        self.stop_applied: float | None = None
        self.drained_by: float | None = None
        self.changed = asyncio.Event()
        self.own: set[int] = set()  # the pids of the processes it started
        self.subreaper = False
        self._reap_wanted = False
        self._pids: TextIO | None = None  # ``pids``, open while processes are started
        st = proctable.read_stat(os.getpid())
        self.identity = {"pid": os.getpid(), "start_ticks": st.start_ticks if st is not None else 0}

    # ------------------------------------------------------------------ status

    def write(self) -> None:
        doc = {**self.machine.to_json(), "supervisor": self.identity}
        try:
            attempt.write_json(os.path.join(self.adir, attempt.STATUS), doc)
        except OSError as e:
            log.warning("cannot write the status: %s", e)
        self.changed.set()

    def _settle(self) -> None:
        if self.machine.finish(time.time()) and self.kill_handle is not None:
            self.kill_handle.cancel()
        if self.machine.state.is_terminal() and self.machine.logs_done:
            self._close_transports()
        self.write()

    # ------------------------------------------------------------------ stopping

    def stop_running(self, grace: float) -> None:
        """SIGTERM every running process's session and every escapee; SIGKILL after ``grace``
        (the earliest deadline wins)."""
        running = self.machine.running_pids()
        attempt.signal_sessions(running, signal.SIGTERM)
        self.signal_escapees(signal.SIGTERM, covered=set(running))
        loop = asyncio.get_running_loop()
        deadline = loop.time() + max(0.0, grace)
        if self.kill_deadline is None or deadline < self.kill_deadline:
            if self.kill_handle is not None:
                self.kill_handle.cancel()
            self.kill_deadline = deadline
            self.kill_handle = loop.call_at(deadline, self._kill_running)

    def _kill_running(self) -> None:
        attempt.signal_sessions(self.machine.running_pids(), signal.SIGKILL)
        self.signal_escapees(signal.SIGKILL)

    def signal_escapees(self, sig: int | None, passes: int = 1, covered: set[int] | None = None) -> bool:
        """Signal what the job's processes left behind outside their sessions (a daemon that
        called setsid, whose parent ended: the supervisor is a child subreaper, so it came
        here), each with its group and session; reap the ended ones (``sig`` None: only
        that). Whether one was alive (after ``passes`` passes: a SIGKILLed one's children
        come here next). ``covered``: the replicas just signalled with their groups and sessions;
        an escapee still in one of them has had the signal (a second SIGTERM is "abort now")."""
        if not self.subreaper:
            return False
        live: list[proctable.ProcStat] = []
        for _ in range(max(1, passes)):
            live, dead = proctable.adopted(os.getpid(), self.own)
            if covered:
                live = [st for st in live if st.session not in covered and st.pgrp not in covered]
            for pid in dead:
                with contextlib.suppress(ChildProcessError):
                    os.waitpid(pid, os.WNOHANG)
            if not live or sig is None:
                return bool(live)
            if sig == signal.SIGKILL:
                log.info("killing %d process(es) the job left outside its sessions", len(live))
            leaders = [st.pid for st in live if st.pgrp == st.pid]
            attempt.signal_sessions(leaders, sig)
            for st in live:
                if st.pgrp != st.pid:
                    with contextlib.suppress(ProcessLookupError, PermissionError):
                        os.kill(st.pid, sig)
            if sig != signal.SIGKILL:
                break
        return bool(live)

    def check_stop(self) -> None:
        """Apply a stop the driver asked for (``stop.json``), once per new grace."""
        grace = attempt.read_stop(self.adir)
        if grace is None or grace == self.stop_applied:
            return
        self.stop_applied = grace
        if self.machine.request_stop(grace):
            self.stop_running(grace)
        self.write()

    def time_limit(self) -> None:
        if self.machine.time_limit():
            self.stop_running(self.grace)
            self.write()

    def abandon(self, reason: str, message: str, grace: float) -> None:
        if self.machine.abandon(reason, message):
            self.stop_running(grace)
            self.write()

    # ------------------------------------------------------------------ processes

    async def spawn_all(self) -> None:
        loop = asyncio.get_running_loop()
        base_env = dict(os.environ)
        for i, p in enumerate(self.plan.processes):
            if self.machine.signalled:
                self.machine.skip(i)
                continue
            if p.placeholder:
                self.machine.placeholder_started(i)
                continue
            self.open_pipes += 2  # before the spawn: a pipe may close before it returns
            try:
                transport, _ = await loop.subprocess_exec(
                    functools.partial(_Pipes, self, i), *p.argv,
                    stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
                    stderr=asyncio.subprocess.PIPE, env={**base_env, "PWD": planner.shell_pwd(p.cwd), **p.env}, cwd=p.cwd,
                    start_new_session=True)
            except (OSError, ValueError) as e:
                self.open_pipes -= 2
                if isinstance(e, OSError):
                    code, line = planner.start_failure(e, p.argv[0], p.cwd)
                else:  # (a NUL in an argument: refused before, never a spawn)
                    code, line = 126, f"dlsched: cannot start {p.argv[0]!r}: {e}"
                _say_on_stderr(p.log_path(LogStream.STDERR), line)
                if self.machine.start_failed(i, code, line.removeprefix("dlsched: ")):
                    self.stop_running(self.grace)
                continue
            self.transports[i] = transport
            pid = transport.get_pid()
            self.own.add(pid)
            st = proctable.read_stat(pid)
            ticks = st.start_ticks if st is not None else 0
            self._note_pid(pid, ticks)
            if self.machine.started(i, pid, ticks, time.time()):
                attempt.signal_sessions([pid], signal.SIGTERM)
        self.machine.all_spawned()
        if self._pids is not None:
            with contextlib.suppress(OSError):
                self._pids.close()
            self._pids = None
        if self.plan.time_limit_seconds and not self.machine.state.is_terminal():
            loop.call_later(self.plan.time_limit_seconds, self.time_limit)
        self.pipe_closed()  # the launch's own hold (settles and writes)

    def _note_pid(self, pid: int, ticks: int) -> None:
        """Append the process to ``pids`` before the next starts (read if this supervisor dies)."""
        try:
            if self._pids is None:
                self._pids = open(os.path.join(self.adir, attempt.PIDS), "a", encoding="ascii")  # noqa: SIM115
            self._pids.write(f"{pid} {ticks}\n")
            self._pids.flush()
        except OSError as e:
            log.warning("cannot note pid %d: %s", pid, e)

    def exited(self, i: int, returncode: int | None, pid: int | None = None) -> None:
        # The pid from the transport: the exit may come before spawn_all noted it (started()).
        pid = pid or self.machine.procs[i].pid
        if pid is not None:
            attempt.signal_sessions([pid], signal.SIGKILL)  # whatever it left behind in its session
        if self.machine.exited(i, returncode):
            self.stop_running(self.grace)
        self._settle()

    def pipe_closed(self) -> None:
        self.open_pipes -= 1
        if self.open_pipes <= 0:
            self.machine.logs_done = True
        self._settle()

    def _close_transports(self) -> None:
        # Only once every pipe is drained: closing a transport closes its pipes.
        for i, t in enumerate(self.transports):
            if t is not None and t.get_returncode() is not None:
                t.close()
                self.transports[i] = None

    # ------------------------------------------------------------------ the run

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGUSR1, self.check_stop)
        loop.add_signal_handler(signal.SIGTERM, self.abandon, states.REASON_SUPERVISOR_LOST,
                                "the job's supervisor was told to stop (SIGTERM)", self.grace)
        for sig in (signal.SIGINT, signal.SIGHUP):
            loop.add_signal_handler(sig, lambda: None)
        self.subreaper = proctable.become_subreaper()
        self.write()  # from here on the driver may wake us (the handler is in place)
        self.check_stop()  # a stop asked for before we started
        await self.spawn_all()
        # Orphans that came here are reaped when a child ended (SIGCHLD: asyncio's child watcher
        # waits on its own pids, not on a signal), at most every REAP_SECONDS: no /proc scan else.
        loop.add_signal_handler(signal.SIGCHLD, self._child_ended)
        reap_at = loop.time()
        while not self.machine.ended:
            self.changed.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.changed.wait(), STOP_POLL_SECONDS)
            self.check_stop()
            self._check_files()
            if self.machine.state.is_terminal():
                # The job has ended: nothing of it runs on (its pipes close with them).
                self.signal_escapees(signal.SIGKILL, ESCAPEE_PASSES)
            elif self._reap_wanted and loop.time() >= reap_at:
                self._reap_wanted = False
                self.signal_escapees(None)  # reaps the ended ones
                reap_at = loop.time() + REAP_SECONDS
            self._drain_bound(loop.time())
        self.signal_escapees(signal.SIGKILL, ESCAPEE_PASSES)
        self._close_transports()
        self.write()

    def _child_ended(self) -> None:
        self._reap_wanted = True

    def _check_files(self) -> None:
        """The state dir removed under a running job (a test's temp dir, a wiped host): stop it now."""
        if not os.path.isdir(self.adir):
            self.abandon(states.REASON_FILES_REMOVED, "the attempt's directory was removed", 0.0)

    def _drain_bound(self, now: float) -> None:
        """A job that ended with pipes still open (held by an escaped descendant) stops waiting for them."""
        if not self.machine.state.is_terminal() or self.machine.logs_done:
            return
        if self.drained_by is None:
            self.drained_by = now + DRAIN_SECONDS
        elif now >= self.drained_by:
            self.machine.logs_done = True
            self._settle()


def _say_on_stderr(path: str, text: str) -> None:
    """One line of dlsched's own in a process's stderr log (why it did not start), as the
    other backends show the shell's or the launcher's."""
    try:
        w = LineWriter(path)
        w.feed(text.encode() + b"\n", time.time_ns())
        w.close(time.time_ns())
    except OSError as e:
        log.warning("cannot write %s: %s", path, e)


def _default_signals() -> None:
    """Signals as a freshly started program has them: none blocked, none ignored. What the driver
    was started with (``cmd &`` in a script ignores SIGINT and SIGQUIT; ``nohup`` SIGHUP) would
    reach every job otherwise (exec keeps ignored signals), where other backends give defaults.
    SIGPIPE and SIGXFSZ stay as Python set them here: the spawn restores them in the child."""
    signal.pthread_sigmask(signal.SIG_SETMASK, set())
    for sig in signal.valid_signals():
        if sig in (signal.SIGPIPE, signal.SIGXFSZ, signal.SIGKILL, signal.SIGSTOP):
            continue
        try:
            if signal.getsignal(sig) == signal.SIG_IGN:
                signal.signal(sig, signal.SIG_DFL)
        except (OSError, ValueError):
            continue  # not settable here


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m drivers.local.supervisor", description=__doc__.split("\n")[0])
    ap.add_argument("attempt_dir")
    ap.add_argument("--grace-seconds", type=float, default=10.0)
    ap.add_argument("--lock-fd", type=int, default=-1, help="the locked supervisor.lock, held until exit")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    _default_signals()
    if args.lock_fd >= 0:
        os.set_inheritable(args.lock_fd, False)  # the job's processes never hold it
    rec = attempt.read_json(os.path.join(args.attempt_dir, attempt.RECORD))
    if rec is None:
        log.error("no readable %s in %s", attempt.RECORD, args.attempt_dir)
        return 2
    plan = render.plan_from_json(json.loads(rec["native_spec"]))
    sup = Supervisor(args.attempt_dir, plan, args.grace_seconds)
    asyncio.run(sup.run())
    return 0


if __name__ == "__main__":
    sys.exit(main())
