"""The names, labels and annotations of a job's Kubernetes objects: the driver's metadata codec.

Names. Per attempt of a job (``<base>`` is ``<job_id>-<attempt>``, made a
DNS-1123 label by ``dns_label``): the headless Service ``<base>``
(``service_name``), one Pod per replica ``<base>-<role>-<index>``
(``pod_name``) with hostname ``<role>-<index>``, so each replica has the
stable name ``<role>-<index>.<base>.<namespace>.svc`` (``replica_host``),
and, for MPI, the Secret ``<base>-ssh`` and the ConfigMap ``<base>-mpi``.
``backend_job_id`` is ``<namespace>/<service>``.

Labels. Every object carries ``dlsched.io/job-id`` (``job_label``: the job
id made a DNS-1123 label, so an id such as ``a--b`` or ``ab-`` becomes a
hashed label), ``dlsched.io/attempt`` and (pods) ``dlsched.io/role`` and
``dlsched.io/replica-index``; the driver's one watch selects
``dlsched.io/job-id`` without ``dlsched.io/recorded`` (the mark of a
forgotten attempt, ``WATCH_SELECTOR``) and keys its jobs by ``job_label``. The job's own
labels go on every object too (``user_labels``): a key that is not a valid
Kubernetes label key (or is in the reserved ``dlsched.io/`` prefix) is left
off, and a value that is not a valid label value is made one by
``label_value``; the labels exactly as given are kept in the annotation
``dlsched.io/labels`` (JSON, ``labels_annotation``).

Annotations: the codec. ``encode(JobMeta)`` gives the pod annotations that
let a restarted driver rebuild a job from its pods alone: the job id
verbatim (``dlsched.io/job-id``), the success rule
(``dlsched.io/decisive-roles``, ``dlsched.io/stopped-after-success``), the
replica counts (``dlsched.io/replicas``) and (MPI) the attempt's other
objects (``dlsched.io/objects``). ``decode(pod)`` reads them back (with the
attempt label) into the same ``JobMeta``, or ``None`` for a pod that does
not describe a job. Both live here, so the format has one owner.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from dlsched.errors import InvalidArgument
from dlsched.kit.parse import decimal
from drivers.common.planner import SuccessRule

LABEL_JOB = "dlsched.io/job-id"
LABEL_ATTEMPT = "dlsched.io/attempt"
#: The job's uid, on every object of a launch that gave one (another uid's objects are another job's).
LABEL_UID = "dlsched.io/job-uid"
LABEL_ROLE = "dlsched.io/role"
LABEL_INDEX = "dlsched.io/replica-index"
#: Pod annotations that let a restarted driver rebuild a job from its pods alone.
ANN_JOB = "dlsched.io/job-id"  # the job id verbatim (the label is ``job_label(job_id)``)
ANN_DECISIVE = "dlsched.io/decisive-roles"
ANN_STOPPED_AFTER = "dlsched.io/stopped-after-success"
ANN_REPLICAS = "dlsched.io/replicas"
ANN_LABELS = "dlsched.io/labels"  # the job's labels verbatim (JSON), when it has any
ANN_NAMES = "dlsched.io/names"  # the pod naming scheme (``pod_name``), when not 1
ANN_OBJECTS = "dlsched.io/objects"  # "<Kind>/<name>,..." the attempt's objects besides Service and Pods
#: A forgotten attempt (ForgetJobs): its Service carries the record (``ANN_FINAL``, JSON: the final
#: observation, replicas, other objects, usage) and every object the label ``LABEL_RECORDED``.
LABEL_RECORDED = "dlsched.io/recorded"
ANN_FINAL = "dlsched.io/final"
#: What the driver's one pod watch selects: dlsched's pods, less the forgotten attempts'.
WATCH_SELECTOR = f"{LABEL_JOB},!{LABEL_RECORDED}"
#: The kinds an attempt may own besides its Service and Pods.
OTHER_KINDS = ("Secret", "ConfigMap")
GPU_RESOURCE = "nvidia.com/gpu"
GPU_PRODUCT_LABEL = "nvidia.com/gpu.product"
DEFAULT_NAMESPACE = "default"
RESERVED_PREFIX = "dlsched.io"
MAX_LABEL = 63
LABEL_RE = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?\Z")
LABEL_VALUE_RE = re.compile(r"^([A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?)?\Z")
SUBDOMAIN_RE = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*\Z")
_LABEL_NAME_RE = re.compile(r"^[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?\Z")


# --------------------------------------------------------------------------- names


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
    return len(name) <= MAX_LABEL and bool(LABEL_RE.match(name))


def is_subdomain(name: str) -> bool:
    return len(name) <= 253 and bool(SUBDOMAIN_RE.match(name))


def is_label_value(text: str) -> bool:
    return len(text) <= MAX_LABEL and bool(LABEL_VALUE_RE.match(text))


def job_label(job_id: str) -> str:
    """The ``dlsched.io/job-id`` label value of a job's objects; the driver keys its jobs by it."""
    return dns_label(job_id)


def service_name(job_id: str, attempt: int) -> str:
    return dns_label(f"{job_id}-{attempt}")


def hostname(role: str, index: int) -> str:
    return dns_label(f"{role}-{index}")


#: Pod naming schemes (annotation ``ANN_NAMES``): 1, ``<job>-<attempt>-<role>-<index>``; 2, the
#: same, with a hash of the four parts when the role has a '-'. Job ids have '-' too, so under 1
#: job "x" role "w-1-ps" and job "x-1-w" role "ps" named the same pod: one user's job could make
#: another's pod look like its own (and delete it). Without a '-' in the role the name reads back
#: to one (job, attempt, role, index), so both schemes name it alike.
NAMES = 2


def pod_name(job_id: str, attempt: int, role: str, index: int, scheme: int = NAMES) -> str:
    text = f"{job_id}-{attempt}-{role}-{index}"
    if scheme < 2 or "-" not in role:
        return dns_label(text)
    digest = hashlib.sha256(f"{job_id}\0{attempt}\0{role}\0{index}".encode()).hexdigest()[:12]
    return f"{dns_label(text, MAX_LABEL - 13)}-{digest}"


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


# --------------------------------------------------------------------------- labels


def label_value(text: str) -> str:
    """A valid Kubernetes label value from any text; valid values are kept as they are.

    Every run of other characters becomes ``-``; when that changed or
    shortened the text, ``<prefix>-<8 hex>`` (a hash of the original)
    within 63 characters keeps distinct texts distinct.
    """
    if is_label_value(text):
        return text
    clean = re.sub(r"[^A-Za-z0-9_.-]+", "-", text)
    digest = hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()[:8]
    head = re.sub(r"^[^A-Za-z0-9]+|[^A-Za-z0-9]+\Z", "", clean[:MAX_LABEL - 9])
    return f"{head}-{digest}" if head else digest


def is_label_key(key: str) -> bool:
    prefix, slash, name = key.rpartition("/")
    if slash and not is_subdomain(prefix):
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


def job_labels(job_id: str, attempt: int) -> dict[str, str]:
    """The labels that select an attempt's objects (the Service's selector)."""
    return {LABEL_JOB: job_label(job_id), LABEL_ATTEMPT: str(attempt)}


def labels_annotation(labels: Mapping[str, str]) -> dict[str, str]:
    """The job's labels verbatim, as the annotation every object carries (none when it has none)."""
    return {ANN_LABELS: json.dumps(dict(labels), sort_keys=True, ensure_ascii=False)} if labels else {}


def is_recorded(obj: Mapping[str, Any]) -> bool:
    """Whether an object belongs to a forgotten attempt (``LABEL_RECORDED``).

    The watch's selector leaves such pods out; this is the same test made on
    what arrives, for a list or watch that does not apply it."""
    return LABEL_RECORDED in ((obj.get("metadata") or {}).get("labels") or {})


def uid_of(obj: Mapping[str, Any]) -> str:
    """The job uid an object's label ``LABEL_UID`` carries ("" for none)."""
    return str(((obj.get("metadata") or {}).get("labels") or {}).get(LABEL_UID) or "")


def attempt_of(obj: Mapping[str, Any]) -> int:
    """An object's ``dlsched.io/attempt`` label; 0 when it has none."""
    v = ((obj.get("metadata") or {}).get("labels") or {}).get(LABEL_ATTEMPT, "")
    return int(v) if decimal(str(v)) else 0


# --------------------------------------------------------------------------- the annotation codec


@dataclass(frozen=True)
class JobMeta:
    """What a job's pods say of it: enough to track it after a driver restart."""

    job_id: str
    attempt: int
    replicas: tuple[tuple[str, int], ...]  #: (role, replica count), in layout order
    success: SuccessRule
    #: (kind, name) of the attempt's objects besides the Service and the Pods
    others: tuple[tuple[str, str], ...] = ()
    uid: str = ""  #: the job's uid (label ``LABEL_UID``; "" for none)
    names: int = NAMES  #: the pod naming scheme its pods were made with (``pod_name``)

    def pods(self) -> list[tuple[str, int, str]]:
        """(role, index, pod name) of every replica."""
        return [(role, i, pod_name(self.job_id, self.attempt, role, i, self.names))
                for role, n in self.replicas for i in range(n)]


def encode(meta: JobMeta) -> dict[str, str]:
    """The pod annotations that carry ``meta``."""
    out = {
        ANN_JOB: meta.job_id,
        ANN_DECISIVE: ",".join(sorted(meta.success.decisive_roles)),
        ANN_STOPPED_AFTER: ",".join(sorted(meta.success.stopped_after_success)),
        ANN_REPLICAS: ",".join(f"{role}={n}" for role, n in meta.replicas),
    }
    if meta.others:
        out[ANN_OBJECTS] = ",".join(f"{kind}/{name}" for kind, name in meta.others)
    if meta.names != 1 and any("-" in role for role, _ in meta.replicas):  # else both schemes agree
        out[ANN_NAMES] = str(meta.names)
    return out


def _roles(value: str) -> frozenset[str]:
    return frozenset(r for r in value.split(",") if r)


def decode(pod: Mapping[str, Any]) -> JobMeta | None:
    """The job a pod's labels and annotations describe; ``None`` when they describe none.

    A pod made before the job-id annotation existed has the id only as its
    label (then label == id). The attempt is the pod's label; the success
    rule defaults to "every role decides" when the annotation is empty.
    """
    meta = pod.get("metadata") or {}
    key = (meta.get("labels") or {}).get(LABEL_JOB, "")
    ann = meta.get("annotations") or {}
    job_id = ann.get(ANN_JOB) or key
    attempt = attempt_of(pod)
    if attempt < 1 or not job_id or job_label(job_id) != key:
        return None
    counts = [part.partition("=") for part in ann.get(ANN_REPLICAS, "").split(",") if part]
    replicas = tuple((role, int(n)) for role, _, n in counts if decimal(n) and int(n) > 0)
    if not replicas:
        return None
    decisive = _roles(ann.get(ANN_DECISIVE, "")) or frozenset(role for role, _ in replicas)
    rule = SuccessRule(decisive, _roles(ann.get(ANN_STOPPED_AFTER, "")))
    others = tuple((kind, name) for kind, _, name in (part.partition("/") for part in
                                                      ann.get(ANN_OBJECTS, "").split(",") if part)
                   if kind in OTHER_KINDS and name)
    names = NAMES if ann.get(ANN_NAMES) == str(NAMES) else 1  # pods made before the annotation: 1
    return JobMeta(job_id, attempt, replicas, rule, others, str((meta.get("labels") or {}).get(LABEL_UID, "")),
                   names)
