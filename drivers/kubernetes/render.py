"""Translate a job into Kubernetes manifests: a pure function of (job, cluster options).

``render_job(job_id, spec, attempt, options)`` returns the ``Rendered`` job:
the manifests (plain dicts, the JSON the API server takes) that
``KubernetesDriver.launch`` creates, in creation order, and that
``RenderJob`` returns as ``application/yaml`` (one document per object,
sorted keys, so it is golden-file testable). No I/O, no clock, no
randomness; only built-in objects, no operator.

Objects, per attempt of a job (``<base>`` is ``<job_id>-<attempt>``, made a
DNS-1123 label by ``dns_label``):

- a headless Service ``<base>`` (``clusterIP: None``, selecting the
  attempt's pods, ``publishNotReadyAddresses`` so names resolve as soon as a
  pod has an IP). It is the owner of everything else.
- one Pod per replica, ``<base>-<role>-<index>``, with ``hostname:
  <role>-<index>`` and ``subdomain: <base>``, so each replica has the stable
  name ``<role>-<index>.<base>.<namespace>.svc``. Those names are the
  planner's late-resolving placements (``MASTER_ADDR``, ``TF_CONFIG``).
  ``restartPolicy: Never`` (a failed process fails the replica; retries are
  JobManager's, as new attempts), ``enableServiceLinks: false`` (no
  service-discovery variables mixed into the planner's environment),
  ``activeDeadlineSeconds`` from the time limit (the kubelet ends the pod
  with reason ``DeadlineExceeded``).

Every object carries the labels ``dlsched.io/job-id`` (``job_label``: the
job id made a DNS-1123 label, so an id such as ``a--b`` or ``ab-`` becomes a
hashed label), ``dlsched.io/attempt`` and (pods) ``dlsched.io/role`` and
``dlsched.io/replica-index``; the driver's one watch selects
``dlsched.io/job-id`` and keys its jobs by ``job_label``. Pods are annotated
with the job id verbatim (``dlsched.io/job-id``), the success rule (``dlsched.io/decisive-roles``, ``dlsched.io/stopped-after-success``)
and the replica counts (``dlsched.io/replicas``), so a restarted driver
rebuilds every job from the watch alone. Pods have an owner reference to the
Service, so deleting the Service removes the whole attempt. The Service's
uid exists only once it is created: the rendered owner reference carries
``uid: ""`` and ``launch`` fills in the real uid (``with_owner_uid``)
before creating the pods.

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
``image_pull_secrets`` (comma-separated Secret names), ``service_account``.

MPI is refused (FAILED_PRECONDITION ``MPI_NOT_AVAILABLE``): a launcher needs
a way into the workers (MPI Operator v2 generates a per-job SSH key Secret
and runs sshd in the workers) and no such path is built yet.
"""

from __future__ import annotations

import hashlib
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import yaml

from dlsched.errors import FieldViolation, InvalidArgument
from drivers.common import planner
from drivers.common.base import JobSpec, NativeSpec, RunMode

MEDIA_TYPE = "application/yaml"
LABEL_JOB = "dlsched.io/job-id"
LABEL_ATTEMPT = "dlsched.io/attempt"
LABEL_ROLE = "dlsched.io/role"
LABEL_INDEX = "dlsched.io/replica-index"
#: Pod annotations that let a restarted driver rebuild a job from its pods alone.
ANN_JOB = "dlsched.io/job-id"  # the job id verbatim (the label is ``job_label(job_id)``)
ANN_DECISIVE = "dlsched.io/decisive-roles"
ANN_STOPPED_AFTER = "dlsched.io/stopped-after-success"
ANN_REPLICAS = "dlsched.io/replicas"
GPU_RESOURCE = "nvidia.com/gpu"
GPU_PRODUCT_LABEL = "nvidia.com/gpu.product"
DEFAULT_NAMESPACE = "default"
SUPPORTED_RUN_MODES = (RunMode.SINGLE_PROCESS, RunMode.MULTI_PROCESS, RunMode.PS_WORKER,
                       RunMode.MASTER_WORKER)
MAX_LABEL = 63
_LABEL_RE = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_LABEL_VALUE_RE = re.compile(r"^([A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?)?$")
_SUBDOMAIN_RE = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")


def dns_label(text: str, max_len: int = MAX_LABEL) -> str:
    """A valid DNS-1123 label (and DNS-1035: it starts with a letter) from any text.

    Lower-cased, every run of other characters becomes ``-``; when that
    changed or shortened the text, a hash of the original keeps distinct
    inputs distinct: ``<prefix>-<8 hex>`` within ``max_len``.
    """
    clean = re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")
    if not clean or not clean[0].isalpha():
        clean = "x-" + clean if clean else "x"
    if clean == text and len(clean) <= max_len:
        return clean
    digest = hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()[:8]
    head = clean[:max_len - 9].rstrip("-")
    return f"{head}-{digest}" if head else f"x-{digest}"


def is_dns_label(name: str) -> bool:
    return len(name) <= MAX_LABEL and bool(_LABEL_RE.match(name))


def job_label(job_id: str) -> str:
    """The ``dlsched.io/job-id`` label value of a job's objects; the driver keys its jobs by it."""
    return dns_label(job_id)


def service_name(job_id: str, attempt: int) -> str:
    return dns_label(f"{job_id}-{attempt}")


def hostname(role: str, index: int) -> str:
    return dns_label(f"{role}-{index}")


def pod_name(job_id: str, attempt: int, role: str, index: int) -> str:
    return dns_label(f"{job_id}-{attempt}-{role}-{index}")


def replica_host(job_id: str, attempt: int, role: str, index: int, namespace: str) -> str:
    """The replica's stable DNS name through the headless Service."""
    return f"{hostname(role, index)}.{service_name(job_id, attempt)}.{namespace}.svc"


def namespace_of(options: Mapping[str, str]) -> str:
    ns = options.get("namespace", "") or DEFAULT_NAMESPACE
    if not is_dns_label(ns):
        raise InvalidArgument.for_field("cluster.options[namespace]", "must be a DNS-1123 label")
    return ns


def backend_job_id(namespace: str, job_id: str, attempt: int) -> str:
    return f"{namespace}/{service_name(job_id, attempt)}"


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
    job_id: str
    attempt: int
    namespace: str
    service: str
    backend_job_id: str
    manifests: tuple[dict[str, Any], ...]
    pods: tuple[PodInfo, ...]
    success: planner.SuccessRule

    def native_spec(self) -> NativeSpec:
        return to_native_spec(self.manifests)


def to_native_spec(manifests: Sequence[Mapping[str, Any]]) -> NativeSpec:
    text = yaml.safe_dump_all(list(manifests), sort_keys=True, default_flow_style=False,
                              allow_unicode=True)
    return NativeSpec(media_type=MEDIA_TYPE, content=text)


def with_owner_uid(manifest: Mapping[str, Any], uid: str) -> dict[str, Any]:
    """A copy of ``manifest`` whose owner references carry the owner's real uid."""
    meta = dict(manifest["metadata"])
    meta["ownerReferences"] = [{**r, "uid": uid} for r in meta.get("ownerReferences", ())]
    return {**manifest, "metadata": meta}


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


def _check(job_id: str, spec: JobSpec, attempt: int, options: Mapping[str, str]) -> None:
    vs: list[FieldViolation] = []
    if not job_id:
        vs.append(FieldViolation("job_id", "required"))
    if attempt < 1:
        vs.append(FieldViolation("attempt", "must be at least 1"))
    if spec.run_mode is RunMode.MPI:
        raise planner.MpiNotAvailable("the Kubernetes driver does not run MPI jobs yet "
                                      "(no launcher-to-worker access is built)")
    default_image = options.get("default_image", "")
    for i, g in enumerate(spec.replica_groups):
        gf = f"spec.replica_groups[{i}]"
        if not (g.image or default_image):
            vs.append(FieldViolation(f"{gf}.image", "required: the cluster has no default_image option"))
        if g.resources.gpus and g.resources.gpus % g.processes:
            vs.append(FieldViolation(f"{gf}.resources.gpus",
                                     "must divide evenly over processes_per_replica (one container each)"))
        if g.resources.gpu_type and not (len(g.resources.gpu_type) <= MAX_LABEL
                                         and _LABEL_VALUE_RE.match(g.resources.gpu_type)):
            vs.append(FieldViolation(f"{gf}.resources.gpu_type", "must be a Kubernetes label value"))
    for s in _pull_secrets(options):
        if not (len(s) <= 253 and _SUBDOMAIN_RE.match(s)):
            vs.append(FieldViolation("cluster.options[image_pull_secrets]",
                                     f"{s!r} is not a valid Secret name"))
    sa = options.get("service_account", "")
    if sa and not (len(sa) <= 253 and _SUBDOMAIN_RE.match(sa)):
        vs.append(FieldViolation("cluster.options[service_account]", "must be a DNS-1123 subdomain"))
    if vs:
        raise InvalidArgument("; ".join(f"{v.field}: {v.description}" for v in vs), vs)


def _pull_secrets(options: Mapping[str, str]) -> list[str]:
    return [s.strip() for s in options.get("image_pull_secrets", "").split(",") if s.strip()]


def render_job(job_id: str, spec: JobSpec, attempt: int,
               options: Mapping[str, str] | None = None) -> Rendered:
    """The manifests of one attempt; raises InvalidArgument / FailedPrecondition."""
    options = options or {}
    ns = namespace_of(options)
    _check(job_id, spec, attempt, options)
    svc = service_name(job_id, attempt)
    base_labels = {LABEL_JOB: job_label(job_id), LABEL_ATTEMPT: str(attempt)}
    # One pod per replica: each is a node of its own, numbered in the planner's layout order.
    order = planner.ROLES.get(spec.run_mode, ())
    layout = sorted(spec.replica_groups, key=lambda g: order.index(g.role) if g.role in order else len(order))
    placements = [planner.Placement(role=g.role, replica_index=r,
                                    host=replica_host(job_id, attempt, g.role, r, ns), node_rank=q)
                  for q, (g, r) in enumerate((g, r) for g in layout for r in range(g.replicas))]
    plan = planner.plan_job(job_id, spec, placements)
    by_replica: dict[tuple[str, int], list[planner.ProcessLaunch]] = {}
    for p in plan.processes:
        by_replica.setdefault((p.role, p.replica_index), []).append(p)
    groups = {g.role: g for g in spec.replica_groups}

    service = {
        "apiVersion": "v1", "kind": "Service",
        "metadata": {"name": svc, "namespace": ns, "labels": dict(base_labels)},
        "spec": {"clusterIP": "None", "publishNotReadyAddresses": True,
                 "selector": dict(base_labels)},
    }
    owner = {"apiVersion": "v1", "kind": "Service", "name": svc, "uid": "",
             "blockOwnerDeletion": True}
    pull = [{"name": s} for s in _pull_secrets(options)]
    annotations = {
        ANN_JOB: job_id,
        ANN_DECISIVE: ",".join(sorted(plan.success.decisive_roles)),
        ANN_STOPPED_AFTER: ",".join(sorted(plan.success.stopped_after_success)),
        ANN_REPLICAS: ",".join(f"{g.role}={g.replicas}" for g in layout),
    }
    manifests: list[dict[str, Any]] = [service]
    pods: list[PodInfo] = []
    for (role, index), procs in by_replica.items():
        g = groups[role]
        n = len(procs)
        containers = []
        for p in procs:
            cname = "main" if n == 1 else f"proc-{p.process_index}"
            argv = list(p.argv)
            cmd = list(g.command)
            c: dict[str, Any] = {
                "name": cname,
                "image": g.image or options["default_image"],
                "command": cmd if argv[:len(cmd)] == cmd else argv,
                "env": [{"name": k, "value": v} for k, v in p.env.items()],
            }
            if argv[:len(cmd)] == cmd and argv[len(cmd):]:
                c["args"] = argv[len(cmd):]
            if p.working_dir:
                c["workingDir"] = p.working_dir
            res = _resources(_split(g.resources.cpu, n), int(_split(g.resources.memory_bytes, n)),
                             g.resources.gpus // n)
            if res:
                c["resources"] = res
            containers.append(c)
        name = pod_name(job_id, attempt, role, index)
        pod_spec: dict[str, Any] = {
            "restartPolicy": "Never",
            "hostname": hostname(role, index),
            "subdomain": svc,
            "enableServiceLinks": False,
            "containers": containers,
        }
        if spec.time_limit_seconds:
            pod_spec["activeDeadlineSeconds"] = max(1, math.ceil(spec.time_limit_seconds))
        if pull:
            pod_spec["imagePullSecrets"] = pull
        if options.get("service_account"):
            pod_spec["serviceAccountName"] = options["service_account"]
        if g.resources.gpus and g.resources.gpu_type:
            pod_spec["nodeSelector"] = {GPU_PRODUCT_LABEL: g.resources.gpu_type}
        manifests.append({
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {
                "name": name, "namespace": ns,
                "labels": {**base_labels, LABEL_ROLE: role, LABEL_INDEX: str(index)},
                "annotations": dict(annotations),
                "ownerReferences": [dict(owner)],
            },
            "spec": pod_spec,
        })
        pods.append(PodInfo(name=name, role=role, index=index,
                            containers=tuple(c["name"] for c in containers)))
    return Rendered(job_id=job_id, attempt=attempt, namespace=ns, service=svc,
                    backend_job_id=backend_job_id(ns, job_id, attempt), manifests=tuple(manifests),
                    pods=tuple(pods), success=plan.success)
