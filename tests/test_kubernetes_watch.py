"""The Kubernetes driver's status: one list + watch per cluster, re-lists, and an API server in trouble."""

from __future__ import annotations

import asyncio
from typing import Any

import grpc
import pytest

pytest.importorskip("kmock")
pytest.importorskip("kubernetes")


from dlsched.v1 import cluster_pb2, driver_service_pb2_grpc, job_pb2  # noqa: E402
from dlsched.v1 import driver_service_pb2 as dpb  # noqa: E402
from drivers.kubernetes import render  # noqa: E402
from tests import security  # noqa: E402
from tests.harness import ServiceProcess  # noqa: E402
from tests.kube_emulator import (  # noqa: E402, F401 - the fixtures driver, emu, stub, by their names
    NS,
    TOKEN,
    Emulator,
    backend_calls,
    configure,
    driver_fixture,
    emu_fixture,
    emulator,
    eventually,
    exited,
    kubelet,
    launch,
    measure,
    new_id,
    observe,
    pods_of,
    render_spec,
    spec,
    stub_fixture,
    wait_for,
)


async def test_status_of_many_jobs_comes_from_one_watch(driver: ServiceProcess) -> None:
    n = 1000
    ids = [f"bulk-{i}" for i in range(n)]
    async with security.channel(driver.address) as ch, emulator() as (e, url):
        stub = driver_service_pb2_grpc.DriverServiceStub(ch)
        for j in ids:  # pods the driver did not create: it adopts them from its list + watch
            pod = dict(render.render_job(j, render_spec(), 1, {"namespace": NS, "default_image": "x"}).manifests[1])
            pod["status"] = {"phase": "Running"}
            e.objects["v1/pods", NS, pod["metadata"]["name"]] = pod
        counted_before = backend_calls(driver)
        await configure(stub, "clusters/bulk", url)
        refs = [dpb.JobRef(job_id=j) for j in ids]

        async def batch() -> list[dpb.JobObservation]:
            resp = await stub.BatchGetJobObservations(dpb.BatchGetJobObservationsRequest(
                cluster="clusters/bulk", jobs=refs), timeout=10)
            return list(resp.observations)

        for _ in range(100):
            if all(o.state == job_pb2.JOB_STATE_RUNNING for o in await batch()):
                break
            await asyncio.sleep(0.1)
        else:
            raise AssertionError("the list did not deliver every pod")
        driver_requests = lambda: sum(1 for p in e.paths if not p.startswith("PATCH"))  # noqa: E731
        before = driver_requests()
        for i in range(5):  # five status intervals over 1,000 jobs, one job finishing in each
            await kubelet(url, f"bulk-{i}-1-main-0", "Succeeded", **exited(0, "Completed"))
            await wait_for(stub, f"bulk-{i}", [job_pb2.JOB_STATE_SUCCEEDED], cluster="clusters/bulk")
            obs = await batch()
            assert len(obs) == n and all(o.found for o in obs)
        assert driver_requests() - before <= 1  # at most a watch reconnect; never a request per job
        # /metrics counts exactly the API calls the emulator saw from the driver.
        assert backend_calls(driver) - counted_before == driver_requests()
        await stub.RemoveCluster(dpb.RemoveClusterRequest(cluster="clusters/bulk"), timeout=10)

async def test_an_unreachable_api_server_never_fails_jobs(driver: ServiceProcess) -> None:
    async with security.channel(driver.address) as ch:
        stub = driver_service_pb2_grpc.DriverServiceStub(ch)
        cluster = "clusters/flaky"
        async with emulator() as (e, url):
            await configure(stub, cluster, url)
            job = new_id("flaky")
            await launch(stub, job, spec("single_process"), cluster=cluster)
            await kubelet(url, f"{job}-1-main-0", "Running")
            await wait_for(stub, job, [job_pb2.JOB_STATE_RUNNING], cluster=cluster)
            assert f"Bearer {TOKEN}" in e.auth  # the token reached the API server (and no log line)
        # The emulator is gone: connection refused.
        obs = await wait_for(stub, job, [job_pb2.JOB_STATE_RUNNING], reason="BackendStale", cluster=cluster)
        assert obs.state == job_pb2.JOB_STATE_RUNNING
        info = (await stub.GetClusterInfo(dpb.GetClusterInfoRequest(cluster=cluster), timeout=15)).info
        assert info.state == cluster_pb2.CLUSTER_STATE_UNREACHABLE
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await launch(stub, new_id("flaky"), spec("single_process"), cluster=cluster)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        await stub.RemoveCluster(dpb.RemoveClusterRequest(cluster=cluster), timeout=10)

async def test_a_410_gone_watch_relists(stub: Any, emu: tuple[Emulator, str]) -> None:
    e, url = emu
    job = new_id("gone")
    await launch(stub, job, spec("single_process"))
    def relisted() -> bool:
        return e.gone_at > 0 and any(p.startswith("GET /api/v1/namespaces/dl/pods?") and "watch" not in p
                                     for p in e.paths[e.gone_at:])

    e.gone, e.gone_at = True, 0
    e.drop_streams()  # the watch breaks; the next one is answered 410 Gone
    await eventually(relisted)
    await kubelet(url, f"{job}-1-main-0", "Running")
    await wait_for(stub, job, [job_pb2.JOB_STATE_RUNNING])  # watching again after the re-list

async def test_a_410_inside_a_watch_relists_without_marking_the_cluster_stale(
        stub: Any, emu: tuple[Emulator, str], driver: ServiceProcess) -> None:
    """kube-apiserver answers a watch from a compacted resourceVersion with 200 and one ERROR
    event (code 410). That is a re-list, not a failure: the client's Watch raised KeyError on
    it (deserialize=False), so every compaction marked the whole cluster stale and backed off."""
    e, url = emu
    job = new_id("gone-in-stream")
    await launch(stub, job, spec("single_process"))

    def relisted() -> bool:
        return e.gone_at > 0 and any(p.startswith("GET /api/v1/namespaces/dl/pods?") and "watch" not in p
                                     for p in e.paths[e.gone_at:])

    gone = driver.log().count("resourceVersion gone (410)")
    e.gone, e.gone_in_stream, e.gone_at = True, True, 0
    e.drop_streams()  # (the broken watch is a failure; the next watch meets the 410)
    await eventually(relisted)
    await kubelet(url, f"{job}-1-main-0", "Running")
    await wait_for(stub, job, [job_pb2.JOB_STATE_RUNNING])
    # The re-list came from the 410 event, not from a failure of the watch (KeyError before).
    assert driver.log().count("resourceVersion gone (410)") == gone + 1, driver.log()[-2000:]
    assert "KeyError" not in driver.log()


async def test_render_and_watch_observations(stub: Any, emu: tuple[Emulator, str]) -> None:
    e, url = emu
    job = new_id("watched")
    rendered = await stub.RenderJob(dpb.RenderJobRequest(cluster="clusters/k8s", job_id=job,
                                                         spec=spec("master_worker")), timeout=10)
    assert rendered.native_spec.media_type == "application/yaml"
    assert f"master-0.{job}-1.{NS}.svc" in rendered.native_spec.content
    assert pods_of(e, job) == {}  # a dry run creates nothing
    call = stub.WatchJobObservations(dpb.WatchJobObservationsRequest(cluster="clusters/k8s"), timeout=20)
    try:
        async for ev in call:
            if ev.snapshot_complete:
                break
        await launch(stub, job, spec("single_process"))
        await kubelet(url, f"{job}-1-main-0", "Running")
        async for ev in call:
            if ev.observation.job_id == job and ev.observation.state == job_pb2.JOB_STATE_RUNNING:
                break
    finally:
        call.cancel()

async def test_an_api_server_answering_5xx_never_fails_jobs(driver: ServiceProcess) -> None:
    cluster = "clusters/five-xx"
    async with security.channel(driver.address) as ch, emulator() as (e, url):
        stub = driver_service_pb2_grpc.DriverServiceStub(ch)
        await configure(stub, cluster, url)
        job = new_id("five-xx")
        await launch(stub, job, spec("single_process"), cluster=cluster)
        pod = f"{job}-1-main-0"
        await kubelet(url, pod, "Running")
        await wait_for(stub, job, [job_pb2.JOB_STATE_RUNNING], cluster=cluster)

        e.fail_with = 503
        e.drop_streams()  # the watch breaks; every request after it is answered 503
        await eventually(lambda: e.failed >= 2)  # the informer's re-list was refused, and retried
        await wait_for(stub, job, [job_pb2.JOB_STATE_RUNNING], reason="BackendStale", cluster=cluster)
        info = (await stub.GetClusterInfo(dpb.GetClusterInfoRequest(cluster=cluster), timeout=10)).info
        assert info.state == cluster_pb2.CLUSTER_STATE_UNREACHABLE
        for call in (launch(stub, new_id("five-xx"), spec("single_process"), cluster=cluster), measure(stub, job, cluster)):
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await call
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        for _ in range(5):  # the last state is kept, never FAILED
            obs = await observe(stub, job, cluster)
            assert (obs.state, obs.reason) == (job_pb2.JOB_STATE_RUNNING, "BackendStale")
            await asyncio.sleep(0.1)

        e.fail_with = None  # the API server is well again: the informer re-lists and the job is current
        await wait_for(stub, job, [job_pb2.JOB_STATE_RUNNING], reason="Running", within=20, cluster=cluster)
        info = (await stub.GetClusterInfo(dpb.GetClusterInfoRequest(cluster=cluster), timeout=10)).info
        assert info.state == cluster_pb2.CLUSTER_STATE_READY
        await kubelet(url, pod, "Succeeded", **exited(0, "Completed"))
        await wait_for(stub, job, [job_pb2.JOB_STATE_SUCCEEDED], cluster=cluster)
        await stub.RemoveCluster(dpb.RemoveClusterRequest(cluster=cluster), timeout=10)


async def test_an_api_server_that_accepts_and_never_answers_is_stale() -> None:
    """A list or watch request that times out is the cluster failing: the informer used to take
    every timeout (a connect or a list timeout too) for an idle watch, so an API server that
    accepts connections and never answers was never reported, and was retried without backoff."""
    import threading

    from drivers.common.base import ClusterConfig
    from drivers.kubernetes.api import KubeApi
    from drivers.kubernetes.informer import PodInformer, RequestBudget

    held: list[asyncio.StreamWriter] = []

    async def silent(_r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        held.append(w)  # accepted, never answered

    server = await asyncio.start_server(silent, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    api = KubeApi(ClusterConfig(name="clusters/silent", address=f"http://127.0.0.1:{port}"),
                  qps=100, burst=100, request_timeout=1)
    stale = threading.Event()
    inf = PodInformer(api.core, NS, "dlsched.io/job-id", RequestBudget(100, 100), on_sync=lambda _: None,
                      on_event=lambda *_: None, on_stale=lambda _: stale.set(), request_timeout=1, read_timeout=1)
    try:
        inf.start()
        assert await asyncio.to_thread(stale.wait, 60), "a silent API server was never reported"
    finally:
        inf.stop()
        for w in held:
            w.close()
        server.close()
        await api.close()


class _WatchServer:
    """A raw HTTP API server for the informer alone: lists answer an empty pod list at
    resourceVersion 10; each watch is answered by ``mode``: ``drop`` sends one event (version 11)
    and cuts the connection without the final chunk, ``empty`` ends at once with nothing."""

    def __init__(self, mode: str) -> None:
        import socket
        import threading

        self.mode = mode
        self.lists = 0
        self.watch_lines: list[str] = []
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.port = self.sock.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        import threading

        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: Any) -> None:
        import json
        import time

        with conn:
            f = conn.makefile("rb")
            line = f.readline().decode()
            while f.readline() not in (b"\r\n", b""):
                pass
            if "watch=true" not in line:
                self.lists += 1
                body = json.dumps({"metadata": {"resourceVersion": "10"}, "items": []}).encode()
                conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                             b"Content-Length: %d\r\n\r\n" % len(body) + body)
                return
            self.watch_lines.append(line)
            conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n")
            if self.mode == "drop":
                ev = json.dumps({"type": "BOOKMARK", "object": {"metadata": {"resourceVersion": "11"}}}).encode()
                conn.sendall(b"%x\r\n" % (len(ev) + 1) + ev + b"\n\r\n")
                time.sleep(0.1)  # then cut: no terminating chunk
            else:
                conn.sendall(b"0\r\n\r\n")

    def close(self) -> None:
        self.sock.close()


@pytest.mark.parametrize("mode", ["drop", "empty"])
async def test_a_cut_watch_resumes_and_watches_that_end_at_once_back_off_to_stale(mode: str) -> None:
    """A watch cut mid-stream (a load balancer, an API server restart) resumes from the last
    resourceVersion without marking the cluster stale (it did, and re-listed every pod each time);
    watches that keep ending at once with nothing read (a proxy) are backed off and reported
    stale (they looped at the full request budget, the cluster shown fresh)."""
    import threading

    from kubernetes import client

    from drivers.kubernetes.informer import MAX_EMPTY_WATCHES, PodInformer, RequestBudget

    server = _WatchServer(mode)
    cfg = client.Configuration()
    cfg.host = f"http://127.0.0.1:{server.port}"
    api = client.ApiClient(cfg)
    stale: list[str] = []
    reported = threading.Event()

    def on_stale(msg: str) -> None:
        stale.append(msg)
        reported.set()

    inf = PodInformer(client.CoreV1Api(api), NS, "dlsched.io/job-id", RequestBudget(100, 100),
                      on_sync=lambda _: None, on_event=lambda *_: None, on_stale=on_stale)
    try:
        inf.start()
        if mode == "drop":
            await eventually(lambda: len(server.watch_lines) >= 6, within=60)
            assert not stale, stale
            assert server.lists == 1
            assert all("resourceVersion=11" in w for w in server.watch_lines[1:]), server.watch_lines
        else:
            assert await asyncio.to_thread(reported.wait, 60), "watches ending at once were never reported"
            assert "ended at once" in stale[0]
            assert len(server.watch_lines) >= MAX_EMPTY_WATCHES and server.lists >= 1
    finally:
        inf.stop()
        server.close()
        api.close()
