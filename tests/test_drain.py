# ruff: noqa: ASYNC109  -- tests bound real streams by deadlines
"""Graceful drain, log resume, client reconnect and keepalive (issue 15 item 4).

The whole stack runs as real processes (etcd, ClusterManager, the local
driver, JobManager) over TLS with tokens. A job prints numbered lines slowly,
to stdout and (every tenth) to stderr; an SDK follower (``stream_job_logs``)
and a ``dlsched logs -f`` subprocess follow it while

- JobManager gets SIGTERM and a new one starts on the same port: both get
  exactly the job's lines, none missing, none twice (the stream ended
  UNAVAILABLE / SHUTTING_DOWN and they resumed from the last cursor);
- with two JobManagers and clients built with both addresses, the one they
  are on is SIGKILLed: they carry on on the other, again with the exact lines.

300 unary calls in flight at a SIGTERM end OK or UNAVAILABLE, none CANCELLED
(the channel has retries off, so the codes are the server's own). A client
frozen (SIGSTOP) while holding a WatchJobs stream has it released by the
server's keepalive: the server's ``dlsched_rpc_streams_active`` gauge drops
within seconds with ``--keepalive-seconds 2 --keepalive-timeout-seconds 2``
(gRPC core's 60 s ping timeout, the old behaviour, would hold it far longer).
A malformed or foreign cursor is INVALID_ARGUMENT naming ``resume_cursor``.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import textwrap
import urllib.request
import uuid
from collections.abc import Awaitable, Callable, Iterator

import grpc
import pytest
from grpc_status import rpc_status

from dlsched.client import DlschedRpcError, JobManagerClient
from dlsched.kit import tls as tls_kit
from dlsched.kit.channel import TokenSource
from dlsched.kit.rpc_errors import error_info, field_violations
from dlsched.v1 import job_manager_service_pb2 as pb
from dlsched.v1 import job_manager_service_pb2_grpc as pb_grpc
from dlsched.v1 import job_pb2
from job_manager.domain.log_cursor import LogCursor, Skipper
from tests import security
from tests.harness import ROOT, EtcdServer, ServiceProcess, Stack

LINES = 300       # stdout lines the job prints
PAUSE = 0.05      # seconds between them
DEADLINE = 180.0  # generous bound on every follower
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}
STDOUT = [f"line-{i}" for i in range(LINES)]
STDERR = [f"err-{i}" for i in range(0, LINES, 10)]


@pytest.fixture(scope="module")
def stack(etcd: EtcdServer) -> Iterator[Stack]:
    s = Stack(etcd, f"/dlsched-drain-{uuid.uuid4().hex[:8]}/",
              jm_args=["--stream-heartbeat-seconds", "2"])
    with s.running():
        yield s


@pytest.fixture
async def cluster(stack: Stack) -> str:
    return await stack.register_local()


def new_jm(stack: Stack, *args: str, name: str = "job-manager") -> ServiceProcess:
    """Another JobManager of the stack (not started); ``--listen`` in args wins."""
    return ServiceProcess("job_manager", [
        *stack.etcd.service_args(), "--prefix", stack.prefix, "--cluster-manager",
        stack.cm.address, "--stream-heartbeat-seconds", "2", *args], name=name)


async def submit_printer(address: str) -> job_pb2.Job:
    code = textwrap.dedent(f"""\
        import sys, time
        for i in range({LINES}):
            print(f"line-{{i}}", flush=True)
            if i % 10 == 0:
                print(f"err-{{i}}", file=sys.stderr, flush=True)
            time.sleep({PAUSE})
        """)
    spec = job_pb2.JobSpec(run_mode=job_pb2.RUN_MODE_SINGLE_PROCESS, replica_groups=[
        job_pb2.ReplicaGroup(role="main", replicas=1, command=[sys.executable, "-u", "-c", code])])
    async with security.channel(address) as ch:
        resp = await pb_grpc.JobManagerServiceStub(ch).SubmitJob(pb.SubmitJobRequest(
            job_id=f"drain-{uuid.uuid4().hex[:8]}", spec=spec, request_id=uuid.uuid4().hex))
    job: job_pb2.Job = resp.job
    return job


async def sdk_follow(target: str, name: str, got: list[tuple[int, str]],
                     reconnects: list[DlschedRpcError]) -> None:
    async with security.channel(target) as ch:
        jm = JobManagerClient(target, channel=ch)
        async for e in jm.stream_job_logs(name, follow=True, on_reconnect=reconnects.append):
            got.append((e.stream, e.text))


async def cli_follow(target: str, job_id: str, got: list[str]) -> tuple[int, str]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "dlsched", "--server", target, "logs", "-f", job_id,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, cwd=str(ROOT), env=ENV)
    assert proc.stdout is not None and proc.stderr is not None
    err = asyncio.ensure_future(proc.stderr.read())
    try:
        while line := await proc.stdout.readline():
            got.append(line.decode().rstrip("\n"))
        return await proc.wait(), (await err).decode()
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


async def until(cond: Callable[[], bool], within: float, what: str) -> None:
    try:
        async with asyncio.timeout(within):
            while True:
                if cond():
                    return
                await asyncio.sleep(0.1)
    except TimeoutError:
        raise AssertionError(what) from None


def by_stream(got: list[tuple[int, str]], stream: int) -> list[str]:
    return [t for s, t in got if s == stream]


async def follow_through(target: str, job: job_pb2.Job,
                         disrupt: Callable[[], Awaitable[None]]) -> None:
    """An SDK and a CLI follower on ``target``; ``disrupt()`` once both have
    lines; then both must have exactly the job's lines."""
    sdk_got: list[tuple[int, str]] = []
    cli_got: list[str] = []
    reconnects: list[DlschedRpcError] = []
    job_id = job.name.split("/", 1)[1]
    sdk = asyncio.ensure_future(sdk_follow(target, job.name, sdk_got, reconnects))
    cli = asyncio.ensure_future(cli_follow(target, job_id, cli_got))
    try:
        await until(lambda: len(sdk_got) >= 20 and len(cli_got) >= 5 or sdk.done() or cli.done(),
                    90, "the followers got no lines")
        assert not sdk.done() and not cli.done(), "a follower ended before the disruption"
        assert len(cli_got) < LINES - 20, "the job ended before the disruption; make it slower"
        await disrupt()
        _, (rc, err) = await asyncio.wait_for(asyncio.gather(sdk, cli), DEADLINE)
    finally:
        for t in (sdk, cli):
            t.cancel()
        await asyncio.gather(sdk, cli, return_exceptions=True)
    assert by_stream(sdk_got, job_pb2.LOG_STREAM_STDOUT) == STDOUT
    assert by_stream(sdk_got, job_pb2.LOG_STREAM_STDERR) == STDERR
    assert reconnects and all(e.code == "UNAVAILABLE" for e in reconnects), reconnects
    assert rc == 0, err
    assert cli_got == STDOUT, err
    assert "reconnecting" in err, err


async def test_log_followers_survive_sigterm_and_restart(stack: Stack, cluster: str) -> None:
    assert stack.jm is not None
    address = stack.jm.address
    job = await submit_printer(address)

    async def sigterm_and_restart() -> None:
        assert stack.jm is not None
        assert await asyncio.to_thread(stack.jm.stop) == 0, stack.jm.log()
        stack.jm = new_jm(stack, "--listen", address)
        await asyncio.to_thread(stack.jm.start)

    await follow_through(address, job, sigterm_and_restart)


async def test_log_followers_move_to_the_other_replica(stack: Stack, cluster: str) -> None:
    assert stack.jm is not None
    other = new_jm(stack, name="job-manager-2").start()
    try:
        # pick_first: both clients use the first address until it dies.
        target = f"ipv4:{stack.jm.address},{other.address}"
        job = await submit_printer(stack.jm.address)

        async def kill_first() -> None:
            assert stack.jm is not None
            await asyncio.to_thread(stack.jm.kill)

        await follow_through(target, job, kill_first)
    finally:
        other.stop()
        stack.jm.start()


def plain_channel(address: str) -> grpc.aio.Channel:
    """``security.channel`` without retries: the codes seen are the server's."""
    s = security.current()
    return tls_kit.channel(address, s.service_tls(), client_cert=True,
                           token=TokenSource(token=s.admin_token),
                           extra_options=[("grpc.enable_retries", 0)])


async def test_sigterm_with_300_unary_calls_in_flight_cancels_none(stack: Stack,
                                                                   cluster: str) -> None:
    assert stack.jm is not None
    address = stack.jm.address
    job = await submit_printer(address)
    codes: dict[str, int] = {}
    reasons: dict[str, int] = {}
    stop = asyncio.Event()

    async def caller(stub: pb_grpc.JobManagerServiceStub, i: int) -> None:
        while not stop.is_set():
            try:
                if i % 2:
                    await stub.GetJob(pb.GetJobRequest(name=job.name), timeout=60)
                else:
                    await stub.ListJobs(pb.ListJobsRequest(page_size=50), timeout=60)
                code = "OK"
            except grpc.aio.AioRpcError as e:
                code = e.code().name
                info = error_info(e)
                reasons[info.reason if info else ""] = reasons.get(info.reason if info else "", 0) + 1
            codes[code] = codes.get(code, 0) + 1
            if code != "OK":
                return  # as an application would: the SDK raised; it calls elsewhere

    async with plain_channel(address) as ch:
        stub = pb_grpc.JobManagerServiceStub(ch)
        callers = [asyncio.ensure_future(caller(stub, i)) for i in range(300)]
        try:
            await until(lambda: codes.get("OK", 0) >= 600, 60, "the calls did not get through")
            ok_before = codes["OK"]
            proc = stack.jm.proc
            assert proc is not None
            proc.send_signal(signal.SIGTERM)
            await asyncio.to_thread(proc.wait, 30)
            stop.set()
            await asyncio.wait_for(asyncio.gather(*callers), 90)
        finally:
            stop.set()
            for c in callers:
                c.cancel()
            await asyncio.gather(*callers, return_exceptions=True)
    old, stack.jm = stack.jm, new_jm(stack, "--listen", address).start()
    assert proc.returncode == 0, old.log()
    # Every caller had one call in flight at the signal: each ended OK
    # (finished in the grace) or UNAVAILABLE (refused, or failed at its end).
    assert sum(codes.values()) - ok_before >= 300, codes
    assert "CANCELLED" not in codes, (codes, reasons)
    assert set(codes) <= {"OK", "UNAVAILABLE"}, (codes, reasons)
    assert codes.get("UNAVAILABLE", 0) >= 1, codes


def streams_active(metrics_file: str, method: str) -> float:
    with open(metrics_file) as f:
        url = f"http://{f.read().strip()}/metrics"
    with urllib.request.urlopen(url, timeout=10) as r:
        for line in r.read().decode().splitlines():
            if line.startswith("dlsched_rpc_streams_active{") and f'method="{method}"' in line:
                return float(line.rsplit(" ", 1)[1])
    return 0.0


async def test_keepalive_frees_a_frozen_clients_streams(stack: Stack, cluster: str) -> None:
    jm = new_jm(stack, "--keepalive-seconds", "2", "--keepalive-timeout-seconds", "2",
                "--metrics-listen", "127.0.0.1:0", name="job-manager-keepalive").start()
    metrics = jm.port_file + ".metrics"
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "dlsched", "--server", jm.address, "watch",
        stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL, cwd=str(ROOT),
        env=ENV)
    try:
        await until(lambda: streams_active(metrics, "WatchJobs") == 1, 60, "no watch stream")
        os.kill(proc.pid, signal.SIGSTOP)
        # Keepalive 2 s + 2 s; gRPC core's default ping timeout alone is 60 s.
        await until(lambda: streams_active(metrics, "WatchJobs") == 0, 30,
                    "the frozen client's stream was not released")
    finally:
        proc.kill()  # SIGKILL ends a stopped process too; asyncio may reap it at once, so no
        await proc.wait()  # signal goes to its pid after this (it may belong to no one by then)
        jm.stop()


async def test_keepalive_flags_default_to_30_and_10_seconds() -> None:
    from job_manager.__main__ import parse_args

    cfg = parse_args(["--etcd", "127.0.0.1:1", "--cluster-manager", "127.0.0.1:2", "--no-auth"])
    assert (cfg.keepalive_seconds, cfg.keepalive_timeout_seconds) == (30.0, 10.0)


async def test_a_bad_cursor_is_invalid_argument(stack: Stack, cluster: str) -> None:
    assert stack.jm is not None
    job = await submit_printer(stack.jm.address)
    other = await submit_printer(stack.jm.address)
    async with security.channel(stack.jm.address) as ch:
        stub = pb_grpc.JobManagerServiceStub(ch)
        # A cursor the server issued for the other job.
        foreign = ""
        async for resp in stub.StreamJobLogs(pb.StreamJobLogsRequest(name=other.name, follow=True)):
            if resp.entries:
                foreign = resp.resume_cursor
                break
        assert foreign
        # This job's uid with the other job's attempt (a backend id the cursor alone names):
        # the driver knows no such attempt of this job (it answered NOT_FOUND about it).
        theirs = (await stub.GetJob(pb.GetJobRequest(name=other.name))).job.backend_job_id
        deadline = asyncio.get_running_loop().time() + 120
        while not (await stub.GetJob(pb.GetJobRequest(name=job.name))).job.backend_job_id:
            assert asyncio.get_running_loop().time() < deadline, "the job never launched"
            await asyncio.sleep(0.1)  # launched: its own attempt is known
        forged = LogCursor(job.uid, theirs).encode()
        # an attempt no backend id can be (the driver refused it naming its own field)
        unbounded = [LogCursor(job.uid, a).encode() for a in ("x" * 300, "a\x00b")]
        for bad in ("not a cursor!", "eJzLSM3JyQcABiwCFQ", foreign, forged, *unbounded):
            with pytest.raises(grpc.aio.AioRpcError) as ei:
                async for _ in stub.StreamJobLogs(pb.StreamJobLogsRequest(
                        name=job.name, resume_cursor=bad)):
                    pass
            assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert [v.field for v in field_violations(ei.value)] == ["resume_cursor"]
            assert rpc_status.from_call(ei.value) is not None


async def test_a_foreign_cursor_is_refused_before_the_job_launches(stack: Stack, etcd: EtcdServer) -> None:
    """A job not launched yet (PENDING on a cluster nobody runs) still refuses another
    job's cursor, followed or not, instead of ending or waiting for the launch."""
    from datetime import UTC, datetime

    from dlsched.kit.etcd import connect
    from job_manager.domain.model import Job, JobSpec, JobState, ReplicaGroup
    from tests.test_watch_cache import put_jobs

    assert stack.jm is not None
    now = datetime.now(UTC)
    pending = Job(id=f"p{uuid.uuid4().hex[:8]}", uid=uuid.uuid4().hex, state=JobState.PENDING,
                  cluster="clusters/nobody-runs-this", attempt=0, create_time=now, update_time=now,
                  owner="admin", spec=JobSpec(run_mode=1, replica_groups=[
                      ReplicaGroup(role="main", replicas=1, command=["true"])]))
    client = await connect(etcd.endpoint)
    try:
        await put_jobs(client, stack.prefix, [pending])
    finally:
        await client.close()
    foreign = LogCursor(uuid.uuid4().hex).encode()
    async with security.channel(stack.jm.address) as ch:
        stub = pb_grpc.JobManagerServiceStub(ch)
        for follow in (False, True):
            with pytest.raises(grpc.aio.AioRpcError) as ei:
                async with asyncio.timeout(60):
                    async for _ in stub.StreamJobLogs(pb.StreamJobLogsRequest(
                            name=f"jobs/{pending.id}", resume_cursor=foreign, follow=follow)):
                        pass
            assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT, follow
            assert [v.field for v in field_violations(ei.value)] == ["resume_cursor"]
        # A bad role or replica index too, at once (a follow kept beating until the launch).
        for req, field in ((pb.StreamJobLogsRequest(name=f"jobs/{pending.id}", follow=True, replica_index=-1),
                            "replica_index"),
                           (pb.StreamJobLogsRequest(name=f"jobs/{pending.id}", follow=True, role="Bad Role"),
                            "role")):
            with pytest.raises(grpc.aio.AioRpcError) as ei:
                async with asyncio.timeout(60):
                    async for _ in stub.StreamJobLogs(req):
                        pass
            assert [v.field for v in field_violations(ei.value)] == [field]


async def test_resume_from_each_cursor_gives_exactly_the_rest(stack: Stack, cluster: str) -> None:
    """Without any shutdown: a stream resumed from any response's cursor
    (heartbeats included) sends exactly the lines after it."""
    assert stack.jm is not None
    job = await submit_printer(stack.jm.address)
    async with security.channel(stack.jm.address) as ch:
        stub = pb_grpc.JobManagerServiceStub(ch)
        batches: list[tuple[list[tuple[int, str]], str]] = []
        async for resp in stub.StreamJobLogs(pb.StreamJobLogsRequest(name=job.name, follow=True)):
            # Every response carries a cursor (the proto says so), the first too: it comes at
            # once, empty, with this job's cursor of nothing delivered.
            assert resp.resume_cursor, batches
            batches.append(([(e.stream, e.text) for e in resp.entries], resp.resume_cursor))
        assert not batches[0][0]
        everything = [x for b, _ in batches for x in b]
        assert by_stream(everything, job_pb2.LOG_STREAM_STDOUT) == STDOUT
        # Resumed from it, the stream is the first call again: every line, or the tail asked for.
        for tail, want in ((0, everything), (3, None)):
            again: list[tuple[int, str]] = []
            async for resp in stub.StreamJobLogs(pb.StreamJobLogsRequest(
                    name=job.name, tail_lines=tail, resume_cursor=batches[0][1])):
                again.extend((e.stream, e.text) for e in resp.entries)
            if want is not None:
                for s in (job_pb2.LOG_STREAM_STDOUT, job_pb2.LOG_STREAM_STDERR):
                    assert by_stream(again, s) == by_stream(want, s)
            else:
                assert by_stream(again, job_pb2.LOG_STREAM_STDOUT) == STDOUT[-3:]
        cursored = [i for i, (b, _) in enumerate(batches) if b]
        for i in (cursored[0], cursored[1], cursored[len(cursored) // 2], cursored[-1]):
            rest: list[tuple[int, str]] = []
            async for resp in stub.StreamJobLogs(pb.StreamJobLogsRequest(
                    name=job.name, follow=True, tail_lines=5, resume_cursor=batches[i][1])):
                rest.extend((e.stream, e.text) for e in resp.entries)
            done = [x for b, _ in batches[:i + 1] for x in b]
            for s in (job_pb2.LOG_STREAM_STDOUT, job_pb2.LOG_STREAM_STDERR):
                assert by_stream(done, s) + by_stream(rest, s) == by_stream(everything, s), i


def test_cursor_skips_exactly_what_was_delivered() -> None:
    """The cursor's rule on dated and undated lines, equal times included."""
    out, err = ("main", 0, 1), ("main", 0, 2)
    lines = [(out, 10), (out, 10), (err, 10), (out, 11), (out, 11), (out, 12), (err, 13)]
    for cut in range(len(lines) + 1):
        c = LogCursor("uid", "a1")
        for key, t in lines[:cut]:
            c.delivered(key, t)
        back = LogCursor.decode(c.encode())
        assert back == c
        skip = Skipper(back)
        assert [x for x in lines if not skip.seen(*x)] == lines[cut:], cut
    undated = [(out, 0)] * 5
    for cut in range(6):
        c = LogCursor("uid", "a1")
        for key, t in undated[:cut]:
            c.delivered(key, t)
        skip = Skipper(LogCursor.decode(c.encode()))
        assert sum(not skip.seen(*x) for x in undated) == 5 - cut
    # A whole stream (no tail_lines, no since_time) on a backend whose logs only grow: counted.
    # Slurm dated the lines by their file's last write (12) when they went out, and by its log
    # index (11, 11, 13) on the re-read: by dates the third would go out twice.
    sent, again = [(out, 12)] * 3, [(out, 11), (out, 11), (out, 13), (out, 13), (out, 14)]
    for by_count, whole in ((True, True), (False, True), (True, False)):
        c = LogCursor("uid")
        c.at_attempt("a1", whole)
        for key, t in sent:
            c.delivered(key, t)
        back = LogCursor.decode(c.encode())
        assert back == c and back.whole is whole
        skip = Skipper(back, by_count)
        got = [x for x in again if not skip.seen(*x)]
        assert got == (again[3:] if by_count and whole else again[2:]), (by_count, whole)
    for bad in ("", "!!", "eJzLSM3JyQcABiwCFQ", "x" * (1 << 21)):
        with pytest.raises(Exception) as ei:
            LogCursor.decode(bad)
        assert getattr(ei.value, "violations", [None])[0].field == "resume_cursor"


async def test_sdk_does_not_retry_a_server_that_never_answered() -> None:
    """The reconnect loop is for streams that were established: with nothing
    listening, ``stream_job_logs`` fails UNAVAILABLE at once."""
    from tests.harness import free_port

    address = f"127.0.0.1:{free_port()}"
    async with security.channel(address) as ch:
        jm = JobManagerClient(address, channel=ch)
        with pytest.raises(DlschedRpcError) as ei:
            async with asyncio.timeout(60):
                async for _ in jm.stream_job_logs("jobs/x", follow=True):
                    pass
        assert ei.value.code == "UNAVAILABLE"


async def test_expire_fails_running_unary_calls_unavailable_and_leaves_client_cancels_alone() -> None:
    """``Drain`` in a real grpc.aio server: ``expire()`` ends a unary call still in its
    handler with UNAVAILABLE / SHUTTING_DOWN (the handler's own ``finally`` ran), and
    a call its client cancelled is cancelled in the handler too, not turned into anything."""
    from dlsched.kit.server import Drain

    drain = Drain()
    entered: list[str] = []
    cleaned: list[str] = []

    async def hang(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        entered.append(request.decode())
        try:
            await asyncio.Event().wait()
        finally:
            cleaned.append(request.decode())
        return b""

    server = grpc.aio.server(interceptors=[drain])
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(
        "t.S", {"Hang": grpc.unary_unary_rpc_method_handler(hang)})])
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            call = ch.unary_unary("/t.S/Hang")
            left = call(b"left")
            kept = call(b"kept")
            await until(lambda: sorted(entered) == ["kept", "left"], 60, "both calls in their handler")
            left.cancel()
            await until(lambda: "left" in cleaned, 60, "the cancelled call's handler ending")
            drain.begin()
            drain.expire()
            with pytest.raises(grpc.aio.AioRpcError) as ei:
                await asyncio.wait_for(kept, 60)
            assert ei.value.code() == grpc.StatusCode.UNAVAILABLE
            info = error_info(ei.value)
            assert info is not None and info.reason == "SHUTTING_DOWN"
            assert sorted(cleaned) == ["kept", "left"]
            assert await drain.settle(30)
    finally:
        await server.stop(None)


async def test_closed_streams_memory_is_handed_back_to_the_system() -> None:
    """``Drain`` counts the streams that end (client gone or handler done) and its
    ``Trimmer`` runs glibc's malloc_trim once ``threshold`` of them ended, not before."""
    from dlsched.kit.memory import Trimmer
    from dlsched.kit.server import Drain

    drain = Drain()
    trimmed: list[int] = []
    drain.trimmer = Trimmer(threshold=20, every=0.05, trim=lambda: trimmed.append(1) or 0)
    assert Trimmer().maybe_trim() is False  # the real one: nothing ended yet, nothing done

    async def watch(request: bytes, context: grpc.aio.ServicerContext):  # type: ignore[no-untyped-def]
        yield b"x"
        await asyncio.Event().wait()

    server = grpc.aio.server(interceptors=[drain])
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(
        "t.S", {"Watch": grpc.unary_stream_rpc_method_handler(watch)})])
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    trimming = asyncio.create_task(drain.trimmer.run())
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            calls = [ch.unary_stream("/t.S/Watch")(b"") for _ in range(30)]
            for c in calls:
                await c.read()
            for c in calls[:10]:
                c.cancel()
            await asyncio.sleep(1)  # ten ended: under the threshold
            assert trimmed == []
            for c in calls[10:]:
                c.cancel()
            await until(lambda: trimmed == [1], 60, "a trim after 30 streams ended")
            await asyncio.sleep(0.5)
            assert trimmed == [1]  # once: the count starts again
    finally:
        trimming.cancel()
        await server.stop(None)


def test_malloc_trim_is_found_on_glibc() -> None:
    import platform

    from dlsched.kit.memory import _glibc_trim
    if platform.libc_ver()[0] != "glibc":
        pytest.skip("not a glibc system")
    trim = _glibc_trim()
    assert trim is not None
    assert trim() in (0, 1)
