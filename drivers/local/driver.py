"""``LocalDriver``: jobs as process groups on the driver's host.

Each process of a job (one per slot, see ``drivers.common.planner``) is started in
exec form (never a shell) in a session of its own (``start_new_session``), so
its pid is the id of a process group that holds everything it forks. Its
environment is the driver's, plus the planner's variables, plus the user's.

State comes from the processes themselves, not from polling: a subprocess
protocol is told when the process exits (``process_exited``) and when each
pipe closes, and every change is published at once to the watchers through an
``ObservationHub``. When a process exits, what is left of its process group
is killed, so a job's end means all of its processes are gone.

Run modes: all five, planned by ``drivers.common.planner`` with every
replica on this host (``127.0.0.1``, node rank 0). At launch the driver picks
free ports on the host (one ``MASTER_PORT`` per MULTI_PROCESS / MASTER_WORKER
job, one task port per ps / worker / chief replica of a PS_WORKER job) and,
for replicas asking for GPUs, distinct GPU indices from ``nvidia-smi`` that no
running job holds (``CUDA_VISIBLE_DEVICES``; too few is FAILED_PRECONDITION
``GPUS_UNAVAILABLE``). MPI runs the launcher under the ``mpirun`` found on
the driver's PATH with ``--oversubscribe --bind-to none`` (plus
``--allow-run-as-root`` as root) and the hostfile in the attempt directory;
its workers are placeholders: nothing is started for them (mpirun starts
every rank on this host), they report RUNNING while the launcher runs and
end with it. Without ``mpirun`` an MPI launch (or render) is
FAILED_PRECONDITION ``MPI_NOT_AVAILABLE`` and ``supported_run_modes`` omits
MPI.

Success rule (the plan's ``SuccessRule``): the job SUCCEEDS once every
process of the deciding roles exits 0 (every role for SINGLE_PROCESS,
MULTI_PROCESS and MASTER_WORKER; the workers, or the chief, for PS_WORKER;
the launcher for MPI); processes of the other roles still running are then
stopped (SIGTERM, SIGKILL after the grace) and end STOPPED, not failed. A
process that fails before that fails the job. When one fails, the job records it (reason ``NonZeroExit``,
its exit code) and stops the others (SIGTERM, SIGKILL after the default
grace); it reports FAILED once all are gone, so a retry never overlaps the
failed attempt. ``terminate``: STOPPING, SIGTERM to every process group,
SIGKILL after the grace period, then STOPPED. The time limit stops the job
the same way and reports FAILED / ``TimeLimitExceeded``.

Logs: the driver reads each process's stdout and stderr pipes itself and
appends every line to ``{state}/jobs/{job_id}/attempt-{n}/{role}-{index}.
{stdout|stderr}`` as ``<unix-nanos> <text>`` (see ``render`` and
``logfile``), so line times are exact. Tails read those files and are woken
by the writer on every chunk (no polling delay); a follow ends when the job
has ended and every pipe is drained.

Records: ``record.json`` per attempt is written at launch, once the processes
run, and when the job ends. On start the driver reloads the newest attempt of
every job, so launch dedup, observations and logs survive a driver restart.
A job that was still running cannot be re-adopted (its output pipes died with
the old driver): its leftover process groups are killed (after checking the
process start time, so a reused pid is never hit) and it is reported FAILED,
reason ``DriverRestarted``; JobManager's retry policy then resubmits it as a
new attempt. On a clean shutdown (SIGTERM) running jobs are stopped and
reported FAILED, reason ``DriverStopped``.

Capacity: one node; CPUs ``os.cpu_count()``, memory ``/proc/meminfo``, GPUs
from ``nvidia-smi`` when present. Free CPUs are the total minus what running
jobs ask for (each replica's ``resources.cpu``, or one per process when 0);
free GPUs likewise; free memory is MemAvailable. Nothing is enforced.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import os
import shutil
import signal
import socket
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from dlsched import __version__
from dlsched.errors import Internal, InvalidArgument
from drivers.common.base import (
    ClusterCapacity,
    ClusterConfig,
    ClusterInfo,
    ClusterState,
    Driver,
    GpuInventory,
    JobNotFound,
    JobObservation,
    JobRef,
    JobSpec,
    JobState,
    JobUsage,
    LaunchResult,
    LogEntry,
    LogQuery,
    LogStream,
    NativeSpec,
    ReplicaState,
    ReplicaStatus,
    ReplicaUsage,
    RunMode,
    WatchEvent,
)
from drivers.common.convert import ID_RE
from drivers.common.hub import ObservationHub
from drivers.common.launches import Known, LaunchRules
from drivers.common.planner import (
    ALL_RUN_MODES,
    DEFAULT_MASTER_PORT,
    TORCH_MODES,
    MpiNotAvailable,
    assign_gpus,
)
from drivers.common.registry import ClusterRegistry
from drivers.local import procfs, render, states
from drivers.local.logfile import LineWriter, LogFileReader

log = logging.getLogger("dlsched.driver.local")

MAX_PROCESSES = 256
RECORD = "record.json"
BATCH_ENTRIES = 500
BATCH_BYTES = 1 << 20
GPU_CACHE_SECONDS = 60.0


def _default_state_dir() -> str:
    base = os.environ.get("XDG_STATE_HOME") or os.path.expanduser("~/.local/state")
    return os.path.join(base, "dlsched", "local")


@dataclass(frozen=True)
class LocalConfig:
    """The local driver's flags."""

    state_dir: str = field(default_factory=_default_state_dir,
                           metadata={"help": "where job records and logs live"})
    grace_seconds: float = field(default=10.0, metadata={
        "help": "SIGTERM-to-SIGKILL grace when a request names none"})


class _Signal:
    """Wakes every waiter on ``notify``; waiters take ``current()`` before checking."""

    def __init__(self) -> None:
        self._ev = asyncio.Event()

    def current(self) -> asyncio.Event:
        return self._ev

    def notify(self) -> None:
        self._ev.set()
        self._ev = asyncio.Event()


class _Slot:
    """One process of a job."""

    def __init__(self, plan: render.ProcessPlan) -> None:
        self.plan = plan
        self.transport: asyncio.SubprocessTransport | None = None
        self.pid: int | None = None
        self.start_ticks = 0
        self.state = ReplicaState.PENDING
        self.exit_code: int | None = None
        self.message = ""
        self.cpu_seconds = 0.0
        self.peak_bytes = 0

    @property
    def placeholder(self) -> bool:
        return self.plan.placeholder

    @property
    def running(self) -> bool:
        """A started process that has not ended (placeholders have none)."""
        return self.state is ReplicaState.RUNNING and not self.plan.placeholder


class _Job:
    def __init__(self, cluster: str, job_id: str, attempt: int, spec: JobSpec | None,
                 plan: render.LocalPlan, native: NativeSpec) -> None:
        self.cluster = cluster
        self.job_id = job_id
        self.attempt = attempt
        self.backend_job_id = plan.backend_job_id
        self.spec = spec
        self.plan = plan
        self.native = native
        self.state = JobState.PENDING
        self.reason = ""
        self.message = ""
        self.exit_code: int | None = None
        self.start_time: float | None = None
        self.end_time: float | None = None
        self.slots = [_Slot(p) for p in plan.processes]
        self.stop_requested = False
        self.stop_final: tuple[JobState, str] | None = None
        self.stop_signalled = False
        self.succeeding = False  # the deciding roles succeeded; the rest are being stopped
        self.failure: tuple[str, int, int, str] | None = None
        self.kill_handle: asyncio.TimerHandle | None = None
        self.kill_deadline: float | None = None
        self.limit_handle: asyncio.TimerHandle | None = None
        self.started = asyncio.Event()
        self.done = asyncio.Event()
        self.logs_done = asyncio.Event()
        self.log_signal = _Signal()
        self.open_pipes = 1  # the launch itself holds one until every process is started

    @property
    def dir(self) -> str:
        return os.path.dirname(self.slots[0].plan.stdout) if self.slots else ""

    def ended(self) -> bool:
        return self.done.is_set() and self.logs_done.is_set()

    def gpus_held(self) -> set[str]:
        out: set[str] = set()
        for s in self.slots:
            if v := s.plan.env.get("CUDA_VISIBLE_DEVICES"):
                out.update(v.split(","))
        return out

    def requested(self) -> tuple[float, int]:
        """(CPUs, GPUs) the job asks for while it runs."""
        if self.spec is None:
            return 0.0, 0
        cpu, gpu = 0.0, 0
        for g in self.spec.replica_groups:
            cpu += g.replicas * (g.resources.cpu if g.resources.cpu > 0 else g.processes)
            gpu += g.replicas * g.resources.gpus
        return cpu, gpu


class _SlotProtocol(asyncio.SubprocessProtocol):
    """Feeds a slot's pipes to its log files and reports its exit at once."""

    def __init__(self, driver: LocalDriver, job: _Job, slot: _Slot) -> None:
        self._driver, self._job, self._slot = driver, job, slot
        self._writers: dict[int, LineWriter | None] = {}
        self._transport: asyncio.SubprocessTransport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # Opened only once the process exists, so a failed spawn leaks nothing.
        self._transport = transport  # type: ignore[assignment]
        for fd, stream in ((1, LogStream.STDOUT), (2, LogStream.STDERR)):
            path = self._slot.plan.log_path(stream)
            try:
                self._writers[fd] = LineWriter(path)
            except OSError as e:
                log.warning("cannot open log %s: %s", path, e)
                self._writers[fd] = None

    def pipe_data_received(self, fd: int, data: bytes | str) -> None:
        w = self._writers.get(fd)
        if w is None:
            return
        raw = data if isinstance(data, bytes) else data.encode()
        try:
            if w.feed(raw, time.time_ns()):
                self._job.log_signal.notify()
        except OSError as e:  # disk full, files removed: keep draining the pipe
            log.warning("log write failed for %s: %s", self._job.job_id, e)
            self._writers[fd] = None

    def pipe_connection_lost(self, fd: int, exc: Exception | None) -> None:
        w = self._writers.pop(fd, None)
        if w is not None:
            with contextlib.suppress(OSError):
                w.close(time.time_ns())
        if fd in (1, 2):
            self._driver._pipe_closed(self._job)

    def process_exited(self) -> None:
        rc = self._transport.get_returncode() if self._transport is not None else None
        self._driver._process_exited(self._job, self._slot, rc)


def _free_ports(n: int) -> list[int]:
    """``n`` distinct free ports (all bound at once, then released)."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            socks.append(s)
            s.bind((render.LOCAL_HOST, 0))
        return [int(s.getsockname()[1]) for s in socks]
    finally:
        for s in socks:
            s.close()


def _signal_session(pgid: int | None, sig: int) -> None:
    """Signal a replica: its process group, and every other process of the
    session it leads. Each replica starts a session of its own, and a process
    that leaves the group (mpirun puts every rank in a group of its own) stays
    in the session, so a stop or an exit leaves no orphan running."""
    _signal_sessions([pgid] if pgid is not None else [], sig)


def _signal_sessions(leaders: list[int], sig: int) -> None:
    """``_signal_session`` for many replicas with one pass over /proc."""
    if not leaders:
        return
    for pgid in leaders:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, sig)
    for pid in procfs.session_members(*leaders):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, sig)


class LocalDriver(Driver):
    name = "local"

    def __init__(self, config: LocalConfig, *, base_env: Mapping[str, str] | None = None) -> None:
        self._cfg = config
        self._state_dir = os.path.abspath(config.state_dir)
        self._grace = config.grace_seconds
        self._base_env = dict(os.environ if base_env is None else base_env)
        self._host = socket.gethostname()
        self._jobs: dict[str, _Job] = {}
        self._launches = LaunchRules()
        self._hub = ObservationHub()
        self._clusters: ClusterRegistry[ClusterConfig] = ClusterRegistry(self._hub)
        self._gpu_cache: tuple[float, list[tuple[str, int]]] | None = None
        path = self._base_env.get("PATH", os.defpath)
        self._mpirun = shutil.which("mpirun", path=path)
        self._mpirun_args = ["--oversubscribe", "--bind-to", "none"]
        if os.geteuid() == 0:
            self._mpirun_args.insert(0, "--allow-run-as-root")

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        os.makedirs(os.path.join(self._state_dir, "jobs"), exist_ok=True)
        for job in self._load_records():
            self._jobs[job.job_id] = job
        log.info("local driver state in %s; %d job(s) reloaded", self._state_dir, len(self._jobs))

    async def close(self) -> None:
        live = [j for j in self._jobs.values() if not j.state.is_terminal()]
        grace = min(self._grace, 5.0)
        for job in live:
            if not job.stop_requested and job.failure is None:
                job.stop_requested = True
                job.stop_final = (JobState.FAILED, "DriverStopped")
            self._signal_stop(job, grace)
        if live:
            await asyncio.wait([asyncio.ensure_future(j.done.wait()) for j in live], timeout=grace + 2)

    # ------------------------------------------------------------------ clusters

    def _require(self, cluster: str) -> None:
        self._clusters.require(cluster)

    async def configure_cluster(self, config: ClusterConfig) -> ClusterInfo:
        # The local backend needs no address or credentials; keep neither.
        await self._clusters.configure(
            config.name, lambda _old: ClusterConfig(name=config.name, options=dict(config.options)))
        return await self._info()

    async def remove_cluster(self, cluster: str) -> None:
        await self._clusters.remove(cluster)

    async def cluster_info(self, cluster: str) -> ClusterInfo:
        self._require(cluster)
        return await self._info()

    async def _gpus(self) -> list[tuple[str, int]]:
        now = time.monotonic()
        if self._gpu_cache is None or now - self._gpu_cache[0] > GPU_CACHE_SECONDS:
            self._gpu_cache = (now, await procfs.nvidia_gpus())
        return self._gpu_cache[1]

    async def _info(self) -> ClusterInfo:
        cpus = float(os.cpu_count() or 1)
        mem_total, mem_avail = procfs.meminfo()
        gpus = await self._gpus()
        used_cpu = used_gpu = 0.0
        for j in self._jobs.values():
            if not j.state.is_terminal():
                c, g = j.requested()
                used_cpu += c
                used_gpu += g
        cpus_free = max(0.0, cpus - used_cpu)
        by_type: dict[str, int] = {}
        for t, _ in gpus:
            by_type[t] = by_type.get(t, 0) + 1
        left = int(used_gpu)
        inventory = []
        for t, n in sorted(by_type.items()):
            take = min(n, left)
            left -= take
            inventory.append(GpuInventory(gpu_type=t, total=n, free=n - take))
        gpus_total = len(gpus)
        cap = ClusterCapacity(
            nodes_total=1, nodes_free=1 if cpus_free > 0 else 0,
            cpus_total=cpus, cpus_free=cpus_free,
            memory_bytes_total=mem_total, memory_bytes_free=mem_avail,
            gpus_total=gpus_total, gpus_free=max(0, gpus_total - int(used_gpu)),
            gpus=tuple(inventory),
            max_cpus_per_node=cpus, max_memory_bytes_per_node=mem_total,
            max_gpus_per_node=gpus_total,
        )
        return ClusterInfo(state=ClusterState.READY, capacity=cap,
                           supported_run_modes=self._run_modes(),
                           driver_version=f"local/{__version__}")

    # ------------------------------------------------------------------ render / launch

    def _run_modes(self) -> tuple[RunMode, ...]:
        return tuple(m for m in ALL_RUN_MODES if m is not RunMode.MPI or self._mpirun is not None)

    def _plan(self, job_id: str, spec: JobSpec, attempt: int, *, launch: bool,
              gpus: Mapping[tuple[str, int], tuple[str, ...]] | None = None) -> render.LocalPlan:
        if spec.run_mode is RunMode.MPI and self._mpirun is None:
            raise MpiNotAvailable("no mpirun on the local driver's PATH")
        master_port, ports = DEFAULT_MASTER_PORT, {}
        if launch:
            keys = [(g.role, r) for g in spec.replica_groups for r in range(g.replicas)
                    if spec.run_mode is RunMode.PS_WORKER and g.role != "evaluator"]
            free = _free_ports(len(keys) + 1)
            ports = dict(zip(keys, free[1:], strict=True))
            if spec.run_mode in TORCH_MODES:
                master_port = free[0]
        plan = render.plan_job(job_id, spec, attempt=attempt, state_dir=self._state_dir,
                               master_port=master_port, ports=ports, gpus=gpus,
                               mpirun=self._mpirun or "mpirun", mpirun_args=self._mpirun_args)
        if len(plan.processes) > MAX_PROCESSES:
            raise InvalidArgument.for_field(
                "spec.replica_groups", f"the local driver runs at most {MAX_PROCESSES} processes per job")
        return plan

    async def _assign_gpus(self, spec: JobSpec) -> dict[tuple[str, int], tuple[str, ...]]:
        requests = [(g.role, r, g.resources.gpus) for g in spec.replica_groups for r in range(g.replicas)]
        if not any(n > 0 for *_, n in requests):
            return {}
        inventory = [str(i) for i in range(len(await self._gpus()))]
        held: set[str] = set()
        for j in self._jobs.values():
            if not j.state.is_terminal():
                held |= j.gpus_held()
        return assign_gpus(inventory, sorted(held), requests)

    async def render(self, cluster: str, job_id: str, spec: JobSpec) -> NativeSpec:
        self._require(cluster)
        return render.to_native_spec(self._plan(job_id, spec, 1, launch=False))

    async def launch(self, cluster: str, job_id: str, spec: JobSpec, attempt: int) -> LaunchResult:
        self._require(cluster)

        def known() -> Known | None:  # jobs are keyed by id alone: one host under every cluster name
            prev = self._jobs.get(job_id)
            if prev is None:
                return None
            return Known(prev.cluster, prev.attempt, not prev.state.is_terminal(),
                         lambda: LaunchResult(prev.backend_job_id, prev.native, self._observe(prev)))

        return await self._launches.launch(cluster, job_id, attempt, known=known,
                                           submit=lambda: self._submit(cluster, job_id, spec, attempt))

    async def _submit(self, cluster: str, job_id: str, spec: JobSpec, attempt: int) -> LaunchResult:
        gpus = await self._assign_gpus(spec)
        plan = self._plan(job_id, spec, attempt, launch=True, gpus=gpus)
        job = _Job(cluster, job_id, attempt, spec, plan, render.to_native_spec(plan))
        self._jobs[job_id] = job  # before any await: a stop or an observation during the spawn finds it
        try:
            self._prepare(job)
        except OSError as e:
            del self._jobs[job_id]
            job.started.set()
            raise Internal(f"cannot prepare the job directory: {e.strerror}") from e
        try:
            await self._spawn_all(job)
        finally:
            job.started.set()
        log.info("job %s attempt %d launched as %s: %d process(es), %s", job_id, attempt, job.backend_job_id,
                 len(job.slots), job.state.name)
        return LaunchResult(job.backend_job_id, job.native, self._observe(job))

    def _prepare(self, job: _Job) -> None:
        os.makedirs(job.dir, exist_ok=True)
        for name, content in job.plan.files.items():
            with open(os.path.join(job.dir, name), "w") as f:
                f.write(content)
        for s in job.slots:
            for stream in (LogStream.STDOUT, LogStream.STDERR):
                open(s.plan.log_path(stream), "ab").close()
        self._persist(job)

    async def _spawn_all(self, job: _Job) -> None:
        loop = asyncio.get_running_loop()
        for slot in job.slots:
            if job.stop_signalled:
                slot.state = ReplicaState.STOPPED
                slot.message = "not started: the job is stopping"
                continue
            if slot.placeholder:
                slot.state = ReplicaState.RUNNING
                slot.message = "placeholder: mpirun starts this host's ranks"
                continue
            argv, p = slot.plan.argv, slot.plan
            env = {**self._base_env, **p.env}
            job.open_pipes += 2  # before the spawn: a pipe may close before it returns
            try:
                transport, _ = await loop.subprocess_exec(
                    functools.partial(_SlotProtocol, self, job, slot), *argv,
                    stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
                    stderr=asyncio.subprocess.PIPE, env=env, cwd=p.cwd, start_new_session=True)
            except (OSError, ValueError) as e:
                job.open_pipes -= 2
                code = 127 if isinstance(e, FileNotFoundError) else 126
                slot.state, slot.exit_code = ReplicaState.FAILED, code
                what = getattr(e, "strerror", None) or str(e)
                slot.message = f"cannot start {argv[0]!r} in {p.cwd!r}: {what}"
                if job.failure is None:
                    job.failure = (p.role, p.index, code, states.REASON_START_FAILED)
                    job.reason, job.message = states.REASON_START_FAILED, slot.message
                self._signal_stop(job, self._grace)
                continue
            slot.transport = transport
            slot.pid = transport.get_pid()
            if slot.state is ReplicaState.PENDING:  # it may have exited already
                slot.state = ReplicaState.RUNNING
            st = procfs.read_stat(slot.pid)
            slot.start_ticks = st.start_ticks if st is not None else 0
            if job.stop_signalled:
                _signal_session(slot.pid, signal.SIGTERM)
            if job.state is JobState.PENDING:
                job.state, job.reason = JobState.RUNNING, states.REASON_STARTED
                job.start_time = time.time()
        if job.spec is not None and job.spec.time_limit_seconds and not job.state.is_terminal():
            job.limit_handle = loop.call_later(job.spec.time_limit_seconds, self._time_limit, job)
        with contextlib.suppress(OSError):
            self._persist(job)
        self._pipe_closed(job)  # the launch's own hold
        self._maybe_finish(job)

    # ------------------------------------------------------------------ process events

    def _process_exited(self, job: _Job, slot: _Slot, returncode: int | None) -> None:
        _signal_session(slot.pid, signal.SIGKILL)  # whatever the process left behind in its session
        code = states.exit_code_of(returncode)
        slot.exit_code = code
        slot.state = states.replica_state(code, stop_signalled=job.stop_signalled)
        if slot.state is ReplicaState.FAILED:
            slot.message = f"exited with code {code}"
            if job.failure is None and not job.stop_requested:
                job.failure = (slot.plan.role, slot.plan.index, code if code is not None else 1,
                               states.REASON_NON_ZERO_EXIT)
                if any(s.running for s in job.slots):
                    job.reason = states.REASON_REPLICA_FAILED
                    job.message = f"{slot.plan.role}-{slot.plan.index} exited with code {code}; stopping the rest"
                    self._signal_stop(job, self._grace)
        elif slot.state is ReplicaState.STOPPED:
            slot.message = "stopped: the job succeeded" if job.succeeding else "stopped by dlsched"
        elif (slot.state is ReplicaState.SUCCEEDED and not job.succeeding and job.failure is None
              and not job.stop_requested and job.plan.decides(slot.plan.role)
              and all(s.state is ReplicaState.SUCCEEDED for s in job.slots if job.plan.decides(s.plan.role))):
            job.succeeding = True
            if any(s.running for s in job.slots):
                job.message = f"{job.plan.success_description}: stopping the rest"
                self._signal_stop(job, self._grace)
        self._maybe_finish(job)

    def _pipe_closed(self, job: _Job) -> None:
        job.open_pipes -= 1
        if job.open_pipes <= 0 and not job.logs_done.is_set():
            job.logs_done.set()
            job.log_signal.notify()
            self._close_transports(job)

    def _close_transports(self, job: _Job) -> None:
        # Only once every pipe is drained: closing a transport closes its pipes.
        for s in job.slots:
            if s.transport is not None and s.transport.get_returncode() is not None:
                s.transport.close()
                s.transport = None

    def _maybe_finish(self, job: _Job) -> None:
        if job.state.is_terminal():
            return
        if not job.started.is_set() and any(s.state is ReplicaState.PENDING for s in job.slots):
            self._publish(job)
            return
        if any(not s.state.is_terminal() for s in job.slots if not s.placeholder):
            self._publish(job)
            return
        out = states.job_outcome(stop_requested=job.stop_requested, stop_final=job.stop_final,
                                 failure=job.failure, success_message=job.plan.success_description)
        for s in job.slots:
            if s.placeholder and not s.state.is_terminal():
                ok = out.state is JobState.SUCCEEDED
                s.state = ReplicaState.SUCCEEDED if ok else ReplicaState.STOPPED
                s.message = "placeholder: ended with the launcher"
        job.state, job.reason, job.message, job.exit_code = out.state, out.reason, out.message, out.exit_code
        job.end_time = time.time()
        for h in (job.kill_handle, job.limit_handle):
            if h is not None:
                h.cancel()
        with contextlib.suppress(OSError):
            self._persist(job)
        self._publish(job)
        job.done.set()
        job.log_signal.notify()
        if job.logs_done.is_set():
            self._close_transports(job)

    def _signal_stop(self, job: _Job, grace: float) -> None:
        job.stop_signalled = True
        _signal_sessions([s.pid for s in job.slots if s.running and s.pid is not None], signal.SIGTERM)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + max(0.0, grace)
        if job.kill_deadline is None or deadline < job.kill_deadline:
            if job.kill_handle is not None:
                job.kill_handle.cancel()
            job.kill_deadline = deadline
            job.kill_handle = loop.call_at(deadline, self._kill_all, job)

    def _kill_all(self, job: _Job) -> None:
        _signal_sessions([s.pid for s in job.slots if s.running and s.pid is not None], signal.SIGKILL)

    def _time_limit(self, job: _Job) -> None:
        if job.state.is_terminal() or job.stop_requested or job.failure is not None or job.succeeding:
            return
        job.stop_requested = True
        job.stop_final = (JobState.FAILED, states.REASON_TIME_LIMIT)
        job.reason, job.message = states.REASON_TIME_LIMIT, "the job ran past its time limit; stopping"
        self._signal_stop(job, self._grace)
        self._publish(job)

    # ------------------------------------------------------------------ observations

    def _observe(self, job: _Job) -> JobObservation:
        return JobObservation(
            job_id=job.job_id, backend_job_id=job.backend_job_id, found=True, state=job.state,
            reason=job.reason, message=job.message, exit_code=job.exit_code,
            replicas=tuple(ReplicaStatus(role=s.plan.role, index=s.plan.index, state=s.state,
                                         exit_code=s.exit_code, host=self._host, message=s.message)
                           for s in job.slots),
            start_time=job.start_time, end_time=job.end_time, attempt=job.attempt,
        )

    def _publish(self, job: _Job) -> None:
        self._hub.publish(job.cluster, self._observe(job))

    def _find(self, cluster: str, ref: JobRef) -> _Job | None:
        job = self._jobs.get(ref.job_id)
        if job is None or job.cluster != cluster:
            return None
        if ref.backend_job_id and ref.backend_job_id != job.backend_job_id:
            return None
        return job

    async def observe(self, cluster: str, refs: Sequence[JobRef]) -> list[JobObservation]:
        self._require(cluster)
        out = []
        for ref in refs:
            job = self._find(cluster, ref)
            out.append(self._observe(job) if job is not None else JobObservation.not_found(ref))
        return out

    def watch(self, cluster: str) -> AsyncIterator[WatchEvent]:
        return self._clusters.watch(
            cluster, lambda _c: [self._observe(j) for j in self._jobs.values() if j.cluster == cluster])

    # ------------------------------------------------------------------ stop / cleanup

    async def terminate(self, cluster: str, ref: JobRef, grace_seconds: float | None) -> JobObservation:
        self._require(cluster)
        job = self._find(cluster, ref)
        if job is None:
            return JobObservation.not_found(ref)
        if job.state.is_terminal() or job.succeeding:
            return self._observe(job)  # a succeeding job is already stopping the rest
        grace = self._grace if grace_seconds is None else grace_seconds
        if not job.stop_requested and job.failure is None:
            job.stop_requested = True
            job.stop_final = (JobState.STOPPED, states.REASON_STOPPED)
            job.state, job.reason = JobState.STOPPING, states.REASON_STOPPING
            job.message = f"stopping: SIGTERM, SIGKILL after {grace:g}s"
        self._signal_stop(job, grace)
        self._publish(job)
        return self._observe(job)

    async def cleanup(self, cluster: str, ref: JobRef) -> None:
        self._require(cluster)
        job = self._find(cluster, ref)
        if job is None:
            return
        if not job.state.is_terminal():
            await self.terminate(cluster, ref, None)
        await job.started.wait()
        await job.done.wait()
        await job.logs_done.wait()
        if self._jobs.get(job.job_id) is job:
            del self._jobs[job.job_id]
        await asyncio.to_thread(shutil.rmtree, render.job_dir(self._state_dir, job.job_id), True)

    # ------------------------------------------------------------------ logs

    def tail_logs(self, cluster: str, ref: JobRef, query: LogQuery) -> AsyncIterator[list[LogEntry]]:
        return self._tail(cluster, ref, query)

    async def _tail(self, cluster: str, ref: JobRef, query: LogQuery) -> AsyncIterator[list[LogEntry]]:
        self._require(cluster)
        job = self._find(cluster, ref)
        if job is None:
            raise JobNotFound(ref.job_id)
        files = [(s.plan.role, s.plan.index, stream, LogFileReader(s.plan.log_path(stream)))
                 for s in job.slots for stream in (LogStream.STDOUT, LogStream.STDERR)
                 if query.wants_replica(s.plan.role, s.plan.index) and query.wants_stream(stream)]

        def entries(per_file: list[list[tuple[int, str]]], tail: int) -> list[LogEntry]:
            out: list[LogEntry] = []
            for (role, index, stream, _), lines in zip(files, per_file, strict=True):
                if query.since_ns is not None:
                    lines = [ln for ln in lines if ln[0] >= query.since_ns]
                if tail:
                    lines = lines[-tail:]
                out.extend(LogEntry(role=role, replica_index=index, stream=stream, text=t,
                                    time_ns=ns or None) for ns, t in lines)
            out.sort(key=lambda e: e.time_ns or 0)
            return out

        ended = job.ended()
        backlog = await asyncio.to_thread(lambda: [r.read_new() for *_, r in files])
        for batch in _batches(entries(backlog, query.tail_lines)):
            yield batch
        if not query.follow or ended:
            return
        while True:
            ended = job.ended()
            wake = job.log_signal.current()
            new = entries([r.read_new() for *_, r in files], 0)
            if new:
                for batch in _batches(new):
                    yield batch
                continue
            if ended or self._jobs.get(job.job_id) is not job:
                return
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(wake.wait(), timeout=1.0)

    # ------------------------------------------------------------------ usage

    async def usage(self, cluster: str, ref: JobRef) -> JobUsage:
        self._require(cluster)
        job = self._find(cluster, ref)
        if job is None:
            raise JobNotFound(ref.job_id)
        live = {s.pid for s in job.slots if s.running and s.pid is not None}
        stats = await asyncio.to_thread(procfs.all_stats) if live else []
        groups: dict[int, list[procfs.ProcStat]] = {pid: [] for pid in live}
        for st in stats:
            for key in {st.pgrp, st.session} & live:
                groups[key].append(st)
                break
        out = []
        for s in job.slots:
            members = groups.get(s.pid, []) if s.pid is not None else []
            rss = sum(m.rss_bytes for m in members)
            if members:
                s.cpu_seconds = max(s.cpu_seconds, sum(m.cpu_seconds for m in members))
                hwm = sum(procfs.vm_hwm_bytes(m.pid) for m in members)
                s.peak_bytes = max(s.peak_bytes, hwm, rss)
            out.append(ReplicaUsage(role=s.plan.role, replica_index=s.plan.index,
                                    cpu_seconds=s.cpu_seconds, memory_bytes=rss,
                                    peak_memory_bytes=s.peak_bytes, running=bool(members)))
        return JobUsage(replicas=tuple(out), sample_time=time.time())

    # ------------------------------------------------------------------ records

    def _persist(self, job: _Job) -> None:
        rec: dict[str, Any] = {
            "version": 1, "cluster": job.cluster, "job_id": job.job_id, "attempt": job.attempt,
            "backend_job_id": job.backend_job_id, "state": job.state.name, "reason": job.reason,
            "message": job.message, "exit_code": job.exit_code, "start_time": job.start_time,
            "end_time": job.end_time, "native_spec": job.native.content,
            "slots": [{"state": s.state.name, "exit_code": s.exit_code, "message": s.message,
                       "pid": s.pid, "start_ticks": s.start_ticks} for s in job.slots],
        }
        path = os.path.join(job.dir, RECORD)
        tmp = f"{path}.tmp"
        with open(tmp, "w") as f:
            json.dump(rec, f)
        os.replace(tmp, path)

    def _load_records(self) -> list[_Job]:
        root = os.path.join(self._state_dir, "jobs")
        out = []
        for job_id in sorted(os.listdir(root)):
            jdir = os.path.join(root, job_id)
            if not ID_RE.match(job_id) or not os.path.isdir(jdir):
                continue
            attempts = []
            for name in os.listdir(jdir):
                if name.startswith("attempt-") and name[8:].isdigit():
                    attempts.append(int(name[8:]))
            for attempt in sorted(attempts, reverse=True):
                path = os.path.join(render.attempt_dir(self._state_dir, job_id, attempt), RECORD)
                try:
                    with open(path) as f:
                        rec = json.load(f)
                    job = self._job_from_record(rec)
                except (OSError, ValueError, KeyError, TypeError) as e:
                    log.warning("skipping unreadable record %s: %s", path, e)
                    continue
                out.append(job)
                break
        return out

    def _job_from_record(self, rec: dict[str, Any]) -> _Job:
        plan = render.plan_from_json(json.loads(rec["native_spec"]))
        job = _Job(rec["cluster"], rec["job_id"], rec["attempt"], None, plan,
                   NativeSpec(render.MEDIA_TYPE, rec["native_spec"]))
        job.state = JobState[rec["state"]]
        job.reason, job.message, job.exit_code = rec["reason"], rec["message"], rec["exit_code"]
        job.start_time, job.end_time = rec["start_time"], rec["end_time"]
        for s, r in zip(job.slots, rec["slots"], strict=True):
            s.state, s.exit_code, s.message = ReplicaState[r["state"]], r["exit_code"], r["message"]
            s.pid, s.start_ticks = r["pid"], r["start_ticks"]
        if not job.state.is_terminal():
            for s in job.slots:
                if s.pid and s.start_ticks and (st := procfs.read_stat(s.pid)) is not None \
                        and st.start_ticks == s.start_ticks and st.pgrp == s.pid:
                    _signal_session(s.pid, signal.SIGKILL)
                if not s.state.is_terminal():
                    s.state, s.message = ReplicaState.FAILED, "lost when the driver restarted"
            job.state, job.reason = JobState.FAILED, states.REASON_DRIVER_RESTARTED
            job.message = "the driver restarted while the job ran; its processes were stopped"
            job.end_time = time.time()
            self._persist(job)
        job.started.set()
        job.done.set()
        job.logs_done.set()
        job.open_pipes = 0
        return job


def _batches(entries: list[LogEntry]) -> list[list[LogEntry]]:
    out: list[list[LogEntry]] = []
    cur: list[LogEntry] = []
    size = 0
    for e in entries:
        n = len(e.text) + 64
        if cur and (len(cur) >= BATCH_ENTRIES or size + n > BATCH_BYTES):
            out.append(cur)
            cur, size = [], 0
        cur.append(e)
        size += n
    if cur:
        out.append(cur)
    return out
