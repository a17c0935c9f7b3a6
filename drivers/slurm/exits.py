"""Each process's end, as the batch script recorded it: per-replica truth on Slurm.

Slurm knows one state and one exit code per job (the batch script's, which
is the deciding process's). The script knows more: it hears of every
process's end and appends it to the attempt's ``exits`` file
(``shell.EXITS``, ``shell.SUCCESS_RULE``'s ``dlsched_record``)::

    labels master-0 worker-0 worker-1
    end worker-1 3 exit
    end master-0 143 stop
    end worker-0 143 stop

An MPI job's file has a second line, ``hosts worker-0 worker-1``: the
replicas that only host the launcher's ranks (no process of their own), so
a driver that adopts the job without its record still reports them.

``exit``: the process ended before the job was decided; ``stop``: after it, so the success rule
(or the step's end) stopped it; ``halt``: after dlsched's stop reached it (never a success). When a job ends, the
driver reads this file once (``read``, one ``cat`` over SSH, no Slurm call)
before it reports the end, and ``replicas`` makes of it what every backend
reports (docs/ENVIRONMENT.md, as drivers/local and drivers/ray):

- the process whose non-zero ``exit`` decided a FAILED job is FAILED with
  its code, and the job's message names it (``worker-1 exited with code 3``)
  and takes its exit code: the first failure is the one named;
- any other process that exited 0 before the decision SUCCEEDED (dlsched's
  stop writes its mark before it signals anything: an end it caused is
  recorded ``halt``);
- every other one is STOPPED (stopped by the success rule, by a
  TerminateJob, by the time limit, or never heard of because Slurm killed
  the script), with its exit code where the script saw it.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Sequence
from dataclasses import dataclass

from dlsched.kit.parse import decimal
from dlsched.spec_rules import MAX_PROCESSES
from drivers.common.base import JobState, ReplicaState, ReplicaStatus
from drivers.slurm import shell

#: The exit file is read at most this many times (one per poll round) before the job's end is
#: reported without it (each replica then takes the job's state, as before the file existed).
MAX_READS = 3


@dataclass(frozen=True)
class End:
    """One process's end, as the script heard of it."""

    label: str
    status: int
    stopped: bool  #: it ended after the job was decided
    halted: bool = False  #: ... by dlsched's stop (its mark was there): no success, whatever its status


@dataclass(frozen=True)
class Exits:
    """The parsed ``exits`` file."""

    labels: tuple[str, ...]  #: every process the script started, in plan order
    ends: tuple[End, ...]  #: in the order the script heard of them
    hosts: tuple[str, ...] = ()  #: the replicas that only host ranks (MPI's workers)

    def first_failure(self) -> End | None:
        """The non-zero end that decided the job (the first heard of before any decision)."""
        return next((e for e in self.ends if not e.stopped and e.status != 0), None)

    def succeeded(self) -> bool:
        """Every process the script started ended and none failed before the job was decided:
        the script decided success, whatever Slurm later made of the job's end."""
        heard = {e.label for e in self.ends}
        return (bool(self.labels) and all(lb in heard for lb in self.labels) and self.first_failure() is None
                and not any(e.halted for e in self.ends))


#: The most of the file read: its lines for the most processes a job may have (the job can write
#: to its own directory, so the file's size is the job's to choose; the read is bounded).
MAX_BYTES = 16 << 20
#: A label as the script writes it: ``<role>-<index>``.
_LABEL_RE = re.compile(r"[a-z][a-z0-9-]{0,62}-[0-9]{1,7}")
_STATUS_RE = re.compile(r"[0-9]{1,3}")  # an exit status (ASCII digits: str.isdigit takes others)


def read_command(adir: str) -> str:
    """The remote command that prints the attempt's exits file (nothing when it is missing),
    at most ``MAX_BYTES`` of it."""
    return f"head -c {MAX_BYTES} -- {shlex.quote(f'{adir}/{shell.EXITS}')} 2>/dev/null || true"


def _labels(words: Sequence[str]) -> tuple[str, ...]:
    """The well-formed labels of a ``labels``/``hosts`` line, each once, at most ``MAX_PROCESSES``
    (the job's processes may write to the file: nothing else is taken for a replica)."""
    return tuple(dict.fromkeys(w for w in words if _LABEL_RE.fullmatch(w)))[:MAX_PROCESSES]


def parse(text: str) -> Exits | None:
    """The file's lines; anything malformed (a line cut by a crash) is skipped. None without
    its ``labels`` line: no file (the job never ran its script, or an older driver's script
    wrote none), which is not "every process stopped"."""
    labels: tuple[str, ...] = ()
    hosts: tuple[str, ...] = ()
    ends: list[End] = []
    seen: set[str] = set()
    for line in text.splitlines():
        words = line.split()
        if words[:1] == ["labels"]:
            labels = _labels(words[1:])
        elif words[:1] == ["hosts"]:
            hosts = _labels(words[1:])
        elif (len(words) == 4 and words[0] == "end" and _LABEL_RE.fullmatch(words[1])
              and _STATUS_RE.fullmatch(words[2]) and words[3] in ("exit", "stop", "halt")
              and words[1] not in seen and len(seen) < MAX_PROCESSES):
            seen.add(words[1])  # heard of once; a repeat (never written) would not change it
            ends.append(End(words[1], int(words[2]), words[3] != "exit", words[3] == "halt"))
    return Exits(labels, tuple(ends), hosts) if labels else None


def split_label(label: str) -> tuple[str, int] | None:
    """``worker-1`` -> ("worker", 1); roles never hold a ``-`` followed by digits only at the end."""
    role, sep, index = label.rpartition("-")
    return (role, int(index)) if sep and role and decimal(index) else None


def replicas(exits: Exits, roles: Sequence[tuple[str, int]], job_state: JobState,
             host: str) -> tuple[tuple[ReplicaStatus, ...], End | None]:
    """Every replica's status from the recorded ends, and the failure that decided the job
    (None unless the job FAILED on a process's non-zero exit). ``roles`` names the replicas
    (the rendered steps); empty (a job adopted after a restart), the file's labels do."""
    failure = exits.first_failure() if job_state is JobState.FAILED else None
    if not roles:
        roles = [r for r in (split_label(lb) for lb in exits.labels) if r is not None]
    by_label = {e.label: e for e in exits.ends}
    out = []
    for role, index in roles:
        end = by_label.get(f"{role}-{index}")
        if end is None:
            state, code = ReplicaState.STOPPED, None
            msg = "stopped with the job" if job_state.is_terminal() else ""
        elif end is failure:
            state, code, msg = ReplicaState.FAILED, end.status, f"exited with code {end.status}"
        elif end.status == 0 and not end.stopped:
            state, code, msg = ReplicaState.SUCCEEDED, 0, "exited with code 0"
        else:
            state, code = ReplicaState.STOPPED, end.status
            msg = f"stopped (exit code {end.status})"
        out.append(ReplicaStatus(role=role, index=index, state=state, host=host, exit_code=code, message=msg))
    return tuple(out), failure
