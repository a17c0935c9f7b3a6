"""Usage of the launcher's processes, measured by the launcher itself (Linux ``/proc``, NVML when there).

Ray measures no process a job starts (see ``drivers.ray.driver``), but the
launcher that starts every replica runs inside the cluster: each replica
process leads a session of its own (``start_new_session``), and one scan of
``/proc/*/stat`` a tick sums every session's members:

- CPU seconds: ``utime + stime + cutime + cstime`` of the live members (a
  reaped child's time is in its parent's ``c*time``), never going down;
- memory: the members' RSS now, and the highest sum seen (``peak``);
- GPU, where ``libnvidia-ml.so.1`` loads: the GPU memory NVML lists for the
  members' pids, and the utilisation of the devices they use (mean).

Stdlib only (``ctypes`` for NVML): it runs in the cluster's interpreter.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import time
from dataclasses import dataclass

from dlsched.kit.parse import decimal

TICK = float(os.sysconf("SC_CLK_TCK")) if hasattr(os, "sysconf") else 100.0
PAGE = int(os.sysconf("SC_PAGE_SIZE")) if hasattr(os, "sysconf") else 4096


@dataclass
class Sample:
    cpu: float = 0.0
    rss: int = 0
    peak: int = 0
    gpu: float = 0.0
    gpu_mem: int = 0
    running: bool = True

    def doc(self, t: float) -> dict[str, object]:
        return {"t": round(t, 3), "cpu": round(self.cpu, 3), "rss": self.rss, "peak": self.peak,
                "gpu": round(self.gpu, 1), "gpu_mem": self.gpu_mem, "running": self.running}


def _stat(pid: str) -> tuple[int, float, int] | None:
    """(session, CPU seconds incl. reaped children, RSS bytes) of one process."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read()
    except OSError:
        return None
    fields = raw[raw.rfind(b")") + 2:].split()
    try:
        # after "pid (comm) ": state ppid pgrp session ... utime(11) stime cutime cstime ... rss(21)
        ticks = int(fields[11]) + int(fields[12]) + int(fields[13]) + int(fields[14])
        return int(fields[3]), ticks / TICK, int(fields[21]) * PAGE
    except (IndexError, ValueError):
        return None


class _ProcInfo(ctypes.Structure):
    _fields_ = [("pid", ctypes.c_uint), ("used", ctypes.c_ulonglong),
                ("gi", ctypes.c_uint), ("ci", ctypes.c_uint)]


class _Util(ctypes.Structure):
    _fields_ = [("gpu", ctypes.c_uint), ("memory", ctypes.c_uint)]


class Nvml:
    """The few NVML calls needed, through ctypes; ``ok`` False when there is no NVML."""

    def __init__(self) -> None:
        self.ok = False
        self.handles: list[ctypes.c_void_p] = []
        try:
            self.lib = ctypes.CDLL("libnvidia-ml.so.1")
            if self.lib.nvmlInit_v2() != 0:
                return
            n = ctypes.c_uint(0)
            if self.lib.nvmlDeviceGetCount_v2(ctypes.byref(n)) != 0:
                return
            for i in range(n.value):
                h = ctypes.c_void_p()
                if self.lib.nvmlDeviceGetHandleByIndex_v2(i, ctypes.byref(h)) == 0:
                    self.handles.append(h)
            self.procs_fn = None
            for name in ("nvmlDeviceGetComputeRunningProcesses_v3", "nvmlDeviceGetComputeRunningProcesses_v2"):
                with contextlib.suppress(AttributeError):
                    self.procs_fn = getattr(self.lib, name)
                    break
            self.ok = self.procs_fn is not None and bool(self.handles)
        except OSError:
            return

    def processes(self, h: ctypes.c_void_p) -> list[tuple[int, int]]:
        """(pid, GPU memory bytes) of the compute processes on one device."""
        count = ctypes.c_uint(64)
        buf = (_ProcInfo * 64)()
        if self.procs_fn is None or self.procs_fn(h, ctypes.byref(count), buf) != 0:
            return []
        return [(buf[i].pid, int(buf[i].used)) for i in range(min(count.value, 64))]

    def utilization(self, h: ctypes.c_void_p) -> float:
        u = _Util()
        return float(u.gpu) if self.lib.nvmlDeviceGetUtilizationRates(h, ctypes.byref(u)) == 0 else 0.0

    def sample(self, members: dict[int, set[int]]) -> dict[int, tuple[float, int]]:
        """Per session: (mean utilisation of the devices it uses, its GPU memory)."""
        out: dict[int, tuple[float, int]] = {}
        if not self.ok:
            return out
        owner = {pid: s for s, pids in members.items() for pid in pids}
        utils: dict[int, list[float]] = {}
        mem: dict[int, int] = {}
        for h in self.handles:
            used = [(owner[pid], b) for pid, b in self.processes(h) if pid in owner]
            if not used:
                continue
            util = self.utilization(h)
            for s in {s for s, _ in used}:
                utils.setdefault(s, []).append(util)
            for s, b in used:
                mem[s] = mem.get(s, 0) + b
        for s, us in utils.items():
            out[s] = (sum(us) / len(us), mem.get(s, 0))
        return out


class Sampler:
    """Samples the sessions led by ``leaders`` (the replica processes' pids)."""

    def __init__(self, leaders: list[int], nvml: Nvml | None = None) -> None:
        self.samples = {pid: Sample() for pid in leaders}
        self.nvml = nvml if nvml is not None else Nvml()

    def add(self, leader: int) -> None:
        self.samples.setdefault(leader, Sample())

    def sample(self) -> dict[int, Sample]:
        cpu: dict[int, float] = {}
        rss: dict[int, int] = {}
        members: dict[int, set[int]] = {}
        for name in os.listdir("/proc"):
            if not decimal(name):
                continue
            st = _stat(name)
            if st is None or st[0] not in self.samples:
                continue
            s, c, r = st
            cpu[s] = cpu.get(s, 0.0) + c
            rss[s] = rss.get(s, 0) + r
            members.setdefault(s, set()).add(int(name))
        gpus = self.nvml.sample(members) if self.nvml.ok else {}
        for leader, smp in self.samples.items():
            if leader not in members:
                smp.running, smp.rss, smp.gpu, smp.gpu_mem = False, 0, 0.0, 0
                continue
            smp.running = True
            smp.cpu = max(smp.cpu, cpu[leader])
            smp.rss = rss[leader]
            smp.peak = max(smp.peak, smp.rss)
            smp.gpu, smp.gpu_mem = gpus.get(leader, (0.0, 0))
        return self.samples

    def end(self, leader: int) -> Sample:
        """The last sample of an exited session."""
        smp = self.samples[leader]
        smp.running, smp.rss, smp.gpu, smp.gpu_mem = False, 0, 0.0, 0
        return smp


def now() -> float:
    return time.time()
