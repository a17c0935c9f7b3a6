"""What the local driver reads from the host beside the process table (the kit's
``drivers.common.procfs``): a process's peak memory, /proc/meminfo, nvidia-smi.

Adapters only; no dlsched state here.
"""

from __future__ import annotations

import asyncio
import shutil


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
