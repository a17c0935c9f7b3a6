"""A job's earlier attempts on the API server: a retry's launch leaves them (their logs stay
readable); cleaning the job up deletes them with the newest (``delete_earlier``)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence

from drivers.kubernetes import naming
from drivers.kubernetes.api import api_error
from drivers.kubernetes.tracking import KubeCluster, TrackedJob

#: The kinds an attempt may own besides its Service and Pods, and the CoreV1Api call deleting one.
DELETE_OTHER = {"Secret": "delete_namespaced_secret", "ConfigMap": "delete_namespaced_config_map"}


DeletePods = Callable[[KubeCluster, Sequence[str], float], Awaitable[None]]


async def delete_earlier(c: KubeCluster, job: TrackedJob, delete_pods: DeletePods) -> None:
    """Delete the objects of the job's earlier attempts (a retry's launch leaves them, so
    their logs stay readable)."""
    await delete_attempts(c, job.job_id, job.uid, delete_pods, below=job.attempt)


async def delete_attempts(c: KubeCluster, job_id: str, uid: str, delete_pods: DeletePods,
                          below: int | None = None) -> None:
    """Delete every attempt's objects of job ``job_id`` with ``uid`` (those below attempt
    ``below`` when given): each Service of the job's label and uid, its pods, and MPI's Secret
    (its SSH key) and ConfigMap. Also the clean-up of a job the driver neither tracks nor has a
    record of (it ended and a restarted driver never saw it: no pod left to adopt it from)."""
    key = naming.job_label(job_id)
    try:
        doc = await c.api.call(c.api.core.list_namespaced_service, c.namespace,
                               label_selector=f"{naming.LABEL_JOB}={key}")
    except Exception as e:  # noqa: BLE001
        raise api_error(e, f"listing the services of job {job_id}") from None
    for svc in doc.get("items") or ():
        attempt, name = naming.attempt_of(svc), str((svc.get("metadata") or {}).get("name") or "")
        if not name or attempt <= 0 or (below is not None and attempt >= below) or not uid \
                or naming.uid_of(svc) != uid:
            continue  # (an attempt of this very job: both uids known and the same)
        try:
            pods = await c.api.call(c.api.core.list_namespaced_pod, c.namespace,
                                    label_selector=f"{naming.LABEL_JOB}={key},{naming.LABEL_ATTEMPT}={attempt}")
        except Exception as e:  # noqa: BLE001
            raise api_error(e, f"listing the pods of attempt {attempt} of job {job_id}") from None
        names = [str(p["metadata"]["name"]) for p in pods.get("items") or () if (p.get("metadata") or {}).get("name")]
        await delete_pods(c, names, 0)
        for kind, obj in (("Secret", naming.secret_name(job_id, attempt)),
                          ("ConfigMap", naming.config_map_name(job_id, attempt))):
            await c.api.delete(getattr(c.api.core, DELETE_OTHER[kind]), obj, c.namespace, f"{kind.lower()} {obj}")
        await c.api.delete(c.api.core.delete_namespaced_service, name, c.namespace, f"service {name}",
                           propagation_policy="Background")
