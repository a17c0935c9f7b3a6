"""Translate a job into an sbatch script: a pure function of (job, cluster options).

``render_job(job_id, spec, attempt, options)`` returns the ``SlurmScript``
``SlurmDriver`` sends to ``sbatch --parsable`` on stdin (and that
``RenderJob`` returns). No I/O, no clock; golden-file tested. It is three
steps: ``check`` (every value Slurm cannot take, as field violations of one
``InvalidArgument``) → ``place`` (replicas onto nodes, the planner's plan,
the per-node allocation: a ``Layout``) → ``emit`` (the script text). The
job's metadata codec lives here too, beside its encoder: ``job_name``,
``job_comment`` and ``parse_comment`` (how the poller and a restarted
driver recognise an attempt), and the file layout (``state_dir_of``,
``attempt_dir``, ``batch_output``).

Layout. A replica runs on one node; the job asks for
``nodes = min(replicas, max_nodes)`` nodes (cluster option ``max_nodes``,
default unbounded) and replica ``q`` of the job (in the planner's layout
order) runs on node ``q * nodes // replicas`` of the allocation. The node
names are read at run time from the allocation (``scontrol show hostnames
"$SLURM_JOB_NODELIST"``; node 0 is its first line) and handed to the
planner as late-resolving hosts, so ``MASTER_ADDR``, ``TF_CONFIG`` and the
MPI hostfile name the allocation's real nodes.

Ports. Jobs share nodes (Slurm may run several on one), so no rendezvous
port is fixed: ``MASTER_PORT`` and each PS-Worker task's port (chief, ps,
worker; the evaluator listens on none) are late-resolving tokens too
(``@DLSCHED_PORT_k@``), picked by the batch script before any step starts
(``shell.PORT_PICKER``): from the job's block of the range ``[LO, HI]``
(cluster option ``port_range``, ``LO-HI``, validated by ``port_range_of``;
default ``PORT_LO``-``PORT_LO + PORT_SPAN - 1``, below Linux's ephemeral
range, so no outgoing connection holds one), starting at ``LO +
(SLURM_JOB_ID * PORT_STRIDE) % (HI - LO + 1)``, each the next port that nothing listens on at the node whose process
will listen (node 0, where the batch script runs and the master is: a
connect to 127.0.0.1; another node: a connect to its name). Every step's
environment gets them, as it gets the node names.

Allocation (``#SBATCH``): ``--nodes``, ``--ntasks-per-node`` (the most
processes one node runs; for MPI the worker ranks, the launcher being the
batch script itself), ``--cpus-per-task`` (the largest
``ceil(cpu / processes)`` of any group, at least 1), ``--mem`` (the most
memory one node's replicas ask for, MiB, rounded up), ``--gres=gpu[:type]:N``
(the most GPUs one node's replicas ask for; every group asking for GPUs must
name the same type), ``--partition`` (``spec.queue``, else cluster option
``partition``), ``--time`` (the time limit, rounded up to whole seconds; Slurm
itself keeps it in whole minutes, rounded up, and enforces it on its own timer),
``--job-name=dlsched-<job_id>`` and ``--comment=dlsched-<job_id>.<attempt>.<uid>``
(how a retried launch finds an earlier submission; ``<uid>``, the job's uid
without its dashes, tells a job id used again after a delete from the deleted
job, which squeue may still list; a launch without a uid leaves ``.<uid>`` out; a launch
with one adopts only its own comment, never the uid-less one, which any job of the Slurm
user could put on a held submission), and the batch script's
own output (and Slurm's notes on the job: cancelled, time limit) in
``<job_id>.<attempt>.batch.stdout|stderr`` directly in the state dir. That
directory exists before any job of the cluster (the driver creates it once),
the attempt directory does not: the script makes it first thing, so a submit
is ``sbatch`` alone, with no ``mkdir`` process in front of it.

Steps. Every process of the plan is one ``srun --nodes=1 --ntasks=1
--relative=<node> --overlap`` step (``--overlap``: steps share the job's
CPUs, memory and GPUs, so concurrent steps never wait on each other; a
replica's processes see all of its node's GPUs and pick one by
``LOCAL_RANK``), started in a subshell that exports the planner's variables
and the user's ``env`` and redirects the step's output to
``<role>-<index>.stdout`` / ``.stderr`` in the attempt directory. PS_WORKER
runs all its tasks in one ``srun --multi-prog`` step (one step launch for
the job; ``steps.multi_prog``): each task runs a wrapper the script writes,
``task-<t>.sh``, with its own ``TF_CONFIG`` (the picked ports, as
``DLSCHED_PORT_LIST``), and
``SLURM_HOSTFILE`` places task ``t`` on its node. MPI runs the
launcher's ``mpirun -np N --hostfile <attempt dir>/hostfile ...`` in the
batch script itself (on the allocation's first node; Open MPI launches its
daemons through Slurm) after writing the hostfile from the node list; the
workers are hosts only, nothing is started for them (they are reported
with the job's state: ``SlurmScript.hosts``). Each rank's output
goes to files of its own (``--output-filename <attempt dir>/mpi:nocopy``)
and whole lines of them to the launcher's log (``steps.mpi_launcher``,
``shell.MPI_MERGE``), so ranks never share a line. The script makes
``DLSCHED_DIR`` absolute first thing, and the hostfile's path the planner
gives mpirun and the ranks is that absolute path (``shell.DIR_TOKEN``), so a
launcher with a working directory of its own finds it. The steps are
written by ``steps``.

Success rule (the plan's ``SuccessRule``), in the script, one shell function
(``dlsched_decide``, ``shell.SUCCESS_RULE``) fed two ways: per-process steps are
waited for one by one (``wait -n``) and their exit statuses written to
``<role>-<index>.exit``; PS_WORKER's tasks write those files themselves and
the script reads them. The first failing process ends the job with its exit
code after stopping the rest; once every deciding process exited 0 the rest
are stopped and the script exits 0. Stopping the rest (``shell``'s
``dlsched_term``): SIGTERM to every step's tasks (``scancel --signal=TERM``,
which spares the batch script: an srun sent SIGTERM itself SIGKILLs its
tasks at once), then, after the stop grace (``DLSCHED_GRACE``, the
driver's ``--grace-seconds``), SIGTERM to the sruns still running, which
SIGKILL their tasks. So Slurm's own state (COMPLETED / FAILED)
and ``ExitCode`` are the job's. Each process's end is also appended to the
attempt's ``exits`` file (``end <label> <status> exit|stop|halt``: heard of
before or after the job was decided, after a first ``labels`` line), which
the driver reads when the job ends (``exits``) to report every replica's
own state and name the failure that decided the job.

Quoting. Every user value that reaches the script (command, args, env
values, working directory) is shell-quoted by ``shell.sh_quote``: printable ASCII
in single quotes (``shlex.quote``), anything else (newlines, control bytes,
non-ASCII) as bash ``$'...'`` with every other byte ``\\xHH``, so each value
is one line, no ``#SBATCH`` line can be smuggled in, and the program gets
its argv and environment byte for byte. Values that land in ``#SBATCH``
lines (job id, attempt, partition, GPU type) are validated instead; a bad one
is INVALID_ARGUMENT naming the field. Env names are validated upstream
(``drivers.common.convert``) and again here.

Files, relative to the SSH user's home (the submit directory, which is the
job's working directory by default)::

    <state_dir>/<job_id>.<n>.batch.stdout|.batch.stderr
    <state_dir>/<job_id>/attempt-<n>/<role>-<index>.stdout|.stderr|.exit
    <state_dir>/<job_id>/attempt-<n>/exits             each process's end, in the order heard of
    <state_dir>/<job_id>/attempt-<n>/hostfile          MPI only
    <state_dir>/<job_id>/attempt-<n>/mpi/<j>/rank.<r>/stdout|stderr, mpi.done   MPI only
    <state_dir>/<job_id>/attempt-<n>/task-<t>.sh, tasks.conf, tasks.hosts   PS_WORKER only
    <state_dir>/<job_id>/attempt-<n>/log.index         when each log file reached each size

The log index: a background function of the script (``dlsched_index``)
looks at the sizes of the log files every ``INDEX_INTERVAL`` seconds and
appends ``<unix seconds.micros> <size> <name>`` for each file that grew (one
more look when the steps have ended), so the driver can date every line to
about a second (``since_time``, ``LogEntry.time``; ``logs.py``) while the
steps' output still goes straight to its files.

``state_dir`` is cluster option ``state_dir`` (default ``.dlsched/slurm``);
it must be on a file system the compute nodes and the login node share.
"""

from __future__ import annotations

import dataclasses
import math
import re
import shlex
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TypeVar

from dlsched import resources, spec_rules
from dlsched.errors import FieldViolation, InvalidArgument
from dlsched.kit.parse import decimal
from dlsched.spec_rules import ENV_NAME_RE, ID_RE
from drivers.common import planner
from drivers.common.base import JobSpec, LogStream, NativeSpec, ReplicaGroup, RunMode
from drivers.slurm import shell, steps
from drivers.slurm.shell import sh_quote
from drivers.slurm.steps import TASKS_STEP, StepFiles

T = TypeVar("T")

MEDIA_TYPE = "text/x-shellscript"
DEFAULT_STATE_DIR = ".dlsched/slurm"
NAME_PREFIX = "dlsched-"
#: Rendezvous ports: the range the batch script picks from (cluster option ``port_range``, ``LO-HI``,
#: default ``PORT_LO``-``PORT_LO + PORT_SPAN - 1``), and how far apart concurrent jobs' blocks start.
PORT_LO = 10000
PORT_SPAN = 22760  # up to 32759: below Linux's default ephemeral range (32768-60999); a multiple of the stride
PORT_STRIDE = 8
PORT_RANGE_RE = re.compile(r"([0-9]{1,5})-([0-9]{1,5})")
#: The lowest port a range may start at (below it, binding needs privileges jobs do not have).
PORT_MIN = 1024
#: Seconds between the SIGTERM and the SIGKILL of the processes the success rule stops (the driver
#: passes its ``--grace-seconds``).
STOP_GRACE_SECONDS = 10.0
#: The log index file in each attempt directory, and how often the job script appends to it.
LOG_INDEX = "log.index"
INDEX_INTERVAL = 1
#: Values that land in #SBATCH lines or paths: validated, never quoted.
PARTITION_RE = spec_rules.QUEUE_RE  # spec.queue's rule, the cluster's default partition's too
UID_MARK_RE = re.compile(r"[A-Za-z0-9]{1,64}")  #: a job uid without its dashes, in the comment
GPU_TYPE_RE = re.compile(r"^[A-Za-z0-9_.-]{1,64}\Z")
STATE_DIR_RE = re.compile(r"^(?!-)[A-Za-z0-9_./-]{1,255}\Z")

__all__ = ["MEDIA_TYPE", "TASKS_STEP", "Checked", "Layout", "SlurmScript", "StepFiles", "attempt_dir", "batch_output",
           "check", "emit", "job_comment", "job_name", "parse_comment", "place", "port_range_of", "render_job",
           "sh_quote", "state_dir_of", "check_options"]


@dataclass(frozen=True)
class SlurmScript:
    """The rendered job (``skeleton.Rendered``): the script sbatch reads on stdin, and what
    the driver keeps of it (the name and comment a look-up finds it by, its files)."""

    job_id: str
    attempt: int
    job_name: str
    comment: str
    dir: str
    script: str
    steps: tuple[StepFiles, ...]
    uid: str = ""  #: the job's uid as ``comment`` carries it ("" for none)
    #: (role, index) of the replicas no step runs for, whose state is the job's: MPI's workers
    #: (hosts for the launcher's ranks, nothing is started for them)
    hosts: tuple[tuple[str, int], ...] = ()

    @property
    def roles(self) -> tuple[tuple[str, int], ...]:
        """(role, index) of the replicas a step runs for."""
        return tuple((s.role, s.index) for s in self.steps)

    def native_spec(self) -> NativeSpec:
        return NativeSpec(media_type=MEDIA_TYPE, content=self.script)

    @property
    def attempt_key(self) -> str:
        """The comment without a uid: what every job of this id and attempt is listed under."""
        return job_comment(self.job_id, self.attempt)

    def marks(self, comment: str) -> bool:
        """Whether a Slurm job with ``comment`` is a submission of this attempt: this comment
        only. A launch with a uid never takes the uid-less key: any job of the same Slurm user
        can submit one (``--comment=dlsched-<id>.<attempt>``, held) and would be adopted and
        released as this attempt. A launch without a uid has that key for its comment."""
        return comment == self.comment

    def in_listing(self, listed: Mapping[str, Mapping[str, T]]) -> T | None:
        """This attempt's job in ``listed`` (attempt key -> comment -> job), by ``marks``; None when none."""
        return (listed.get(self.attempt_key) or {}).get(self.comment)

    def other_attempts(self, listed: Mapping[str, Mapping[str, T]]) -> list[tuple[int, T]]:
        """(attempt, job) of this job's other attempts in ``listed``, under this launch's own
        comment for them (``marks``'s rule: this uid's, or the uid-less one for a launch without)."""
        prefix = job_comment(self.job_id, 0)[:-1]  # "dlsched-<job_id>."
        out = []
        for key, entry in listed.items():
            if key.startswith(prefix) and decimal(rest := key[len(prefix):]) and int(rest) != self.attempt:
                job = entry.get(job_comment(self.job_id, int(rest), self.uid))
                if job is not None:
                    out.append((int(rest), job))
        return out

    def rivals(self, listed: Mapping[str, Mapping[str, T]]) -> list[T]:
        """The jobs ``listed`` has of this job id and attempt for another job uid (an earlier job
        of the same id, deleted without its cleanup); none when this launch has no uid. A
        uid-less comment is no rival either: it names no job, and anyone can write it."""
        entry = listed.get(self.attempt_key) or {}
        return [j for comment, j in entry.items() if self.uid and comment != self.attempt_key
                and not self.marks(comment)]


# --------------------------------------------------------------------------- metadata codec and files


def job_name(job_id: str) -> str:
    return f"{NAME_PREFIX}{job_id}"


def job_comment(job_id: str, attempt: int, uid: str = "") -> str:
    """``dlsched-<job_id>.<attempt>.<uid>`` (``uid`` without dashes; none: ``.<uid>`` left out)."""
    mark = uid.replace("-", "")
    return f"{NAME_PREFIX}{job_id}.{attempt}.{mark}" if mark else f"{NAME_PREFIX}{job_id}.{attempt}"


def parse_comment(comment: str) -> tuple[str, int, str] | None:
    """``dlsched-<job_id>.<attempt>[.<uid>]`` -> (job_id, attempt, uid without dashes, "" for
    none); anything else None."""
    if not comment.startswith(NAME_PREFIX):
        return None
    parts = comment[len(NAME_PREFIX):].split(".")
    if len(parts) == 2:
        parts.append("")
    if len(parts) != 3:
        return None
    job_id, attempt, mark = parts
    if not decimal(attempt) or not ID_RE.fullmatch(job_id) or mark and not UID_MARK_RE.fullmatch(mark):
        return None
    return job_id, int(attempt), mark


def is_ours(comment: str) -> bool:
    """Whether a Slurm job's comment is a dlsched attempt's (cheap: the prefix only)."""
    return comment.startswith(NAME_PREFIX)


def state_dir_of(options: Mapping[str, str]) -> str:
    d = options.get("state_dir", "") or DEFAULT_STATE_DIR
    if not STATE_DIR_RE.match(d) or ".." in d.split("/"):
        raise InvalidArgument.for_field("cluster.options[state_dir]",
                                        "must match [A-Za-z0-9_./-]+ without '..' or a leading '-'")
    return d.rstrip("/") or "/"


def check_options(options: Mapping[str, str]) -> None:
    """A cluster's options as every launch reads them (ConfigureCluster refuses the cluster,
    which is then UNREACHABLE saying why, rather than READY with every launch refused)."""
    state_dir_of(options)
    port_range_of(options)
    script_bound(options)
    partition = options.get("partition", "")
    if partition and not PARTITION_RE.match(partition):
        raise InvalidArgument.for_field("cluster.options[partition]",
                                        "must be a Slurm partition name [A-Za-z0-9_.-] (comma-separated)")
    max_nodes = options.get("max_nodes", "")
    if max_nodes and not (decimal(max_nodes) and int(max_nodes) >= 1):
        raise InvalidArgument.for_field("cluster.options[max_nodes]", "must be a positive integer")


def script_bound(options: Mapping[str, str]) -> int:
    """Cluster option ``max_script_bytes`` (Slurm's ``max_script_size``), else its default."""
    limit = options.get("max_script_bytes", "")
    if not limit:
        return MAX_SCRIPT_BYTES
    if not (len(limit) <= 12 and decimal(limit) and int(limit) >= 1):
        raise InvalidArgument.for_field("cluster.options[max_script_bytes]", "must be a positive integer (bytes)")
    return int(limit)


def port_range_of(options: Mapping[str, str]) -> tuple[int, int]:
    """Cluster option ``port_range`` (``LO-HI``, inclusive) -> (LO, HI); the default without it.
    INVALID_ARGUMENT unless ``PORT_MIN <= LO`` and ``LO + PORT_STRIDE - 1 <= HI <= 65535``."""
    raw = options.get("port_range", "")
    if not raw:
        return PORT_LO, PORT_LO + PORT_SPAN - 1
    m = PORT_RANGE_RE.fullmatch(raw)
    lo, hi = (int(m.group(1)), int(m.group(2))) if m else (0, 0)
    if not m or lo < PORT_MIN or hi > 65535 or hi - lo + 1 < PORT_STRIDE:
        raise InvalidArgument.for_field(
            "cluster.options[port_range]",
            f"must be LO-HI with {PORT_MIN} <= LO, HI <= 65535 and at least {PORT_STRIDE} ports, e.g. 20000-29999")
    return lo, hi


def attempt_dir(options: Mapping[str, str], job_id: str, attempt: int) -> str:
    return f"{state_dir_of(options)}/{job_id}/attempt-{attempt}"


def batch_output(options: Mapping[str, str], job_id: str, attempt: int, stream: LogStream) -> str:
    """The batch script's own stdout/stderr file (in the state dir, which exists at submit)."""
    return f"{state_dir_of(options)}/{job_id}.{attempt}.batch.{stream.name.lower()}"


def _time(seconds: float) -> str:
    s = max(1, math.ceil(seconds))
    d, s = divmod(s, 86400)
    h, s = divmod(s, 3600)
    m, s = divmod(s, 60)
    return f"{d}-{h:02d}:{m:02d}:{s:02d}"


# --------------------------------------------------------------------------- check → place → emit


def render_job(job_id: str, spec: JobSpec, attempt: int,
               options: Mapping[str, str] | None = None, *, uid: str = "",
               stop_grace: float = STOP_GRACE_SECONDS) -> SlurmScript:
    """The sbatch script; raises InvalidArgument for specs Slurm cannot take. ``stop_grace``:
    seconds between the SIGTERM and the SIGKILL of the processes the success rule stops."""
    checked = check(job_id, spec, attempt, options or {}, uid)
    out = emit(place(dataclasses.replace(checked, stop_grace=max(0.0, stop_grace))))
    bound = script_bound(options or {})
    if (size := len(out.script.encode("utf-8", "surrogateescape"))) > bound:
        # (sbatch would refuse it, "Pathname of a file, directory or other parameter too long")
        raise InvalidArgument.for_field(
            "spec.replica_groups", f"the job's batch script takes {size} bytes, over the cluster's {bound} "
            "(Slurm's max_script_size; cluster option max_script_bytes): every process's command, "
            "arguments and environment are in it; ship large inputs as files")
    return out


#: Slurm's default ``SchedulerParameters=max_script_size`` (4 MB): a longer script sbatch refuses
MAX_SCRIPT_BYTES = 4 * 1024 * 1024


@dataclass(frozen=True)
class Checked:
    """A job Slurm can take, with the values that land in ``#SBATCH`` lines validated."""

    job_id: str
    spec: JobSpec
    attempt: int
    options: Mapping[str, str]
    uid: str  #: the job's uid as the comment carries it ("" for none)
    partition: str  #: ``spec.queue``, else the cluster's default partition ("" for Slurm's)
    max_nodes: int | None  #: cluster option ``max_nodes``
    gpu_type: str  #: the one GPU type the groups name ("" for any)
    ports: tuple[int, int] = (PORT_LO, PORT_LO + PORT_SPAN - 1)  #: cluster option ``port_range``, inclusive
    stop_grace: float = STOP_GRACE_SECONDS  #: SIGTERM to SIGKILL of the processes the success rule stops


def check(job_id: str, spec: JobSpec, attempt: int, options: Mapping[str, str], uid: str = "") -> Checked:
    """Every value Slurm cannot take, as the field violations of one ``InvalidArgument``."""
    vs: list[FieldViolation] = []
    if not ID_RE.match(job_id):
        vs.append(FieldViolation("job_id", "must match [a-z][a-z0-9-]{0,62}"))
    mark = uid.replace("-", "")
    if uid and not UID_MARK_RE.fullmatch(mark):
        vs.append(FieldViolation("job_uid", "must be up to 64 letters, digits and dashes"))
    if attempt < 1:
        vs.append(FieldViolation("attempt", "must be at least 1"))
    partition = spec.queue or options.get("partition", "")
    if partition and not PARTITION_RE.match(partition):
        field = "spec.queue" if spec.queue else "cluster.options[partition]"
        vs.append(FieldViolation(field, "must be a Slurm partition name [A-Za-z0-9_.-] (comma-separated)"))
    max_nodes = options.get("max_nodes", "")
    if max_nodes and not (decimal(max_nodes) and int(max_nodes) >= 1):
        vs.append(FieldViolation("cluster.options[max_nodes]", "must be a positive integer"))
    gpu_types = set()
    for i, g in enumerate(spec.replica_groups):
        vs += _group_violations(f"spec.replica_groups[{i}]", g)
        if g.resources.gpus and g.resources.gpu_type:
            gpu_types.add(g.resources.gpu_type)
    if len(gpu_types) > 1:
        vs.append(FieldViolation("spec.replica_groups", "every group asking for GPUs must name the same gpu_type"))
    try:
        ports = port_range_of(options)
    except InvalidArgument as e:
        vs += e.violations
    if vs:
        raise InvalidArgument("; ".join(f"{v.field}: {v.description}" for v in vs), vs)
    state_dir_of(options)
    return Checked(job_id, spec, attempt, options, mark, partition, int(max_nodes) if max_nodes else None,
                   next(iter(gpu_types), ""), ports)


def _group_violations(gf: str, g: ReplicaGroup) -> list[FieldViolation]:
    vs = []
    if g.resources.gpus and g.resources.gpu_type and not GPU_TYPE_RE.match(g.resources.gpu_type):
        vs.append(FieldViolation(f"{gf}.resources.gpu_type", "must match [A-Za-z0-9_.-]{1,64}"))
    for k in g.env:
        if not ENV_NAME_RE.match(k):
            vs.append(FieldViolation(f"{gf}.env[{k!r}]", "name must match [A-Za-z_][A-Za-z0-9_]*"))
    if g.image:
        vs.append(FieldViolation(f"{gf}.image", "the Slurm driver runs no container images"))
    return vs


@dataclass(frozen=True)
class Layout:
    """Where everything goes: replica ``q`` of the layout order on node ``q * nodes // R``,
    the planner's plan for those placements, and what each node must hold."""

    job: Checked
    nodes: int
    node_of: Mapping[tuple[str, int], int]  #: (role, replica index) -> node of the allocation
    plan: planner.JobPlan
    dir: str  #: the attempt directory
    tasks_per_node: int  #: the most processes one node runs (MPI: the ranks, not the launcher)
    cpus_per_task: int
    mem_per_node: int  #: bytes, the most one node's replicas ask for
    gpus_per_node: int
    port_nodes: tuple[int, ...] = ()  #: port token k -> the node whose process listens on it


def place(job: Checked) -> Layout:
    """Replicas onto nodes (late-resolving host tokens), the plan, the per-node allocation."""
    spec = job.spec
    ordered = [g for _, g in planner.groups_in_order(spec)]
    replicas = [(g, r) for g in ordered for r in range(g.replicas)]
    total = len(replicas)
    nodes = min(total, job.max_nodes) if job.max_nodes else total
    node_of = {(g.role, r): q * nodes // total for q, (g, r) in enumerate(replicas)}
    port_nodes: list[int] = []  # a port token per listener: the torch master (node 0), each PS task but the evaluator
    task_port: dict[tuple[str, int], str] = {}
    if spec.run_mode in planner.TORCH_MODES:
        port_nodes.append(0)
    elif spec.run_mode is RunMode.PS_WORKER:
        for g, r in replicas:
            if g.role != "evaluator":
                task_port[(g.role, r)] = shell.PORT_TOKEN.format(len(port_nodes))
                port_nodes.append(node_of[(g.role, r)])
    placements = [planner.Placement(role=g.role, replica_index=r,
                                    host=shell.NODE_TOKEN.format(node_of[(g.role, r)]),
                                    node_rank=node_of[(g.role, r)], port=task_port.get((g.role, r), 0))
                  for g, r in replicas]
    adir = attempt_dir(job.options, job.job_id, job.attempt)
    plan = planner.plan_job(job.job_id, spec, placements, master_port=shell.PORT_TOKEN.format(0),
                            hostfile_path=f"{shell.DIR_TOKEN}/{planner.HOSTFILE}", mpirun_args=steps.MPI_ARGS)
    procs_on = [0] * nodes
    mem_on = [0] * nodes
    gpus_on = [0] * nodes
    for g, r in replicas:
        n = node_of[(g.role, r)]
        launcher = spec.run_mode is RunMode.MPI and g.role == "launcher"
        procs_on[n] += 0 if launcher else g.processes  # MPI: the tasks are mpirun's ranks
        mem_on[n] += g.resources.memory_bytes
        gpus_on[n] += g.resources.gpus
    cpt = resources.cpus_per_task(ordered)  # the matcher counts the same (dlsched.resources)
    return Layout(job, nodes, node_of, plan, adir, max(procs_on), cpt, max(mem_on), max(gpus_on),
                  tuple(port_nodes))


def emit(lay: Layout) -> SlurmScript:
    """The script text: ``#SBATCH`` lines, the prologue, the steps, the success rule."""
    job, spec, plan = lay.job, lay.job.spec, lay.plan
    name, comment = job_name(job.job_id), job_comment(job.job_id, job.attempt, job.uid)
    h = _sbatch_lines(lay, name, comment) + [
        "",
        f"# dlsched job {job.job_id}, attempt {job.attempt}: {spec.run_mode.name}, "
        f"{len(plan.processes)} process(es) on {lay.nodes} node(s)",
        f"# success: {plan.success.description}",
        "set -u",
        f"DLSCHED_GRACE={job.stop_grace:.3f}",
        f"DLSCHED_DIR={shlex.quote(lay.dir)}",
        'mkdir -p -- "$DLSCHED_DIR" || exit 1',
        'DLSCHED_DIR=$(cd -- "$DLSCHED_DIR" && pwd -P) || exit 1  # absolute: processes run in other directories',
        'mapfile -t DLSCHED_NODES < <(scontrol show hostnames "$SLURM_JOB_NODELIST")',
        'if [ "${#DLSCHED_NODES[@]}" -lt ' + str(lay.nodes) + ' ]; then',
        f'  echo "dlsched: the allocation has ${{#DLSCHED_NODES[@]}} node(s), {lay.nodes} needed" >&2',
        "  exit 1",
        "fi",
        "declare -A DLSCHED_NAME=() DLSCHED_DECIDES=()",
        f"printf '%s\\n' {' '.join(shlex.quote(ln) for ln in _exits_head(spec, plan))} >\"$DLSCHED_DIR/{shell.EXITS}\"",
    ]
    if lay.port_nodes:
        lo, hi = job.ports
        h += shell.PORT_PICKER.format(lo=lo, span=hi - lo + 1, hi=hi, stride=PORT_STRIDE).splitlines()
        h += [f"dlsched_port {n} || exit 1" for n in lay.port_nodes]
    h += shell.INDEXER.format(interval=INDEX_INTERVAL, index=LOG_INDEX).splitlines()
    if planner.HOSTFILE in plan.files:
        h.append("{")
        for ln in plan.files[planner.HOSTFILE].splitlines():
            h.append(f"  printf '%s\\n' {shell.dq_with_tokens(ln)}")
        h.append(f'}} > "$DLSCHED_DIR/{planner.HOSTFILE}"')
    files: list[StepFiles] = []
    if spec.run_mode is RunMode.PS_WORKER:
        h += steps.multi_prog(lay, files)
    else:
        if spec.run_mode is RunMode.MPI:
            h += shell.MPI_MERGE.splitlines()
        h += steps.srun_steps(lay, files)
    h += shell.SCRIPT_END.splitlines()
    return SlurmScript(job_id=job.job_id, attempt=job.attempt, job_name=name, comment=comment, dir=lay.dir,
                       script="\n".join(h) + "\n", steps=tuple(files), uid=job.uid, hosts=_hosts(spec))


def _hosts(spec: JobSpec) -> tuple[tuple[str, int], ...]:
    """The replicas that only host processes (MPI's workers: the launcher's ranks run there)."""
    return tuple((g.role, i) for g in spec.replica_groups for i in range(g.replicas)
                 if spec.run_mode is RunMode.MPI and g.role != "launcher")


def _exits_head(spec: JobSpec, plan: planner.JobPlan) -> list[str]:
    """The exits file's first lines: the processes the script starts, then the replicas
    that only host ranks (so a driver that adopts the job without its record knows them)."""
    head = ["labels " + " ".join(steps.labels(plan))]
    if hosts := _hosts(spec):
        head.append("hosts " + " ".join(f"{r}-{i}" for r, i in hosts))
    return head


def _sbatch_lines(lay: Layout, name: str, comment: str) -> list[str]:
    job = lay.job
    h = ["#!/bin/bash", f"#SBATCH --job-name={name}", f"#SBATCH --comment={comment}"]
    if job.partition:
        h.append(f"#SBATCH --partition={job.partition}")
    if job.spec.time_limit_seconds:
        h.append(f"#SBATCH --time={_time(job.spec.time_limit_seconds)}")
    h += [
        f"#SBATCH --nodes={lay.nodes}",
        f"#SBATCH --ntasks-per-node={lay.tasks_per_node}",
        f"#SBATCH --cpus-per-task={lay.cpus_per_task}",
    ]
    if lay.mem_per_node > 0:
        h.append(f"#SBATCH --mem={math.ceil(lay.mem_per_node / (1 << 20))}M")
    if lay.gpus_per_node > 0:
        t = job.gpu_type
        h.append(f"#SBATCH --gres=gpu:{t + ':' if t else ''}{lay.gpus_per_node}")
    h += [
        f"#SBATCH --output={batch_output(job.options, job.job_id, job.attempt, LogStream.STDOUT)}",
        f"#SBATCH --error={batch_output(job.options, job.job_id, job.attempt, LogStream.STDERR)}",
    ]
    return h
