"""The run-mode planner: per-process argv and environment.

``plan_processes(job_id, spec, placements)`` is a pure function. It checks the
run mode's structure, then lays out one process per *slot*: replicas x
processes_per_replica, in group order, then replica order, then process
order; the slot's position is its rank.

Every process gets::

    DLSCHED_JOB_ID         the job id
    DLSCHED_JOB_NAME       "jobs/{job_id}"
    DLSCHED_ROLE           its group's role
    DLSCHED_REPLICA_INDEX  its replica's index within the group
    DLSCHED_NUM_REPLICAS   replicas in its group

``RUN_MODE_MULTI_PROCESS`` processes also get the torch.distributed variables:
``MASTER_ADDR`` (rank 0's host), ``MASTER_PORT``, ``WORLD_SIZE`` (all
slots), ``RANK``, ``LOCAL_RANK`` / ``LOCAL_WORLD_SIZE`` (position among,
and number of, the processes on the same node) and ``NODE_RANK`` (from the
placement).

A placement says where each replica runs (host, node rank); a driver passes
its own (the local driver puts everything on one node). A later issue grows
this into the PS-Worker / Master-Worker / MPI planner; until then those modes
raise ``Unimplemented`` (reason ``UNSUPPORTED``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from dlsched.errors import FieldViolation, InvalidArgument, Unimplemented
from drivers.common.base import JobSpec, RunMode

PLANNED_RUN_MODES = (RunMode.SINGLE_PROCESS, RunMode.MULTI_PROCESS)
DEFAULT_MASTER_PORT = 29500


@dataclass(frozen=True)
class Placement:
    """Where one replica runs."""

    role: str
    replica_index: int
    host: str
    node_rank: int = 0


@dataclass(frozen=True)
class ProcessLaunch:
    """One process to start."""

    role: str
    replica_index: int
    process_index: int  # within its replica
    rank: int  # position among all processes of the job
    slot_index: int  # the index it reports as (logs, ReplicaStatus)
    host: str
    argv: tuple[str, ...]
    env: Mapping[str, str]  # added to the backend's environment; user env last
    working_dir: str


def check_run_mode(spec: JobSpec, field: str = "spec") -> None:
    """The run mode's structural rules; raises InvalidArgument / Unimplemented."""
    mode = spec.run_mode
    if mode not in PLANNED_RUN_MODES:
        raise Unimplemented(f"run mode {mode.name} is not supported yet",
                            metadata={"run_mode": f"RUN_MODE_{mode.name}"})
    groups = spec.replica_groups
    vs: list[FieldViolation] = []
    if len(groups) != 1:
        vs.append(FieldViolation(f"{field}.replica_groups", f"{mode.name} takes exactly one replica group"))
    elif mode is RunMode.SINGLE_PROCESS:
        g = groups[0]
        if g.replicas != 1:
            vs.append(FieldViolation(f"{field}.replica_groups[0].replicas", "SINGLE_PROCESS takes one replica"))
        if g.processes != 1:
            vs.append(FieldViolation(f"{field}.replica_groups[0].processes_per_replica",
                                     "SINGLE_PROCESS takes one process"))
    elif mode is RunMode.MULTI_PROCESS and groups[0].role != "worker":
        vs.append(FieldViolation(f"{field}.replica_groups[0].role", "MULTI_PROCESS takes role 'worker'"))
    if vs:
        raise InvalidArgument("; ".join(f"{v.field}: {v.description}" for v in vs), vs)


def plan_processes(job_id: str, spec: JobSpec, placements: Sequence[Placement], *,
                   master_port: int = DEFAULT_MASTER_PORT) -> list[ProcessLaunch]:
    """Every process of the job, in rank order."""
    check_run_mode(spec)
    where = {(p.role, p.replica_index): p for p in placements}
    slots: list[tuple[int, int, int, Placement]] = []  # (group, replica, process, placement)
    for gi, g in enumerate(spec.replica_groups):
        for r in range(g.replicas):
            p = where.get((g.role, r))
            if p is None:
                raise ValueError(f"no placement for {g.role}[{r}]")
            for k in range(g.processes):
                slots.append((gi, r, k, p))
    world = len(slots)
    master_addr = slots[0][3].host if slots else ""
    per_node: dict[int, int] = {}
    for *_, p in slots:
        per_node[p.node_rank] = per_node.get(p.node_rank, 0) + 1
    seen_on_node: dict[int, int] = {}
    out: list[ProcessLaunch] = []
    multi = spec.run_mode is RunMode.MULTI_PROCESS
    for rank, (gi, r, k, p) in enumerate(slots):
        g = spec.replica_groups[gi]
        env: dict[str, str] = {
            "DLSCHED_JOB_ID": job_id,
            "DLSCHED_JOB_NAME": f"jobs/{job_id}",
            "DLSCHED_ROLE": g.role,
            "DLSCHED_REPLICA_INDEX": str(r),
            "DLSCHED_NUM_REPLICAS": str(g.replicas),
        }
        local_rank = seen_on_node.get(p.node_rank, 0)
        seen_on_node[p.node_rank] = local_rank + 1
        if multi:
            env.update({
                "MASTER_ADDR": master_addr,
                "MASTER_PORT": str(master_port),
                "WORLD_SIZE": str(world),
                "RANK": str(rank),
                "LOCAL_RANK": str(local_rank),
                "LOCAL_WORLD_SIZE": str(per_node[p.node_rank]),
                "NODE_RANK": str(p.node_rank),
            })
        env.update(g.env)
        out.append(ProcessLaunch(
            role=g.role, replica_index=r, process_index=k, rank=rank,
            slot_index=rank if multi else r, host=p.host, argv=g.argv, env=env,
            working_dir=g.working_dir,
        ))
    return out
