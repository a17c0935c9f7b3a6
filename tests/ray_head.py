"""A real, small Ray head for tests: ``RayHead().start()`` ... ``stop()``.

Runs ``ray start --head --block`` (the same interpreter's ``ray``) with
2 CPUs, a 100 MB object store, the dashboard (the Jobs REST API) on a free
port, every other fixed port on a free one too, and a ``--temp-dir`` of its
own. ``start`` returns once a probe job has run through the Jobs API (the
dashboard answering is not enough: a head whose job agent never came up
takes every submission and runs none); a head that fails it is started once
more on fresh ports, and a second failure raises with the head's own logs.
``stop`` never runs ``ray stop`` (that kills every Ray on the machine):
it SIGTERMs its own ``ray start --block`` (which shuts its node down), then
SIGKILLs whatever process still names its temp dir, then removes the dir.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from collections.abc import Iterator

from tests.harness import ServiceProcess, free_port


def started_head(required: bool) -> Iterator[RayHead]:
    """A module fixture's body: a head for the ``with``-less ``yield from``, stopped after;
    skipped when Ray is missing unless ``required`` (CI)."""
    import pytest

    if not ray_available() and not required:
        pytest.skip("ray[default] is not installed (pip install 'ray[default]')")
    h = RayHead().start()
    try:
        yield h
    finally:
        h.stop()


def started_driver(name: str, *args: str) -> Iterator[ServiceProcess]:
    """The Ray driver service as a process (fast polls for tests), stopped after."""
    svc = ServiceProcess("drivers.ray", ["--poll-interval", "0.2", "--log-poll-interval", "0.05", *args],
                         name=name).start()
    try:
        yield svc
    finally:
        svc.stop()


def ray_available() -> bool:
    return shutil.which("ray", path=os.path.dirname(sys.executable)) is not None


class RayHead:
    def __init__(self, num_cpus: int = 2) -> None:
        self.num_cpus = num_cpus
        self._fresh()

    def _fresh(self) -> None:
        """A temp dir and ports of its own (again, for a second start)."""
        # Short: Ray puts Unix sockets under it (107-byte limit).
        self.dir = tempfile.mkdtemp(prefix="dlr", dir="/tmp")
        self.dashboard_port = free_port()
        self.gcs_port = free_port()
        self.address = f"http://127.0.0.1:{self.dashboard_port}"
        self.proc: subprocess.Popen[bytes] | None = None
        self.log_path = os.path.join(self.dir, "ray-start.log")

    def start(self, timeout: float = 90, probe_timeout: float = 120) -> RayHead:
        try:
            return self._start_once(timeout, probe_timeout)
        except RuntimeError as first:
            print(f"the Ray head failed its start, starting a fresh one: {first}", file=sys.stderr, flush=True)
            self._fresh()
            return self._start_once(timeout, probe_timeout)

    def _start_once(self, timeout: float, probe_timeout: float) -> RayHead:
        ray = os.path.join(os.path.dirname(sys.executable), "ray")
        env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "RAY_DEDUP_LOGS": "0"}
        env.pop("RAY_ADDRESS", None)
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [ray, "start", "--head", "--block", "--disable-usage-stats",
                 "--num-cpus", str(self.num_cpus), "--num-gpus", "0",
                 "--object-store-memory", "100000000",
                 "--include-dashboard", "true", "--dashboard-host", "127.0.0.1",
                 "--dashboard-port", str(self.dashboard_port), "--port", str(self.gcs_port),
                 "--dashboard-agent-listen-port", str(free_port()),
                 "--ray-client-server-port", str(free_port()),
                 "--node-ip-address", "127.0.0.1", "--temp-dir", self.dir],
                stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        deadline = time.monotonic() + timeout
        try:
            while not self._jobs_api_up():
                if self.proc.poll() is not None:
                    raise RuntimeError(f"ray start exited {self.proc.returncode}:\n{self.log()}")
                if time.monotonic() > deadline:
                    raise RuntimeError(f"the Ray head did not come up:\n{self.log()}")
                time.sleep(0.5)
            self._probe(time.monotonic() + probe_timeout)
            return self
        except BaseException:
            self.stop()
            raise

    def _call(self, method: str, path: str, body: object = None) -> object:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.address + path, data=data, method=method,
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=30) as r:
            return json.loads(r.read() or b"null")

    def _probe(self, deadline: float) -> None:
        """A job that runs ``true`` through the Jobs API must succeed, then it is deleted."""
        sid = f"probe-{uuid.uuid4().hex[:12]}"
        status: object = None
        try:
            self._call("POST", "/api/jobs/", {"entrypoint": "true", "submission_id": sid})
            while time.monotonic() < deadline:
                info = self._call("GET", f"/api/jobs/{sid}")
                status = info.get("status") if isinstance(info, dict) else None
                if status == "SUCCEEDED":
                    self._call("DELETE", f"/api/jobs/{sid}")
                    return
                if status in ("FAILED", "STOPPED"):
                    break
                time.sleep(0.5)
        except (OSError, ValueError) as e:
            status = f"{status} ({e})"
        raise RuntimeError(f"the Ray head's probe job ended {status}:\n{self.logs(sid)}")

    def failure_logs(self) -> str:
        return self.logs()

    def logs(self, sid: str = "") -> str:
        """The tails of the head's own logs (ray start's output and the session's log files)."""
        parts = [f"--- ray start\n{self.log()}"]
        logs_dir = os.path.join(self.dir, "session_latest", "logs")
        for name in ("dashboard.log", "dashboard_agent.log", "runtime_env_agent.log", "raylet.out",
                     "gcs_server.out", f"job-driver-{sid}.log"):
            path = os.path.join(logs_dir, name)
            with contextlib.suppress(OSError), open(path, errors="replace") as f:
                f.seek(max(0, os.fstat(f.fileno()).st_size - 3000))
                parts.append(f"--- {name}\n{f.read()}")
        return "\n".join(parts)

    def _jobs_api_up(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.address}/api/jobs/", timeout=2) as r:
                json.loads(r.read())
            with urllib.request.urlopen(f"{self.address}/api/version", timeout=2) as r:
                return r.status == 200
        except (OSError, ValueError):
            return False

    def log(self) -> str:
        try:
            with open(self.log_path, errors="replace") as f:
                return f.read()[-5000:]
        except OSError:
            return ""

    def _own_pids(self) -> list[int]:
        """Processes whose command line names this head's temp dir."""
        me = os.getpid()
        out = []
        needle = self.dir.encode()
        for name in os.listdir("/proc"):
            if not name.isdigit() or int(name) == me:
                continue
            try:
                with open(f"/proc/{name}/cmdline", "rb") as f:
                    if needle in f.read():
                        out.append(int(name))
            except OSError:
                continue
        return out

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(5)
        if self.proc is not None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.proc.pid, signal.SIGKILL)
        for _ in range(3):
            pids = self._own_pids()
            if not pids:
                break
            for pid in pids:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.3)
        shutil.rmtree(self.dir, ignore_errors=True)


if __name__ == "__main__":  # manual exploration: start a head, print its address, wait
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # so ``finally`` stops the head
    head = RayHead().start()
    print(head.address, head.dir, flush=True)
    try:
        signal.pause()
    finally:
        head.stop()
