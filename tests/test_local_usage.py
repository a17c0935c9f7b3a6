"""The local driver's usage: CPU and memory of a job's processes from /proc."""

from __future__ import annotations

import asyncio
import time

from dlsched.v1 import driver_service_pb2 as dpb
from tests.local_peer import (
    CLUSTER,
    driver_fixtures,
    launch,
    new_id,
    single,
    wait_state,
)

state_dir, driver, stub = driver_fixtures()


async def test_usage_reports_cpu_and_memory_of_a_busy_process(stub):
    job_id = new_id("usage")
    # a second of CPU, not of wall time (on a busy machine a second may hold little CPU)
    code = "import time\nwhile time.process_time() < 1.0: pass\ntime.sleep(30)\n"
    await launch(stub, job_id, single(code))
    deadline = time.monotonic() + 60
    while True:
        resp = await stub.MeasureJobUsage(dpb.MeasureJobUsageRequest(cluster=CLUSTER, job=dpb.JobRef(job_id=job_id)), timeout=10)
        [u] = resp.usage.replicas
        if u.cpu_seconds > 0.3 or time.monotonic() > deadline:
            break
        await asyncio.sleep(0.1)
    assert u.running and u.cpu_seconds > 0.3
    assert u.memory_bytes > 1 << 20 and u.peak_memory_bytes >= u.memory_bytes
    assert (u.role, u.replica_index) == ("main", 0)
    await stub.TerminateJob(dpb.TerminateJobRequest(cluster=CLUSTER, job=dpb.JobRef(job_id=job_id),
                                                    grace_period={}), timeout=10)
    await wait_state(stub, job_id)
    resp = await stub.MeasureJobUsage(dpb.MeasureJobUsageRequest(cluster=CLUSTER, job=dpb.JobRef(job_id=job_id)), timeout=10)
    assert not resp.usage.replicas[0].running
