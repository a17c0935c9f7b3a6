"""``dlsched up``: the whole local stack in the foreground.

Secure by default. On the first run it makes, under ``DATA`` (dirs 0700,
secret files 0600), and reuses afterwards: a private CA and one service
certificate (``DATA/tls/``: CN job-manager, DNS SANs cluster-manager and
localhost, IP 127.0.0.1; reissued when it nears its end or lacks a name),
the bootstrap admin token ``DATA/admin.token``, the control plane's token
``DATA/control-plane.token`` and the credentials key
``DATA/encryption-key.json``.

Starts, as child processes each in its own process group with its log in
``DATA/logs/``: etcd on loopback (data in ``DATA/etcd``), ClusterManager on
PORT+1, the local driver (state in ``DATA/local``, mutual TLS, on a free
loopback port) and JobManager on PORT, all serving TLS with that certificate
and authenticating callers; waits for each one's port file, registers cluster
``local`` with the admin token (or points the existing one at this run's
driver), saves a context ``local`` (server, cluster manager, CA, admin token
file) in the user's config (``dlsched.profile``; current when none is), so
the CLI on this machine needs no flags, prints one ready line and writes
``DATA/ready.json``. SIGINT or SIGTERM stops the children in reverse order
(SIGTERM to the group, a grace period, then SIGKILL) and exits 0. A child that
dies on its own is started again, with the same arguments and address (every
service recovers its state: etcd's data, the driver's jobs, JobManager's
clusters), at most ``RESTARTS`` times in ``RESTART_WINDOW_S``; past that the
stack stops and exits 1. The children die with ``dlsched up`` (each gets
SIGTERM when it dies, even by SIGKILL: PR_SET_PDEATHSIG), so a killed ``up``
leaves no service holding its ports and data for the next one; the local
jobs' supervisors are not its children and run on, re-adopted by the next.

The services run as ``python -m <package>`` processes; this module never
imports them (an import-linter contract forbids it).
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import datetime
import fcntl
import ipaddress
import json
import os
import pathlib
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from dlsched import errors
from dlsched.auth.tokens import random_token, write_token_file
from dlsched.kit import pki
from dlsched.kit.envelope import generate_key_file
from dlsched.kit.etcd import find_etcd_binary

READY_PREFIX = "dlsched is up:"
#: a child that died is started again at most this many times in this many seconds
RESTARTS = 5
RESTART_WINDOW_S = 300.0
STOP_GRACE_S = 10.0
CONTEXT = "local"
SERVICE_IDENTITY = "job-manager"  # drivers accept it (--allowed-clients' default)
CERT_RENEW_BEFORE = datetime.timedelta(days=30)
# Settings from the caller's shell that would turn security off in the children.
_UNSAFE_ENV = ("DLSCHED_INSECURE", "DLSCHED_NO_AUTH")


class StackError(errors.FailedPrecondition):
    reason = "STACK_START_FAILED"


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def port_is_free(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def _source_root() -> pathlib.Path | None:
    """The checkout holding the service packages, when dlsched runs from one."""
    root = pathlib.Path(__file__).resolve().parent.parent
    return root if (root / "job_manager").is_dir() else None


@dataclass
class Child:
    """One supervised process."""

    name: str
    argv: list[str]
    log_path: pathlib.Path
    port_file: pathlib.Path | None = None
    env: dict[str, str] = field(default_factory=dict)
    proc: subprocess.Popen[bytes] | None = None
    address: str = ""
    starts: list[float] = field(default_factory=list)  #: when it was started again (monotonic)

    def may_restart(self) -> bool:
        now = time.monotonic()
        return sum(1 for t in self.starts if now - t < RESTART_WINDOW_S) < RESTARTS

    def start(self) -> None:
        if self.port_file is not None:
            with contextlib.suppress(FileNotFoundError):
                self.port_file.unlink()
        with open(self.log_path, "ab") as log:
            log.write(f"\n==== {time.strftime('%Y-%m-%d %H:%M:%S')} {' '.join(self.argv)}\n"
                      .encode())
            log.flush()
            env = {k: v for k, v in os.environ.items() if k not in _UNSAFE_ENV}
            self.proc = subprocess.Popen(
                self.argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                env={**env, **self.env}, start_new_session=True, preexec_fn=_die_with(os.getpid()))

    def restart(self) -> None:
        """Start again, on the address it had (a listener on port 0: the port it got)."""
        if self.address and "--listen" in self.argv:
            i = self.argv.index("--listen") + 1
            if self.argv[i].endswith(":0"):
                self.argv[i] = self.address
        self.starts.append(time.monotonic())
        self.start()

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log_tail(self, n: int = 20) -> str:
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return ""
        return "\n".join(lines[-n:])

    async def wait_port_file(self, within: float) -> str:
        assert self.port_file is not None and self.proc is not None
        deadline = time.monotonic() + within
        while time.monotonic() < deadline:
            if self.port_file.exists():
                self.address = self.port_file.read_text().strip()
                if self.address:
                    return self.address
            if self.proc.poll() is not None:
                raise StackError(f"{self.name} exited with {self.proc.returncode}; "
                                 f"its log {self.log_path} ends:\n{self.log_tail()}")
            await asyncio.sleep(0.05)
        raise StackError(f"{self.name} did not start in {within:.0f}s; see {self.log_path}")

    async def wait_tcp(self, host: str, port: int, within: float) -> None:
        assert self.proc is not None
        deadline = time.monotonic() + within
        while time.monotonic() < deadline:
            try:
                _, w = await asyncio.wait_for(asyncio.open_connection(host, port), 0.5)
                w.close()
                with contextlib.suppress(OSError):
                    await w.wait_closed()
                return
            except (OSError, TimeoutError):
                if self.proc.poll() is not None:
                    raise StackError(f"{self.name} exited with {self.proc.returncode}; "
                                     f"its log {self.log_path} ends:\n{self.log_tail()}") from None
                await asyncio.sleep(0.05)
        raise StackError(f"{self.name} did not listen on {host}:{port} in {within:.0f}s")

    def signal_group(self, sig: int) -> None:
        if self.proc is None:
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, sig)

    async def stop(self, grace: float = STOP_GRACE_S) -> int | None:
        """SIGTERM the process group, wait ``grace`` seconds, then SIGKILL it."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.signal_group(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                await asyncio.to_thread(self.proc.wait, grace)
        # Whatever is left in the group (the leader's children) goes too.
        self.signal_group(signal.SIGKILL)
        if self.proc.poll() is None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(5)
        return self.proc.returncode


@dataclass(frozen=True)
class Security:
    """The stack's TLS files and tokens, all under the data dir."""

    ca_file: str
    cert_file: str
    key_file: str
    admin_token_file: str
    control_plane_token_file: str
    encryption_key_file: str

    def tls_args(self) -> list[str]:
        return ["--tls-cert-file", self.cert_file, "--tls-key-file", self.key_file,
                "--tls-ca-file", self.ca_file]

    def etcd_server_args(self) -> list[str]:
        """etcd serves its clients TLS and takes only certificates of this CA:
        another local user (or a job) cannot read or write the registry."""
        return ["--cert-file", self.cert_file, "--key-file", self.key_file,
                "--client-cert-auth", "--trusted-ca-file", self.ca_file]

    def etcd_client_args(self) -> list[str]:
        return ["--etcd-ca-file", self.ca_file, "--etcd-cert-file", self.cert_file,
                "--etcd-key-file", self.key_file]


def _private_dir(path: pathlib.Path) -> pathlib.Path:
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    path.chmod(0o700)
    return path


def _token_file(path: pathlib.Path) -> str:
    """A static token file, made on the first run; kept 0600."""
    if not path.exists():
        write_token_file(str(path), random_token())
    path.chmod(0o600)
    return str(path)


def _cert_usable(cert_file: str, ca_file: str, dns: Sequence[str], ips: Sequence[str]) -> bool:
    """Whether ``cert_file`` is signed by the CA, names every ``dns``/``ips``
    and stays valid for longer than ``CERT_RENEW_BEFORE``."""
    from cryptography import x509

    try:
        cert = x509.load_pem_x509_certificate(pathlib.Path(cert_file).read_bytes())
        ca = x509.load_pem_x509_certificate(pathlib.Path(ca_file).read_bytes())
        cert.verify_directly_issued_by(ca)
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except Exception:  # noqa: BLE001 - unreadable, foreign or malformed: issue a new one
        return False
    now = datetime.datetime.now(datetime.UTC)
    if cert.not_valid_after_utc - now < CERT_RENEW_BEFORE or cert.not_valid_before_utc > now:
        return False
    have_dns = set(san.get_values_for_type(x509.DNSName))
    have_ips = {str(i) for i in san.get_values_for_type(x509.IPAddress)}
    return set(dns) <= have_dns and set(ips) <= have_ips


def _ca_usable(ca: pki.Issued) -> bool:
    from cryptography import x509

    if not (os.path.exists(ca.cert_file) and os.path.exists(ca.key_file)):
        return False
    try:
        cert = x509.load_pem_x509_certificate(pathlib.Path(ca.cert_file).read_bytes())
    except (OSError, ValueError):
        return False
    return cert.not_valid_after_utc - datetime.datetime.now(datetime.UTC) > CERT_RENEW_BEFORE


class LocalStack:
    """etcd + ClusterManager + local driver + JobManager under one data dir."""

    def __init__(self, data_dir: str, port: int = 50051, host: str = "127.0.0.1",
                 *, ready_timeout: float = 60.0) -> None:
        self.data = pathlib.Path(data_dir).resolve()
        self.port = port
        self.host = host
        self.ready_timeout = ready_timeout
        self.children: list[Child] = []
        self.logs = self.data / "logs"
        self.run_dir = self.data / "run"
        self._lock_fd: int | None = None
        self.etcd_endpoint = ""
        self.security: Security | None = None
        self.config_file: pathlib.Path | None = None
        self.context_current = False

    # -- start ------------------------------------------------------------------

    def _lock(self) -> None:
        _private_dir(self.data)
        fd = os.open(self.data / "up.lock", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise StackError(f"another `dlsched up` already runs with data dir {self.data}") from None
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        self._lock_fd = fd

    def _etcd_ports(self) -> tuple[int, int]:
        """Reuses last run's ports when free: etcd keeps its peer URL in its data."""
        saved = self.data / "etcd-ports.json"
        try:
            d = json.loads(saved.read_text())
            client, peer = int(d["client"]), int(d["peer"])
            if port_is_free("127.0.0.1", client) and port_is_free("127.0.0.1", peer):
                return client, peer
        except (OSError, ValueError, KeyError, TypeError):
            pass
        client, peer = free_port(), free_port()
        while peer == client:
            peer = free_port()
        saved.write_text(json.dumps({"client": client, "peer": peer}))
        return client, peer

    def _encryption_key_file(self) -> pathlib.Path:
        """The key file that encrypts cluster credentials in etcd, made (0600) on the first run."""
        path = self.data / "encryption-key.json"
        if not path.exists():
            generate_key_file(path)
        path.chmod(0o600)
        return path

    @property
    def client_host(self) -> str:
        """The host clients dial: loopback when the services listen on every address."""
        return "127.0.0.1" if self.host in ("0.0.0.0", "::", "") else self.host

    def _cert_names(self) -> tuple[list[str], list[str]]:
        """DNS and IP SANs of the service certificate."""
        dns, ips = ["cluster-manager", "localhost"], ["127.0.0.1"]
        extra = [socket.gethostname()] if self.host in ("0.0.0.0", "::") else [self.host]
        for h in extra:
            if not h or h in dns or h in ips:
                continue
            try:
                ips.append(str(ipaddress.ip_address(h)))
            except ValueError:
                dns.append(h)
        return dns, ips

    def _security(self) -> Security:
        """The CA, the service certificate and the tokens, made once and reused
        (the certificate is reissued when it nears its end or lacks a name)."""
        tls = _private_dir(self.data / "tls")
        ca = pki.Issued(str(tls / "ca.pem"), str(tls / "ca.key"))
        new_ca = not _ca_usable(ca)
        if new_ca:
            ca = pki.make_ca(str(tls), name="dlsched up local CA")
        dns, ips = self._cert_names()
        svc = pki.Issued(str(tls / f"{SERVICE_IDENTITY}.pem"), str(tls / f"{SERVICE_IDENTITY}.key"))
        if new_ca or not os.path.exists(svc.key_file) or not _cert_usable(
                svc.cert_file, ca.cert_file, dns, ips):
            svc = pki.issue(ca, str(tls), SERVICE_IDENTITY, dns=dns, ips=ips)
        for f in (ca.key_file, svc.key_file):
            os.chmod(f, 0o600)
        return Security(
            ca_file=ca.cert_file, cert_file=svc.cert_file, key_file=svc.key_file,
            admin_token_file=_token_file(self.data / "admin.token"),
            control_plane_token_file=_token_file(self.data / "control-plane.token"),
            encryption_key_file=str(self._encryption_key_file()))

    def client_profile(self, server: str = "", cluster_manager: str = "") -> Any:
        """A client profile for this stack: verified TLS against its CA, the admin token."""
        from dlsched.kit.tls import TlsOptions
        from dlsched.profile import Profile

        assert self.security is not None
        return Profile(server=server, cluster_manager=cluster_manager,
                       tls=TlsOptions(ca_file=self.security.ca_file),
                       token_file=self.security.admin_token_file)

    def _service(self, name: str, module: str, listen_port: int, args: Sequence[str],
                 host: str | None = None) -> Child:
        env = {"PYTHONUNBUFFERED": "1"}
        root = _source_root()
        if root is not None:
            env["PYTHONPATH"] = os.pathsep.join(
                p for p in (str(root), os.environ.get("PYTHONPATH", "")) if p)
        port_file = self.run_dir / f"{name}.port"
        return Child(
            name=name,
            argv=[sys.executable, "-m", module, "--listen", f"{host or self.host}:{listen_port}",
                  "--port-file", str(port_file), *args],
            log_path=self.logs / f"{name}.log", port_file=port_file, env=env)

    async def start(self) -> dict[str, str]:
        self._lock()
        for d in (self.logs, self.run_dir, self.data / "local", self.data / "etcd"):
            _private_dir(d)
        sec = self.security = self._security()
        with contextlib.suppress(FileNotFoundError):
            (self.data / "ready.json").unlink()
        for p in (self.port, self.port + 1):
            if not port_is_free(self.host, p):
                raise StackError(f"port {self.host}:{p} is in use; pick another with --port "
                                 "(ClusterManager uses PORT+1)")

        client, peer = self._etcd_ports()
        etcd = Child(
            name="etcd",
            argv=[find_etcd_binary(), "--name", "dlsched", "--data-dir", str(self.data / "etcd"),
                  "--listen-client-urls", f"https://127.0.0.1:{client}",
                  "--advertise-client-urls", f"https://127.0.0.1:{client}",
                  "--listen-peer-urls", f"http://127.0.0.1:{peer}",
                  "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer}",
                  "--initial-cluster", f"dlsched=http://127.0.0.1:{peer}",
                  *sec.etcd_server_args(), "--log-level", "warn"],
            log_path=self.logs / "etcd.log")
        self.children.append(etcd)
        etcd.start()
        await etcd.wait_tcp("127.0.0.1", client, self.ready_timeout)
        self.etcd_endpoint = f"127.0.0.1:{client}"

        auth = ["--admin-token-file", sec.admin_token_file,
                "--control-plane-token-file", sec.control_plane_token_file]
        cm = self._service("cluster-manager", "cluster_manager", self.port + 1,
                           ["--etcd", self.etcd_endpoint, *sec.etcd_client_args(),
                            "--prefix", "/dlsched/", "--monitor-interval", "2",
                            "--encryption-key-file", sec.encryption_key_file,
                            *sec.tls_args(), *auth])
        self.children.append(cm)
        cm.start()
        # Only the control plane calls the driver (mutual TLS): loopback, whatever --host says.
        driver = self._service("local-driver", "drivers.local", 0,
                               ["--state-dir", str(self.data / "local"), *sec.tls_args()],
                               host="127.0.0.1")
        self.children.append(driver)
        driver.start()
        await cm.wait_port_file(self.ready_timeout)
        await driver.wait_port_file(self.ready_timeout)
        cm_address = self._dial(cm.address)

        jm = self._service("job-manager", "job_manager", self.port,
                           ["--etcd", self.etcd_endpoint, *sec.etcd_client_args(),
                            "--cluster-manager", cm_address,
                            # the job history: SQLite, DIR/job-manager/history.db
                            "--data-dir", str(self.data / "job-manager"),
                            "--prefix", "/dlsched/", *sec.tls_args(), *auth])
        self.children.append(jm)
        jm.start()
        await jm.wait_port_file(self.ready_timeout)
        jm_address = self._dial(jm.address)

        state = await self._register_local(cm_address, driver.address)
        self._save_context(jm_address, cm_address)
        addrs = {"server": jm_address, "cluster_manager": cm_address,
                 "driver": driver.address, "etcd": self.etcd_endpoint,
                 "cluster_state": state, "pid": str(os.getpid()),
                 "ca_file": sec.ca_file, "token_file": sec.admin_token_file,
                 "config": str(self.config_file or ""), "context": CONTEXT}
        tmp = self.data / "ready.json.tmp"
        tmp.write_text(json.dumps(addrs))
        os.replace(tmp, self.data / "ready.json")
        return addrs

    def _dial(self, address: str) -> str:
        """``address`` as a client dials it (0.0.0.0 → loopback)."""
        host, _, port = address.rpartition(":")
        return f"{self.client_host}:{port}" if host in ("0.0.0.0", "::", "[::]", "") else address

    def _save_context(self, server: str, cluster_manager: str) -> None:
        """Context ``local`` in the user's config, current when none is; a
        config that cannot be written only costs a warning."""
        from dlsched import profile

        assert self.security is not None
        try:
            path = profile.config_path()
            current, _ = profile.get_contexts(path)
            profile.save_context(CONTEXT, {
                "server": server, "cluster-manager": cluster_manager,
                "ca-file": self.security.ca_file, "token-file": self.security.admin_token_file,
            }, path=path)
            self.config_file = path
            self.context_current = current in (None, CONTEXT)
        except (errors.DlschedError, OSError) as e:
            print(f"warning: could not save context {CONTEXT!r} in the dlsched config: {e}",
                  file=sys.stderr, flush=True)

    async def _register_local(self, cm_address: str, driver_address: str) -> str:
        from dlsched.client import ClusterManagerClient, DlschedRpcError
        from dlsched.v1 import cluster_pb2, job_pb2

        async with ClusterManagerClient(
                cm_address, profile=self.client_profile(cluster_manager=cm_address)) as cm:
            try:
                c = await cm.get_cluster("local")
                if c.driver_address != driver_address:
                    await cm.update_cluster(
                        cluster_pb2.Cluster(name="clusters/local", driver_address=driver_address),
                        ["driver_address"])
            except DlschedRpcError as e:
                if e.code != "NOT_FOUND":
                    raise
                try:
                    await cm.create_cluster("local", cluster_pb2.Cluster(
                        type=job_pb2.CLUSTER_TYPE_LOCAL, driver_address=driver_address,
                        labels={"dlsched.io/stack": "up"}))
                except DlschedRpcError as e2:
                    if e2.code != "ALREADY_EXISTS":
                        raise
                    await cm.update_cluster(
                        cluster_pb2.Cluster(name="clusters/local", driver_address=driver_address),
                        ["driver_address"])
            try:
                c = await cm.wait_cluster_state("local", timeout=min(30.0, self.ready_timeout))
            except TimeoutError as e:
                print(f"warning: cluster local is not READY yet: {e}", file=sys.stderr)
                c = await cm.get_cluster("local")
            return cluster_pb2.ClusterState.Name(c.state)

    # -- run / stop -------------------------------------------------------------

    def dead_child(self) -> Child | None:
        for c in self.children:
            if not c.alive():
                return c
        return None

    async def stop(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            (self.data / "ready.json").unlink()
        for c in reversed(self.children):
            await c.stop()
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None


async def _run(stack: LocalStack) -> int:
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    received: list[int] = []

    def on_signal(sig: int) -> None:
        received.append(sig)
        stop.set()

    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        loop.add_signal_handler(sig, on_signal, sig)
    code = 0
    try:
        start = asyncio.ensure_future(stack.start())
        stopper = asyncio.ensure_future(stop.wait())
        await asyncio.wait({start, stopper}, return_when=asyncio.FIRST_COMPLETED)
        if not start.done():
            start.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await start
            print("dlsched up: interrupted while starting; stopping", file=sys.stderr)
            return 0
        stopper.cancel()
        addrs = start.result()  # raises a start failure
        print(f"{READY_PREFIX} server={addrs['server']} cluster-manager={addrs['cluster_manager']} "
              f"driver={addrs['driver']} etcd={addrs['etcd']} "
              f"cluster=clusters/local({addrs['cluster_state'].removeprefix('CLUSTER_STATE_')})",
              flush=True)
        if stack.config_file is None:
            how = (f"dlsched --server {addrs['server']} --cluster-manager {addrs['cluster_manager']}"
                   f" --ca-file {addrs['ca_file']} --token-file {addrs['token_file']}")
            where = "no context saved"
        elif stack.context_current:
            how, where = "dlsched", f"context {CONTEXT} (current) in {stack.config_file}"
        else:
            how = f"dlsched --context {CONTEXT}"
            where = f"context {CONTEXT} (not current) in {stack.config_file}"
        print(f"  data {stack.data}, logs {stack.logs}, {where}, admin token "
              f"{addrs['token_file']}; try `{how} submit examples/hello.yaml --follow`; "
              "Ctrl-C stops", flush=True)
        while not stop.is_set():
            dead = stack.dead_child()
            if dead is not None:
                rc = dead.proc.returncode if dead.proc else "?"
                if not dead.may_restart():
                    print(f"error: {dead.name} exited with {rc}, {RESTARTS} times in "
                          f"{RESTART_WINDOW_S:.0f} s; stopping the stack. Its log {dead.log_path} "
                          f"ends:\n{dead.log_tail()}", file=sys.stderr, flush=True)
                    code = 1
                    break
                print(f"dlsched up: {dead.name} exited with {rc}; starting it again (its log: "
                      f"{dead.log_path})", file=sys.stderr, flush=True)
                dead.restart()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), 0.5)
        if received:
            print(f"dlsched up: {signal.Signals(received[0]).name}; stopping", file=sys.stderr,
                  flush=True)
        return code
    finally:
        started = bool(stack.children)
        await stack.stop()
        if started:
            print("dlsched up: stopped", file=sys.stderr, flush=True)


def _die_with(parent: int) -> Callable[[], None]:
    """A child's ``preexec_fn``: SIGTERM when ``parent`` dies (Linux's PR_SET_PDEATHSIG; the
    thread that forks is the event loop's, which lives as long as the process)."""
    prctl = _prctl()

    def pre() -> None:
        if prctl is not None:
            prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
        if os.getppid() != parent:  # it died before the prctl
            os._exit(1)
    return pre


def _prctl() -> Callable[..., int] | None:
    try:
        fn: Callable[..., int] = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):  # not Linux
        return None
    return fn


def main(*, data_dir: str = "./.dlsched", port: int = 50051, host: str = "127.0.0.1",
         ready_timeout: float = 60.0) -> int:
    """Runs the stack until a signal; the process's exit code."""
    from dlsched.cli import print_error

    stack = LocalStack(data_dir, port, host, ready_timeout=ready_timeout)
    try:
        return asyncio.run(_run(stack))
    except KeyboardInterrupt:
        return 0
    except errors.DlschedError as e:
        print_error(e)
        return 1
    except OSError as e:
        print(f"error: FAILED_PRECONDITION {StackError.reason}: {e}", file=sys.stderr)
        return 1
