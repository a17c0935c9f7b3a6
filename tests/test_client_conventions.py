"""Client conventions: the gRPC service config shipped with the protos, retries
that never act twice, keepalive and size limits that agree with the servers.

The retry tests run the SDK against a real grpc.aio server on loopback whose
handlers answer UNAVAILABLE a given number of times first (the way a server
going away does), because what is under test is the client's channel policy.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

import grpc
import pytest

from dlsched.client import DlschedRpcError, JobManagerClient
from dlsched.kit import channel
from dlsched.kit.server import Registration, ServerOptions, start_server
from dlsched.v1 import (
    cluster_manager_service_pb2,
    driver_service_pb2,
    job_manager_service_pb2,
    job_pb2,
)
from dlsched.v1 import job_manager_service_pb2_grpc as jm_grpc
from tests import security
from tests.harness import ROOT

SERVICES = {
    "dlsched.v1.JobManagerService": job_manager_service_pb2,
    "dlsched.v1.ClusterManagerService": cluster_manager_service_pb2,
    "dlsched.v1.DriverService": driver_service_pb2,
}


def shipped() -> dict:
    return json.loads((ROOT / "protos" / "dlsched" / "v1" / "service_config.json").read_text())


def test_the_service_config_covers_every_rpc_once_and_retries_only_safe_mutations() -> None:
    cfg = shipped()
    assert json.loads(channel.service_config()) == cfg  # the package ships the same file
    seen: dict[tuple[str, str], dict] = {}
    for mc in cfg["methodConfig"]:
        for n in mc["name"]:
            key = (n["service"], n["method"])
            assert key not in seen, key
            seen[key] = mc
    every = {(s, m.name): m for s, mod in SERVICES.items()
             for m in mod.DESCRIPTOR.services_by_name[s.rsplit(".", 1)[1]].methods}
    assert set(seen) == set(every)
    for key, mc in seen.items():
        m = every[key]
        if m.server_streaming:
            assert "timeout" not in mc, key  # a watch or a follow has no deadline
        else:
            assert mc["timeout"].endswith("s"), key
        policy = mc.get("retryPolicy")
        if policy is not None:
            assert policy["retryableStatusCodes"] == ["UNAVAILABLE"], key
    # Mutations retried by the channel act once: the job and cluster creates
    # deduplicate on request_id; the rest are idempotent by contract.
    for method in ("SubmitJob", "CreateCluster"):
        (key,) = [k for k in seen if k[1] == method]
        assert "retryPolicy" in seen[key]
        assert "request_id" in every[key].input_type.fields_by_name
    for method in ("DeleteJob", "DeleteCluster", "UpdateCluster"):
        (key,) = [k for k in seen if k[1] == method]
        assert "retryPolicy" not in seen[key], key


class Flaky(jm_grpc.JobManagerServiceServicer):
    """Answers UNAVAILABLE ``failures`` times per method, then succeeds."""

    def __init__(self, failures: int) -> None:
        self.failures = failures
        self.calls: dict[str, list[object]] = {}

    async def _maybe_fail(self, method: str, request: object, context: grpc.aio.ServicerContext) -> None:
        calls = self.calls.setdefault(method, [])
        calls.append(request)
        if len(calls) <= self.failures:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "going away")

    async def GetJob(self, request, context):  # noqa: N802
        await self._maybe_fail("GetJob", request, context)
        return job_manager_service_pb2.GetJobResponse(job=job_pb2.Job(name=request.name))

    async def SubmitJob(self, request, context):  # noqa: N802
        await self._maybe_fail("SubmitJob", request, context)
        return job_manager_service_pb2.SubmitJobResponse(job=job_pb2.Job(name="jobs/x"))

    async def DeleteJob(self, request, context):  # noqa: N802
        await self._maybe_fail("DeleteJob", request, context)
        return job_manager_service_pb2.DeleteJobResponse()


@pytest.fixture
async def flaky() -> AsyncIterator[tuple[Flaky, str]]:
    servicer = Flaky(failures=2)
    running = await start_server(ServerOptions(listen="127.0.0.1:0", tls=security.current().service_tls()), [Registration(
        jm_grpc.add_JobManagerServiceServicer_to_server, servicer, "dlsched.v1.JobManagerService")],
        announce_as="flaky")
    try:
        yield servicer, running.address
    finally:
        await running.stop()


async def test_sdk_retries_reads_and_request_id_submits_but_never_deletes(flaky) -> None:
    servicer, address = flaky
    async with JobManagerClient(address) as jm:
        assert (await jm.get_job("jobs/a")).name == "jobs/a"
        assert len(servicer.calls["GetJob"]) == 3  # two UNAVAILABLE, then the answer

        spec = job_pb2.JobSpec(run_mode=job_pb2.RUN_MODE_SINGLE_PROCESS)
        await jm.submit_job(spec)
        submits = servicer.calls["SubmitJob"]
        assert len(submits) == 3
        ids = {r.request_id for r in submits}  # type: ignore[attr-defined]
        assert len(ids) == 1 and ids != {""}  # one request id on every try: the server dedups them

        with pytest.raises(DlschedRpcError) as ei:
            await jm.delete_job("jobs/a")
        assert ei.value.code == "UNAVAILABLE"
        assert len(servicer.calls["DeleteJob"]) == 1  # a delete is never retried


async def test_waiting_for_a_job_gives_up_once_the_server_stays_unreachable() -> None:
    """wait_for_job (what `dlsched submit -f` waits with once the log stream gave up) retried
    UNAVAILABLE forever, silently: it now raises it after ``unavailable_timeout`` in a row."""
    import asyncio
    import socket

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    async with JobManagerClient(f"127.0.0.1:{port}") as jm:
        with pytest.raises(DlschedRpcError) as ei:
            await asyncio.wait_for(jm.wait_for_job("jobs/a", unavailable_timeout=1.0), 120)
    assert ei.value.code == "UNAVAILABLE"


def test_clients_ping_no_faster_than_servers_allow_and_limits_agree() -> None:
    """Client keepalive pings (every 30 s) keep a quiet stream's connection in
    use behind load balancers, and stay above the servers' 10 s minimum, so a
    server never answers them with GOAWAY too_many_pings."""
    opts = dict(channel.options())
    assert opts["grpc.keepalive_time_ms"] >= 10_000
    assert opts["grpc.max_receive_message_length"] == channel.MAX_MESSAGE_BYTES
    assert ServerOptions().max_message_bytes == channel.MAX_MESSAGE_BYTES
