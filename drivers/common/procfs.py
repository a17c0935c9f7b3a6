"""The process table of this host (/proc): the drivers' supervisors read it to find what a job's
processes left behind (a child subreaper adopts a daemon that left its session) and what they use.

Adapters only; no dlsched state here.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
from dataclasses import dataclass

from dlsched.kit.parse import decimal

CLK_TCK = os.sysconf("SC_CLK_TCK")
PAGE_SIZE = os.sysconf("SC_PAGE_SIZE")


@dataclass(frozen=True)
class ProcStat:
    pid: int
    ppid: int
    state: str  # "R", "S", ... "Z" a zombie
    pgrp: int
    session: int
    cpu_seconds: float  # utime + stime + cutime + cstime
    rss_bytes: int
    start_ticks: int


def parse_stat(pid: int, text: str) -> ProcStat:
    # comm (field 2) is in parentheses and may hold spaces or ")".
    rest = text[text.rindex(")") + 2:].split()
    # rest[0] is field 3 (state); field n is rest[n - 3].
    ticks = sum(int(rest[i - 3]) for i in (14, 15, 16, 17))
    return ProcStat(pid=pid, ppid=int(rest[4 - 3]), state=rest[0], pgrp=int(rest[5 - 3]), session=int(rest[6 - 3]),
                    cpu_seconds=ticks / CLK_TCK, rss_bytes=int(rest[24 - 3]) * PAGE_SIZE,
                    start_ticks=int(rest[22 - 3]))


def read_stat(pid: int) -> ProcStat | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return parse_stat(pid, f.read())
    except (OSError, ValueError, IndexError):
        return None


def all_stats() -> list[ProcStat]:
    out = []
    for name in os.listdir("/proc"):
        if decimal(name) and (st := read_stat(int(name))) is not None:
            out.append(st)
    return out


def session_members(*sessions: int, outside_groups: bool = False) -> list[int]:
    """Pids of every live process in any of ``sessions`` (one pass over /proc):
    also those a program moved to process groups of their own (mpirun puts
    each rank in its own group). ``outside_groups``: only those, not the members
    of the group each session's leader leads (its pgid is the session id)."""
    wanted = set(sessions)
    return [st.pid for st in all_stats() if st.session in wanted
            and not (outside_groups and st.pgrp in wanted)]


def become_subreaper() -> bool:
    """PR_SET_CHILD_SUBREAPER: orphaned descendants come to this process, not init."""
    try:
        return bool(ctypes.CDLL("libc.so.6", use_errno=True).prctl(36, 1, 0, 0, 0) == 0)
    except (OSError, AttributeError):
        return False


def is_subreaper() -> bool:
    """Whether this process is a child subreaper (PR_GET_CHILD_SUBREAPER)."""
    try:
        flag = ctypes.c_int(0)
        return bool(ctypes.CDLL("libc.so.6", use_errno=True).prctl(37, ctypes.byref(flag), 0, 0, 0) == 0
                    and flag.value)
    except (OSError, AttributeError):
        return False


def adopted(parent: int, own: set[int]) -> tuple[list[ProcStat], list[int]]:
    """The children of ``parent`` (a child subreaper) other than the ``own`` it started:
    (live ones, zombies' pids), one pass over /proc. Descendants whose parents ended
    come to the nearest subreaper, a program that escaped its session (setsid) too."""
    live: list[ProcStat] = []
    dead: list[int] = []
    for st in all_stats():
        if st.ppid == parent and st.pid not in own:
            if st.state in ("Z", "X"):
                dead.append(st.pid)
            else:
                live.append(st)
    return live, dead


def kill_adopted(own: set[int], passes: int = 3) -> int:
    """SIGKILL what this child subreaper adopted beyond ``own`` (the processes it started),
    with their process groups and sessions, and reap the ended ones; ``passes`` times, since a
    killed one's children come here next. How many were alive."""
    n = 0
    for _ in range(passes):
        live, dead = adopted(os.getpid(), own)
        for pid in dead:
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, os.WNOHANG)
        if not live:
            break
        n += len(live)
        for st in live:
            for kill, target in ((os.killpg, st.session), (os.killpg, st.pgrp), (os.kill, st.pid)):
                if target > 1:
                    with contextlib.suppress(ProcessLookupError, PermissionError):
                        kill(target, signal.SIGKILL)
        for st in live:
            with contextlib.suppress(ChildProcessError):
                os.waitpid(st.pid, 0)
    return n
