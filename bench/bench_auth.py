"""What TLS + authentication cost: the local stack with security ON next to OFF.

    .venv/bin/python bench/bench_auth.py [--duration 4] [--rounds 4] [--concurrency 16]
                                         [--submits 20] [--breakdown] [--py-spy DIR]

Starts one etcd and two local stacks as real processes (tests.harness: etcd,
ClusterManager, the local driver, JobManager), each with cluster ``local``:

- OFF: ``--insecure`` on every service and ``--no-auth`` on JobManager and
  ClusterManager (drivers under ``--insecure`` do no auth);
- ON: TLS from ``dlsched.kit.pki`` (a CA and one control-plane certificate;
  drivers require it as a client certificate), a static admin token, the
  control plane's token, and an OIDC issuer: a small HTTP server in this
  process serving discovery + JWKS (the number of fetches is reported; it must
  not grow with the calls).

Client modes (raw stubs on ``dlsched.kit.tls.channel``; ON modes carry their
token through the channel's bearer interceptors):

- ``off``        plaintext, no token;
- ``api-token``  an API token made through AccessService for ``sa:bench``
                 (member of project ``default``): the target mode;
- ``admin``      the static admin token;
- ``oidc``       an RS256 JWT for ``user:bench`` (member via a role binding).

With ``--breakdown`` three more, to split the cost: ``tls-only`` (a third
stack with TLS but ``--no-auth``), ``api-md`` (the API token as per-call
metadata on a channel without interceptors) and ``api-creds`` (the API token
as gRPC call credentials, ``access_token_call_credentials``: added in C core).

Measured per mode: GetJob QPS (``--concurrency`` calls in flight for
``--duration`` s) with p50/p99, and sequential SubmitJob latency p50/p99
(``--submits`` tiny jobs per round). Fairness on a loaded machine: a warm-up
phase for every mode, then ``--rounds`` rounds in which every mode runs once,
the order rotating each round; ratios are computed per round (against that
round's OFF phase) and over all rounds. Target: GetJob QPS api-token/off >= 0.85.

``--py-spy DIR`` records the ON (and OFF) JobManager and this client process
with py-spy during the measured rounds (collapsed stacks in DIR) and prints
the heaviest frames of each.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import os
import pathlib
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import grpc  # noqa: E402

from bench.stats import ms, pct  # noqa: E402
from dlsched.auth.tokens import random_token, write_token_file  # noqa: E402
from dlsched.client import AccessClient, ClusterManagerClient, is_terminal  # noqa: E402
from dlsched.kit import envelope, pki  # noqa: E402
from dlsched.kit import tls as tls_kit  # noqa: E402
from dlsched.kit.channel import TokenSource  # noqa: E402
from dlsched.kit.channel import options as channel_options  # noqa: E402
from dlsched.v1 import cluster_pb2, job_pb2  # noqa: E402
from dlsched.v1 import job_manager_service_pb2 as jms  # noqa: E402
from dlsched.v1 import job_manager_service_pb2_grpc as jms_grpc  # noqa: E402
from tests.harness import EtcdServer, Stack  # noqa: E402
from tests.oidc_issuer import OidcIssuer  # noqa: E402

TARGET = 0.85
AUDIENCE = "dlsched-bench"


def spec(label: str) -> job_pb2.JobSpec:
    return job_pb2.JobSpec(
        run_mode=job_pb2.RUN_MODE_SINGLE_PROCESS,
        replica_groups=[job_pb2.ReplicaGroup(role="main", replicas=1, command=["true"])],
        cluster_selector=job_pb2.ClusterSelector(cluster="local"),
        labels={"bench": label},
    )


# --------------------------------------------------------------------------- OIDC issuer


class Issuer(OidcIssuer):
    """The tests' OIDC issuer (tests/oidc_issuer.py) with the bench's audience."""

    def __init__(self) -> None:
        super().__init__()
        self.start()

    def token(self, sub: str, aud: str = AUDIENCE, exp_in: float = 3600, **kw: Any) -> str:  # type: ignore[override]
        return super().token(sub, aud, exp_in, **kw)

    def counts(self) -> dict[str, int]:
        return {w: self.fetches(w) for w in ("discovery", "jwks") if self.fetches(w)}

    def close(self) -> None:
        self.stop()


# --------------------------------------------------------------------------- stacks


@dataclass
class Security:
    dir: str
    ca: pki.Issued
    service: pki.Issued
    admin_token_file: str
    cp_token_file: str
    key_file: str

    @classmethod
    def make(cls) -> Security:
        d = tempfile.mkdtemp(prefix="dlsched-bench-auth-")
        ca = pki.make_ca(os.path.join(d, "ca"))
        service = pki.issue(ca, d, "job-manager", dns=("cluster-manager", "localhost"))
        admin = os.path.join(d, "admin.token")
        write_token_file(admin, random_token())
        cp = os.path.join(d, "control-plane.token")
        write_token_file(cp, random_token())
        key = os.path.join(d, "encryption.key")
        envelope.generate_key_file(key)
        return cls(d, ca, service, admin, cp, key)

    @property
    def admin_token(self) -> str:
        with open(self.admin_token_file) as f:
            return f.read().strip()

    def tls_args(self) -> list[str]:
        return ["--tls-cert-file", self.service.cert_file, "--tls-key-file", self.service.key_file,
                "--tls-ca-file", self.ca.cert_file]

    def user_tls(self) -> tls_kit.TlsOptions:
        return tls_kit.TlsOptions(ca_file=self.ca.cert_file)


def make_stack(etcd: EtcdServer, sec: Security, kind: str, issuer: Issuer | None) -> Stack:
    """kind: ``off`` (plaintext, no auth), ``on`` (TLS + auth), ``tls`` (TLS, --no-auth)."""
    prefix = f"/dlsched-bench-auth-{kind}-{uuid.uuid4().hex[:6]}/"
    key = ["--encryption-key-file", sec.key_file]
    if kind == "off":
        off = ["--insecure", "--no-auth"]
        return Stack(etcd, prefix, jm_args=off, cm_args=[*off, *key], driver_args=["--insecure"])
    tls = sec.tls_args()
    if kind == "tls":
        # JM -> CM still carries the control-plane token; --no-auth takes anyone.
        common = [*tls, "--no-auth", "--control-plane-token-file", sec.cp_token_file]
        return Stack(etcd, prefix, jm_args=common, cm_args=[*common, *key], driver_args=tls)
    common = [*tls, "--admin-token-file", sec.admin_token_file,
              "--control-plane-token-file", sec.cp_token_file]
    oidc = []
    if issuer is not None:
        oidc = ["--oidc-issuer", issuer.url, "--oidc-audience", AUDIENCE]
    return Stack(etcd, prefix, jm_args=[*common, *oidc], cm_args=[*common, *key], driver_args=tls)


def admin_channel(stack_kind: str, sec: Security, address: str) -> grpc.aio.Channel:
    if stack_kind == "off":
        return tls_kit.channel(address, tls_kit.TlsOptions(insecure=True))
    return tls_kit.channel(address, sec.user_tls(), token=TokenSource(token=sec.admin_token))


async def register_local(stack: Stack, kind: str, sec: Security) -> None:
    ch = admin_channel(kind, sec, stack.cm.address)
    async with ClusterManagerClient(stack.cm.address, channel=ch) as cm:
        await cm.create_cluster("local", cluster_pb2.Cluster(
            type=job_pb2.CLUSTER_TYPE_LOCAL, driver_address=stack.driver.address),
            request_id="register-local")
        await cm.wait_cluster_state("local", timeout=30)
    await ch.close()


# --------------------------------------------------------------------------- modes


@dataclass
class Mode:
    name: str
    stack: str  # off | on | tls
    channel: grpc.aio.Channel
    metadata: tuple[tuple[str, str], ...] | None = None
    stub: Any = None
    job: str = ""  # the job GetJob reads
    qps: list[float] = field(default_factory=list)  # per round
    get_lat: list[float] = field(default_factory=list)
    get_errors: int = 0
    calls: int = 0
    seconds: float = 0.0
    submit_lat: list[float] = field(default_factory=list)
    submitted: list[str] = field(default_factory=list)
    pids: dict[str, int] = field(default_factory=dict)  # process -> pid (0: this one)
    cpu: collections.Counter[str] = field(default_factory=collections.Counter)  # in GetJob phases

    def __post_init__(self) -> None:
        self.stub = jms_grpc.JobManagerServiceStub(self.channel)  # type: ignore[no-untyped-call]


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process (0: this one), seconds."""
    if pid == 0:
        t = os.times()
        return t.user + t.system
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def getjob_phase(m: Mode, concurrency: int, seconds: float, record: bool) -> float:
    req = jms.GetJobRequest(name=m.job)
    lat: list[float] = []
    errors = 0
    end = time.perf_counter() + seconds

    async def worker() -> None:
        nonlocal errors
        while time.perf_counter() < end:
            s = time.perf_counter()
            try:
                await m.stub.GetJob(req, timeout=10, metadata=m.metadata)
            except grpc.RpcError:
                errors += 1
                continue
            lat.append(time.perf_counter() - s)

    c0 = {k: cpu_seconds(pid) for k, pid in m.pids.items()}
    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    elapsed = time.perf_counter() - t0
    qps = len(lat) / elapsed
    if record:
        for k, pid in m.pids.items():
            m.cpu[k] += cpu_seconds(pid) - c0[k]
        m.qps.append(qps)
        m.get_lat.extend(lat)
        m.get_errors += errors
        m.calls += len(lat)
        m.seconds += elapsed
    elif errors:
        print(f"warning: {m.name}: {errors} GetJob errors in warm-up", file=sys.stderr)
    return qps


async def submit_phase(m: Mode, n: int, record: bool) -> None:
    tiny = spec("auth")
    for _ in range(n):
        req = jms.SubmitJobRequest(spec=tiny, request_id=uuid.uuid4().hex)
        s = time.perf_counter()
        resp = await m.stub.SubmitJob(req, timeout=30, metadata=m.metadata)
        d = time.perf_counter() - s
        m.submitted.append(resp.job.name)
        if record:
            m.submit_lat.append(d)


async def settle(modes: list[Mode], deadline_s: float = 30) -> int:
    """Waits until the jobs submitted so far have ended (so their launches do
    not load the next phase); the number still running at the deadline."""
    end = time.monotonic() + deadline_s
    pending = [(m, name) for m in modes for name in m.submitted]
    while pending and time.monotonic() < end:
        still = []
        for m, name in pending:
            job = (await m.stub.GetJob(jms.GetJobRequest(name=name), timeout=10,
                                       metadata=m.metadata)).job
            if not is_terminal(job.state):
                still.append((m, name))
        pending = still
        if pending:
            await asyncio.sleep(0.2)
    for m in modes:
        m.submitted.clear()
    return len(pending)


# --------------------------------------------------------------------------- micro


async def micro(issuer: Issuer | None, n: int) -> list[tuple[str, float]]:
    """Per-call cost of the server-side auth path in this process (no gRPC):
    ``Authenticator.authenticate`` per token kind, the whole ``AuthInterceptor``
    wrapper around a no-op handler, and the client's bearer-metadata step."""
    from datetime import UTC, datetime

    from dlsched.auth.authn import Authenticator, AuthOptions
    from dlsched.auth.interceptor import AuthInterceptor
    from dlsched.auth.model import ApiToken, Role, RoleBinding
    from dlsched.auth.oidc import OidcOptions
    from dlsched.auth.store import AccessStore
    from dlsched.auth.tokens import new_api_token
    from dlsched.kit.channel import bearer_interceptors

    d = tempfile.mkdtemp(prefix="dlsched-bench-auth-micro-")
    try:
        admin_file = os.path.join(d, "admin.token")
        admin = random_token()
        write_token_file(admin_file, admin)
        cp_file = os.path.join(d, "cp.token")
        write_token_file(cp_file, random_token())
        store = AccessStore(None, "/micro/")  # type: ignore[arg-type] - the view only
        tid, secret, digest = new_api_token()
        store.tokens[tid] = ApiToken(tid, "bench", digest, create_time=datetime.now(UTC))
        for who in ("sa:bench", "user:bench"):
            b = RoleBinding(uuid.uuid4().hex[:16], who, "default", Role.MEMBER, datetime.now(UTC), "admin")
            store.bindings[b.id] = b
            store.by_principal[who].append(b)
        oidc = (OidcOptions(issuer=issuer.url, audience=AUDIENCE) if issuer is not None else None)
        auth = Authenticator.from_options(AuthOptions(admin_file, cp_file, oidc), store)
        off = Authenticator.from_options(AuthOptions(disabled=True), None)
        kinds = [("api-token", auth, f"Bearer {secret}"), ("admin", auth, f"Bearer {admin}")]
        if issuer is not None:
            kinds.append(("oidc", auth, f"Bearer {issuer.token('bench')}"))
        kinds.append(("no-auth", off, None))
        out: list[tuple[str, float]] = []
        for name, a, value in kinds:
            await a.authenticate(value)  # warm: the OIDC key fetch and token cache
            t0 = time.perf_counter()
            for _ in range(n):
                await a.authenticate(value)
            out.append((f"authenticate {name}", (time.perf_counter() - t0) / n))

        class Ctx:
            def __init__(self, md: tuple[tuple[str, str], ...]) -> None:
                self.md = md

            def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
                return self.md

            def auth_context(self) -> dict[str, list[bytes]]:
                return {"transport_security_type": [b"ssl"]}

        async def noop(request: Any, context: Any) -> None:
            return None

        details = collections.namedtuple("details", "method invocation_metadata")
        base = grpc.unary_unary_rpc_method_handler(noop)

        async def cont(_: Any) -> Any:
            return base

        for name, a, value in (kinds[0], kinds[-1]):
            md = (("user-agent", "grpc-python/x"),) + ((("authorization", value),) if value else ())
            ctx = Ctx(md)
            icpt = AuthInterceptor(a.authenticate)
            t0 = time.perf_counter()
            for _ in range(n):
                h = await icpt.intercept_service(cont, details("/dlsched.v1.JobManagerService/GetJob", md))
                await h.unary_unary(None, ctx)
            out.append((f"AuthInterceptor + no-op handler, {name}", (time.perf_counter() - t0) / n))

        bi = bearer_interceptors(TokenSource(token=secret))[0]
        call = grpc.aio.ClientCallDetails("/dlsched.v1.JobManagerService/GetJob", 10.0, None, None, None)
        t0 = time.perf_counter()
        for _ in range(n):
            bi._details(call)
        out.append(("client _Bearer._details (metadata copy)", (time.perf_counter() - t0) / n))
        return out
    finally:
        shutil.rmtree(d, ignore_errors=True)


# --------------------------------------------------------------------------- py-spy


class Spy:
    """py-spy record of a few processes into collapsed-stack files."""

    def __init__(self, out_dir: str) -> None:
        self.dir = out_dir
        os.makedirs(out_dir, exist_ok=True)
        self.exe = shutil.which("py-spy") or str(pathlib.Path(sys.executable).parent / "py-spy")
        self.procs: list[tuple[str, subprocess.Popen[bytes]]] = []

    def start(self, name: str, pid: int) -> None:
        path = os.path.join(self.dir, f"{name}.txt")
        log = open(os.path.join(self.dir, f"{name}.log"), "wb")  # noqa: SIM115 - held by py-spy
        p = subprocess.Popen([self.exe, "record", "--pid", str(pid), "--format", "raw",
                              "--rate", "200", "--output", path, "--nonblocking"],
                             stdout=log, stderr=subprocess.STDOUT)
        self.procs.append((path, p))

    def stop(self) -> None:
        for _, p in self.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGINT)
        for _, p in self.procs:
            try:
                p.wait(20)
            except subprocess.TimeoutExpired:
                p.kill()

    def report(self, top: int = 25) -> None:
        for path, _ in self.procs:
            summarize(path, top)


def summarize(path: str, top: int) -> None:
    """Self and inclusive sample shares of the heaviest frames of a collapsed-stack file."""
    try:
        lines = open(path).read().splitlines()
    except OSError as e:
        print(f"\n{path}: no profile ({e})")
        return
    total = 0
    incl: collections.Counter[str] = collections.Counter()
    self_: collections.Counter[str] = collections.Counter()
    for line in lines:
        stack, _, n = line.rpartition(" ")
        if not stack or not n.isdigit():
            continue
        k = int(n)
        total += k
        frames = [_short(f) for f in stack.split(";")]
        self_[frames[-1]] += k
        for f in set(frames):
            incl[f] += k
    print(f"\n{os.path.basename(path)}: {total} samples (non-idle)")
    if not total:
        return
    print(f"  {'self%':>6}  {'incl%':>6}  frame")
    for f, k in incl.most_common(top):
        print(f"  {100 * self_[f] / total:6.1f}  {100 * k / total:6.1f}  {f}")
    print("  -- heaviest self:")
    for f, k in self_.most_common(12):
        print(f"  {100 * k / total:6.1f}  {100 * incl[f] / total:6.1f}  {f}")


def _short(frame: str) -> str:
    # "func (path/to/file.py:123)" -> "func (file.py)" with the package dir kept
    name, _, loc = frame.partition(" (")
    loc = loc.rstrip(")")
    file = loc.rsplit(":", 1)[0]
    parts = file.split("/")
    return f"{name} ({'/'.join(parts[-2:])})" if parts else name


# --------------------------------------------------------------------------- run


async def run(args: argparse.Namespace) -> int:
    # Services and clients get only what this benchmark passes them.
    for k in [k for k in os.environ if k.startswith("DLSCHED_")]:
        del os.environ[k]
    sec = Security.make()
    os.environ["DLSCHED_CONFIG"] = os.path.join(sec.dir, "no-config.yaml")
    issuer = Issuer() if "oidc" in args.modes else None
    etcd = EtcdServer().start()
    kinds = ["off", "on"] + (["tls"] if "tls-only" in args.modes else [])
    stacks = {k: make_stack(etcd, sec, k, issuer) for k in kinds}
    channels: list[grpc.aio.Channel] = []
    spy: Spy | None = None
    try:
        for kind, st in stacks.items():
            st.start()
            await register_local(st, kind, sec)
        jm = {k: st.jm.address for k, st in stacks.items() if st.jm is not None}
        print(f"stacks up: {jm}, etcd={etcd.endpoint}", file=sys.stderr)

        # Principals of the ON stack: sa:bench (API token) and user:bench (OIDC),
        # both members of project "default"; the admin token is static.
        adm = admin_channel("on", sec, jm["on"])
        channels.append(adm)
        access = AccessClient(jm["on"], channel=adm)
        await access.create_role_binding("sa:bench", "default", "member")
        _, api_secret = await access.create_api_token("bench", description="bench_auth")
        if issuer is not None:
            await access.create_role_binding("user:bench", "default", "member")

        def ch(kind: str, token: str | None) -> grpc.aio.Channel:
            c = (tls_kit.channel(jm[kind], tls_kit.TlsOptions(insecure=True)) if kind == "off"
                 else tls_kit.channel(jm[kind], sec.user_tls(),
                                      token=TokenSource(token=token) if token else None))
            channels.append(c)
            return c

        modes: list[Mode] = []
        for name in args.modes:
            if name == "off":
                modes.append(Mode(name, "off", ch("off", None)))
            elif name == "api-token":
                modes.append(Mode(name, "on", ch("on", api_secret)))
            elif name == "admin":
                modes.append(Mode(name, "on", ch("on", sec.admin_token)))
            elif name == "oidc":
                assert issuer is not None
                modes.append(Mode(name, "on", ch("on", issuer.token("bench"))))
            elif name == "api-md":
                modes.append(Mode(name, "on", ch("on", None),
                                  metadata=(("authorization", f"Bearer {api_secret}"),)))
            elif name == "api-creds":
                # The token as C-core call credentials: no Python per call on the client.
                creds = grpc.composite_channel_credentials(
                    tls_kit.client_credentials(sec.user_tls(), client_cert=False),
                    grpc.access_token_call_credentials(api_secret))
                c = grpc.aio.secure_channel(jm["on"], creds, options=[
                    *channel_options(), *tls_kit.name_options(jm["on"])])
                channels.append(c)
                modes.append(Mode(name, "on", c))
            elif name == "tls-only":
                modes.append(Mode(name, "tls", ch("tls", None)))
        # The job GetJob reads: one per stack, submitted as sa:bench on ON.
        first: dict[str, str] = {}
        for m in modes:
            if m.stack not in first or m.stack == "on" and m.name == "api-token":
                first[m.stack] = (await m.stub.SubmitJob(jms.SubmitJobRequest(
                    spec=spec("target"), request_id=uuid.uuid4().hex),
                    timeout=30, metadata=m.metadata)).job.name
        for m in modes:
            m.job = first[m.stack]
            st = stacks[m.stack]
            assert st.jm is not None and st.jm.proc is not None and etcd.proc is not None
            m.pids = {"jm": st.jm.proc.pid, "etcd": etcd.proc.pid, "client": 0}

        print(f"warm-up: {args.warmup:g} s GetJob + 5 submits per mode", file=sys.stderr)
        for m in modes:
            await getjob_phase(m, args.concurrency, args.warmup, record=False)
            await submit_phase(m, 5, record=False)
        await settle(modes)
        micro_rows = await micro(issuer, args.micro) if args.micro else []
        # From here on, what the measured calls cause: counts above these.
        warm_fetches = issuer.counts() if issuer is not None else {}

        if args.py_spy:
            spy = Spy(args.py_spy)
            for kind, st in stacks.items():
                if st.jm is not None and st.jm.proc is not None:
                    spy.start(f"jm-{kind}", st.jm.proc.pid)
            spy.start("client", os.getpid())
            await asyncio.sleep(1)

        k = len(modes)
        for r in range(args.rounds):
            order = modes[r % k:] + modes[:r % k]
            line = []
            for m in order:
                q = await getjob_phase(m, args.concurrency, args.duration, record=True)
                line.append(f"{m.name}={q:.0f}")
            for m in order:
                await submit_phase(m, args.submits, record=True)
            left = await settle(modes)
            print(f"round {r + 1}/{args.rounds}: GetJob QPS " + " ".join(line)
                  + (f" ({left} jobs still running)" if left else ""), file=sys.stderr)
        if spy is not None:
            spy.stop()
    finally:
        for c in channels:
            await c.close()
        if spy is not None:
            spy.stop()
        for st in stacks.values():
            st.stop()
        etcd.stop()
        if issuer is not None:
            issuer.close()
        shutil.rmtree(sec.dir, ignore_errors=True)

    off = next((m for m in modes if m.name == "off"), None)
    print()
    print(f"dlsched auth benchmark: GetJob x{args.concurrency} for {args.duration:g} s and "
          f"{args.submits} sequential submits per mode per round, {args.rounds} rounds "
          f"(rotating order), {os.cpu_count()} CPUs, load avg {os.getloadavg()[0]:.1f}")
    print(f"{'mode':<11}{'GetJob QPS':>11}{'p50':>12}{'p99':>12}{'on/off':>8}{'rounds':>8}"
          f"{'min':>7}   {'Submit p50':>11}{'p99':>12}{'on/off':>8}")
    ok = True
    for m in modes:
        qps = m.calls / m.seconds if m.seconds else 0.0
        ratio = per_round = lo = sub_ratio = ""
        if off is not None and off.seconds:
            base = off.calls / off.seconds
            ratio = f"{qps / base:8.2f}"
            rr = [a / b for a, b in zip(m.qps, off.qps, strict=True) if b]
            per_round = f"{statistics.median(rr):8.2f}" if rr else ""
            lo = f"{min(rr):7.2f}" if rr else ""
            if off.submit_lat and m.submit_lat:
                sub_ratio = f"{pct(m.submit_lat, 50) / pct(off.submit_lat, 50):8.2f}"
            if m.name == "api-token":
                ok = qps / base >= TARGET
        err = f"  ({m.get_errors} errors)" if m.get_errors else ""
        print(f"{m.name:<11}{qps:11.0f}{ms(pct(m.get_lat, 50)):>12}{ms(pct(m.get_lat, 99)):>12}"
              f"{ratio:>8}{per_round:>8}{lo:>7}   {ms(pct(m.submit_lat, 50)):>11}"
              f"{ms(pct(m.submit_lat, 99)):>12}{sub_ratio:>8}{err}")
    print("  on/off: all rounds pooled; 'rounds': median of per-round ratios; 'min': the worst round;"
          " Submit on/off: p50 ratio")
    print()
    print("CPU per GetJob call during the measured phases (load-independent; 'pred.' = the QPS")
    print("ratio if the machine were CPU-bound on these processes alone, off/on CPU per call)")
    print(f"{'mode':<11}{'JobManager':>12}{'client':>12}{'etcd':>12}{'total':>12}{'pred.':>8}")
    base_cpu = (sum(off.cpu.values()) / off.calls) if off is not None and off.calls else 0.0
    for m in modes:
        if not m.calls:
            continue
        per = {k: 1e6 * v / m.calls for k, v in m.cpu.items()}
        tot = sum(m.cpu.values()) / m.calls
        pred = f"{base_cpu / tot:8.2f}" if base_cpu and tot else ""
        print(f"{m.name:<11}" + "".join(f"{per.get(k, 0):9.0f} us" for k in ("jm", "client", "etcd"))
              + f"{1e6 * tot:9.0f} us{pred}")
    if micro_rows:
        print()
        print(f"auth path in-process, per call (mean of {args.micro}; no gRPC, no TLS):")
        for name, v in micro_rows:
            print(f"  {name:<44}{v * 1e6:8.1f} us")
    if issuer is not None:
        print(f"  OIDC issuer fetches: set-up + warm-up + micro {warm_fetches or 'none'}; "
              f"measured rounds {({w: n - warm_fetches.get(w, 0) for w, n in issuer.counts().items() if n > warm_fetches.get(w, 0)}) or 'none'} "
              f"(oidc calls measured: {sum(m.calls for m in modes if m.name == 'oidc')})")
    if off is not None and any(m.name == "api-token" for m in modes):
        print(f"target GetJob QPS api-token/off >= {TARGET}: {'met' if ok else 'MISSED'}")
    if spy is not None:
        spy.report(args.top)
    return 0 if ok or not args.strict else 1


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--duration", type=float, default=4.0, help="seconds per GetJob phase (default 4)")
    p.add_argument("--rounds", type=int, default=4, help="rounds of all modes (default 4)")
    p.add_argument("--concurrency", type=int, default=16, help="GetJob calls in flight (default 16)")
    p.add_argument("--warmup", type=float, default=2.0, help="GetJob warm-up seconds per mode")
    p.add_argument("--submits", type=int, default=20, help="sequential submits per mode per round")
    p.add_argument("--modes", default="off,api-token,admin,oidc",
                   help="comma list of off, api-token, admin, oidc, api-md, api-creds, tls-only")
    p.add_argument("--breakdown", action="store_true",
                   help="add the api-md, api-creds and tls-only modes")
    p.add_argument("--micro", type=int, default=20000,
                   help="calls per in-process auth micro-benchmark (0: skip)")
    p.add_argument("--py-spy", metavar="DIR", help="profile the JobManagers and this client")
    p.add_argument("--top", type=int, default=25, help="frames per profile summary")
    p.add_argument("--strict", action="store_true", help="exit 1 when the target is missed")
    args = p.parse_args()
    args.modes = [s.strip() for s in args.modes.split(",") if s.strip()]
    if args.breakdown:
        args.modes += [m for m in ("api-md", "api-creds", "tls-only") if m not in args.modes]
    known = {"off", "api-token", "admin", "oidc", "api-md", "api-creds", "tls-only"}
    if set(args.modes) - known:
        p.error(f"unknown modes {sorted(set(args.modes) - known)}")
    per_mode = args.rounds * (args.duration + args.submits * 0.5 + 2) + args.warmup + 10
    bound = 120 + len(args.modes) * per_mode
    try:
        sys.exit(asyncio.run(asyncio.wait_for(run(args), bound)))
    except TimeoutError:
        print(f"error: the benchmark ran past its {bound:.0f} s bound", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
