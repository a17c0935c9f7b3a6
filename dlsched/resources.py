"""One resource model: what a job asks of a backend, for the matcher and the renderers alike.

ClusterManager's matcher decides "fits" from these numbers and the backends
ask for exactly these, so a job the matcher places is one the backend can
hold, and a job no node can hold is refused at submit with the reason.

CPUs depend on how a backend hands them out (``CpuRule``):

- ``AS_GIVEN`` (Kubernetes requests, Ray resources, local): fractional, per
  replica as the spec says; 0 asks for nothing (the local backend enforces
  nothing: it runs what it is given, so the matcher refuses only what the
  spec itself asks beyond the host).
- ``WHOLE_TASKS`` (Slurm): every process is a task with
  ``--cpus-per-task`` whole CPUs, one value for the whole job: the largest
  ``ceil(cpu / processes)`` of its groups, at least 1. A replica of P
  processes that asks for CPUs is asked for ``P * cpus_per_task`` on its
  node; one that asks for none (0: the backend's default) is not counted.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Sequence
from typing import Any


class CpuRule(enum.Enum):
    AS_GIVEN = "as-given"
    WHOLE_TASKS = "whole-tasks"


def _processes(group: Any) -> int:
    return max(1, int(group.processes_per_replica))


def cpus_per_task(groups: Sequence[Any]) -> int:
    """Slurm's ``--cpus-per-task`` for a job: the largest whole share of any group, at least 1."""
    return max([math.ceil(g.resources.cpu / _processes(g)) if g.resources.cpu > 0 else 1 for g in groups] + [1])


def replica_cpus(groups: Sequence[Any], rule: CpuRule) -> list[float]:
    """CPUs one replica of each group is asked for, in the order of ``groups``."""
    if rule is CpuRule.WHOLE_TASKS:
        cpt = cpus_per_task(groups)
        # cpu 0 is "the backend's default": the site decides (Slurm may share or overcommit), not counted.
        return [float(_processes(g) * cpt) if g.resources.cpu > 0 else 0.0 for g in groups]
    return [float(g.resources.cpu) for g in groups]


def job_cpus(groups: Sequence[Any], rule: CpuRule) -> float:
    """CPUs the whole job is asked for."""
    return float(sum(max(g.replicas, 1) * c for g, c in zip(groups, replica_cpus(groups, rule), strict=True)))
