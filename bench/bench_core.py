"""Core latency benchmark of the full local stack, against a bare etcd baseline.

    .venv/bin/python bench/bench_core.py [--jobs 100] [--concurrency 8]

Starts its own etcd and the three services as processes (tests.harness), then
measures, in one run:

- SubmitJob latency p50/p99 and throughput for N tiny jobs (``true``),
  sequential and with concurrency C, next to a bare aetcd put of a job-sized
  value on the same etcd (the floor: a submit is at least one etcd txn);
- status freshness: each job writes ``time.time()`` to a file just before it
  exits; the time from that to the WatchJobs event that shows the job
  terminal (target p99 <= 100 ms);
- log tail latency: a job prints ``time.time()`` every 50 ms; a follower of
  StreamJobLogs computes receive time minus stamp (targets p50 <= 100 ms,
  p99 <= 250 ms).

Bounded: every phase has a deadline; the whole run takes well under 2 min.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import pathlib
import statistics
import sys
import tempfile
import time
import uuid

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.stats import ms, pct  # noqa: E402
from dlsched.client import (  # noqa: E402
    ClusterManagerClient,
    JobManagerClient,
    is_terminal,
)
from dlsched.kit import etcd as etcd_kit  # noqa: E402
from dlsched.v1 import cluster_pb2, job_pb2  # noqa: E402
from tests import security  # noqa: E402  (TLS certificates and tokens, as in the tests)
from tests.harness import EtcdServer, Stack  # noqa: E402

PY = sys.executable


def spec(command: list[str], label: str) -> job_pb2.JobSpec:
    return job_pb2.JobSpec(
        run_mode=job_pb2.RUN_MODE_SINGLE_PROCESS,
        replica_groups=[job_pb2.ReplicaGroup(role="main", replicas=1, command=command)],
        cluster_selector=job_pb2.ClusterSelector(cluster="local"),
        labels={"bench": label},
    )


async def etcd_baseline(endpoint: str, n: int, concurrency: int, size: int,
                        ) -> tuple[list[float], float, list[float], float]:
    client = await etcd_kit.connect(endpoint)
    value = os.urandom(size)
    prefix = f"/bench-{uuid.uuid4().hex[:6]}/"
    try:
        for i in range(5):  # warm up the connection
            await client.put(f"{prefix}warm{i}".encode(), value)
        seq: list[float] = []
        t0 = time.perf_counter()
        for i in range(n):
            s = time.perf_counter()
            await client.put(f"{prefix}seq{i}".encode(), value)
            seq.append(time.perf_counter() - s)
        seq_tput = n / (time.perf_counter() - t0)

        conc: list[float] = []
        sem = asyncio.Semaphore(concurrency)

        async def one(i: int) -> None:
            async with sem:
                s = time.perf_counter()
                await client.put(f"{prefix}conc{i}".encode(), value)
                conc.append(time.perf_counter() - s)

        t0 = time.perf_counter()
        await asyncio.gather(*(one(i) for i in range(n)))
        conc_tput = n / (time.perf_counter() - t0)
        await client.delete_prefix(prefix.encode())
        return seq, seq_tput, conc, conc_tput
    finally:
        await client.close()


async def submit_bench(jm: JobManagerClient, n: int, concurrency: int,
                       ) -> tuple[list[float], float, list[float], float, list[str]]:
    names: list[str] = []
    tiny = spec(["true"], "submit")
    for _ in range(3):  # warm up
        names.append((await jm.submit_job(tiny)).job.name)
    seq: list[float] = []
    t0 = time.perf_counter()
    for _ in range(n):
        s = time.perf_counter()
        names.append((await jm.submit_job(tiny)).job.name)
        seq.append(time.perf_counter() - s)
    seq_tput = n / (time.perf_counter() - t0)

    conc: list[float] = []
    sem = asyncio.Semaphore(concurrency)

    async def one() -> None:
        async with sem:
            s = time.perf_counter()
            names.append((await jm.submit_job(tiny)).job.name)
            conc.append(time.perf_counter() - s)

    t0 = time.perf_counter()
    await asyncio.gather(*(one() for _ in range(n)))
    conc_tput = n / (time.perf_counter() - t0)
    return seq, seq_tput, conc, conc_tput, names


async def wait_all_terminal(jm: JobManagerClient, names: list[str], deadline_s: float) -> int:
    """Waits until the given jobs have ended; the number still running at the deadline."""
    pending = set(names)
    end = time.monotonic() + deadline_s
    while pending and time.monotonic() < end:
        jobs = await jm.list_all_jobs("labels.bench=submit", page_size=1000)
        pending -= {j.name for j in jobs if is_terminal(j.state)}
        if pending:
            await asyncio.sleep(0.5)
    return len(pending)


def _read_float(path: str) -> float:
    with open(path) as f:
        return float(f.read())


async def freshness_bench(jm: JobManagerClient, n: int, tmp: str) -> tuple[list[float], int]:
    """Exit wall time (written by the job) -> WatchJobs event with the terminal state."""
    seen: dict[str, float] = {}
    events: dict[str, asyncio.Event] = {}
    ready = asyncio.Event()

    async def watcher() -> None:
        async for ev in jm.watch_jobs(filter="labels.bench=freshness"):
            if ev.type == job_pb2.WATCH_EVENT_TYPE_SNAPSHOT_COMPLETE:
                ready.set()
                continue
            if is_terminal(ev.job.state) and ev.job.name not in seen:
                seen[ev.job.name] = time.time()
                if ev.job.name in events:
                    events[ev.job.name].set()

    task = asyncio.create_task(watcher())
    await asyncio.wait_for(ready.wait(), 10)
    samples: list[float] = []
    missed = 0
    try:
        for i in range(n):
            stamp = os.path.join(tmp, f"exit-{i}")
            code = (f"import time\nf = open({stamp!r}, 'w')\n"
                    "f.write(repr(time.time()))\nf.close()\n")
            job = (await jm.submit_job(spec([PY, "-c", code], "freshness"))).job
            ev = events.setdefault(job.name, asyncio.Event())
            if job.name in seen:
                ev.set()
            try:
                await asyncio.wait_for(ev.wait(), 20)
            except TimeoutError:
                missed += 1
                continue
            try:
                exit_time = _read_float(stamp)
            except (OSError, ValueError):
                missed += 1
                continue
            samples.append(seen[job.name] - exit_time)
    finally:
        task.cancel()
        try:
            await task
        except (asyncio.CancelledError, Exception):  # noqa: BLE001 - the watch is done
            pass
    return samples, missed


async def log_tail_bench(jm: JobManagerClient, jobs: int, lines: int) -> list[float]:
    code = ("import time, sys\n"
            f"for _ in range({lines}):\n"
            "    print(repr(time.time()), flush=True)\n"
            "    time.sleep(0.05)\n")
    samples: list[float] = []

    async def one() -> None:
        job = (await jm.submit_job(spec([PY, "-u", "-c", code], "logs"))).job
        async for entry in jm.stream_job_logs(job.name, follow=True):
            now = time.time()
            try:
                samples.append(now - float(entry.text))
            except ValueError:
                pass

    await asyncio.wait_for(asyncio.gather(*(one() for _ in range(jobs))), 60)
    return samples


async def run(args: argparse.Namespace) -> int:
    etcd = EtcdServer().start()
    stack = Stack(etcd, f"/dlsched-bench-{uuid.uuid4().hex[:6]}/")
    tmp = tempfile.mkdtemp(prefix="dlsched-bench-")
    try:
        stack.start()
        assert stack.jm is not None
        async with ClusterManagerClient(stack.cm.address) as cm:
            await cm.create_cluster("local", cluster_pb2.Cluster(
                type=job_pb2.CLUSTER_TYPE_LOCAL, driver_address=stack.driver.address))
            await cm.wait_cluster_state("local", timeout=30)
        print(f"stack up: jm={stack.jm.address} cm={stack.cm.address} etcd={etcd.endpoint}",
              file=sys.stderr)

        async with JobManagerClient(stack.jm.address) as jm:
            job_size = len(job_pb2.Job(name="jobs/x" * 2, spec=spec(["true"], "submit"))
                           .SerializeToString()) + 64
            e_seq, e_seq_tput, e_conc, e_conc_tput = await etcd_baseline(
                etcd.endpoint, args.jobs, args.concurrency, job_size)
            s_seq, s_seq_tput, s_conc, s_conc_tput, names = await submit_bench(
                jm, args.jobs, args.concurrency)
            left = await wait_all_terminal(jm, names, 60)
            if left:
                print(f"warning: {left} submit-bench jobs had not ended after 60 s",
                      file=sys.stderr)
            fresh, missed = await freshness_bench(jm, args.freshness_jobs, tmp)
            tail = await log_tail_bench(jm, args.log_jobs, args.log_lines)
    finally:
        stack.stop()
        etcd.stop()

    def row(name: str, xs: list[float], base: list[float] | None = None) -> str:
        r = f"{name:<34}{ms(pct(xs, 50))}  {ms(pct(xs, 99))}"
        if base:
            r += f"  {pct(xs, 50) / pct(base, 50):8.1f}x  {pct(xs, 99) / pct(base, 99):8.1f}x"
        return r

    print()
    print(f"dlsched core benchmark ({args.jobs} jobs, concurrency {args.concurrency}, "
          f"{os.cpu_count()} CPUs)")
    print(f"{'latency':<34}{'p50':>11}  {'p99':>11}  {'p50/etcd':>9}  {'p99/etcd':>9}")
    print(row("etcd put (baseline), sequential", e_seq))
    print(row(f"etcd put (baseline), x{args.concurrency}", e_conc))
    print(row("SubmitJob, sequential", s_seq, e_seq))
    print(row(f"SubmitJob, x{args.concurrency}", s_conc, e_conc))
    print()
    print(f"{'throughput':<34}{'ops/s':>11}  {'/etcd':>9}")
    for name, v, b in (("etcd put, sequential", e_seq_tput, None),
                       (f"etcd put, x{args.concurrency}", e_conc_tput, None),
                       ("SubmitJob, sequential", s_seq_tput, e_seq_tput),
                       (f"SubmitJob, x{args.concurrency}", s_conc_tput, e_conc_tput)):
        print(f"{name:<34}{v:11.1f}" + (f"  {v / b:8.2f}x" if b else ""))
    print()
    checks = [
        ("status freshness p99 (exit->watch)", pct(fresh, 99), 0.100, fresh),
        ("log tail latency p50", pct(tail, 50), 0.100, tail),
        ("log tail latency p99", pct(tail, 99), 0.250, tail),
    ]
    print(f"{'target':<38}{'measured':>11}  {'target':>9}  result   (samples)")
    ok = True
    for name, v, target, xs in checks:
        met = bool(xs) and v <= target
        ok = ok and met
        print(f"{name:<38}{ms(v)}  <= {target * 1000:4.0f} ms  {'met ' if met else 'MISSED'}"
              f"   (n={len(xs)})")
    if fresh:
        print(f"  freshness p50 {ms(pct(fresh, 50)).strip()}, max {ms(max(fresh)).strip()}"
              f"{f', {missed} missed' if missed else ''}")
    if tail:
        print(f"  log tail mean {ms(statistics.mean(tail)).strip()}, max {ms(max(tail)).strip()}")
    print()
    print("all targets met" if ok else "some targets MISSED")
    return 0 if ok or not args.strict else 1


def main() -> None:
    security.install()
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--jobs", type=int, default=100, help="jobs per submit phase (default 100)")
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--freshness-jobs", type=int, default=20)
    p.add_argument("--log-jobs", type=int, default=2)
    p.add_argument("--log-lines", type=int, default=60, help="stamps per log job, 50 ms apart")
    p.add_argument("--strict", action="store_true", help="exit 1 when a target is missed")
    args = p.parse_args()
    try:
        sys.exit(asyncio.run(asyncio.wait_for(run(args), 110)))
    except TimeoutError:
        print("error: the benchmark ran past its 110 s bound", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
