"""Ray log follow (latency, bytes fetched) and usage sampling cost, next to Ray's own ``ray job logs --follow``.

    .venv/bin/python bench/bench_ray.py [--part latency|bytes|usage|all] [--lines 240] [--strict]

Starts, in one run, a real Ray head (tests/ray_head.py, 2 CPUs) and the Ray
driver service as a process (``python -m drivers.ray`` with its default flags,
tests.harness.ServiceProcess), configures the head as a cluster and launches
one job that prints ``READY``, waits for both followers, then prints
``time.time()`` every 50 ms. Two followers read the SAME job at the same time:

- ours: a gRPC ``TailJobLogs(follow=True)`` stream from the driver;
- Ray's: ``.venv/bin/ray job logs --follow --address <dashboard>`` as a
  subprocess (``PYTHONUNBUFFERED=1``, so a pipe's block buffering is not
  counted against Ray), read line by line. It follows a twin of the job
  submitted to Ray directly (same program, same ``go`` file): a dlsched
  job's output is in the launcher's per-process files, not in the Ray job
  log that command reads.

Latency of a line = the time the follower received it - the stamp in it (one
machine, one clock). Only stamps printed after both followers saw ``READY``
count. Prints p50/p99 of each, the ratio of Ray's p50 to ours and the target
(ours at least 4x lower p50, ours <= 100 ms).

Bytes (``--part bytes``): per log size (1, 10 and 100 MB written before the
followers attach), a job then writes ``RATE`` lines of 100 bytes a second for
``STEADY_SECONDS``; ours follows with ``tail_lines=10`` (``dlsched logs -f
--tail 10``), Ray's CLI as above. Bytes fetched per follower per second in
that window: ours from the driver's ``dlsched_backend_bytes_fetched_total``
(its /metrics), Ray's CLI as the bytes it printed (its websocket sends the new
lines); target: flat over the sizes and <= 2x the bytes the job wrote a second.
Also the bytes each fetched to attach (until it saw READY, and 1 s more): ours the last 10
lines of the file and a resume window of ``drivers.ray.logs.RESUME_LINES``
lines (here 1 KB each), Ray's CLI the whole log.

Usage (``--part usage``): a job of one sleeping process for ``USAGE_SECONDS``;
the launcher's own CPU time (``/proc/<pid>/stat`` of the process running
``drivers.ray.launcher`` for that submission) over the run, as a share of one
core (its sampler scans /proc once a second); target <= 1 %.

Bounded: every phase has a deadline; it exits non-zero only on an error (or,
with ``--strict``, when a target is missed).
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
from typing import Any

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
TARGET_P50 = 0.100
SIZES_MB = (1, 10, 100)
RATE = 100  # lines a second in the bytes window
LINE_BYTES = 100
STEADY_SECONDS = 6.0
USAGE_SECONDS = 12.0
TARGET_USAGE_SHARE = 0.01
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
            if e.code() not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED) \
                    or time.monotonic() > deadline:
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
        await launch(stub, dpb.LaunchJobRequest(cluster=CLUSTER, job_id=job_id, spec=spec, attempt=1), 90)
        sid = await asyncio.to_thread(submit_twin, head, job_code(go, lines))
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


def submit_twin(head: RayHead, code: str) -> str:
    """The same program as a plain Ray job (``POST /api/jobs/``), for ``ray job logs --follow``."""
    import json
    import shlex
    import urllib.request

    sid = f"bench-twin-{uuid.uuid4().hex[:6]}"
    body = json.dumps({"entrypoint": shlex.join([PY, "-u", "-c", code]), "submission_id": sid}).encode()
    req = urllib.request.Request(f"{head.address}/api/jobs/", data=body, method="POST",
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as r:
        r.read()
    return sid


def loud_code(go_file: str, history_bytes: int) -> str:
    """``history_bytes`` of 1 KB lines, READY, then (on ``go``) RATE lines of 100 bytes a second, DONE."""
    return ("import os, sys, time\n"
            "out = sys.stdout\n"
            f"for i in range({history_bytes // 1024}):\n"
            "    out.write('%09d ' % i + 'h' * 1013 + '\\n')\n"
            "out.write('READY\\n'); out.flush()\n"
            "t = time.monotonic() + 120\n"
            f"while not os.path.exists({go_file!r}) and time.monotonic() < t:\n"
            "    time.sleep(0.02)\n"
            f"for i in range({int(RATE * STEADY_SECONDS)}):\n"
            f"    out.write('%09d ' % i + 's' * {LINE_BYTES - 11} + '\\n'); out.flush()\n"
            f"    time.sleep({1 / RATE})\n"
            "out.write('DONE\\n'); out.flush()\n")


def fetched(driver: ServiceProcess) -> float:
    """The driver's ``dlsched_backend_bytes_fetched_total`` (every call), from its /metrics."""
    import urllib.request

    with open(driver.port_file + ".metrics") as f:
        url = f"http://{f.read().strip()}/metrics"
    with urllib.request.urlopen(url, timeout=10) as r:
        text = r.read().decode()
    return sum(float(ln.rsplit(" ", 1)[1]) for ln in text.splitlines()
               if ln.startswith("dlsched_backend_bytes_fetched_total{") and 'backend="ray"' in ln)


class Counted:
    """A follower's marks: bytes at READY and at go / DONE (``bytes`` is read by ``count``)."""

    def __init__(self, name: str, count: Any) -> None:
        self.name, self.count = name, count
        self.ready, self.done = asyncio.Event(), asyncio.Event()
        self.at_start = count()
        self.at_ready = self.at_go = self.at_done = 0.0
        self.t_go = self.t_done = 0.0

    def line(self, text: str) -> None:
        text = text.strip()
        if text == "READY" and not self.ready.is_set():
            self.at_ready = self.count()
            self.ready.set()
        elif text == "DONE" and not self.done.is_set():
            self.at_done, self.t_done = self.count(), time.monotonic()
            self.done.set()


async def measure_bytes(stub: driver_service_pb2_grpc.DriverServiceStub, head: RayHead, driver: ServiceProcess,
                        size_mb: int, tmp: str) -> tuple[Counted, Counted]:
    job_id = f"bytes-{size_mb}-{uuid.uuid4().hex[:6]}"
    go = os.path.join(tmp, f"go-{job_id}")
    spec = job_pb2.JobSpec(run_mode=job_pb2.RUN_MODE_SINGLE_PROCESS, replica_groups=[job_pb2.ReplicaGroup(
        role="main", replicas=1, command=[PY, "-u", "-c"], args=[loud_code(go, size_mb << 20)])])
    await launch(stub, dpb.LaunchJobRequest(cluster=CLUSTER, job_id=job_id, spec=spec, attempt=1), 90)
    sid = await asyncio.to_thread(submit_twin, head, loud_code(go, size_mb << 20))
    if await wait_state(stub, job_id, (job_pb2.JOB_STATE_RUNNING, *TERMINAL), 60) != job_pb2.JOB_STATE_RUNNING:
        raise RuntimeError("the bytes job did not start")
    deadline = time.monotonic() + 120
    while True:  # attach once the history is written: its last line is READY
        req = dpb.TailJobLogsRequest(cluster=CLUSTER, job=dpb.JobRef(job_id=job_id), tail_lines=1)
        last = [e.text async for r in stub.TailJobLogs(req, timeout=30) for e in r.entries]
        if last == ["READY"]:
            break
        if time.monotonic() > deadline:
            raise RuntimeError(f"{size_mb} MB: the history was not written in time")
        await asyncio.sleep(0.5)
    printed = [0.0]
    ours = Counted("dlsched TailJobLogs --tail 10", lambda: fetched(driver))
    ray = Counted("ray job logs --follow", lambda: printed[0])

    async def follow_ours_() -> None:
        req = dpb.TailJobLogsRequest(cluster=CLUSTER, job=dpb.JobRef(job_id=job_id), follow=True, tail_lines=10)
        async for resp in stub.TailJobLogs(req, timeout=240):
            for e in resp.entries:
                ours.line(e.text)

    async def follow_ray_() -> None:
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "RAY_USAGE_STATS_ENABLED": "0"}
        env.pop("RAY_ADDRESS", None)
        proc = await asyncio.create_subprocess_exec(
            RAY, "job", "logs", "--follow", "--address", head.address, sid,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL, env=env, limit=1 << 22)
        assert proc.stdout is not None
        try:
            while line := await proc.stdout.readline():
                printed[0] += len(line)
                ray.line(line.decode(errors="replace"))
                if ray.done.is_set():
                    break
        finally:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()

    tasks = [asyncio.create_task(follow_ours_()), asyncio.create_task(follow_ray_())]
    try:
        await asyncio.wait_for(asyncio.gather(ours.ready.wait(), ray.ready.wait()), 180)
        await asyncio.sleep(1.0)  # let both settle on the end of the file
        for f in (ours, ray):
            f.at_go, f.t_go = f.count(), time.monotonic()
        await asyncio.to_thread(pathlib.Path(go).touch)
        await asyncio.wait_for(asyncio.gather(ours.done.wait(), ray.done.wait()), 60)
    except TimeoutError:
        raise RuntimeError(f"{size_mb} MB: a follower never got READY/DONE (ours {ours.ready.is_set()}/"
                           f"{ours.done.is_set()}, ray {ray.ready.is_set()}/{ray.done.is_set()})") from None
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        with contextlib.suppress(grpc.aio.AioRpcError):
            await stub.CleanupJob(dpb.CleanupJobRequest(cluster=CLUSTER, job=dpb.JobRef(job_id=job_id)), timeout=60)
    return ours, ray


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat", "rb") as f:
        fields = f.read().rsplit(b")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def launcher_pid(sid: str) -> int:
    """The launcher of submission ``sid``: the process running ``drivers.ray.launcher`` with that job."""
    needle = f'"submission_id":"{sid}"'.encode()
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        with contextlib.suppress(OSError):
            with open(f"/proc/{name}/cmdline", "rb") as f:
                if b"drivers.ray.launcher" not in f.read().split(b"\0"):  # python -m ..., not sh -c "..."
                    continue
            with open(f"/proc/{name}/environ", "rb") as f:
                if needle in f.read():
                    return int(name)
    raise RuntimeError(f"no launcher process of {sid} on this machine")


async def measure_usage(stub: driver_service_pb2_grpc.DriverServiceStub, head: RayHead) -> tuple[float, float]:
    """(launcher CPU seconds, wall seconds) over a sleeping job's run."""
    job_id = f"usage-{uuid.uuid4().hex[:6]}"
    spec = job_pb2.JobSpec(run_mode=job_pb2.RUN_MODE_SINGLE_PROCESS, replica_groups=[job_pb2.ReplicaGroup(
        role="main", replicas=1, command=[PY, "-c", f"import time; time.sleep({USAGE_SECONDS})"])])
    sid = await launch(stub, dpb.LaunchJobRequest(cluster=CLUSTER, job_id=job_id, spec=spec, attempt=1), 90)
    if await wait_state(stub, job_id, (job_pb2.JOB_STATE_RUNNING, *TERMINAL), 60) != job_pb2.JOB_STATE_RUNNING:
        raise RuntimeError("the usage job did not start")

    await asyncio.sleep(2.0)  # past its start (imports)
    pid = await asyncio.to_thread(launcher_pid, sid)
    c0, t0 = cpu_seconds(pid), time.monotonic()
    await asyncio.sleep(USAGE_SECONDS - 4)
    c1, t1 = cpu_seconds(pid), time.monotonic()
    await wait_state(stub, job_id, TERMINAL, 60)
    with contextlib.suppress(grpc.aio.AioRpcError):
        await stub.CleanupJob(dpb.CleanupJobRequest(cluster=CLUSTER, job=dpb.JobRef(job_id=job_id)), timeout=60)
    return c1 - c0, t1 - t0


async def bytes_and_usage(head: RayHead, driver: ServiceProcess, parts: set[str], tmp: str) -> bool:
    met = True
    async with security.channel(driver.address) as ch:
        stub = driver_service_pb2_grpc.DriverServiceStub(ch)
        await stub.ConfigureCluster(dpb.ConfigureClusterRequest(
            cluster=CLUSTER, address=head.address, options={"python": PY}), timeout=30)
        if "bytes" in parts:
            written = RATE * (LINE_BYTES + 1)
            print()
            print(f"Bytes fetched from Ray per follower per second while the job writes {written} B/s "
                  f"({RATE} lines of {LINE_BYTES} B), after a log of 1/10/100 MB; target <= {2 * written} B/s, flat")
            print(f"{'log':>6}  {'follower':<32}{'attach bytes':>14}{'bytes/s':>12}{'x written':>11}")
            for size in SIZES_MB:
                ours, ray = await measure_bytes(stub, head, driver, size, tmp)
                for f in (ours, ray):
                    rate = (f.at_done - f.at_go) / max(1e-9, f.t_done - f.t_go)
                    print(f"{size:>4}MB  {f.name:<32}{f.at_go - f.at_start:>14.0f}{rate:>12.0f}"
                          f"{rate / written:>10.2f}x")
                    if f is ours and rate > 2 * written:
                        met = False
        if "usage" in parts:
            cpu, wall = await measure_usage(stub, head)
            share = cpu / wall
            print()
            print(f"Launcher CPU while its process sleeps (sampling every second): {cpu:.3f} s over {wall:.1f} s "
                  f"= {share * 100:.2f} % of a core   target <= {TARGET_USAGE_SHARE * 100:.0f} %   "
                  f"{'met' if share <= TARGET_USAGE_SHARE else 'MISSED'}")
            met = met and share <= TARGET_USAGE_SHARE
    return met


async def run(args: argparse.Namespace) -> int:
    if not ray_available():
        print("error: ray is not installed next to this Python (pip install 'ray[default]')", file=sys.stderr)
        return 1
    parts = {"latency", "bytes", "usage"} if args.part == "all" else {args.part}
    tmp = tempfile.mkdtemp(prefix="dlsched-bench-ray-")
    head = await asyncio.to_thread(RayHead().start)
    driver: ServiceProcess | None = None
    met = True
    try:
        driver = ServiceProcess("drivers.ray", ["--metrics-listen", "127.0.0.1:0", *args.driver_args],
                                name="ray-driver").start()
        print(f"ray head {head.address}, driver {driver.address}", file=sys.stderr)
        if "latency" in parts:
            met = report_latency(args, *await measure(head, driver, args.lines, tmp))
        if parts & {"bytes", "usage"}:
            met = await bytes_and_usage(head, driver, parts, tmp) and met
    finally:
        if driver is not None:
            driver.stop()
        await asyncio.to_thread(head.stop)
    return 0 if met or not args.strict else 1


def report_latency(args: argparse.Namespace, ours: Follower, ray: Follower, after: float, final: int) -> bool:
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
    met = ratio >= TARGET_RATIO and bool(lat_ours) and pct(lat_ours, 50) <= TARGET_P50
    print()
    print(f"p50 ratio (ray / ours): {ratio:.1f}x   target >= {TARGET_RATIO:.0f}x and ours <= "
          f"{TARGET_P50 * 1000:.0f} ms   {'met' if met else 'MISSED'}")
    missing = [f.name for f, xs in ((ours, lat_ours), (ray, lat_ray)) if len(xs) < args.lines * 0.9]
    if missing:
        print(f"warning: fewer than 90% of the {args.lines} stamps reached: {', '.join(missing)}", file=sys.stderr)
    return met


def main() -> None:
    security.install()
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--lines", type=int, default=240, help="stamps printed by the job, 50 ms apart (default 240)")
    p.add_argument("--driver-args", nargs=argparse.REMAINDER, default=[],
                   help="flags for python -m drivers.ray (default: its own defaults); must come last")
    p.add_argument("--part", choices=("latency", "bytes", "usage", "all"), default="all",
                   help="what to measure (default all)")
    p.add_argument("--strict", action="store_true", help="exit 1 when a target is missed")
    args = p.parse_args()
    bound = 900
    try:
        sys.exit(asyncio.run(asyncio.wait_for(run(args), bound)))
    except TimeoutError:
        print(f"error: the benchmark ran past its {bound} s bound", file=sys.stderr)
        sys.exit(1)
    except RuntimeError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
