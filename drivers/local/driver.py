"""``LocalDriver``: jobs as process groups on the driver's host, run by supervisors that outlive the driver.

Each job attempt runs under a supervisor of its own (``supervisor.py``,
``python -m drivers.local.supervisor``), started detached: a session of its
own, no pipe to the driver. The supervisor starts the processes (one per
slot, see ``drivers.common.planner``; exec form, a session each), writes their
log files, applies the success rule, the time limit and stops, and records
every change in the attempt's ``status.json`` (``machine.JobMachine``). So a
driver that is killed, restarted or stopped (SIGTERM) leaves its jobs
running; it never stops them on its way out.

The driver learns of changes by reading the status file of each job that
has not ended (a cheap ``stat`` every ``POLL_SECONDS``) and publishes them
at once to the watchers (``ObservationHub``). A launch returns once the
supervisor has started every process. On start the driver reloads the newest
attempt of every job from its files: jobs that ended keep their outcome
(also those that ended while it was down: the supervisor wrote it), jobs
still running are re-adopted (same pids, their logs go on), and a job whose
supervisor is gone before the end (``supervisor.lock`` free: killed, or the
host rebooted) has what is left of its processes killed (after checking
each pid's start time, so a reused pid is never hit) and is reported FAILED,
reason ``SupervisorLost``. A driver restart alone never fails a job.

Jobs start from the driver's environment with the directory of the
driver's own Python first on PATH (``job_path``): ``python3`` in a job is
the interpreter dlsched runs on.

Run modes: all five, planned by ``drivers.common.planner`` with every
replica on this host (``127.0.0.1``, node rank 0). At launch the driver picks
free ports on the host (one ``MASTER_PORT`` per MULTI_PROCESS / MASTER_WORKER
job, one task port per ps / worker / chief replica of a PS_WORKER job) and,
for replicas asking for GPUs, distinct GPU indices from ``nvidia-smi`` that no
running job holds (``CUDA_VISIBLE_DEVICES``; too few is FAILED_PRECONDITION
``GPUS_UNAVAILABLE``). MPI runs the launcher under the ``mpirun`` found on
the jobs' PATH, when it is Open MPI's, with ``--noprefix --oversubscribe
--bind-to none`` (plus ``--allow-run-as-root`` as root) and the hostfile in the attempt directory;
its workers are placeholders: nothing is started for them (mpirun starts
every rank on this host), they report RUNNING while the launcher runs and
end with it. Without ``mpirun`` an MPI launch (or render) is
FAILED_PRECONDITION ``MPI_NOT_AVAILABLE`` and ``supported_run_modes`` omits
MPI.

Bounded memory: once JobManager has recorded a job's end (``ForgetJobs``)
and its supervisor is gone, the driver writes ``recorded.json`` (the usage
peaks) in the attempt directory and drops the job from memory; a restarted
driver does not load it again. Logs, usage, observations, a repeated launch
and cleanup of a forgotten job are answered from its files, read when asked.

Success rule, failures, stops, time limit: ``machine.py``. ``terminate``:
STOPPING, SIGTERM to every process group, SIGKILL after the grace period,
then STOPPED. The supervisor does that; one that has not ended the job
``STOP_BACKSTOP_SECONDS`` after the grace (SIGSTOPped, hung) is killed by
the driver with the job's processes, and the job is STOPPED. Logs: ``logs.py`` (tails read the files the supervisor
writes). Capacity and usage: ``usage.py``. Files: ``attempt.py``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from dlsched import spec_rules
from dlsched.errors import Internal
from dlsched.kit.parse import decimal
from drivers.common.base import (
    ClusterConfig,
    ClusterInfo,
    JobNotFound,
    JobObservation,
    JobRef,
    JobSpec,
    JobUsage,
    LaunchResult,
    LogEntry,
    LogQuery,
    LogStream,
    RunMode,
)
from drivers.common.convert import ID_RE
from drivers.common.launches import Known
from drivers.common.planner import ALL_RUN_MODES, DEFAULT_MASTER_PORT, TORCH_MODES, assign_gpus
from drivers.common.ports import free_ports
from drivers.common.skeleton import BackendDriver, render_off_loop
from drivers.local import attempt, logs, render, states, usage
from drivers.local.machine import JobMachine
from drivers.local.tracked import RECORD_VERSION, TrackedJob

log = logging.getLogger("dlsched.driver.local")

#: how often the status files of jobs that have not ended are looked at
POLL_SECONDS = 0.1
#: how often a re-adopted supervisor's lock is checked (a child's exit is seen at once)
LIVENESS_SECONDS = 0.5
#: how long a launch waits for its supervisor to start every process
SPAWN_WAIT_SECONDS = 30.0
#: how long after a stop's grace the supervisor has to end the job (it kills at the grace);
#: past it (the supervisor stopped, hung), the driver kills the processes and the supervisor
STOP_BACKSTOP_SECONDS = 10.0


def job_path(path: str) -> str:
    """The PATH local jobs get: the driver's, with its own Python's directory first.

    So ``python3`` in a job is the interpreter dlsched runs on (under ``dlsched up`` from a venv: the
    venv's, with torch and mpi4py), whether or not the shell that started the driver activated it.
    """
    bindir = os.path.dirname(sys.executable) if sys.executable else ""
    if not bindir or path.split(os.pathsep)[:1] == [bindir]:
        return path
    return os.pathsep.join([bindir, path]) if path else bindir


def open_mpi(path: str) -> str | None:
    """The ``mpirun`` on ``path`` when it is Open MPI's (the planner's ``-x`` flags are), else None."""
    found = shutil.which("mpirun", path=path)
    if found is None:
        return None
    try:
        r = subprocess.run([found, "--version"], capture_output=True, text=True, timeout=30,
                           stdin=subprocess.DEVNULL, env={"PATH": path})
    except (OSError, subprocess.SubprocessError) as e:
        log.warning("MPI off: %s --version failed: %s", found, e)
        return None
    if "Open MPI" not in r.stdout + r.stderr:
        log.warning("MPI off: %s is not Open MPI's mpirun: %s", found, (r.stdout + r.stderr).strip()[:200])
        return None
    return found


def _default_state_dir() -> str:
    base = os.environ.get("XDG_STATE_HOME") or os.path.expanduser("~/.local/state")
    return os.path.join(base, "dlsched", "local")


@dataclass(frozen=True)
class LocalConfig:
    """The local driver's flags."""

    state_dir: str = field(default_factory=_default_state_dir,
                           metadata={"help": "where job records and logs live"})
    grace_seconds: float = field(default=10.0, metadata={"min": 0,
        "help": "SIGTERM-to-SIGKILL grace when a request names none"})


@dataclass
class _Cluster:
    """A cluster name the host serves (the local backend needs no address or credentials)."""

    name: str
    options: Mapping[str, str]


class LocalDriver(BackendDriver[_Cluster, render.LocalRequest]):
    name = "local"
    supports_logs = True
    supports_usage = True

    def __init__(self, config: LocalConfig, *, base_env: Mapping[str, str] | None = None) -> None:
        super().__init__()
        self._state_dir = os.path.abspath(config.state_dir)
        self._grace = config.grace_seconds
        # The driver's own settings (DLSCHED_TOKEN_FILE, DLSCHED_TLS_KEY_FILE, a history DSN
        # with its password ...) are no job's: DLSCHED_* names are the planner's alone.
        self._base_env = {k: v for k, v in (os.environ if base_env is None else base_env).items()
                          if not k.upper().startswith(spec_rules.RESERVED_ENV_PREFIX)}
        self._host = socket.gethostname()
        self._jobs: dict[str, TrackedJob] = {}
        self._gpus = usage.Gpus()
        self._poller: asyncio.Task[None] | None = None
        self._base_env["PATH"] = job_path(self._base_env.get("PATH", os.defpath))
        self._mpirun = open_mpi(self._base_env["PATH"])
        # --noprefix: an absolute mpirun path means --prefix to Open MPI, which puts /usr/bin first on the
        # ranks' PATH (python3 would be the system's, not the one the job's PATH names)
        self._mpirun_args = ["--noprefix", "--oversubscribe", "--bind-to", "none"]
        if os.geteuid() == 0:
            self._mpirun_args.insert(0, "--allow-run-as-root")

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        os.makedirs(os.path.join(self._state_dir, "jobs"), exist_ok=True)
        for job in self._load():
            self._jobs[job.job_id] = job
            self._refresh(job)
        running = sum(1 for j in self._jobs.values() if not j.machine.state.is_terminal())
        log.info("local driver state in %s; %d job(s) reloaded, %d running", self._state_dir,
                 len(self._jobs), running)
        self._poller = asyncio.ensure_future(self._poll())

    async def close(self) -> None:
        """Stops serving; the jobs run on under their supervisors (a restarted driver re-adopts them)."""
        await super().close()
        if self._poller is not None:
            self._poller.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._poller

    # ------------------------------------------------------------------ hooks: clusters

    async def _connect(self, config: ClusterConfig, old: _Cluster | None) -> _Cluster:
        return _Cluster(config.name, dict(config.options))

    def _modes(self, c: _Cluster) -> tuple[RunMode, ...]:
        return self._run_modes()

    async def _info(self, c: _Cluster) -> ClusterInfo:
        running = [j.request for j in self._jobs.values() if not j.machine.state.is_terminal()]
        return usage.cluster_info(await self._gpus.get(), running, self._run_modes())

    # ------------------------------------------------------------------ hooks: render / launch

    def _run_modes(self) -> tuple[RunMode, ...]:
        return tuple(m for m in ALL_RUN_MODES if m is not RunMode.MPI or self._mpirun is not None)

    async def _prepare(self, c: _Cluster, job_id: str, spec: JobSpec, attempt_no: int,
                       uid: str) -> render.LocalRequest:
        return await render_off_loop(spec, render.render_job, job_id, spec, attempt=attempt_no,
                                     state_dir=self._state_dir, mpirun=self._mpirun,
                                     mpirun_args=self._mpirun_args, uid=uid)

    async def _launch_plan(self, request: render.LocalRequest) -> render.LocalPlan:
        """The plan with free ports on this host and GPUs no running job holds."""
        spec = request.spec
        keys = [(g.role, r) for g in spec.replica_groups for r in range(g.replicas)
                if spec.run_mode is RunMode.PS_WORKER and g.role != "evaluator"]
        free = free_ports(len(keys) + 1, render.LOCAL_HOST)
        master_port = free[0] if spec.run_mode in TORCH_MODES else DEFAULT_MASTER_PORT
        return request.plan(master_port=master_port, ports=dict(zip(keys, free[1:], strict=True)),
                            gpus=await self._assign_gpus(spec))

    async def _assign_gpus(self, spec: JobSpec) -> dict[tuple[str, int], tuple[str, ...]]:
        requests = [(g.role, r, g.resources.gpus) for g in spec.replica_groups for r in range(g.replicas)]
        if not any(n > 0 for *_, n in requests):
            return {}
        inventory = [str(i) for i in range(len(await self._gpus.get()))]
        held: set[str] = set()
        for j in self._jobs.values():
            if not j.machine.state.is_terminal():
                held |= j.gpus_held()
        return assign_gpus(inventory, sorted(held), requests)

    def _known(self, c: _Cluster, job_id: str, rendered: render.LocalRequest) -> Known | None:
        # keyed by id alone: one host under every cluster name
        prev = self._jobs.get(job_id) or self._forgotten(job_id)
        if prev is None:
            return None
        return Known(prev.cluster, prev.attempt, not prev.machine.state.is_terminal(),
                     lambda: LaunchResult(prev.backend_job_id, prev.native, self._observation(prev)), prev.uid)

    async def _submit(self, c: _Cluster, name: str, job_id: str, spec: JobSpec, attempt_no: int,
                      rendered: render.LocalRequest) -> LaunchResult:
        plan = await self._launch_plan(rendered)
        job = TrackedJob(self._state_dir, name, job_id, attempt_no, plan, usage.requested(spec), rendered.uid)
        self._jobs[job_id] = job  # before any await: a stop or an observation during the spawn finds it
        try:
            self._write_files(job)
            job.proc = attempt.start_supervisor(job.dir, grace=self._grace, env=self._base_env)
        except OSError as e:
            del self._jobs[job_id]
            raise Internal(f"cannot start the job: {e.strerror or e}") from e
        deadline = time.monotonic() + SPAWN_WAIT_SECONDS
        while not (job.machine.spawned or job.final) and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
            self._refresh(job)
        log.info("job %s attempt %d launched as %s: %d process(es), %s", job_id, attempt_no,
                 job.backend_job_id, len(plan.processes), job.machine.state.name)
        return LaunchResult(job.backend_job_id, job.native, self._observation(job))

    def _write_files(self, job: TrackedJob) -> None:
        os.makedirs(job.dir, exist_ok=True)
        for fname, content in job.plan.files.items():
            with open(os.path.join(job.dir, fname), "w") as f:
                f.write(content)
        for p in job.plan.processes:
            for stream in (LogStream.STDOUT, LogStream.STDERR):
                open(p.log_path(stream), "ab").close()
        attempt.write_json(os.path.join(job.dir, attempt.RECORD), job.record())

    # ------------------------------------------------------------------ hooks: observations

    def _observation(self, job: TrackedJob) -> JobObservation:
        return job.machine.observation(job.job_id, job.backend_job_id, job.attempt, self._host, job.uid)

    def _find(self, cluster: str, ref: JobRef) -> TrackedJob | None:
        job = self._jobs.get(ref.job_id) or self._forgotten(ref.job_id)
        if job is None or job.cluster != cluster:
            return None
        if ref.backend_job_id and ref.backend_job_id != job.backend_job_id:
            return None
        return job

    def _snapshot(self, c: _Cluster) -> Iterable[JobObservation]:
        return [self._observation(j) for j in self._jobs.values() if j.cluster == c.name]

    async def _observe(self, c: _Cluster, refs: Sequence[JobRef]) -> list[JobObservation | None]:
        return [self._lookup(c, ref) for ref in refs]

    def _lookup(self, c: _Cluster, ref: JobRef) -> JobObservation | None:
        job = self._find(c.name, ref)
        return self._observation(job) if job is not None else None

    def _publish(self, job: TrackedJob) -> None:
        obs = self._observation(job)
        h = hash(obs)  # an equal hash of a changed observation (2^-64) would skip one publish
        if h != job.published:
            job.published = h
            self.hub.publish(job.cluster, obs)

    # ------------------------------------------------------------------ hooks: stop / cleanup

    async def _terminate(self, c: _Cluster, name: str, ref: JobRef,
                         grace_seconds: float | None) -> JobObservation | None:
        job = self._find(name, ref)
        if job is None:
            return None
        grace = self._grace if grace_seconds is None else grace_seconds
        if job.machine.request_stop(grace):  # what the supervisor will do, answered now
            try:
                attempt.ask_stop(job.dir, grace)
            except OSError as e:
                raise Internal(f"cannot ask the job to stop: {e.strerror or e}") from e
            job.pending_stop = grace
            by = time.monotonic() + grace + STOP_BACKSTOP_SECONDS
            job.stop_by = by if job.stop_by is None else min(job.stop_by, by)
            attempt.wake_supervisor(job.supervisor)
            self._publish(job)
        return self._observation(job)

    async def _cleanup(self, c: _Cluster, name: str, ref: JobRef) -> None:
        job = self._find(name, ref)
        if job is None:
            return
        if not job.machine.state.is_terminal():
            await self._terminate(c, name, ref, None)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(job.finished.wait(), self._grace + 30.0)
        if self._jobs.get(job.job_id) is job:
            del self._jobs[job.job_id]
        await asyncio.to_thread(shutil.rmtree, render.job_dir(self._state_dir, job.job_id), True)

    # ------------------------------------------------------------------ hooks: forget

    def _forget(self, c: _Cluster, ref: JobRef) -> bool:
        job = self._jobs.get(ref.job_id)
        if job is None or job.cluster != c.name or (ref.backend_job_id and ref.backend_job_id != job.backend_job_id):
            return False
        if not job.final:  # ended, but its supervisor may still write: dropped once it is gone
            job.forget_when_final = True
            return False
        self._drop(job)
        return True

    def _drop(self, job: TrackedJob) -> None:
        """Mark the attempt recorded on disk (with the usage peaks) and let go of it."""
        try:
            attempt.write_json(os.path.join(job.dir, attempt.RECORDED),
                               {"peaks": [[p.cpu_seconds, p.peak_bytes] for p in job.peaks]})
        except OSError as e:  # kept in memory: a later ForgetJobs tries again
            log.warning("cannot mark job %s recorded: %s", job.job_id, e)
            return
        if self._jobs.get(job.job_id) is job:
            del self._jobs[job.job_id]

    def _forgotten(self, job_id: str) -> TrackedJob | None:
        """A forgotten job's newest attempt, read from its files (not kept in memory)."""
        jdir = render.job_dir(self._state_dir, job_id)
        if not ID_RE.match(job_id) or not os.path.isdir(jdir):
            return None
        attempts = [int(n[8:]) for n in os.listdir(jdir) if n.startswith("attempt-") and decimal(n[8:])]
        if not attempts:
            return None
        adir = render.attempt_dir(self._state_dir, job_id, max(attempts))
        marker = attempt.read_json(os.path.join(adir, attempt.RECORDED))
        if marker is None:
            return None  # not forgotten (in memory, or being removed)
        try:
            job = self._job_from_record(attempt.read_json(os.path.join(adir, attempt.RECORD)), job_id, max(attempts))
            doc = attempt.read_json(os.path.join(adir, attempt.STATUS), attempt.STATUS_LIMIT)
            if doc is not None:
                job.machine = JobMachine.from_json(job.plan, doc)
            for peak, (cpu, mem) in zip(job.peaks, marker.get("peaks", []), strict=False):
                peak.cpu_seconds, peak.peak_bytes = float(cpu), int(mem)
        except Exception as e:  # the job's own files (it may write over them): never the driver's end
            log.warning("unreadable files of forgotten job %s: %s", job_id, e)
            return None
        job.machine.logs_done = True
        job.end()
        job.published = hash(self._observation(job))
        return job

    # ------------------------------------------------------------------ hooks: logs / usage

    def _tail(self, c: _Cluster, ref: JobRef, query: LogQuery) -> AsyncIterator[list[LogEntry]]:
        job = self._find(c.name, ref)
        if job is None:
            raise JobNotFound(ref.job_id)
        files = [logs.LogFile(p.role, p.index, stream, p.log_path(stream))
                 for p in job.plan.processes for stream in (LogStream.STDOUT, LogStream.STDERR)]
        return logs.tail(files, query, ended=lambda: job.logs_ended,
                         gone=lambda: self._jobs.get(job.job_id) is not job)

    async def _usage(self, c: _Cluster, ref: JobRef) -> JobUsage:
        job = self._find(c.name, ref)
        if job is None:
            raise JobNotFound(ref.job_id)
        return await usage.measure(job.machine.procs, job.peaks)

    # ------------------------------------------------------------------ following the supervisors

    async def _poll(self) -> None:
        while True:
            await asyncio.sleep(POLL_SECONDS)
            for job in list(self._jobs.values()):
                try:
                    self._refresh(job)
                except Exception:  # one broken job must not stop the others' updates
                    log.exception("cannot follow job %s", job.job_id)

    def _refresh(self, job: TrackedJob) -> None:
        """Read the job's status if it changed; publish; notice a supervisor gone."""
        if job.final:
            return
        self._read_status(job)
        if job.stop_by is not None and time.monotonic() > job.stop_by and not job.machine.state.is_terminal():
            job.stop_by = None
            self._kill_unanswering(job)
        if not self._supervisor_gone(job):
            return
        self._read_status(job)  # its last words, written before it exited
        if not job.machine.ended:
            self._lost(job)
        job.end()
        self._publish(job)
        if job.forget_when_final:
            self._drop(job)

    def _read_status(self, job: TrackedJob) -> None:
        path = os.path.join(job.dir, attempt.STATUS)
        sig = attempt.signature(path)
        if sig is None or sig == job.signature:
            return
        doc = attempt.read_json(path, attempt.STATUS_LIMIT)
        try:
            if doc is None:
                raise ValueError("missing, too large, not JSON or nested too deep")
            machine = JobMachine.from_json(job.plan, doc)
        except Exception as e:  # the job may write over it: read again once it changes, not every poll
            job.signature = sig
            log.warning("unreadable status of job %s: %s", job.job_id, e)
            return
        job.signature, job.machine = sig, machine
        job.supervisor = attempt.supervisor_of(doc)
        if job.pending_stop is not None:
            if machine.stop is not None or machine.succeeding or machine.state.is_terminal():
                job.pending_stop = None  # the supervisor has it
            else:
                machine.request_stop(job.pending_stop)
        self._publish(job)

    def _supervisor_gone(self, job: TrackedJob) -> bool:
        if job.proc is not None:
            if job.proc.poll() is None:
                return False
            job.proc = None
            return not attempt.supervisor_alive(job.dir)
        now = time.monotonic()
        if now < job.next_liveness:
            return False
        job.next_liveness = now + LIVENESS_SECONDS
        return not attempt.supervisor_alive(job.dir)

    def _kill_unanswering(self, job: TrackedJob) -> None:
        """A stop's grace is long past and the job has not ended (its supervisor is stopped or
        hung): kill its processes and the supervisor; the supervisor's end is then seen as lost."""
        log.warning("job %s: its supervisor did not end the job %.0fs after the stop's grace; "
                    "killing its processes", job.job_id, STOP_BACKSTOP_SECONDS)
        attempt.kill_leftovers([*((p.pid, p.start_ticks) for p in job.machine.procs),
                                *attempt.started_pids(job.dir, len(job.machine.procs))])
        attempt.kill_supervisor(job.supervisor)
        if job.proc is not None:
            with contextlib.suppress(OSError):
                job.proc.kill()
        elif job.supervisor is None:  # not known yet (no status written): look again in a while
            job.stop_by = time.monotonic() + STOP_BACKSTOP_SECONDS
        job.next_liveness = 0.0  # look at once

    def _lost(self, job: TrackedJob) -> None:
        """The supervisor died before the job ended: kill what is left, report it honestly."""
        m = job.machine
        if m.state.is_terminal():
            m.logs_done = True  # no one writes its logs anymore
        else:
            attempt.kill_leftovers([*((p.pid, p.start_ticks) for p in m.procs if not p.state.is_terminal()),
                                    *attempt.started_pids(job.dir, len(m.procs))])  # (killed mid-spawn)
            m.lost(states.REASON_SUPERVISOR_LOST,
                   "the job's supervisor ended before the job (killed, or the host restarted); "
                   "what was left of its processes was stopped", time.time())
            log.warning("job %s: supervisor lost; failed", job.job_id)
        with contextlib.suppress(OSError):
            attempt.write_json(os.path.join(job.dir, attempt.STATUS), {**m.to_json(), "supervisor": None})

    # ------------------------------------------------------------------ records

    def _load(self) -> list[TrackedJob]:
        root = os.path.join(self._state_dir, "jobs")
        out = []
        for job_id in sorted(os.listdir(root)):
            jdir = os.path.join(root, job_id)
            if not ID_RE.match(job_id) or not os.path.isdir(jdir):
                continue
            attempts = sorted((int(n[8:]) for n in os.listdir(jdir) if n.startswith("attempt-") and decimal(n[8:])),
                              reverse=True)
            if attempts and os.path.exists(os.path.join(
                    render.attempt_dir(self._state_dir, job_id, attempts[0]), attempt.RECORDED)):
                continue  # JobManager recorded its end: read from its files when asked
            for n in attempts:
                path = os.path.join(render.attempt_dir(self._state_dir, job_id, n), attempt.RECORD)
                try:
                    out.append(self._job_from_record(attempt.read_json(path), job_id, n))
                    break
                except Exception as e:  # one job's files (it may write over them) never stop the others
                    log.warning("skipping unreadable record %s: %s", path, e)
        return out

    def _job_from_record(self, rec: dict[str, Any] | None, job_id: str, attempt_no: int) -> TrackedJob:
        """The job the record of ``job_id``'s attempt ``attempt_no`` launched; raises for one
        unreadable, or naming another job or attempt (a job can write over its record)."""
        if rec is None:
            raise ValueError("missing, too large, not JSON or nested too deep")
        if rec.get("job_id") != job_id or rec.get("attempt") != attempt_no:
            raise ValueError(f"the record names job {str(rec.get('job_id'))[:80]!r} attempt "
                             f"{str(rec.get('attempt'))[:20]}, not its directory's")
        plan = render.plan_from_json(json.loads(rec["native_spec"]))
        cpu, gpu = rec.get("request") or (0.0, 0)
        job = TrackedJob(self._state_dir, rec["cluster"], rec["job_id"], int(rec["attempt"]), plan, (float(cpu), int(gpu)),
                         str(rec.get("uid", "")))
        if rec.get("version", 1) < RECORD_VERSION:
            _legacy(job, rec)
        return job


def _legacy(job: TrackedJob, rec: Mapping[str, Any]) -> None:
    """A record from before supervisors: its outcome, or (still running) kill it as that driver did."""
    doc = {"state": rec["state"], "reason": rec["reason"], "message": rec["message"],
           "exit_code": rec["exit_code"], "start_time": rec["start_time"], "end_time": rec["end_time"],
           "spawned": True, "signalled": False, "succeeding": False, "logs_done": True,
           "processes": [{**s, "start_ticks": s.get("start_ticks") or 0} for s in rec["slots"]]}
    job.machine = JobMachine.from_json(job.plan, doc)
    if not job.machine.state.is_terminal():
        attempt.kill_leftovers((p.pid, p.start_ticks) for p in job.machine.procs)
        job.machine.lost(states.REASON_DRIVER_RESTARTED,
                         "the driver restarted while the job ran (started before job supervisors)", time.time())
    job.end()
