"""Ray log tail latency: our driver's TailJobLogs follow next to Ray's own ``ray job logs --follow``.

    .venv/bin/python bench/bench_ray.py [--lines 240] [--strict]

Starts, in one run, a real Ray head (tests/ray_head.py, 2 CPUs) and the Ray
driver service as a process (``python -m drivers.ray`` with its default flags,
tests.harness.ServiceProcess), configures the head as a cluster and launches
one job that prints ``READY``, waits for both followers, then prints
``time.time()`` every 50 ms. Two followers read the SAME job at the same time:

- ours: a gRPC ``TailJobLogs(follow=True)`` stream from the driver;
- Ray's: ``.venv/bin/ray job logs --follow --address <dashboard>`` as a
  subprocess (``PYTHONUNBUFFERED=1``, so a pipe's block buffering is not
  counted against Ray), read line by line.

Latency of a line = the time the follower received it - the stamp in it (one
machine, one clock). Only stamps printed after both followers saw ``READY``
count. Prints p50/p99 of each, the ratio of Ray's p50 to ours and the target
(ours at least 4x lower p50). Bounded: every phase has a deadline and the whole
run takes about a minute; it exits non-zero only on an error (or, with
``--strict``, when the target is missed).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import pathlib
import statistics
import sys
import tempfile
import time
import uuid

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import grpc  # noqa: E402

from bench.stats import ms, pct  # noqa: E402
from dlsched.v1 import driver_service_pb2 as dpb  # noqa: E402
from dlsched.v1 import driver_service_pb2_grpc, job_pb2  # noqa: E402
from tests import security  # noqa: E402  (TLS certificates and tokens, as in the tests)
from tests.harness import ServiceProcess  # noqa: E402
from tests.ray_head import RayHead, ray_available  # noqa: E402

PY = sys.executable
RAY = os.path.join(os.path.dirname(PY), "ray")
CLUSTER = "clusters/ray-bench"
TARGET_RATIO = 4.0
TERMINAL = (job_pb2.JOB_STATE_SUCCEEDED, job_pb2.JOB_STATE_FAILED, job_pb2.JOB_STATE_STOPPED)


def job_code(go_file: str, lines: int) -> str:
    """READY, then (once both followers saw it, or after 20 s) a stamp every 50 ms."""
    return ("import os, time\n"
            "print('READY', flush=True)\n"
            "t = time.monotonic() + 20\n"
            f"while not os.path.exists({go_file!r}) and time.monotonic() < t:\n"
            "    time.sleep(0.02)\n"
            f"for _ in range({lines}):\n"
            "    print(repr(time.time()), flush=True)\n"
            "    time.sleep(0.05)\n"
            "print('DONE', flush=True)\n")


class Follower:
    """Samples of one follower; ``ready`` is set when it saw READY."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.ready = asyncio.Event()
        self.ready_at = 0.0
        self.samples: list[tuple[float, float]] = []  # (stamp, received)
        self.done = False

    def line(self, text: str, now: float) -> None:
        text = text.strip()
        if text == "READY" and not self.ready.is_set():
            self.ready_at = now
            self.ready.set()
        elif text == "DONE":
            self.done = True
        else:
            with contextlib.suppress(ValueError):
                self.samples.append((float(text), now))

    def latencies(self, after: float) -> list[float]:
        return [now - stamp for stamp, now in self.samples if stamp >= after]


async def follow_ours(stub: driver_service_pb2_grpc.DriverServiceStub, job_id: str, f: Follower,
                      deadline: float) -> None:
    req = dpb.TailJobLogsRequest(cluster=CLUSTER, job=dpb.JobRef(job_id=job_id), follow=True)
    async for resp in stub.TailJobLogs(req, timeout=deadline):
        now = time.time()
        for e in resp.entries:
            f.line(e.text, now)


async def follow_ray(address: str, sid: str, f: Follower, deadline: float) -> int:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "RAY_USAGE_STATS_ENABLED": "0"}
    env.pop("RAY_ADDRESS", None)
    proc = await asyncio.create_subprocess_exec(
        RAY, "job", "logs", "--follow", "--address", address, sid,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL, env=env)
    assert proc.stdout is not None
    try:
        async with asyncio.timeout(deadline):
            while line := await proc.stdout.readline():
                f.line(line.decode(errors="replace"), time.time())
            return await proc.wait()
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


async def wait_state(stub: driver_service_pb2_grpc.DriverServiceStub, job_id: str, states: tuple[int, ...],
                     within: float) -> int:
    deadline = time.monotonic() + within
    while True:
        resp = await stub.BatchGetJobObservations(dpb.BatchGetJobObservationsRequest(
            cluster=CLUSTER, jobs=[dpb.JobRef(job_id=job_id)]), timeout=10)
        state = resp.observations[0].state
        if state in states or time.monotonic() > deadline:
            return state
        await asyncio.sleep(0.1)


async def launch(stub: driver_service_pb2_grpc.DriverServiceStub, req: dpb.LaunchJobRequest, within: float) -> str:
    """LaunchJob, retried while the head is slow to answer (a launch is idempotent per attempt)."""
    deadline = time.monotonic() + within
    while True:
        try:
            return (await stub.LaunchJob(req, timeout=30)).backend_job_id
        except grpc.aio.AioRpcError as e:
            if e.code() != grpc.StatusCode.UNAVAILABLE or time.monotonic() > deadline:
                raise RuntimeError(f"LaunchJob failed: {e.code().name} {e.details()}") from e
            print(f"LaunchJob: {e.details()}; retrying", file=sys.stderr)
            await asyncio.sleep(1)


async def measure(head: RayHead, driver: ServiceProcess, lines: int, tmp: str,
                  ) -> tuple[Follower, Follower, float, int]:
    async with security.channel(driver.address) as ch:
        stub = driver_service_pb2_grpc.DriverServiceStub(ch)
        await stub.ConfigureCluster(dpb.ConfigureClusterRequest(
            cluster=CLUSTER, address=head.address, options={"python": PY}), timeout=30)
        job_id = f"bench-{uuid.uuid4().hex[:6]}"
        go = os.path.join(tmp, "go")
        spec = job_pb2.JobSpec(run_mode=job_pb2.RUN_MODE_SINGLE_PROCESS, replica_groups=[job_pb2.ReplicaGroup(
            role="main", replicas=1, command=[PY, "-u", "-c"], args=[job_code(go, lines)])])
        sid = await launch(stub, dpb.LaunchJobRequest(cluster=CLUSTER, job_id=job_id, spec=spec, attempt=1), 90)
        state = await wait_state(stub, job_id, (job_pb2.JOB_STATE_RUNNING, *TERMINAL), 60)
        if state != job_pb2.JOB_STATE_RUNNING:
            raise RuntimeError(f"the bench job did not start: {job_pb2.JobState.Name(state)}")
        ours, ray = Follower("dlsched TailJobLogs"), Follower("ray job logs --follow")
        bound = 30 + lines * 0.05 + 30
        tasks = [asyncio.create_task(follow_ours(stub, job_id, ours, bound)),
                 asyncio.create_task(follow_ray(head.address, sid, ray, bound))]
        try:
            await asyncio.wait_for(asyncio.gather(ours.ready.wait(), ray.ready.wait()), 30)
        except TimeoutError:
            for t in tasks:
                t.cancel()
            raise RuntimeError(f"a follower never saw READY (ours {ours.ready.is_set()}, "
                               f"ray {ray.ready.is_set()})") from None
        after = time.time()
        await asyncio.to_thread(pathlib.Path(go).touch)  # the job starts stamping
        results = await asyncio.gather(*tasks, return_exceptions=True)
        for r in results:
            if isinstance(r, BaseException):
                raise RuntimeError(f"a follower failed: {r!r}") from r
        final = await wait_state(stub, job_id, TERMINAL, 30)
        with contextlib.suppress(grpc.aio.AioRpcError):
            await stub.CleanupJob(dpb.CleanupJobRequest(cluster=CLUSTER, job=dpb.JobRef(job_id=job_id)),
                                  timeout=30)
        return ours, ray, after, final


async def run(args: argparse.Namespace) -> int:
    if not ray_available():
        print("error: ray is not installed next to this Python (pip install 'ray[default]')", file=sys.stderr)
        return 1
    tmp = tempfile.mkdtemp(prefix="dlsched-bench-ray-")
    head = await asyncio.to_thread(RayHead().start)
    driver: ServiceProcess | None = None
    try:
        driver = ServiceProcess("drivers.ray", args.driver_args, name="ray-driver").start()
        print(f"ray head {head.address}, driver {driver.address}", file=sys.stderr)
        ours, ray, after, final = await measure(head, driver, args.lines, tmp)
    finally:
        if driver is not None:
            driver.stop()
        await asyncio.to_thread(head.stop)

    lat_ours, lat_ray = ours.latencies(after), ray.latencies(after)
    print()
    print(f"Ray log tail latency: one job, {args.lines} stamps 50 ms apart, both followers on it at once "
          f"({os.cpu_count()} CPUs; job ended {job_pb2.JobState.Name(final)})")
    print(f"{'follower':<34}{'p50':>11}  {'p99':>11}  {'mean':>11}  samples")
    for f, xs in ((ours, lat_ours), (ray, lat_ray)):
        mean = statistics.mean(xs) if xs else float("nan")
        print(f"{f.name:<34}{ms(pct(xs, 50))}  {ms(pct(xs, 99))}  {ms(mean)}  {len(xs)}"
              f"{'' if f.done else '  (never saw DONE)'}")
    ratio = pct(lat_ray, 50) / pct(lat_ours, 50) if lat_ours and lat_ray else float("nan")
    met = ratio >= TARGET_RATIO
    print()
    print(f"p50 ratio (ray / ours): {ratio:.1f}x   target >= {TARGET_RATIO:.0f}x   {'met' if met else 'MISSED'}")
    missing = [f.name for f, xs in ((ours, lat_ours), (ray, lat_ray)) if len(xs) < args.lines * 0.9]
    if missing:
        print(f"warning: fewer than 90% of the {args.lines} stamps reached: {', '.join(missing)}", file=sys.stderr)
    return 0 if met or not args.strict else 1


def main() -> None:
    security.install()
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--lines", type=int, default=240, help="stamps printed by the job, 50 ms apart (default 240)")
    p.add_argument("--driver-args", nargs=argparse.REMAINDER, default=[],
                   help="flags for python -m drivers.ray (default: its own defaults); must come last")
    p.add_argument("--strict", action="store_true", help="exit 1 when the target is missed")
    args = p.parse_args()
    try:
        sys.exit(asyncio.run(asyncio.wait_for(run(args), 150)))
    except TimeoutError:
        print("error: the benchmark ran past its 150 s bound", file=sys.stderr)
        sys.exit(1)
    except RuntimeError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
