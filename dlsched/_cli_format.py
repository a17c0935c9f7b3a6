"""Output of the ``dlsched`` CLI: tables for people, JSON and YAML for programs.

JSON and YAML are the proto JSON form (camelCase keys, enum names), the same
shape a job file uses, so ``dlsched get JOB -o yaml`` output can be edited and
submitted again (its ``spec``).
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import sys
from collections.abc import Iterable, Sequence
from datetime import UTC, datetime
from typing import Any, TextIO

import yaml
from google.protobuf import json_format
from google.protobuf.message import Message

from dlsched.kit import timeutil
from dlsched.v1 import access_pb2, cluster_pb2, job_pb2

FORMATS = ("table", "json", "yaml")

# The CLI prints every error itself: keep gRPC's core from logging, e.g., each TLS
# handshake failure on stderr. Read once, when grpc loads, which is after this module
# (imported by dlsched.cli before dlsched.client); a value the user set wins.
os.environ.setdefault("GRPC_VERBOSITY", "ERROR")


def to_dict(msg: Message) -> dict[str, Any]:
    return json_format.MessageToDict(msg)


def dump(obj: Any, fmt: str, out: TextIO | None = None) -> None:
    """Prints a dict (or list) as JSON or YAML."""
    out = out or sys.stdout
    if fmt == "yaml":
        out.write(yaml.safe_dump(obj, sort_keys=False, default_flow_style=False))
    else:
        out.write(json.dumps(obj, indent=2) + "\n")
    out.flush()


def json_line(obj: Any, out: TextIO | None = None) -> None:
    out = out or sys.stdout
    out.write(json.dumps(obj, separators=(",", ":")) + "\n")
    out.flush()


def enum_short(enum: Any, value: int) -> str:
    """``JOB_STATE_RUNNING`` -> ``RUNNING`` (the value's name without its prefix)."""
    try:
        name: str = enum.Name(value)
    except ValueError:
        return str(value)
    first: str = enum.DESCRIPTOR.values[0].name
    prefix = first[: -len("UNSPECIFIED")] if first.endswith("UNSPECIFIED") else ""
    return name[len(prefix):] if name.startswith(prefix) else name


def job_state(state: int) -> str:
    return enum_short(job_pb2.JobState, state)


def table(rows: Sequence[Sequence[str]], headers: Sequence[str], out: TextIO | None = None) -> None:
    out = out or sys.stdout
    widths = [len(h) for h in headers]
    for r in rows:
        for i, cell in enumerate(r):
            widths[i] = max(widths[i], len(cell))
    for r in [headers, *rows]:
        line = "  ".join(c.ljust(widths[i]) for i, c in enumerate(r)).rstrip()
        out.write(line + "\n")
    out.flush()


def _ts(ts: Any) -> datetime | None:
    return timeutil.from_timestamp(ts)


def age(ts: Any, now: datetime | None = None) -> str:
    dt = _ts(ts)
    if dt is None:
        return "-"
    secs = max(0, int(((now or datetime.now(UTC)) - dt).total_seconds()))
    if secs < 120:
        return f"{secs}s"
    if secs < 7200:
        return f"{secs // 60}m"
    if secs < 172800:
        return f"{secs // 3600}h"
    return f"{secs // 86400}d"


def when(ts: Any) -> str:
    dt = _ts(ts)
    if dt is None:
        return "-"
    return f"{dt.astimezone().isoformat(timespec='seconds')} ({age(ts)} ago)"


def size(n: int) -> str:
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{value:.0f}{unit}" if unit == "B" else f"{value:.1f}{unit}"
        value /= 1024
    return f"{n}B"


def num(x: float) -> str:
    return f"{x:g}"


def total_slots(spec: job_pb2.JobSpec) -> int:
    """Processes of a job: replicas x processes per replica, all groups."""
    return sum(max(1, g.replicas) * max(1, g.processes_per_replica) for g in spec.replica_groups)



# --------------------------------------------------------------------------- jobs

JOB_HEADERS = ("NAME", "PROJECT", "OWNER", "STATE", "MODE", "REPLICAS", "CLUSTER", "AGE", "REASON")


def job_row(job: job_pb2.Job) -> list[str]:
    running = sum(1 for r in job.replicas if r.state == job_pb2.REPLICA_STATE_RUNNING)
    return [
        job.name,
        job.project or "-",
        job.owner or "-",
        job_state(job.state),
        enum_short(job_pb2.RunMode, job.spec.run_mode),
        f"{running}/{total_slots(job.spec)}",
        job.cluster.removeprefix("clusters/") or "-",
        age(job.create_time),
        job.reason or "",
    ]


def jobs_table(jobs: Iterable[job_pb2.Job]) -> None:
    table([job_row(j) for j in jobs], JOB_HEADERS)


def job_detail(job: job_pb2.Job, out: TextIO | None = None) -> None:
    out = out or sys.stdout
    state = job_state(job.state)
    if job.reason:
        state += f" ({job.reason})"
    fields = [
        ("Name", job.name),
        ("UID", job.uid),
        ("Project", job.project),
        ("Owner", job.owner),
        ("State", state),
        ("Message", job.message),
        ("Exit code", str(job.exit_code) if job.HasField("exit_code") else ""),
        ("Run mode", enum_short(job_pb2.RunMode, job.spec.run_mode)),
        ("Cluster", job.cluster),
        ("Backend id", job.backend_job_id),
        ("Attempt", str(job.attempt) if job.attempt else ""),
        ("Created", when(job.create_time)),
        ("Started", when(job.start_time) if _ts(job.start_time) else ""),
        ("Ended", when(job.end_time) if _ts(job.end_time) else ""),
        ("Labels", ", ".join(f"{k}={v}" for k, v in sorted(job.labels.items()))),
    ]
    for k, v in fields:
        if v:
            out.write(f"{k + ':':<12}{v}\n")
    out.write("Replica groups:\n")
    for g in job.spec.replica_groups:
        res = g.resources
        parts = []
        if res.cpu:
            parts.append(f"cpu={num(res.cpu)}")
        if res.memory_bytes:
            parts.append(f"memory={size(res.memory_bytes)}")
        if res.gpus:
            parts.append(f"gpus={res.gpus}{':' + res.gpu_type if res.gpu_type else ''}")
        argv = " ".join([*g.command, *g.args])
        out.write(f"  {g.role or '-'} x{max(1, g.replicas)}"
                  f"{f' ({g.processes_per_replica} processes each)' if g.processes_per_replica > 1 else ''}"
                  f": {argv}{'  [' + ' '.join(parts) + ']' if parts else ''}\n")
    if job.replicas:
        out.write("Replicas:\n")
        rows = [[f"{r.role}/{r.index}", enum_short(job_pb2.ReplicaState, r.state),
                 str(r.exit_code) if r.HasField("exit_code") else "-", r.host or "-", r.message]
                for r in job.replicas]
        buf = io.StringIO()
        table(rows, ("REPLICA", "STATE", "EXIT", "HOST", "MESSAGE"), buf)
        for line in buf.getvalue().splitlines():
            out.write(f"  {line}\n")
    out.flush()


def usage_table(usage: job_pb2.JobUsage) -> None:
    rows = [[f"{r.role}/{r.replica_index}", f"{r.cpu_seconds:.2f}", size(r.memory_bytes),
             size(r.peak_memory_bytes),
             f"{r.gpu_utilization_percent:.0f}%" if r.gpu_utilization_percent else "-",
             size(r.gpu_memory_bytes) if r.gpu_memory_bytes else "-",
             "yes" if r.running else "no"] for r in usage.replicas]
    table(rows, ("REPLICA", "CPU_SECONDS", "MEMORY", "PEAK_MEMORY", "GPU_UTIL", "GPU_MEMORY",
                 "RUNNING"))


# --------------------------------------------------------------------------- clusters

CLUSTER_HEADERS = ("NAME", "TYPE", "STATE", "DRIVER", "ADDRESS", "CPUS", "MEMORY", "GPUS", "AGE")


def cluster_row(c: cluster_pb2.Cluster) -> list[str]:
    cap = c.capacity
    return [
        c.name,
        enum_short(job_pb2.ClusterType, c.type),
        enum_short(cluster_pb2.ClusterState, c.state),
        c.driver_address or "-",
        c.address or "-",
        f"{num(cap.cpus_free)}/{num(cap.cpus_total)}" if cap.cpus_total else "-",
        f"{size(cap.memory_bytes_free)}/{size(cap.memory_bytes_total)}"
        if cap.memory_bytes_total else "-",
        f"{cap.gpus_free}/{cap.gpus_total}" if cap.gpus_total else "0",
        age(c.create_time),
    ]


def clusters_table(clusters: Iterable[cluster_pb2.Cluster]) -> None:
    table([cluster_row(c) for c in clusters], CLUSTER_HEADERS)


def cluster_detail(c: cluster_pb2.Cluster, out: TextIO | None = None) -> None:
    out = out or sys.stdout
    cap = c.capacity
    fields = [
        ("Name", c.name),
        ("UID", c.uid),
        ("Type", enum_short(job_pb2.ClusterType, c.type)),
        ("State", enum_short(cluster_pb2.ClusterState, c.state)),
        ("Message", c.state_message),
        ("Address", c.address),
        ("Driver", c.driver_address),
        ("Tracked by", c.tracking_replica),
        ("Credentials", "stored" if c.has_credentials else "none"),
        ("Labels", ", ".join(f"{k}={v}" for k, v in sorted(c.labels.items()))),
        ("Options", ", ".join(f"{k}={v}" for k, v in sorted(c.options.items()))),
        ("Run modes", ", ".join(enum_short(job_pb2.RunMode, m) for m in c.supported_run_modes)),
        ("Nodes", f"{cap.nodes_free}/{cap.nodes_total} free" if cap.nodes_total else ""),
        ("CPUs", f"{num(cap.cpus_free)}/{num(cap.cpus_total)} free" if cap.cpus_total else ""),
        ("Memory", f"{size(cap.memory_bytes_free)}/{size(cap.memory_bytes_total)} free"
         if cap.memory_bytes_total else ""),
        ("GPUs", f"{cap.gpus_free}/{cap.gpus_total} free" if cap.gpus_total else ""),
        ("Created", when(c.create_time)),
        ("Heartbeat", when(c.last_heartbeat_time) if _ts(c.last_heartbeat_time) else ""),
    ]
    for k, v in fields:
        if v:
            out.write(f"{k + ':':<13}{v}\n")
    for g in cap.gpus:
        out.write(f"  gpu {g.gpu_type or '?'}: {g.free}/{g.total} free\n")
    out.flush()


def candidates_table(cands: Iterable[cluster_pb2.ClusterCandidate]) -> None:
    rows = [[c.cluster, enum_short(job_pb2.ClusterType, c.cluster_type),
             "yes" if c.eligible else "no", f"{c.score:g}" if c.eligible else "-",
             "; ".join(c.reasons)] for c in cands]
    table(rows, ("CLUSTER", "TYPE", "ELIGIBLE", "SCORE", "REASONS"))


# --------------------------------------------------------------------------- access


def role(value: int) -> str:
    return enum_short(access_pb2.Role, value)


def caller_dict(principal: str, admin: bool, roles: Iterable[access_pb2.ProjectRole]) -> dict[str, Any]:
    """GetCaller's answer in the proto JSON form, ``admin`` always present."""
    return {"principal": principal, "admin": admin,
            "roles": [{"project": r.project, "role": access_pb2.Role.Name(r.role)} for r in roles]}


def caller_detail(principal: str, admin: bool, roles: Sequence[access_pb2.ProjectRole],
                  out: TextIO | None = None) -> None:
    out = out or sys.stdout
    out.write(f"{'Principal:':<11}{principal}\n")
    out.write(f"{'Admin:':<11}{'yes' if admin else 'no'}\n")
    out.write(f"{'Roles:':<11}"
              f"{', '.join(f'{r.project}={role(r.role)}' for r in roles) or 'none'}\n")
    out.flush()


def role_bindings_table(bindings: Iterable[access_pb2.RoleBinding]) -> None:
    table([[b.name, b.principal, b.project, role(b.role), b.creator or "-", age(b.create_time)]
           for b in bindings], ("NAME", "PRINCIPAL", "PROJECT", "ROLE", "CREATOR", "AGE"))


def _expires(ts: Any) -> str:
    dt = _ts(ts)
    return "never" if dt is None else dt.astimezone().isoformat(timespec="seconds")


def api_tokens_table(tokens: Iterable[access_pb2.ApiToken]) -> None:
    table([[t.name, t.service_account, _expires(t.expire_time), t.creator or "-",
            age(t.create_time), t.description] for t in tokens],
          ("NAME", "SERVICE_ACCOUNT", "EXPIRES", "CREATOR", "AGE", "DESCRIPTION"))


def contexts_table(current: str | None, contexts: dict[str, dict[str, Any]]) -> None:
    rows = []
    for name, c in sorted(contexts.items()):
        auth = (f"token-file {c['token-file']}" if c.get("token-file")
                else "token-command" if c.get("token-command") else "-")
        rows.append(["*" if name == current else "", name, str(c.get("server") or "-"),
                     str(c.get("cluster-manager") or "-"),
                     "insecure" if c.get("insecure") else str(c.get("ca-file") or "system CAs"),
                     auth])
    table(rows, ("CURRENT", "NAME", "SERVER", "CLUSTER_MANAGER", "TLS", "AUTH"))


# --------------------------------------------------------------------------- terminals

#: what a terminal would act on (C0 controls but newline and tab, DEL, C1): written as \xNN
_CONTROLS = {c: f"\\x{c:02x}" for c in (*range(0x00, 0x20), 0x7F, *range(0x80, 0xA0)) if c not in (0x0A, 0x09)}


class SafeTerminal(io.TextIOBase):
    """A terminal stream that shows control characters instead of acting on them: a job's log
    line, message or label with ESC sequences (a retitled window, a rewritten screen, a forged
    prompt) or a carriage return comes out as ``\\x1b`` and ``\\x0d``. Pipes and files get
    the bytes as they are."""

    def __init__(self, inner: TextIO) -> None:
        self._inner = inner

    def write(self, text: str) -> int:
        self._inner.write(text.translate(_CONTROLS))
        return len(text)

    def flush(self) -> None:
        self._inner.flush()

    def isatty(self) -> bool:
        return True

    def fileno(self) -> int:
        return self._inner.fileno()

    @property
    def encoding(self) -> str:  # type: ignore[override]
        return self._inner.encoding


def guard_terminal() -> None:
    """Standard output and error: text a locale cannot encode is escaped, not an error; on a
    terminal, control characters are shown (``SafeTerminal``)."""
    for name in ("stdout", "stderr"):
        stream = getattr(sys, name)
        reconfigure = getattr(stream, "reconfigure", None)
        if reconfigure is not None:
            with contextlib.suppress(ValueError, OSError):
                reconfigure(errors="backslashreplace")
        isatty = getattr(stream, "isatty", None)
        if not isinstance(stream, SafeTerminal) and isatty is not None and isatty():
            setattr(sys, name, SafeTerminal(stream))

