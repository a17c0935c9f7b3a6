"""JobManager reads at scale: the watch cache against bare baselines, in one run.

    .venv/bin/python bench/bench_scale.py [--jobs 100000] [--concurrency 16] [--duration 4]

Starts its own etcd, writes ``--jobs`` synthetic finished jobs (~900 bytes
each, the store's encoding, 128 per transaction), then starts the local stack
(tests.harness; TLS and tokens as in the tests) and measures:

- GetJob QPS (``--concurrency`` calls in flight for ``--duration`` s) next to
  a bare grpc.aio echo server (another process, the same TLS, a response of
  the same size) and a bare etcd single-key range (what GetJob cost when it
  read etcd): target GetJob >= 0.7x echo;
- ListJobs page p50/p99 (page_size 50): the first page, a page deep in the
  list (by token), a page of a selective label filter, next to a bare etcd
  range of 50 keys;
- how long JobManager took to start (the cache's paged load) and its RSS.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import pathlib
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime, timedelta

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from aetcd import rpc  # noqa: E402

from bench.stats import ms, pct  # noqa: E402
from dlsched.kit import etcd as etcd_kit  # noqa: E402
from dlsched.v1 import job_manager_service_pb2 as jms  # noqa: E402
from dlsched.v1 import job_manager_service_pb2_grpc as jms_grpc  # noqa: E402
from job_manager.convert import job_to_bytes  # noqa: E402
from job_manager.domain.model import Job, JobSpec, JobState, ReplicaGroup  # noqa: E402
from tests import security  # noqa: E402
from tests.harness import EtcdServer, ServiceProcess, Stack  # noqa: E402

TARGET = 0.7
PREFIX = "/dlsched-bench-scale/"
T0 = datetime(2026, 1, 1, tzinfo=UTC)

ECHO_SERVER = r"""
import asyncio, sys, grpc
from dlsched.kit import tls
async def main():
    server = grpc.aio.server()
    echo = grpc.unary_unary_rpc_method_handler(_echo)
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler("bench.Echo", {"Echo": echo})])
    port = server.add_secure_port("127.0.0.1:0", tls.server_credentials(tls.TlsOptions(
        sys.argv[1], sys.argv[2], sys.argv[3]), require_client_cert=False))
    await server.start()
    print(port, flush=True)
    await server.wait_for_termination()
async def _echo(req, ctx):
    return req
asyncio.run(main())
"""


def synthetic(i: int) -> Job:
    return Job(id=f"s{i:07d}", uid=f"uid-{i}", state=JobState.SUCCEEDED, cluster="clusters/local",
               attempt=1, create_time=T0 + timedelta(milliseconds=i), update_time=T0,
               labels={"group": f"g{i % 20}", **({"rare": "yes"} if i % 1000 == 7 else {})},
               owner="bench", message="m" * 700, backend_job_id=f"b{i}",
               spec=JobSpec(run_mode=1, replica_groups=[ReplicaGroup(role="main", replicas=1,
                                                                     command=["true"])]))


async def write_jobs(client, n: int) -> None:  # type: ignore[no-untyped-def]
    await client.connect()
    key = f"{PREFIX}jobs/".encode()
    for start in range(0, n, 128):
        ops = [rpc.RequestOp(request_put=rpc.PutRequest(key=key + j.id.encode(), value=job_to_bytes(j)))
               for j in map(synthetic, range(start, min(n, start + 128)))]
        await client.kvstub.Txn(rpc.TxnRequest(success=ops), timeout=60, metadata=client.metadata)


async def qps(call, concurrency: int, seconds: float) -> tuple[float, list[float]]:  # type: ignore[no-untyped-def]
    lat: list[float] = []
    end = time.perf_counter() + seconds

    async def worker() -> None:
        while time.perf_counter() < end:
            s = time.perf_counter()
            await call()
            lat.append(time.perf_counter() - s)

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return len(lat) / (time.perf_counter() - t0), lat


async def seq(call, n: int) -> list[float]:  # type: ignore[no-untyped-def]
    out = []
    for _ in range(n):
        s = time.perf_counter()
        await call()
        out.append(time.perf_counter() - s)
    return out


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


async def run(args: argparse.Namespace) -> int:
    sec = security.install()
    etcd = EtcdServer().start()
    echo = None
    stack = Stack(etcd, PREFIX)
    try:
        client = await etcd_kit.connect(etcd.endpoint)
        t = time.perf_counter()
        await write_jobs(client, args.jobs)
        print(f"wrote {args.jobs} jobs in {time.perf_counter() - t:.1f} s")
        stack.driver.start()
        stack.cm.start()
        t = time.perf_counter()
        stack.jm = ServiceProcess("job_manager", [*etcd.service_args(), "--prefix", PREFIX,
                                                 "--cluster-manager", stack.cm.address],
                                  name="job-manager").start(timeout=600)
        started = time.perf_counter() - t
        assert stack.jm.proc is not None
        print(f"JobManager serving after {started:.1f} s (cache load), RSS {rss_mb(stack.jm.proc.pid):.0f} MB")

        echo = subprocess.Popen(  # noqa: ASYNC220 - set-up, before anything is measured
            [sys.executable, "-c", ECHO_SERVER, sec.service.cert_file, sec.service.key_file,
             sec.ca.cert_file], stdout=subprocess.PIPE, cwd=str(ROOT),
            env={**os.environ, "PYTHONPATH": str(ROOT)})
        assert echo.stdout is not None
        echo_port = int(echo.stdout.readline())

        async with security.channel(stack.jm.address) as ch, \
                security.channel(f"127.0.0.1:{echo_port}") as ech:
            jm = jms_grpc.JobManagerServiceStub(ch)
            name = f"jobs/s{args.jobs // 2:07d}"
            one = (await jm.GetJob(jms.GetJobRequest(name=name))).SerializeToString()
            echo_call = ech.unary_unary("/bench.Echo/Echo")
            get_req = jms.GetJobRequest(name=name)
            key = f"{PREFIX}jobs/s{args.jobs // 2:07d}".encode()

            async def getjob() -> None:
                await jm.GetJob(get_req, timeout=10)

            async def echo_one() -> None:
                await echo_call(one, timeout=10)

            async def etcd_get() -> None:
                await client.get(key)

            rows = []
            for label, call in (("echo (bare grpc.aio, TLS)", echo_one),
                                ("etcd single-key range", etcd_get), ("GetJob", getjob)):
                await qps(call, args.concurrency, 1.0)  # warm-up
                q, lat = await qps(call, args.concurrency, args.duration)
                rows.append((label, q, lat))
            echo_q = rows[0][1]
            print(f"\nGetJob at {args.jobs} jobs, concurrency {args.concurrency}:")
            for label, q, lat in rows:
                print(f"  {label:28s} {q:8.0f}/s  p50 {ms(pct(lat, 50))}  p99 {ms(pct(lat, 99))}"
                      f"  {q / echo_q:.2f}x echo")
            ratio = rows[2][1] / echo_q

            first = jms.ListJobsRequest(page_size=50)
            tok = ""
            for _ in range(args.jobs // 2 // 1000):  # a token half-way down, 1000 at a time
                tok = (await jm.ListJobs(jms.ListJobsRequest(page_size=1000, page_token=tok),
                                         timeout=60)).next_page_token
            deep = jms.ListJobsRequest(page_size=50, page_token=tok)
            rare = jms.ListJobsRequest(page_size=50, filter="labels.rare=yes")
            pages = {"first page": first, "page half-way (token)": deep, "labels.rare=yes": rare}
            range_req = rpc.RangeRequest(key=f"{PREFIX}jobs/".encode(),
                                         range_end=f"{PREFIX}jobs0".encode(), limit=50)

            async def etcd_range() -> None:
                await client.kvstub.Range(range_req, timeout=10, metadata=client.metadata)

            print("\nListJobs page_size 50, sequential:")
            base = await seq(etcd_range, args.pages)
            print(f"  {'etcd range of 50 keys':28s} p50 {ms(pct(base, 50))}  p99 {ms(pct(base, 99))}")
            for label, req in pages.items():
                lat = await seq(lambda req=req: jm.ListJobs(req, timeout=60), args.pages)
                print(f"  {label:28s} p50 {ms(pct(lat, 50))}  p99 {ms(pct(lat, 99))}")
            print(f"\nJobManager RSS {rss_mb(stack.jm.proc.pid):.0f} MB with {args.jobs} jobs cached")
            print(f"GetJob / echo = {ratio:.2f} (target >= {TARGET})")
        await client.close()
        return 0 if ratio >= TARGET else 1
    finally:
        if echo is not None:
            echo.kill()
        stack.stop()
        etcd.stop()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--jobs", type=int, default=100_000)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--duration", type=float, default=4.0)
    p.add_argument("--pages", type=int, default=50)
    args = p.parse_args()
    with tempfile.TemporaryDirectory():
        sys.exit(asyncio.run(run(args)))


if __name__ == "__main__":
    main()
