"""Who may see and change which job: pure functions over ``Principal`` and ``Job``.

A job belongs to a project (``Job.project``; records from before projects
existed count as ``default``). Viewers of the project may read it (get, list,
watch, logs, usage), members may also stop and delete it, admins may do
everything everywhere. A job the caller may not read does not exist for it:
NOT_FOUND (``JOB_NOT_FOUND``), exactly as for a missing job, so ids of other
projects' jobs cannot be probed. A job it may read but not change:
PERMISSION_DENIED.
"""

from __future__ import annotations

from dlsched.auth.model import DEFAULT_PROJECT, Principal
from dlsched.errors import PermissionDenied
from job_manager.domain.errors import JobNotFound
from job_manager.domain.model import Job


def project_of(job: Job) -> str:
    return job.project or DEFAULT_PROJECT


def may_read(p: Principal, job: Job) -> bool:
    return p.may_read(project_of(job))


def check_read(p: Principal, job: Job) -> Job:
    if not may_read(p, job):
        raise JobNotFound(f"job {job.name} not found", metadata={"name": job.name})
    return job


def check_write(p: Principal, job: Job) -> Job:
    check_read(p, job)
    if not p.may_write(project_of(job)):
        raise PermissionDenied(
            f"{p.name} may not change jobs of project {project_of(job)}",
            metadata={"principal": p.name, "project": project_of(job), "required_role": "member"})
    return job
