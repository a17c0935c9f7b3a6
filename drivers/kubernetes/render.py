"""Translate a job into Kubernetes manifests: a pure function of (job, cluster options).

``render_job(job_id, spec, attempt, options)`` returns the ``Rendered`` job:
the manifests (plain dicts, the JSON the API server takes) that
``KubernetesDriver.launch`` creates, in creation order, and that
``RenderJob`` returns as ``application/yaml`` (one document per object,
sorted keys, so it is golden-file testable). No I/O, no clock, no
randomness; only built-in objects, no operator.

Objects, per attempt (names from ``naming``): a headless Service
(``clusterIP: None``, selecting the attempt's pods,
``publishNotReadyAddresses`` so names resolve as soon as a pod has an IP),
the owner of everything else; one Pod per replica with ``hostname`` and
``subdomain`` giving it a stable name, the planner's late-resolving
placement (``MASTER_ADDR``, ``TF_CONFIG``); ``restartPolicy: Never``
(retries are JobManager's, as new attempts), ``enableServiceLinks: false``,
``activeDeadlineSeconds`` from the time limit. Labels and the annotations
a restarted driver rebuilds a job from are ``naming``'s (the metadata
codec, encode and decode in one module). The rendered owner references
carry ``uid: ""``: ``launch`` fills in the Service's uid
(``with_owner_uid``) once it is created.

Three steps: ``check`` (InvalidArgument with every field this backend
cannot take), ``place`` (one pod per replica, each a node of its own, and
the planner's processes for it) and ``emit`` (the manifests).

Containers: one per process of the replica (``processes_per_replica``; the
planner gives each its own ``RANK`` / ``LOCAL_RANK``), named ``main`` when
there is one, else ``proc-<k>``. The command is exec form: ``command`` is the
group's command and ``args`` its args (never ``sh -c``). Environment: the
planner's variables then the user's (the planner puts the user's last), as
literal values. Image: the group's, else cluster option ``default_image``.
Resources: the replica's CPU, memory and GPUs split evenly over its
containers, as equal requests and limits (Guaranteed QoS); GPUs as the
``nvidia.com/gpu`` extended resource, ``gpu_type`` as a node selector on
``nvidia.com/gpu.product`` (the label NVIDIA GPU feature discovery sets).

Cluster options: ``namespace`` (default ``default``), ``default_image``,
``image_pull_secrets`` (comma-separated Secret names), ``service_account``
(the pods' ServiceAccount; without it a pod mounts no API token).

MPI (as MPI Operator v2 does it, with built-in objects only): ``mpi``.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import yaml

from dlsched.errors import FieldViolation, InvalidArgument
from drivers.common import planner
from drivers.common.base import JobSpec, NativeSpec, ReplicaGroup, RunMode
from drivers.kubernetes import mpi
from drivers.kubernetes.naming import (
    GPU_PRODUCT_LABEL,
    GPU_RESOURCE,
    LABEL_ATTEMPT,
    LABEL_INDEX,
    LABEL_JOB,
    LABEL_ROLE,
    LABEL_UID,
    JobMeta,
    backend_job_id,
    config_map_name,
    encode,
    hostname,
    is_label_value,
    is_subdomain,
    job_labels,
    labels_annotation,
    namespace_of,
    pod_name,
    replica_host,
    secret_name,
    service_name,
    user_labels,
)

MEDIA_TYPE = "application/yaml"
SUPPORTED_RUN_MODES = (RunMode.SINGLE_PROCESS, RunMode.MULTI_PROCESS, RunMode.PS_WORKER,
                       RunMode.MASTER_WORKER, RunMode.MPI)


def cpu_quantity(cores: float) -> str:
    """Cores -> a Kubernetes quantity: whole cores as ``"2"``, else millicores."""
    milli = math.ceil(cores * 1000 - 1e-9)
    return str(milli // 1000) if milli % 1000 == 0 else f"{milli}m"


@dataclass(frozen=True)
class PodInfo:
    """One replica's pod, as the driver tracks it."""

    name: str
    role: str
    index: int
    containers: tuple[str, ...]


@dataclass(frozen=True)
class Rendered:
    """One attempt's objects, in creation order, and what the driver tracks of them."""

    job_id: str
    attempt: int
    namespace: str
    service: str
    backend_job_id: str
    manifests: tuple[dict[str, Any], ...]
    pods: tuple[PodInfo, ...]
    success: planner.SuccessRule
    #: (kind, name) of the objects besides the Service and the Pods (MPI: the Secret, the ConfigMap).
    others: tuple[tuple[str, str], ...] = ()
    uid: str = ""  #: the job's uid, on the Service (``with_job_uid``); "" for none

    def native_spec(self) -> NativeSpec:
        return to_native_spec(self.manifests)


# libyaml's emitter where PyYAML has it: the pure-Python one took 165 s for the 20 MB of a
# 10-replica job with 200 KB of env per process.
_SafeDumper: type[yaml.SafeDumper] = getattr(yaml, "CSafeDumper", yaml.SafeDumper)


class _Dumper(_SafeDumper):  # type: ignore[valid-type,misc]
    """Multi-line strings (MPI's hostfile and ssh configs) as ``|`` blocks, readable in a dry run."""


def _str(dumper: yaml.SafeDumper, value: str) -> yaml.ScalarNode:
    style = "|" if "\n" in value.rstrip("\n") or value.endswith("\n") and len(value) > 1 else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_Dumper.add_representer(str, _str)


def to_native_spec(manifests: Sequence[Mapping[str, Any]]) -> NativeSpec:
    text = yaml.dump_all(list(manifests), Dumper=_Dumper, sort_keys=True, default_flow_style=False,
                         allow_unicode=True)
    return NativeSpec(media_type=MEDIA_TYPE, content=text)


def with_job_uid(rendered: Rendered, uid: str) -> Rendered:
    """``rendered`` with the job's ``uid`` as every object's label ``LABEL_UID`` (none when empty)."""
    if not uid:
        return rendered
    manifests = tuple({**m, "metadata": {**m["metadata"], "labels": {**m["metadata"].get("labels", {}), LABEL_UID: uid}}}
                      for m in rendered.manifests)
    return dataclasses.replace(rendered, manifests=manifests, uid=uid)


def with_owner_uid(manifest: Mapping[str, Any], uid: str) -> dict[str, Any]:
    """A copy of ``manifest`` whose owner references carry the owner's real uid."""
    meta = dict(manifest["metadata"])
    meta["ownerReferences"] = [{**r, "uid": uid} for r in meta.get("ownerReferences", ())]
    return {**manifest, "metadata": meta}


# --------------------------------------------------------------------------- check


def pull_secrets(options: Mapping[str, str]) -> list[str]:
    return [s.strip() for s in options.get("image_pull_secrets", "").split(",") if s.strip()]


def _group_violations(i: int, g: ReplicaGroup, spec: JobSpec, default_image: str) -> list[FieldViolation]:
    vs: list[FieldViolation] = []
    gf = f"spec.replica_groups[{i}]"
    if not (g.image or default_image):
        vs.append(FieldViolation(f"{gf}.image", "required: the cluster has no default_image option"))
    elif g.image and (g.image != g.image.strip() or not g.image.isprintable()):
        # the API server's own rule, refused here before any object of the launch is made
        vs.append(FieldViolation(f"{gf}.image", "an image reference has no leading or trailing "
                                 "whitespace and no control characters"))
    one_container = spec.run_mode is RunMode.MPI  # an MPI worker is one sshd container
    if g.resources.gpus and g.resources.gpus % g.processes and not one_container:
        vs.append(FieldViolation(f"{gf}.resources.gpus",
                                 "must divide evenly over processes_per_replica (one container each)"))
    if g.resources.gpu_type and not is_label_value(g.resources.gpu_type):
        vs.append(FieldViolation(f"{gf}.resources.gpu_type", "must be a Kubernetes label value"))
    runs_command = not (spec.run_mode is RunMode.MPI and g.role != "launcher")  # MPI workers run sshd
    if g.working_dir and not g.working_dir.startswith("/") and runs_command:
        # the container's workingDir: a runtime refuses a relative one, and the pod never starts
        vs.append(FieldViolation(f"{gf}.working_dir", "must be an absolute path on Kubernetes"))
    return vs


def check(job_id: str, spec: JobSpec, attempt: int, options: Mapping[str, str]) -> str:
    """The cluster's namespace; raises InvalidArgument naming every field this backend cannot take."""
    ns = namespace_of(options)
    vs: list[FieldViolation] = []
    if not job_id:
        vs.append(FieldViolation("job_id", "required"))
    if attempt < 1:
        vs.append(FieldViolation("attempt", "must be at least 1"))
    default_image = options.get("default_image", "")
    for i, g in enumerate(spec.replica_groups):
        vs.extend(_group_violations(i, g, spec, default_image))
    for s in pull_secrets(options):
        if not is_subdomain(s):
            vs.append(FieldViolation("cluster.options[image_pull_secrets]", f"{s!r} is not a valid Secret name"))
    sa = options.get("service_account", "")
    if sa and not is_subdomain(sa):
        vs.append(FieldViolation("cluster.options[service_account]", "must be a DNS-1123 subdomain"))
    if vs:
        raise InvalidArgument("; ".join(f"{v.field}: {v.description}" for v in vs), vs)
    return ns


# --------------------------------------------------------------------------- place


@dataclass(frozen=True)
class Placed:
    """One pod per replica, each a node of its own, numbered in the planner's layout order."""

    job_id: str
    attempt: int
    namespace: str
    layout: tuple[ReplicaGroup, ...]
    placements: tuple[planner.Placement, ...]
    plan: planner.JobPlan

    @property
    def service(self) -> str:
        return service_name(self.job_id, self.attempt)

    def by_replica(self) -> dict[tuple[str, int], list[planner.ProcessLaunch]]:
        """Each replica's processes, replicas in rank order."""
        out: dict[tuple[str, int], list[planner.ProcessLaunch]] = {}
        for p in self.plan.processes:
            out.setdefault((p.role, p.replica_index), []).append(p)
        return out


def place(job_id: str, spec: JobSpec, attempt: int, namespace: str) -> Placed:
    """Every replica's stable name and the planner's processes for it (InvalidArgument from the planner)."""
    layout = tuple(g for _, g in planner.groups_in_order(spec))
    placements = tuple(planner.Placement(role=g.role, replica_index=r,
                                         host=replica_host(job_id, attempt, g.role, r, namespace), node_rank=q)
                       for q, (g, r) in enumerate((g, r) for g in layout for r in range(g.replicas)))
    plan = planner.plan_job(job_id, spec, placements, hostfile_path=mpi.HOSTFILE_PATH)
    return Placed(job_id, attempt, namespace, layout, placements, plan)


# --------------------------------------------------------------------------- emit


def _split(total: float, parts: int) -> float:
    return total / parts if parts else total


def _resources(cpu: float, memory: int, gpus: int) -> dict[str, dict[str, str]]:
    q: dict[str, str] = {}
    if cpu > 0:
        q["cpu"] = cpu_quantity(cpu)
    if memory > 0:
        q["memory"] = str(memory)
    if gpus > 0:
        q[GPU_RESOURCE] = str(gpus)
    return {"requests": dict(q), "limits": dict(q)} if q else {}


_KUBELET_SPECIAL = re.compile(r"\$(?=[$(])")


def literal(text: str) -> str:
    """``text`` as the kubelet passes it on: it expands ``$(NAME)`` in command, args and env values
    and turns ``$$`` into ``$``, so a ``$`` before ``(`` or ``$`` is doubled (any other stays as it is)."""
    return _KUBELET_SPECIAL.sub("$$", text)


def _container(name: str, image: str, argv: Sequence[str], command: Sequence[str],
               env: Mapping[str, str], working_dir: str,
               resources: dict[str, dict[str, str]]) -> dict[str, Any]:
    """Exec form: ``command`` is the group's command and ``args`` the rest, when argv starts with it.
    Every value is ``literal``: the process gets its argv and environment verbatim."""
    argv, cmd = [literal(a) for a in argv], [literal(a) for a in command]
    c: dict[str, Any] = {
        "name": name,
        "image": image,
        "command": cmd if argv[:len(cmd)] == cmd else argv,
    }
    if env:
        c["env"] = [{"name": k, "value": literal(v)} for k, v in env.items()]
    if argv[:len(cmd)] == cmd and argv[len(cmd):]:
        c["args"] = argv[len(cmd):]
    if working_dir:
        c["workingDir"] = working_dir
    if resources:
        c["resources"] = {k: dict(v) for k, v in resources.items()}  # no shared dicts (YAML anchors)
    return c


@dataclass(frozen=True)
class _Common:
    """What every object of the attempt shares."""

    placed: Placed
    spec: JobSpec
    options: Mapping[str, str]
    labels: dict[str, str]  #: the job's valid labels under ours
    annotations: dict[str, str]  #: the job's labels verbatim (every object)
    owner: dict[str, Any]  #: the owner reference to the Service (uid filled in at launch)

    @property
    def mpi(self) -> bool:
        return self.spec.run_mode is RunMode.MPI

    def metadata(self, name: str, *, owned: bool = True, **extra: Any) -> dict[str, Any]:
        meta: dict[str, Any] = {"name": name, "namespace": self.placed.namespace, "labels": dict(self.labels)}
        if self.annotations:
            meta["annotations"] = dict(self.annotations)
        if owned:
            meta["ownerReferences"] = [dict(self.owner)]
        return {**meta, **extra}


def _service(c: _Common) -> dict[str, Any]:
    p = c.placed
    return {
        "apiVersion": "v1", "kind": "Service",
        "metadata": c.metadata(p.service, owned=False),
        "spec": {"clusterIP": "None", "publishNotReadyAddresses": True,
                 "selector": job_labels(p.job_id, p.attempt)},
    }


def _mpi_objects(c: _Common) -> list[dict[str, Any]]:
    """MPI's Secret (key pair filled in at launch: ``with_ssh_key``) and ConfigMap."""
    p = c.placed
    return [{
        "apiVersion": "v1", "kind": "Secret", "type": "kubernetes.io/ssh-auth",
        "metadata": c.metadata(secret_name(p.job_id, p.attempt)),
        "stringData": {"ssh-privatekey": "", "ssh-publickey": "", "known_hosts": ""},
    }, {
        "apiVersion": "v1", "kind": "ConfigMap",
        "metadata": c.metadata(config_map_name(p.job_id, p.attempt)),
        "data": {planner.HOSTFILE: p.plan.files[planner.HOSTFILE], "ssh_config": mpi.ssh_config(p.service, p.namespace),
                 "sshd_config": mpi.sshd_config()},
    }]


def _containers(c: _Common, g: ReplicaGroup, procs: Sequence[planner.ProcessLaunch],
                image: str) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(init containers, containers) of one replica's pod."""
    res = g.resources
    if c.mpi and procs[0].placeholder:  # an MPI worker: a host for mpirun's ranks
        sshd = [mpi.SSHD, "-De", "-f", f"{mpi.SSH_DIR}/sshd_config"]
        return [], [_container("sshd", image, sshd, sshd, procs[0].env, "",
                               _resources(res.cpu, res.memory_bytes, res.gpus))]
    n = len(procs)
    # memory rounded up: a share truncated to 0 would be no limit at all
    share = _resources(_split(res.cpu, n), -(-res.memory_bytes // n), res.gpus // n)
    extra_env = mpi.MPI_LAUNCHER_ENV if c.mpi else {}
    containers = [_container("main" if n == 1 else f"proc-{p.process_index}", image, p.argv,
                             g.command, {**extra_env, **p.env}, p.working_dir, share)
                  for p in procs]
    if not c.mpi:
        return [], containers
    # the launcher starts once every worker's sshd lets the job's key in
    workers = [p.host for p in c.placed.placements if p.role == "worker"]
    wait = ["sh", "-c", mpi.WAIT_SCRIPT, "wait-for-workers", *workers]
    return [_container("wait-for-workers", image, wait, wait, {}, "", share)], containers


def _pod(c: _Common, role: str, index: int, procs: Sequence[planner.ProcessLaunch],
         annotations: Mapping[str, str]) -> tuple[dict[str, Any], PodInfo]:
    p, spec, options = c.placed, c.spec, c.options
    g = next(g for g in spec.replica_groups if g.role == role)
    init, containers = _containers(c, g, procs, g.image or options["default_image"])
    if c.mpi:
        for cont in init + containers:
            cont["volumeMounts"] = [dict(m) for m in mpi.MPI_MOUNTS]
    pod_spec: dict[str, Any] = {
        "restartPolicy": "Never",
        "hostname": hostname(role, index),
        "subdomain": p.service,
        "enableServiceLinks": False,
        "containers": containers,
    }
    if init:
        pod_spec["initContainers"] = init
    if c.mpi:
        pod_spec["volumes"] = mpi.volumes(secret_name(p.job_id, p.attempt), config_map_name(p.job_id, p.attempt))
    if spec.time_limit_seconds:
        pod_spec["activeDeadlineSeconds"] = max(1, math.ceil(spec.time_limit_seconds))
    if pull := pull_secrets(options):
        pod_spec["imagePullSecrets"] = [{"name": s} for s in pull]
    if options.get("service_account"):
        pod_spec["serviceAccountName"] = options["service_account"]
    else:  # no API credentials for a job unless the cluster names a ServiceAccount for its jobs
        pod_spec["automountServiceAccountToken"] = False
    if g.resources.gpus and g.resources.gpu_type:
        pod_spec["nodeSelector"] = {GPU_PRODUCT_LABEL: g.resources.gpu_type}
    name = pod_name(p.job_id, p.attempt, role, index)
    manifest = {
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {**c.metadata(name), "labels": {**c.labels, LABEL_ROLE: role, LABEL_INDEX: str(index)},
                     "annotations": dict(annotations)},
        "spec": pod_spec,
    }
    return manifest, PodInfo(name=name, role=role, index=index, containers=tuple(x["name"] for x in containers))


def emit(placed: Placed, spec: JobSpec, options: Mapping[str, str]) -> Rendered:
    """The attempt's manifests in creation order: the Service, (MPI) the Secret and ConfigMap, the Pods."""
    p = placed
    # No blockOwnerDeletion: the driver deletes the objects itself, and under the
    # OwnerReferencesPermissionEnforcement admission plugin (OpenShift) setting it needs update
    # on services/finalizers, which the documented RBAC does not grant: every Pod create refused.
    owner = {"apiVersion": "v1", "kind": "Service", "name": p.service, "uid": ""}
    labels = {**user_labels(spec.labels), **job_labels(p.job_id, p.attempt)}  # the selector is ours alone
    c = _Common(p, spec, options, labels, labels_annotation(spec.labels), owner)
    manifests = [_service(c), *(_mpi_objects(c) if c.mpi else ())]
    others = (("ConfigMap", config_map_name(p.job_id, p.attempt)),
              ("Secret", secret_name(p.job_id, p.attempt))) if c.mpi else ()
    meta = JobMeta(p.job_id, p.attempt, tuple((g.role, g.replicas) for g in p.layout), p.plan.success, others)
    annotations = {**c.annotations, **encode(meta)}
    pods: list[PodInfo] = []
    for (role, index), procs in p.by_replica().items():
        manifest, info = _pod(c, role, index, procs, annotations)
        manifests.append(manifest)
        pods.append(info)
    return Rendered(job_id=p.job_id, attempt=p.attempt, namespace=p.namespace, service=p.service,
                    backend_job_id=backend_job_id(p.namespace, p.job_id, p.attempt), manifests=tuple(manifests),
                    pods=tuple(pods), success=p.plan.success, others=others)


def render_job(job_id: str, spec: JobSpec, attempt: int,
               options: Mapping[str, str] | None = None) -> Rendered:
    """The manifests of one attempt: check, place, emit; raises InvalidArgument / FailedPrecondition."""
    options = options or {}
    ns = check(job_id, spec, attempt, options)
    return emit(place(job_id, spec, attempt, ns), spec, options)


__all__ = [  # LABEL_JOB, LABEL_ATTEMPT: re-exported from naming, the labels every object carries
    "LABEL_ATTEMPT", "LABEL_JOB", "MEDIA_TYPE", "SUPPORTED_RUN_MODES", "PodInfo", "Placed", "Rendered", "check",
    "cpu_quantity", "emit", "place", "pull_secrets", "render_job", "to_native_spec", "with_owner_uid",
]
