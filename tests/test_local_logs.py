"""The local driver's logs: follow, tail, since and stream filters, from the files the job's supervisor writes."""

from __future__ import annotations

import asyncio
import pathlib
import random
import time
import tracemalloc

import pytest

from dlsched.v1 import driver_service_pb2 as dpb
from dlsched.v1 import job_pb2
from drivers.common.base import LogEntry, LogQuery, LogStream
from drivers.local import logs as local_logs
from tests.local_peer import (
    CLUSTER,
    driver_fixtures,
    launch,
    logs,
    new_id,
    observe,
    single,
    texts,
    wait_state,
)

state_dir, driver, stub = driver_fixtures()


async def test_logs_follow_arrive_line_by_line_and_end_with_the_job(stub):
    job_id = new_id("follow")
    code = "import time\nfor i in range(5):\n    print(f'{i} {time.time()}', flush=True)\n    time.sleep(0.3)\n"
    await launch(stub, job_id, single(code))
    arrivals: list[tuple[float, str]] = []
    req = dpb.TailJobLogsRequest(cluster=CLUSTER, job=dpb.JobRef(job_id=job_id), follow=True)

    async def follow() -> None:
        async for resp in stub.TailJobLogs(req):
            for e in resp.entries:
                arrivals.append((time.time(), e.text))

    await asyncio.wait_for(follow(), timeout=10)  # the stream ends by itself when the job ends
    obs = await observe(stub, job_id)
    assert obs.state == job_pb2.JOB_STATE_SUCCEEDED
    assert [t.split()[0] for _, t in arrivals] == ["0", "1", "2", "3", "4"]
    end = obs.end_time.seconds + obs.end_time.nanos / 1e9
    assert arrivals[0][0] < end - 1.0  # the first line came while the job still ran
    latencies = sorted(at - float(t.split()[1]) for at, t in arrivals)
    assert latencies[len(latencies) // 2] < 0.1, latencies
    assert latencies[-1] < 0.25, latencies


async def test_tail_lines_since_time_and_stream_filters(stub):
    job_id = new_id("tail")
    code = ("import sys, time\n"
            "for i in range(1, 6): print(f'line-{i}')\n"
            "sys.stdout.flush(); time.sleep(0.2)\n"
            "for i in range(6, 11): print(f'line-{i}')\n"
            "print('err-1', file=sys.stderr); print('err-2', file=sys.stderr)\n")
    await launch(stub, job_id, single(code))
    await wait_state(stub, job_id)
    everything = await logs(stub, job_id)
    assert texts(everything) == [f"line-{i}" for i in range(1, 11)]
    last = await logs(stub, job_id, tail_lines=3)
    assert texts(last) == ["line-8", "line-9", "line-10"]
    assert texts(last, job_pb2.LOG_STREAM_STDERR) == ["err-1", "err-2"]
    only_err = await logs(stub, job_id, streams=[job_pb2.LOG_STREAM_STDERR])
    assert {e.stream for e in only_err} == {job_pb2.LOG_STREAM_STDERR} and len(only_err) == 2
    line6 = next(e for e in everything if e.text == "line-6")
    since = await logs(stub, job_id, since_time=line6.time, streams=[job_pb2.LOG_STREAM_STDOUT])
    assert texts(since) == [f"line-{i}" for i in range(6, 11)]
    assert await logs(stub, job_id, role="other") == []


# --------------------------------------------------------------------------- the files, read in bounded pieces


def _write_lines(path: pathlib.Path, lines: list[tuple[int, str]], tail: bytes = b"") -> None:
    path.write_bytes(b"".join(f"{ns} {t}\n".encode() for ns, t in lines) + tail)


def _big_log(path: pathlib.Path, mib: int, width: int = 1000) -> int:
    """A log of ``mib`` MiB of ``width``-byte lines stamped 1, 2, ...; returns the number of lines."""
    per_mib = (1 << 20) // width
    with open(path, "wb") as f:
        n = 0
        for _ in range(mib):
            block = b"".join(b"%019d %s\n" % (n + i + 1, b"x" * (width - 21)) for i in range(per_mib))
            f.write(block)
            n += per_mib
    return n


def _collect(files: list[local_logs.LogFile], query: LogQuery) -> list[LogEntry]:
    async def go() -> list[LogEntry]:
        return [e async for batch in local_logs.tail(files, query, ended=lambda: True, gone=lambda: False) for e in batch]
    return asyncio.run(go())


@pytest.mark.parametrize("step", [999, 4096, 1 << 20])
def test_a_long_line_is_cut_at_characters_into_the_same_pieces_however_it_arrives(tmp_path, step):
    """A line of 300,000 two-byte characters after one ASCII one, written whole or in reads of any size: pieces of
    at most MAX_LINE bytes, each whole UTF-8 (no character cut in two, none lost)."""
    from drivers.local.logs import MAX_LINE, LineWriter

    line = ("x" + "é" * 300_000).encode() + b"\n" + b"after\n"  # "x": every MAX_LINE-th byte mid-character
    w = LineWriter(str(tmp_path / "out"))
    for i in range(0, len(line), step):
        w.feed(line[i:i + step], 1)
    w.close(2)
    texts = [raw.partition(b" ")[2] for raw in (tmp_path / "out").read_bytes().splitlines()]
    assert texts[-1] == b"after"
    assert all(len(t) <= MAX_LINE for t in texts), [len(t) for t in texts]
    assert b"".join(texts[:-1]).decode() == "x" + "é" * 300_000


def test_tail_lines_reads_only_the_end_of_a_big_file(tmp_path):
    """``tail_lines=1`` of a 100 MiB log: one chunk read, memory a few chunks (it used to read the whole file)."""
    path = tmp_path / "main-0.stdout"
    n = _big_log(path, 100)
    r = local_logs.LogFileReader(str(path))
    assert [ns for ns, _ in r.read_last(1)] == [n]
    assert r.bytes_read <= local_logs.READ_CHUNK + 1000  # a chunk backwards, the (1000-byte) line again forwards
    assert [ns for ns, _ in local_logs.LogFileReader(str(path)).read_last(3, since_ns=n - 1)] == [n - 1, n]
    files = [local_logs.LogFile("main", 0, LogStream.STDOUT, str(path))]
    tracemalloc.start()
    try:
        got = _collect(files, LogQuery(tail_lines=5))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert [e.time_ns for e in got] == list(range(n - 4, n + 1))
    assert peak < 4 * local_logs.READ_CHUNK, peak


def test_a_huge_tail_lines_costs_a_chunk_of_memory_not_the_lines(tmp_path):
    """``tail_lines`` of 2**31-1 on a 24 MiB log: every line, streamed forwards in chunks once found
    backwards (the lines found used to be held until there were n of them: the log's size in memory)."""
    path = tmp_path / "main-0.stdout"
    n = _big_log(path, 24)
    files = [local_logs.LogFile("main", 0, LogStream.STDOUT, str(path))]
    tracemalloc.start()
    try:
        async def go() -> tuple[int, int, int]:
            count, first, last = 0, 0, 0
            async for batch in local_logs.tail(files, LogQuery(tail_lines=2**31 - 1), ended=lambda: True,
                                               gone=lambda: False):
                first = first or batch[0].time_ns or 0
                count, last = count + len(batch), batch[-1].time_ns or 0
            return count, first, last
        count, first, last = asyncio.run(go())
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert (count, first, last) == (n, 1, n)
    assert peak < 12 * local_logs.READ_CHUNK + 2 * local_logs.BATCH_BYTES, peak


def test_a_whole_backlog_streams_in_bounded_memory_merged_by_time(tmp_path):
    out, err = tmp_path / "w-0.stdout", tmp_path / "w-0.stderr"
    n = _big_log(out, 24)  # stamps 1..n
    _write_lines(err, [(ns, f"err {ns}") for ns in range(5, n, 5000)])
    files = [local_logs.LogFile("w", 0, LogStream.STDOUT, str(out)), local_logs.LogFile("w", 0, LogStream.STDERR, str(err))]
    tracemalloc.start()
    try:
        async def go() -> tuple[int, list[int], list[int]]:
            count, stamps, batch_sizes = 0, [], []
            async for batch in local_logs.tail(files, LogQuery(), ended=lambda: True, gone=lambda: False):
                batch_sizes.append(sum(len(e.text) for e in batch))
                count += len(batch)
                stamps.extend(e.time_ns for e in batch if e.stream is LogStream.STDERR or e.time_ns % 997 == 0)
            return count, stamps, batch_sizes
        count, stamps, sizes = asyncio.run(go())
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert count == n + len(range(5, n, 5000))
    assert stamps == sorted(stamps)  # one time order across the two files
    assert max(sizes) <= local_logs.BATCH_BYTES
    assert peak < 12 * local_logs.READ_CHUNK + 2 * local_logs.BATCH_BYTES, peak  # the file is 24 MiB


@pytest.mark.parametrize("chunk", [1, 2, 5, 64, local_logs.READ_CHUNK])
def test_read_last_agrees_with_reading_everything(tmp_path, chunk):
    rnd = random.Random(chunk)
    path = tmp_path / "log"
    for trial in range(30):
        lines = [(1000 + i, "".join(rnd.choice("ab é\t") for _ in range(rnd.randrange(0, 12))))
                 for i in range(rnd.randrange(0, 12))]
        partial = rnd.choice([b"", b"17", b"1234 unfinished"])
        _write_lines(path, lines, partial)
        n = rnd.randrange(1, 15)
        since = rnd.choice([None, 1000 + rnd.randrange(0, 12)])
        r = local_logs.LogFileReader(str(path), chunk=chunk)
        want = [ln for ln in lines if since is None or ln[0] >= since][-n:]
        assert r.read_last(n, since) == want, (trial, lines, n, since)
        with open(path, "ab") as f:  # the writer goes on: the follow continues with exactly what came after
            f.write(b" done\n2000 next\n")
        rest: list[tuple[int, str]] = []
        while (more := r.read_new()) or not r.eof:
            rest.extend(more)
        assert [ns for ns, _ in rest][-1:] == [2000]
        tail_of_partial = (partial + b" done").decode()
        assert rest[0] == local_logs._parse(tail_of_partial.encode()), (rest, partial)


def test_follow_reads_a_burst_in_chunks(tmp_path):
    path = tmp_path / "log"
    path.write_bytes(b"")
    r = local_logs.LogFileReader(str(path), chunk=4096)
    _write_lines(path, [(i, "y" * 100) for i in range(1, 1001)])  # ~120 KiB at once
    first = r.read_new()
    assert 0 < len(first) < 40 and not r.eof and r.bytes_read == 4096
    got = list(first)
    while (more := r.read_new()) or not r.eof:
        got.extend(more)
    assert [ns for ns, _ in got] == list(range(1, 1001))


def test_a_tail_whose_file_is_cut_or_removed_under_it_ends(tmp_path):
    """The file truncated (a job rewriting its log) or removed (a cleanup) between finding the
    last lines and reading them: the read ends there (a bare limit kept it reading for ever)."""
    for how in ("truncate", "unlink"):
        path = tmp_path / f"{how}.log"
        _write_lines(path, [(i, f"line {i}") for i in range(1, 200)])
        r = local_logs.LogFileReader(str(path), chunk=64)
        r.seek_last(50)
        if how == "truncate":
            path.write_bytes(b"")
        else:
            path.unlink()
        for _ in range(1000):
            r.read_new()
            if r.eof:
                break
        assert r.eof, how
