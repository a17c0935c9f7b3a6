"""A real, small Ray head for tests: ``RayHead().start()`` ... ``stop()``.

Runs ``ray start --head --block`` (the same interpreter's ``ray``) with
2 CPUs, a 100 MB object store, the dashboard (the Jobs REST API) on a free
port, every other fixed port on a free one too, and a ``--temp-dir`` of its
own. ``stop`` never runs ``ray stop`` (that kills every Ray on the machine):
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
        # Short: Ray puts Unix sockets under it (107-byte limit).
        self.dir = tempfile.mkdtemp(prefix="dlr", dir="/tmp")
        self.num_cpus = num_cpus
        self.dashboard_port = free_port()
        self.gcs_port = free_port()
        self.address = f"http://127.0.0.1:{self.dashboard_port}"
        self.proc: subprocess.Popen[bytes] | None = None
        self.log_path = os.path.join(self.dir, "ray-start.log")

    def start(self, timeout: float = 90) -> RayHead:
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
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"ray start exited {self.proc.returncode}:\n{self.log()}")
                if self._jobs_api_up():
                    return self
                time.sleep(0.5)
            raise RuntimeError(f"the Ray head did not come up:\n{self.log()}")
        except BaseException:
            self.stop()
            raise

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
