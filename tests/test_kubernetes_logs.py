"""The Kubernetes driver's logs: the pod log API, followed, tailed and since a time."""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest

pytest.importorskip("kmock")
pytest.importorskip("kubernetes")


from dlsched.v1 import driver_service_pb2 as dpb  # noqa: E402
from dlsched.v1 import job_pb2  # noqa: E402
from tests.harness import ServiceProcess  # noqa: E402
from tests.kube_emulator import (  # noqa: E402, F401 - the fixtures driver, emu, stub, by their names
    Emulator,
    configure,
    driver_fixture,
    emu_fixture,
    eventually,
    exited,
    kubelet,
    launch,
    new_id,
    spec,
    stub_fixture,
    wait_for,
)


async def test_logs_follow_a_replica_until_the_job_ends(stub: Any, emu: tuple[Emulator, str]) -> None:
    e, url = emu
    job = new_id("logs")
    await launch(stub, job, spec("single_process"))
    pod = f"{job}-1-main-0"
    got: list[str] = []

    async def follow() -> None:
        req = dpb.TailJobLogsRequest(cluster="clusters/k8s", job=dpb.JobRef(job_id=job), follow=True)
        async for r in stub.TailJobLogs(req, timeout=30):
            got.extend(x.text for x in r.entries)

    task = asyncio.create_task(follow())
    await asyncio.sleep(0.3)
    await kubelet(url, pod, "Running")
    e.write_log(pod, "epoch 1")
    await eventually(lambda: "epoch 1" in got)
    assert got == ["epoch 1"]
    e.write_log(pod, "epoch 2")
    await kubelet(url, pod, "Succeeded", **exited(0, "Completed"))
    await asyncio.wait_for(task, 60)
    assert got == ["epoch 1", "epoch 2"]
    tail = []
    async for r in stub.TailJobLogs(dpb.TailJobLogsRequest(cluster="clusters/k8s", job=dpb.JobRef(job_id=job),
                                                           tail_lines=1), timeout=10):
        tail.extend(r.entries)
    assert [t.text for t in tail] == ["epoch 2"] and tail[0].time.seconds > 0
    # A client that cancels a follow of a silent replica leaves no reader behind (see the fixture).
    quiet = new_id("quiet")
    await launch(stub, quiet, spec("single_process"))
    await kubelet(url, f"{quiet}-1-main-0", "Running")
    await wait_for(stub, quiet, [job_pb2.JOB_STATE_RUNNING])
    call = stub.TailJobLogs(dpb.TailJobLogsRequest(cluster="clusters/k8s", job=dpb.JobRef(job_id=quiet),
                                                   follow=True), timeout=30)
    await asyncio.sleep(0.5)
    call.cancel()

async def test_logs_since_a_time_ask_the_pod_log_api_for_since_seconds(stub: Any, emu: tuple[Emulator, str]) -> None:
    e, url = emu
    job = new_id("since")
    await launch(stub, job, spec("single_process"))
    pod = f"{job}-1-main-0"
    await kubelet(url, pod, "Running")
    since = time.time() - 60
    e.write_log(pod, "long before", at=since - 3600)
    e.write_log(pod, "just before", at=since - 0.5)  # inside the API's whole-second rounding: the driver drops it
    e.write_log(pod, "at the time", at=since + 0.001)
    e.write_log(pod, "now")
    before = len(e.paths)
    req = dpb.TailJobLogsRequest(cluster="clusters/k8s", job=dpb.JobRef(job_id=job))
    req.since_time.FromNanoseconds(int(since * 1e9))
    got = [x.text async for r in stub.TailJobLogs(req, timeout=10) for x in r.entries]
    assert got == ["at the time", "now"]
    (asked,) = [p for p in e.paths[before:] if f"/pods/{pod}/log?" in p]
    from urllib.parse import parse_qs, urlsplit

    q = parse_qs(urlsplit(asked.split(" ", 1)[1]).query)
    assert 60 <= int(q["sinceSeconds"][0]) <= 63, asked  # rounded up, never short
    assert q["timestamps"] == ["true"]


async def test_a_line_longer_than_a_message_goes_out_in_pieces(stub: Any, emu: tuple[Emulator, str]) -> None:
    """Output without a newline for a long while is not held whole in the driver: pieces of at
    most MAX_LINE_CHARS bytes, cut between characters, each with the line's time stamp (only
    its first piece carries it), which together are the line."""
    from drivers.common.convert import MAX_LINE_CHARS

    e, url = emu
    job = new_id("long")
    await launch(stub, job, spec("single_process"))
    pod = f"{job}-1-main-0"
    await kubelet(url, pod, "Running")
    line = "".join(f"{i:07d} €" for i in range(30_000))  # 300,000 characters, 360,000 bytes, one line
    e.write_log(pod, line)
    await kubelet(url, pod, "Succeeded", **exited(0, "Completed"))
    got: list[Any] = []
    async for r in stub.TailJobLogs(dpb.TailJobLogsRequest(cluster="clusters/k8s", job=dpb.JobRef(job_id=job)),
                                    timeout=30):
        got.extend(r.entries)
    texts = [x.text for x in got]
    assert len(texts) > 1 and max(len(t.encode()) for t in texts) <= MAX_LINE_CHARS
    assert "".join(texts) == line  # cut between characters, never inside one
    assert len({(x.time.seconds, x.time.nanos) for x in got}) == 1 and got[0].time.seconds > 0  # the line's time


async def test_a_client_that_reads_slowly_holds_the_pod_log_stream_back(stub: Any, emu: tuple[Emulator, str]) -> None:
    """A follower that does not read: the driver queues a bounded amount (QUEUED_CHARS) and the
    pod log stream waits in flow control, instead of the driver reading all the pod wrote into
    memory. Every line still arrives, in order, once the client reads."""
    e, url = emu
    job = new_id("slow")
    await launch(stub, job, spec("single_process"))
    pod = f"{job}-1-main-0"
    await kubelet(url, pod, "Running")
    # 128 MB: what sits in flow control between the emulator and the unread gRPC stream (socket
    # buffers both ways, HTTP/2 windows, the tail's 4 Mi characters) reached 35 MB on a loaded CI
    # machine, past half of the 64 MB this wrote before; reading it all is what this must catch.
    lines = [f"{i:06d} " + "x" * 16_000 for i in range(8_000)]
    for line in lines:
        e.write_log(pod, line)
    total = sum(len(x) + 40 for x in lines)
    req = dpb.TailJobLogsRequest(cluster="clusters/k8s", job=dpb.JobRef(job_id=job), follow=True)
    call = stub.TailJobLogs(req, timeout=300)
    got = [x.text for x in (await call.read()).entries]
    last, still = -1, time.monotonic()
    while time.monotonic() - still < 2.0:  # until the emulator's writes stall (or all went out)
        sent = e.log_sent.get((pod, "main"), 0)
        if sent != last:
            last, still = sent, time.monotonic()
        if sent >= total:
            break
        await asyncio.sleep(0.1)
    assert last < total / 2, (last, total)
    await kubelet(url, pod, "Succeeded", **exited(0, "Completed"))
    async for r in call:
        got.extend(x.text for x in r.entries)
    assert got == lines


async def _running_job_saying_hello(stub: Any, emu: tuple[Emulator, str], prefix: str) -> dpb.TailJobLogsRequest:
    """A job launched, its pod running and logging "hello": the request following its log."""
    e, url = emu
    job = new_id(prefix)
    await launch(stub, job, spec("single_process"))
    pod = f"{job}-1-main-0"
    await kubelet(url, pod, "Running")
    e.write_log(pod, "hello")
    return dpb.TailJobLogsRequest(cluster="clusters/k8s", job=dpb.JobRef(job_id=job), follow=True)


async def test_many_followers_never_hold_back_the_drivers_api_calls(stub: Any, emu: tuple[Emulator, str]) -> None:
    """Each follow holds a reader thread for as long as it lasts: 40 of them (more than the
    default thread pool of any machine) and the driver still launches and observes jobs."""
    e, url = emu
    req = await _running_job_saying_hello(stub, emu, "crowd")
    calls = [stub.TailJobLogs(req, timeout=300) for _ in range(40)]
    try:
        for call in calls:  # every follow has its reader (it has read the first line)
            assert [x.text for x in (await call.read()).entries] == ["hello"]
        other = new_id("other")
        await asyncio.wait_for(launch(stub, other, spec("single_process")), 60)
        await eventually(lambda: e.phase(f"{other}-1-main-0") != "")
    finally:
        for call in calls:
            call.cancel()


@contextlib.asynccontextmanager
async def _driver_with_readers(readers: int, url: str) -> AsyncIterator[tuple[ServiceProcess, Any]]:
    """A Kubernetes driver of its own with ``--max-log-readers readers``, clusters/k8s configured
    on the emulator: the process and a stub."""
    from dlsched.v1 import driver_service_pb2_grpc
    from tests import security
    from tests.kube_emulator import configure

    svc = ServiceProcess("drivers.kubernetes", ["--request-timeout", "3", "--qps", "500", "--burst", "1000",
                                                "--max-log-readers", str(readers)],
                         name=f"kubernetes-driver-{readers}-readers").start()
    try:
        async with security.channel(svc.address) as ch:
            stub = driver_service_pb2_grpc.DriverServiceStub(ch)
            await configure(stub, "clusters/k8s", url)
            yield svc, stub
    finally:
        svc.stop()


async def test_follows_past_the_reader_pool_are_refused_not_left_waiting(emu: tuple[Emulator, str]) -> None:
    """A follow holds a reader slot (an open response) for as long as it lasts. With
    ``--max-log-readers 8`` follows may hold 7: the 8th follow is RESOURCE_EXHAUSTED
    ``LOG_READERS_EXHAUSTED`` at once (not left waiting, silent, for a slot a follow may hold
    for days); a tail that ends is still
    read; once a follow ends, another is taken."""
    import grpc
    from google.rpc import error_details_pb2
    from grpc_status import rpc_status

    e, url = emu
    calls: list[Any] = []
    try:
        async with _driver_with_readers(8, url) as (svc, stub):
            follow = await _running_job_saying_hello(stub, emu, "readers")
            job = follow.job.job_id
            assert svc.proc is not None
            threads = len(os.listdir(f"/proc/{svc.proc.pid}/task"))
            for _ in range(7):
                call = stub.TailJobLogs(follow, timeout=300)
                calls.append(call)
                assert [x.text for x in (await call.read()).entries] == ["hello"]
            # Seven silent follows hold seven responses, not seven threads (a thread each before).
            assert len(os.listdir(f"/proc/{svc.proc.pid}/task")) < threads + 7

            refused = stub.TailJobLogs(follow, timeout=60)
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await refused.read()
            assert err.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
            status = rpc_status.from_call(err.value)
            assert status is not None
            info = error_details_pb2.ErrorInfo()
            assert any(d.Unpack(info) for d in status.details) and info.reason == "LOG_READERS_EXHAUSTED"

            once = stub.TailJobLogs(dpb.TailJobLogsRequest(cluster="clusters/k8s", job=dpb.JobRef(job_id=job)),
                                    timeout=60)
            assert [x.text for r in [m async for m in once] for x in r.entries] == ["hello"]

            calls.pop().cancel()

            deadline = time.monotonic() + 60
            while True:  # the cancelled follow's slot is given back as its reader ends
                call = stub.TailJobLogs(follow, timeout=300)
                try:
                    first = await call.read()
                except grpc.aio.AioRpcError as ex:
                    assert ex.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
                    assert time.monotonic() < deadline, "no follow was taken after one ended"
                    await asyncio.sleep(0.1)
                    continue
                calls.append(call)
                assert [x.text for x in first.entries] == ["hello"]
                break
    finally:
        for call in calls:
            call.cancel()


async def test_a_follow_cut_while_its_pod_runs_reads_on_from_its_last_line(
        stub: Any, emu: tuple[Emulator, str]) -> None:
    """The API server ends a followed log as if done when it loses the kubelet (a kubelet
    restart); the pod runs on. The follow ended OK there, the job still running; it now reads
    again from its last line's time: every line once, and it ends when the pod does."""
    e, url = emu
    req = await _running_job_saying_hello(stub, emu, "cut")
    pod = f"{req.job.job_id}-1-main-0"
    call = stub.TailJobLogs(req, timeout=300)
    got = [x.text for x in (await call.read()).entries]
    assert got == ["hello"]
    e.cut_follows()
    await asyncio.sleep(0.2)
    # of the very time of the line before it (a clock's tick): sent, and that one not again
    lines = e.logs[(pod, "main")]
    lines.append(lines[-1].split(" ", 1)[0] + " after the cut")
    e.log_event.set()
    more = await asyncio.wait_for(call.read(), 60)
    assert more is not grpc.aio.EOF, "the follow ended with the pod running"
    got += [x.text for x in more.entries]
    e.cut_follows()
    e.write_log(pod, "last")
    await kubelet(url, pod, "Succeeded", **exited(0, "Completed"))
    async for r in call:
        got.extend(x.text for x in r.entries)
    assert got == ["hello", "after the cut", "last"]


async def test_reads_that_never_end_keep_no_follow_waiting(emu: tuple[Emulator, str]) -> None:
    """Reads without follow hold their own eighth of the reader slots: two reads of a log that
    never ends (an API server that trickles) held both slots of ``--max-log-readers 2``, and a
    follow, let through by its count, then waited silently behind them for good. Now the
    second read waits for the first, and the follow is read at once."""
    e, url = emu
    calls: list[Any] = []
    try:
        async with _driver_with_readers(2, url) as (_, stub):
            slow = await _running_job_saying_hello(stub, emu, "trickle")
            e.trickle.add(f"{slow.job.job_id}-1-main-0")
            read = dpb.TailJobLogsRequest(cluster="clusters/k8s", job=slow.job)
            first = stub.TailJobLogs(read, timeout=300)
            calls.append(first)
            assert [x.text for x in (await first.read()).entries] == ["trickle"]
            calls.append(stub.TailJobLogs(read, timeout=300))  # waits for a read slot
            follow = await _running_job_saying_hello(stub, emu, "followed")
            call = stub.TailJobLogs(follow, timeout=300)
            calls.append(call)
            got = await asyncio.wait_for(call.read(), 60)
            assert [x.text for x in got.entries] == ["hello"]
    finally:
        for c in calls:
            c.cancel()


async def test_logs_of_a_kubeconfig_cluster_carry_its_token_and_a_bad_ca_is_invalid_argument(
        stub: Any, emu: tuple[Emulator, str]) -> None:
    """A kubeconfig's token sits where the client keeps it (``BearerToken``), not where a
    bearer-token credential's does: the pod log reads, which do not go through the client,
    sent no token at all for such a cluster. And a CA bundle that is no certificate is refused
    at configuration, naming the field, not an INTERNAL."""
    import grpc

    from dlsched.v1 import cluster_pb2
    from tests.kube_emulator import NS

    e, url = emu
    token = "kc-token-" + new_id("t")
    kubeconfig = (
        "apiVersion: v1\nkind: Config\n"
        f"clusters:\n- name: c\n  cluster: {{server: \"{url}\"}}\n"
        f"users:\n- name: u\n  user: {{token: \"{token}\"}}\n"
        "contexts:\n- name: x\n  context: {cluster: c, user: u}\ncurrent-context: x\n")
    await stub.ConfigureCluster(dpb.ConfigureClusterRequest(
        cluster="clusters/kc", options={"namespace": NS, "default_image": "python:3.11-slim"},
        credentials=cluster_pb2.ClusterCredentials(kubernetes=cluster_pb2.KubernetesCredentials(
            kubeconfig=kubeconfig))), timeout=15)
    try:
        job = new_id("kc")
        await launch(stub, job, spec("single_process"), cluster="clusters/kc")
        pod = f"{job}-1-main-0"
        await kubelet(url, pod, "Running")
        e.write_log(pod, "hello")
        asked = len(e.log_auth)
        req = dpb.TailJobLogsRequest(cluster="clusters/kc", job=dpb.JobRef(job_id=job))
        assert [x.text for r in [m async for m in stub.TailJobLogs(req, timeout=60)] for x in r.entries] == ["hello"]
        assert e.log_auth[asked:] == [f"Bearer {token}"]
    finally:
        await stub.RemoveCluster(dpb.RemoveClusterRequest(cluster="clusters/kc"), timeout=10)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stub.ConfigureCluster(dpb.ConfigureClusterRequest(
            cluster="clusters/bad-ca", address="https://127.0.0.1:1", options={"namespace": NS},
            credentials=cluster_pb2.ClusterCredentials(kubernetes=cluster_pb2.KubernetesCredentials(
                token="t", ca_cert="not a certificate"))), timeout=15)
    assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert "credentials.kubernetes.ca_cert" in (err.value.details() or "")


async def test_a_closed_pod_log_client_opens_nothing_again(emu: tuple[Emulator, str]) -> None:
    """A tail still waiting (for its pod, or a slot) when its cluster is reconfigured or removed
    must not open a new session on the dropped record: it would never be closed."""
    from dlsched.errors import Unavailable
    from drivers.common.base import ClusterConfig
    from drivers.kubernetes.api import KubeApi
    from tests.kube_emulator import NS

    _, url = emu
    api = KubeApi(ClusterConfig(name="clusters/closing", address=url), qps=100, burst=100, request_timeout=3)
    await api.close()
    with pytest.raises(Unavailable):
        await api.logs.open(NS, "no-such-pod", {"follow": "false"}, read_timeout=3)
    assert api.logs._session is None


async def test_an_adopted_job_of_several_processes_per_pod_reads_each_containers_log(
        stub: Any, emu: tuple[Emulator, str]) -> None:
    """A driver that finds a job on the watch (after a restart; here a second configuration of
    the same API server) learns each pod's containers from the pod: it asked the log API without
    a container, which a pod of several answers 400, so such a job showed no log at all."""
    e, url = emu
    await configure(stub, "clusters/adopter", url)
    try:
        job = new_id("procs")
        await launch(stub, job, spec("multi_process"))  # 2 workers x 2 processes, a container each
        for i in range(2):
            pod = f"{job}-1-worker-{i}"
            await kubelet(url, pod, "Running")
            for k in range(2):
                e.write_log(pod, f"worker {i} process {k}", container=f"proc-{k}")
        await wait_for(stub, job, [job_pb2.JOB_STATE_RUNNING], cluster="clusters/adopter")
        req = dpb.TailJobLogsRequest(cluster="clusters/adopter", job=dpb.JobRef(job_id=job))
        got = sorted((x.replica_index, x.text) for r in [m async for m in stub.TailJobLogs(req, timeout=60)]
                     for x in r.entries)
        assert got == [(0, "worker 0 process 0"), (1, "worker 0 process 1"),
                       (2, "worker 1 process 0"), (3, "worker 1 process 1")], got
    finally:
        await stub.RemoveCluster(dpb.RemoveClusterRequest(cluster="clusters/adopter"), timeout=10)


async def test_log_reads_bypass_the_proxy_where_the_client_does(stub: Any, emu: tuple[Emulator, str]) -> None:
    """The pod log request goes where the client's other requests go: a host in no_proxy is
    reached directly, not through the proxy (here one that refuses connections)."""
    from drivers.common.base import ClusterConfig
    from drivers.kubernetes.api import KubeApi
    from tests.kube_emulator import NS

    e, url = emu
    req = await _running_job_saying_hello(stub, emu, "proxied")
    pod = f"{req.job.job_id}-1-main-0"
    api = KubeApi(ClusterConfig(name="clusters/proxied", address=url), qps=100, burst=100, request_timeout=3)
    try:
        api.client.configuration.proxy = "http://127.0.0.1:9"  # nothing listens there
        api.client.configuration.no_proxy = "127.0.0.1,localhost"
        resp = await api.logs.open(NS, pod, {"follow": "false", "timestamps": "true"}, read_timeout=5)
        try:
            assert (await resp.read()).decode().endswith("hello\n")
        finally:
            resp.release()
    finally:
        await api.close()


async def test_a_follow_cut_mid_line_sends_that_line_whole(stub: Any, emu: tuple[Emulator, str]) -> None:
    """The API server's stream ends mid-line (its connection to the kubelet dropped) while the
    pod runs on: the follow reads on from its last line and sends the cut line whole, once (it
    sent the head as a line and skipped the rest as sent)."""
    import aiohttp.web

    e, url = emu
    job = new_id("midcut")
    await launch(stub, job, spec("single_process"))
    pod = f"{job}-1-main-0"
    await kubelet(url, pod, "Running")
    e.write_log(pod, "first")
    e.write_log(pod, "hello world, the whole line")
    serve = e._serve_log
    calls = 0

    async def cut_once(request: Any) -> Any:
        nonlocal calls
        calls += 1
        if calls > 1:
            return await serve(request)
        resp = aiohttp.web.StreamResponse()
        resp.content_type = "text/plain"
        await resp.prepare(request._raw_request)
        lines = e.logs[(pod, "main")]
        await resp.write((lines[0] + "\n").encode())
        await resp.write(lines[1].encode()[: len(lines[1]) - 15])
        await resp.write_eof()
        return resp

    e._serve_log = cut_once
    try:
        got: list[str] = []

        async def read() -> None:
            req = dpb.TailJobLogsRequest(cluster="clusters/k8s", job=dpb.JobRef(job_id=job), follow=True)
            async for r in stub.TailJobLogs(req, timeout=60):
                got.extend(x.text for x in r.entries)

        reader = asyncio.ensure_future(read())
        await eventually(lambda: calls >= 2)  # cut, then read on
        e.write_log(pod, "last")
        await kubelet(url, pod, "Succeeded", **exited(0, "Completed"))
        await asyncio.wait_for(reader, 60)
    finally:
        e._serve_log = serve
    assert got == ["first", "hello world, the whole line", "last"], got
