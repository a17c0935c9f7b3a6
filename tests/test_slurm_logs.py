"""The Slurm driver's logs: tails of ended jobs, ``since_time``, followers streaming on the
log connection (bounded, dated by the log index) and falling back to polls without
losing or repeating a line (``slurm_peer``: the driver as a real process, real sshd)."""

from __future__ import annotations

import asyncio
import itertools
import os
import time

from google.protobuf.timestamp_pb2 import Timestamp

from dlsched.v1 import driver_service_pb2 as dpb
from dlsched.v1 import driver_service_pb2_grpc, job_pb2
from tests import security
from tests.harness import ServiceProcess
from tests.slurm_peer import (
    CLUSTER,
    TICKS,
    configure_request,
    driver_fixtures,
    launch,
    logs,
    new_id,
    observe,
    scrape,
    single,
    wait_state,
)

cluster, driver, stub = driver_fixtures()


async def test_tail_lines_gives_the_last_lines_of_a_finished_job(stub):
    jid = new_id("taillines")
    # ~1.6 MiB of stdout: more than one read of the log file, so the tail has to come from its end
    code = "import sys\nfor i in range(20000):\n    print(f'line {i:05d} ' + 'x' * 70)\nprint('last', file=sys.stderr)"
    await launch(stub, jid, single(code))
    assert (await wait_state(stub, jid)).state == job_pb2.JOB_STATE_SUCCEEDED
    got = await logs(stub, jid, tail_lines=3)
    out = [e.text[:10] for e in got if e.stream == job_pb2.LOG_STREAM_STDOUT]
    assert out == ["line 19997", "line 19998", "line 19999"]
    assert [e.text for e in got if e.stream == job_pb2.LOG_STREAM_STDERR] == ["last"]
    assert len(await logs(stub, jid, tail_lines=3, streams=[job_pb2.LOG_STREAM_STDOUT])) == 3


async def test_logs_stream_while_the_job_runs(stub):
    jid = new_id("follow")
    code = "import time\nfor i in range(4):\n    print('tick', i, flush=True)\n    time.sleep(0.7)"
    await launch(stub, jid, single(code))
    got: list[str] = []
    seen_running = False
    req = dpb.TailJobLogsRequest(cluster=CLUSTER, job=dpb.JobRef(job_id=jid), follow=True)
    async for resp in stub.TailJobLogs(req, timeout=60):
        got.extend(e.text for e in resp.entries)
        if got and not seen_running:
            seen_running = (await observe(stub, jid)).state == job_pb2.JOB_STATE_RUNNING
    assert got == [f"tick {i}" for i in range(4)]
    assert seen_running  # the first lines came while it still ran
    assert (await observe(stub, jid)).state == job_pb2.JOB_STATE_SUCCEEDED


async def test_follow_keeps_odd_bytes_and_an_unterminated_last_line(stub):
    jid = new_id("bytes")
    code = ("import sys, time\nsys.stdout.buffer.write(b'a\\xff\\n'); sys.stdout.flush(); time.sleep(1)\n"
            "sys.stdout.write('end'); sys.stdout.flush(); time.sleep(1)")
    await launch(stub, jid, single(code))
    lines = [e.text for e in await logs(stub, jid, follow=True) if e.stream == job_pb2.LOG_STREAM_STDOUT]
    assert lines == ["a\ufffd", "end"]


def log_stream_pids() -> list[int]:
    """One pid per remote log-stream loop of the driver on this host (the login node here).
    sshd starts each channel's command in a session of its own, so a loop is a session: its
    forks (a stat, a subshell, one orphaned as the loop exits) share it and count once."""
    loops: dict[int, int] = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                argv = f.read().rstrip(b"\0").split(b"\0")
            if argv[-1:] != [b"dlsched-log-stream"]:
                continue
            with open(f"/proc/{pid}/stat") as f:
                sid = int(f.read().rsplit(")", 1)[1].split()[3])
        except (OSError, ValueError, IndexError):
            continue
        loops[sid] = min(int(pid), loops.get(sid, int(pid)))
    return sorted(loops.values())


async def wait_no_log_streams(within: float = 60.0) -> None:
    deadline = time.monotonic() + within
    left = await asyncio.to_thread(log_stream_pids)
    while left and time.monotonic() < deadline:
        await asyncio.sleep(0.2)
        left = await asyncio.to_thread(log_stream_pids)
    assert not left, f"remote log-stream loops outlived their followers: {left}"


async def test_a_follower_streams_on_one_channel_with_each_line_dated(cluster, tmp_path):
    """A follow costs one read and one long-lived stream (``tail`` calls in /metrics), not a
    command per poll; each line is dated by the log index when it was written (the ticks
    are 0.8 s apart, so one mtime for all would fail), and the stream ends with the job."""
    svc = ServiceProcess("drivers.slurm", ["--poll-interval", "0.3", "--metrics-listen", "127.0.0.1:0"],
                         name="slurm-driver-streams").start()
    try:
        async with security.channel(svc.address) as ch:
            s = driver_service_pb2_grpc.DriverServiceStub(ch)
            await s.ConfigureCluster(configure_request(cluster), timeout=30)
            jid = new_id("stream")
            await launch(s, jid, single(TICKS.format(n=5, gap=0.8)))
            t0 = time.time()
            got = await logs(s, jid, follow=True)
            took = time.time() - t0
            assert (await observe(s, jid)).state == job_pb2.JOB_STATE_SUCCEEDED
            tails = scrape(svc)
            await s.RemoveCluster(dpb.RemoveClusterRequest(cluster=CLUSTER), timeout=30)
    finally:
        svc.stop()
    assert [e.text for e in got] == [f"tick {i}" for i in range(5)]
    assert took > 3.0  # it followed the job while it ran
    calls = tails.get("tail/ok", 0) + tails.get("tail/error", 0)
    assert 2 <= calls <= 3, tails  # the first read, the stream (and at most one read before it)
    times = [e.time.ToNanoseconds() / 1e9 for e in got]
    assert all(t > 0 for t in times)
    gaps = [b - a for a, b in itertools.pairwise(times)]
    # Dated "to about a second": lines that one read finds before the job's log index covers
    # them share their file's mtime, so a gap may be 0; never backwards, and the 3.2 s the
    # ticks span shows.
    assert all(0 <= g < 2.5 for g in gaps), gaps
    assert 2.2 < times[-1] - times[0] < 4.4, times
    assert t0 - 5 < times[0] < times[-1] < time.time() + 1


async def test_since_time_keeps_the_lines_written_after_it(stub):
    jid = new_id("since")
    code = ("import time\nfor i in range(3):\n    print('early', i, flush=True)\ntime.sleep(3)\n"
            "for i in range(3):\n    print('late', i, flush=True)\nprint('late err', flush=True, file=__import__('sys').stderr)")
    await launch(stub, jid, single(code))
    assert (await wait_state(stub, jid)).state == job_pb2.JOB_STATE_SUCCEEDED
    every = await logs(stub, jid)
    early = [e.time.ToNanoseconds() for e in every if e.text.startswith("early")]
    late = [e.time.ToNanoseconds() for e in every if e.text.startswith("late")]
    assert len(early) == 3 and len(late) == 4 and max(early) + 2_000_000_000 < min(late), every
    since = Timestamp()
    since.FromNanoseconds((max(early) + min(late)) // 2)
    got = await logs(stub, jid, since_time=since)
    assert sorted(e.text for e in got) == ["late 0", "late 1", "late 2", "late err"]
    got = await logs(stub, jid, since_time=since, tail_lines=1, streams=[job_pb2.LOG_STREAM_STDOUT])
    assert [e.text for e in got] == ["late 2"]
    after = Timestamp()
    after.FromNanoseconds(max(late) + 5_000_000_000)
    assert await logs(stub, jid, since_time=after) == []
    assert [e.text for e in await logs(stub, jid, since_time=since, follow=True)
            if e.stream == job_pb2.LOG_STREAM_STDOUT] == ["late 0", "late 1", "late 2"]


async def test_more_followers_than_log_streams_each_get_every_line_once(stub):
    """12 followers of one job: 8 stream (the bound; never more remote loops than that), the
    rest read by polls; every follower gets every line exactly once, the job still ends
    (the control connection is never starved), and no remote loop outlives its follower."""
    await wait_no_log_streams()  # earlier tests' loops are gone before this one counts
    jid = new_id("fanout")
    await launch(stub, jid, single(TICKS.format(n=6, gap=0.5)))
    peak = 0

    async def sample() -> None:
        nonlocal peak
        while True:
            peak = max(peak, len(await asyncio.to_thread(log_stream_pids)))
            await asyncio.sleep(0.1)

    sampler = asyncio.create_task(sample())
    followers = [asyncio.create_task(logs(stub, jid, follow=True)) for _ in range(12)]
    try:  # sampled while all follow: as streams end, a poller may take a freed slot before the loop exits
        await asyncio.wait(followers, return_when=asyncio.FIRST_COMPLETED)
    finally:
        sampler.cancel()
    results = await asyncio.gather(*followers)
    for got in results:
        assert [e.text for e in got] == [f"tick {i}" for i in range(6)]
    assert peak == 8, peak  # the bound, used and never passed
    assert (await observe(stub, jid)).state == job_pb2.JOB_STATE_SUCCEEDED
    await wait_no_log_streams()


async def test_a_follower_that_leaves_ends_its_remote_loop(stub):
    jid = new_id("leave")
    await launch(stub, jid, single(TICKS.format(n=40, gap=0.25)))
    req = dpb.TailJobLogsRequest(cluster=CLUSTER, job=dpb.JobRef(job_id=jid), follow=True)
    call = stub.TailJobLogs(req, timeout=60)
    seen = 0
    async for resp in call:
        seen += len(resp.entries)
        if seen >= 3 and await asyncio.to_thread(log_stream_pids):
            break
    call.cancel()
    await wait_no_log_streams()
    await stub.TerminateJob(dpb.TerminateJobRequest(cluster=CLUSTER, job=dpb.JobRef(job_id=jid)), timeout=30)


async def test_a_stream_that_dies_falls_back_without_losing_or_repeating_a_line(stub):
    """The remote loop killed mid-job (as when the log connection drops): the follower goes on
    from the last whole round, by a poll and then a new stream."""
    jid = new_id("streamkill")
    await launch(stub, jid, single(TICKS.format(n=10, gap=0.4)))
    got: list[str] = []
    killed = False
    req = dpb.TailJobLogsRequest(cluster=CLUSTER, job=dpb.JobRef(job_id=jid), follow=True)
    async for resp in stub.TailJobLogs(req, timeout=60):
        got.extend(e.text for e in resp.entries)
        if not killed and len(got) >= 3 and (pids := await asyncio.to_thread(log_stream_pids)):
            for pid in pids:
                os.kill(pid, 9)
            killed = True
    assert killed
    assert got == [f"tick {i}" for i in range(10)]
