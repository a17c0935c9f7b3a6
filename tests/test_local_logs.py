"""The local driver's logs: follow, tail, since and stream filters, from the files the job's supervisor writes."""

from __future__ import annotations

import asyncio
import time

from dlsched.v1 import driver_service_pb2 as dpb
from dlsched.v1 import job_pb2
from tests.local_peer import (
    CLUSTER,
    driver_fixtures,
    launch,
    logs,
    new_id,
    observe,
    single,
    texts,
    wait_state,
)

state_dir, driver, stub = driver_fixtures()


async def test_logs_follow_arrive_line_by_line_and_end_with_the_job(stub):
    job_id = new_id("follow")
    code = "import time\nfor i in range(5):\n    print(f'{i} {time.time()}', flush=True)\n    time.sleep(0.3)\n"
    await launch(stub, job_id, single(code))
    arrivals: list[tuple[float, str]] = []
    req = dpb.TailJobLogsRequest(cluster=CLUSTER, job=dpb.JobRef(job_id=job_id), follow=True)

    async def follow() -> None:
        async for resp in stub.TailJobLogs(req):
            for e in resp.entries:
                arrivals.append((time.time(), e.text))

    await asyncio.wait_for(follow(), timeout=10)  # the stream ends by itself when the job ends
    obs = await observe(stub, job_id)
    assert obs.state == job_pb2.JOB_STATE_SUCCEEDED
    assert [t.split()[0] for _, t in arrivals] == ["0", "1", "2", "3", "4"]
    end = obs.end_time.seconds + obs.end_time.nanos / 1e9
    assert arrivals[0][0] < end - 1.0  # the first line came while the job still ran
    latencies = sorted(at - float(t.split()[1]) for at, t in arrivals)
    assert latencies[len(latencies) // 2] < 0.1, latencies
    assert latencies[-1] < 0.25, latencies


async def test_tail_lines_since_time_and_stream_filters(stub):
    job_id = new_id("tail")
    code = ("import sys, time\n"
            "for i in range(1, 6): print(f'line-{i}')\n"
            "sys.stdout.flush(); time.sleep(0.2)\n"
            "for i in range(6, 11): print(f'line-{i}')\n"
            "print('err-1', file=sys.stderr); print('err-2', file=sys.stderr)\n")
    await launch(stub, job_id, single(code))
    await wait_state(stub, job_id)
    everything = await logs(stub, job_id)
    assert texts(everything) == [f"line-{i}" for i in range(1, 11)]
    last = await logs(stub, job_id, tail_lines=3)
    assert texts(last) == ["line-8", "line-9", "line-10"]
    assert texts(last, job_pb2.LOG_STREAM_STDERR) == ["err-1", "err-2"]
    only_err = await logs(stub, job_id, streams=[job_pb2.LOG_STREAM_STDERR])
    assert {e.stream for e in only_err} == {job_pb2.LOG_STREAM_STDERR} and len(only_err) == 2
    line6 = next(e for e in everything if e.text == "line-6")
    since = await logs(stub, job_id, since_time=line6.time, streams=[job_pb2.LOG_STREAM_STDOUT])
    assert texts(since) == [f"line-{i}" for i in range(6, 11)]
    assert await logs(stub, job_id, role="other") == []
