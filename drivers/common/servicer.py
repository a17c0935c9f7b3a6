"""``DriverServicer``: the one ``dlsched.v1.DriverService`` for every backend.

Transport only: check the request, convert it (``drivers.common.convert``),
call the ``Driver``, convert back. Errors are ``dlsched.errors`` classes; the
kit's ``ErrorInterceptor`` turns them into ``google.rpc.Status``. Streaming
handlers close the driver's iterator in ``finally``, so a client that cancels
releases its subscription at once.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

import grpc

from dlsched import errors, spec_rules
from dlsched.kit import logs
from dlsched.v1 import driver_service_pb2 as pb
from dlsched.v1 import driver_service_pb2_grpc
from drivers.common import convert
from drivers.common.base import Driver
from drivers.common.logmux import LogMux

#: the backends whose drivers check a cluster's type (``Driver.name``)
_BACKENDS = frozenset(n.lower() for n in spec_rules.CLUSTER_TYPE_NAMES.values())


async def _aclose(it: Any) -> None:
    aclose = getattr(it, "aclose", None)
    if aclose is not None:
        await aclose()


class DriverServicer(driver_service_pb2_grpc.DriverServiceServicer):
    """Exposes any ``Driver`` as ``dlsched.v1.DriverService``."""

    FULL_NAME = "dlsched.v1.DriverService"

    def __init__(self, driver: Driver) -> None:
        self._driver = driver

    async def ConfigureCluster(self, request: pb.ConfigureClusterRequest,
                               context: grpc.aio.ServicerContext) -> pb.ConfigureClusterResponse:
        self._check_type(request)
        info = await self._driver.configure_cluster(convert.cluster_config(request))
        return pb.ConfigureClusterResponse(info=convert.cluster_info_pb(info))

    def _check_type(self, request: pb.ConfigureClusterRequest) -> None:
        """A cluster of another backend type is refused before anything of it is kept (a Slurm
        cluster registered with a local driver's address ran its jobs as local processes)."""
        ours = self._driver.name
        theirs = spec_rules.CLUSTER_TYPE_NAMES.get(request.cluster_type, "").lower()
        if theirs and ours in _BACKENDS and theirs != ours:
            raise errors.FailedPrecondition(
                f"this driver serves {ours} clusters; {request.cluster[:300]} is a {theirs} cluster: "
                f"register it with a {theirs} driver's address", reason="CLUSTER_TYPE_MISMATCH",
                metadata={"driver": ours, "cluster_type": theirs.upper()})

    async def RemoveCluster(self, request: pb.RemoveClusterRequest,
                            context: grpc.aio.ServicerContext) -> pb.RemoveClusterResponse:
        await self._driver.remove_cluster(convert.cluster_name(request.cluster), if_idle=request.if_idle)
        return pb.RemoveClusterResponse()

    async def GetClusterInfo(self, request: pb.GetClusterInfoRequest,
                             context: grpc.aio.ServicerContext) -> pb.GetClusterInfoResponse:
        info = await self._driver.cluster_info(convert.cluster_name(request.cluster))
        return pb.GetClusterInfoResponse(info=convert.cluster_info_pb(info))

    async def RenderJob(self, request: pb.RenderJobRequest,
                        context: grpc.aio.ServicerContext) -> pb.RenderJobResponse:
        cluster = convert.cluster_name(request.cluster)
        job_id = convert.job_id(request.job_id)
        spec = convert.job_spec(request.spec, request.HasField("spec"))
        native = await self._driver.render(cluster, job_id, spec)
        return pb.RenderJobResponse(native_spec=convert.native_spec_pb(native))

    async def LaunchJob(self, request: pb.LaunchJobRequest,
                        context: grpc.aio.ServicerContext) -> pb.LaunchJobResponse:
        cluster = convert.cluster_name(request.cluster)
        job_id = convert.job_id(request.job_id)
        logs.JOB_ID.set(job_id)  # this handler's task: its records name the job
        attempt = convert.attempt(request.attempt)
        uid = convert.job_uid(request.job_uid)
        spec = convert.job_spec(request.spec, request.HasField("spec"))
        res = await self._driver.launch(cluster, job_id, spec, attempt, uid)
        return convert.launch_response_pb(res)

    async def BatchGetJobObservations(
        self, request: pb.BatchGetJobObservationsRequest, context: grpc.aio.ServicerContext,
    ) -> pb.BatchGetJobObservationsResponse:
        cluster = convert.cluster_name(request.cluster)
        refs = convert.job_refs(list(request.jobs))
        obs = await self._driver.observe(cluster, refs)
        return pb.BatchGetJobObservationsResponse(
            observations=[convert.observation_pb(o) for o in obs])

    async def WatchJobObservations(
        self, request: pb.WatchJobObservationsRequest, context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[pb.WatchJobObservationsResponse]:
        cluster = convert.cluster_name(request.cluster)
        it = self._driver.watch(cluster)
        try:
            async for ev in it:
                yield convert.watch_event_pb(ev)
        finally:
            await _aclose(it)

    async def TerminateJob(self, request: pb.TerminateJobRequest,
                           context: grpc.aio.ServicerContext) -> pb.TerminateJobResponse:
        cluster = convert.cluster_name(request.cluster)
        ref = convert.job_ref(request.job)
        logs.JOB_ID.set(ref.job_id)
        grace = convert.grace_seconds(request.grace_period, request.HasField("grace_period"))
        obs = await self._driver.terminate(cluster, ref, grace)
        return pb.TerminateJobResponse(observation=convert.observation_pb(obs))

    async def CleanupJob(self, request: pb.CleanupJobRequest,
                         context: grpc.aio.ServicerContext) -> pb.CleanupJobResponse:
        cluster = convert.cluster_name(request.cluster)
        await self._driver.cleanup(cluster, convert.job_ref(request.job))
        return pb.CleanupJobResponse()

    async def ForgetJobs(self, request: pb.ForgetJobsRequest,
                         context: grpc.aio.ServicerContext) -> pb.ForgetJobsResponse:
        cluster = convert.cluster_name(request.cluster)
        n = await self._driver.forget(cluster, convert.job_refs(list(request.jobs)))
        return pb.ForgetJobsResponse(forgotten=n)

    async def TailJobLogs(self, request: pb.TailJobLogsRequest,
                          context: grpc.aio.ServicerContext) -> AsyncIterator[pb.TailJobLogsResponse]:
        async for batch in self._tail(request):
            yield batch

    async def MultiplexJobLogs(self, request_iterator: AsyncIterator[Any],
                               context: grpc.aio.ServicerContext) -> AsyncIterator[pb.MultiplexJobLogsResponse]:
        async with contextlib.aclosing(LogMux(self._tail).run(request_iterator)) as responses:
            async for resp in responses:
                yield resp

    async def _tail(self, request: pb.TailJobLogsRequest) -> AsyncIterator[pb.TailJobLogsResponse]:
        """What one TailJobLogs call (or one tail of a MultiplexJobLogs) sends."""
        cluster = convert.cluster_name(request.cluster)
        ref = convert.job_ref(request.job)
        query = convert.log_query(request)
        it = self._driver.tail_logs(cluster, ref, query)
        try:
            async for batch in it:
                for message in convert.log_batches_pb(batch):  # none for an empty batch
                    yield message
        finally:
            await _aclose(it)

    async def MeasureJobUsage(self, request: pb.MeasureJobUsageRequest,
                              context: grpc.aio.ServicerContext) -> pb.MeasureJobUsageResponse:
        cluster = convert.cluster_name(request.cluster)
        usage = await self._driver.usage(cluster, convert.job_ref(request.job))
        return pb.MeasureJobUsageResponse(usage=convert.usage_pb(usage))
