"""Reading a job's log files on the login node: remote scripts, their framing, and dating lines.

Files (render): ``<role>-<index>.stdout|.stderr`` in the attempt directory,
written by the steps, and ``log.index``, appended by the job script every
``render.INDEX_INTERVAL`` seconds with each file that grew: ``<unix
seconds.micros> <size> <name>``, "by then the file held ``size`` bytes".

Both remote scripts answer in frames, one per file with new bytes::

    <n> <start> <size> <mtime> <name>\\n<exactly n bytes of the file from start>

(``size``: the file's size when it was looked at; ``mtime``: its last write,
``YYYY-MM-DDTHH:MM:SS.nnnnnnnnn+ZZZZ``); a stream ends each round that sent
anything with ``0 0 0 - .`` and its very end with ``0 0 0 - end``.

The job can write anything into its attempt directory (and so can any job of
the same Slurm user), so both scripts bound what they send: only the job's
own log files (``<role>-<index>`` of its rendered steps, or, for a job
adopted without them, of its exits file's ``labels`` line; each name checked
in the shell before anything stats it), only regular files (no symlink, no
FIFO), at most ``MAX_CHUNK`` of a file and ``ROUND_BUDGET`` (file bytes and
``HEADER_BYTES`` a frame) of a round. A read that spends its budget ends with
``0 0 0 - more`` and the cursor reads on at once; a first read still sends a
frame of no bytes for each file it did not reach, so the file keeps its
first-read start. Offsets move only by what was sent: nothing is lost or
said twice. A stream's round past the budget fails the stream.

- ``read_script``: one read of every file from the offsets already known
  (new files from 0, or, on a first read, from ``tail_lines`` lines before
  their end and/or the last index entry before ``since``), in one POSIX sh
  command. On a first read the index comes as ``log.index.filtered``: only
  the entries past each file's start, so a week-long job's index is never
  sent whole.
- ``stream_script``: the same, in a loop in one long-lived bash on one
  channel (``tail -F``-style: files are followed by name, a file that
  appears later is picked up, a truncated one is read again from 0), every
  ``interval`` seconds while a chunk was capped, nothing is sent while
  nothing changed. Between rounds the loop waits on its stdin (``read -t``):
  the end of its input (the driver closes it once the job has ended; the
  channel closing, the driver gone, does the same) makes it drain every file,
  send the end frame and exit, so no loop outlives its follower. Only the end
  of input is a signal, never a line: bash's ``read -t`` can drop bytes that
  arrive as it times out.

Dating (``LogCursor``): a line is dated by the first index entry that shows
its file holding the whole line (at most one index interval after it was
written); a line the index does not cover yet (a running job's last second,
a job killed before its last index round, a job from before the index) gets
its file's mtime at the read, which is its last write. ``since_time`` keeps
the lines dated at or after it.

Following (``tail``): a tail starts with one framed read of every file on the
control connection (``tail_lines``: each file from its last N lines (pieces), found
within N pieces from its end, so a large log is never read whole; ``since_time``: from the
log index's last entry before it). A follower then streams: one long-lived
remote loop on one channel of the cluster's second SSH connection
(``SlurmClient.log_ssh``, opened on first use, at most ``--max-log-streams``
channels, default 8, below sshd's MaxSessions) sends each file's new bytes
as they come and, once the poller has seen the job end and the driver closes
the loop's input, drains every file and ends. Followers beyond the bound (and
a follower whose stream broke) read by polls on the control connection (one
command per ``min(1 s, poll interval)``, floor ``LOG_POLL_FLOOR``) and take a
stream slot when one frees. Either way the cursor holds each file's offset
and applies whole rounds only, so nothing is lost or said twice.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import re
import shlex
import time
from collections import deque
from collections.abc import AsyncGenerator, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import TYPE_CHECKING

from dlsched.errors import DlschedError
from dlsched.kit.parse import decimal
from dlsched.spec_rules import MAX_PROCESSES
from drivers.common.base import LogEntry, LogQuery, LogStream
from drivers.common.convert import MAX_LINE_CHARS, pieces
from drivers.common.registry import BackendUnavailable
from drivers.slurm import shell
from drivers.slurm.render import LOG_INDEX

if TYPE_CHECKING:
    from drivers.slurm.adapter import SlurmClient

#: Bounds on what the job can write into its log index (``dlsched_index`` keeps it, in the job's
#: directory): a line's length, the files named (two streams per process, and the batch files)
#: and the entries kept per file (dating lines not read yet; past it, every other one is dropped,
#: so a day of output keeps its early lines dated, a little more coarsely).
_MAX_INDEX_LINE = 1024
_MAX_FILES = 2 * MAX_PROCESSES + 8
_MAX_INDEX_ENTRIES = 100_000

log = logging.getLogger("dlsched.driver.slurm")

#: What srun (``srun: error: node: task 0: Exited with exit code 7``, ``srun: launch/slurm:
#: _step_signal: Terminating StepId=1.0``) and slurmstepd (``slurmstepd-node: error: *** STEP 5.1
#: ON node CANCELLED AT ... ***``) write into a step's stderr, beside its tasks' lines: left out,
#: as the other backends add nothing of their own to a replica's output.
SLURM_OWN_LINE_RE = re.compile(
    rb"srun: (?:error: |warning: |launch/|Job step aborted|Job [0-9]+ step |forcing job termination|got SIGCONT"
    rb"|Terminating |Complete StepId|Step created|Force Terminated|Received task exit)"
    rb"|slurmstepd(?:-[^:\s]{1,128})?: error: \*\*\* (?:STEP|JOB) .*\*\*\*\Z")
#: srun's and slurmstepd's lines that may follow a task's last stderr line without a newline, glued
#: to it (``err two no newlinesrun: error: vm: task 0: Exited with exit code 7``): a task's end (its
#: code, or its signal's ``strsignal`` text) and a step's cancel, split off; the program's part is kept.
SLURM_OWN_SUFFIX_RE = re.compile(
    rb"(?:srun: error: [^\s:]{1,128}: tasks? [0-9,-]{1,64}: "
    rb"(?:Exited with exit code [0-9]{1,3}|[A-Z][A-Za-z0-9/ ]{0,40}?(?: \(core dumped\))?)"
    rb"|slurmstepd(?:-[^:\s]{1,128})?: error: \*\*\* (?:STEP|JOB) [^*]{1,512}\*\*\*)\Z")
SLURM_OWN_TAIL_EXTRA = 64  # lines a stderr tail reads beyond tail_lines: srun's own (short), left out after
FILE_RE = re.compile(r"^([a-z][a-z0-9-]{0,62})-([0-9]{1,7})\.(stdout|stderr)\Z")  # ASCII digits: \d takes others
MAX_CHUNK = 1 << 20
#: Log tails read files on the login node, not the controller: their own, lower floor.
LOG_POLL_FLOOR = 0.2
#: A log stream's remote loop looks at its files this often (a stat on the login node, no SSH
#: round trip), whatever the poll interval: a line reaches the driver about half of it after it
#: was written (0.2 s measured p50 110 ms; 0.1 s keeps p50 under 100 ms at 10 stats a second).
STREAM_INTERVAL = 0.1
FILTERED_INDEX = LOG_INDEX + ".filtered"
ROUND_END = "."
STREAM_END = "end"

#: The most one round sends (a read's answer, a stream's round): file bytes plus ``HEADER_BYTES``
#: for each frame. A round that runs out sends ``0 0 0 - more`` and the next reads on at once.
ROUND_BUDGET = 8 << 20
#: A frame header's share of the budget (a header is at most about 170 bytes: the name is checked).
HEADER_BYTES = 256
MORE = "more"
#: The most of a listing a script reads: the exits file's ``labels`` line (a job adopted without
#: its roles), the log index filtered on a first read (the rest of it follows in later reads).
LISTING_BYTES = 1 << 20
_MAX_NAME = 80  # the longest log file name: a 63-character role, a 7-digit index, ".stdout"

#: The shell function both scripts share: emit <name> <from> <size> <mtime> sends what it may of
#: the file (a regular file only, nothing past ``MAX_CHUNK`` or the round's budget ``left``); it
#: sets ``n`` to the bytes sent (0: nothing, it fails) and ``more`` when bytes stay unsent.
_EMIT = ("emit() { n=0; [ \"$3\" -gt \"$2\" ] || return 1; [ -f \"$1\" ] && [ ! -L \"$1\" ] || return 1; "
         f"[ $left -gt {HEADER_BYTES} ] || {{ more=1; return 1; }}; "
         f"n=$(($3 - $2)); [ $n -le {MAX_CHUNK} ] || n={MAX_CHUNK}; "
         f"[ $n -le $((left - {HEADER_BYTES})) ] || n=$((left - {HEADER_BYTES})); "
         f"left=$((left - {HEADER_BYTES} - n)); [ $(($2 + n)) -ge \"$3\" ] || more=1; "
         "printf '%s %s %s %s %s\\n' \"$n\" \"$2\" \"$3\" \"$4\" \"$1\"; "
         "tail -c +$(($2 + 1)) -- \"$1\" | head -c \"$n\"; }; ")
_ROLE_RE = re.compile(r"^[a-z][a-z0-9-]{0,62}\Z")


def _file_globs(query: LogQuery | None) -> list[str]:
    role, index = "*", "*"
    streams: tuple[str, ...] = ("stdout", "stderr")
    if query is not None:
        if query.role and _ROLE_RE.match(query.role):
            role = query.role
        if query.replica_index is not None:
            index = str(int(query.replica_index))
        if query.streams:
            streams = tuple(sorted(st.name.lower() for st in query.streams))
    return [f"{role}-{index}.{st}" for st in streams]


def log_globs(query: LogQuery | None = None) -> str:
    """The shell globs of the log files a query wants (plus the index), so a filtered tail
    reads only those; a role that is not a plain name is not put in a glob (the driver
    filters it). Globs may match more (role ``a`` matches ``a-b-0``), never less."""
    return " ".join(_file_globs(query)) + f" {LOG_INDEX}"


def _replica_filter(roles: Sequence[tuple[str, int]]) -> str:
    """Shell that ``continue``s past a name ``$f`` that is no ``<role>-<index>.stdout|stderr``
    of the job: one ``case`` arm per role, longest first (role ``a-b``'s files are never taken
    for role ``a``'s), a decimal index below the role's replica count."""
    q = shlex.quote
    count: dict[str, int] = {}
    for role, index in roles:
        count[role] = max(count.get(role, 0), index + 1)
    arms = "".join(f"{q(r)}-*) r={q(r)}; c={count[r]};; "
                   for r in sorted(count, key=lambda r: (-len(r), r)))
    return (f'case "$f" in {arms}*) continue;; esac; i=${{f#"$r"-}}; i=${{i%.stdout}}; i=${{i%.stderr}}; '
            "case \"$i\" in ''|*[!0-9]*|0?*|????????*) continue;; esac; [ \"$i\" -lt \"$c\" ] || continue; ")


def _listing(query: LogQuery | None, roles: Sequence[tuple[str, int]]) -> str:
    """One stat line per file of a round, the index first: ``<mode> <size> <date> <time> <zone>
    <name>``. Names are filtered before anything looks at them (``_replica_filter``; without
    roles, a job adopted without its record, by the ``labels`` line of its exits file, in one
    awk), so the files a job makes beside its logs cost the driver nothing, and no command
    line grows with them (names go to stat through xargs; they hold no blank or quote)."""
    too_long = "?" * (_MAX_NAME + 1) + "*"
    names = (f"for f in {LOG_INDEX} {' '.join(_file_globs(query))}; do "
             f"case \"$f\" in *[!a-z0-9.-]*|{too_long}) continue;; esac; "
             + (f'if [ "$f" != {LOG_INDEX} ]; then {_replica_filter(roles)}fi; ' if roles else "")
             + "printf '%s\\n' \"$f\"; done")
    if not roles:
        names = (f"{{ head -c {LISTING_BYTES} -- {shell.EXITS} 2>/dev/null | head -n 1; echo; {names}; }} | "
                 "awk 'NR == 1 { if ($1 == \"labels\") for (i = 2; i <= NF; i++) ok[$i] = 1; next } "
                 f"{{ l = $0; sub(/[.]std(out|err)$/, \"\", l) }} $0 == \"{LOG_INDEX}\" || (l in ok)'")
    return f"{names} | xargs -r stat -c '%A %s %y %n' -- 2>/dev/null"


def read_script(adir: str, offsets: Mapping[str, int], tail_lines: int = 0,
                since_ns: int | None = None, query: LogQuery | None = None,
                roles: Sequence[tuple[str, int]] = ()) -> str:
    """One framed read of every log file of ``adir`` past ``offsets`` (POSIX sh), at most
    ``ROUND_BUDGET``: past it, ``0 0 0 - more``. ``roles``: the job's (role, index) pairs,
    the only log files read. With no offsets at all it is a first read: ``tail_lines`` and
    ``since_ns`` pick where each file starts (a file the budget left unread still says where
    it starts, in a frame of no bytes), and the index comes filtered."""
    q = shlex.quote
    head = f"cd -- {q(adir)} 2>/dev/null || exit 0; export LC_ALL=C; left={ROUND_BUDGET}; more=0; {_EMIT}"
    if offsets:
        cases = "".join(f"{q(n)}) o={o};; " for n, o in sorted(offsets.items()))
        per_file = f'case "$f" in {cases}*) o=0;; esac; '
        tail = ""
    else:
        per_file = f'[ "$f" != {LOG_INDEX} ] || continue; o=0; '
        if tail_lines > 0:  # tail reads after stat: a file growing meanwhile can push it below 0
            # (stderr: srun's lines too; within a piece a line from the end: a 3 MB line came whole)
            k, c = tail_lines + SLURM_OWN_TAIL_EXTRA, tail_lines * MAX_LINE_CHARS
            per_file += (f'k={tail_lines}; c={c}; case "$f" in *.stderr) k={k}; c={c + 1024 * SLURM_OWN_TAIL_EXTRA};; '
                         'esac; o=$((s - $(tail -c "$c" -- "$f" | tail -n "$k" | wc -c))); [ $o -ge 0 ] || o=0; ')
        if since_ns is not None:  # the size the last index entry before since saw
            secs = f"{since_ns // 1_000_000_000}.{since_ns % 1_000_000_000:09d}"
            head += (f"since=$(awk -v s={secs} '$1 < s {{ o[$3] = $2 }} END {{ for (f in o) print f, o[f] }}' "
                     f"{LOG_INDEX} 2>/dev/null); ")
            per_file += ("b=$(printf '%s\n' \"$since\" | awk -v f=\"$f\" '$1 == f { print $2 }'); "
                         '[ -z "$b" ] || [ "$b" -le "$o" ] || o=$b; ')
        # then the index entries past each file's start, as one frame of at most LISTING_BYTES
        # whose start is where the index was read to (the rest comes in later reads), then its
        # size: awk ends with that place, the digits after the last entry
        tail = (f"[ -f {LOG_INDEX} ] && [ ! -L {LOG_INDEX} ] || exit 0; isz=$(stat -c %s {LOG_INDEX}); "
                f"x=$(DLSCHED_STARTS=\"$starts\" awk -v cap={LISTING_BYTES} "
                "'BEGIN { n = split(ENVIRON[\"DLSCHED_STARTS\"], a, \"\\n\"); "
                "for (i = 1; i <= n; i++) { split(a[i], kv, \" \"); st[kv[1]] = kv[2] } } "
                "{ if (($3 in st) && $2 > st[$3]) { if (out + length($0) + 1 > cap) exit; print; "
                "out += length($0) + 1 } pos += length($0) + 1 } END { print pos + 0 }' "
                f"{LOG_INDEX}; echo .); x=${{x%.}}; x=${{x%?}}; p=${{x##*[!0-9]}}; x=${{x%\"$p\"}}; "
                '[ "$p" -le "$isz" ] || p=$isz; '
                f"printf '%s %s %s - {FILTERED_INDEX}\\n%s' $(($(printf '%s' \"$x\" | wc -c))) "
                f'"$p" "$isz" "$x"; ')
    return (f"{head}starts=''; {_listing(query, roles)} | {{ while read -r a s d t z f; do "
            'case "$a" in -*) ;; *) continue;; esac; [ -f "$f" ] && [ ! -L "$f" ] || continue; '
            f"{per_file}"
            '[ "$s" -ge "$o" ] || o=0; starts="$starts$f $o\n"; '
            'emit "$f" "$o" "$s" "${d}T$t$z"'
            + (" || :; " if offsets else  # a file not read (at its end, or past the budget) says where it stands
               ' || printf \'0 %s %s %s %s\\n\' "$o" "$s" "${d}T$t$z" "$f"; ')
            + f"done; [ $more = 0 ] || printf '0 0 0 - {MORE}\\n'; {tail}}}")


def stream_script(adir: str, offsets: Mapping[str, int], interval: float,
                  query: LogQuery | None = None, roles: Sequence[tuple[str, int]] = ()) -> str:
    """The long-lived follower (bash): frames every round that found new bytes, at most
    ``ROUND_BUDGET`` a round (a round that runs out is followed at once by the next)."""
    init = " ".join(f"[{shlex.quote(n)}]={o}" for n, o in sorted(offsets.items()))
    body = (
        "set -u; export LC_ALL=C; "
        f"declare -A off=({init}); more=0; sent=0; left=0; n=0; "
        f"{_EMIT}"
        f"round() {{ local a s d t z f o; more=0; sent=0; left={ROUND_BUDGET}; "
        "while read -r a s d t z f; do case \"$a\" in -*) ;; *) continue;; esac; "
        "o=${off[$f]:-0}; [ \"$s\" -ge \"$o\" ] || o=0; "
        "emit \"$f\" \"$o\" \"$s\" \"${d}T$t$z\" || continue; off[$f]=$((o + n)); sent=1; "
        f"done < <({_listing(query, roles)}); "
        f"[ $sent = 0 ] || printf '0 0 0 - {ROUND_END}\\n'; }}; "
        # wait for the attempt directory (a pending job has none), listening to the driver
        f"until cd -- {shlex.quote(adir)} 2>/dev/null; do "
        "read -t 1 -r cmd; [ $? -gt 128 ] || { "
        f"printf '0 0 0 - {STREAM_END}\\n'; exit 0; }}; done; "
        "while :; do round; w=" + f"{interval:g}" + "; [ $more = 0 ] || w=0.01; "
        "read -t \"$w\" -r cmd; [ $? -gt 128 ] && continue; "
        "round; while [ $more = 1 ]; do round; done; "
        f"printf '0 0 0 - {STREAM_END}\\n'; exit 0; done"
    )
    return f"exec bash -c {shlex.quote(body)} dlsched-log-stream"


@dataclass(frozen=True)
class Frame:
    name: str
    start: int
    size: int
    mtime_ns: int | None
    data: bytes


def parse_header(line: bytes) -> tuple[int, int, int, int | None, str] | None:
    parts = line.rstrip(b"\n").decode("utf-8", "replace").split(" ", 4)
    if len(parts) != 5 or not all(decimal(p) for p in parts[:3]):
        return None
    return int(parts[0]), int(parts[1]), int(parts[2]), _mtime_ns(parts[3]), parts[4]


def parse_frames(data: bytes) -> list[Frame]:
    """Every whole frame of one ``read_script`` answer."""
    out = []
    pos = 0
    while pos < len(data):
        nl = data.find(b"\n", pos)
        if nl < 0:
            break
        h = parse_header(data[pos:nl + 1])
        if h is None:
            break
        n, start, size, mtime, name = h
        out.append(Frame(name, start, size, mtime, data[nl + 1:nl + 1 + n]))
        pos = nl + 1 + n
    return out


def _mtime_ns(text: str) -> int | None:
    """``2026-12-02T19:43:38.123456789+0000`` -> unix nanoseconds."""
    m = re.match(r"^(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d)(?:\.(\d{1,9}))?([+-]\d{4})\Z", text)
    if m is None:
        return None
    try:
        whole = datetime.strptime(m.group(1) + m.group(3), "%Y-%m-%dT%H:%M:%S%z")
    except ValueError:
        return None
    return int(whole.timestamp()) * 1_000_000_000 + int((m.group(2) or "0").ljust(9, "0"))


def _index_time_ns(text: str) -> int | None:
    whole, _, frac = text.partition(".")
    if not decimal(whole) or (frac and not decimal(frac)):
        return None
    return int(whole) * 1_000_000_000 + int(frac[:9].ljust(9, "0") or "0")


@dataclass
class _File:
    offset: int = 0  # bytes read so far
    partial: bytes = b""  # an unfinished last line
    index: deque[tuple[int, int]] = field(default_factory=deque)  # (size, unix ns), sizes rising
    mtime_ns: int | None = None
    more: bool = False  # bytes beyond what was read


def _program_part(line: bytes) -> bytes:
    """A stderr line without srun's or slurmstepd's message glued to its end (``SLURM_OWN_SUFFIX_RE``)."""
    if b"srun: error: " in line or b"slurmstepd" in line:
        m = SLURM_OWN_SUFFIX_RE.search(line)
        if m is not None:
            return line[:m.start()]
    return line


class LogCursor:
    """Where a tail stands in each file: offsets for the next read, unfinished lines,
    and the index entries that date the lines still to come."""

    def __init__(self, query: LogQuery, roles: Sequence[tuple[str, int]] = ()) -> None:
        self.query = query
        self.roles = tuple(roles)  #: the job's (role, index) pairs; none known: any the files name
        self._replicas = frozenset(self.roles)
        self.files: dict[str, _File] = {}
        self.index_partial = b""
        self.first = True
        self.budget_spent = False  # the last read ran out of its budget: files it did not reach

    def offsets(self) -> dict[str, int]:
        out = {n: f.offset for n, f in self.files.items()}
        if LOG_INDEX in self.files or not self.first:
            out.setdefault(LOG_INDEX, 0)
        return out

    def more(self) -> bool:
        """A file has bytes past the last read (its chunk was capped, or the read's budget spent)."""
        return self.budget_spent or any(f.more for f in self.files.values())

    def read_script(self, adir: str) -> str:
        return read_script(adir, self.offsets() if not self.first else {},
                           self.query.tail_lines if self.first else 0,
                           self.query.since_ns if self.first else None, self.query, self.roles)

    def stream_script(self, adir: str, interval: float) -> str:
        return stream_script(adir, self.offsets(), interval, self.query, self.roles)

    def _log_file(self, name: str) -> re.Match[str] | None:
        """``name``'s match if it is a log file of one of the job's replicas."""
        m = FILE_RE.match(name)
        if m is None or (self._replicas and (m.group(1), int(m.group(2))) not in self._replicas):
            return None
        return m

    def feed(self, frames: Iterable[Frame], ended: bool = False) -> list[LogEntry]:
        """One round of frames -> the log entries the query wants, oldest first per file.
        ``ended``: the job has ended, so a drained file's unfinished line is a line."""
        frames = list(frames)
        self.budget_spent = any(fr.name == MORE for fr in frames)
        if not self.budget_spent:  # a file without a frame had nothing to send (or is no regular
            # file now: one swapped for a symlink while capped is not read on for ever)
            sent = {LOG_INDEX if fr.name == FILTERED_INDEX else fr.name for fr in frames}
            for name, f in self.files.items():
                f.more = f.more and name in sent
        for fr in frames:  # the index first: it dates this round's lines
            if fr.name == FILTERED_INDEX:  # read up to its start (the rest follows)
                self._index(fr.data, replace=True)
                f = self.files.setdefault(LOG_INDEX, _File())
                f.offset, f.more = fr.start, fr.start < fr.size
            elif fr.name == LOG_INDEX:
                f = self.files.setdefault(LOG_INDEX, _File())
                if fr.start != f.offset:
                    self.index_partial = b""
                f.offset = fr.start + len(fr.data)
                f.more = f.offset < fr.size
                self._index(fr.data)
        out: list[LogEntry] = []
        for fr in frames:
            m = self._log_file(fr.name)
            if m is None:
                continue
            f = self.files.setdefault(fr.name, _File())
            if fr.start != f.offset:  # a first read's start, or a file truncated and read again
                f.partial = b""
            line_start = fr.start - len(f.partial)
            f.offset = fr.start + len(fr.data)
            f.mtime_ns = fr.mtime_ns or f.mtime_ns
            f.more = f.offset < fr.size
            *raw, unfinished = (f.partial + fr.data).split(b"\n")
            role, index, stream = m.group(1), int(m.group(2)), LogStream[m.group(3).upper()]
            lines = []
            for n, text in enumerate([*raw, unfinished]):  # long ones in pieces, each dated by its end
                cuts, text = pieces(text)
                for piece in cuts:
                    line_start += len(piece)
                    lines.append((piece, self._date(f, line_start)))
                if n < len(raw):
                    line_start += len(text) + 1
                    lines.append((text, self._date(f, line_start)))
                else:  # output without newlines went out in the same pieces; the rest waits
                    f.partial = text
            out.extend(self._entries(role, index, stream, lines))
        if ended:
            for name, f in sorted(self.files.items()):
                m = self._log_file(name)
                if m is None or f.more or not f.partial:
                    continue
                end = f.offset
                entry = [(f.partial, self._date(f, end))]
                f.partial = b""
                out.extend(self._entries(m.group(1), int(m.group(2)), LogStream[m.group(3).upper()], entry))
        self.first = False
        return out

    def _entries(self, role: str, index: int, stream: LogStream,
                 lines: list[tuple[bytes, int | None]]) -> list[LogEntry]:
        q = self.query
        if not (q.wants_replica(role, index) and q.wants_stream(stream)):
            return []
        if stream is LogStream.STDERR:  # srun's and slurmstepd's own lines are no replica's output
            lines = [(t, ns) for t, ns in lines if not SLURM_OWN_LINE_RE.match(t)]
            if lines:  # only the last of the program's lines read can have srun's glued to its end
                lines[-1] = (_program_part(lines[-1][0]), lines[-1][1])
        if q.since_ns is not None:
            lines = [(t, ns) for t, ns in lines if ns is None or ns >= q.since_ns]
        if self.first and q.tail_lines:
            lines = lines[-q.tail_lines:]
        return [LogEntry(role=role, replica_index=index, stream=stream, text=t.decode("utf-8", "replace"),
                         time_ns=ns) for t, ns in lines]

    def _index(self, data: bytes, replace: bool = False) -> None:
        if replace:
            self.index_partial = b""
        raw = (self.index_partial + data).split(b"\n")
        self.index_partial = raw.pop()[-_MAX_INDEX_LINE:]  # an index line is short: a longer one is no line
        for line in raw:
            parts = line.decode("ascii", "replace").split(" ")
            if len(parts) != 3 or not decimal(parts[1]) or self._log_file(parts[2]) is None:
                continue
            ns = _index_time_ns(parts[0])
            if ns is None:
                continue
            if parts[2] not in self.files and len(self.files) >= _MAX_FILES:
                continue  # more names than any job's files: the job wrote them into the index
            f = self.files.setdefault(parts[2], _File())
            size = int(parts[1])
            if (not f.index or size > f.index[-1][0]) and size > f.offset - len(f.partial):
                if len(f.index) >= _MAX_INDEX_ENTRIES:  # thinned, every part of the file still dated
                    f.index = deque(itertools.islice(f.index, 0, None, 2))
                f.index.append((size, ns))

    @staticmethod
    def _date(f: _File, end: int) -> int | None:
        """When the file first held ``end`` bytes: the index, else its last write."""
        while f.index and f.index[0][0] < end:
            f.index.popleft()
        if f.index:
            return f.index[0][1]
        return f.mtime_ns if f.mtime_ns is not None else time.time_ns()


# --------------------------------------------------------------------------- following


async def tail(client: Callable[[], SlurmClient], adir: str, query: LogQuery, ended: Callable[[], bool],
               poll_interval: float, stream_interval: float = STREAM_INTERVAL,
               roles: Sequence[tuple[str, int]] = ()) -> AsyncGenerator[list[LogEntry], None]:
    """A tail of the attempt directory ``adir``: one framed read of every file on the
    control connection, then (``query.follow``) a stream on one channel of the log
    connection (``_stream``) while one is free, else polls every ``poll_interval``
    (and a stream slot taken when one frees). ``client()`` is looked up again each
    round (a reconfigured cluster has new connections); ``ended()`` says the job has
    ended (or was forgotten): then every file is drained and the tail ends. ``roles``: the
    job's (role, index) pairs, whose files alone are read (none: the exits file's labels)."""
    cursor = LogCursor(query, roles)
    while True:
        c = client()
        done = ended()
        out = await c.ssh.run_bytes(cursor.read_script(adir), time_limit=c.timeout, call="tail")
        batch = cursor.feed(parse_frames(out.stdout), done)
        if batch:
            yield batch
        if cursor.more():
            continue  # a capped chunk or a spent budget: read on at once
        if done or not query.follow:
            return
        if c.log_ssh.channel_free():
            try:
                async with contextlib.aclosing(_stream(c, adir, cursor, ended, poll_interval,
                                                       stream_interval)) as stream:
                    async for batch in stream:
                        yield batch
                return
            except DlschedError as e:  # go on reading from where the stream's last round left off
                log.info("log stream of %s ended early (%s); reading by polls", adir, e.message)
        await asyncio.sleep(poll_interval)


async def _stream(c: SlurmClient, adir: str, cursor: LogCursor, ended: Callable[[], bool],
                  check: float, interval: float = STREAM_INTERVAL) -> AsyncGenerator[list[LogEntry], None]:
    """Follow on one long-lived channel of the cluster's log connection (``stream_script``)
    until the job has ended and every file is drained. Rounds are applied whole, so when the
    channel fails the cursor stands at the end of the last whole round and nothing is lost or
    said twice."""
    proc = await c.log_ssh.start(cursor.stream_script(adir, interval), call="tail", wait=False)
    rounds: asyncio.Queue[list[Frame] | None | DlschedError] = asyncio.Queue()

    async def read() -> None:
        frames: list[Frame] = []
        size = 0  # of this round so far: never more than its budget (the script keeps to it)
        try:
            while True:
                line = await proc.readline()
                h = parse_header(line) if line else None
                if h is None:
                    raise BackendUnavailable("the log stream ended without its end frame")
                n, start, fsize, mtime, name = h
                if name == STREAM_END:
                    await rounds.put(None)
                    return
                if name == ROUND_END:
                    await rounds.put(frames)
                    frames, size = [], 0
                    continue
                size += len(line) + n
                if n > MAX_CHUNK or size > ROUND_BUDGET + HEADER_BYTES:  # out of step, or not our script
                    raise BackendUnavailable(f"the log stream sent a round of over {size} bytes")
                frames.append(Frame(name, start, fsize, mtime, await proc.readexactly(n) if n else b""))
        except DlschedError as e:
            await rounds.put(e)
        except Exception as e:  # noqa: BLE001 - a stream out of step ends this channel, not the follower
            await rounds.put(BackendUnavailable(f"the log stream failed: {e!r:.200}"))

    reader = asyncio.create_task(read(), name=f"slurm-log-stream-{adir}")
    ending = False
    getter: asyncio.Task[list[Frame] | None | DlschedError] | None = None
    try:
        while True:
            # not wait_for(rounds.get()): its timeout can race the get and lose the item
            getter = getter or asyncio.create_task(rounds.get())
            done, _ = await asyncio.wait({getter}, timeout=check)
            if not done:
                if not ending and ended():
                    proc.end_input()  # drain every file, then the end frame
                    ending = True
                continue
            got, getter = getter.result(), None
            if isinstance(got, DlschedError):
                raise got
            if got is None:
                if batch := cursor.feed([], ended=True):
                    yield batch
                return
            if batch := cursor.feed(got, ended=False):
                yield batch
    finally:
        proc.close()
        if getter is not None:
            getter.cancel()
        reader.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await reader
