"""What the local driver reads from the host: /proc, /proc/meminfo, nvidia-smi.

Adapters only; no dlsched state here.
"""

from __future__ import annotations

import asyncio
import ctypes
import os
import shutil
from dataclasses import dataclass

from dlsched.kit.parse import decimal

CLK_TCK = os.sysconf("SC_CLK_TCK")
PAGE_SIZE = os.sysconf("SC_PAGE_SIZE")


@dataclass(frozen=True)
class ProcStat:
    pid: int
    ppid: int
    state: str  # "R", "S", ... "Z" a zombie
    pgrp: int
    session: int
    cpu_seconds: float  # utime + stime + cutime + cstime
    rss_bytes: int
    start_ticks: int


def parse_stat(pid: int, text: str) -> ProcStat:
    # comm (field 2) is in parentheses and may hold spaces or ")".
    rest = text[text.rindex(")") + 2:].split()
    # rest[0] is field 3 (state); field n is rest[n - 3].
    ticks = sum(int(rest[i - 3]) for i in (14, 15, 16, 17))
    return ProcStat(pid=pid, ppid=int(rest[4 - 3]), state=rest[0], pgrp=int(rest[5 - 3]), session=int(rest[6 - 3]),
                    cpu_seconds=ticks / CLK_TCK, rss_bytes=int(rest[24 - 3]) * PAGE_SIZE,
                    start_ticks=int(rest[22 - 3]))


def read_stat(pid: int) -> ProcStat | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return parse_stat(pid, f.read())
    except (OSError, ValueError, IndexError):
        return None


def all_stats() -> list[ProcStat]:
    out = []
    for name in os.listdir("/proc"):
        if decimal(name) and (st := read_stat(int(name))) is not None:
            out.append(st)
    return out


def session_members(*sessions: int, outside_groups: bool = False) -> list[int]:
    """Pids of every live process in any of ``sessions`` (one pass over /proc):
    also those a program moved to process groups of their own (mpirun puts
    each rank in its own group). ``outside_groups``: only those, not the members
    of the group each session's leader leads (its pgid is the session id)."""
    wanted = set(sessions)
    return [st.pid for st in all_stats() if st.session in wanted
            and not (outside_groups and st.pgrp in wanted)]


def become_subreaper() -> bool:
    """PR_SET_CHILD_SUBREAPER: orphaned descendants come to this process, not init."""
    try:
        return bool(ctypes.CDLL("libc.so.6", use_errno=True).prctl(36, 1, 0, 0, 0) == 0)
    except (OSError, AttributeError):
        return False


def adopted(parent: int, own: set[int]) -> tuple[list[ProcStat], list[int]]:
    """The children of ``parent`` (a child subreaper) other than the ``own`` it started:
    (live ones, zombies' pids), one pass over /proc. Descendants whose parents ended
    come to the nearest subreaper, a program that escaped its session (setsid) too."""
    live: list[ProcStat] = []
    dead: list[int] = []
    for st in all_stats():
        if st.ppid == parent and st.pid not in own:
            if st.state in ("Z", "X"):
                dead.append(st.pid)
            else:
                live.append(st)
    return live, dead


def vm_hwm_bytes(pid: int) -> int:
    """Peak resident memory of a live process (VmHWM), 0 when unknown."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


def meminfo() -> tuple[int, int]:
    """(MemTotal, MemAvailable) in bytes."""
    total = avail = 0
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                key, _, val = line.partition(":")
                if key == "MemTotal":
                    total = int(val.split()[0]) * 1024
                elif key == "MemAvailable":
                    avail = int(val.split()[0]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return total, avail


def gpu_type_of(name: str) -> str:
    """``"NVIDIA A100-SXM4-80GB"`` -> ``"a100"``, ``"NVIDIA H200"`` -> ``"h200"``,
    ``"NVIDIA GeForce RTX 4090"`` -> ``"rtx-4090"``."""
    words = [w for w in name.lower().split() if w not in ("nvidia", "tesla", "geforce")]
    if not words:
        return ""
    if words[0] in ("rtx", "gtx", "quadro") and len(words) > 1:
        return f"{words[0]}-{words[1].split('-')[0]}"
    return words[0].split("-")[0]


async def nvidia_gpus(limit_s: float = 5.0) -> list[tuple[str, int]]:
    """[(gpu_type, memory_bytes)] from nvidia-smi; [] when absent or failing."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return []
    try:
        proc = await asyncio.create_subprocess_exec(
            exe, "--query-gpu=name,memory.total", "--format=csv,noheader,nounits",
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL)
    except OSError:
        return []
    try:
        out, _ = await asyncio.wait_for(proc.communicate(), limit_s)
    except TimeoutError:
        proc.kill()
        await proc.wait()
        return []
    except BaseException:  # cancelled (the driver closing): not left running
        proc.kill()
        raise
    if proc.returncode != 0:
        return []
    return parse_nvidia_smi(out.decode(errors="replace"))


def parse_nvidia_smi(text: str) -> list[tuple[str, int]]:
    """``name, memory.total`` CSV lines (no header, no units) -> [(gpu_type, bytes)]."""
    gpus = []
    for line in text.splitlines():
        name, _, mem = line.rpartition(",")
        if not name.strip():
            continue
        try:
            mib = int(float(mem.strip()))
        except ValueError:
            mib = 0
        gpus.append((gpu_type_of(name.strip()), mib * 1024 * 1024))
    return gpus
