"""The in-cluster launcher: ``python -m drivers.ray.launcher``, the entrypoint of every dlsched Ray job.

It reads the job from ``DLSCHED_RAY_JOB`` (``render.render_submission``
writes it) and runs the job's processes as ``drivers.common.planner`` plans
them, so every run mode sees the same environment as on any other backend.

- ``local`` (SINGLE_PROCESS, MULTI_PROCESS): every process on the
  entrypoint's node, ``MASTER_ADDR`` 127.0.0.1 and a free ``MASTER_PORT``.
- ``placement-group`` (MASTER_WORKER, PS_WORKER): one bundle per replica
  (its CPUs, or 0.1 when it names none; its GPUs and memory) in a placement
  group; a probe task per bundle reports its node's id, then one task per
  node picks that node's ports all at once (``drivers.common.ports``: a
  replica's port and, on bundle 0's node, ``MASTER_PORT``; never the same
  port twice in one job); each replica's host is the address Ray registered that node with
  (``ray.nodes()`` ``NodeManagerAddress``, not what the probe's own
  interface lookup would pick); the plan is made with those placements; one
  task per replica runs that replica's processes. This module imports
  ``ray`` only here, inside the cluster (the driver never does).

Output and usage go to files in the node's Ray log directory
(``drivers.ray.layout``: per process ``<role>-<index>.out`` / ``.err`` as
``<unix-nanos> <text>`` lines, ``.usage`` samples; the manifest
``replicas.jsonl`` on the entrypoint's node says where each process's files
are and how each process exited), which the driver reads through Ray's
state API. The log directory is where Ray sends this process's stdout (the
``job-driver-<id>.log`` of Ray Jobs, a worker's ``worker-*.out``), else
``<temp-dir>/<session>/logs`` of the runtime context. The launcher's own
stdout, the job log Ray keeps beside its own lines, carries only a line per
failed process (``dlsched: <role>-<index> exited with code N``), so Ray's
failure message names it.

A sampler thread per node (``drivers.ray.sampler``) measures each process's
session every ``SAMPLE_SECONDS`` and appends a sample; a process that ended
gets a last one with ``running: false``. The success rule is the plan's:
once every deciding process exited 0 the rest are stopped and the launcher
exits 0; the first process that fails stops the rest and the launcher exits
with its code. SIGTERM (a Ray stop) stops every process. A process whose end
was not seen before the job was decided is recorded stopped, whatever it
exits with (in placement-group mode each replica's task returns its
processes' ends to the entrypoint, which records them).

A process's environment is the node's without its ``DLSCHED_*`` names, then
``PWD`` (its working directory, as a shell sets it), then the plan's.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from dlsched.spec_rules import RESERVED_ENV_PREFIX
from drivers.common import planner, procfs
from drivers.common.base import JobSpec
from drivers.common.convert import MAX_LINE_CHARS, pieces
from drivers.common.ports import free_ports
from drivers.ray import layout, render
from drivers.ray.sampler import Sampler

DEFAULT_BUNDLE_CPU = 0.1
SAMPLE_SECONDS = 1.0
FIRST_SAMPLE_SECONDS = 0.1
CHUNK = 1 << 16
MAX_LINE = MAX_LINE_CHARS  # a longer line without a newline is written in pieces
STOP_GRACE_SECONDS = render.STOP_GRACE_SECONDS
#: How long the replicas' tasks get to end after their cancel, before the placement group goes.
CANCEL_WAIT_SECONDS = STOP_GRACE_SECONDS + 25


def _parent_death_signal(sig: int) -> None:
    """This process gets ``sig`` when its parent dies (PR_SET_PDEATHSIG; best effort)."""
    with contextlib.suppress(Exception):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, sig)


def _die_with_parent() -> None:
    """In the child before exec: it dies with its launcher (PR_SET_PDEATHSIG), and starts with
    no signal blocked or ignored (a Ray worker running a replica's task blocks SIGINT: a
    process started from there did too, unlike one on any other backend)."""
    _parent_death_signal(signal.SIGKILL)
    with contextlib.suppress(Exception):
        signal.pthread_sigmask(signal.SIG_SETMASK, set())
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGQUIT, signal.SIGHUP):
        with contextlib.suppress(Exception):
            signal.signal(sig, signal.SIG_DFL)


def ray_logs_dir() -> str:
    """This node's Ray log directory (see the module docstring)."""
    with contextlib.suppress(OSError):
        d = os.path.dirname(os.readlink("/proc/self/fd/1"))
        if os.path.basename(d) == "logs" and os.path.isdir(d):
            return d
    import ray

    ctx = ray.get_runtime_context()
    return os.path.join(ctx.get_temp_dir(), ctx.get_session_name(), "logs")


def _append(path: str, text: str) -> None:
    with open(path, "a") as f:
        f.write(text)


@dataclass
class Outputs:
    """The files of one submission under one node's Ray log directory."""

    logs_dir: str
    sid: str
    lock: threading.Lock = field(default_factory=threading.Lock)

    def path(self, rel: str) -> str:
        return os.path.join(self.logs_dir, rel)

    def prepare(self) -> None:
        os.makedirs(self.path(layout.job_dir(self.sid)), exist_ok=True)

    def create(self, p: planner.ProcessLaunch) -> None:
        for kind in (*layout.STREAMS, "usage"):
            with open(self.path(layout.output(self.sid, p.role, p.slot_index, kind)), "ab"):
                pass

    def note(self, doc: dict[str, Any]) -> None:
        """One manifest line (the entrypoint's node only)."""
        with self.lock:
            _append(self.path(layout.manifest(self.sid)), layout.manifest_line(doc))

    def usage(self, p: planner.ProcessLaunch, doc: dict[str, object]) -> None:
        _append(self.path(layout.output(self.sid, p.role, p.slot_index, "usage")), json.dumps(doc) + "\n")


def _pump(fd: int, path: str) -> None:
    """Copy a pipe to ``path`` as ``<nanos> <line>`` lines, then ``eof``."""
    last, pending = 0, b""

    def stamp() -> int:
        nonlocal last
        last = max(time.time_ns(), last + 1)
        return last

    with open(path, "ab") as out:
        while True:
            try:
                chunk = os.read(fd, CHUNK)
            except OSError:
                chunk = b""
            if not chunk:
                break
            *whole, pending = (pending + chunk).split(b"\n")
            lines: list[bytes] = []
            for ln in whole:  # a long line in pieces, each cut at a character's start (as on local)
                cuts, rest = pieces(ln, MAX_LINE)
                lines += [*cuts, rest]
            cuts, pending = pieces(pending, MAX_LINE)
            lines.extend(cuts)
            if lines:
                out.write(b"".join(b"%d %s\n" % (stamp(), ln) for ln in lines))
                out.flush()
        if pending:
            out.write(b"%d %s\n" % (stamp(), pending))
        out.write(layout.EOF.encode() + b"\n")
    os.close(fd)


def _sample_loop(sampler: Sampler, procs: dict[int, planner.ProcessLaunch], outputs: Outputs,
                 done: threading.Event, ended: set[int]) -> None:
    wait = FIRST_SAMPLE_SECONDS
    while not done.wait(wait):
        wait = SAMPLE_SECONDS
        t = time.time()
        for pid, smp in sampler.sample().items():
            if pid not in ended:
                outputs.usage(procs[pid], smp.doc(t))


def run_processes(procs: Sequence[planner.ProcessLaunch], decisive: Callable[[str], bool],
                  outputs: Outputs, stop_event: threading.Event | None = None,
                  on_exit: Callable[[planner.ProcessLaunch, int, bool], None] | None = None,
                  stop_signalled: bool = False) -> tuple[int, planner.ProcessLaunch | None]:
    """Start ``procs``, apply the success rule; (exit code, the process that failed).

    Once the job is decided (a failure, the success rule, ``stop_event``) every process whose
    end was not seen before is stopped, whatever it then exits with: SIGTERM, SIGKILL after
    STOP_GRACE_SECONDS. ``stop_signalled``: a set ``stop_event`` means the processes got the
    stop's SIGTERM already (Ray's job supervisor signals every descendant of the entrypoint),
    so none is sent from here (a second one, as no other backend sends). In a child subreaper
    (the entrypoint, a replica's task: ``procfs.become_subreaper``), what the processes left
    behind (a daemon that called setsid comes here, not to init) is SIGKILLed once they have
    ended, as on local: it held their output pipes (the job's end waited for them) and
    outlived the job.
    """
    subreaper = procfs.is_subreaper()
    # The node's own DLSCHED_* settings (the head's token and key files, the job's JSON) are
    # no job's: those names are the planner's alone, as on every other backend.
    env0 = {k: v for k, v in os.environ.items()  # (the supervisor's stop wait is not the job's)
            if not k.upper().startswith(RESERVED_ENV_PREFIX) and k != render.STOP_WAIT_ENV}
    running: list[tuple[planner.ProcessLaunch, subprocess.Popen[bytes]]] = []
    pumps: list[threading.Thread] = []
    outputs.prepare()
    by_pid: dict[int, planner.ProcessLaunch] = {}
    ended: set[int] = set()
    sampler = Sampler([])
    done = threading.Event()
    sampling = threading.Thread(target=_sample_loop, args=(sampler, by_pid, outputs, done, ended), daemon=True)

    killed: set[int] = set()

    def finish(p: planner.ProcessLaunch, c: subprocess.Popen[bytes], rc: int) -> None:
        if c.pid not in ended:
            ended.add(c.pid)
            with contextlib.suppress(OSError):  # what it left in its group ends with it (as on local)
                os.killpg(c.pid, signal.SIGKILL)
            outputs.usage(p, sampler.end(c.pid).doc(time.time()))
            if on_exit is not None:
                on_exit(p, rc, c.pid in killed)
    try:
        for p in procs:
            if stop_event is not None and stop_event.is_set():
                break  # stopped meanwhile: none is started after (it would miss the stop's SIGTERM)
            outputs.create(p)
            cwd = p.working_dir if p.working_dir and not render.is_uri(p.working_dir) else None
            out_r, out_w = os.pipe()
            err_r, err_w = os.pipe()
            try:
                child = subprocess.Popen(list(p.argv), env={**env0, "PWD": planner.shell_pwd(cwd), **p.env}, cwd=cwd, stdin=subprocess.DEVNULL,
                                         stdout=out_w, stderr=err_w, start_new_session=True,
                                         preexec_fn=_die_with_parent)  # noqa: PLW1509
            except OSError as e:
                for fd in (out_r, out_w, err_r, err_w):
                    os.close(fd)
                code, line = planner.start_failure(e, p.argv[0], cwd)
                _append(outputs.path(layout.output(outputs.sid, p.role, p.slot_index, "err")),
                        layout.format_line(time.time_ns(), line) + layout.EOF + "\n")
                print(f"dlsched: {p.role}-{p.slot_index} could not start: {e}", flush=True)
                if on_exit is not None:  # its end, as for a process that ran (not "stopped", exit 0)
                    on_exit(p, code, False)
                return code, p
            os.close(out_w)
            os.close(err_w)
            running.append((p, child))
            by_pid[child.pid] = p
            sampler.add(child.pid)
            for fd, kind in ((out_r, "out"), (err_r, "err")):
                path = outputs.path(layout.output(outputs.sid, p.role, p.slot_index, kind))
                t = threading.Thread(target=_pump, args=(fd, path), daemon=True)
                t.start()
                pumps.append(t)
        sampling.start()
        pending = {id(c): (p, c) for p, c in running}
        while pending:
            if stop_event is not None and stop_event.is_set():
                return 143, None
            for key, (p, c) in list(pending.items()):
                rc = c.poll()
                if rc is None:
                    continue
                del pending[key]
                code = rc if rc >= 0 else 128 - rc
                finish(p, c, code)
                if code != 0:
                    print(f"dlsched: {p.role}-{p.slot_index} exited with code {code}", flush=True)
                    return code, p
            if not any(decisive(p.role) for p, _ in pending.values()):
                return 0, None
            time.sleep(0.05)
        return 0, None
    finally:
        signalled = stop_signalled and stop_event is not None and stop_event.is_set()
        for _, c in running:
            if c.pid not in ended:  # its end not seen before the job was decided: stopped
                killed.add(c.pid)
                if not signalled and c.poll() is None:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(c.pid, signal.SIGTERM)
        deadline = time.monotonic() + STOP_GRACE_SECONDS
        for _, c in running:
            with contextlib.suppress(subprocess.TimeoutExpired):
                c.wait(max(0.0, deadline - time.monotonic()))
            if c.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(c.pid, signal.SIGKILL)
                c.wait()
        if subreaper:
            procfs.kill_adopted({c.pid for _, c in running})
        done.set()
        if sampling.is_alive():
            sampling.join(5)
        for p, c in running:
            finish(p, c, c.returncode if c.returncode >= 0 else 128 - c.returncode)
        for t in pumps:
            t.join(5)


def _layout(spec: JobSpec) -> list[tuple[str, int]]:
    order = planner.ROLES.get(spec.run_mode, ())
    groups = sorted(spec.replica_groups, key=lambda g: order.index(g.role) if g.role in order else len(order))
    return [(g.role, r) for g in groups for r in range(g.replicas)]


def _exit_noter(outputs: Outputs) -> Callable[[planner.ProcessLaunch, int, bool], None]:
    def note(p: planner.ProcessLaunch, rc: int, stopped: bool) -> None:
        doc: dict[str, Any] = {"role": p.role, "index": p.slot_index, "exit": rc}
        if stopped:
            doc["stopped"] = True
        outputs.note(doc)
    return note


def local_gpus(spec: JobSpec, layout_: list[tuple[str, int]], visible: str) -> list[tuple[str, ...]]:
    """Each replica's share of the GPUs Ray gave the entrypoint (``visible``: its
    CUDA_VISIBLE_DEVICES), in layout order, as many as its group asks: every replica saw
    all of the job's GPUs. Without enough of them listed, none (each inherits them all)."""
    ids = [g for g in visible.split(",") if g.strip()] if visible else []
    asked = {g.role: max(0, g.resources.gpus) for g in spec.replica_groups}
    if sum(asked[role] for role, _ in layout_) > len(ids):
        return [() for _ in layout_]
    out, at = [], 0
    for role, _ in layout_:
        out.append(tuple(ids[at:at + asked[role]]))
        at += asked[role]
    return out


def run_local(job: dict[str, Any], spec: JobSpec, stop: threading.Event) -> int:
    layout_ = _layout(spec)
    *ports, master_port = free_ports(len(layout_) + 1)
    gpus = local_gpus(spec, layout_, os.environ.get("CUDA_VISIBLE_DEVICES", ""))
    placements = [planner.Placement(role, r, render.LOCAL_HOST, 0, port, gpus=share)
                  for (role, r), port, share in zip(layout_, ports, gpus, strict=True)]
    plan = planner.plan_job(job["job_id"], spec, placements, master_port=master_port)
    decisive = plan.success.decisive_roles
    outputs = Outputs(ray_logs_dir(), job["submission_id"])
    outputs.prepare()
    for p in plan.processes:
        outputs.create(p)
        outputs.note({"role": p.role, "index": p.slot_index, "node_id": ""})
    rc, _ = run_processes(plan.processes, lambda role: role in decisive, outputs, stop, _exit_noter(outputs),
                          stop_signalled=True)  # ``stop`` is the SIGTERM of Ray's job supervisor
    return rc


#: A process's end: the process, its exit code, whether it was stopped.
End = tuple[planner.ProcessLaunch, int, bool]


def run_replica(sid: str, procs: list[planner.ProcessLaunch]) -> tuple[int, str, int, list[End]]:
    """One replica's processes, in a Ray task: (exit code, role and index of the failed
    process, each process's end) for the entrypoint's manifest. Ray's cancel of the task
    (``interrupt_main``: the job was decided elsewhere) stops them as a stop does, and the task
    still returns their ends."""
    ends: list[End] = []
    stop = threading.Event()
    old: Any = None
    with contextlib.suppress(ValueError):  # not the main thread: a cancel is a KeyboardInterrupt
        old = signal.signal(signal.SIGINT, lambda *_: stop.set())
    try:
        rc, failed = run_processes(procs, lambda role: True, Outputs(ray_logs_dir(), sid), stop,
                                   lambda p, code, stopped: ends.append((p, code, stopped)))
    finally:
        if old is not None:
            signal.signal(signal.SIGINT, old)
    return rc, failed.role if failed else "", failed.slot_index if failed else -1, ends


def run_placement_group(job: dict[str, Any], spec: JobSpec) -> int:  # pragma: no cover - needs a Ray cluster
    import ray
    from ray.util.placement_group import placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    ray.init()
    sid = job["submission_id"]
    outputs = Outputs(ray_logs_dir(), sid)
    outputs.prepare()
    layout_ = _layout(spec)
    groups = {g.role: g for g in spec.replica_groups}

    def bundle(role: str) -> dict[str, float]:
        res = groups[role].resources
        b: dict[str, float] = {"CPU": res.cpu if res.cpu > 0 else DEFAULT_BUNDLE_CPU}
        if res.gpus:
            b["GPU"] = float(res.gpus)
        if res.memory_bytes:
            b["memory"] = float(res.memory_bytes)
        return b

    pg = placement_group([bundle(role) for role, _ in layout_], strategy=job.get("placement_strategy", "PACK"))
    ray.get(pg.ready())

    def in_bundle(i: int) -> PlacementGroupSchedulingStrategy:
        return PlacementGroupSchedulingStrategy(placement_group=pg, placement_group_bundle_index=i)

    @ray.remote(num_cpus=0)
    def probe() -> str:
        return str(ray.get_runtime_context().get_node_id())

    @ray.remote(num_cpus=0)
    def ports_on_node(n: int) -> list[int]:
        from drivers.common.ports import free_ports as free

        return free(n)

    node_ids: list[str] = ray.get([probe.options(scheduling_strategy=in_bundle(i)).remote() for i in range(len(layout_))])
    # One port call per node, so a node's ports are distinct; the master's port on bundle 0's node.
    bundles_on: dict[str, list[int]] = {}
    for i, nid in enumerate(node_ids):
        bundles_on.setdefault(nid, []).append(i)
    asked = {nid: len(idx) + (nid == node_ids[0]) for nid, idx in bundles_on.items()}
    answers: list[list[int]] = ray.get([ports_on_node.options(scheduling_strategy=in_bundle(idx[0])).remote(asked[nid])
                                        for nid, idx in bundles_on.items()])
    port_of: dict[int, int] = {}
    master_port = 0
    for (nid, idx), got in zip(bundles_on.items(), answers, strict=True):
        if nid == node_ids[0]:
            master_port = got.pop()
        port_of.update(zip(idx, got, strict=True))
    registered = {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes()}  # type: ignore[no-untyped-call]
    node_rank: dict[str, int] = {}
    placements = []
    for i, ((role, r), node_id) in enumerate(zip(layout_, node_ids, strict=True)):
        node_rank.setdefault(node_id, len(node_rank))
        placements.append(planner.Placement(role, r, registered[node_id], node_rank[node_id], port_of[i]))
    plan = planner.plan_job(job["job_id"], spec, placements, master_port=master_port)
    node_of = dict(zip(layout_, node_ids, strict=True))
    for p in plan.processes:
        nid = node_of[(p.role, p.replica_index)]
        outputs.note({"role": p.role, "index": p.slot_index, "node_id": nid, "host": registered[nid]})

    # max_retries=0: a replica whose Ray worker or node dies is not run again behind the job's
    # back (Ray retries a task 3 times by default: the replica then ran twice, the rest of the
    # world waiting on the first); the job fails naming it (``except`` below).
    @ray.remote(max_retries=0)
    def replica(procs: list[planner.ProcessLaunch]) -> tuple[int, str, int, list[End]]:
        # By module name: run as __main__, this module would be pickled by value.
        from drivers.common import procfs as task_procfs
        from drivers.ray import launcher

        task_procfs.become_subreaper()  # (this worker runs this job's tasks alone)
        return launcher.run_replica(sid, procs)

    refs = {}
    for i, (role, r) in enumerate(layout_):
        procs = [p for p in plan.processes if (p.role, p.replica_index) == (role, r)]
        b = bundle(role)
        refs[replica.options(scheduling_strategy=in_bundle(i), num_cpus=b["CPU"], num_gpus=b.get("GPU", 0),
                             memory=b.get("memory")).remote(procs)] = procs
    decisive = plan.success.decisive_roles
    note = _exit_noter(outputs)
    code = 0
    while refs:
        done, _ = ray.wait(list(refs), num_returns=1)
        procs = refs.pop(done[0])
        try:
            rc, failed_role, failed_index, ends = ray.get(done[0])
        except Exception as e:  # the task itself failed (node lost, worker killed): no other end is known
            print(f"dlsched: replica task of {procs[0].role}-{procs[0].replica_index} failed: {e}", flush=True)
            rc, failed_role, failed_index, ends = 1, procs[0].role, procs[0].slot_index, [(procs[0], 1, False)]
        for end in ends:
            note(*end)
        if rc != 0:
            print(f"dlsched: {failed_role}-{failed_index} exited with code {rc}", flush=True)
            code = rc
            break
        if not any(p.role in decisive for ps in refs.values() for p in ps):
            break
    # The rest stop as a local job's do, after the success rule: a cancel stops each replica's
    # task (``run_replica``), whose ``run_processes`` gives its processes SIGTERM and
    # STOP_GRACE_SECONDS before SIGKILL and returns their ends; the placement group goes once
    # they have (its removal kills the tasks' workers, and their processes with them by
    # PR_SET_PDEATHSIG: SIGKILL, no SIGTERM first). A cancel reaches a task through Ray's
    # workers, late on a busy node: it gets CANCEL_WAIT_SECONDS.
    for ref in refs:
        with contextlib.suppress(Exception):
            ray.cancel(ref)
    stopped: list[Any] = []
    with contextlib.suppress(Exception):
        stopped, _ = ray.wait(list(refs), num_returns=len(refs), timeout=CANCEL_WAIT_SECONDS)
    for ref in stopped:  # their processes' ends (a task cancelled before it ran has none)
        with contextlib.suppress(Exception):
            for end in ray.get(ref)[3]:
                note(*end)
    with contextlib.suppress(Exception):
        ray.util.remove_placement_group(pg)
    return code


def main() -> int:
    # The launcher dies with what started it (Ray's job supervisor): a stop that reached only its
    # parent must not leave it running the job, untracked.
    parent = os.getppid()
    _parent_death_signal(signal.SIGTERM)
    if os.getppid() != parent:  # (it died before the prctl)
        return 143
    job = render.job_from_env(os.environ)
    spec = render.spec_from_json(job["spec"])
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    if job["mode"] == "local":
        procfs.become_subreaper()
        return run_local(job, spec, stop)
    # A Ray stop's SIGTERM ends this process at once: Ray then ends the job's workers, whose
    # SIGTERM ends each replica task's ``run_processes`` (SystemExit: its processes get SIGTERM
    # and the grace) unless Ray's SIGKILL of the worker (kill_worker_timeout, 100 ms) comes
    # first: best effort. Cancelling the tasks from here was no better (Ray's SIGKILL of this
    # process, after RAY_JOB_STOP_WAIT_TIME_S, came first under load).
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    return run_placement_group(job, spec)


if __name__ == "__main__":
    sys.exit(main())
