"""JobManager reads at scale: the watch cache against bare baselines, in one run.

    .venv/bin/python bench/bench_scale.py [--jobs 100000] [--concurrency 16] [--duration 4]

Starts its own etcd, writes ``--jobs`` synthetic finished jobs (~900 bytes
each, the store's encoding, 128 per transaction), then starts the local stack
(tests.harness; TLS and tokens as in the tests) and measures:

- GetJob QPS (``--concurrency`` calls in flight for ``--duration`` s) next to
  a bare grpc.aio echo server (another process, the same TLS, a response of
  the same size) and a bare etcd single-key range (what GetJob cost when it
  read etcd): target GetJob >= 0.7x echo (the replica alone: its reads are
  proved by its sole-writer claim); GetJob with ``min_etag`` (the job's etag:
  served from the cache, no etcd read of the current revision); and GetJob
  once a second replica runs (each consistent read waits for a shared read of
  etcd's revision);
- ListJobs page p50/p99 (page_size 50): the first page, a page deep in the
  list (by token), a page of a selective label filter, next to a bare etcd
  range of 50 keys;
- for each GetJob row, the CPU per call of the server (JobManager, the echo
  server, etcd) and of the benchmark client, from /proc and process_time:
  on a loaded machine a steadier comparison than QPS;
- how long JobManager took to start (the cache's paged load) and its RSS.

``--streams`` (e.g. ``--streams --jobs 0``) measures WatchJobs instead, next to
a bare grpc.aio streaming server (another process, the same TLS) in the same
run, for each ``--watchers`` count: the time to open that many idle streams
(each until its first message, 100 opening at a time), the server's RSS per
open stream and what stays after they close (targets <= 30 KiB per stream,
5,000 open in <= 5 s); and, for each ``--fanout`` count, one event to that
many watchers, p50/p99 from the write (an etcd put of a job; the bare
server's broadcast call) to each stream's receipt (targets p99 <= 100 ms at
1,000, <= 200 ms at 10,000). The client is one process, so both rows carry
its cost alike. ``--log-streams`` counts (default 1000) add idle
StreamJobLogs followers of one running local job: JobManager's and the
local driver's RSS per stream next to the bare server's (target <= 30 KiB in
each); ``--watchers '' --fanout ''`` measures only those.
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

import grpc  # noqa: E402
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


STREAM_SERVER = r"""
import asyncio, sys, grpc
from dlsched.kit import tls
class Hub:
    def __init__(self):
        self.event = asyncio.Event()
        self.payload = b""
hub = Hub()
async def watch(req, ctx):
    yield b"snapshot-complete"
    while True:
        ev = hub.event
        await ev.wait()
        yield hub.payload
async def fire(req, ctx):
    hub.payload = req
    ev, hub.event = hub.event, asyncio.Event()
    ev.set()
    return b""
async def main():
    server = grpc.aio.server()
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler("bench.Stream", {
        "Watch": grpc.unary_stream_rpc_method_handler(watch),
        "Fire": grpc.unary_unary_rpc_method_handler(fire)})])
    port = server.add_secure_port("127.0.0.1:0", tls.server_credentials(tls.TlsOptions(
        sys.argv[1], sys.argv[2], sys.argv[3]), require_client_cert=False))
    await server.start()
    print(port, flush=True)
    await server.wait_for_termination()
asyncio.run(main())
"""


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


def cpu_s(pid: int) -> float:
    """The process's CPU time so far (user + system), in seconds."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


class Streams:
    """N idle server streams from this process, each read by its own task;
    ``received[i]`` the time stream i got its latest message."""

    def __init__(self, open_call, n: int) -> None:  # type: ignore[no-untyped-def]
        self.open_call = open_call  # (stream index) -> call
        self.n = n
        self.calls: list = []  # type: ignore[type-arg]
        self.tasks: list[asyncio.Task[None]] = []
        self.received: list[float] = []
        self.counts: list[int] = []

    async def open(self) -> float:
        """Seconds until every stream has its first message (100 opening at a time)."""
        t = time.perf_counter()
        for start in range(0, self.n, 100):
            batch = [self.open_call(i) for i in range(start, min(self.n, start + 100))]
            await asyncio.gather(*(c.read() for c in batch))
            self.calls += batch
        took = time.perf_counter() - t
        self.received = [0.0] * self.n
        self.counts = [0] * self.n
        self.tasks = [asyncio.create_task(self._read(i, c)) for i, c in enumerate(self.calls)]
        return took

    async def _read(self, i: int, call) -> None:  # type: ignore[no-untyped-def]
        try:
            async for _ in call:
                self.received[i] = time.perf_counter()
                self.counts[i] += 1
        except Exception:  # noqa: BLE001 - cancelled at the end
            pass

    async def fanout(self, fire, within: float = 60) -> list[float]:  # type: ignore[no-untyped-def]
        """Latencies from ``fire()`` (called now) to each stream's receipt of one more message."""
        before = list(self.counts)
        t0 = time.perf_counter()
        await fire()
        deadline = t0 + within
        while any(c <= b for c, b in zip(self.counts, before, strict=True)):
            if time.perf_counter() > deadline:
                raise RuntimeError("not every stream got the event")
            await asyncio.sleep(0.005)
        return [r - t0 for r in self.received]

    async def close(self) -> None:
        for c in self.calls:
            c.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        self.calls, self.tasks = [], []


async def settle_rss(pid: int, seconds: float = 2.0) -> float:
    await asyncio.sleep(seconds)
    return rss_mb(pid)


STREAMS_PER_CONNECTION = 500


def pool(address: str, n: int) -> list[grpc.aio.Channel]:
    """Channels on separate connections, one per ``STREAMS_PER_CONNECTION`` streams."""
    from dlsched.kit import tls
    from dlsched.kit.channel import TokenSource

    sec = security.current()
    return [tls.channel(address, sec.service_tls(), client_cert=True,
                        token=TokenSource(token=sec.admin_token),
                        extra_options=[("grpc.use_local_subchannel_pool", 1)])
            for _ in range(max(1, -(-n // STREAMS_PER_CONNECTION)))]


async def stream_rows(args: argparse.Namespace, jm_address: str, jm_pid: int,  # type: ignore[no-untyped-def]
                      bare_address: str, bare_pid: int, client) -> None:
    watch_req = jms.WatchJobsRequest(filter="labels.bench=fanout")
    payload = jms.WatchJobsResponse(job=jms.GetJobResponse().job).SerializeToString()
    addresses = {"jm": jm_address, "bare": bare_address}
    pids = {"jm": jm_pid, "bare": bare_pid}
    labels = {"jm": "WatchJobs", "bare": "bare grpc.aio stream"}

    def opener(kind: str, chans: list[grpc.aio.Channel]):  # type: ignore[no-untyped-def]
        if kind == "jm":
            stubs = [jms_grpc.JobManagerServiceStub(c) for c in chans]
            return lambda i: stubs[i // STREAMS_PER_CONNECTION].WatchJobs(watch_req)
        calls = [c.unary_stream("/bench.Stream/Watch") for c in chans]
        return lambda i: calls[i // STREAMS_PER_CONNECTION](b"")

    print("\nidle streams: open time, server RSS per stream, RSS left after close")
    for n in args.watchers:
        for kind in ("bare", "jm"):
            chans = pool(addresses[kind], n)
            base = await settle_rss(pids[kind], 1.0)
            st = Streams(opener(kind, chans), n)
            took = await st.open()
            peak = await settle_rss(pids[kind])
            await st.close()
            for c in chans:
                await c.close()
            after = await settle_rss(pids[kind], 10.0)
            print(f"  {labels[kind]:22s} {n:6d} streams  open {took:6.2f} s"
                  f"  {(peak - base) * 1024 / n:6.1f} KiB/stream"
                  f"  after close {(after - base) * 1024 / n:6.1f} KiB/stream")
    key = f"{PREFIX}jobs/fanout".encode()
    seq_no = [0]

    async def put_job() -> None:
        seq_no[0] += 1
        job = synthetic(10_000_000 + seq_no[0])
        job.labels = {"bench": "fanout"}
        await client.put(key, job_to_bytes(job))

    print("\none event to N watchers (write -> receipt at every stream):")
    for n in args.fanout:
        for kind in ("bare", "jm"):
            chans = pool(addresses[kind], n)
            fire = (put_job if kind == "jm" else
                    lambda ch=chans[0]: ch.unary_unary("/bench.Stream/Fire")(payload, timeout=30))
            st = Streams(opener(kind, chans), n)
            await st.open()
            lat: list[float] = []
            for _ in range(args.events):
                lat += await st.fanout(fire)
                await asyncio.sleep(0.2)
            await st.close()
            for c in chans:
                await c.close()
            await asyncio.sleep(10.0)  # the server lets go of the streams
            print(f"  {labels[kind]:22s} {n:6d} watchers  p50 {ms(pct(lat, 50))}  p99 {ms(pct(lat, 99))}")


async def log_rows(args: argparse.Namespace, stack: Stack, bare_address: str, bare_pid: int) -> None:
    """Idle StreamJobLogs followers of one running local job: JobManager's and the local
    driver's RSS per stream next to the bare streaming server's (target <= 30 KiB each)."""
    from dlsched.v1 import job_pb2

    assert stack.jm is not None and stack.jm.proc is not None and stack.driver.proc is not None
    await stack.register_local()
    spec = job_pb2.JobSpec(run_mode=job_pb2.RUN_MODE_SINGLE_PROCESS,
                           cluster_selector=job_pb2.ClusterSelector(cluster="local"),
                           replica_groups=[job_pb2.ReplicaGroup(role="main", replicas=1, command=[
                               sys.executable, "-c", "import time; print('ready', flush=True); time.sleep(3600)"])])
    chans = pool(stack.jm.address, 1)
    jm = jms_grpc.JobManagerServiceStub(chans[0])
    job = (await jm.SubmitJob(jms.SubmitJobRequest(job_id="bench-logs", spec=spec), timeout=60)).job
    log_req = jms.StreamJobLogsRequest(name=job.name, follow=True)
    deadline = time.monotonic() + 120
    while True:  # the job runs and has printed its line
        try:
            async for _ in jm.StreamJobLogs(jms.StreamJobLogsRequest(name=job.name), timeout=10):
                break
            else:
                raise RuntimeError("no line yet")
            break
        except (grpc.aio.AioRpcError, RuntimeError):
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.5)
    print("\nidle log followers (StreamJobLogs follow=True, one running local job): RSS per stream")
    pids = {"JobManager": stack.jm.proc.pid, "local driver": stack.driver.proc.pid}
    for n in args.log_streams:
        for kind in ("bare", "jm"):
            cs = pool(bare_address if kind == "bare" else stack.jm.address, n)
            if kind == "bare":
                calls = [c.unary_stream("/bench.Stream/Watch") for c in cs]
                opener = lambda i, calls=calls: calls[i // STREAMS_PER_CONNECTION](b"")  # noqa: E731
                watched = {"bare grpc.aio stream": bare_pid}
            else:
                stubs = [jms_grpc.JobManagerServiceStub(c) for c in cs]
                opener = lambda i, stubs=stubs: stubs[i // STREAMS_PER_CONNECTION].StreamJobLogs(log_req)  # noqa: E731
                watched = pids
            base = {k: await settle_rss(pid, 1.0) for k, pid in watched.items()}
            st = Streams(opener, n)
            took = await st.open()
            peak = {k: await settle_rss(pid) for k, pid in watched.items()}
            await st.close()
            for c in cs:
                await c.close()
            after = {k: await settle_rss(pid, 10.0) for k, pid in watched.items()}
            for k in watched:
                print(f"  {k:22s} {n:6d} streams  open {took:6.2f} s"
                      f"  {(peak[k] - base[k]) * 1024 / n:6.1f} KiB/stream"
                      f"  after close {(after[k] - base[k]) * 1024 / n:6.1f} KiB/stream")
    await jm.StopJob(jms.StopJobRequest(name=job.name), timeout=30)
    for c in chans:
        await c.close()


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
                                                 "--cluster-manager", stack.cm.address,
                                                 *os.environ.get("BENCH_JM_ARGS", "").split()],
                                  name="job-manager").start(timeout=600)
        started = time.perf_counter() - t
        assert stack.jm.proc is not None
        print(f"JobManager serving after {started:.1f} s (cache load), RSS {rss_mb(stack.jm.proc.pid):.0f} MB")

        if args.streams:
            bare = subprocess.Popen(  # noqa: ASYNC220 - set-up, before anything is measured
                [sys.executable, "-c", STREAM_SERVER, sec.service.cert_file, sec.service.key_file,
                 sec.ca.cert_file], stdout=subprocess.PIPE, cwd=str(ROOT),
                env={**os.environ, "PYTHONPATH": str(ROOT)})
            try:
                assert bare.stdout is not None
                bare_port = int(bare.stdout.readline())
                if args.watchers or args.fanout:
                    await stream_rows(args, stack.jm.address, stack.jm.proc.pid,
                                      f"127.0.0.1:{bare_port}", bare.pid, client)
                if args.log_streams:
                    await log_rows(args, stack, f"127.0.0.1:{bare_port}", bare.pid)
            finally:
                bare.kill()
            await client.close()
            return 0

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
            etag_req = jms.GetJobRequest(name=name, min_etag=jms.GetJobResponse.FromString(one).job.etag)
            key = f"{PREFIX}jobs/s{args.jobs // 2:07d}".encode()

            async def getjob() -> None:
                await jm.GetJob(get_req, timeout=10)

            async def getjob_etag() -> None:
                await jm.GetJob(etag_req, timeout=10)

            async def echo_one() -> None:
                await echo_call(one, timeout=10)

            async def etcd_get() -> None:
                await client.get(key)

            rows = []
            for label, call, pid in (("echo (bare grpc.aio, TLS)", echo_one, echo.pid),
                                     ("etcd single-key range", etcd_get, etcd.proc.pid),
                                     ("GetJob", getjob, stack.jm.proc.pid),
                                     ("GetJob, min_etag (cache)", getjob_etag, stack.jm.proc.pid)):
                await qps(call, args.concurrency, 1.0)  # warm-up
                server0, client0 = cpu_s(pid), time.process_time()
                q, lat = await qps(call, args.concurrency, args.duration)
                per = 1e6 / max(len(lat), 1)  # CPU microseconds per call, server's and client's
                rows.append((label, q, lat, (cpu_s(pid) - server0) * per,
                             (time.process_time() - client0) * per))
            # A second replica: the first is no longer the sole writer, so its consistent
            # reads each wait for a (shared) read of etcd's revision again.
            assert stack.jm.proc is not None
            second = ServiceProcess("job_manager", [*etcd.service_args(), "--prefix", PREFIX,
                                                    "--cluster-manager", stack.cm.address],
                                    name="job-manager-b").start(timeout=600)
            try:
                await asyncio.sleep(3.0)  # the first replica's ownership round sees it (ttl/4)
                await qps(getjob, args.concurrency, 1.0)
                jm_pid = stack.jm.proc.pid
                server0, client0 = cpu_s(jm_pid), time.process_time()
                q, lat = await qps(getjob, args.concurrency, args.duration)
                per = 1e6 / max(len(lat), 1)
                rows.append(("GetJob, 2 replicas", q, lat, (cpu_s(jm_pid) - server0) * per,
                             (time.process_time() - client0) * per))
            finally:
                second.stop()
            echo_q = rows[0][1]
            print(f"\nGetJob at {args.jobs} jobs, concurrency {args.concurrency}"
                  " (CPU per call: the server's, the benchmark client's):")
            for label, q, lat, server_us, client_us in rows:
                print(f"  {label:28s} {q:8.0f}/s  p50 {ms(pct(lat, 50))}  p99 {ms(pct(lat, 99))}"
                      f"  {q / echo_q:.2f}x echo  CPU {server_us:4.0f} us, client {client_us:4.0f} us")
            ratio, cached_ratio = rows[2][1] / echo_q, rows[3][1] / echo_q

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
            print(f"GetJob / echo = {ratio:.2f} (target >= {TARGET}); "
                  f"with min_etag (served from the cache) {cached_ratio:.2f}")
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
    p.add_argument("--streams", action="store_true",
                   help="measure WatchJobs streams (open, memory, fan-out) instead of reads")
    p.add_argument("--watchers", type=lambda v: [int(x) for x in v.split(",") if x],
                   default=[1000, 5000], help="idle stream counts, comma-separated")
    p.add_argument("--fanout", type=lambda v: [int(x) for x in v.split(",") if x],
                   default=[1000, 10000], help="watcher counts for one event, comma-separated")
    p.add_argument("--events", type=int, default=5, help="events per fan-out row")
    p.add_argument("--log-streams", type=lambda v: [int(x) for x in v.split(",") if x],
                   default=[1000], help="idle StreamJobLogs follower counts (with --streams; '' for none)")
    args = p.parse_args()
    with tempfile.TemporaryDirectory():
        sys.exit(asyncio.run(run(args)))


if __name__ == "__main__":
    main()
