"""Deleting a job's objects on the API server: its pods (``delete_pods``; in the background,
until gone: ``delete_until_gone``), and its earlier attempts, which a retry's launch leaves
(their logs stay readable) and cleaning the job up deletes with the newest (``delete_earlier``,
``delete_attempts``)."""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Callable, Sequence

from drivers.kubernetes import naming
from drivers.kubernetes.api import api_error
from drivers.kubernetes.tracking import KubeCluster, TrackedJob

log = logging.getLogger("dlsched.driver.kubernetes")

#: The kinds an attempt may own besides its Service and Pods, and the CoreV1Api call deleting one.
DELETE_OTHER = {"Secret": "delete_namespaced_secret", "ConfigMap": "delete_namespaced_config_map"}


async def delete_pods(c: KubeCluster, names: Sequence[str], grace: float) -> None:
    """Delete pods (gone already is fine), each with ``grace`` seconds to end; raises on the
    first that fails."""
    for name in names:
        try:
            await c.api.delete(c.api.core.delete_namespaced_pod, name, c.namespace, f"pod {name}",
                               grace_period_seconds=max(0, math.ceil(grace)))
        except Exception as e:
            log.warning("deleting pod %s/%s failed: %s", c.namespace, name, e)
            raise


async def delete_until_gone(c: KubeCluster, job: TrackedJob, names: Sequence[str], grace: float,
                            current: Callable[[], bool]) -> None:
    """``delete_pods`` in the background, each pod it could not delete (an API 503, 429) asked
    again with backoff: a pod left running after its job ended held its GPUs for good while the
    job read its replica STOPPED. Ends once ``current`` says the cluster was reconfigured, or
    the job was cleaned up (its clean-up deletes every pod)."""
    left, delay = list(names), 1.0
    while True:
        failed = []
        for name in left:
            try:
                await delete_pods(c, [name], grace)
            except Exception:  # noqa: BLE001 - logged by delete_pods; asked again
                failed.append(name)
        if not failed or job.cleaned or not current():
            return
        left = failed
        await asyncio.sleep(delay)
        delay = min(delay * 2, 30.0)


async def delete_earlier(c: KubeCluster, job: TrackedJob) -> None:
    """Delete the objects of the job's earlier attempts (a retry's launch leaves them, so
    their logs stay readable)."""
    await delete_attempts(c, job.job_id, job.uid, below=job.attempt)


async def delete_attempts(c: KubeCluster, job_id: str, uid: str, below: int | None = None) -> None:
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
