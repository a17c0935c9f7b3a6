"""DriverService clients: one grpc.aio channel per driver address, errors
translated into dlsched errors (``from_rpc_error``); results as domain values.

Requests carrying credentials are built here and handed straight to the stub;
they are never logged.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping

import grpc

from dlsched.errors import DeadlineExceeded, DlschedError, FailedPrecondition, Unavailable
from dlsched.kit import tls as tls_kit
from dlsched.kit.rpc_errors import from_rpc_error
from dlsched.v1 import driver_service_pb2 as pb
from dlsched.v1 import driver_service_pb2_grpc as pb_grpc

from . import convert
from .domain.models import ClusterType, Credentials, Observation

log = logging.getLogger("cluster_manager.drivers")

NOT_CONFIGURED = "CLUSTER_NOT_CONFIGURED"

_CHANNEL_OPTIONS = [
    # A driver that restarts on the same address is reached again within
    # seconds, not after grpc's default two-minute backoff.
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.min_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 2000),
    ("grpc.enable_retries", 0),
]


def is_not_configured(err: DlschedError) -> bool:
    return isinstance(err, FailedPrecondition) and err.reason == NOT_CONFIGURED


def is_unreachable(err: DlschedError) -> bool:
    """The driver itself does not answer in time (as opposed to answering with an error): no
    answer at all, or its own TIMED_OUT (the call's deadline ran out in the driver), as
    JobManager's clients read them."""
    return isinstance(err, Unavailable | DeadlineExceeded) and err.reason in (
        "UNAVAILABLE", "DEADLINE_EXCEEDED", "TIMED_OUT", "UNKNOWN", "CANCELLED")


class DriverClients:
    """Channels to drivers: verified TLS presenting ClusterManager's own
    certificate (drivers require mutual TLS), so credentials reach only a
    driver whose certificate the CA vouches for, under the name dialled."""

    def __init__(self, timeout: float = 5.0, tls: tls_kit.TlsOptions | None = None) -> None:
        self._timeout = timeout
        self._tls = tls or tls_kit.TlsOptions(insecure=True)
        self._watch = tls_kit.FilesWatch(self._tls)
        self._retired: list[grpc.aio.Channel] = []
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._stubs: dict[str, pb_grpc.DriverServiceStub] = {}

    def _stub(self, address: str) -> pb_grpc.DriverServiceStub:
        if self._watch.changed():
            # A renewed certificate: new channels from now on; the old ones
            # close with the client.
            self._retired.extend(self._channels.values())
            self._channels.clear()
            self._stubs.clear()
        stub = self._stubs.get(address)
        if stub is None:
            if self._tls.insecure:
                ch = grpc.aio.insecure_channel(address, options=_CHANNEL_OPTIONS)
            else:
                ch = grpc.aio.secure_channel(
                    address, tls_kit.client_credentials(self._tls, client_cert=True),
                    options=_CHANNEL_OPTIONS)
            self._channels[address] = ch
            stub = self._stubs[address] = pb_grpc.DriverServiceStub(ch)
        return stub

    async def configure(self, driver_address: str, cluster: str, address: str,
                        credentials: Credentials | None,
                        options: Mapping[str, str], cluster_type: ClusterType) -> Observation:
        req = pb.ConfigureClusterRequest(cluster=cluster, address=address, options=dict(options),
                                         cluster_type=f"CLUSTER_TYPE_{cluster_type.value}")
        if credentials is not None:
            req.credentials.CopyFrom(convert.credentials_to_proto(credentials))
        try:
            resp = await self._stub(driver_address).ConfigureCluster(req, timeout=self._timeout)
        except grpc.aio.AioRpcError as e:
            raise from_rpc_error(e) from None
        return convert.observation_from_info(resp.info)

    async def get_info(self, driver_address: str, cluster: str) -> Observation:
        try:
            resp = await self._stub(driver_address).GetClusterInfo(
                pb.GetClusterInfoRequest(cluster=cluster), timeout=self._timeout)
        except grpc.aio.AioRpcError as e:
            raise from_rpc_error(e) from None
        return convert.observation_from_info(resp.info)

    async def remove(self, driver_address: str, cluster: str, *, if_idle: bool = False) -> None:
        try:
            await self._stub(driver_address).RemoveCluster(
                pb.RemoveClusterRequest(cluster=cluster, if_idle=if_idle), timeout=min(self._timeout, 2.0))
        except grpc.aio.AioRpcError as e:
            raise from_rpc_error(e) from None

    async def close(self) -> None:
        chans = [*self._channels.values(), *self._retired]
        self._channels.clear()
        self._retired.clear()
        self._stubs.clear()
        await asyncio.gather(*(c.close() for c in chans), return_exceptions=True)
