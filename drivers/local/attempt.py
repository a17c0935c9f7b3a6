"""An attempt's directory: the files the driver and the job's supervisor share.

Adapter only (files, locks, signals); the state lives in ``machine.py``.

- ``record.json`` (the driver, at launch): cluster, job id, attempt, the
  plan (``native_spec``) and what the job asked for;
- ``status.json`` (the supervisor, on every change; the driver only for a
  job whose supervisor is gone): ``JobMachine.to_json()`` plus the
  supervisor's pid and start time;
- ``pids`` (the supervisor, appended as it starts each process): ``<pid>
  <start ticks>`` lines, so a supervisor killed while it starts a large job
  leaves every process it started findable (``status.json`` is written once
  the spawning is done);
- ``stop.json`` (the driver): a TerminateJob's grace; the supervisor reads
  it when woken by SIGUSR1 and at least every ``STOP_POLL_SECONDS``;
- ``supervisor.lock``: held (``flock``) for exactly the supervisor's life.
  The driver locks it BEFORE starting the supervisor and hands the locked
  descriptor over (``pass_fds``), so at no moment does a job run with the
  lock free: a free lock means no supervisor runs, whatever the pids say.

Every JSON file is written whole (a temp file renamed over it), so a reader
never sees half of one.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import pathlib
import signal
import subprocess
import sys
from collections.abc import Iterable, Mapping
from typing import Any

from drivers.common import procfs as proctable

RECORD = "record.json"
STATUS = "status.json"
STOP = "stop.json"
PIDS = "pids"
LOCK = "supervisor.lock"
SUPERVISOR_LOG = "supervisor.log"
#: written when JobManager has recorded the attempt's end (ForgetJobs): the driver
#: no longer holds the job in memory, nor loads it on start; holds the usage peaks
RECORDED = "recorded.json"
#: the most bytes ``read_json`` reads of a record: its plan is at most ``spec_rules.MAX_EXPANDED_BYTES``
#: (16 MiB) of argv, env and paths, JSON-escaped twice (the plan is a string in the record)
RECORD_LIMIT = 64 << 20
#: the most bytes of a status (``JobMachine.to_json``: a few hundred per process, at most
#: ``render.MAX_PROCESSES`` of them) or of the other files the driver reads
STATUS_LIMIT = 4 << 20
#: the folder ``python -m drivers.local.supervisor`` runs in (where ``drivers`` is importable)
_ROOT = str(pathlib.Path(__file__).resolve().parent.parent.parent)


def write_json(path: str, doc: Mapping[str, Any]) -> None:
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump(doc, f)
    os.replace(tmp, path)


def read_json(path: str, limit: int = RECORD_LIMIT) -> dict[str, Any] | None:
    """The file's document; None when it is missing or unreadable: over ``limit`` bytes, not
    JSON, or nested too deep to parse. The job's default working directory is its attempt
    directory, so a job can write over these files: what they say is checked by the reader
    (``JobMachine.from_json``), what they weigh here."""
    try:
        with open(path, "rb") as f:
            data = f.read(limit + 1)
        if len(data) > limit:
            return None
        doc = json.loads(data)
    except (OSError, ValueError, RecursionError):
        return None
    return doc if isinstance(doc, dict) else None


def signature(path: str) -> tuple[int, int, int] | None:
    """Changes whenever the file is replaced (inode, size, mtime)."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_ino, st.st_size, st.st_mtime_ns


def supervisor_alive(adir: str) -> bool:
    """Whether the attempt's supervisor runs: it holds the lock for its whole life."""
    try:
        fd = os.open(os.path.join(adir, LOCK), os.O_RDONLY)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    except OSError:
        return False
    finally:
        os.close(fd)  # also releases the lock taken just now
    return False


def start_supervisor(adir: str, *, grace: float, env: Mapping[str, str]) -> subprocess.Popen[bytes]:
    """``python -m drivers.local.supervisor ADIR``, detached: a session of its own, no pipe to the driver.

    It inherits the locked ``supervisor.lock`` (its lock from then on) and
    ``env`` (the environment its processes start from).
    """
    fd = os.open(os.path.join(adir, LOCK), os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        with open(os.path.join(adir, SUPERVISOR_LOG), "ab") as out:
            return subprocess.Popen(
                [sys.executable, "-m", "drivers.local.supervisor", adir, "--grace-seconds", str(grace),
                 "--lock-fd", str(fd)],
                stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, env=dict(env), cwd=_ROOT,
                pass_fds=(fd,), start_new_session=True)
    finally:
        os.close(fd)  # the supervisor's copy keeps the lock


def ask_stop(adir: str, grace: float) -> None:
    write_json(os.path.join(adir, STOP), {"grace_seconds": grace})


def read_stop(adir: str) -> float | None:
    doc = read_json(os.path.join(adir, STOP), STATUS_LIMIT)
    if doc is None:
        return None
    try:
        return max(0.0, float(doc["grace_seconds"]))
    except (KeyError, TypeError, ValueError):
        return None


def supervisor_of(status: Mapping[str, Any] | None) -> tuple[int, int] | None:
    """The (pid, start ticks) of the supervisor its status names; None when it names none or
    not as integers (a job can write over the file)."""
    sup = (status or {}).get("supervisor")
    if not isinstance(sup, dict):
        return None
    pid, ticks = sup.get("pid"), sup.get("start_ticks")
    if type(pid) is not int or type(ticks) is not int or not 0 < pid < 1 << 31 or not 0 < ticks < 1 << 63:
        return None
    return pid, ticks


def wake_supervisor(supervisor: tuple[int, int] | None) -> None:
    """SIGUSR1 to the supervisor (pid, start ticks), only when its start time still matches."""
    if supervisor is None:
        return  # no status yet: it reads the stop file once it has installed its handler
    pid, ticks = supervisor
    st = proctable.read_stat(pid)
    if st is not None and st.start_ticks == ticks:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGUSR1)


def kill_supervisor(supervisor: tuple[int, int] | None) -> None:
    """SIGKILL the supervisor (pid, start ticks), only when its start time still matches."""
    if supervisor is None:
        return
    pid, ticks = supervisor
    st = proctable.read_stat(pid)
    if st is not None and st.start_ticks == ticks:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)


def signal_sessions(leaders: Iterable[int], sig: int) -> None:
    """Signal replicas: each one's process group, and every other process of
    the session it leads. Each replica starts a session of its own, and a
    process that leaves the group (mpirun puts every rank in a group of its
    own) stays in the session, so a stop or an exit leaves no orphan running.
    One pass over /proc for all of them; each process gets the signal once (a
    second SIGTERM is "abort now" to many trainers)."""
    leaders = list(leaders)
    if not leaders:
        return
    for pgid in leaders:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, sig)
    for pid in proctable.session_members(*leaders, outside_groups=sig != signal.SIGKILL):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, sig)


def started_pids(adir: str, most: int) -> list[tuple[int | None, int]]:
    """The (pid, start ticks) the supervisor noted in ``pids`` as it started them (at most
    ``most``: the plan's processes; a line that is no such pair is skipped)."""
    out: list[tuple[int | None, int]] = []
    try:
        with open(os.path.join(adir, PIDS), "rb") as f:
            for line in f.read(most * 48).splitlines()[:most]:
                parts = line.split()
                if len(parts) == 2 and parts[0].isdigit() and parts[1].isdigit():
                    out.append((int(parts[0]), int(parts[1])))
    except OSError:
        pass
    return out


def kill_leftovers(procs: Iterable[tuple[int | None, int]]) -> None:
    """SIGKILL what is left of (pid, start ticks) replicas, checking each is still that process."""
    alive = [pid for pid, ticks in procs
             if pid and ticks and (st := proctable.read_stat(pid)) is not None
             and st.start_ticks == ticks and st.pgrp == pid]
    signal_sessions(alive, signal.SIGKILL)
