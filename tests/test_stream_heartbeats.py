# ruff: noqa: ASYNC109  -- tests bound real streams by deadlines
"""Heartbeats keep quiet streams open through a proxy that closes idle ones.

Between the clients and JobManager sits ``IdleCuttingProxy``: a real TCP
proxy (asyncio) that forwards bytes both ways and closes both sides of a
connection once no byte has crossed it for ``IDLE`` seconds, as L7 proxies and
load balancers do with quiet streams. It counts bytes, not messages, so
anything on the wire resets its timer, HTTP/2 PINGs included (a TCP proxy
forwards them; an L7 proxy answers them itself, which is why they keep
nothing open there). The test's channels therefore ping every 120 s at most
(``grpc.keepalive_time_ms``), longer than the test, and the server's own
keepalive pings (every 30 s) come later than the proxy's cut.

One JobManager runs with ``--stream-heartbeat-seconds 5``: a WatchJobs stream
and a followed StreamJobLogs of a job that prints nothing for 60 s stay open
through the proxy to the job's end, over raw stubs (which see the heartbeats),
the SDK and ``dlsched logs -f`` (which hide them) and the HTTP gateway's NDJSON
stream (which passes them on as lines). A second JobManager on the same etcd
with heartbeats off (0) has the same streams cut by the proxy: the proxy
really cuts.
"""

from __future__ import annotations

import asyncio
import json
import os
import ssl
import sys
import tempfile
import textwrap
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass

import aiohttp
import grpc
import pytest

from dlsched.client import JobManagerClient
from dlsched.kit import pki
from dlsched.kit import tls as tls_kit
from dlsched.kit.channel import TokenSource
from dlsched.v1 import job_manager_service_pb2 as pb
from dlsched.v1 import job_manager_service_pb2_grpc as pb_grpc
from dlsched.v1 import job_pb2
from tests import security
from tests.harness import ROOT, EtcdServer, ServiceProcess, Stack

IDLE = 10.0       # the proxy cuts a connection after this long without a byte
HEARTBEAT = 5     # JobManager's --stream-heartbeat-seconds, well under IDLE
QUIET = 62        # the job prints nothing for this long
DEADLINE = 150.0  # generous bound on every stream of the test
TERMINAL = {job_pb2.JOB_STATE_SUCCEEDED, job_pb2.JOB_STATE_FAILED, job_pb2.JOB_STATE_STOPPED}


# ---------------------------------------------------------------- the proxy

class IdleCuttingProxy:
    """A TCP proxy to ``upstream`` that closes a connection (both sides) after
    ``idle`` seconds in which no byte crossed it in either direction."""

    def __init__(self, upstream: str, idle: float) -> None:
        self.upstream = upstream
        self.idle = idle
        self.cuts = 0
        self.address = ""
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    async def __aenter__(self) -> IdleCuttingProxy:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        port = self._server.sockets[0].getsockname()[1]
        self.address = f"127.0.0.1:{port}"
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._server is not None
        self._server.close()
        for t in list(self._tasks):
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self._server.wait_closed()

    async def _serve(self, c_reader: asyncio.StreamReader, c_writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        host, port = self.upstream.rsplit(":", 1)
        loop = asyncio.get_running_loop()
        try:
            u_reader, u_writer = await asyncio.open_connection(host, int(port))
        except OSError:
            c_writer.close()
            self._tasks.discard(task)
            return
        last = loop.time()

        async def pump(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
            nonlocal last
            while data := await r.read(65536):
                last = loop.time()
                w.write(data)
                await w.drain()

        pumps = [asyncio.create_task(pump(c_reader, u_writer)),
                 asyncio.create_task(pump(u_reader, c_writer))]
        try:
            while not any(p.done() for p in pumps):
                left = last + self.idle - loop.time()
                if left <= 0:
                    self.cuts += 1
                    break
                await asyncio.wait(pumps, timeout=left, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for p in pumps:
                p.cancel()
            await asyncio.gather(*pumps, return_exceptions=True)
            for w in (c_writer, u_writer):
                w.close()
            self._tasks.discard(task)


# ---------------------------------------------------------------- fixtures

@dataclass
class Services:
    stack: Stack
    jm_on: ServiceProcess   # heartbeats every HEARTBEAT seconds
    jm_off: ServiceProcess  # heartbeats off
    gateway: ServiceProcess  # in front of jm_on


@pytest.fixture(scope="module")
def services(etcd: EtcdServer) -> Iterator[Services]:
    prefix = f"/dlsched-hb-{uuid.uuid4().hex[:8]}/"
    stack = Stack(etcd, prefix, jm_args=["--stream-heartbeat-seconds", str(HEARTBEAT)])
    extra: list[ServiceProcess] = []
    try:
        stack.start()
        assert stack.jm is not None
        jm_off = ServiceProcess("job_manager", [*etcd.service_args(), "--prefix", prefix,
                                                "--cluster-manager", stack.cm.address,
                                                "--stream-heartbeat-seconds", "0"], name="jm-no-heartbeat")
        extra.append(jm_off)
        jm_off.start()
        cert = pki.issue(security.current().ca, tempfile.mkdtemp(prefix="dlsched-hb-gw-"), "gateway")
        gw = ServiceProcess("gateway", ["--job-manager", stack.jm.address,
                                        "--cluster-manager", stack.cm.address,
                                        "--tls-cert-file", cert.cert_file,
                                        "--tls-key-file", cert.key_file], name="gateway-hb")
        extra.append(gw)
        gw.start()
        yield Services(stack, stack.jm, jm_off, gw)
    finally:
        for p in extra:
            p.stop()
        stack.stop()


def test_heartbeat_flag_is_bounded() -> None:
    from job_manager.__main__ import parse_args

    base = ["--etcd", "127.0.0.1:1", "--cluster-manager", "127.0.0.1:2", "--no-auth"]
    assert parse_args(base).stream_heartbeat_seconds == 15
    assert parse_args([*base, "--stream-heartbeat-seconds", "0"]).stream_heartbeat_seconds == 0
    for bad in ("31", "-1", "nan"):
        with pytest.raises(SystemExit):
            parse_args([*base, "--stream-heartbeat-seconds", bad])


# ---------------------------------------------------------------- helpers

def quiet_channel(address: str) -> grpc.aio.Channel:
    """``security.channel`` whose keepalive PINGs (which do cross a TCP proxy)
    come later than the end of the test, so only messages reset the proxy's
    idle timer."""
    s = security.current()
    return tls_kit.channel(address, s.service_tls(), client_cert=True,
                           token=TokenSource(token=s.admin_token),
                           extra_options=[("grpc.keepalive_time_ms", 120_000)])


async def raw_watch(stub: pb_grpc.JobManagerServiceStub, name: str,
                    ) -> list[pb.WatchJobsResponse]:
    """WatchJobs until ``name`` is terminal: every event, heartbeats included."""
    events: list[pb.WatchJobsResponse] = []
    async for ev in stub.WatchJobs(pb.WatchJobsRequest()):
        events.append(ev)
        if ev.job.name == name and ev.job.state in TERMINAL:
            return events
    raise AssertionError("WatchJobs ended before the job did")


def _key(ev: pb.WatchJobsResponse) -> tuple[int, str, int]:
    return ev.type, ev.job.name, ev.job.state


async def raw_logs(stub: pb_grpc.JobManagerServiceStub, name: str) -> tuple[list[str], int]:
    """A followed StreamJobLogs to its end: the lines, and the heartbeats (responses
    with no entries) seen."""
    lines: list[str] = []
    beats = 0
    async for resp in stub.StreamJobLogs(pb.StreamJobLogsRequest(name=name, follow=True)):
        if not resp.entries:
            beats += 1
        lines.extend(e.text for e in resp.entries)
    return lines, beats


async def sdk_watch(address: str, name: str) -> list[int]:
    """The SDK's watch_jobs until ``name`` is terminal: the event types it gave."""
    async with JobManagerClient(address, channel=quiet_channel(address)) as jm:
        types: list[int] = []
        async for ev in jm.watch_jobs():
            types.append(ev.type)
            if ev.job.name == name and ev.job.state in TERMINAL:
                return types
    raise AssertionError("watch_jobs ended before the job did")


async def cli_logs(address: str, job_id: str) -> tuple[int, str, str]:
    # The CLI's channel pings every 30 s: later than the proxy's cut.
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "dlsched", "--server", address, "logs", "-f", job_id,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, cwd=str(ROOT),
        env={**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"})
    try:
        out, err = await proc.communicate()
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


async def gateway_logs(address: str, job_id: str) -> list[dict[str, object]]:
    """The gateway's NDJSON log follow to its end, one dict per line."""
    ctx = ssl.create_default_context(cafile=security.current().ca.cert_file)
    headers = {"Authorization": f"Bearer {security.current().admin_token}"}
    timeout = aiohttp.ClientTimeout(total=DEADLINE)
    async with aiohttp.ClientSession(timeout=timeout) as http, http.get(
            f"https://{address}/v1/jobs/{job_id}/logs?follow=true", headers=headers, ssl=ctx) as resp:
        assert resp.status == 200, await resp.text()
        assert resp.content_type == "application/x-ndjson"
        return [json.loads(line) async for line in resp.content if line.strip()]


async def expect_cut(call: AsyncIterator[object]) -> grpc.StatusCode:
    """Reads a stream until it fails; its status code."""
    try:
        async for _ in call:
            pass
    except grpc.aio.AioRpcError as e:
        return e.code()
    raise AssertionError("the stream ended OK; the proxy should have cut it")


@pytest.fixture
async def cm_registered(services: Services) -> str:
    return await services.stack.register_local()


# ---------------------------------------------------------------- the test

async def test_heartbeats_keep_quiet_streams_open_through_an_idle_cutting_proxy(
        services: Services, cm_registered: str) -> None:
    job_id = f"hb-{uuid.uuid4().hex[:8]}"
    code = textwrap.dedent(f"""\
        import time
        print("start", flush=True)
        time.sleep({QUIET})
        print("end", flush=True)
        """)
    spec = job_pb2.JobSpec(run_mode=job_pb2.RUN_MODE_SINGLE_PROCESS, replica_groups=[
        job_pb2.ReplicaGroup(role="main", replicas=1, command=[sys.executable, "-u", "-c", code])])
    async with security.channel(services.jm_on.address) as ch:
        direct = pb_grpc.JobManagerServiceStub(ch)
        job = (await direct.SubmitJob(pb.SubmitJobRequest(job_id=job_id, spec=spec,
                                                          request_id=uuid.uuid4().hex))).job
        # Open every stream once the job has printed "start": from then on it is quiet.
        async with asyncio.timeout(60):
            while True:
                got = [e.text async for r in direct.StreamJobLogs(
                    pb.StreamJobLogsRequest(name=job.name)) for e in r.entries]
                if got == ["start"]:
                    break
                await asyncio.sleep(0.2)

    async with (IdleCuttingProxy(services.jm_on.address, IDLE) as on,
                IdleCuttingProxy(services.jm_off.address, IDLE) as off,
                IdleCuttingProxy(services.gateway.address, IDLE) as gw,
                quiet_channel(on.address) as on_ch, quiet_channel(off.address) as off_ch):
        on_stub = pb_grpc.JobManagerServiceStub(on_ch)
        off_stub = pb_grpc.JobManagerServiceStub(off_ch)
        results = await asyncio.wait_for(asyncio.gather(
            raw_watch(on_stub, job.name),
            raw_logs(on_stub, job.name),
            sdk_watch(on.address, job.name),
            cli_logs(on.address, job_id),
            gateway_logs(gw.address, job_id),
            expect_cut(off_stub.WatchJobs(pb.WatchJobsRequest())),
            expect_cut(off_stub.StreamJobLogs(pb.StreamJobLogsRequest(name=job.name, follow=True))),
        ), DEADLINE)
        events, (lines, log_beats), sdk_types, cli, ndjson, cut_watch, cut_logs = results

        # With heartbeats: every stream lasted the quiet minute to the job's end.
        assert events[-1].job.state == job_pb2.JOB_STATE_SUCCEEDED
        watch_beats = [ev for ev in events if ev.type == job_pb2.WATCH_EVENT_TYPE_HEARTBEAT]
        assert watch_beats, "no WatchJobs heartbeat in a quiet minute"
        for hb in watch_beats:
            assert not hb.HasField("job") and hb.resume_token
        assert lines == ["start", "end"] and log_beats >= 1
        assert job_pb2.WATCH_EVENT_TYPE_HEARTBEAT not in sdk_types  # the SDK hides them
        rc, out, err = cli
        assert (rc, out) == (0, "start\nend\n"), err  # so does `dlsched logs -f`
        # The gateway passes them on as NDJSON lines with no entries.
        texts = [e["text"] for m in ndjson for e in m.get("entries", [])]
        assert texts == ["start", "end"]
        assert [m for m in ndjson if not m.get("entries")] and not [m for m in ndjson if "error" in m]
        assert on.cuts == 0 and gw.cuts == 0

        # Without: the proxy cut the very same streams.
        assert cut_watch == grpc.StatusCode.UNAVAILABLE
        assert cut_logs == grpc.StatusCode.UNAVAILABLE
        assert off.cuts >= 1

        # A heartbeat's token resumes the watch with nothing lost or repeated:
        # the events that followed the last heartbeat, then (quiet) a heartbeat.
        last = max(i for i, ev in enumerate(events)
                   if ev.type == job_pb2.WATCH_EVENT_TYPE_HEARTBEAT)
        after = [_key(ev) for ev in events[last + 1:]
                 if ev.type != job_pb2.WATCH_EVENT_TYPE_HEARTBEAT]
        resumed: list[tuple[int, str, int]] = []
        async with asyncio.timeout(30):
            async for ev in on_stub.WatchJobs(pb.WatchJobsRequest(
                    resume_token=events[last].resume_token)):
                if ev.type == job_pb2.WATCH_EVENT_TYPE_HEARTBEAT:
                    break
                resumed.append(_key(ev))
        assert resumed[:len(after)] == after and after, (resumed, after)


async def test_a_watch_whose_filter_drops_every_event_still_gets_heartbeats(
        services: Services, cm_registered: str) -> None:
    """Events a stream filters out send nothing, so they must not postpone its heartbeat:
    while other jobs change more often than every HEARTBEAT seconds, a watcher of a label no
    job has still hears from the server within a few heartbeat periods."""
    spec = job_pb2.JobSpec(run_mode=job_pb2.RUN_MODE_SINGLE_PROCESS, replica_groups=[
        job_pb2.ReplicaGroup(role="main", replicas=1, command=["true"])])
    async with security.channel(services.jm_on.address) as ch:
        stub = pb_grpc.JobManagerServiceStub(ch)
        stop = asyncio.Event()

        async def churn() -> int:  # a job change every ~0.3 s, none the watcher sees
            n = 0
            while not stop.is_set():
                await stub.SubmitJob(pb.SubmitJobRequest(spec=spec, request_id=uuid.uuid4().hex))
                n += 1
                await asyncio.sleep(0.3)
            return n

        call = stub.WatchJobs(pb.WatchJobsRequest(filter="labels.nobody=has-this"))
        first = await call.read()
        assert first.type == job_pb2.WATCH_EVENT_TYPE_SNAPSHOT_COMPLETE
        churning = asyncio.create_task(churn())
        try:
            async with asyncio.timeout(DEADLINE):
                beat = await call.read()
            assert beat.type == job_pb2.WATCH_EVENT_TYPE_HEARTBEAT and beat.resume_token
        finally:
            stop.set()
            call.cancel()
            submitted = await churning
        assert submitted >= 2  # jobs did change meanwhile
