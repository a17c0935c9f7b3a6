"""Translate a job into a Ray Jobs submission: a pure function of (job, attempt, cluster options).

``render_submission(job_id, spec, attempt, options)`` returns the JSON body
``RayDriver.launch`` POSTs to ``/api/jobs/`` (and ``RenderJob`` returns, as
``application/json`` with sorted keys, so it is golden-file tested). No I/O,
no clock.

The submission:

- ``submission_id`` is ``dlsched-{job_id}-{attempt}_{uid}`` (``dlsched-{job_id}-{attempt}``
  for a launch without the job's uid, and for submissions made before uids
  were in the id): Ray refuses a second submission with the same id, so a
  retried launch can never start a second job, and a job id used again (a
  new job, a new uid) never reuses an id Ray has seen. Ray's job monitor of
  a deleted submission may still be running; a new submission of the same
  id would be taken for its dead supervisor and failed. ``metadata`` carries ``dlsched_job_id``, ``dlsched_attempt`` and
  ``dlsched_run_mode`` (plus ``dlsched_time_limit_seconds``, and
  ``dlsched_job_uid`` when the launch gives the job's uid: a submission of the
  same id with another uid is another job's, never adopted); the poller
  knows our jobs by them, and only under the id they derive
  (``parse_submission``): anything in the cluster can POST our metadata.
- ``entrypoint`` is always ``exec <python> -m drivers.ray.launcher``, the
  in-cluster launcher (``drivers.ray.launcher``); ``<python>`` is cluster
  option ``python`` (default ``python``), an interpreter on the cluster that
  can import ``dlsched[ray]``. The job reaches it as JSON in the
  ``DLSCHED_RAY_JOB`` variable (``runtime_env.env_vars``), so no user value
  is in the command line Ray hands to ``/bin/sh``; the launcher starts each
  process with its argv as a list, never through a shell. Ray expands
  ``$VAR`` in env_vars values: every ``$`` there is written ``\u0024``.
  Ray hands the whole runtime_env to each worker of the job as one argument
  on its command line, where Linux takes at most 128 KiB per string: a job
  over ``MAX_JOB_ENV_BYTES`` encoded is INVALID_ARGUMENT (its workers could
  never start: the job waited ~6 minutes, then failed
  JobSupervisorActorUnschedulable).
- ``runtime_env.working_dir`` only when a group's working directory is a URI
  Ray fetches (``s3://``, ``gs://``, ``https://...zip``, ``gcs://``); a plain
  path is a directory on the cluster's nodes, the process's cwd.
- ``entrypoint_num_cpus`` / ``entrypoint_num_gpus`` / ``entrypoint_memory``
  (SINGLE_PROCESS, MULTI_PROCESS): what the entrypoint's processes ask for
  (a resource left 0 is omitted: Ray's default).

Run modes:

- SINGLE_PROCESS, MULTI_PROCESS: the launcher in ``local`` mode: it starts
  every process of the plan on the entrypoint's node (``MASTER_ADDR``
  127.0.0.1) and reports the first failure; resources are the sum over
  replicas. A single process runs under the launcher too, so its stdout and
  stderr stay apart, Ray's own lines stay out of them, and it is measured.
- MASTER_WORKER, PS_WORKER: the launcher in ``placement-group`` mode: it
  reserves one bundle per replica (the replica's CPUs, GPUs, memory) in a
  placement group (strategy: cluster option ``placement_strategy``, default
  ``PACK``), learns each bundle's node and a free port there, plans
  the job with those placements through ``drivers.common.planner`` (so
  ``MASTER_ADDR``/``RANK`` and ``TF_CONFIG`` are exactly those of every other
  backend) and runs one task per replica that starts its processes.
  The entrypoint itself asks for nothing.
- MPI: refused, FAILED_PRECONDITION ``MPI_NOT_SUPPORTED``.
"""

from __future__ import annotations

import json
import re
import shlex
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

from dlsched.errors import FailedPrecondition, InvalidArgument
from drivers.common import planner
from drivers.common.base import JobSpec, NativeSpec, ReplicaGroup, RunMode

MEDIA_TYPE = "application/json"
LAUNCHER_MODULE = "drivers.ray.launcher"
JOB_ENV = "DLSCHED_RAY_JOB"
#: Seconds between the SIGTERM and the SIGKILL of the processes a stop or the success rule ends
#: (the launcher's grace, as local's).
STOP_GRACE_SECONDS = 5.0
#: Ray's job supervisor SIGKILLs what a stop's SIGTERM left after RAY_JOB_STOP_WAIT_TIME_S (3 s
#: by default), the launcher too, before it recorded the replicas' ends (a process taking its
#: grace lost every replica's exit code): the supervisor, which runs with the job's runtime_env,
#: is told to wait the grace and the record's writing.
STOP_WAIT_ENV = "RAY_JOB_STOP_WAIT_TIME_S"
STOP_WAIT_SECONDS = int(STOP_GRACE_SECONDS) + 10
#: the most bytes of ``DLSCHED_RAY_JOB`` (Ray passes the runtime_env, JSON, as one argument of each
#: worker's command line: Linux's 128 KiB per string, less the rest of it)
MAX_JOB_ENV_BYTES = 112 * 1024
META_JOB_ID = "dlsched_job_id"
META_ATTEMPT = "dlsched_attempt"
META_JOB_UID = "dlsched_job_uid"
META_TIME_LIMIT = "dlsched_time_limit_seconds"  # the driver stops the job after it (Ray has no limit)
LOCAL_HOST = "127.0.0.1"
URI_RE = re.compile(r"^[a-z][a-z0-9+.-]*://")
STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")
LOCAL_MODES = (RunMode.SINGLE_PROCESS, RunMode.MULTI_PROCESS)  # every process on the entrypoint's node
SUPPORTED_RUN_MODES = (RunMode.SINGLE_PROCESS, RunMode.MULTI_PROCESS, RunMode.PS_WORKER,
                       RunMode.MASTER_WORKER)


class MpiNotSupported(FailedPrecondition):
    """The Ray backend does not run MPI jobs."""

    reason = "MPI_NOT_SUPPORTED"

    def __init__(self) -> None:
        super().__init__(
            "RUN_MODE_MPI is not supported on Ray clusters: Ray Jobs starts one entrypoint "
            "process and Ray tasks, not an mpirun with a hostfile of its nodes and their sshd "
            "or PMIx launcher; run MPI jobs on a Slurm or local cluster, or use "
            "RUN_MODE_MASTER_WORKER (torch.distributed) on Ray",
            metadata={"run_mode": "RUN_MODE_MPI"})


@dataclass(frozen=True)
class RayOptions:
    """Cluster options the Ray driver reads (``Cluster.options``)."""

    python: str = "python"
    placement_strategy: str = "PACK"

    @classmethod
    def from_mapping(cls, options: Mapping[str, str]) -> RayOptions:
        o = cls(python=options.get("python", cls.python),
                placement_strategy=options.get("placement_strategy", cls.placement_strategy))
        if not o.python:
            raise InvalidArgument.for_field("cluster.options[python]", "must not be empty")
        if o.placement_strategy not in STRATEGIES:
            raise InvalidArgument.for_field("cluster.options[placement_strategy]",
                                            "one of " + ", ".join(STRATEGIES))
        return o


def submission_id(job_id: str, attempt: int, uid: str = "") -> str:
    """The submission's id (the uid without dashes: one id however the uid is written); ``_``
    is in neither a job id nor a uid (``carries_uid``)."""
    return f"dlsched-{job_id}-{attempt}_{uid.replace('-', '')}" if uid else f"dlsched-{job_id}-{attempt}"


def carries_uid(sid: str) -> bool:
    """Whether a submission id names its job's uid: one no later job of the same id uses again."""
    return "_" in sid


def is_uri(path: str) -> bool:
    return bool(URI_RE.match(path))


def _resources(groups: tuple[ReplicaGroup, ...]) -> dict[str, float | int]:
    cpu = sum(g.replicas * g.resources.cpu for g in groups)
    gpus = sum(g.replicas * g.resources.gpus for g in groups)
    mem = sum(g.replicas * g.resources.memory_bytes for g in groups)
    out: dict[str, float | int] = {}
    if cpu > 0:
        out["entrypoint_num_cpus"] = cpu
    if gpus > 0:
        out["entrypoint_num_gpus"] = gpus
    if mem > 0:
        out["entrypoint_memory"] = mem
    return out


def _runtime_env(env_vars: Mapping[str, str], working_dir: str) -> dict[str, Any]:
    rt: dict[str, Any] = {"env_vars": dict(env_vars)}
    if working_dir and is_uri(working_dir):
        rt["working_dir"] = working_dir
    return rt


def _group_json(g: ReplicaGroup) -> dict[str, Any]:
    d = asdict(g)
    d["command"], d["args"], d["env"] = list(g.command), list(g.args), dict(g.env)
    return d


def spec_to_json(spec: JobSpec) -> dict[str, Any]:
    """The parts of the spec the launcher needs, as JSON."""
    return {"run_mode": spec.run_mode.name, "replica_groups": [_group_json(g) for g in spec.replica_groups]}


def spec_from_json(doc: Mapping[str, Any]) -> JobSpec:
    from drivers.common.base import Resources

    groups = []
    for g in doc["replica_groups"]:
        groups.append(ReplicaGroup(
            role=g["role"], replicas=g["replicas"], command=tuple(g["command"]), args=tuple(g["args"]),
            processes_per_replica=g["processes_per_replica"], image=g.get("image", ""),
            env=dict(g["env"]), working_dir=g.get("working_dir", ""),
            resources=Resources(**g["resources"])))
    return JobSpec(run_mode=RunMode[doc["run_mode"]], replica_groups=tuple(groups))


@dataclass(frozen=True)
class RaySubmission:
    """The rendered request: the ``POST /api/jobs/`` body, sent as is."""

    body: Mapping[str, Any]

    @property
    def submission_id(self) -> str:
        return str(self.body["submission_id"])

    @property
    def uid(self) -> str:
        return str(self.body["metadata"].get(META_JOB_UID, ""))

    def native_spec(self) -> NativeSpec:
        return to_native_spec(self.body)


@dataclass(frozen=True)
class SubmissionMeta:
    """What the driver reads back from a listed submission (``parse_submission``)."""

    job_id: str
    attempt: int
    submission_id: str
    uid: str = ""  #: the job's uid (``META_JOB_UID``), "" for none


def uid_of(it: Mapping[str, Any]) -> str:
    """The job uid a submission's metadata carries ("" for none)."""
    return str((it.get("metadata") or {}).get(META_JOB_UID) or "")


def parse_submission(it: Mapping[str, Any]) -> SubmissionMeta | None:
    """The dlsched metadata of a ``GET /api/jobs/`` entry; ``None`` for other jobs.

    Only a submission whose id is the one its metadata derives (``submission_id`` of its
    job, attempt and uid, or of job and attempt alone: made before ids named uids) is one
    a driver made: anything in the cluster may POST a job with our metadata under an id
    of its own choosing, never to be taken for the job it names (nor stopped or deleted
    for it)."""
    if it.get("type") != "SUBMISSION":
        return None
    meta = it.get("metadata") or {}
    job_id, sid = meta.get(META_JOB_ID), it.get("submission_id")
    try:
        attempt = int(meta.get(META_ATTEMPT, ""))
    except (TypeError, ValueError):
        return None
    if not isinstance(job_id, str) or not job_id or not isinstance(sid, str) or not sid:
        return None
    uid = uid_of(it)
    if sid not in (submission_id(job_id, attempt, uid), submission_id(job_id, attempt)):
        return None
    return SubmissionMeta(job_id, attempt, sid, uid)


def check(spec: JobSpec, options: Mapping[str, str] | None = None) -> RayOptions:
    """The spec and options a Ray cluster can run; raises InvalidArgument / ``MpiNotSupported``."""
    opts = RayOptions.from_mapping(options or {})
    if spec.run_mode is RunMode.MPI:
        raise MpiNotSupported()
    planner.check_run_mode(spec)
    planner.check_no_images(spec, "Ray")
    first = next((g.working_dir for g in spec.replica_groups if g.working_dir and is_uri(g.working_dir)), "")
    for i, g in enumerate(spec.replica_groups):
        if g.working_dir and is_uri(g.working_dir) and g.working_dir != first:
            raise InvalidArgument.for_field(f"spec.replica_groups[{i}].working_dir",
                                            "Ray takes one working_dir URI per job")
    return opts


def render(job_id: str, spec: JobSpec, attempt: int, options: Mapping[str, str] | None = None,
           uid: str = "") -> RaySubmission:
    """check → emit (Ray places replicas itself: the launcher's placement group)."""
    return RaySubmission(render_submission(job_id, spec, attempt, options, uid))


def render_submission(job_id: str, spec: JobSpec, attempt: int,
                      options: Mapping[str, str] | None = None, uid: str = "") -> dict[str, Any]:
    """The ``POST /api/jobs/`` body. Raises InvalidArgument / ``MpiNotSupported``."""
    opts = check(spec, options)
    sid = submission_id(job_id, attempt, uid)
    body: dict[str, Any] = {
        "submission_id": sid,
        "metadata": {META_JOB_ID: job_id, META_ATTEMPT: str(attempt),
                     "dlsched_run_mode": f"RUN_MODE_{spec.run_mode.name}"},
    }
    if uid:
        body["metadata"][META_JOB_UID] = uid
    if spec.time_limit_seconds:
        body["metadata"][META_TIME_LIMIT] = repr(float(spec.time_limit_seconds))
    launcher = {
        "job_id": job_id,
        "attempt": attempt,
        "submission_id": sid,
        "mode": "local" if spec.run_mode in LOCAL_MODES else "placement-group",
        "placement_strategy": opts.placement_strategy,
        "spec": spec_to_json(spec),
    }
    # exec: Ray runs the entrypoint through /bin/sh, which forks (dash) unless told to exec: a
    # stop that came as the job started signalled the shell alone, and the launcher it forked a
    # moment later ran the whole job, untracked (Ray and dlsched said STOPPED)
    body["entrypoint"] = "exec " + shlex.join([opts.python, "-m", LAUNCHER_MODULE])
    uris = {g.working_dir for g in spec.replica_groups if g.working_dir and is_uri(g.working_dir)}
    body["runtime_env"] = _runtime_env(job_env(job_env_value(launcher)),
                                       next(iter(uris)) if len(uris) == 1 else "")
    if spec.run_mode in LOCAL_MODES:
        body.update(_resources(spec.replica_groups))
    return body


def job_env_value(launcher: Mapping[str, Any]) -> str:
    """The launcher's job as the JSON of ``DLSCHED_RAY_JOB``, with no ``$`` in it: Ray expands
    ``$VAR``/``${VAR}`` in every ``runtime_env.env_vars`` value and deletes a ``${VAR}`` it does
    not know, so an argv or env value of the job holding one would arrive changed. ``$`` only
    occurs inside JSON strings, where ``\\u0024`` is the same character to any JSON reader."""
    return json.dumps(launcher, sort_keys=True, separators=(",", ":")).replace("$", "\\u0024")


def job_env(value: str) -> dict[str, str]:
    """The variable that carries ``value`` (``job_env_value``: ASCII). InvalidArgument past
    ``MAX_JOB_ENV_BYTES``."""
    if len(value) > MAX_JOB_ENV_BYTES:
        raise InvalidArgument.for_field(
            "spec.replica_groups", f"the job's commands, arguments and environment take {len(value)} bytes "
            f"encoded for the Ray launcher, over this driver's {MAX_JOB_ENV_BYTES} (Ray passes them on "
            "the command line of every worker of the job; '$' and non-ASCII characters take 6 bytes); "
            "ship large inputs as files")
    return {JOB_ENV: value, STOP_WAIT_ENV: str(STOP_WAIT_SECONDS)}


def job_from_env(environ: Mapping[str, str]) -> Any:
    """The launcher's job from the variable ``job_env`` made."""
    return json.loads(environ[JOB_ENV])


def to_native_spec(body: Mapping[str, Any]) -> NativeSpec:
    return NativeSpec(media_type=MEDIA_TYPE, content=json.dumps(body, indent=2, sort_keys=True) + "\n")
