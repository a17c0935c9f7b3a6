"""A real PostgreSQL server in a temp dir, on a free loopback port (Debian's
``postgresql`` package: ``scripts/install-system-deps.sh``).

initdb (trust auth, superuser ``dlsched``) then ``postgres`` on 127.0.0.1;
PostgreSQL refuses to run as root, so under root the cluster runs as the
``postgres`` system user the package creates. ``database()`` makes a fresh
database per test.
"""

from __future__ import annotations

import contextlib
import glob
import os
import pwd
import re
import shutil
import signal
import subprocess
import tempfile
import time
import uuid

from tests.harness import free_port

SUPERUSER = "dlsched"


def find_bin_dir() -> str | None:
    """The newest /usr/lib/postgresql/<ver>/bin that has initdb and postgres."""
    dirs = sorted(glob.glob("/usr/lib/postgresql/*/bin"),
                  key=lambda d: int(d.split("/")[-2]) if d.split("/")[-2].isdigit() else 0)
    for d in reversed(dirs):
        if os.path.exists(os.path.join(d, "initdb")) and os.path.exists(os.path.join(d, "postgres")):
            return d
    initdb = shutil.which("initdb")
    return os.path.dirname(initdb) if initdb else None


class PostgresServer:
    def __init__(self) -> None:
        bin_dir = find_bin_dir()
        if bin_dir is None:
            raise FileNotFoundError("no PostgreSQL server binaries (apt-get install postgresql)")
        self.bin = bin_dir
        self.dir = tempfile.mkdtemp(prefix="dlsched-pg-")
        self.data = os.path.join(self.dir, "data")
        self.port = free_port()
        self.user: str | None = None
        if os.geteuid() == 0:
            try:
                pwd.getpwnam("postgres")
            except KeyError as e:
                raise FileNotFoundError("running as root and no 'postgres' user to run PostgreSQL as") from e
            self.user = "postgres"
            shutil.chown(self.dir, "postgres", "postgres")
            os.chmod(self.dir, 0o700)
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def dsn(self) -> str:
        return self.dsn_for("postgres")

    def dsn_for(self, database: str) -> str:
        return f"postgresql://{SUPERUSER}@127.0.0.1:{self.port}/{database}"

    def start(self) -> PostgresServer:
        subprocess.run([os.path.join(self.bin, "initdb"), "-D", self.data, "-U", SUPERUSER,
                        "--auth=trust", "-E", "UTF8", "--no-sync"], check=True, user=self.user,
                       stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, cwd=self.dir)
        return self.restart()

    def restart(self, *, wait: bool = True, settings: tuple[str, ...] = ()) -> PostgresServer:
        """Run the server on its data directory (again, after it was killed) until it answers
        (``wait``); ``settings``: more ``name=value`` server settings."""
        log = open(os.path.join(self.dir, "postgres.log"), "ab")  # noqa: SIM115 - held by postgres
        extra = [a for s in settings for a in ("-c", s)]
        self.proc = subprocess.Popen(
            [os.path.join(self.bin, "postgres"), "-D", self.data, "-p", str(self.port),
             "-c", "listen_addresses=127.0.0.1", "-c", f"unix_socket_directories={self.dir}",
             "-c", "fsync=off", "-c", "max_connections=200", "-c", "shared_buffers=64MB", *extra],
            stdout=log, stderr=subprocess.STDOUT, user=self.user, cwd=self.dir,
            start_new_session=True)
        if not wait:
            return self
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            r = subprocess.run([os.path.join(self.bin, "pg_isready"), "-h", "127.0.0.1",
                                "-p", str(self.port), "-U", SUPERUSER],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            if r.returncode == 0:
                return self
            if self.proc.poll() is not None:
                raise RuntimeError("postgres exited: " + self.log())
            time.sleep(0.1)
        raise RuntimeError("postgres did not start: " + self.log())

    def standby(self) -> PostgresServer:
        """Restart as a standby that has no primary and takes no connections (``hot_standby``
        off): it answers every connection "the database system is not accepting connections"
        (SQLSTATE 57P03), as a server does while it recovers after a crash, until ``promote()``."""
        self.stop_server()
        signal_file = os.path.join(self.data, "standby.signal")
        open(signal_file, "w").close()
        if self.user:
            shutil.chown(signal_file, self.user, self.user)
        return self.restart(wait=False, settings=("hot_standby=off",))

    def promote(self) -> PostgresServer:
        """End a ``standby()``'s recovery: it takes connections again."""
        subprocess.run([os.path.join(self.bin, "pg_ctl"), "promote", "-D", self.data, "-w", "-t", "60"],
                       check=True, user=self.user, cwd=self.dir, stdout=subprocess.DEVNULL)
        return self

    def stop_server(self) -> None:
        """A fast shutdown; the data directory stays."""
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)

    def signal_all(self, sig: int) -> None:
        """``sig`` to the server and every process it started: each backend runs in a
        session of its own, so no process group holds them all (a SIGSTOP of the
        postmaster alone leaves open connections answering)."""
        assert self.proc is not None
        pids = [self.proc.pid]
        for d in os.listdir("/proc"):
            if not d.isdigit():
                continue
            try:
                with open(f"/proc/{d}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            if ppid == self.proc.pid:
                pids.append(int(d))
        for pid in pids:  # the postmaster first: it starts no backend after
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)

    def log(self) -> str:
        try:
            return open(os.path.join(self.dir, "postgres.log"), errors="replace").read()
        except OSError:
            return ""

    async def database(self, icu_locale: str = "") -> str:
        """A new, empty database; its DSN. ``icu_locale``: its default collation is that ICU
        locale's (e.g. ``und-u-ka-shifted``, where punctuation is ignored at the first level,
        as en_US.UTF-8 does), not the server's C.UTF-8."""
        import asyncpg  # type: ignore[import-untyped]

        name = f"t_{uuid.uuid4().hex[:12]}"
        conn = await asyncpg.connect(self.dsn)
        try:
            if icu_locale:
                assert re.fullmatch(r"[A-Za-z0-9-]+", icu_locale), icu_locale
                await conn.execute(f"CREATE DATABASE \"{name}\" TEMPLATE template0 LOCALE_PROVIDER icu "
                                   f"ICU_LOCALE '{icu_locale}'")
            else:
                await conn.execute(f'CREATE DATABASE "{name}"')
        finally:
            await conn.close()
        return self.dsn_for(name)

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()  # smart shutdown
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        shutil.rmtree(self.dir, ignore_errors=True)
