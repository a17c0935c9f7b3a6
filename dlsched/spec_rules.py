"""The one validator of the unified job spec: the same rules, limits and messages in JobManager and every driver.

JobManager checks a SubmitJob with it before it stores anything, and every
driver checks a LaunchJob / RenderJob with it again before it converts
anything (a driver assumes a hostile client), so a spec JobManager accepts
is never refused by a driver for its shape (it may still be refused for what
the backend lacks: MPI, GPUs).

The checks read attributes only (``run_mode``, ``replica_groups[i].role``,
``.replicas``, ``.processes_per_replica``, ``.command``, ``.args``, ``.env``,
``.image``, ``.working_dir``, ``.resources.cpu|memory_bytes|gpus|gpu_type``,
``labels``, ``queue``, ``max_retries``, ``cluster_selector.cluster_type``), so they run on the ``dlsched.v1``
message itself before conversion and on the services' plain dataclasses
alike. Patterns match whole strings (``\\Z``). What bounds the work a spec can
cost (group, replica, process, entry and byte counts) is checked first; the
per-field checks run only on a spec within those bounds.
"""

from __future__ import annotations

import math
import posixpath
import re
import shlex
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any, Protocol

from dlsched.errors import FieldViolation, InvalidArgument
from dlsched.kit.timeutil import check_duration

#: Job ids (and cluster ids): they become paths and backend object names.
ID_RE = re.compile(r"[a-z][a-z0-9-]{0,62}\Z")
#: A job uid as drivers get it (LaunchJobRequest.job_uid, JobRef.job_uid): also a Kubernetes label value.
JOB_UID_RE = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?")


def same_job(uid: str, other: str) -> bool:
    """Whether two job uids (with or without dashes) may be one job's: equal, or either
    unknown (a launch without a uid, a submission made before uids were sent)."""
    return not uid or not other or uid.replace("-", "") == other.replace("-", "")
ROLE_RE = re.compile(r"[a-z][a-z0-9-]{0,62}\Z")
ENV_NAME_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
#: Kubernetes label keys: an optional prefix, a DNS subdomain ("a.b/": dot-separated DNS
#: labels of up to 63 characters, 253 in all), then a name; values alike without prefix.
_DNS_LABEL = r"[a-z0-9](?:[-a-z0-9]{0,61}[a-z0-9])?"
LABEL_KEY_RE = re.compile(
    rf"(?:{_DNS_LABEL}(?:\.{_DNS_LABEL})*/)?[A-Za-z0-9](?:[-A-Za-z0-9_.]*[A-Za-z0-9])?\Z")
LABEL_VALUE_RE = re.compile(r"([A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?)?\Z")
RESERVED_ENV_PREFIX = "DLSCHED_"  # any case
#: Names the shells of the launch scripts own (Slurm's steps and wrappers, MPI ranks on every
#: backend run under /bin/sh or bash, which a non-interactive shell cannot leave alone): a
#: shell resets them (IFS), fails on them (OPTIND=x, read-only UID), changes its own behaviour
#: (POSIXLY_CORRECT, SHELLOPTS, BASH_ENV, CDPATH) or sets them itself (PWD, SHLVL, RANDOM): the
#: job could not get them as given, so SubmitJob refuses them (names only an interactive shell
#: reads, ENV, PS1, TMOUT, OSTYPE ..., reach the job and stay allowed).
SHELL_ENV_NAMES = frozenset({
    "IFS", "OPTIND", "OPTARG", "POSIXLY_CORRECT", "SHELLOPTS", "BASHOPTS", "BASH_ENV", "CDPATH",
    "GLOBIGNORE", "EXECIGNORE", "BASH_VERSINFO", "BASH_VERSION", "UID", "EUID", "PPID", "GROUPS", "BASHPID",
    "BASH_ARGV", "BASH_ARGC", "BASH_ARGV0", "BASH_LINENO", "BASH_SOURCE", "FUNCNAME", "BASH_CMDS",
    "BASH_ALIASES", "BASH_SUBSHELL", "BASH_COMMAND", "BASH_REMATCH", "BASH", "RANDOM", "SRANDOM", "SECONDS",
    "LINENO", "EPOCHSECONDS", "EPOCHREALTIME", "HISTCMD", "DIRSTACK", "PIPESTATUS", "SHLVL", "PWD", "OLDPWD",
    "_", "BASH_COMPAT", "BASH_LOADABLES_PATH"})
#: Queue (a Slurm partition, a list of them, a Kubernetes queue's name): never an option or a line.
QUEUE_RE = re.compile(r"[A-Za-z0-9_.-]{1,64}(?:,[A-Za-z0-9_.-]{1,64}){0,15}\Z")
#: An MPI launcher's command line, shell-quoted (``shlex.join`` of command + args), at most: it
#: reaches the ranks in one environment string on every backend, whose Linux limit
#: (MAX_ARG_STRLEN, 128 KiB) holds ``DLSCHED_MPI_ARGV=`` too.
ARGV_MAX_BYTES = 131072 - len("DLSCHED_MPI_ARGV") - 2

MAX_SPEC_BYTES = 256 * 1024
MAX_GROUPS = 16
MAX_LIST_ENTRIES = 1000  # command, args, env, labels entries each
MAX_STRING_BYTES = 64 * 1024
MAX_REPLICAS = 10_000  # per group
MAX_PROCESSES_PER_REPLICA = 1024
MAX_PROCESSES = 100_000  # replicas x processes over the job
# What the job weighs once every process carries its own copy of its group's command, args,
# env and working dir (Slurm exports per process, Kubernetes writes env per container): the
# bound on what any renderer may produce from one spec. Without it, a 200 KB spec of 10,000
# replicas asked the Slurm renderer for a 20 GB script and Kubernetes' for 20 GB of YAML.
MAX_EXPANDED_BYTES = 16 * 1024 * 1024
#: What one task adds to every PS_WORKER process's TF_CONFIG ('"host:port",'), counted as a
#: long host name: a PS_WORKER job of about 590 tasks is the most that fits the bound above.
TF_CONFIG_TASK_BYTES = 48
MAX_RETRIES = 10
MAX_LABEL = 63
MAX_LABEL_PREFIX = 253
MAX_LABEL_KEY = MAX_LABEL_PREFIX + 1 + MAX_LABEL
MAX_CPU = 100_000.0
MAX_MEMORY_BYTES = 1 << 60
MAX_GPUS = 10_000
MAX_TIME_LIMIT_SECONDS = 366 * 24 * 3600.0

# Run modes by their API numbers (dlsched.v1.RunMode).
SINGLE_PROCESS, MULTI_PROCESS, PS_WORKER, MASTER_WORKER, MPI = 1, 2, 3, 4, 5
MODE_NAMES = {SINGLE_PROCESS: "SINGLE_PROCESS", MULTI_PROCESS: "MULTI_PROCESS", PS_WORKER: "PS_WORKER",
              MASTER_WORKER: "MASTER_WORKER", MPI: "MPI"}
#: Cluster types by their API numbers (dlsched.v1.ClusterType); 0, unspecified, means any type
#: in a ClusterSelector and is refused where a cluster is registered.
CLUSTER_TYPE_NAMES = {1: "LOCAL", 2: "SLURM", 3: "KUBERNETES", 4: "RAY"}
#: Roles each mode accepts, in rank / layout order.
ROLES: Mapping[int, tuple[str, ...]] = {
    MULTI_PROCESS: ("worker",),
    MASTER_WORKER: ("master", "worker"),
    PS_WORKER: ("chief", "ps", "worker", "evaluator"),
    MPI: ("launcher", "worker"),
}
#: Roles that must be present.
REQUIRED: Mapping[int, tuple[str, ...]] = {
    MULTI_PROCESS: ("worker",),
    MASTER_WORKER: ("master",),
    PS_WORKER: ("ps", "worker"),
    MPI: ("launcher", "worker"),
}
#: Roles limited to one replica.
SINGLETON: Mapping[int, tuple[str, ...]] = {
    MASTER_WORKER: ("master",),  # one replica; several processes are fine
    PS_WORKER: ("chief", "evaluator"),
    MPI: ("launcher",),
}


class _Resources(Protocol):
    @property
    def cpu(self) -> float: ...
    @property
    def memory_bytes(self) -> int: ...
    @property
    def gpus(self) -> int: ...
    @property
    def gpu_type(self) -> str: ...


class _Group(Protocol):
    @property
    def role(self) -> str: ...
    @property
    def replicas(self) -> int: ...
    @property
    def processes_per_replica(self) -> int: ...
    @property
    def image(self) -> str: ...
    @property
    def working_dir(self) -> str: ...
    @property
    def command(self) -> Sequence[str]: ...
    @property
    def args(self) -> Sequence[str]: ...
    @property
    def env(self) -> Mapping[str, str]: ...
    @property
    def resources(self) -> _Resources: ...


def _groups(spec: Any) -> Sequence[_Group]:
    return spec.replica_groups  # type: ignore[no-any-return]


def _processes(g: _Group) -> int:
    return max(1, g.processes_per_replica)


def _strings(spec: Any) -> Iterator[tuple[str, str]]:
    yield "spec.queue", spec.queue
    for k, v in spec.labels.items():
        yield "spec.labels", k
        yield "spec.labels", v
    for i, g in enumerate(_groups(spec)):
        f = f"spec.replica_groups[{i}]"
        yield f"{f}.role", g.role
        yield f"{f}.image", g.image
        yield f"{f}.working_dir", g.working_dir
        yield f"{f}.resources.gpu_type", g.resources.gpu_type
        for j, a in enumerate(g.command):
            yield f"{f}.command[{j}]", a
        for j, a in enumerate(g.args):
            yield f"{f}.args[{j}]", a
        for k, v in g.env.items():
            yield f"{f}.env", k
            yield f"{f}.env[{k[:40]!r}]", v


def check_bounds(spec: Any, spec_bytes: int | None = None, field: str = "spec") -> list[FieldViolation]:
    """What bounds the work: sizes and counts. Run first; nothing else walks a spec over them."""
    if spec_bytes is not None and spec_bytes > MAX_SPEC_BYTES:
        return [FieldViolation(field, f"serialized spec is {spec_bytes} bytes, at most {MAX_SPEC_BYTES}")]
    groups = _groups(spec)
    if len(groups) > MAX_GROUPS:
        return [FieldViolation(f"{field}.replica_groups", f"{len(groups)} groups, at most {MAX_GROUPS}")]
    if len(spec.labels) > MAX_LIST_ENTRIES:
        return [FieldViolation(f"{field}.labels", f"at most {MAX_LIST_ENTRIES} labels")]
    out: list[FieldViolation] = []
    total = 0
    for i, g in enumerate(groups):
        f = f"{field}.replica_groups[{i}]"
        for what, n in (("command", len(g.command)), ("args", len(g.args)), ("env", len(g.env))):
            if n > MAX_LIST_ENTRIES:
                out.append(FieldViolation(f"{f}.{what}", f"{n} entries, at most {MAX_LIST_ENTRIES}"))
        if g.replicas > MAX_REPLICAS:
            out.append(FieldViolation(f"{f}.replicas", f"1 to {MAX_REPLICAS}, got {g.replicas}"))
        if g.processes_per_replica > MAX_PROCESSES_PER_REPLICA:
            out.append(FieldViolation(f"{f}.processes_per_replica",
                                      f"0 to {MAX_PROCESSES_PER_REPLICA}, got {g.processes_per_replica}"))
        total += max(0, g.replicas) * max(1, g.processes_per_replica)
    if not out and total > MAX_PROCESSES:
        out.append(FieldViolation(f"{field}.replica_groups",
                                  f"{total} processes in all (replicas x processes_per_replica), "
                                  f"at most {MAX_PROCESSES}"))
    if out:
        return out
    for where, s in _strings(spec):
        if len(s) > MAX_STRING_BYTES or len(s.encode("utf-8", "surrogatepass")) > MAX_STRING_BYTES:
            return [FieldViolation(where.replace("spec", field, 1), f"at most {MAX_STRING_BYTES} bytes")]
    expanded = sum(max(0, g.replicas) * max(1, g.processes_per_replica) * _per_process_bytes(g)
                   for g in groups)
    if int(getattr(spec, "run_mode", 0)) == PS_WORKER:
        # Each task's TF_CONFIG lists every task of the cluster: bytes square in the tasks.
        tasks = sum(max(0, g.replicas) for g in groups if g.role != "evaluator")
        expanded += sum(max(0, g.replicas) for g in groups) * tasks * TF_CONFIG_TASK_BYTES
    if expanded > MAX_EXPANDED_BYTES:
        return [FieldViolation(f"{field}.replica_groups",
                               f"{expanded} bytes of command, args, env and working dir once every "
                               f"process has its own copy (with PS_WORKER, a TF_CONFIG naming every "
                               f"task), at most {MAX_EXPANDED_BYTES}: use fewer replicas or a smaller "
                               "env (e.g. a file the job reads)")]
    return []


def _per_process_bytes(g: _Group) -> int:
    """The bytes of one process's command, args, env and working dir (characters: a bound)."""
    return (len(g.working_dir) + sum(len(a) + 1 for a in g.command) + sum(len(a) + 1 for a in g.args)
            + sum(len(k) + len(v) + 2 for k, v in g.env.items()))


def _labels(out: list[FieldViolation], field: str, labels: Mapping[str, str]) -> None:
    for k, val in labels.items():
        prefix, _, name = k.rpartition("/")
        if not k or len(k) > MAX_LABEL_KEY or len(name) > MAX_LABEL or len(prefix) > MAX_LABEL_PREFIX \
                or not LABEL_KEY_RE.match(k):
            out.append(FieldViolation(f"{field}[{k[:40]!r}]", "label keys: a name of up to 63 characters "
                                      "[A-Za-z0-9-_.], alphanumeric at both ends, after an optional "
                                      "DNS subdomain prefix of up to 253 and '/'"))
        if len(val) > MAX_LABEL or not LABEL_VALUE_RE.match(val):
            out.append(FieldViolation(f"{field}[{k[:40]!r}]", "label values: up to 63 characters "
                                      "[A-Za-z0-9-_.], alphanumeric at both ends"))


def check_group(out: list[FieldViolation], f: str, g: _Group, *, admission: bool = False,
                mpi_launcher: bool = False) -> None:
    """One replica group's own fields (not its run-mode role rules)."""
    if g.replicas < 1:
        out.append(FieldViolation(f"{f}.replicas", f"1 to {MAX_REPLICAS}, got {g.replicas}"))
    if g.processes_per_replica < 0:
        out.append(FieldViolation(f"{f}.processes_per_replica",
                                  f"0 to {MAX_PROCESSES_PER_REPLICA}, got {g.processes_per_replica}"))
    if not ROLE_RE.match(g.role):
        out.append(FieldViolation(f"{f}.role", "1 to 63 characters: lower case letters, digits and '-', "
                                  "starting with a letter"))
    if not g.command:
        out.append(FieldViolation(f"{f}.command", "must not be empty"))
    elif not g.command[0]:
        out.append(FieldViolation(f"{f}.command[0]", "the program must not be empty"))
    nul = False
    for name, items in (("command", g.command), ("args", g.args)):
        for j, a in enumerate(items):
            if "\x00" in a:
                out.append(FieldViolation(f"{f}.{name}[{j}]", "must not contain NUL"))
                nul = True
    if mpi_launcher and not nul and len(shlex.join([*g.command, *g.args]).encode()) > ARGV_MAX_BYTES:
        out.append(FieldViolation(f"{f}.args" if g.args else f"{f}.command",
                                  f"an MPI launcher's command line, shell-quoted, must fit in {ARGV_MAX_BYTES} "
                                  "bytes (it reaches the ranks in one environment string)"))
    for k, v in g.env.items():
        if not ENV_NAME_RE.match(k):
            out.append(FieldViolation(f"{f}.env[{k[:40]!r}]", "names match [A-Za-z_][A-Za-z0-9_]*"))
        elif k.upper().startswith(RESERVED_ENV_PREFIX):
            out.append(FieldViolation(f"{f}.env[{k[:40]!r}]",
                                      f"names starting with {RESERVED_ENV_PREFIX} (any case) are reserved"))
        elif admission and k in SHELL_ENV_NAMES:
            out.append(FieldViolation(f"{f}.env[{k!r}]", "a name the launch scripts' shell owns (it would "
                                                        "not reach the job as given); use another name"))
        if "\x00" in v:
            out.append(FieldViolation(f"{f}.env[{k[:40]!r}]", "the value must not contain NUL"))
    for name in ("image", "working_dir"):
        if "\x00" in getattr(g, name):
            out.append(FieldViolation(f"{f}.{name}", "must not contain NUL"))
    check_resources(out, f, g.resources)


def check_resources(out: list[FieldViolation], f: str, r: Any) -> None:
    """A replica group's resources (``f``: the group's field): finite, in range."""
    if not (math.isfinite(r.cpu) and 0 <= r.cpu <= MAX_CPU):
        out.append(FieldViolation(f"{f}.resources.cpu", f"a finite number from 0 to {MAX_CPU:g}"))
    if not 0 <= r.memory_bytes <= MAX_MEMORY_BYTES:
        out.append(FieldViolation(f"{f}.resources.memory_bytes", f"0 to {MAX_MEMORY_BYTES}"))
    if not 0 <= r.gpus <= MAX_GPUS:
        out.append(FieldViolation(f"{f}.resources.gpus", f"0 to {MAX_GPUS}"))
    if len(r.gpu_type) > MAX_LABEL or not LABEL_VALUE_RE.match(r.gpu_type):
        # What every backend takes: a Kubernetes node-label value, a Slurm GRES type.
        out.append(FieldViolation(f"{f}.resources.gpu_type", "up to 63 characters [A-Za-z0-9-_.], "
                                  "alphanumeric at both ends (e.g. a100, NVIDIA-A100-SXM4-80GB)"))


def check_run_mode(run_mode: int, groups: Sequence[_Group], field: str = "spec") -> list[FieldViolation]:
    """The run mode's structural rules (roles, replicas, processes)."""
    out: list[FieldViolation] = []
    gf = f"{field}.replica_groups"
    if run_mode not in MODE_NAMES:
        return [FieldViolation(f"{field}.run_mode", (f"unknown value {run_mode}" if run_mode else "required")
                               + ": one of " + ", ".join(f"RUN_MODE_{n}" for n in MODE_NAMES.values()))]
    name = f"RUN_MODE_{MODE_NAMES[run_mode]}"
    if not groups:
        return [FieldViolation(gf, "at least one replica group")]
    if run_mode == SINGLE_PROCESS:
        if len(groups) != 1:
            out.append(FieldViolation(gf, f"{name} takes exactly one replica group"))
        else:
            g = groups[0]
            if g.replicas != 1:
                out.append(FieldViolation(f"{gf}[0].replicas", f"{name} takes one replica"))
            if _processes(g) != 1:
                out.append(FieldViolation(f"{gf}[0].processes_per_replica", f"{name} takes one process"))
        return out
    allowed = ROLES[run_mode]
    if run_mode == MULTI_PROCESS and len(groups) != 1:
        out.append(FieldViolation(gf, f"{name} takes exactly one replica group"))
    seen: set[str] = set()
    for i, g in enumerate(groups):
        if g.role in seen:
            out.append(FieldViolation(f"{gf}[{i}].role", f"duplicate role {g.role!r}"))
        seen.add(g.role)
        if g.role not in allowed:
            out.append(FieldViolation(f"{gf}[{i}].role", f"{name} takes roles " + ", ".join(map(repr, allowed))))
            continue
        if g.role in SINGLETON.get(run_mode, ()) and g.replicas != 1:
            out.append(FieldViolation(f"{gf}[{i}].replicas", f"{name} takes one {g.role!r} replica"))
        one_process = run_mode == PS_WORKER or (run_mode == MPI and g.role == "launcher")
        if one_process and _processes(g) != 1:
            out.append(FieldViolation(f"{gf}[{i}].processes_per_replica",
                                      f"{name} runs one process per {g.role!r} replica"))
    for role in REQUIRED[run_mode]:
        if role not in seen:
            out.append(FieldViolation(gf, f"{name} needs a {role!r} replica group"))
    return out


def check_spec(spec: Any, *, time_limit_seconds: float | None, spec_bytes: int | None = None,
               field: str = "spec", admission: bool = False) -> list[FieldViolation]:
    """Every violation of the unified spec (bounds first: over them, only those are reported).
    ``admission``: SubmitJob's check, which also refuses what some backend cannot run as given
    (env names the launch scripts' shell owns, a queue that is no partition list); a driver's
    own check leaves them to its renderer, so a job stored before those rules still launches."""
    out = check_bounds(spec, spec_bytes, field)
    if out:
        return out
    groups = _groups(spec)
    for i, g in enumerate(groups):
        check_group(out, f"{field}.replica_groups[{i}]", g, admission=admission,
                    mpi_launcher=int(spec.run_mode) == MPI and g.role == "launcher")
    out += check_run_mode(int(spec.run_mode), groups, field)
    if not 0 <= spec.max_retries <= MAX_RETRIES:
        out.append(FieldViolation(f"{field}.max_retries", f"0 to {MAX_RETRIES}, got {spec.max_retries}"))
    if time_limit_seconds is not None and not (
            math.isfinite(time_limit_seconds) and 0 < time_limit_seconds <= MAX_TIME_LIMIT_SECONDS):
        out.append(FieldViolation(f"{field}.time_limit",
                                  f"more than 0 and at most {MAX_TIME_LIMIT_SECONDS:.0f} s (366 days)"))
    if spec.queue and "\x00" in spec.queue:
        out.append(FieldViolation(f"{field}.queue", "must not contain NUL"))
    elif admission and spec.queue and not QUEUE_RE.match(spec.queue):
        out.append(FieldViolation(f"{field}.queue", "letters, digits, '_', '.' and '-' (1 to 64), or a "
                                                    "comma-separated list of up to 16 such names"))
    out += check_cluster_type(int(spec.cluster_selector.cluster_type), f"{field}.cluster_selector.cluster_type",
                              allow_unspecified=True)
    _labels(out, f"{field}.labels", spec.labels)
    return out


def check_time_limit(d: Any, field: str) -> None:
    """A spec's ``time_limit`` Duration as given (before any conversion normalises it): a valid
    Duration, at most 366 days exactly; else INVALID_ARGUMENT naming ``field``."""
    check_duration(d, field)
    if time_limit_over(d.seconds, d.nanos):
        raise InvalidArgument.for_field(field, "at most 366 days")


def time_limit_over(seconds: int, nanos: int) -> bool:
    """Whether a Duration (valid, as ``timeutil.check_duration`` says) is past the time limit's
    bound, compared exactly (a float of 366 days and 1 ns is 366 days)."""
    return (seconds, nanos) > (int(MAX_TIME_LIMIT_SECONDS), 0)


def check_cluster_type(value: int, field: str, *, allow_unspecified: bool) -> list[FieldViolation]:
    """A ClusterType a client sent: a known value (an unknown one is never read as "any")."""
    if value in CLUSTER_TYPE_NAMES or (value == 0 and allow_unspecified):
        return []
    names = ", ".join(f"CLUSTER_TYPE_{n}" for n in CLUSTER_TYPE_NAMES.values())
    return [FieldViolation(field, (f"unknown value {value}" if value else "required") + f": one of {names}"
                           + (" (or unset for any)" if allow_unspecified else ""))]


#: a selector's cluster: its name (``clusters/{id}``) or its id, nothing around it
SELECTED_CLUSTER_RE = re.compile(r"(?:clusters/)?" + ID_RE.pattern)


def check_selected_cluster(value: str, field: str) -> list[FieldViolation]:
    """``cluster_selector.cluster``: empty (any cluster), or a cluster's name or id, whole."""
    if not value or SELECTED_CLUSTER_RE.match(value):
        return []
    return [FieldViolation(field, "a cluster's name (clusters/{id}) or id: 1 to 63 lower case letters, "
                                  "digits and '-', starting with a letter")]


def check_for_cluster_type(spec: Any, cluster_type: int) -> list[FieldViolation]:
    """What the driver of ``cluster_type`` would refuse for the spec's shape, checked once the
    cluster is chosen (SubmitJob), so that a job is refused at once and not stored to fail at
    its launch (LaunchRejected). The drivers check again (``render.check``)."""
    out: list[FieldViolation] = []
    for i, g in enumerate(_groups(spec)):
        wd = str(g.working_dir)
        if not wd or wd.startswith("/") or "://" in wd:
            continue
        f = f"spec.replica_groups[{i}].working_dir"
        if cluster_type == 1 and posixpath.normpath(wd).split("/", 1)[0] == "..":  # LOCAL
            out.append(FieldViolation(f, "a relative working directory must stay inside the attempt directory"))
        elif cluster_type == 3 and not (int(spec.run_mode) == MPI and g.role != "launcher"):  # KUBERNETES
            # (MPI workers run sshd, not the command: their working_dir is not used)
            out.append(FieldViolation(f, "must be an absolute path on Kubernetes"))
    return out


def check_labels(labels: Mapping[str, str], field: str) -> list[FieldViolation]:
    out: list[FieldViolation] = []
    _labels(out, field, labels)
    return out


def unique(violations: Iterable[FieldViolation]) -> list[FieldViolation]:
    """Violations without repeats, in order."""
    seen: set[tuple[str, str]] = set()
    out = []
    for v in violations:
        if (v.field, v.description) not in seen:
            seen.add((v.field, v.description))
            out.append(v)
    return out
