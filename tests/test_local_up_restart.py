"""``dlsched up`` SIGKILLed with every service it started, then started again: running local
jobs keep running and are re-adopted, jobs that ended meanwhile show their true outcome,
nothing runs twice (the CLI against the real stack, as a user would)."""

from __future__ import annotations

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
