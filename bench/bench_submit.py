"""The submit path (issue 18 items 4, 5): SubmitJob against bare baselines, in one run.

    .venv/bin/python bench/bench_submit.py [--jobs 1000] [--latency-jobs 30]
                                           [--rss-jobs 200] [--slurm] [--slurm-jobs 40]

Starts its own etcd and the local stack as processes (tests.harness; TLS and
tokens as in the tests) and measures:

- SubmitJob throughput and latency at concurrency 1, 8 and 64, next to a bare
  etcd put of a job-sized value and a bare grpc.aio echo (another process, the
  same TLS, a response of a SubmitJob's size) at the same concurrency. SubmitJob
  answers once the job is stored; the launches queue behind it. So the rows
  measure the submit path alone, the local driver is paused (SIGSTOP) for them:
  LaunchJob calls wait (at most ``max_concurrent_launches`` in flight, the rest
  queued in JobManager) and no process is spawned. Then JobManager is killed, the
  jobs are removed from etcd and everything resumes. Target: >= 500 jobs/s at 64;
- SubmitJob -> backend id on the local driver (live): from the call to the
  WatchJobs event that carries the backend id, one job at a time, beside
  SubmitJob's own latency;
- the local driver's memory per job: bytes per tracked job (tracemalloc over
  1,000 of the driver's job records built in this process), and the driver
  process's RSS after two rounds of ``--rss-jobs`` real jobs that ran, ended
  and were forgotten (ForgetJobs): the second round's growth per job.
  Target: <= 2 KiB per tracked job;
- with ``--slurm`` (root, Debian's slurm packages): a one-node Slurm behind sshd
  (tests.slurm_cluster), the Slurm driver, the cluster registered through
  ClusterManager; SubmitJob -> backend id (WatchJobs) one for one interleaved
  with a bare ``sbatch --parsable`` of the same script on a persistent asyncssh
  connection. Target: p50 <= 1.2x.

``BENCH_JM_ARGS`` adds JobManager flags, e.g. ``--data-dir DIR`` (the job
history on, as under ``dlsched up``: a retried submit's request id is also
looked up there).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import os
import pathlib
import shlex
import signal
import subprocess
import sys
import tempfile
import time
import tracemalloc
import uuid
from collections.abc import Awaitable, Callable

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.bench_scale import ECHO_SERVER, rss_mb  # noqa: E402
from bench.stats import ms, pct  # noqa: E402
from dlsched.client import ClusterManagerClient, JobManagerClient  # noqa: E402
from dlsched.kit import etcd as etcd_kit  # noqa: E402
from dlsched.v1 import cluster_pb2, driver_service_pb2_grpc, job_pb2  # noqa: E402
from dlsched.v1 import driver_service_pb2 as dpb  # noqa: E402
from tests import security  # noqa: E402
from tests.harness import EtcdServer, ServiceProcess, Stack, metrics_samples, sample  # noqa: E402

PY = sys.executable
TARGET_JOBS_PER_S = 500
TARGET_BYTES_PER_JOB = 2048
TARGET_SLURM_RATIO = 1.2
BOUND_S = 600


def spec(command: list[str], label: str, cluster: str = "local", cpu: float = 0) -> job_pb2.JobSpec:
    return job_pb2.JobSpec(
        run_mode=job_pb2.RUN_MODE_SINGLE_PROCESS,
        replica_groups=[job_pb2.ReplicaGroup(role="main", replicas=1, command=command,
                                             resources=job_pb2.Resources(cpu=cpu) if cpu else None)],
        cluster_selector=job_pb2.ClusterSelector(cluster=cluster), labels={"bench": label})


async def rate(call: Callable[[int], Awaitable[object]], n: int, concurrency: int) -> tuple[float, list[float]]:
    """``n`` calls, ``concurrency`` in flight: (calls/s, latencies)."""
    lat: list[float] = []
    it = iter(range(n))

    async def worker() -> None:
        for i in it:
            s = time.perf_counter()
            await call(i)
            lat.append(time.perf_counter() - s)

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return n / (time.perf_counter() - t0), lat


class Launched:
    """One WatchJobs stream: when each job was first seen with a backend id."""

    def __init__(self, jm: JobManagerClient, label: str) -> None:
        self.jm, self.label = jm, label
        self.at: dict[str, float] = {}
        #: the server's own clock: create_time -> update_time of the event that carried the id
        self.server: dict[str, float] = {}
        self.waiters: dict[str, asyncio.Event] = {}
        self.ready = asyncio.Event()
        self.task = asyncio.create_task(self._run())

    async def _run(self) -> None:
        async for ev in self.jm.watch_jobs(filter=f"labels.bench={self.label}"):
            if ev.type == job_pb2.WATCH_EVENT_TYPE_SNAPSHOT_COMPLETE:
                self.ready.set()
            elif ev.job.backend_job_id and ev.job.name not in self.at:
                self.at[ev.job.name] = time.perf_counter()
                self.server[ev.job.name] = (ev.job.update_time.ToNanoseconds()
                                            - ev.job.create_time.ToNanoseconds()) / 1e9
                self.waiters.setdefault(ev.job.name, asyncio.Event()).set()

    async def wait(self, name: str, within: float = 60) -> float:
        await asyncio.wait_for(self.waiters.setdefault(name, asyncio.Event()).wait(), within)
        return self.at[name]

    async def close(self) -> None:
        self.task.cancel()
        await asyncio.gather(self.task, return_exceptions=True)


def tracked_job_bytes(n: int) -> float:
    """tracemalloc bytes per local-driver job record (what the driver holds per tracked job)."""
    from drivers.common import convert
    from drivers.local import render
    from drivers.local.tracked import TrackedJob as _Job

    with tempfile.TemporaryDirectory() as state:
        pb = spec([PY, "-c", "print(1)"], "mem")
        s = convert.job_spec(pb, True)
        requests = [render.render_job(f"mem-{i:06d}", s, attempt=1, state_dir=state, mpirun=None, mpirun_args=[])
                    for i in range(n)]
        gc.collect()
        tracemalloc.start()
        before = tracemalloc.take_snapshot()
        jobs = [_Job(state, "clusters/local", f"mem-{i:06d}", 1, r.plan(), (1.0, 0))
                for i, r in enumerate(requests)]
        gc.collect()
        after = tracemalloc.take_snapshot()
        tracemalloc.stop()
        total = sum(st.size_diff for st in after.compare_to(before, "filename"))
        del jobs
        return total / n


async def submit_phase(args: argparse.Namespace, stack: Stack, etcd: EtcdServer, sec: security.TestSecurity,
                       ) -> list[tuple[int, float, float, float, list[float], float]]:
    """(concurrency, echo/s, etcd put/s, SubmitJob/s, SubmitJob latencies, SubmitJob/s of
    distinct specs) with the driver paused."""
    assert stack.jm is not None and stack.driver.proc is not None
    tiny = spec(["true"], "submit")
    echo = subprocess.Popen([PY, "-c", ECHO_SERVER, sec.service.cert_file, sec.service.key_file,  # noqa: ASYNC220
                             sec.ca.cert_file], stdout=subprocess.PIPE, cwd=str(ROOT),
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    client = await etcd_kit.connect(etcd.endpoint)
    rows = []
    try:
        assert echo.stdout is not None
        port = int(echo.stdout.readline())
        async with JobManagerClient(stack.jm.address) as jm, security.channel(f"127.0.0.1:{port}") as ech:
            sample_job = (await jm.submit_job(tiny)).job  # warm; also the size of a response
            body = sample_job.SerializeToString()
            echo_call = ech.unary_unary("/bench.Echo/Echo")
            prefix = f"/bench-put-{uuid.uuid4().hex[:6]}/"
            # paused before the warm-up: the warm jobs' launches would spawn processes that load
            # the CPUs during the first rows (the baselines' too)
            stack.driver.proc.send_signal(signal.SIGSTOP)
            try:
                for _ in range(20):  # warm every path
                    await echo_call(body, timeout=10)
                    await client.put(f"{prefix}warm".encode(), body)
                    await jm.submit_job(tiny)
                for c in (1, 8, 64):
                    n = args.jobs if c > 1 else max(50, args.jobs // 5)
                    e_rate, _ = await rate(lambda i: echo_call(body, timeout=10), n, c)
                    p_rate, _ = await rate(lambda i, c=c: client.put(f"{prefix}{c}-{i}".encode(), body), n, c)
                    s_rate, s_lat = await rate(lambda i: jm.submit_job(tiny), n, c)
                    # every spec different (an argument per job): no two matches are alike
                    d_rate, _ = await rate(lambda i, c=c: jm.submit_job(spec(["true", f"{c}-{i}"], "submit")), n, c)
                    rows.append((c, e_rate, p_rate, s_rate, s_lat, d_rate))
                    print(f"concurrency {c}: echo {e_rate:.0f}/s, etcd put {p_rate:.0f}/s, "
                          f"SubmitJob {s_rate:.0f}/s (distinct specs {d_rate:.0f}/s)", file=sys.stderr)
            finally:
                # Nothing of this phase may run: drop JobManager and its jobs, then resume the driver.
                stack.jm.kill()
                await client.delete_prefix(f"{stack.prefix}jobs/".encode())
                await client.delete_prefix(f"{stack.prefix}job-requests/".encode())
                await client.delete_prefix(prefix.encode())
                stack.driver.proc.send_signal(signal.SIGCONT)
                stack.jm.start()
    finally:
        echo.kill()
        await client.close()
    return rows


async def latency_phase(args: argparse.Namespace, stack: Stack) -> tuple[list[float], list[float]]:
    """(SubmitJob latency, SubmitJob -> backend id) for live local launches, one at a time."""
    assert stack.jm is not None
    async with JobManagerClient(stack.jm.address) as jm:
        seen = Launched(jm, "latency")
        await asyncio.wait_for(seen.ready.wait(), 30)
        ret: list[float] = []
        launched: list[float] = []
        try:
            for _ in range(args.latency_jobs + 3):
                s = time.perf_counter()
                job = (await jm.submit_job(spec(["true"], "latency"))).job
                ret.append(time.perf_counter() - s)
                launched.append(await seen.wait(job.name) - s)
        finally:
            await seen.close()
    return ret[3:], launched[3:]


async def forgotten(driver: ServiceProcess, names: set[str], within: float) -> int:
    """Waits until the driver's snapshot holds none of ``names``; how many it still holds."""
    deadline = time.monotonic() + within
    async with security.channel(driver.address) as ch:
        stub = driver_service_pb2_grpc.DriverServiceStub(ch)
        while True:
            held = 0
            call = stub.WatchJobObservations(dpb.WatchJobObservationsRequest(cluster="clusters/local"), timeout=60)
            async for ev in call:
                if ev.snapshot_complete:
                    break
                held += ev.observation.job_id in names
            call.cancel()
            if not held or time.monotonic() > deadline:
                return held
            await asyncio.sleep(0.5)


async def rss_phase(args: argparse.Namespace, stack: Stack) -> tuple[float, float, int]:
    """(driver RSS MB after a first round of ``--rss-jobs`` real jobs, after a second, jobs
    still held): each round runs, ends and has its jobs forgotten; the first warms the
    allocator, so the second shows what a job leaves behind."""
    assert stack.jm is not None and stack.driver.proc is not None
    pid = stack.driver.proc.pid
    out: list[float] = []
    held = 0
    async with JobManagerClient(stack.jm.address) as jm:
        for rnd in ("rss-1", "rss-2"):
            await rate(lambda i, rnd=rnd: jm.submit_job(spec(["true"], rnd)), args.rss_jobs, 8)
            deadline = time.monotonic() + 300
            while True:
                jobs = await jm.list_all_jobs(f"labels.bench={rnd}", page_size=1000)
                if len(jobs) == args.rss_jobs and all(j.state == job_pb2.JOB_STATE_SUCCEEDED for j in jobs):
                    break
                assert time.monotonic() < deadline, "rss jobs did not all succeed"
                await asyncio.sleep(1)
            held += await forgotten(stack.driver, {j.name.rpartition("/")[2] for j in jobs}, 60)
            await asyncio.sleep(2)
            out.append(rss_mb(pid))
    return out[0], out[1], held


SlurmRows = dict[str, list[float]]
#: the Slurm rows, in print order; the first is the baseline, the last the measured path
SBATCH, DIRECT, MATCH, PUT, ANSWERED, SERVER, OURS = (
    "bare sbatch, persistent asyncssh", "LaunchJob to the driver alone", "MatchClusters alone",
    "bare etcd put (job-sized)", "SubmitJob (answered)", "  create -> launch recorded (server)",
    "SubmitJob -> backend id (WatchJobs)")


async def slurm_phase(args: argparse.Namespace, stack: Stack, etcd: EtcdServer) -> SlurmRows:
    """SubmitJob -> backend id, the driver's LaunchJob alone and a bare sbatch, one for one
    interleaved, on a real Slurm; beside them the pieces of the path (ClusterManager's match, an
    etcd put, SubmitJob's answer, the server's own create -> launched time)."""
    import asyncssh

    from dlsched.v1 import cluster_manager_service_pb2 as cm_pb
    from dlsched.v1 import cluster_manager_service_pb2_grpc as cm_grpc
    from tests import slurm_cluster

    if why := slurm_cluster.available():
        raise RuntimeError(why)
    assert stack.jm is not None
    cluster = slurm_cluster.SlurmCluster()
    driver: ServiceProcess | None = None
    await asyncio.to_thread(cluster.start)
    try:
        driver = ServiceProcess("drivers.slurm", ["--poll-interval", "2"], name="slurm-driver").start()
        async with ClusterManagerClient(stack.cm.address) as cm:
            await cm.create_cluster("slurm", cluster_pb2.Cluster(
                type=job_pb2.CLUSTER_TYPE_SLURM, address=cluster.address, driver_address=driver.address,
                options=cluster.options(), credentials=cluster_pb2.ClusterCredentials(ssh=cluster_pb2.SshCredentials(
                    username=cluster.user, private_key=cluster.user_key, known_host_keys=[cluster.host_key_pub]))))
            await cm.wait_cluster_state("slurm", timeout=120)
        env = f"export SLURM_CONF={shlex.quote(cluster.conf)}; "
        conn = await asyncssh.connect(
            "127.0.0.1", cluster.ssh_port, username=cluster.user,
            client_keys=[asyncssh.import_private_key(cluster.user_key)],
            known_hosts=([asyncssh.import_public_key(cluster.host_key_pub)], [], []), agent_path=None, config=[])
        pending = spec([PY, "-c", "print(1)"], "slurm", cluster="slurm", cpu=1)  # a tiny job
        rows: SlurmRows = {k: [] for k in (SBATCH, DIRECT, MATCH, PUT, ANSWERED, SERVER, OURS)}
        value = b"x" * len(pending.SerializeToString()) * 2
        ec = await etcd_kit.connect(etcd.endpoint)
        async with (JobManagerClient(stack.jm.address) as jm, security.channel(driver.address) as dch,
                    security.channel(stack.cm.address) as cmch):
            dstub = driver_service_pb2_grpc.DriverServiceStub(dch)
            cmstub = cm_grpc.ClusterManagerServiceStub(cmch)
            seen = Launched(jm, "slurm")
            await asyncio.wait_for(seen.ready.wait(), 30)
            try:
                script = ""

                async def one_ours() -> None:
                    nonlocal script
                    s = time.perf_counter()
                    job = (await jm.submit_job(pending)).job
                    rows[ANSWERED].append(time.perf_counter() - s)
                    rows[OURS].append(await seen.wait(job.name, 120) - s)
                    rows[SERVER].append(seen.server[job.name])
                    if not script:  # the same script the driver sent, for the bare sbatch
                        dry = await jm.submit_job(pending, dry_run=True)
                        script = dry.dry_run.native_spec.content

                async def one_direct() -> None:
                    s = time.perf_counter()
                    await dstub.LaunchJob(dpb.LaunchJobRequest(
                        cluster="clusters/slurm", job_id=f"direct-{uuid.uuid4().hex[:10]}", spec=pending, attempt=1),
                        timeout=120)
                    rows[DIRECT].append(time.perf_counter() - s)

                async def one_bare() -> None:
                    s = time.perf_counter()
                    r = await conn.run(env + "sbatch --parsable", input=script, check=False)
                    rows[SBATCH].append(time.perf_counter() - s)
                    if r.exit_status != 0:
                        raise RuntimeError(f"bare sbatch failed: {r.stderr!r}")

                async def pieces() -> None:  # the path's parts, between the interleaved ones
                    s = time.perf_counter()
                    await cmstub.MatchClusters(cm_pb.MatchClustersRequest(spec=pending), timeout=30)
                    rows[MATCH].append(time.perf_counter() - s)
                    s = time.perf_counter()
                    await ec.put(f"/dlsched-bench-put/{uuid.uuid4().hex}".encode(), value)
                    rows[PUT].append(time.perf_counter() - s)

                for _ in range(5):  # warm: the driver's connection, the warm sbatch, the watch
                    await one_ours()
                    await one_direct()
                    await one_bare()
                    await pieces()
                for xs in rows.values():
                    xs.clear()
                order = [one_ours, one_direct, one_bare, pieces]
                for i in range(args.slurm_jobs):  # rotate which goes first
                    for f in order[i % 4:] + order[:i % 4]:
                        await f()
            finally:
                await seen.close()
                conn.close()
                await ec.delete_prefix(b"/dlsched-bench-put/")
                await ec.close()
        return rows
    finally:
        if driver is not None:
            driver.stop()
        await asyncio.to_thread(cluster.stop)


async def run(args: argparse.Namespace) -> int:
    sec = security.install()
    etcd = EtcdServer().start()
    stack = Stack(etcd, f"/dlsched-bench-submit-{uuid.uuid4().hex[:6]}/",
                  jm_args=["--metrics-listen", "127.0.0.1:0", *os.environ.get("BENCH_JM_ARGS", "").split()],
                  cm_args=["--driver-timeout", "300"])
    slurm: SlurmRows | None = None
    try:
        stack.start()
        if args.slurm_only:
            slurm = await slurm_phase(args, stack, etcd)
            return _report_slurm(slurm)
        await stack.register_local()
        rows = await submit_phase(args, stack, etcd, sec)
        await stack.register_local()
        ret, launched = await latency_phase(args, stack)
        assert stack.jm is not None
        hist = metrics_samples(stack.jm)
        launch_count = sample(hist, "dlsched_job_launch_latency_seconds_count")
        launch_sum = sample(hist, "dlsched_job_launch_latency_seconds_sum")
        rss_before, rss_after, held = await rss_phase(args, stack)
        per_tracked = tracked_job_bytes(1000)
        if args.slurm:
            slurm = await slurm_phase(args, stack, etcd)
    finally:
        stack.stop()
        etcd.stop()

    print()
    print(f"dlsched submit benchmark ({os.cpu_count()} CPUs; local stack, TLS)")
    print()
    print(f"{'concurrency':<12}{'echo/s':>10}{'etcd put/s':>12}{'SubmitJob/s':>13}{'/put':>7}{'/echo':>7}"
          f"{'p50':>12}{'p99':>12}{'distinct/s':>12}")
    for c, e, p, s, lat, d in rows:
        print(f"{c:<12}{e:10.0f}{p:12.0f}{s:13.0f}{s / p:7.2f}{s / e:7.2f}{ms(pct(lat, 50)):>12}"
              f"{ms(pct(lat, 99)):>12}{d:12.0f}")
    print("  (SubmitJob answers once stored; the local driver is paused for these rows, so launches queue.")
    print("   SubmitJob/s: one spec over and over (an array of jobs: concurrent identical matches share one")
    print("   MatchClusters call); distinct/s: every spec different)")
    print()
    print(f"{'local, one job at a time':<40}{'p50':>11}  {'p99':>11}")
    print(f"{'SubmitJob (answered)':<40}{ms(pct(ret, 50))}  {ms(pct(ret, 99))}")
    print(f"{'SubmitJob -> backend id (WatchJobs)':<40}{ms(pct(launched, 50))}  {ms(pct(launched, 99))}")
    if launch_count:
        print(f"  dlsched_job_launch_latency_seconds: {launch_count:.0f} launches, "
              f"mean {launch_sum / launch_count * 1000:.1f} ms")
    print()
    per_job_rss = (rss_after - rss_before) * 1024 * 1024 / args.rss_jobs
    print(f"local driver memory: {per_tracked:.0f} B per tracked job (tracemalloc, 1000 records); "
          f"RSS {rss_before:.1f} -> {rss_after:.1f} MB over a second {args.rss_jobs} jobs run, ended and "
          f"forgotten after a first ({per_job_rss:.0f} B/job; {held} still held)")
    if slurm is not None:
        _print_slurm(slurm)
    print()
    at64 = next(s for c, _, _, s, _, _ in rows if c == 64)
    checks = [(f"SubmitJob/s at 64 (>= {TARGET_JOBS_PER_S})", at64 >= TARGET_JOBS_PER_S, f"{at64:.0f}"),
              (f"bytes per tracked job (<= {TARGET_BYTES_PER_JOB})", per_tracked <= TARGET_BYTES_PER_JOB,
               f"{per_tracked:.0f}"),
              ("ended jobs forgotten by the driver", held == 0, f"{held} held")]
    if slurm is not None:
        ratio = _slurm_ratio(slurm)
        checks.append((f"Slurm SubmitJob->id / bare sbatch p50 (<= {TARGET_SLURM_RATIO})",
                       ratio <= TARGET_SLURM_RATIO, f"{ratio:.2f}x"))
    for name, ok, v in checks:
        print(f"{name:<52}{v:>10}  {'met' if ok else 'MISSED'}")
    return 0 if all(ok for _, ok, _ in checks) or not args.strict else 1


def _print_slurm(rows: SlurmRows) -> None:
    print()
    base = pct(rows[SBATCH], 50)
    print(f"{'slurm, ' + str(len(rows[OURS])) + ' jobs interleaved':<40}{'p50':>11}  {'p99':>11}  {'p50/sbatch':>10}")
    for name, xs in rows.items():
        print(f"{name:<40}{ms(pct(xs, 50))}  {ms(pct(xs, 99))}  {pct(xs, 50) / base:9.2f}x")


def _slurm_ratio(rows: SlurmRows) -> float:
    return pct(rows[OURS], 50) / pct(rows[SBATCH], 50)


def _report_slurm(rows: SlurmRows) -> int:
    _print_slurm(rows)
    ratio = _slurm_ratio(rows)
    print(f"Slurm SubmitJob->id / bare sbatch p50 (<= {TARGET_SLURM_RATIO}): {ratio:.2f}x "
          f"{'met' if ratio <= TARGET_SLURM_RATIO else 'MISSED'}")
    return 0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--jobs", type=int, default=1000, help="submits per concurrency (a fifth at 1)")
    p.add_argument("--latency-jobs", type=int, default=30)
    p.add_argument("--rss-jobs", type=int, default=150, help="real jobs per RSS round (two rounds)")
    p.add_argument("--slurm", action="store_true", help="also SubmitJob -> Slurm backend id vs bare sbatch")
    p.add_argument("--slurm-jobs", type=int, default=40)
    p.add_argument("--slurm-only", action="store_true", help="only the Slurm rows")
    p.add_argument("--strict", action="store_true", help="exit 1 when a target is missed")
    args = p.parse_args()
    try:
        sys.exit(asyncio.run(asyncio.wait_for(run(args), BOUND_S)))
    except TimeoutError:
        print(f"error: the benchmark ran past its {BOUND_S} s bound", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
