"""One persistent asyncssh connection per cluster, with pinned host keys.

(``adapter.SlurmClient`` opens a second ``SshClient`` per cluster for log
followers' long-lived streams, on first use, so that they never take the
channels that polls, submits and stops need.)

``SshClient.run(command, input=...)`` runs one command on the login node in a
channel of the cluster's single connection. The connection opens on first
use and reopens after it dies, with exponential backoff between failed
attempts (``Unavailable``, reason ``BACKEND_UNAVAILABLE``, while backing
off); keepalives find a dead peer.

Sessions (sshd's ``MaxSessions``, 10 per connection, counts every session
whose command has not ended, whatever the client did with its channel): a
semaphore bounds the commands of the bound (default 8), and a command holds
its slot until sshd has ended its session, not merely until the driver gave
up on it. Every command first prints its process group on stderr
(``PGID_MARK``; sshd makes each session's shell a session and group leader;
the line is taken off the stderr callers see). A command that times out (or
whose caller leaves) is handed to a reaper that keeps its slot, kills the
remote process group (``kill -KILL -- -PGID``) over one reserved channel
(so the bound plus the reserve, 9, stays below ``MaxSessions``), and frees
the slot only once the server has closed that command's channel (the kill
is retried meanwhile; a lost connection ends every session at once). A
session sshd refuses (``ChannelOpenError``: nothing ran) never touches the
shared connection or the commands in flight: the channel is tried again,
backing off, for up to the command's time limit; waiting for a slot is
bounded by it too (each step on its own: a command that got its session has
its whole time limit to run). A command that times out, or finds no slot or
no session within its limit, raises ``Congested`` (still reason
``BACKEND_UNAVAILABLE``): the connection is up but the login node is slow;
the driver reports such a cluster DEGRADED, not UNREACHABLE.

Host keys: only the keys pinned in the credentials (``known_host_keys``, in
known_hosts or authorized_keys line form) are trusted; none pinned, or a
server key that is not among them, is FAILED_PRECONDITION reason
``HOST_KEY_MISMATCH``. There is no trust on first use.

Commands are strings run by the login shell; every caller quotes what it
puts in them (``shlex.quote``). ``env`` (from the cluster's upper-case
options, e.g. ``SLURM_CONF``) is exported before each command, plus
``TZ=UTC`` so Slurm prints times in UTC.

Metrics: every command counts once in ``dlsched_backend_calls_total``
with ``backend="slurm"``, a bounded ``call`` name (``call_name``: the first
Slurm or file tool the command line names, e.g. ``squeue``, ``sbatch``;
callers may name it, e.g. ``tail`` for log reads; never an id or argument)
and ``outcome`` error when the transport failed or the exit was non-zero.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import shlex
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import asyncssh

from dlsched.errors import FailedPrecondition, InvalidArgument
from dlsched.kit import metrics
from dlsched.kit.parse import decimal
from drivers.common.registry import BackendUnavailable

log = logging.getLogger("dlsched.driver.slurm.ssh")

MAX_CHANNELS = 8
#: Channels reserved beside the bound for killing timed-out commands' process groups.
KILL_CHANNELS = 1
#: The first stderr line of every command: its process group id (taken off what callers see).
PGID_MARK = b"dlsched-pgid "
_PGID_LINE = "printf 'dlsched-pgid %s\\n' \"$$\" >&2; "
_PGID_RE = re.compile(rb"^dlsched-pgid (\d+)\n", re.M)
#: Seconds one kill command may take, and the reaper's waits between kills (backing off).
KILL_TIME_LIMIT = 10.0
REAP_WAIT_MIN, REAP_WAIT_MAX = 1.0, 30.0
#: Seconds a command given up (``Started.close``) has to end by itself before it is killed.
CLOSE_GRACE = 2.0
#: First and longest pause between tries to open a channel sshd refused.
OPEN_BACKOFF_MIN, OPEN_BACKOFF_MAX = 0.05, 1.0
#: The only values the ``call`` label of the backend-call counter takes (plus ``other``).
CALL_NAMES = frozenset({"squeue", "scontrol", "sbatch", "scancel", "sstat", "sinfo", "sacct", "tail", "cat",
                        "rm", "mkdir", "true"})


def call_name(command: str) -> str:
    """The metrics name of a shell line: the commands it runs are the first word of
    each ``;``/``&&``/``|`` segment (``exec`` skipped; quoted arguments are never one);
    a Slurm tool among them wins (``mkdir -p d && exec sbatch`` is ``sbatch``), then
    any known one, else ``other``."""
    try:
        lex = shlex.shlex(command, posix=True, punctuation_chars=True)
        tokens = list(lex)
    except ValueError:
        return "other"
    heads, start = [], True
    for t in tokens:
        if t and all(ch in ";&|()" for ch in t):
            start = True
        elif start and t != "exec":
            heads.append(t)
            start = False
    slurm = next((h for h in heads if h.startswith("s") and h in CALL_NAMES), None)
    return slurm or next((h for h in heads if h in CALL_NAMES), "other")
ENV_RE = re.compile(r"^[A-Z_][A-Z0-9_]*\Z")


class HostKeyMismatch(FailedPrecondition):
    reason = "HOST_KEY_MISMATCH"


class Congested(BackendUnavailable):
    """The connection is up, but a command timed out or found no slot or session in time
    (same reason as any ``BackendUnavailable``: callers retry; the driver says DEGRADED)."""


@dataclass(frozen=True)
class Result:
    exit_status: int
    stdout: str
    stderr: str


@dataclass(frozen=True)
class BytesResult:
    exit_status: int
    stdout: bytes
    stderr: bytes


def _completed(r: asyncssh.SSHCompletedProcess) -> BytesResult:
    """A finished command as a ``BytesResult``. A channel that closed with neither an
    exit status nor a signal (the connection or sshd went away under it) says nothing
    about the command: that is a transport failure, not an exit code to read."""
    out = r.stdout if isinstance(r.stdout, bytes) else (r.stdout or "").encode()
    err = _strip_mark(r.stderr if isinstance(r.stderr, bytes) else (r.stderr or "").encode())
    if r.exit_status is None and not r.exit_signal:
        raise BackendUnavailable("the channel closed before the command reported an exit status")
    status = r.exit_status if r.exit_status is not None else 128 + 9
    return BytesResult(status, out, err)


def _strip_mark(err: bytes) -> bytes:
    """``err`` without the process-group line the command printed (first, after anything the
    login shell itself printed)."""
    m = _PGID_RE.search(err) if PGID_MARK in err else None
    return err[:m.start()] + err[m.end():] if m else err


def _pgid(err: object) -> int | None:
    """The process group a command printed on stderr, if it got that far."""
    m = _PGID_RE.search(err) if isinstance(err, bytes) else None
    return int(m.group(1)) if m else None


def parse_host_keys(lines: Sequence[str]) -> list[asyncssh.SSHKey]:
    """Pinned keys from known_hosts (``host key-type base64``) or bare public-key lines."""
    keys = []
    for i, line in enumerate(lines):
        text = line.strip()
        if not text or text.startswith("#"):
            continue
        parts = text.split()
        if parts[0].startswith("@"):
            raise InvalidArgument.for_field(f"credentials.ssh.known_host_keys[{i}]",
                                            "markers (@cert-authority, @revoked) are not supported")
        if not _looks_like_key_type(parts[0]) and len(parts) >= 3:
            parts = parts[1:]  # known_hosts: drop the host pattern
        try:
            keys.append(asyncssh.import_public_key(" ".join(parts[:2])))
        except (asyncssh.KeyImportError, ValueError) as e:
            raise InvalidArgument.for_field(f"credentials.ssh.known_host_keys[{i}]",
                                            "not a public key line") from e
    return keys


def _looks_like_key_type(s: str) -> bool:
    return s.startswith(("ssh-", "ecdsa-", "sk-", "rsa-sha2-"))


def parse_address(address: str) -> tuple[str, int]:
    host, sep, port = address.rpartition(":")
    if not sep or not host:
        return address, 22
    if not decimal(port) or not 0 < int(port) < 65536:
        raise InvalidArgument.for_field("address", "must be host[:port]")
    return host.strip("[]"), int(port)


class Started:
    """A remote command already running and waiting for its stdin (``SshClient.start``).
    ``finish`` (once) or ``close`` ends it; either counts it once. Its slot of the bound is
    freed when its session has ended (see the module docstring)."""

    def __init__(self, client: SshClient, conn: asyncssh.SSHClientConnection,
                 proc: asyncssh.SSHClientProcess[bytes], call: str) -> None:
        self._client = client
        self._conn = conn
        self._proc = proc
        self._call = call
        self._done = False
        self.started = time.monotonic()

    def alive(self) -> bool:
        """Still waiting: the process has not exited and its channel is open."""
        return not self._done and self._proc.exit_status is None and not self._proc.is_closing()

    def _end(self, ok: bool, grace: float | None = None, err: object = None) -> None:
        """Count it once and free its slot: now (it ended), or through the reaper once its
        session has ended (``grace``: seconds it has to end by itself before the kill;
        ``err``: its stderr already taken)."""
        if not self._done:
            self._done = True
            if grace is None:
                self._client._sem.release()
            else:
                self._client._reap(self._conn, self._proc, grace,
                                   err if isinstance(err, bytes) else self._proc.collect_output()[1])
            metrics.backend_call("slurm", self._call, ok)

    async def finish(self, input: bytes, time_limit: float) -> BytesResult:
        """Send ``input``, close stdin, wait for the exit; transport failures raise
        (ambiguous: the input may have been read)."""
        if self._done:
            raise BackendUnavailable("the started command was already used")
        ok, grace, err = False, None, None
        try:
            self._proc.stdin.write(input)
            self._proc.stdin.write_eof()
            r = await self._proc.wait(check=False, timeout=time_limit)
        except asyncssh.TimeoutError as e:
            grace, err = 0.0, e.stderr
            raise self._client._congested(f"command timed out after {time_limit:g}s") from e
        except (OSError, asyncssh.Error) as e:
            self._proc.close()
            raise self._client._as_error(e) from e
        except BaseException:
            grace = 0.0
            raise
        else:
            result = _completed(r)
            ok = result.exit_status == 0
            return result
        finally:
            self._end(ok, grace, err)

    async def readline(self) -> bytes:
        """One line of its stdout (b"" at its end); transport failures raise."""
        try:
            return await self._proc.stdout.readline()
        except (OSError, asyncssh.Error) as e:
            raise self._client._as_error(e) from e

    async def readexactly(self, n: int) -> bytes:
        try:
            return await self._proc.stdout.readexactly(n)
        except asyncio.IncompleteReadError as e:
            raise BackendUnavailable("the remote command ended mid-frame") from e
        except (OSError, asyncssh.Error) as e:
            raise self._client._as_error(e) from e

    def end_input(self) -> None:
        """Close its stdin (the command reads end of input)."""
        if self.alive():
            self._proc.stdin.write_eof()

    def close(self) -> None:
        """Give it up: its stdin ends (sbatch: "Batch script is empty", no job; a log
        stream drains and ends); killed if it has not ended within ``CLOSE_GRACE``."""
        if not self._done:
            with contextlib.suppress(OSError, asyncssh.Error):
                if not self._proc.is_closing():
                    self._proc.stdin.write_eof()
            self._end(False, CLOSE_GRACE)


class SshClient:
    def __init__(self, address: str, username: str, private_key: str, known_host_keys: Sequence[str], *,
                 env: Mapping[str, str] | None = None, max_channels: int = MAX_CHANNELS,
                 connect_timeout: float = 10.0, keepalive: float = 10.0,
                 backoff_max: float = 30.0) -> None:
        self.host, self.port = parse_address(address)
        if not username:
            raise InvalidArgument.for_field("credentials.ssh.username", "required")
        self.username = username
        self._keys = parse_host_keys(known_host_keys)
        try:
            self._client_key = asyncssh.import_private_key(private_key) if private_key else None
        except (asyncssh.KeyImportError, ValueError) as e:
            raise InvalidArgument.for_field("credentials.ssh.private_key", "not a private key") from e
        for k in env or {}:
            if not ENV_RE.match(k):
                raise InvalidArgument.for_field(f"options[{k}]", "environment names must be upper case")
        prefix = ["export TZ=UTC"] + [f"export {k}={shlex.quote(v)}" for k, v in sorted((env or {}).items())]
        self._prefix = "; ".join(prefix) + "; "
        self._sem = asyncio.Semaphore(max_channels)
        self._kill_sem = asyncio.Semaphore(KILL_CHANNELS)
        self._reapers: set[asyncio.Task[None]] = set()
        #: when (monotonic) a command last timed out or found no slot/session in time
        self.last_congestion: float | None = None
        self._lock = asyncio.Lock()
        self._conn: asyncssh.SSHClientConnection | None = None
        self._connect_timeout = connect_timeout
        self._keepalive = keepalive
        self._backoff = 0.0
        self._backoff_max = backoff_max
        self._next_try = 0.0
        self._last_error: Exception | None = None
        self._closed = False
        self.commands = 0  # commands issued, for tests and benchmarks
        self.sessions_refused = 0  # sessions sshd refused (asked for again), for tests

    async def _connection(self) -> asyncssh.SSHClientConnection:
        conn = self._conn
        if conn is not None and not conn.is_closed():
            return conn
        async with self._lock:
            if self._conn is not None and not self._conn.is_closed():
                return self._conn
            if self._closed:
                raise BackendUnavailable("the SSH client is closed")
            if not self._keys:
                raise HostKeyMismatch("no host key is pinned for this cluster; refusing to trust on first use",
                                      metadata={"host": self.host})
            now = time.monotonic()
            if now < self._next_try and self._last_error is not None:
                raise self._as_error(self._last_error)
            try:
                self._conn = await asyncio.wait_for(asyncssh.connect(
                    self.host, self.port, username=self.username,
                    client_keys=[self._client_key] if self._client_key is not None else None,
                    known_hosts=(self._keys, [], []), agent_path=None, config=[],
                    keepalive_interval=self._keepalive, keepalive_count_max=3,
                    login_timeout=self._connect_timeout, connect_timeout=self._connect_timeout,
                ), timeout=self._connect_timeout + 5)
            except (OSError, asyncssh.Error, TimeoutError) as e:
                self._backoff = min(self._backoff_max, max(0.5, self._backoff * 2))
                self._next_try = time.monotonic() + self._backoff
                self._last_error = e
                raise self._as_error(e) from e
            self._backoff, self._last_error = 0.0, None
            log.info("connected to %s:%d as %s", self.host, self.port, self.username)
            return self._conn

    def _as_error(self, e: Exception) -> Exception:
        if isinstance(e, asyncssh.HostKeyNotVerifiable):
            return HostKeyMismatch(f"the host key of {self.host}:{self.port} is not the pinned one",
                                   metadata={"host": self.host})
        return BackendUnavailable(f"cannot reach {self.host}:{self.port} over SSH: {type(e).__name__}: {e}")

    async def run(self, command: str, *, input: str | None = None, time_limit: float = 30.0,
                  call: str | None = None) -> Result:
        """Run ``command``; a non-zero exit is a ``Result``, transport failures raise.
        Output is decoded as UTF-8 with undecodable bytes replaced. ``call`` names it in
        the metrics (default ``call_name(command)``)."""
        r = await self._run(command, input.encode() if input is not None else None, time_limit, call)
        return Result(r.exit_status, r.stdout.decode("utf-8", "replace"), r.stderr.decode("utf-8", "replace"))

    async def run_bytes(self, command: str, *, time_limit: float = 30.0,
                        call: str | None = None) -> BytesResult:
        """``run`` with the output as raw bytes (log files)."""
        return await self._run(command, None, time_limit, call)

    async def _run(self, command: str, input: bytes | None, time_limit: float,
                   call: str | None = None) -> BytesResult:
        name = call if call in CALL_NAMES else call_name(command)
        ok = False
        try:
            r = await self._run_counted(command, input, time_limit)
            ok = r.exit_status == 0
            return r
        finally:
            metrics.backend_call("slurm", name, ok)

    async def _run_counted(self, command: str, input: bytes | None, time_limit: float) -> BytesResult:
        conn = await self._connection()
        await self._acquire(time.monotonic() + time_limit)
        proc: asyncssh.SSHClientProcess[bytes] | None = None
        held = True  # this call still owns its slot (else the reaper does)
        try:
            proc = await self._open(conn, command, time.monotonic() + time_limit)
            self.commands += 1
            if input is not None:
                proc.stdin.write(input)
            proc.stdin.write_eof()
            r = await proc.wait(check=False, timeout=time_limit)
        except asyncssh.TimeoutError as e:
            assert proc is not None
            held = False
            self._reap(conn, proc, 0.0, e.stderr)  # the slot stays taken until the command has ended
            raise self._congested(f"command timed out after {time_limit:g}s") from e
        except Congested:
            raise
        except (OSError, asyncssh.Error) as e:
            self._lost(conn)
            raise self._as_error(e) from e
        except BaseException:  # the caller left (cancelled): end what it started
            if proc is not None:
                held = False
                self._reap(conn, proc, 0.0, proc.collect_output()[1])
            raise
        finally:
            if held:
                self._sem.release()
        return _completed(r)

    def _congested(self, message: str) -> Congested:
        self.last_congestion = time.monotonic()
        return Congested(message)

    def _lost(self, conn: asyncssh.SSHClientConnection) -> None:
        """The connection failed under a command: forget it (the next command reconnects)."""
        if self._conn is conn:
            self._conn = None
        conn.abort()

    async def _acquire(self, deadline: float) -> None:
        """A slot of the bound, waiting at most until ``deadline``."""
        try:
            async with asyncio.timeout(max(0.0, deadline - time.monotonic())):
                await self._sem.acquire()
        except TimeoutError:
            raise self._congested("every SSH channel of the bound stayed busy") from None

    async def _open(self, conn: asyncssh.SSHClientConnection, command: str,
                    deadline: float) -> asyncssh.SSHClientProcess[bytes]:
        """A session running ``command``; a session sshd refuses (nothing ran; the connection is
        fine) is asked for again, backing off, until ``deadline``."""
        pause = OPEN_BACKOFF_MIN
        while True:
            try:
                return await conn.create_process(_PGID_LINE + self._prefix + command, encoding=None)
            except asyncssh.ChannelOpenError as e:
                if conn.is_closed():
                    raise  # "SSH connection closed": the caller's connection handling
                self.sessions_refused += 1
                if time.monotonic() + pause > deadline:
                    raise self._congested(f"sshd refused a session until the time limit: {e.reason}") from e
                await asyncio.sleep(pause)
                pause = min(OPEN_BACKOFF_MAX, pause * 2)

    def _reap(self, conn: asyncssh.SSHClientConnection, proc: asyncssh.SSHClientProcess[bytes],
              grace: float, err: object = None) -> None:
        """Take over a command's slot until its session has ended, killing its process group
        after ``grace`` seconds (``err``: stderr already taken from it, holding its group)."""
        task = asyncio.create_task(self._reaper(conn, proc, grace, err if isinstance(err, bytes) else b""),
                                   name=f"ssh-reap-{self.host}")
        self._reapers.add(task)
        task.add_done_callback(self._reapers.discard)

    async def _reaper(self, conn: asyncssh.SSHClientConnection, proc: asyncssh.SSHClientProcess[bytes],
                      grace: float, err: bytes) -> None:
        wait = grace
        try:
            while True:
                try:
                    await asyncio.wait_for(proc.wait_closed(), wait)
                    return  # the server closed the session's channel: the session is gone
                except TimeoutError:
                    pass
                if conn.is_closed():
                    return  # the connection, and with it every session, is gone
                # An exit status alone is not the end: sshd counts the session until every
                # process holding its output has ended and the channel is closed.
                err += proc.collect_output()[1]
                if (pgid := _pgid(err)) is not None:
                    await self._kill(conn, pgid)
                wait = max(REAP_WAIT_MIN, min(REAP_WAIT_MAX, wait * 2))
        except (OSError, asyncssh.Error):
            return
        finally:
            proc.close()
            self._sem.release()

    async def _kill(self, conn: asyncssh.SSHClientConnection, pgid: int) -> None:
        """``kill -KILL`` a command's process group over the reserved channel (best effort)."""
        async with self._kill_sem:
            try:
                r = await asyncio.wait_for(conn.run(
                    f"kill -KILL -- -{pgid} 2>/dev/null || kill -KILL {pgid} 2>/dev/null; true",
                    check=False, encoding=None), KILL_TIME_LIMIT)
                log.info("killed the process group %d of a timed-out command on %s (exit %s)",
                         pgid, self.host, r.exit_status)
            except (OSError, asyncssh.Error, TimeoutError) as e:
                log.warning("killing the process group %d on %s: %s", pgid, self.host, e)

    def channel_free(self) -> bool:
        """Whether a channel of the bound is free right now."""
        return not self._sem.locked()

    def connected(self) -> bool:
        """Whether the connection is open now (no command is issued to tell)."""
        return self._conn is not None and not self._conn.is_closed()

    async def start(self, command: str, *, call: str | None = None, wait: bool = True,
                    time_limit: float = 30.0) -> Started:
        """Start ``command`` now and hand it its stdin later (``Started.finish``): the
        channel, the remote shell and the exec are paid before the input exists. It holds
        one channel of the bound until it ends or is closed. ``wait=False``: when no
        channel is free, ``BackendUnavailable`` at once instead of waiting for one."""
        name = call if call in CALL_NAMES else call_name(command)
        conn = await self._connection()
        if not wait and self._sem.locked():
            raise BackendUnavailable("every channel of the bound is in use")
        deadline = time.monotonic() + time_limit
        await self._acquire(deadline)
        try:
            proc = await self._open(conn, command, deadline)
        except Congested:
            self._sem.release()
            metrics.backend_call("slurm", name, False)
            raise
        except (OSError, asyncssh.Error) as e:
            self._sem.release()
            self._lost(conn)
            metrics.backend_call("slurm", name, False)
            raise self._as_error(e) from e
        except BaseException:
            self._sem.release()
            raise
        self.commands += 1
        return Started(self, conn, proc, name)

    def drop(self) -> None:
        """Forget the connection (tests: simulate a dead one)."""
        if self._conn is not None:
            self._conn.abort()
            self._conn = None

    async def close(self) -> None:
        self._closed = True
        for task in list(self._reapers):
            task.cancel()
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.close()
            try:
                await asyncio.wait_for(conn.wait_closed(), 5)
            except (TimeoutError, OSError, asyncssh.Error):
                pass
