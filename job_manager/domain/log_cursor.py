"""Where a StreamJobLogs stream stands, so a new call continues it exactly.

A cursor names the job (its uid), the attempt being streamed (its backend
job id), whether that attempt's lines went out from each stream's first
line (``whole``: no ``tail_lines`` or ``since_time`` cut them) and, for
every replica stream that has sent lines in that attempt, its
``StreamPos``: how many lines were delivered, the time of the last one and
how many delivered lines share that time. Within one replica stream a
backend keeps the order the lines were written in and dates them
non-decreasingly, so on resume (the driver asked again for every line of
the attempt) a line was already delivered exactly when

- counted (``whole``, on a backend whose logs only grow: ``by_count``): it
  is one of the first ``count`` lines of its stream. A backend may date a
  line differently on a second read (Slurm dates a line its log index does
  not cover yet by its file's last write, later by the index), so counting
  is the exact rule wherever positions are stable;
- dated: it is older than the last delivered time, or it has that time and
  fewer than ``at_time`` lines with it were skipped so far (this holds
  whatever ``tail_lines`` or ``since_time`` the first call used);
- undated (a backend that does not date lines): it is one of the first
  ``count`` lines of its stream.

The cursor travels as unpadded base64url of zlib-compressed JSON: opaque to
clients, its size bounded by the number of replica streams, not of lines.
"""

from __future__ import annotations

import base64
import binascii
import json
import zlib
from dataclasses import dataclass, field

from dlsched.errors import InvalidArgument
from dlsched.spec_rules import MAX_PROCESSES

FIELD = "resume_cursor"
#: Longest cursor accepted (characters); far above what a 10 000-replica job makes.
MAX_CURSOR_CHARS = 1 << 20
_MAX_JSON_BYTES = 8 << 20
#: a position per stream of every process a job may have (stdout and stderr), and a few more
MAX_CURSOR_STREAMS = 2 * MAX_PROCESSES + 16
#: the longest attempt (backend job id) a cursor may name: the Driver API's bound on backend job ids
MAX_ATTEMPT_CHARS = 256
_VERSION = 1

StreamKey = tuple[str, int, int]  # (role, replica_index, LogStream value)


@dataclass
class StreamPos:
    """What one replica stream has delivered in the cursor's attempt."""

    count: int = 0  # lines delivered
    time_ns: int = 0  # time of the last delivered line; 0: undated
    at_time: int = 0  # delivered lines dated exactly time_ns (the last ones)


@dataclass
class LogCursor:
    """The position of a log stream; ``delivered`` moves it past one line."""

    job_uid: str
    attempt: str = ""  # backend job id of the attempt streamed; "" before any line
    streams: dict[StreamKey, StreamPos] = field(default_factory=dict)
    whole: bool = False  # the attempt's lines went out from each stream's first line

    def at_attempt(self, attempt: str, whole: bool) -> None:
        """Lines from now on belong to ``attempt`` (``whole``: sent from each stream's first
        line); a new one starts from nothing."""
        if attempt != self.attempt:
            self.attempt, self.whole = attempt, whole
            self.streams = {}

    def delivered(self, key: StreamKey, time_ns: int) -> None:
        pos = self.streams.get(key)
        if pos is None:
            pos = self.streams[key] = StreamPos()
        pos.count += 1
        if time_ns and time_ns == pos.time_ns:
            pos.at_time += 1
        else:
            pos.time_ns, pos.at_time = time_ns, (1 if time_ns else 0)

    def encode(self) -> str:
        rows = [[r, i, s, p.count, p.time_ns, p.at_time]
                for (r, i, s), p in sorted(self.streams.items())]
        data = json.dumps({"v": _VERSION, "u": self.job_uid, "a": self.attempt, "s": rows,
                           **({"w": 1} if self.whole else {})}, separators=(",", ":")).encode()
        return base64.urlsafe_b64encode(zlib.compress(data, 6)).decode().rstrip("=")

    @classmethod
    def decode(cls, text: str) -> LogCursor:
        """The cursor ``text`` encodes; INVALID_ARGUMENT naming the field if
        it is not one a server issued."""
        if len(text) > MAX_CURSOR_CHARS:
            raise InvalidArgument.for_field(FIELD, f"longer than {MAX_CURSOR_CHARS} characters")
        try:
            raw = base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))
            inflate = zlib.decompressobj()
            data = inflate.decompress(raw, _MAX_JSON_BYTES)
            if inflate.unconsumed_tail or not inflate.eof:
                raise ValueError("truncated or too large")
            obj = json.loads(data)
            if not isinstance(obj, dict) or obj.get("v") != _VERSION:
                raise ValueError("version")
            uid, attempt, rows, whole = obj["u"], obj["a"], obj["s"], obj.get("w", 0)
            if not isinstance(uid, str) or not isinstance(attempt, str) or not isinstance(rows, list) \
                    or whole not in (0, 1) or isinstance(whole, bool):
                raise ValueError("shape")
            if len(attempt) > MAX_ATTEMPT_CHARS or "\x00" in attempt:
                raise ValueError("attempt")  # (the driver would refuse it, naming its own field)
            if len(rows) > MAX_CURSOR_STREAMS:
                raise ValueError("too many streams")
            streams: dict[StreamKey, StreamPos] = {}
            for row in rows:
                if not isinstance(row, list) or len(row) != 6:
                    raise ValueError("row")
                role, idx, stream, count, t, k = row
                if not isinstance(role, str) or not all(
                        isinstance(v, int) and not isinstance(v, bool) and v >= 0
                        for v in (idx, stream, count, t, k)):
                    raise ValueError("row")
                streams[(role, idx, stream)] = StreamPos(count, t, k)
        except (binascii.Error, zlib.error, ValueError, KeyError, TypeError, RecursionError) as e:
            raise InvalidArgument.for_field(FIELD, "not a log cursor this server issued") from e
        return cls(uid, attempt, streams, whole == 1)


class Skipper:
    """On resume: which lines of the cursor's attempt were delivered before."""

    def __init__(self, cursor: LogCursor, by_count: bool = False) -> None:
        """``by_count``: the backend's log streams only grow (no rotation drops their first
        lines), so a ``whole`` cursor's counts are positions."""
        self._left = {k: StreamPos(p.count, p.time_ns, p.at_time) for k, p in cursor.streams.items()}
        self._done: set[StreamKey] = set()
        self._count = by_count and cursor.whole

    def seen(self, key: StreamKey, time_ns: int) -> bool:
        """Whether this line (the next of its stream) was delivered before."""
        pos = self._left.get(key)
        if pos is None or key in self._done:
            return False
        if self._count:
            skip = pos.count > 0
        elif pos.time_ns and time_ns:
            if time_ns < pos.time_ns:
                skip = True
            else:
                skip = time_ns == pos.time_ns and pos.at_time > 0
                if skip:
                    pos.at_time -= 1
        else:
            skip = pos.count > 0
        if skip:
            pos.count = max(pos.count - 1, 0)
        else:
            self._done.add(key)  # past the cursor: the rest of the stream is new
        return skip
