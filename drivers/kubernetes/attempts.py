"""A job's earlier attempts on the API server: a retry's launch leaves them (their logs stay
readable); cleaning the job up deletes them with the newest (``delete_earlier``)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence

from drivers.kubernetes import naming
from drivers.kubernetes.api import api_error
from drivers.kubernetes.tracking import KubeCluster, TrackedJob

#: The kinds an attempt may own besides its Service and Pods, and the CoreV1Api call deleting one.
DELETE_OTHER = {"Secret": "delete_namespaced_secret", "ConfigMap": "delete_namespaced_config_map"}


async def delete_earlier(c: KubeCluster, job: TrackedJob,
                         delete_pods: Callable[[KubeCluster, Sequence[str], float], Awaitable[None]]) -> None:
    """Delete the objects of the job's earlier attempts (a retry's launch leaves them, so
    their logs stay readable): each earlier Service of the job's label and uid, its pods,
    and MPI's Secret (its SSH key) and ConfigMap."""
    key = naming.job_label(job.job_id)
    try:
        doc = await c.api.call(c.api.core.list_namespaced_service, c.namespace,
                               label_selector=f"{naming.LABEL_JOB}={key}")
    except Exception as e:  # noqa: BLE001
        raise api_error(e, f"listing the services of job {job.job_id}") from None
    for svc in doc.get("items") or ():
        attempt, name = naming.attempt_of(svc), str((svc.get("metadata") or {}).get("name") or "")
        if not name or not 0 < attempt < job.attempt or not job.uid or naming.uid_of(svc) != job.uid:
            continue  # (an earlier attempt of this very job: both uids known and the same)
        try:
            pods = await c.api.call(c.api.core.list_namespaced_pod, c.namespace,
                                    label_selector=f"{naming.LABEL_JOB}={key},{naming.LABEL_ATTEMPT}={attempt}")
        except Exception as e:  # noqa: BLE001
            raise api_error(e, f"listing the pods of attempt {attempt} of job {job.job_id}") from None
        names = [str(p["metadata"]["name"]) for p in pods.get("items") or () if (p.get("metadata") or {}).get("name")]
        await delete_pods(c, names, 0)
        for kind, obj in (("Secret", naming.secret_name(job.job_id, attempt)),
                          ("ConfigMap", naming.config_map_name(job.job_id, attempt))):
            await c.api.delete(getattr(c.api.core, DELETE_OTHER[kind]), obj, c.namespace, f"{kind.lower()} {obj}")
        await c.api.delete(c.api.core.delete_namespaced_service, name, c.namespace, f"service {name}",
                           propagation_policy="Background")
