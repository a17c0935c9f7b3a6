"""The Ray driver's log follow over an in-memory stand-in for Ray's log endpoints (the resume window).

The real endpoints are exercised against a real Ray head in test_ray_driver.py;
this covers what a head cannot be made to do on cue: a file that grew past the
resume window between the history read and the stream's start.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

from drivers.common.base import LogQuery, LogStream
from drivers.ray import layout, logs


class FakeStream:
    def __init__(self, chunks: list[bytes]) -> None:
        self.chunks = chunks

    async def read(self) -> bytes:
        return self.chunks.pop(0) if self.chunks else b""


class FakeApi:
    """One file, ``lines`` 1..n stamped with their number, then ``eof``; records every stream's ``lines``."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.opened: list[int] = []

    def text(self) -> bytes:
        return b"".join(layout.format_line(i, f"line {i}").encode() for i in range(1, self.n + 1)) + b"eof\n"

    @contextlib.asynccontextmanager
    async def stream_file(self, node_id: str, filename: str, interval: float, lines: int = -1,
                          ) -> AsyncIterator[FakeStream]:
        self.opened.append(lines)
        rows = self.text().splitlines(keepends=True)
        yield FakeStream([b"".join(rows if lines == -1 else rows[-lines:])])


F = logs.OutputFile("main", 0, LogStream.STDOUT, "node", "dlsched/s/main-0.out")


async def follow(api: FakeApi, after: int, tail: int) -> list[int]:
    got: list[int] = []
    await logs._follow_file(api, F, after, LogQuery(follow=True, tail_lines=tail), 0.05,  # type: ignore[arg-type]
                            ended=lambda: True, put=lambda es: got.extend(e.time_ns or 0 for e in es))
    return got


async def test_a_window_reaching_back_to_the_last_line_sent_is_read_once() -> None:
    n = 5000 + logs.RESUME_LINES // 2
    api = FakeApi(n)
    assert await follow(api, after=5000, tail=3) == list(range(5001, n + 1))
    assert api.opened == [logs.RESUME_LINES + 3]


async def test_a_file_that_outgrew_the_window_is_read_from_its_start_without_gaps_or_repeats() -> None:
    n = 5000 + 3 * logs.RESUME_LINES
    api = FakeApi(n)
    assert await follow(api, after=5000, tail=3) == list(range(5001, n + 1))
    assert api.opened == [logs.RESUME_LINES + 3, -1]


async def test_without_history_the_follow_starts_at_the_files_start() -> None:
    api = FakeApi(10)
    assert await follow(api, after=0, tail=0) == list(range(1, 11))
    assert api.opened == [-1]


class FakeFiles:
    """Whole files by path (``read_file``'s newest ``lines`` rows), as Ray's log endpoint reads them."""

    def __init__(self, files: dict[str, bytes]) -> None:
        self.files = files

    async def read_file(self, node_id: str, path: str, lines: int, newest: bool = False) -> bytes:
        rows = self.files[path].splitlines(keepends=True)
        return b"".join(rows if lines == -1 else rows[-lines:] if newest else rows[:lines])


async def test_tail_lines_cuts_each_replica_stream_not_the_merge() -> None:
    """StreamJobLogsRequest.tail_lines: "the last N lines of each replica stream" (as on every
    backend): two replicas writing by turns give N lines each, not N in all."""
    files = [logs.OutputFile("main", i, LogStream.STDOUT, "node", f"dlsched/s/main-{i}.out") for i in (0, 1)]
    api = FakeFiles({f.path: b"".join(layout.format_line(10 * t + f.index, f"r{f.index} {t}").encode()
                                      for t in range(1, 6)) + b"eof\n" for f in files})
    got, _ = await logs.history(api, files, LogQuery(tail_lines=2))  # type: ignore[arg-type]
    assert [e.text for e in got] == ["r0 4", "r1 4", "r0 5", "r1 5"]
    everything, _ = await logs.history(api, files, LogQuery())  # type: ignore[arg-type]
    assert len(everything) == 10


async def test_the_largest_tail_lines_asks_ray_for_lines_it_can_count() -> None:
    """tail_lines=2**31-1 asked Ray's endpoint for 2**31 lines: an int32 overflow there, answered
    UNAVAILABLE for ever (local and Slurm answer the whole file)."""
    asked: list[int] = []

    class Counting(FakeFiles):
        async def read_file(self, node_id: str, path: str, lines: int, newest: bool = False) -> bytes:
            asked.append(lines)
            return await super().read_file(node_id, path, lines, newest)

    f = logs.OutputFile("main", 0, LogStream.STDOUT, "node", "dlsched/s/main-0.out")
    api = Counting({f.path: layout.format_line(1, "only").encode() + b"eof\n"})
    got, _ = await logs.history(api, [f], LogQuery(tail_lines=2**31 - 1))  # type: ignore[arg-type]
    assert [e.text for e in got] == ["only"]
    assert asked and all(0 < n < 2**31 - 1 for n in asked)
    three = FakeApi(3)
    assert await follow(three, after=1, tail=2**31 - 1) == [2, 3]
    assert three.opened and all(n < 2**31 - 1 for n in three.opened)
