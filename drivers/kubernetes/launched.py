"""Whether every object of an attempt's launch was made: a mark on its Service.

A driver learns of jobs from their pods. After a restart, an adopted job with a pod missing is
either a launch that stopped part-way (JobManager launches the attempt again, and the launch
makes the rest) or a launch that completed and has lost a pod since (deleted while the driver
was down: a node lost, a ``kubectl delete``): that replica is FAILED ``PodDeleted``, where it
read PENDING "created; not observed yet" for ever. A completed launch marks its Service
(``ANN_LAUNCHED``, in the background: a launch answers without waiting for it); a restarted
driver reads the mark for an adopted job with a pod missing.
"""

from __future__ import annotations

import logging

from drivers.kubernetes import naming
from drivers.kubernetes.api import status_of, status_text
from drivers.kubernetes.tracking import KubeCluster, TrackedJob

log = logging.getLogger("dlsched.driver.kubernetes")

ANN_LAUNCHED = "dlsched.io/launched"


async def mark(c: KubeCluster, job: TrackedJob) -> None:
    """Mark the attempt's Service: every object of its launch was made (a failure is logged: a
    driver restarted then leaves a pod lost meanwhile PENDING, as before the mark)."""
    body = {"metadata": {"annotations": {ANN_LAUNCHED: "true"}}}
    try:
        await c.api.call(c.api.core.patch_namespaced_service, job.service, c.namespace, body)
    except Exception as e:  # noqa: BLE001
        if status_of(e) != 404:
            log.warning("marking the launch of %s made: %s", job.job_id, status_text(e))


async def was_launched(c: KubeCluster, job: TrackedJob) -> bool:
    """Whether the attempt's Service carries the mark (and is this job's: its uid)."""
    try:
        svc = await c.api.call(c.api.core.read_namespaced_service, job.service, c.namespace)
    except Exception:  # noqa: BLE001 - not known: the job keeps waiting for its launch
        return False
    meta = svc.get("metadata") or {}
    return (meta.get("annotations") or {}).get(ANN_LAUNCHED) == "true" and naming.uid_of(svc) == job.uid
