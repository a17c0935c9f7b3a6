"""The Kubernetes API adapter: one cluster's client, every call as plain JSON off the loop, one error map.

``KubeApi`` holds a cluster's ``ApiClient`` (a bearer token with an
optional CA bundle, or a kubeconfig's current context; credentials stay in
memory, never logged), its ``CoreV1Api`` and its ``RequestBudget``
(``--qps`` / ``--burst``). ``call`` takes a token on the event loop, then runs one request in a
worker thread (``asyncio.to_thread``), and returns the response body
as plain JSON: never through the client's model classes, so a response
they cannot deserialize (a pod status missing a field they require) does
not turn a delete that worked into an error.

``api_error`` is the ONE mapping from an API failure to dlsched's errors:
unreachable or 5xx/429 → UNAVAILABLE ``BACKEND_UNAVAILABLE`` (JobManager
retries); 401/403 → FAILED_PRECONDITION ``BACKEND_PERMISSION_DENIED``;
400/422 → INVALID_ARGUMENT; anything else → FAILED_PRECONDITION
``BACKEND_ERROR``. ``delete`` treats 404 as success (idempotent clean-up).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import ssl
import tempfile
from collections.abc import Callable
from typing import Any

from dlsched.errors import DlschedError, FailedPrecondition, InvalidArgument, ResourceExhausted
from dlsched.kit import metrics
from drivers.common.base import ClusterConfig, KubernetesCredentials
from drivers.common.registry import BackendUnavailable
from drivers.kubernetes.informer import RequestBudget
from drivers.kubernetes.podlog import PodLogClient


def is_unreachable(exc: BaseException) -> bool:
    """Connection problems and 5xx (and 429): the API server is not answering."""
    status = getattr(exc, "status", None)
    if isinstance(status, int) and status > 0:
        return status >= 500 or status == 429
    return True


def status_of(exc: BaseException) -> int | None:
    """The HTTP status of an API failure; ``None`` when there was no answer."""
    s = getattr(exc, "status", None)
    return s if isinstance(s, int) else None


def status_text(exc: BaseException) -> str:
    status = status_of(exc)
    return f"HTTP {status}" if status else type(exc).__name__


def _message(exc: BaseException) -> str:
    body = getattr(exc, "body", None)
    if body:
        with contextlib.suppress(ValueError, TypeError, RecursionError):
            doc = json.loads(body)
            if isinstance(doc, dict):  # a Status; a proxy's body may be any JSON
                return str(doc.get("message", ""))[:500]
    return ""


def api_error(exc: BaseException, what: str) -> DlschedError:
    """The dlsched error for a failed API request (``what``: "creating pod x")."""
    status = status_of(exc)
    if is_unreachable(exc):
        return BackendUnavailable(f"Kubernetes API server: {what} failed ({status_text(exc)})")
    message = _message(exc) if status == 403 else ""
    if status == 403 and "exceeded quota" in message:
        # A ResourceQuota of the namespace: it frees up as other pods end (a launch retried later).
        return ResourceExhausted(f"Kubernetes API server refused {what}: {message}", reason="BACKEND_QUOTA_EXCEEDED")
    if status == 403 and "forbidden: " in message and ("maximum" in message or "minimum" in message):
        # A LimitRange: the request itself is out of the namespace's bounds.
        return FailedPrecondition(f"Kubernetes API server refused {what}: {message}", reason="BACKEND_REJECTED")
    if status in (401, 403):
        return FailedPrecondition(f"Kubernetes API server refused {what} (HTTP {status}); check the "
                                  "cluster's credentials and RBAC", reason="BACKEND_PERMISSION_DENIED")
    if status in (400, 422):
        return InvalidArgument(f"Kubernetes API server rejected {what} (HTTP {status}): {_message(exc)}")
    return FailedPrecondition(f"Kubernetes API server: {what} failed (HTTP {status}): {_message(exc)}",
                              reason="BACKEND_ERROR")


def raise_for_status(resp: Any) -> None:
    """An ``ApiException`` for a non-2xx raw response (``_preload_content=False``)."""
    if not 200 <= resp.status <= 299:
        from kubernetes.client.exceptions import ApiException

        raise ApiException(http_resp=resp)


#: kubeconfig user fields that read the driver host's files; a cluster's ``certificate-authority``
#: likewise. The ``-data`` forms carry the same material inline.
_HOST_FILE_FIELDS = ("tokenFile", "client-certificate", "client-key")


def _refuse_host_access(doc: Any, allow_exec: bool) -> None:
    """A kubeconfig is credentials an admin sends, not a say over the driver's host: file paths
    (the host's files read as certificates or tokens) are refused, and so are ``exec`` and
    ``auth-provider`` plugins (a command run on the host) unless the driver was started with
    ``--allow-kubeconfig-exec`` (EKS, GKE and the like need them)."""
    field = "credentials.kubernetes.kubeconfig"
    if not isinstance(doc, dict):
        raise InvalidArgument.for_field(field, "not a kubeconfig document")
    for entry in doc.get("users") or ():
        user = (entry or {}).get("user") or {} if isinstance(entry, dict) else {}
        if not isinstance(user, dict):
            continue
        if used := [k for k in _HOST_FILE_FIELDS if user.get(k)]:
            raise InvalidArgument.for_field(field, f"user fields {', '.join(used)} name files on the "
                                            "driver's host: give client-certificate-data / client-key-data / token")
        if not allow_exec and (user.get("exec") or user.get("auth-provider")):
            raise InvalidArgument.for_field(field, "exec and auth-provider plugins run commands on the "
                                            "driver's host: start the driver with --allow-kubeconfig-exec to allow them")
    for entry in doc.get("clusters") or ():
        cluster = (entry or {}).get("cluster") or {} if isinstance(entry, dict) else {}
        if isinstance(cluster, dict) and cluster.get("certificate-authority"):
            raise InvalidArgument.for_field(field, "cluster field certificate-authority names a file on "
                                            "the driver's host: give certificate-authority-data")


def _client(config: ClusterConfig, allow_exec: bool = False) -> tuple[Any, str | None]:
    """(ApiClient, CA file to remove on close) from the cluster's address, options and credentials."""
    from kubernetes import client
    from kubernetes import config as kconfig

    cfg = client.Configuration()
    cfg.debug = False
    ca_file: str | None = None
    creds = config.credentials
    if isinstance(creds, KubernetesCredentials) and creds.kubeconfig:
        import yaml

        try:
            doc = yaml.safe_load(creds.kubeconfig)
        except Exception as e:  # noqa: BLE001 - never echo the kubeconfig
            raise InvalidArgument.for_field("credentials.kubernetes.kubeconfig",
                                            f"cannot be loaded ({type(e).__name__})") from None
        _refuse_host_access(doc, allow_exec)
        try:
            kconfig.load_kube_config_from_dict(doc, client_configuration=cfg,  # type: ignore[no-untyped-call]
                                               persist_config=False)
        except Exception as e:  # noqa: BLE001 - never echo the kubeconfig
            raise InvalidArgument.for_field("credentials.kubernetes.kubeconfig",
                                            f"cannot be loaded ({type(e).__name__})") from None
        if config.address:
            cfg.host = config.address.rstrip("/")
    else:
        if not config.address:
            raise InvalidArgument.for_field("address", "the API server URL is required")
        cfg.host = config.address.rstrip("/")
        if isinstance(creds, KubernetesCredentials):
            if creds.token:
                cfg.api_key = {"authorization": creds.token}  # the key name every client version reads
                cfg.api_key_prefix = {"authorization": "Bearer"}
            if creds.ca_cert:
                fd, ca_file = tempfile.mkstemp(prefix="dlsched-k8s-ca-", suffix=".pem")
                with os.fdopen(fd, "w") as f:
                    f.write(creds.ca_cert)
                cfg.ssl_ca_cert = ca_file
        elif creds is not None:
            raise InvalidArgument.for_field("credentials", "the Kubernetes driver takes kubernetes credentials")
    if config.options.get("insecure_skip_tls_verify", "").lower() == "true":
        cfg.verify_ssl = False
    return client.ApiClient(cfg), ca_file


class KubeApi:
    """One cluster's API client, request budget and request timeout."""

    def __init__(self, config: ClusterConfig, *, qps: float, burst: int, request_timeout: float,
                 allow_exec: bool = False) -> None:
        from kubernetes import client

        self.client, self._ca_file = _client(config, allow_exec)
        try:  # the CA bundle and client certificate are read here, once
            self.logs = PodLogClient(self.client.configuration, request_timeout)  # on the loop, no thread
        except (ssl.SSLError, OSError, ValueError) as e:
            self._release()
            field = ("credentials.kubernetes.kubeconfig" if isinstance(config.credentials, KubernetesCredentials)
                     and config.credentials.kubeconfig else "credentials.kubernetes.ca_cert")
            raise InvalidArgument.for_field(
                field, f"its CA bundle or client certificate cannot be loaded ({type(e).__name__})") from None
        self.core: Any = client.CoreV1Api(self.client)  # responses read as plain JSON, not its models
        self.budget = RequestBudget(qps, burst)
        self.timeout = request_timeout

    def _release(self) -> None:
        with contextlib.suppress(Exception):
            self.client.close()
        if self._ca_file:
            with contextlib.suppress(OSError):
                os.unlink(self._ca_file)

    async def close(self) -> None:
        with contextlib.suppress(Exception):
            await self.logs.close()
        self._release()

    async def call(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """One request in a worker thread; the response body as plain JSON (raises ``ApiException``)."""

        def run() -> Any:
            kwargs.setdefault("_request_timeout", self.timeout)
            ok = False
            try:
                resp = fn(*args, _preload_content=False, **kwargs)
                try:
                    raise_for_status(resp)
                    out = json.loads(resp.data)
                    ok = True
                    return out
                finally:
                    resp.release_conn()
            finally:
                metrics.backend_call("kubernetes", getattr(fn, "__name__", "call"), ok)

        # The token is waited for on the loop: a cluster held to its QPS must not hold the
        # default thread pool's threads, which every cluster's calls share.
        await self.budget.acquire_async()
        return await asyncio.to_thread(run)

    async def create(self, fn: Callable[..., Any], namespace: str, body: Any, what: str) -> Any | None:
        """Create an object; ``None`` when it exists already (409); other failures as ``api_error``."""
        try:
            return await self.call(fn, namespace, body)
        except Exception as e:  # noqa: BLE001
            if status_of(e) != 409:
                raise api_error(e, f"creating {what}") from None
            return None

    async def delete(self, fn: Callable[..., Any], name: str, namespace: str, what: str, **kwargs: Any) -> None:
        """Delete an object; one that is gone (404) is fine, other failures as ``api_error``."""
        try:
            await self.call(fn, name, namespace, **kwargs)
        except Exception as e:  # noqa: BLE001
            if status_of(e) != 404:
                raise api_error(e, f"deleting {what}") from None

    async def pod_metrics(self, namespace: str, selector: str) -> Any:
        """``metrics.k8s.io/v1beta1`` PodMetricsList of the pods matching ``selector`` (raises as ``call``)."""
        from kubernetes import client

        custom = client.CustomObjectsApi(self.client)
        return await self.call(custom.list_namespaced_custom_object, "metrics.k8s.io", "v1beta1",
                               namespace, "pods", label_selector=selector)
