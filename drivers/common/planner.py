"""The run-mode planner: one environment contract for every driver.

``plan_job(job_id, spec, placements, ...)`` is a pure function (no I/O, no
clock, no randomness). From the job spec and the places the backend gives
the replicas it returns a ``JobPlan``: every process to start (argv,
environment, host) and the job's ``SuccessRule``. Drivers supply placement
(hosts or late-resolving names, ports, GPU indices) and launch what the plan
says; they never build rendezvous variables themselves. The contract is
written down in ``docs/ENVIRONMENT.md``; in short:

Every process::

    DLSCHED_JOB_ID         the job id
    DLSCHED_JOB_NAME       "jobs/{job_id}"
    DLSCHED_ROLE           its group's role
    DLSCHED_REPLICA_INDEX  its replica's index within the group
    DLSCHED_NUM_REPLICAS   replicas in its group
    CUDA_VISIBLE_DEVICES   the replica's GPUs, when the placement names them

MULTI_PROCESS and MASTER_WORKER (torch.distributed ``env://``):
``MASTER_ADDR`` (rank 0's host), ``MASTER_PORT``, ``WORLD_SIZE``, ``RANK``,
``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``NODE_RANK``. Processes are laid out
one per slot (replicas x processes_per_replica), master group first, then
replica order, then process order; the slot's position is its rank, so the
master holds rank 0.

PS_WORKER: ``TF_CONFIG``, the JSON TensorFlow reads::

    {"cluster": {"chief": [...], "ps": [...], "worker": [...]},
     "task": {"type": "worker", "index": 1}}

with each task's ``host:port`` from its placement. The evaluator, when
there is one, is not part of ``cluster`` (as in TensorFlow).

MPI: the launcher runs ``mpirun -np <worker slots> --hostfile <path>
[driver flags] -x NAME ... /bin/sh -c <MPI_RANK_SCRIPT>`` with
``DLSCHED_MPI_HOSTFILE=<path>`` and ``DLSCHED_MPI_ARGV=<shlex.join of the
launcher command>``. mpirun never sees a user token (a user ``:`` would start
a second program, a ``-np 1`` or ``--version`` would be mpirun's): every rank
runs the same fixed POSIX sh script, which turns ``DLSCHED_MPI_ARGV`` back
into the argv and execs it, verbatim. ``-x`` exports the launcher's contract
variables, ``DLSCHED_MPI_ARGV`` and the group's env names to every rank
(ranks started through ssh or a remote daemon get nothing else); the flags
are Open MPI's. ``JobPlan.files["hostfile"]`` is the hostfile's content
(``host slots=N`` per worker host, N = processes on that host), which the
driver writes to the path it passed. Worker processes are *hosts*:
``ProcessLaunch.placeholder`` is true and the driver only makes the host
reachable for mpirun (on the local backend: nothing is started); the job's
state is the launcher's.

Late-resolving names (a Kubernetes headless service entry, a Slurm node
name) are used verbatim as hosts; nothing here resolves them.
"""

from __future__ import annotations

import json
import os
import shlex
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from dlsched import spec_rules
from dlsched.errors import FailedPrecondition, InvalidArgument
from drivers.common.base import JobSpec, ReplicaGroup, RunMode

ALL_RUN_MODES = (RunMode.SINGLE_PROCESS, RunMode.MULTI_PROCESS, RunMode.PS_WORKER,
                 RunMode.MASTER_WORKER, RunMode.MPI)
DEFAULT_MASTER_PORT = 29500
DEFAULT_TASK_PORT = 2222  # TensorFlow's customary gRPC port, for placements that name none
MPIRUN = "mpirun"
HOSTFILE = "hostfile"
#: MPI: the launcher command, ``shlex.join``-ed, as every rank receives it.
MPI_ARGV_ENV = "DLSCHED_MPI_ARGV"
#: MPI: the fixed program of every rank (POSIX sh, no Python needed on the hosts): the argv back from
#: ``DLSCHED_MPI_ARGV``, exec'd; a program name starting with ``-`` is run without ``exec`` (bash's exec
#: would take it as an option); nothing in the environment, no ranks' work: exit 127, never a silent 0.
MPI_RANK_SCRIPT = ('eval "set -- $DLSCHED_MPI_ARGV" || exit 127; '
                   '[ "$#" -gt 0 ] || { echo "dlsched: DLSCHED_MPI_ARGV is not set in this rank" >&2; exit 127; }; '
                   'case $1 in -*) "$@"; exit;; esac; exec "$@"')
MPI_RANK_PROGRAM = ("/bin/sh", "-c", MPI_RANK_SCRIPT)
#: Linux's limit on one environment string (MAX_ARG_STRLEN), which ``DLSCHED_MPI_ARGV=...`` must fit in.
MPI_ARGV_MAX_BYTES = spec_rules.ARGV_MAX_BYTES
assert MPI_ARGV_MAX_BYTES == 131072 - len(MPI_ARGV_ENV) - 2

#: Roles each mode accepts, in rank / layout order; required ones; one-replica ones (``dlsched.spec_rules``).
ROLES: Mapping[RunMode, tuple[str, ...]] = {RunMode(m): r for m, r in spec_rules.ROLES.items()}
REQUIRED: Mapping[RunMode, tuple[str, ...]] = {RunMode(m): r for m, r in spec_rules.REQUIRED.items()}
SINGLETON: Mapping[RunMode, tuple[str, ...]] = {RunMode(m): r for m, r in spec_rules.SINGLETON.items()}
TORCH_MODES = (RunMode.MULTI_PROCESS, RunMode.MASTER_WORKER)


@dataclass(frozen=True)
class Placement:
    """Where one replica runs, as the backend decided.

    ``host`` is an address or a name that resolves later. ``port`` is the
    replica's own task port (PS_WORKER ``host:port``), a number or a token
    the backend resolves later, like ``host``; 0 means ``DEFAULT_TASK_PORT``.
    ``gpus`` are the device indices the replica was given (empty: the
    backend does not assign GPUs, or none were asked for).
    """

    role: str
    replica_index: int
    host: str
    node_rank: int = 0
    port: int | str = 0
    gpus: tuple[str, ...] = ()


@dataclass(frozen=True)
class ProcessLaunch:
    """One process to start."""

    role: str
    replica_index: int
    process_index: int  # within its replica
    rank: int  # position among all processes of the job
    slot_index: int  # replica_index * processes + process_index: its index within the role
    host: str
    argv: tuple[str, ...]
    env: Mapping[str, str]  # added to the backend's environment; user env last
    working_dir: str
    placeholder: bool = False  # MPI worker: a host for mpirun's ranks, nothing to run


@dataclass(frozen=True)
class SuccessRule:
    """What the job's success means.

    The job succeeds once every process of ``decisive_roles`` exited 0; the
    processes of ``stopped_after_success`` still running then are stopped,
    and that stop is not a failure. Any other process that fails (before the
    job succeeded) fails the job.
    """

    decisive_roles: frozenset[str]
    stopped_after_success: frozenset[str] = frozenset()
    description: str = "every process exited 0"


@dataclass(frozen=True)
class JobPlan:
    processes: tuple[ProcessLaunch, ...]
    success: SuccessRule
    files: Mapping[str, str] = field(default_factory=dict)  # name -> content, e.g. "hostfile"


class MpiNotAvailable(FailedPrecondition):
    """The backend has no ``mpirun``."""

    reason = "MPI_NOT_AVAILABLE"

    def __init__(self, detail: str = "mpirun is not installed on this backend") -> None:
        super().__init__(f"RUN_MODE_MPI needs mpirun: {detail} (Debian: apt-get install openmpi-bin)",
                         metadata={"run_mode": "RUN_MODE_MPI"})


class GpusUnavailable(FailedPrecondition):
    """Not enough free GPUs to give every replica the ones it asks for."""

    reason = "GPUS_UNAVAILABLE"

    def __init__(self, wanted: int, free: int) -> None:
        super().__init__(f"the job asks for {wanted} GPU(s); {free} free",
                         metadata={"wanted": str(wanted), "free": str(free)})


# --------------------------------------------------------------------------- validation


def shell_pwd(cwd: str | None) -> str:
    """``PWD`` for a process started in ``cwd`` (None: this process's): its working directory, as
    a shell sets it. The starter's own would be inherited otherwise; a job cannot set it (a name
    the launch scripts' shell owns)."""
    return os.path.abspath(cwd) if cwd else os.getcwd()


def start_failure(e: OSError, program: str, cwd: str | None) -> tuple[int, str]:
    """A process that could not start: its exit code and stderr line, as a shell says them
    (Slurm's scripts ``cd`` then ``exec``): a working directory that cannot be entered 126, a
    program not found 127, one that cannot be run 126."""
    why = e.strerror or str(e)
    if cwd and e.filename == cwd and program != cwd:  # (the OSError names what failed: chdir's or exec's)
        return 126, f"dlsched: cannot enter the working directory {cwd!r}: {why}"
    return (127 if isinstance(e, FileNotFoundError) else 126), f"dlsched: cannot start {program!r}: {why}"


def groups_in_order(spec: JobSpec) -> list[tuple[int, ReplicaGroup]]:
    """(spec index, group) in the mode's layout order (master first, ...)."""
    order = ROLES.get(spec.run_mode)
    indexed = list(enumerate(spec.replica_groups))
    if order is None:
        return indexed
    return sorted(indexed, key=lambda ig: order.index(ig[1].role) if ig[1].role in order else len(order))


def check_no_images(spec: JobSpec, backend: str) -> None:
    """For a backend that runs processes on its hosts as they are: a group naming a container
    image is refused (run without it, the job would not get the software it named)."""
    for i, g in enumerate(spec.replica_groups):
        if g.image:
            raise InvalidArgument.for_field(f"spec.replica_groups[{i}].image",
                                            f"the {backend} driver runs no container images")


def check_run_mode(spec: JobSpec, field: str = "spec") -> None:
    """The run mode's structural rules (``dlsched.spec_rules``, as JobManager applies them)."""
    vs = spec_rules.check_run_mode(int(spec.run_mode), spec.replica_groups, field)
    if vs:
        raise InvalidArgument("; ".join(f"{v.field}: {v.description}" for v in vs), vs)

# --------------------------------------------------------------------------- GPUs


def assign_gpus(inventory: Sequence[str], in_use: Sequence[str],
                requests: Sequence[tuple[str, int, int]]) -> dict[tuple[str, int], tuple[str, ...]]:
    """Distinct GPU indices per replica: ``requests`` is [(role, replica, gpus)].

    Takes the lowest free indices of ``inventory`` (e.g. ``["0", "1", ...]``
    from nvidia-smi) not in ``in_use``, in request order. Replicas asking for
    none get nothing. Raises ``GpusUnavailable`` when they do not fit.
    """
    busy = set(in_use)
    free = [g for g in inventory if g not in busy]
    wanted = sum(n for *_, n in requests if n > 0)
    if wanted > len(free):
        raise GpusUnavailable(wanted, len(free))
    out: dict[tuple[str, int], tuple[str, ...]] = {}
    pos = 0
    for role, index, n in requests:
        if n > 0:
            out[(role, index)] = tuple(free[pos:pos + n])
            pos += n
    return out


# --------------------------------------------------------------------------- the plan


def success_rule(spec: JobSpec) -> SuccessRule:
    roles = frozenset(g.role for g in spec.replica_groups)
    if spec.run_mode is RunMode.PS_WORKER:
        decisive = frozenset({"chief"}) if "chief" in roles else frozenset({"worker"})
        which = "the chief" if "chief" in decisive else "every worker"
        return SuccessRule(decisive, roles - decisive,
                           f"{which} exited 0; the rest ({', '.join(sorted(roles - decisive))}) stopped")
    if spec.run_mode is RunMode.MPI:
        return SuccessRule(frozenset({"launcher"}), roles - {"launcher"}, "the launcher (mpirun) exited 0")
    return SuccessRule(roles)


def _task_address(p: Placement) -> str:
    return f"{p.host}:{p.port or DEFAULT_TASK_PORT}"


def _mpi_argv(ordered: Sequence[tuple[int, ReplicaGroup]]) -> str:
    """The launcher command as ``DLSCHED_MPI_ARGV`` carries it; INVALID_ARGUMENT when it cannot fit."""
    i, g = next((i, g) for i, g in ordered if g.role == "launcher")
    joined = shlex.join(g.argv)
    if len(joined.encode()) > MPI_ARGV_MAX_BYTES:
        field = f"spec.replica_groups[{i}].args"
        raise InvalidArgument.for_field(field, f"an MPI launcher's command and args, shell-quoted, must fit in "
                                               f"{MPI_ARGV_MAX_BYTES} bytes (they reach the ranks in "
                                               f"{MPI_ARGV_ENV})")
    return joined


def plan_job(job_id: str, spec: JobSpec, placements: Sequence[Placement], *,
             master_port: int | str = DEFAULT_MASTER_PORT, hostfile_path: str = HOSTFILE,
             mpirun: str = MPIRUN, mpirun_args: Sequence[str] = ()) -> JobPlan:
    """Every process of the job in rank order, the success rule and any files.

    ``placements`` has one entry per replica (role, replica index); ``master_port``
    is a number or a token the backend resolves later (``MASTER_PORT``). For MPI,
    ``hostfile_path`` is where the driver will write ``files["hostfile"]``,
    ``mpirun`` the program and ``mpirun_args`` extra flags the backend needs
    (e.g. ``--oversubscribe``).
    """
    check_run_mode(spec)
    mode = spec.run_mode
    where = {(p.role, p.replica_index): p for p in placements}
    ordered = groups_in_order(spec)
    slots: list[tuple[ReplicaGroup, int, int, Placement]] = []
    for _, g in ordered:
        for r in range(g.replicas):
            p = where.get((g.role, r))
            if p is None:
                raise ValueError(f"no placement for {g.role}[{r}]")
            for k in range(g.processes):
                slots.append((g, r, k, p))

    torch = mode in TORCH_MODES
    world = len(slots)
    master_addr = slots[0][3].host if slots else ""
    per_node: dict[int, int] = {}
    for *_, p in slots:
        per_node[p.node_rank] = per_node.get(p.node_rank, 0) + 1

    cluster: dict[str, list[str]] = {}
    if mode is RunMode.PS_WORKER:
        for _, g in ordered:
            if g.role != "evaluator":
                cluster[g.role] = [_task_address(where[(g.role, r)]) for r in range(g.replicas)]

    files: dict[str, str] = {}
    mpi_np = 0
    mpi_argv = ""
    if mode is RunMode.MPI:
        hosts: dict[str, int] = {}
        for g, _, _, p in slots:
            if g.role == "worker":
                hosts[p.host] = hosts.get(p.host, 0) + 1
                mpi_np += 1
        files[HOSTFILE] = "".join(f"{h} slots={n}\n" for h, n in hosts.items())
        mpi_argv = _mpi_argv(ordered)

    seen_on_node: dict[int, int] = {}
    out: list[ProcessLaunch] = []
    for rank, (g, r, k, p) in enumerate(slots):
        env: dict[str, str] = {
            "DLSCHED_JOB_ID": job_id,
            "DLSCHED_JOB_NAME": f"jobs/{job_id}",
            "DLSCHED_ROLE": g.role,
            "DLSCHED_REPLICA_INDEX": str(r),
            "DLSCHED_NUM_REPLICAS": str(g.replicas),
        }
        if p.gpus:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(p.gpus)
        local_rank = seen_on_node.get(p.node_rank, 0)
        seen_on_node[p.node_rank] = local_rank + 1
        argv = g.argv
        placeholder = False
        if torch:
            env.update({
                "MASTER_ADDR": master_addr,
                "MASTER_PORT": str(master_port),
                "WORLD_SIZE": str(world),
                "RANK": str(rank),
                "LOCAL_RANK": str(local_rank),
                "LOCAL_WORLD_SIZE": str(per_node[p.node_rank]),
                "NODE_RANK": str(p.node_rank),
            })
        elif mode is RunMode.PS_WORKER:
            env["TF_CONFIG"] = json.dumps({"cluster": cluster, "task": {"type": g.role, "index": r}},
                                          sort_keys=True, separators=(",", ":"))
        elif mode is RunMode.MPI:
            env["DLSCHED_MPI_HOSTFILE"] = hostfile_path
            if g.role == "launcher":
                env[MPI_ARGV_ENV] = mpi_argv
                exported = [k for k in env if k != "CUDA_VISIBLE_DEVICES"] + sorted(g.env)  # the host's own GPUs
                argv = (mpirun, "-np", str(mpi_np), "--hostfile", hostfile_path, *mpirun_args,
                        *(t for k in dict.fromkeys(exported) for t in ("-x", k)), *MPI_RANK_PROGRAM)
            else:
                placeholder = True
        env.update(g.env)
        out.append(ProcessLaunch(
            role=g.role, replica_index=r, process_index=k, rank=rank,
            slot_index=r * g.processes + k, host=p.host, argv=argv, env=env,
            working_dir=g.working_dir, placeholder=placeholder,
        ))
    return JobPlan(processes=tuple(out), success=success_rule(spec), files=files)


def plan_processes(job_id: str, spec: JobSpec, placements: Sequence[Placement], *,
                   master_port: int = DEFAULT_MASTER_PORT) -> list[ProcessLaunch]:
    """Just the processes of ``plan_job`` (kept for callers that need no more)."""
    return list(plan_job(job_id, spec, placements, master_port=master_port).processes)
