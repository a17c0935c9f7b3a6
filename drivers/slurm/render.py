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
(``shell.PORT_PICKER``): from the job's block of ``[PORT_LO, PORT_LO +
PORT_SPAN)``, starting at ``PORT_LO + (SLURM_JOB_ID * PORT_STRIDE) %
PORT_SPAN`` (below Linux's ephemeral range, so no outgoing connection holds
one), each the next port that nothing listens on at the node whose process
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
``partition``), ``--time`` (the time limit, rounded up to whole seconds),
``--job-name=dlsched-<job_id>`` and ``--comment=dlsched-<job_id>.<attempt>``
(how a retried launch finds an earlier submission), and the batch script's
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
the job; ``_multi_prog``): each task runs a wrapper the script writes,
``task-<t>.sh``, with its own ``TF_CONFIG`` (the picked ports, as
``DLSCHED_PORT_LIST``), and
``SLURM_HOSTFILE`` places task ``t`` on its node. MPI runs the
launcher's ``mpirun -np N --hostfile <attempt dir>/hostfile ...`` in the
batch script itself (on the allocation's first node; Open MPI launches its
daemons through Slurm) after writing the hostfile from the node list; the
workers are hosts only, nothing is started for them.

Success rule (the plan's ``SuccessRule``), in the script, one shell function
(``dlsched_decide``, ``shell.SUCCESS_RULE``) fed two ways: per-process steps are
waited for one by one (``wait -n``) and their exit statuses written to
``<role>-<index>.exit``; PS_WORKER's tasks write those files themselves and
the script reads them. The first failing process ends the job with its exit
code after stopping the rest (SIGTERM to the other sruns, which forward it
to their tasks); once every deciding process exited 0 the rest are stopped
and the script exits 0. So Slurm's own state (COMPLETED / FAILED)
and ``ExitCode`` are the job's.

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
    <state_dir>/<job_id>/attempt-<n>/hostfile          MPI only
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

import math
import re
import shlex
from collections.abc import Mapping
from dataclasses import dataclass

from dlsched import resources
from dlsched.errors import FieldViolation, InvalidArgument
from dlsched.spec_rules import ENV_NAME_RE, ID_RE
from drivers.common import planner
from drivers.common.base import JobSpec, LogStream, NativeSpec, ReplicaGroup, RunMode
from drivers.slurm import shell
from drivers.slurm.shell import sh_quote

MEDIA_TYPE = "text/x-shellscript"
DEFAULT_STATE_DIR = ".dlsched/slurm"
NAME_PREFIX = "dlsched-"
#: Rendezvous ports: the range the batch script picks from, and how far apart concurrent jobs' blocks start.
PORT_LO = 10000
PORT_SPAN = 22760  # up to 32759: below Linux's default ephemeral range (32768-60999); a multiple of the stride
PORT_STRIDE = 8
#: The log index file in each attempt directory, and how often the job script appends to it.
LOG_INDEX = "log.index"
INDEX_INTERVAL = 1
#: PS-Worker: the name of the one ``--multi-prog`` step, and how often the script reads the tasks' exit files.
TASKS_STEP = "dlsched-tasks"
TASK_CHECK_INTERVAL = 0.5
#: Values that land in #SBATCH lines or paths: validated, never quoted.
PARTITION_RE = re.compile(r"^[A-Za-z0-9_.-]{1,64}(,[A-Za-z0-9_.-]{1,64}){0,15}\Z")
GPU_TYPE_RE = re.compile(r"^[A-Za-z0-9_.-]{1,64}\Z")
STATE_DIR_RE = re.compile(r"^(?!-)[A-Za-z0-9_./-]{1,255}\Z")

__all__ = ["MEDIA_TYPE", "Checked", "Layout", "SlurmScript", "StepFiles", "attempt_dir", "batch_output", "check",
           "emit", "job_comment", "job_name", "parse_comment", "place", "render_job", "sh_quote", "state_dir_of"]


@dataclass(frozen=True)
class StepFiles:
    """Where one process's output goes."""

    role: str
    index: int
    stdout: str
    stderr: str

    def log_path(self, stream: LogStream) -> str:
        return self.stdout if stream is LogStream.STDOUT else self.stderr


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

    def native_spec(self) -> NativeSpec:
        return NativeSpec(media_type=MEDIA_TYPE, content=self.script)


# --------------------------------------------------------------------------- metadata codec and files


def job_name(job_id: str) -> str:
    return f"{NAME_PREFIX}{job_id}"


def job_comment(job_id: str, attempt: int) -> str:
    return f"{NAME_PREFIX}{job_id}.{attempt}"


def parse_comment(comment: str) -> tuple[str, int] | None:
    """``dlsched-<job_id>.<attempt>`` -> (job_id, attempt); anything else None."""
    if not comment.startswith(NAME_PREFIX):
        return None
    job_id, sep, attempt = comment[len(NAME_PREFIX):].rpartition(".")
    if not sep or not attempt.isdigit() or not ID_RE.match(job_id):
        return None
    return job_id, int(attempt)


def is_ours(comment: str) -> bool:
    """Whether a Slurm job's comment is a dlsched attempt's (cheap: the prefix only)."""
    return comment.startswith(NAME_PREFIX)


def state_dir_of(options: Mapping[str, str]) -> str:
    d = options.get("state_dir", "") or DEFAULT_STATE_DIR
    if not STATE_DIR_RE.match(d) or ".." in d.split("/"):
        raise InvalidArgument.for_field("cluster.options[state_dir]",
                                        "must match [A-Za-z0-9_./-]+ without '..' or a leading '-'")
    return d.rstrip("/") or "/"


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
               options: Mapping[str, str] | None = None) -> SlurmScript:
    """The sbatch script; raises InvalidArgument for specs Slurm cannot take."""
    return emit(place(check(job_id, spec, attempt, options or {})))


@dataclass(frozen=True)
class Checked:
    """A job Slurm can take, with the values that land in ``#SBATCH`` lines validated."""

    job_id: str
    spec: JobSpec
    attempt: int
    options: Mapping[str, str]
    partition: str  #: ``spec.queue``, else the cluster's default partition ("" for Slurm's)
    max_nodes: int | None  #: cluster option ``max_nodes``
    gpu_type: str  #: the one GPU type the groups name ("" for any)


def check(job_id: str, spec: JobSpec, attempt: int, options: Mapping[str, str]) -> Checked:
    """Every value Slurm cannot take, as the field violations of one ``InvalidArgument``."""
    vs: list[FieldViolation] = []
    if not ID_RE.match(job_id):
        vs.append(FieldViolation("job_id", "must match [a-z][a-z0-9-]{0,62}"))
    if attempt < 1:
        vs.append(FieldViolation("attempt", "must be at least 1"))
    partition = spec.queue or options.get("partition", "")
    if partition and not PARTITION_RE.match(partition):
        field = "spec.queue" if spec.queue else "cluster.options[partition]"
        vs.append(FieldViolation(field, "must be a Slurm partition name [A-Za-z0-9_.-] (comma-separated)"))
    max_nodes = options.get("max_nodes", "")
    if max_nodes and not (max_nodes.isdigit() and int(max_nodes) >= 1):
        vs.append(FieldViolation("cluster.options[max_nodes]", "must be a positive integer"))
    gpu_types = set()
    for i, g in enumerate(spec.replica_groups):
        vs += _group_violations(f"spec.replica_groups[{i}]", g)
        if g.resources.gpus and g.resources.gpu_type:
            gpu_types.add(g.resources.gpu_type)
    if len(gpu_types) > 1:
        vs.append(FieldViolation("spec.replica_groups", "every group asking for GPUs must name the same gpu_type"))
    if vs:
        raise InvalidArgument("; ".join(f"{v.field}: {v.description}" for v in vs), vs)
    state_dir_of(options)
    return Checked(job_id, spec, attempt, options, partition, int(max_nodes) if max_nodes else None,
                   next(iter(gpu_types), ""))


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
                            hostfile_path=f"{adir}/{planner.HOSTFILE}")
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
    name, comment = job_name(job.job_id), job_comment(job.job_id, job.attempt)
    h = _sbatch_lines(lay, name, comment) + [
        "",
        f"# dlsched job {job.job_id}, attempt {job.attempt}: {spec.run_mode.name}, "
        f"{len(plan.processes)} process(es) on {lay.nodes} node(s)",
        f"# success: {plan.success.description}",
        "set -u",
        f"DLSCHED_DIR={shlex.quote(lay.dir)}",
        'mkdir -p -- "$DLSCHED_DIR" || exit 1',
        'mapfile -t DLSCHED_NODES < <(scontrol show hostnames "$SLURM_JOB_NODELIST")',
        'if [ "${#DLSCHED_NODES[@]}" -lt ' + str(lay.nodes) + ' ]; then',
        f'  echo "dlsched: the allocation has ${{#DLSCHED_NODES[@]}} node(s), {lay.nodes} needed" >&2',
        "  exit 1",
        "fi",
        "declare -A DLSCHED_NAME=() DLSCHED_DECIDES=()",
    ]
    if lay.port_nodes:
        h += shell.PORT_PICKER.format(lo=PORT_LO, span=PORT_SPAN, hi=PORT_LO + PORT_SPAN - 1,
                                      stride=PORT_STRIDE).splitlines()
        h += [f"dlsched_port {n} || exit 1" for n in lay.port_nodes]
    h += shell.INDEXER.format(interval=INDEX_INTERVAL, index=LOG_INDEX).splitlines()
    if planner.HOSTFILE in plan.files:
        h.append("{")
        for ln in plan.files[planner.HOSTFILE].splitlines():
            h.append(f"  printf '%s\\n' {shell.dq_with_tokens(ln)}")
        h.append(f'}} > "$DLSCHED_DIR/{planner.HOSTFILE}"')
    steps: list[StepFiles] = []
    if spec.run_mode is RunMode.PS_WORKER:
        h += _multi_prog(lay, steps)
    else:
        h += _srun_steps(lay, steps)
    h += shell.SCRIPT_END.splitlines()
    return SlurmScript(job_id=job.job_id, attempt=job.attempt, job_name=name, comment=comment, dir=lay.dir,
                       script="\n".join(h) + "\n", steps=tuple(steps))


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


def _srun_steps(lay: Layout, steps: list[StepFiles]) -> list[str]:
    """Every mode but PS-Worker: an ``srun`` step per process (the MPI launcher runs in
    the batch script itself), each in a background subshell; the success rule waits
    for them one by one (``wait -n``) and writes their exit files."""
    spec, plan, adir = lay.job.spec, lay.plan, lay.dir
    decisive = plan.success.decisive_roles
    h: list[str] = []
    for p in plan.processes:
        if p.placeholder:
            continue
        label = f"{p.role}-{p.slot_index}"
        files = StepFiles(p.role, p.slot_index, f"{adir}/{label}.stdout", f"{adir}/{label}.stderr")
        steps.append(files)
        h.append(f"# {label}: rank {p.rank}")
        h.append("(")
        h += _exports(spec, p, "  ")
        argv = " ".join(sh_quote(a) for a in p.argv)
        launcher = spec.run_mode is RunMode.MPI and p.role == "launcher"
        if launcher:
            if p.working_dir:
                h.append(f"  cd -- {sh_quote(p.working_dir)} || exit 126")
            h.append(f"  exec {argv}")
        else:
            node = lay.node_of[(p.role, p.replica_index)]
            opts = [f"--job-name={label}", "--nodes=1", "--ntasks=1", f"--relative={node}",
                    f"--cpus-per-task={lay.cpus_per_task}", "--overlap", "--export=ALL", "--kill-on-bad-exit=1"]
            if p.working_dir:
                opts.append(f"--chdir={sh_quote(p.working_dir)}")
            h.append(f"  exec srun {' '.join(opts)} -- {argv}")
        h.append(f') >"$DLSCHED_DIR/{label}.stdout" 2>"$DLSCHED_DIR/{label}.stderr" </dev/null &')
        h.append(f"DLSCHED_NAME[$!]={label}")
        if p.role in decisive:
            h.append("DLSCHED_DECIDES[$!]=1")
    h += (shell.SUCCESS_RULE + shell.WAIT_LOOP).splitlines()
    return h


def _exports(spec: JobSpec, p: planner.ProcessLaunch, indent: str) -> list[str]:
    """``export`` lines of one process: the user's values quoted, the planner's with node names."""
    user_env = _group_env(spec, p.role)
    out = []
    for k, v in p.env.items():
        if not ENV_NAME_RE.match(k):
            raise InvalidArgument.for_field("spec.replica_groups.env", f"bad variable name {k!r}")
        val = sh_quote(v) if k in user_env or k == planner.MPI_ARGV_ENV else shell.dq_with_tokens(v)  # user data
        out.append(f"{indent}export {k}={val}")
    return out


def _multi_prog(lay: Layout, steps: list[StepFiles]) -> list[str]:
    """PS-Worker: every task in one ``srun --multi-prog`` step (one step launch for
    the whole job, where a step per task costs slurmctld one launch each).

    The batch script writes, per task ``t``, a wrapper ``task-<t>.sh`` (a quoted
    heredoc: nothing in it expands while it is written) that exports the task's
    variables (``TF_CONFIG`` names the nodes and ports through ``DLSCHED_NODE_LIST``
    and ``DLSCHED_PORT_LIST``, exported as strings: arrays do not export), sends its
    output to ``<role>-<index>.*``, runs the quoted argv and writes ``<role>-<index>.exit``. The multi-prog file
    names only the wrappers, so srun's own parsing of it (which keeps quotes
    literally) never sees a user value; ``SLURM_HOSTFILE`` with
    ``--distribution=arbitrary`` puts task ``t`` on its node. The success rule
    watches the exit files (every ``TASK_CHECK_INTERVAL`` s, and at once when
    the step ends): the first failure, or every deciding task's success, stops
    the step. A task stopped that way gets srun's exit status in its exit file."""
    spec, plan, adir, node_of = lay.job.spec, lay.plan, lay.dir, lay.node_of
    procs = [p for p in plan.processes if not p.placeholder]
    h = [
        f"# {len(procs)} task(s) in one step: srun --multi-prog runs task t's wrapper {adir}/task-t.sh",
        'export DLSCHED_DIR DLSCHED_NODE_LIST="${DLSCHED_NODES[*]}" DLSCHED_PORT_LIST="${DLSCHED_PORTS[*]}"',
        "{",
    ]
    for p in procs:
        h.append(f'  printf \'%s\\n\' "${{DLSCHED_NODES[{node_of[(p.role, p.replica_index)]}]}}"')
    h.append('} >"$DLSCHED_DIR/tasks.hosts"')
    labels = []
    for t, p in enumerate(procs):
        label = f"{p.role}-{p.slot_index}"
        labels.append(label)
        steps.append(StepFiles(p.role, p.slot_index, f"{adir}/{label}.stdout", f"{adir}/{label}.stderr"))
        body = [f"# {label}: rank {p.rank}", 'read -r -a DLSCHED_NODES <<<"$DLSCHED_NODE_LIST"',
                'read -r -a DLSCHED_PORTS <<<"$DLSCHED_PORT_LIST"']
        body += _exports(spec, p, "")
        argv = " ".join(sh_quote(a) for a in p.argv)
        cd = f"cd -- {sh_quote(p.working_dir)} || exit 126; " if p.working_dir else ""
        body += [f'( {cd}exec {argv} ) >"$DLSCHED_DIR/{label}.stdout" 2>"$DLSCHED_DIR/{label}.stderr" </dev/null',
                 "dlsched_status=$?",
                 f'printf \'%s\\n\' "$dlsched_status" >"$DLSCHED_DIR/{label}.exit.new"',
                 f'mv -f -- "$DLSCHED_DIR/{label}.exit.new" "$DLSCHED_DIR/{label}.exit"',
                 'exit "$dlsched_status"']
        end = f"DLSCHED_TASK_{t}_END"
        # Every value is quoted onto one line (sh_quote), so no line can end the heredoc early;
        # checked all the same, line by line, since a user value that did would run in the script.
        if any(line == end for b in body for line in b.split("\n")):
            raise ValueError("a wrapper line equals its heredoc delimiter")
        h.append(f"cat >\"$DLSCHED_DIR/task-{t}.sh\" <<'{end}'")
        h += body
        h.append(end)
    h.append(f"printf '%s\\n' '* bash {adir}/task-%t.sh' >\"$DLSCHED_DIR/tasks.conf\"")
    opts = ["--job-name=" + TASKS_STEP, f"--ntasks={len(procs)}", "--distribution=arbitrary",
            f"--cpus-per-task={lay.cpus_per_task}", "--overlap", "--export=ALL"]
    h.append(f'SLURM_HOSTFILE="$DLSCHED_DIR/tasks.hosts" srun {" ".join(opts)} '
             f'--multi-prog {adir}/tasks.conf </dev/null &')
    h.append("DLSCHED_SRUN=$!")
    h.append("DLSCHED_TASKS=(" + " ".join(labels) + ")")
    h += [f"DLSCHED_DECIDES[{lb}]=1" for lb, p in zip(labels, procs, strict=True)
          if p.role in plan.success.decisive_roles]
    h += (shell.SUCCESS_RULE + shell.TASKS_LOOP.format(interval=TASK_CHECK_INTERVAL)).splitlines()
    return h


def _group_env(spec: JobSpec, role: str) -> Mapping[str, str]:
    for g in spec.replica_groups:
        if g.role == role:
            return g.env
    return {}
