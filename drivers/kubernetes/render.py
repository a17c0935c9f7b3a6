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
with the job id verbatim (``dlsched.io/job-id``), the success rule
(``dlsched.io/decisive-roles``, ``dlsched.io/stopped-after-success``), the
replica counts (``dlsched.io/replicas``) and (MPI) the other objects of the
attempt (``dlsched.io/objects``), so a restarted driver rebuilds every job
from the watch alone. Every other object has an owner reference to the
Service, so deleting the Service removes the whole attempt. The Service's
uid exists only once it is created: the rendered owner reference carries
``uid: ""`` and ``launch`` fills in the real uid (``with_owner_uid``)
before creating the rest.

The job's own labels (``spec.labels``) go on every object too, under
ours: a key that is not a valid Kubernetes label key (or is in the
reserved ``dlsched.io/`` prefix) is left off, and a value that is not a
valid label value (capitals and dots are; unicode, spaces, more than 63
characters are not) is made one by ``label_value`` (the rest becomes
``-``, a hash of the original keeps distinct values distinct). The labels
exactly as given are kept in the annotation ``dlsched.io/labels`` (JSON).

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

MPI (as MPI Operator v2 does it, with built-in objects only): the launcher
reaches the workers over SSH with a key made for the attempt.

- a Secret ``<base>-ssh`` (``kubernetes.io/ssh-auth``): ``ssh-privatekey``,
  ``ssh-publickey`` and ``known_hosts``. Rendering is pure, so the rendered
  Secret (and the dry run, and the native spec the driver reports) carries
  empty values; ``launch`` makes a fresh Ed25519 key pair and fills them in
  (``with_ssh_key``) just before creating it. The private key goes to the
  API server only. The same key is every worker's sshd host key, so
  ``known_hosts`` pins it for ``*.<base>.<namespace>.svc`` and the client
  checks host keys strictly.
- a ConfigMap ``<base>-mpi``: the planner's ``hostfile`` (worker DNS names,
  ``slots`` = processes per worker), the ssh client ``config`` and the
  ``sshd_config``.
- every MPI pod mounts them: the Secret's keys and the two ssh files at
  ``/root/.ssh`` (a projected volume; private key mode 0400), the
  hostfile at ``/etc/dlsched/mpi/hostfile`` (``DLSCHED_MPI_HOSTFILE``).
- worker pods run one container, ``sshd -De -f /root/.ssh/sshd_config``
  (the image's; the group's command is not run: workers are hosts for
  mpirun), with the whole replica's resources.
- the launcher pod runs the planner's ``mpirun -np <slots> --hostfile ...
  <command>`` after an init container, ``wait-for-workers``, that retries
  ``ssh <worker> true`` until every worker's name resolves and its sshd
  lets the job's key in. The init container's ``sh -c`` script is a
  constant; the worker names are its arguments, never part of the script.
- the job's state is the launcher's: the success rule's decisive role is
  ``launcher``; the workers are stopped once it ends.

The images must be able to run this: ``sshd`` (openssh-server, with
``/run/sshd`` present) in the workers, ``ssh`` and ``sh`` in the launcher,
the MPI runtime on the default PATH of an ssh session, and root as the
user (sshd on port 22, keys under ``/root/.ssh``; Open MPI's refusal to run
as root is lifted with ``OMPI_ALLOW_RUN_AS_ROOT``).
"""

from __future__ import annotations

import hashlib
import json
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
ANN_LABELS = "dlsched.io/labels"  # the job's labels verbatim (JSON), when it has any
ANN_OBJECTS = "dlsched.io/objects"  # "<Kind>/<name>,..." the attempt's objects besides Service and Pods
GPU_RESOURCE = "nvidia.com/gpu"
GPU_PRODUCT_LABEL = "nvidia.com/gpu.product"
DEFAULT_NAMESPACE = "default"
SUPPORTED_RUN_MODES = (RunMode.SINGLE_PROCESS, RunMode.MULTI_PROCESS, RunMode.PS_WORKER,
                       RunMode.MASTER_WORKER, RunMode.MPI)
#: MPI: where the pods find the SSH files and the hostfile.
SSH_DIR = "/root/.ssh"
MPI_DIR = "/etc/dlsched/mpi"
HOSTFILE_PATH = f"{MPI_DIR}/{planner.HOSTFILE}"
SSH_KEY_FILE = "id_ed25519"
SSHD = "/usr/sbin/sshd"
#: The launcher's init container: retry ``ssh <host> true`` for every worker name given as an argument.
WAIT_SCRIPT = (
    'for h in "$@"; do\n'
    '  until ssh -F /root/.ssh/config -o ConnectTimeout=5 "$h" true; do\n'
    '    echo "dlsched: waiting for $h"; sleep 2\n'
    '  done\n'
    'done\n'
)
#: OpenMPI refuses to run as root without these; the MPI pods run as root (sshd, /root/.ssh).
MPI_LAUNCHER_ENV = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}
MAX_LABEL = 63
_LABEL_RE = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_LABEL_VALUE_RE = re.compile(r"^([A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?)?$")
_SUBDOMAIN_RE = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
_LABEL_NAME_RE = re.compile(r"^[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$")
RESERVED_PREFIX = "dlsched.io"


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


def label_value(text: str) -> str:
    """A valid Kubernetes label value from any text; valid values are kept as they are.

    Every run of other characters becomes ``-``; when that changed or
    shortened the text, ``<prefix>-<8 hex>`` (a hash of the original)
    within 63 characters keeps distinct texts distinct.
    """
    if len(text) <= MAX_LABEL and _LABEL_VALUE_RE.match(text):
        return text
    clean = re.sub(r"[^A-Za-z0-9_.-]+", "-", text)
    digest = hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()[:8]
    head = re.sub(r"^[^A-Za-z0-9]+|[^A-Za-z0-9]+$", "", clean[:MAX_LABEL - 9])
    return f"{head}-{digest}" if head else digest


def is_label_key(key: str) -> bool:
    prefix, slash, name = key.rpartition("/")
    if slash and not (len(prefix) <= 253 and _SUBDOMAIN_RE.match(prefix)):
        return False
    return len(name) <= MAX_LABEL and bool(_LABEL_NAME_RE.match(name))


def user_labels(labels: Mapping[str, str]) -> dict[str, str]:
    """The job's labels that can be Kubernetes labels, values made valid; reserved keys left off."""
    out = {}
    for k, v in sorted(labels.items()):
        prefix = k.rpartition("/")[0]
        if is_label_key(k) and prefix != RESERVED_PREFIX and not prefix.endswith("." + RESERVED_PREFIX):
            out[k] = label_value(v)
    return out


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


def secret_name(job_id: str, attempt: int) -> str:
    return dns_label(f"{job_id}-{attempt}-ssh")


def config_map_name(job_id: str, attempt: int) -> str:
    return dns_label(f"{job_id}-{attempt}-mpi")


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
    #: (kind, name) of the objects besides the Service and the Pods (MPI: the Secret, the ConfigMap).
    others: tuple[tuple[str, str], ...] = ()

    def native_spec(self) -> NativeSpec:
        return to_native_spec(self.manifests)


class _Dumper(yaml.SafeDumper):
    """Multi-line strings (MPI's hostfile and ssh configs) as ``|`` blocks, readable in a dry run."""


def _str(dumper: yaml.SafeDumper, value: str) -> yaml.ScalarNode:
    style = "|" if "\n" in value.rstrip("\n") or value.endswith("\n") and len(value) > 1 else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_Dumper.add_representer(str, _str)


def to_native_spec(manifests: Sequence[Mapping[str, Any]]) -> NativeSpec:
    text = yaml.dump_all(list(manifests), Dumper=_Dumper, sort_keys=True, default_flow_style=False,
                         allow_unicode=True)
    return NativeSpec(media_type=MEDIA_TYPE, content=text)


def with_owner_uid(manifest: Mapping[str, Any], uid: str) -> dict[str, Any]:
    """A copy of ``manifest`` whose owner references carry the owner's real uid."""
    meta = dict(manifest["metadata"])
    meta["ownerReferences"] = [{**r, "uid": uid} for r in meta.get("ownerReferences", ())]
    return {**manifest, "metadata": meta}


def with_ssh_key(secret: Mapping[str, Any], private_key: str, public_key: str) -> dict[str, Any]:
    """A copy of the rendered MPI Secret carrying the attempt's key pair (OpenSSH format).

    ``known_hosts`` pins the key (every worker's host key) for the names
    under the headless Service, the Secret's owner.
    """
    meta = secret["metadata"]
    service = meta["ownerReferences"][0]["name"]
    public = public_key.strip()
    data = {
        "ssh-privatekey": private_key if private_key.endswith("\n") else private_key + "\n",
        "ssh-publickey": public + "\n",
        "known_hosts": f"*.{service}.{meta['namespace']}.svc {public}\n",
    }
    return {**secret, "stringData": data}


def _ssh_config(svc: str, ns: str) -> str:
    return (f"Host *.{svc}.{ns}.svc\n"
            f"  IdentityFile {SSH_DIR}/{SSH_KEY_FILE}\n"
            "  IdentitiesOnly yes\n"
            f"  UserKnownHostsFile {SSH_DIR}/known_hosts\n"
            "  StrictHostKeyChecking yes\n"
            "  CheckHostIP no\n"
            "  BatchMode yes\n"
            "  Port 22\n"
            "  LogLevel ERROR\n")


def _sshd_config() -> str:
    return ("Port 22\n"
            f"HostKey {SSH_DIR}/{SSH_KEY_FILE}\n"
            f"AuthorizedKeysFile {SSH_DIR}/authorized_keys\n"
            "PermitRootLogin prohibit-password\n"
            "PubkeyAuthentication yes\n"
            "PasswordAuthentication no\n"
            "KbdInteractiveAuthentication no\n"
            "UsePAM no\n"
            "StrictModes no\n"  # the projected volume's directory is not the user's own ~/.ssh
            "PrintMotd no\n")


def _mpi_volumes(secret: str, config_map: str) -> list[dict[str, Any]]:
    return [
        {"name": "dlsched-ssh", "projected": {"defaultMode": 0o444, "sources": [
            {"secret": {"name": secret, "items": [
                {"key": "ssh-privatekey", "path": SSH_KEY_FILE, "mode": 0o400},
                {"key": "ssh-publickey", "path": f"{SSH_KEY_FILE}.pub"},
                {"key": "ssh-publickey", "path": "authorized_keys"},
                {"key": "known_hosts", "path": "known_hosts"},
            ]}},
            {"configMap": {"name": config_map, "items": [
                {"key": "ssh_config", "path": "config"},
                {"key": "sshd_config", "path": "sshd_config"},
            ]}},
        ]}},
        {"name": "dlsched-mpi", "configMap": {"name": config_map, "defaultMode": 0o444, "items": [
            {"key": planner.HOSTFILE, "path": planner.HOSTFILE}]}},
    ]


MPI_MOUNTS = [{"name": "dlsched-ssh", "mountPath": SSH_DIR, "readOnly": True},
              {"name": "dlsched-mpi", "mountPath": MPI_DIR, "readOnly": True}]


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
    default_image = options.get("default_image", "")
    for i, g in enumerate(spec.replica_groups):
        gf = f"spec.replica_groups[{i}]"
        if not (g.image or default_image):
            vs.append(FieldViolation(f"{gf}.image", "required: the cluster has no default_image option"))
        one_container = spec.run_mode is RunMode.MPI  # an MPI worker is one sshd container
        if g.resources.gpus and g.resources.gpus % g.processes and not one_container:
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


def _container(name: str, image: str, argv: Sequence[str], command: Sequence[str],
               env: Mapping[str, str], working_dir: str,
               resources: dict[str, dict[str, str]]) -> dict[str, Any]:
    """Exec form: ``command`` is the group's command and ``args`` the rest, when argv starts with it."""
    argv, cmd = list(argv), list(command)
    c: dict[str, Any] = {
        "name": name,
        "image": image,
        "command": cmd if argv[:len(cmd)] == cmd else argv,
    }
    if env:
        c["env"] = [{"name": k, "value": v} for k, v in env.items()]
    if argv[:len(cmd)] == cmd and argv[len(cmd):]:
        c["args"] = argv[len(cmd):]
    if working_dir:
        c["workingDir"] = working_dir
    if resources:
        c["resources"] = {k: dict(v) for k, v in resources.items()}  # no shared dicts (YAML anchors)
    return c


def render_job(job_id: str, spec: JobSpec, attempt: int,
               options: Mapping[str, str] | None = None) -> Rendered:
    """The manifests of one attempt; raises InvalidArgument / FailedPrecondition."""
    options = options or {}
    ns = namespace_of(options)
    _check(job_id, spec, attempt, options)
    mpi = spec.run_mode is RunMode.MPI
    svc = service_name(job_id, attempt)
    base_labels = {LABEL_JOB: job_label(job_id), LABEL_ATTEMPT: str(attempt)}
    labels = {**user_labels(spec.labels), **base_labels}  # every object's; the selector is ours alone
    job_annotations = ({ANN_LABELS: json.dumps(dict(spec.labels), sort_keys=True, ensure_ascii=False)}
                       if spec.labels else {})
    # One pod per replica: each is a node of its own, numbered in the planner's layout order.
    order = planner.ROLES.get(spec.run_mode, ())
    layout = sorted(spec.replica_groups, key=lambda g: order.index(g.role) if g.role in order else len(order))
    placements = [planner.Placement(role=g.role, replica_index=r,
                                    host=replica_host(job_id, attempt, g.role, r, ns), node_rank=q)
                  for q, (g, r) in enumerate((g, r) for g in layout for r in range(g.replicas))]
    plan = planner.plan_job(job_id, spec, placements, hostfile_path=HOSTFILE_PATH)
    by_replica: dict[tuple[str, int], list[planner.ProcessLaunch]] = {}
    for p in plan.processes:
        by_replica.setdefault((p.role, p.replica_index), []).append(p)
    groups = {g.role: g for g in spec.replica_groups}

    service = {
        "apiVersion": "v1", "kind": "Service",
        "metadata": {"name": svc, "namespace": ns, "labels": dict(labels)},
        "spec": {"clusterIP": "None", "publishNotReadyAddresses": True,
                 "selector": dict(base_labels)},
    }
    owner = {"apiVersion": "v1", "kind": "Service", "name": svc, "uid": "",
             "blockOwnerDeletion": True}
    manifests: list[dict[str, Any]] = [service]
    others: list[tuple[str, str]] = []
    if mpi:
        secret, config_map = secret_name(job_id, attempt), config_map_name(job_id, attempt)
        others = [("ConfigMap", config_map), ("Secret", secret)]
        manifests.append({
            "apiVersion": "v1", "kind": "Secret", "type": "kubernetes.io/ssh-auth",
            "metadata": {"name": secret, "namespace": ns, "labels": dict(labels),
                         "ownerReferences": [dict(owner)]},
            "stringData": {"ssh-privatekey": "", "ssh-publickey": "", "known_hosts": ""},  # with_ssh_key
        })
        manifests.append({
            "apiVersion": "v1", "kind": "ConfigMap",
            "metadata": {"name": config_map, "namespace": ns, "labels": dict(labels),
                         "ownerReferences": [dict(owner)]},
            "data": {planner.HOSTFILE: plan.files[planner.HOSTFILE], "ssh_config": _ssh_config(svc, ns),
                     "sshd_config": _sshd_config()},
        })
    pull = [{"name": s} for s in _pull_secrets(options)]
    annotations = {
        **job_annotations,
        ANN_JOB: job_id,
        ANN_DECISIVE: ",".join(sorted(plan.success.decisive_roles)),
        ANN_STOPPED_AFTER: ",".join(sorted(plan.success.stopped_after_success)),
        ANN_REPLICAS: ",".join(f"{g.role}={g.replicas}" for g in layout),
    }
    if job_annotations:
        for m in manifests:  # the Service, MPI's Secret and ConfigMap
            m["metadata"]["annotations"] = dict(job_annotations)
    if others:
        annotations[ANN_OBJECTS] = ",".join(f"{kind}/{name}" for kind, name in others)
    worker_hosts = [p.host for p in placements if p.role == "worker"]
    pods: list[PodInfo] = []
    for (role, index), procs in by_replica.items():
        g = groups[role]
        image = g.image or options["default_image"]
        res = g.resources
        init: list[dict[str, Any]] = []
        if mpi and procs[0].placeholder:  # an MPI worker: a host for mpirun's ranks
            sshd = [SSHD, "-De", "-f", f"{SSH_DIR}/sshd_config"]
            containers = [_container("sshd", image, sshd, sshd, procs[0].env, "",
                                     _resources(res.cpu, res.memory_bytes, res.gpus))]
        else:
            n = len(procs)
            share = _resources(_split(res.cpu, n), int(_split(res.memory_bytes, n)), res.gpus // n)
            extra_env = MPI_LAUNCHER_ENV if mpi else {}
            containers = [_container("main" if n == 1 else f"proc-{p.process_index}", image, p.argv,
                                     g.command, {**extra_env, **p.env}, p.working_dir, share)
                          for p in procs]
            if mpi:  # the launcher starts once every worker's sshd lets the job's key in
                wait = ["sh", "-c", WAIT_SCRIPT, "wait-for-workers", *worker_hosts]
                init = [_container("wait-for-workers", image, wait, wait, {}, "", share)]
        if mpi:
            for c in init + containers:
                c["volumeMounts"] = [dict(m) for m in MPI_MOUNTS]
        name = pod_name(job_id, attempt, role, index)
        pod_spec: dict[str, Any] = {
            "restartPolicy": "Never",
            "hostname": hostname(role, index),
            "subdomain": svc,
            "enableServiceLinks": False,
            "containers": containers,
        }
        if init:
            pod_spec["initContainers"] = init
        if mpi:
            pod_spec["volumes"] = _mpi_volumes(secret, config_map)
        if spec.time_limit_seconds:
            pod_spec["activeDeadlineSeconds"] = max(1, math.ceil(spec.time_limit_seconds))
        if pull:
            pod_spec["imagePullSecrets"] = pull
        if options.get("service_account"):
            pod_spec["serviceAccountName"] = options["service_account"]
        if res.gpus and res.gpu_type:
            pod_spec["nodeSelector"] = {GPU_PRODUCT_LABEL: res.gpu_type}
        manifests.append({
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {
                "name": name, "namespace": ns,
                "labels": {**labels, LABEL_ROLE: role, LABEL_INDEX: str(index)},
                "annotations": dict(annotations),
                "ownerReferences": [dict(owner)],
            },
            "spec": pod_spec,
        })
        pods.append(PodInfo(name=name, role=role, index=index,
                            containers=tuple(c["name"] for c in containers)))
    return Rendered(job_id=job_id, attempt=attempt, namespace=ns, service=svc,
                    backend_job_id=backend_job_id(ns, job_id, attempt), manifests=tuple(manifests),
                    pods=tuple(pods), success=plan.success, others=tuple(others))
