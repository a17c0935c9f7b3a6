"""The local driver's log files: ``<unix-nanos> <text>\\n`` per line.

``LineWriter`` turns pipe chunks into stamped lines (a line longer than
``MAX_LINE`` is split; a last line without newline is written at EOF).
``LogFileReader`` reads whole lines from an offset onwards.
"""

from __future__ import annotations

MAX_LINE = 64 * 1024


class LineWriter:
    """Appends stamped lines to one file. Not thread-safe; one per stream."""

    def __init__(self, path: str) -> None:
        self._f = open(path, "ab", buffering=0)  # noqa: SIM115 - closed in close()
        self._partial = b""

    def feed(self, chunk: bytes, now_ns: int) -> int:
        """Write the complete lines of ``chunk``; returns how many were written."""
        data = self._partial + chunk
        lines = data.split(b"\n")
        self._partial = lines.pop()
        while len(self._partial) > MAX_LINE:
            lines.append(self._partial[:MAX_LINE])
            self._partial = self._partial[MAX_LINE:]
        return self._write(lines, now_ns)

    def _write(self, lines: list[bytes], now_ns: int) -> int:
        if not lines:
            return 0
        stamp = str(now_ns).encode() + b" "
        out = b"".join(
            stamp + line.rstrip(b"\r").decode("utf-8", "replace").encode() + b"\n" for line in lines
        )
        self._f.write(out)
        return len(lines)

    def close(self, now_ns: int) -> int:
        n = 0
        if self._partial:
            n = self._write([self._partial], now_ns)
            self._partial = b""
        self._f.close()
        return n


class LogFileReader:
    """Reads the lines appended to a log file since the last call."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._offset = 0
        self._partial = b""

    def read_new(self) -> list[tuple[int, str]]:
        try:
            with open(self.path, "rb") as f:
                f.seek(self._offset)
                data = f.read()
        except OSError:
            return []
        if not data:
            return []
        self._offset += len(data)
        data = self._partial + data
        lines = data.split(b"\n")
        self._partial = lines.pop()
        out: list[tuple[int, str]] = []
        for raw in lines:
            stamp, _, text = raw.partition(b" ")
            try:
                ns = int(stamp)
            except ValueError:
                ns, text = 0, raw
            out.append((ns, text.decode("utf-8", "replace")))
        return out

