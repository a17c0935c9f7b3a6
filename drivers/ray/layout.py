"""The files the launcher writes on a Ray node and the driver reads through Ray's log API.

Paths are relative to the node's Ray log directory (``<temp-dir>/session_*/logs``),
the root Ray's state API serves files from (``/api/v0/logs/file`` and
``/api/v0/logs/stream`` with ``node_id`` and ``filename``). Per submission
``dlsched/<submission-id>/``:

- ``replicas.jsonl``: the manifest, on the entrypoint's node (Ray's
  ``driver_node_id``). One JSON object a line: ``{"role", "index", "node_id",
  "host"}`` when a process's files exist (``node_id`` empty: the entrypoint's
  node), then ``{"role", "index", "exit"}`` when it exited (``"stopped":
  true`` when the launcher stopped it: the job had ended or was stopped).
- ``<role>-<index>.out`` / ``.err``: the process's stdout / stderr, one line
  ``<unix-nanos> <text>`` per line it wrote (nanos strictly increasing per
  file), closed by the line ``eof`` once its pipe closed.
- ``<role>-<index>.usage``: one JSON sample a line (``t`` seconds, ``cpu``
  seconds, ``rss`` / ``peak`` / ``gpu_mem`` bytes, ``gpu`` percent,
  ``running``); the last line is the newest sample.

Pure functions and constants only (the launcher imports this inside the cluster).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from dlsched.kit.parse import decimal
from dlsched.spec_rules import MAX_PROCESSES

ROOT = "dlsched"
EOF = "eof"
STREAMS = ("out", "err")


def job_dir(sid: str) -> str:
    return f"{ROOT}/{sid}"


def manifest(sid: str) -> str:
    return f"{job_dir(sid)}/replicas.jsonl"


def output(sid: str, role: str, index: int, kind: str) -> str:
    """``kind``: ``out``, ``err`` or ``usage``."""
    return f"{job_dir(sid)}/{role}-{index}.{kind}"


def format_line(ns: int, text: str) -> str:
    return f"{ns} {text}\n"


def parse_line(line: str) -> tuple[int, str] | None:
    """``(nanos, text)`` of an output line; ``None`` for the ``eof`` marker or a torn line."""
    head, sep, text = line.partition(" ")
    if not sep or not decimal(head):
        return None
    return int(head), text


@dataclass(frozen=True)
class Placed:
    """A manifest entry: where one process's files are."""

    role: str
    index: int
    node_id: str  # empty: the entrypoint's node
    host: str = ""


@dataclass
class Manifest:
    """The parsed manifest: processes in the order they were placed, exits so far."""

    placed: list[Placed]
    exits: dict[tuple[str, int], tuple[int, bool]]  # (exit code, stopped by the launcher)


def parse_manifest(text: str) -> Manifest:
    out = Manifest([], {})
    seen: set[tuple[str, int]] = set()
    for line in text.splitlines():
        if len(out.placed) >= MAX_PROCESSES and len(out.exits) >= MAX_PROCESSES:
            break
        try:  # a torn last line, or anything a job wrote over the file: skipped
            doc: Any = json.loads(line)
            key = (str(doc["role"]), int(doc["index"]))
            code = int(doc["exit"]) if "exit" in doc else None
        except Exception:  # noqa: BLE001 - RecursionError, OverflowError and the like too
            continue
        if code is not None:
            if len(out.exits) < MAX_PROCESSES or key in out.exits:
                out.exits[key] = (code, bool(doc.get("stopped")))
        elif key not in seen and len(out.placed) < MAX_PROCESSES:
            seen.add(key)
            out.placed.append(Placed(key[0], key[1], str(doc.get("node_id") or ""), str(doc.get("host") or "")))
    return out


def manifest_line(doc: Mapping[str, Any]) -> str:
    return json.dumps(doc, sort_keys=True, separators=(",", ":")) + "\n"
