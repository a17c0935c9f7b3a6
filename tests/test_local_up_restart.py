"""``dlsched up`` SIGKILLed with every service it started, then started again: running local
jobs keep running and are re-adopted, jobs that ended meanwhile show their true outcome,
nothing runs twice (the CLI against the real stack, as a user would)."""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import signal
import sys
import time

import yaml

from tests.harness import pid_alive
from tests.test_cli import Up, _processes_mentioning

#: how long the stack stays down
OUTAGE_SECONDS = 8.0


def _spec(code: str) -> dict[str, object]:
    return {"runMode": "SINGLE_PROCESS", "clusterSelector": {"clusterType": "local"},
            "replicaGroups": [{"role": "main", "replicas": 1, "command": [sys.executable, "-u", "-c", code]}]}


def _job(up: Up, job_id: str) -> dict[str, object]:
    r = up.cli("get", job_id, "-o", "json")
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def _wait(up: Up, job_id: str, states: set[str], within: float) -> dict[str, object]:
    deadline = time.monotonic() + within
    while True:
        job = _job(up, job_id)
        if job["state"] in states or time.monotonic() > deadline:
            return job
        time.sleep(0.3)


def test_dlsched_up_killed_and_started_again_keeps_local_jobs_running(tmp_path: pathlib.Path) -> None:
    up = Up(tmp_path)
    release, long_runs, short_runs = tmp_path / "release", tmp_path / "long.runs", tmp_path / "short.runs"
    specs = {
        "long": _spec(f"import os, pathlib, time\nopen({str(long_runs)!r}, 'a').write('ran\\n')\n"
                      f"print('pid', os.getpid())\n"
                      f"while not pathlib.Path({str(release)!r}).exists(): time.sleep(0.2)\n"),
        "short": _spec(f"import time\nopen({str(short_runs)!r}, 'a').write('ran\\n')\ntime.sleep(3)\n"),
    }
    try:
        up.start()
        for name, spec in specs.items():
            path = tmp_path / f"{name}.yaml"
            path.write_text(yaml.safe_dump(spec))
            r = up.cli("submit", str(path), "--id", f"up-{name}")
            assert r.returncode == 0, r.stderr
        for name in specs:
            assert _wait(up, f"up-{name}", {"JOB_STATE_RUNNING"}, 60)["state"] == "JOB_STATE_RUNNING"
        time.sleep(0.5)
        logs = up.cli("logs", "up-long")
        pid = int(logs.stdout.split()[1])

        # The whole stack dies at once: `dlsched up` and every service it started.
        assert up.proc is not None
        up.proc.kill()
        up.proc.wait()
        for line in _processes_mentioning(str(up.data)):
            if "drivers.local.supervisor" not in line:
                with contextlib.suppress(ProcessLookupError):  # (they die with `up`: SIGTERM)
                    os.kill(int(line.split(":")[0]), signal.SIGKILL)
        time.sleep(OUTAGE_SECONDS)  # "short" ends meanwhile
        assert pid_alive(pid)

        up.start()
        back = time.monotonic()
        short = _wait(up, "up-short", {"JOB_STATE_SUCCEEDED", "JOB_STATE_FAILED"}, 30)
        long = _job(up, "up-long")
        assert short["state"] == "JOB_STATE_SUCCEEDED", short
        assert long["state"] == "JOB_STATE_RUNNING", long
        assert time.monotonic() - back < 30
        release.touch()
        long = _wait(up, "up-long", {"JOB_STATE_SUCCEEDED", "JOB_STATE_FAILED"}, 30)
        assert long["state"] == "JOB_STATE_SUCCEEDED", long
        assert long_runs.read_text() == short_runs.read_text() == "ran\n"  # each ran once
        time.sleep(1)  # the supervisors exit after their last status
        up.stop()
    finally:
        up.kill()


def _services(up: Up) -> dict[str, int]:
    """pid of each service `dlsched up` runs (its job supervisors aside)."""
    out = {}
    for line in _processes_mentioning(str(up.data)):
        pid, cmd = line.split(":", 1)
        for name in ("etcd", "cluster_manager", "drivers.local", "job_manager"):
            if (f" -m {name} " in cmd or cmd.lstrip().split(" ")[0].endswith("/etcd") and name == "etcd") \
                    and "drivers.local.supervisor" not in cmd:
                out[name] = int(pid)
    return out


def test_a_service_killed_under_dlsched_up_is_started_again_and_up_killed_takes_them_along(
        tmp_path: pathlib.Path) -> None:
    """A fault injector's finds: SIGKILL of one service (the local driver) took the whole stack
    down, nothing restarted it; SIGKILL of `dlsched up` left every service running without a
    parent, holding the ports and data, and the next `dlsched up` refused to start. Now the dead
    service is started again on its address (jobs run again), and the services die with `up`."""
    up = Up(tmp_path)
    spec = tmp_path / "job.yaml"
    spec.write_text(yaml.safe_dump(_spec("print('ran')")))
    try:
        up.start()
        first = _services(up)
        assert set(first) == {"etcd", "cluster_manager", "drivers.local", "job_manager"}, first
        os.kill(first["drivers.local"], signal.SIGKILL)
        deadline = time.monotonic() + 90
        while "drivers.local" not in (now := _services(up)) or now["drivers.local"] == first["drivers.local"]:
            assert time.monotonic() < deadline and up.proc is not None and up.proc.poll() is None, \
                up.out_path.read_text()
            time.sleep(0.2)
        assert "starting it again" in up.out_path.read_text()
        r = up.cli("submit", str(spec), "--id", "after-restart")
        assert r.returncode == 0, r.stderr
        job = _wait(up, "after-restart", {"JOB_STATE_SUCCEEDED", "JOB_STATE_FAILED"}, 120)
        assert job["state"] == "JOB_STATE_SUCCEEDED", job

        assert up.proc is not None
        up.proc.kill()
        up.proc.wait()
        deadline = time.monotonic() + 60
        while _services(up):
            assert time.monotonic() < deadline, _services(up)
            time.sleep(0.2)
        up.start()  # the same port and data
        job = _job(up, "after-restart")
        assert job["state"] == "JOB_STATE_SUCCEEDED", job
        up.stop()
    finally:
        up.kill()
