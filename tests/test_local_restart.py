"""Local jobs outlive their driver: SIGKILL, SIGTERM and restarts of the driver process, real jobs,
and the supervisor itself killed (the one way a local job is lost)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import pathlib
import signal
import time
from collections.abc import AsyncIterator, Iterator

import pytest
from google.protobuf.duration_pb2 import Duration

from dlsched.v1 import driver_service_pb2 as dpb
from dlsched.v1 import driver_service_pb2_grpc, job_pb2
from tests import security
from tests.harness import ServiceProcess, pid_alive
from tests.local_peer import CLUSTER, launch, logs, multi, observe, single, texts, wait_state

#: how long the driver stays down (the lead's fault script uses 120 s)
OUTAGE_SECONDS = 12.0
#: every record must equal the truth this soon after the driver is back
TRUTH_WITHIN = 10.0


class Driver:
    """The local driver as a process on one state dir, killed and restarted at will."""

    def __init__(self, state: str, name: str) -> None:
        self.svc = ServiceProcess("drivers.local", ["--state-dir", state, "--grace-seconds", "2"], name=name)

    async def stub(self) -> AsyncIterator[driver_service_pb2_grpc.DriverServiceStub]:
        async with security.channel(self.svc.address) as ch:
            s = driver_service_pb2_grpc.DriverServiceStub(ch)
            await s.ConfigureCluster(dpb.ConfigureClusterRequest(cluster=CLUSTER), timeout=10)
            yield s


@pytest.fixture
def local(tmp_path: pathlib.Path) -> Iterator[Driver]:
    d = Driver(str(tmp_path / "state"), "local-driver-restart")
    d.svc.start()
    yield d
    d.svc.stop()


def ticking(release: pathlib.Path, marker: pathlib.Path) -> str:
    """Marks one run, prints its pid, then a numbered line every 0.2 s until ``release`` exists; exits 0."""
    return (f"import os, pathlib, time\n"
            f"open({str(marker)!r}, 'a').write('ran\\n')\n"
            f"print('pid', os.getpid(), flush=True)\n"
            f"i = 0\n"
            f"while not pathlib.Path({str(release)!r}).exists():\n"
            f"    print('tick', i, flush=True); i += 1; time.sleep(0.2)\n")


def ending(after: float, code: int, marker: pathlib.Path) -> str:
    """Marks one run, then exits ``code`` after ``after`` seconds."""
    return (f"import sys, time\nopen({str(marker)!r}, 'a').write('ran\\n')\n"
            f"time.sleep({after})\nprint('bye', flush=True)\nsys.exit({code})\n")


async def test_sigkilled_driver_readopts_running_jobs_and_reports_jobs_that_ended_meanwhile(local, tmp_path):
    release = tmp_path / "release"
    marks = {name: tmp_path / f"{name}.runs" for name in ("long", "ok", "bad", "before")}
    specs = {
        "long": single(ticking(release, marks["long"])),
        "ok": single(ending(3, 0, marks["ok"])),
        "bad": single(ending(3, 3, marks["bad"])),
        "before": single(ending(0, 0, marks["before"])),
    }
    async for s in local.stub():
        for name, spec in specs.items():
            await launch(s, name, spec)
        await wait_state(s, "before")
        for name in ("long", "ok", "bad"):
            assert (await observe(s, name)).state == job_pb2.JOB_STATE_RUNNING
        await asyncio.sleep(0.5)
        pid = int(texts(await logs(s, "long"))[0].split()[1])
        killed_at = time.time()
    local.svc.kill()
    await asyncio.sleep(OUTAGE_SECONDS)  # "ok" and "bad" end meanwhile; "long" runs on
    assert pid_alive(pid)
    await asyncio.to_thread(local.svc.start)
    back_at = time.monotonic()
    async for s in local.stub():
        long, ok, bad, before = [await observe(s, n) for n in ("long", "ok", "bad", "before")]
        assert time.monotonic() - back_at < TRUTH_WITHIN
        assert long.state == job_pb2.JOB_STATE_RUNNING and long.replicas[0].state == job_pb2.REPLICA_STATE_RUNNING
        assert (ok.state, ok.exit_code, ok.reason) == (job_pb2.JOB_STATE_SUCCEEDED, 0, "Completed")
        assert (bad.state, bad.exit_code, bad.reason) == (job_pb2.JOB_STATE_FAILED, 3, "NonZeroExit")
        assert before.state == job_pb2.JOB_STATE_SUCCEEDED
        for obs in (ok, bad):  # they ended while the driver was down, and the record says so
            assert killed_at < obs.end_time.seconds + obs.end_time.nanos / 1e9 < killed_at + OUTAGE_SECONDS
        # The same attempt again is the first launch's result: nothing runs twice.
        for name in ("long", "ok", "bad"):
            again = await launch(s, name, specs[name])
            assert again.backend_job_id == f"local-{name}-1"
        # The re-adopted job goes on (same process) and ends with its true outcome.
        await asyncio.sleep(0.5)
        release.touch()
        done = await wait_state(s, "long", within=15)
        assert (done.state, done.exit_code) == (job_pb2.JOB_STATE_SUCCEEDED, 0)
        entries = await logs(s, "long")
        out = texts(entries)
        assert out[0] == f"pid {pid}"
        ticks = [int(t.split()[1]) for t in out[1:]]
        assert ticks == list(range(len(ticks)))  # no gap, no duplicate
        stamps = [e.time.seconds + e.time.nanos / 1e9 for e in entries[1:]]
        assert any(t < killed_at for t in stamps) and any(t > killed_at + OUTAGE_SECONDS for t in stamps)
    for name, marker in marks.items():
        assert marker.read_text() == "ran\n", name  # each ran exactly once


async def test_sigterm_leaves_jobs_running_and_a_restarted_driver_can_stop_them(local):
    async for s in local.stub():
        await launch(s, "sleeper", single("import os, time; print(os.getpid(), flush=True); time.sleep(120)"))
        await wait_state(s, "sleeper", [job_pb2.JOB_STATE_RUNNING])
        await asyncio.sleep(0.5)
        pid = int(texts(await logs(s, "sleeper"))[0])
    assert local.svc.stop() == 0
    assert pid_alive(pid)
    await asyncio.to_thread(local.svc.start)
    async for s in local.stub():
        assert (await observe(s, "sleeper")).state == job_pb2.JOB_STATE_RUNNING
        resp = await s.TerminateJob(dpb.TerminateJobRequest(cluster=CLUSTER, job=dpb.JobRef(job_id="sleeper"),
                                                            grace_period={"seconds": 1}), timeout=10)
        assert resp.observation.state == job_pb2.JOB_STATE_STOPPING
        obs = await wait_state(s, "sleeper", within=10)
        assert obs.state == job_pb2.JOB_STATE_STOPPED and obs.reason == "Stopped"
    assert not pid_alive(pid)


async def test_a_killed_supervisor_fails_its_job_supervisor_lost_and_leaves_no_process(local, tmp_path):
    async for s in local.stub():
        await launch(s, "orphan", single("import os, time; print(os.getpid(), flush=True); time.sleep(120)"))
        await wait_state(s, "orphan", [job_pb2.JOB_STATE_RUNNING])
        await asyncio.sleep(0.5)
        pid = int(texts(await logs(s, "orphan"))[0])
        status = json.loads((tmp_path / "state" / "jobs" / "orphan" / "attempt-1" / "status.json").read_text())
        os.kill(status["supervisor"]["pid"], signal.SIGKILL)
        obs = await wait_state(s, "orphan", within=10)
        assert obs.state == job_pb2.JOB_STATE_FAILED and obs.reason == "SupervisorLost"
        await asyncio.sleep(0.2)  # killed before FAILED was reported; give the kernel a moment
        assert not pid_alive(pid)


async def test_a_supervisor_killed_while_it_starts_a_large_job_leaves_no_started_process(local, tmp_path):
    """SIGKILL of the supervisor part-way through starting 200 processes (the OOM killer during a
    large launch): every process it had started is killed, though its status was never written."""
    adir = tmp_path / "state" / "jobs" / "big" / "attempt-1"
    async for s in local.stub():
        launching = asyncio.ensure_future(launch(s, "big", multi("import time; time.sleep(120)", replicas=200)))
        pids = adir / "pids"
        deadline = time.monotonic() + 60
        while not pids.exists() or len(pids.read_text().splitlines()) < 20:
            assert time.monotonic() < deadline, "the supervisor never noted 20 processes"
            await asyncio.sleep(0.002)
        started = [int(line.split()[0]) for line in pids.read_text().splitlines()]
        supervisor = next(int(p) for p in os.listdir("/proc") if p.isdigit() and _is_supervisor(int(p), adir))
        os.kill(supervisor, signal.SIGKILL)
        await launching
        obs = await wait_state(s, "big", within=30)
        assert obs.state == job_pb2.JOB_STATE_FAILED and obs.reason == "SupervisorLost", obs
        deadline = time.monotonic() + 10
        while alive := [p for p in started if pid_alive(p)]:
            assert time.monotonic() < deadline, f"started processes outlived their supervisor: {alive}"
            await asyncio.sleep(0.1)


async def test_a_stop_reaches_the_processes_of_a_job_whose_supervisor_is_frozen(local, tmp_path):
    """SIGSTOP of the job's supervisor, then TerminateJob: the supervisor cannot act on it, so
    some seconds past the grace the driver kills the processes (and the supervisor) itself; the
    job ends STOPPED, as asked, not STOPPING for ever."""
    async for s in local.stub():
        await launch(s, "frozen", single("import os, time; print(os.getpid(), flush=True); time.sleep(300)"))
        await wait_state(s, "frozen", [job_pb2.JOB_STATE_RUNNING])
        deadline = time.monotonic() + 30
        while not (out := texts(await logs(s, "frozen"))):
            assert time.monotonic() < deadline
            await asyncio.sleep(0.1)
        pid = int(out[0])
        status = json.loads((tmp_path / "state" / "jobs" / "frozen" / "attempt-1" / "status.json").read_text())
        supervisor = status["supervisor"]["pid"]
        os.kill(supervisor, signal.SIGSTOP)
        try:
            await s.TerminateJob(dpb.TerminateJobRequest(cluster=CLUSTER, job=dpb.JobRef(job_id="frozen"),
                                                         grace_period=Duration(seconds=1)), timeout=10)
            obs = await wait_state(s, "frozen", within=60)
            assert obs.state == job_pb2.JOB_STATE_STOPPED, obs
            assert not pid_alive(pid) and not pid_alive(supervisor)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.kill(supervisor, signal.SIGKILL)


def _is_supervisor(pid: int, adir: pathlib.Path) -> bool:
    try:
        argv = pathlib.Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    return b"drivers.local.supervisor" in argv and str(adir).encode() in argv


@pytest.mark.parametrize("field,value", [("message", ["a", "list"]), ("exit_code", 10 ** 30),
                                         ("start_time", float("nan")), ("processes", {"a": 1})])
async def test_a_status_file_a_job_wrote_over_is_skipped_and_every_other_job_still_tracked(
        local: Driver, tmp_path: pathlib.Path, field: str, value: object) -> None:
    """A local job runs as the driver's user and can write over its own ``status.json``: a
    document of the wrong types is skipped (the last state stays), never taken in, and the
    driver goes on tracking every job."""
    path = tmp_path / "state" / "jobs" / "forger" / "attempt-1" / "status.json"
    async for s in local.stub():
        await launch(s, "forger", single("import time; time.sleep(120)"))
        await wait_state(s, "forger", [job_pb2.JOB_STATE_RUNNING])
        doc = json.loads(path.read_text())
        doc.update({"state": "SUCCEEDED", field: value})
        tmp = path.with_suffix(".forged")
        tmp.write_text(json.dumps(doc))
        os.replace(tmp, path)
        await launch(s, "after", single("print('fine')"))
        assert (await wait_state(s, "after", within=30)).state == job_pb2.JOB_STATE_SUCCEEDED
        forged = await observe(s, "forger")
        assert forged.state == job_pb2.JOB_STATE_RUNNING, forged
        await s.TerminateJob(dpb.TerminateJobRequest(cluster=CLUSTER, job=dpb.JobRef(job_id="forger")),
                             timeout=10)



#: what a job may write into its working directory, by default its attempt directory: JSON nested too deep to parse
DEEP = "'[' * 100000 + ']' * 100000"


def overwrite(name: str, content: str, release: pathlib.Path) -> str:
    """Writes ``content`` (an expression) over ``name`` in its working directory, whole, then
    waits for ``release``."""
    return (f"import os, pathlib, time\ntime.sleep(0.5)\n"
            f"open({name!r} + '.t', 'w').write({content})\nos.replace({name!r} + '.t', {name!r})\n"
            f"print('written', flush=True)\n"
            f"while not pathlib.Path({str(release)!r}).exists():\n    time.sleep(0.1)\n")


async def written(s: driver_service_pb2_grpc.DriverServiceStub, job_id: str) -> None:
    """Until the ``overwrite`` job has written its file (10 s at most)."""
    for _ in range(100):
        if texts(await logs(s, job_id)) == ["written"]:
            return
        await asyncio.sleep(0.1)
    raise AssertionError(f"{job_id} did not write its file")


async def test_a_status_file_nested_too_deep_is_skipped_once_and_every_other_job_still_tracked(local, tmp_path):
    """A job writes JSON nested deeper than the parser goes over its ``status.json``: its last
    state stays, the driver says so once (not at every poll) and follows every other job."""
    release = tmp_path / "release"
    async for s in local.stub():
        await launch(s, "deep", single(overwrite("status.json", DEEP, release)))
        await written(s, "deep")
        await asyncio.sleep(1.0)  # ten polls of the file
        await launch(s, "after", single("print('fine')"))
        assert (await wait_state(s, "after", within=30)).state == job_pb2.JOB_STATE_SUCCEEDED
        assert (await observe(s, "deep")).state == job_pb2.JOB_STATE_RUNNING
        assert (tmp_path / "state" / "jobs" / "deep" / "attempt-1" / "status.json").read_text().startswith("[[[")
        release.touch()
        assert (await wait_state(s, "deep", within=15)).state == job_pb2.JOB_STATE_SUCCEEDED
    log = local.svc.log()
    assert "cannot follow job deep" not in log and "RecursionError" not in log
    assert log.count("unreadable status of job deep") == 1, log[-3000:]


async def test_a_record_a_job_wrote_over_is_unreadable_and_a_restarted_driver_follows_every_other_job(
        local, tmp_path):
    """Jobs write over their own ``record.json``: JSON nested too deep, and a record naming another
    job. A restarted driver starts, skips both as unreadable and re-adopts the job named, as itself."""
    release = tmp_path / "release"
    rename = ("(lambda d: __import__('json').dumps({**d, 'job_id': 'honest'}))"
              "(__import__('json').load(open('record.json')))")
    async for s in local.stub():
        await launch(s, "deep", single(overwrite("record.json", DEEP, release)))
        await launch(s, "liar", single(overwrite("record.json", rename, release)))
        await launch(s, "honest", single("import time; print('honest', flush=True); time.sleep(120)"))
        for name in ("deep", "liar"):
            await written(s, name)
    local.svc.kill()
    await asyncio.to_thread(local.svc.start)
    async for s in local.stub():
        honest = await observe(s, "honest")
        assert (honest.state, honest.backend_job_id) == (job_pb2.JOB_STATE_RUNNING, "local-honest-1"), honest
        assert texts(await logs(s, "honest", follow=False)) == ["honest"]
        for name in ("deep", "liar"):
            assert not (await observe(s, name)).found, name
        await s.TerminateJob(dpb.TerminateJobRequest(cluster=CLUSTER, job=dpb.JobRef(job_id="honest"),
                                                     grace_period={"seconds": 1}), timeout=10)
        assert (await wait_state(s, "honest", within=10)).state == job_pb2.JOB_STATE_STOPPED
    release.touch()
    assert local.svc.log().count("skipping unreadable record") == 2


def test_a_file_over_its_bound_or_nested_too_deep_is_unreadable(tmp_path):
    """``read_json`` reads at most its bound (a record's is ``RECORD_LIMIT``), so a job's
    gigabytes are never read whole, and parses nothing nested past the parser's reach."""
    from drivers.local import attempt

    path = tmp_path / "record.json"
    path.write_text('{"a": 1}' + " " * 100)
    assert attempt.read_json(str(path), limit=108) == {"a": 1}
    assert attempt.read_json(str(path), limit=107) is None
    path.write_text("[" * 100000 + "]" * 100000)
    assert attempt.read_json(str(path)) is None
    assert attempt.STATUS_LIMIT < attempt.RECORD_LIMIT <= 1 << 30
