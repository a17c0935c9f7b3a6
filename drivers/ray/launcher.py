"""The in-cluster launcher: ``python -m drivers.ray.launcher`` as a Ray job's entrypoint.

It reads the job from ``DLSCHED_RAY_JOB`` (``render.render_submission``
writes it) and runs the job's processes as ``drivers.common.planner`` plans
them, so every run mode sees the same environment as on any other backend.

- ``local`` (MULTI_PROCESS): every process on this node, ``MASTER_ADDR``
  127.0.0.1 and a free ``MASTER_PORT``.
- ``placement-group`` (MASTER_WORKER, PS_WORKER): one bundle per replica
  (its CPUs, or 0.1 when it names none; its GPUs and memory) in a placement
  group; a probe task per bundle reports the node's address and a free port
  there; the plan is made with those placements; one task per replica runs
  that replica's processes. This module imports ``ray`` only here, inside the
  cluster (the driver never does).

Every output line of a process is printed as ``[dlsched <role>-<index>
<out|err>] <text>`` (the driver attributes it to that replica; Ray may prefix
task output with ``(task pid=N)``, which the driver skips). The success rule
is the plan's: once every deciding process exited 0 the rest are stopped and
the launcher exits 0; the first process that fails stops the rest and the
launcher exits with its code. SIGTERM (a Ray stop) stops every process.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from drivers.common import planner
from drivers.common.base import JobSpec
from drivers.ray import render

_print_lock = threading.Lock()
DEFAULT_BUNDLE_CPU = 0.1


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return int(s.getsockname()[1])


def _die_with_parent() -> None:
    with contextlib.suppress(Exception):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def _pump(stream: Any, tag: str) -> None:
    for raw in iter(stream.readline, b""):
        text = raw.decode(errors="replace").rstrip("\n")
        with _print_lock:
            sys.stdout.write(f"[dlsched {tag}] {text}\n")
            sys.stdout.flush()
    stream.close()


def run_processes(procs: Sequence[planner.ProcessLaunch], decisive: Callable[[str], bool],
                  stop_event: threading.Event | None = None) -> int:
    """Start ``procs``, apply the success rule, return the exit code."""
    env0 = {k: v for k, v in os.environ.items() if k != render.JOB_ENV}
    running: list[tuple[planner.ProcessLaunch, subprocess.Popen[bytes]]] = []
    pumps = []
    try:
        for p in procs:
            cwd = p.working_dir or None
            child = subprocess.Popen(list(p.argv), env={**env0, **p.env}, cwd=cwd, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, start_new_session=True,
                                     preexec_fn=_die_with_parent)  # noqa: PLW1509
            running.append((p, child))
            for stream, kind in ((child.stdout, "out"), (child.stderr, "err")):
                t = threading.Thread(target=_pump, args=(stream, f"{p.role}-{p.slot_index} {kind}"), daemon=True)
                t.start()
                pumps.append(t)
        pending = {id(c): (p, c) for p, c in running}
        while pending:
            if stop_event is not None and stop_event.is_set():
                return 143
            for key, (_p, c) in list(pending.items()):
                rc = c.poll()
                if rc is None:
                    continue
                del pending[key]
                if rc != 0:
                    return rc if rc > 0 else 128 - rc
            if not any(decisive(p.role) for p, _ in pending.values()):
                return 0
            time.sleep(0.05)
        return 0
    finally:
        for _, c in running:
            if c.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(c.pid, signal.SIGTERM)
        deadline = time.monotonic() + 5
        for _, c in running:
            with contextlib.suppress(subprocess.TimeoutExpired):
                c.wait(max(0.0, deadline - time.monotonic()))
            if c.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(c.pid, signal.SIGKILL)
                c.wait()
        for t in pumps:
            t.join(2)


def _layout(spec: JobSpec) -> list[tuple[str, int]]:
    order = planner.ROLES.get(spec.run_mode, ())
    groups = sorted(spec.replica_groups, key=lambda g: order.index(g.role) if g.role in order else len(order))
    return [(g.role, r) for g in groups for r in range(g.replicas)]


def run_local(job: dict[str, Any], spec: JobSpec, stop: threading.Event) -> int:
    ports = {(g.role, r): _free_port() for g in spec.replica_groups for r in range(g.replicas)}
    placements = [planner.Placement(role, r, render.LOCAL_HOST, 0, ports[(role, r)]) for role, r in _layout(spec)]
    plan = planner.plan_job(job["job_id"], spec, placements, master_port=_free_port())
    decisive = plan.success.decisive_roles
    return run_processes(plan.processes, lambda role: role in decisive, stop)


def run_placement_group(job: dict[str, Any], spec: JobSpec) -> int:  # pragma: no cover - needs a Ray cluster
    import ray
    from ray.util.placement_group import placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    ray.init()
    layout = _layout(spec)
    groups = {g.role: g for g in spec.replica_groups}

    def bundle(role: str) -> dict[str, float]:
        res = groups[role].resources
        b: dict[str, float] = {"CPU": res.cpu if res.cpu > 0 else DEFAULT_BUNDLE_CPU}
        if res.gpus:
            b["GPU"] = float(res.gpus)
        if res.memory_bytes:
            b["memory"] = float(res.memory_bytes)
        return b

    pg = placement_group([bundle(role) for role, _ in layout], strategy=job.get("placement_strategy", "PACK"))
    ray.get(pg.ready())

    def in_bundle(i: int) -> PlacementGroupSchedulingStrategy:
        return PlacementGroupSchedulingStrategy(placement_group=pg, placement_group_bundle_index=i)

    @ray.remote(num_cpus=0)
    def probe() -> tuple[str, int, int]:
        from drivers.ray import launcher

        return ray.util.get_node_ip_address(), launcher._free_port(), launcher._free_port()  # type: ignore[no-untyped-call]

    found = ray.get([probe.options(scheduling_strategy=in_bundle(i)).remote() for i in range(len(layout))])
    node_rank: dict[str, int] = {}
    placements = []
    for (role, r), (ip, port, _) in zip(layout, found, strict=True):
        node_rank.setdefault(ip, len(node_rank))
        placements.append(planner.Placement(role, r, ip, node_rank[ip], port))
    plan = planner.plan_job(job["job_id"], spec, placements, master_port=found[0][2])

    @ray.remote
    def replica(procs: list[planner.ProcessLaunch]) -> int:
        # By module name: run as __main__, this module would be pickled by value.
        from drivers.ray import launcher

        return launcher.run_processes(procs, lambda role: True)

    refs = {}
    for i, (role, r) in enumerate(layout):
        procs = [p for p in plan.processes if (p.role, p.replica_index) == (role, r)]
        b = bundle(role)
        refs[replica.options(scheduling_strategy=in_bundle(i), num_cpus=b["CPU"], num_gpus=b.get("GPU", 0),
                             memory=b.get("memory")).remote(procs)] = role
    decisive = plan.success.decisive_roles
    code = 0
    while refs:
        done, _ = ray.wait(list(refs), num_returns=1)
        role = refs.pop(done[0])
        try:
            rc = ray.get(done[0])
        except Exception as e:  # the task itself failed (node lost, worker killed)
            print(f"replica task of {role} failed: {e}", file=sys.stderr, flush=True)
            rc = 1
        if rc != 0:
            code = rc
            break
        if not any(r in decisive for r in refs.values()):
            break
    for ref in refs:
        with contextlib.suppress(Exception):
            ray.cancel(ref)
    with contextlib.suppress(Exception):
        ray.util.remove_placement_group(pg)
    return code


def main() -> int:
    job = json.loads(os.environ[render.JOB_ENV])
    spec = render.spec_from_json(job["spec"])
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    if job["mode"] == "local":
        return run_local(job, spec, stop)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    return run_placement_group(job, spec)


if __name__ == "__main__":
    sys.exit(main())
