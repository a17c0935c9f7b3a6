"""What a hostile job writes in its attempt directories cannot take the Slurm driver down: the
remote scripts that read records and logs are run here with bash on a real directory (the
login node's side of the SSH command), and the answer the driver would hold is measured."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
from pathlib import Path

import pytest

from drivers.common.base import JobRef, JobState, LogQuery
from drivers.common.registry import BackendUnavailable
from drivers.slurm import logs as slogs
from drivers.slurm import records
from drivers.slurm.jobs import RECORDED, TrackedJob

STATE = "state"


def bash(cwd: Path, command: str) -> tuple[int, bytes, bytes]:
    p = subprocess.run(["bash", "-c", command], cwd=cwd, capture_output=True, timeout=60, check=False)
    return p.returncode, p.stdout, p.stderr


def runner(cwd: Path, sizes: list[int]):  # noqa: ANN201 - records.Run
    async def run(command: str, input: str | None = None) -> tuple[int, str, str]:
        rc, out, err = await asyncio.to_thread(bash, cwd, command)
        sizes.append(len(out))
        return rc, out.decode("utf-8", "replace"), err.decode("utf-8", "replace")
    return run


def write_record(home: Path, job_id: str, attempt: int, backend_id: str) -> None:
    job = TrackedJob("c", job_id, attempt, backend_id, f"{STATE}/{job_id}/attempt-{attempt}", None,
                     roles=(("main", 0),))
    job.state, job.reason, job.message = JobState.SUCCEEDED, "", "done"
    d = home / STATE / job_id / f"attempt-{attempt}"
    d.mkdir(parents=True, exist_ok=True)
    (d / RECORDED).write_text(json.dumps(job.record(), separators=(",", ":")) + "\n")


def test_records_read_a_bounded_answer_whatever_attempt_directories_the_job_made(tmp_path: Path) -> None:
    write_record(tmp_path, "victim", 1, "41")
    write_record(tmp_path, "victim", 2, "42")
    for i in range(3, 300):  # attempt directories the job made, each with a sparse 64 MiB "record"
        d = tmp_path / STATE / "victim" / f"attempt-{i}"
        d.mkdir(parents=True)
        with open(d / RECORDED, "wb") as f:
            f.truncate(64 << 20)
    os.symlink("/dev/zero", tmp_path / STATE / "victim" / "attempt-1000")
    sizes: list[int] = []
    found = asyncio.run(records.read(runner(tmp_path, sizes), "c", STATE,
                                     [JobRef("victim", "42"), JobRef("victim", "41")]))
    assert found[("victim", "42")].attempt == 2 and found[("victim", "41")].attempt == 1
    assert found[("victim", "42")].state is JobState.SUCCEEDED
    assert max(sizes) <= records.MAX_ANSWER_BYTES  # was 64 MiB for each of the 297 fakes
    sizes.clear()
    asyncio.run(records.read(runner(tmp_path, sizes), "c", STATE, [JobRef("victim")]))
    assert max(sizes) <= records.MAX_RECORDS_PER_REF * records.MAX_RECORD_BYTES + 4096


# --------------------------------------------------------------------------- log reads

ROLES = (("main", 0), *(("worker", i) for i in range(12)))


def log_dir(tmp_path: Path, fakes: int = 100_000) -> tuple[Path, dict[str, bytes]]:
    """An attempt directory: the job's real logs (12 workers of 1.5 MiB, more than one round's
    budget together), and what a hostile job made beside them: sparse 1 MiB files under roles
    and indices the job does not have, a symlink to /dev/zero and a FIFO under real names."""
    adir = tmp_path / "attempt-1"
    adir.mkdir()
    real: dict[str, bytes] = {"main-0.stdout": b"hello\nworld\n", "main-0.stderr": b"warn\n"}
    for i in range(12):
        real[f"worker-{i}.stdout"] = b"".join(b"w%d line %07d\n" % (i, k) for k in range(90_000))
    for name, data in real.items():
        (adir / name).write_bytes(data)
    (adir / slogs.LOG_INDEX).write_bytes(b"".join(  # 2.6 MiB: the first read's filtered index is cut
        b"1700000000.%06d %d worker-%d.stdout\n" % (k, (k // 12 + 1) * 20, k % 12) for k in range(60_000)))
    for i in range(fakes):
        with open(adir / f"fake-{i}.stdout", "wb") as f:
            f.truncate(1 << 20)
    for name in ("worker-12.stdout", "worker-01.stdout", "main-0-1.stdout", "main-x.stderr"):
        with open(adir / name, "wb") as f:
            f.truncate(1 << 20)
    os.symlink("/dev/zero", adir / "worker-0.stderr")
    os.mkfifo(adir / "worker-1.stderr")
    return adir, real


def texts(entries: list) -> dict[str, list[str]]:  # noqa: ANN401 - LogEntry
    out: dict[str, list[str]] = {}
    for e in entries:
        out.setdefault(f"{e.role}-{e.replica_index}.{e.stream.name.lower()}", []).append(e.text)
    return out


def read_all(adir: Path, cursor: slogs.LogCursor) -> tuple[list, list[int]]:  # noqa: ANN401
    """The tail's first read and the reads on at once while more is left (``logs.tail``)."""
    entries: list = []
    sizes: list[int] = []
    while True:
        rc, out, err = bash(adir, cursor.read_script(str(adir)))
        assert rc == 0, err
        sizes.append(len(out))
        entries += cursor.feed(slogs.parse_frames(out), ended=True)
        if not cursor.more():
            return entries, sizes


def test_a_log_read_is_bounded_and_reads_only_the_jobs_regular_log_files(tmp_path: Path) -> None:
    """100k sparse ``fake-<i>.stdout`` files (once 100 GiB in one answer), names past the job's
    replicas, a symlink to /dev/zero and a FIFO: each read answers at most a round's budget,
    and the real logs come through whole, once, over as many reads as they take."""
    adir, real = log_dir(tmp_path)
    cursor = slogs.LogCursor(LogQuery(), ROLES)
    entries, sizes = read_all(adir, cursor)
    assert len(sizes) >= 3 and max(sizes) <= slogs.ROUND_BUDGET + slogs.LISTING_BYTES + 4096
    assert texts(entries) == {n: d.decode().splitlines() for n, d in real.items()}
    assert cursor.files[slogs.LOG_INDEX].offset == (adir / slogs.LOG_INDEX).stat().st_size


def test_a_first_read_from_the_last_lines_keeps_each_files_start_past_the_budget(tmp_path: Path) -> None:
    """``tail_lines`` over more than one read: a file the first read's budget did not reach
    is read from its own last lines, not from 0."""
    adir, real = log_dir(tmp_path, fakes=1000)
    entries, sizes = read_all(adir, slogs.LogCursor(LogQuery(tail_lines=80_000), ROLES))
    assert len(sizes) >= 2 and max(sizes) <= slogs.ROUND_BUDGET + slogs.LISTING_BYTES + 4096
    assert texts(entries) == {n: d.decode().splitlines()[-80_000:] for n, d in real.items()}


def test_a_job_adopted_without_its_roles_reads_the_files_its_labels_name(tmp_path: Path) -> None:
    adir, real = log_dir(tmp_path, fakes=1000)
    (adir / "exits").write_text("labels main-0 worker-3\nend worker-3 0 exit\n")
    entries, _ = read_all(adir, slogs.LogCursor(LogQuery()))
    assert texts(entries) == {n: d.decode().splitlines() for n, d in real.items()
                              if n.startswith(("main-0.", "worker-3."))}
    (adir / "exits").write_bytes(b"labels " + b"x" * (4 << 20))  # a line past the bound names nothing
    entries, sizes = read_all(adir, slogs.LogCursor(LogQuery()))
    assert entries == [] and max(sizes) < 1000


def test_a_log_stream_round_is_bounded_and_loses_nothing(tmp_path: Path) -> None:
    """The follower's loop (its input ended: it drains every file and ends): every round
    within the budget, only the job's logs, each line once."""
    adir, real = log_dir(tmp_path, fakes=20_000)
    cursor = slogs.LogCursor(LogQuery(follow=True), ROLES)
    rc, out, err = bash(adir, f"{cursor.stream_script(str(adir), 0.05)} </dev/null")
    assert rc == 0, err
    entries: list = []
    rounds = out.split(f"0 0 0 - {slogs.ROUND_END}\n".encode())
    assert rounds[-1] == f"0 0 0 - {slogs.STREAM_END}\n".encode() and len(rounds) >= 4
    for r in rounds[:-1]:
        assert len(r) <= slogs.ROUND_BUDGET
        entries += cursor.feed(slogs.parse_frames(r))
    entries += cursor.feed([], ended=True)
    assert texts(entries) == {n: d.decode().splitlines() for n, d in real.items()}


class _Proc:
    """A log stream's channel that sends a round larger than any budget."""

    def __init__(self) -> None:
        frame = b"1048576 0 99999999 - worker-0.stdout\n" + b"x" * (1 << 20)
        self.data = frame * 9 + b"0 0 0 - .\n"

    async def readline(self) -> bytes:
        line, _, self.data = self.data.partition(b"\n")
        return line + b"\n"

    async def readexactly(self, n: int) -> bytes:
        out, self.data = self.data[:n], self.data[n:]
        return out

    def end_input(self) -> None:
        pass

    def close(self) -> None:
        pass


def test_a_log_stream_round_past_the_budget_fails_the_stream() -> None:
    class Ssh:
        async def start(self, command: str, **kw: object) -> _Proc:
            return _Proc()

    class Client:
        log_ssh = Ssh()

    async def follow() -> None:
        cursor = slogs.LogCursor(LogQuery(follow=True), ROLES)
        async for _ in slogs._stream(Client(), "adir", cursor, lambda: False, 1.0):  # type: ignore[arg-type]
            pass

    with pytest.raises(BackendUnavailable):
        asyncio.run(follow())


def test_a_capped_log_swapped_for_a_symlink_is_not_read_on_for_ever(tmp_path: Path) -> None:
    adir = tmp_path / "attempt-1"
    adir.mkdir()
    (adir / "main-0.stdout").write_bytes(b"x" * (3 << 20))
    cursor = slogs.LogCursor(LogQuery(), ROLES)
    cursor.feed(slogs.parse_frames(bash(adir, cursor.read_script(str(adir)))[1]))
    assert cursor.more()  # capped at MAX_CHUNK: read on at once
    (adir / "main-0.stdout").unlink()
    os.symlink("/dev/zero", adir / "main-0.stdout")
    rc, out, _ = bash(adir, cursor.read_script(str(adir)))
    assert rc == 0 and cursor.feed(slogs.parse_frames(out)) == [] and not cursor.more()


def test_a_tail_of_a_file_of_one_huge_line_reads_its_last_pieces(tmp_path: Path) -> None:
    """``tail_lines=3`` of a log of one 3 MiB line and a short one: the last three entries (a
    long line comes in pieces, each an entry), read from a window of three pieces at the end,
    not the whole line (2.36 MB came back, every piece past the first read's)."""
    from drivers.common.convert import MAX_LINE_CHARS

    adir = tmp_path / "attempt-1"
    adir.mkdir()
    huge = bytes(range(97, 123)) * (3 * (1 << 20) // 26)
    (adir / "main-0.stdout").write_bytes(huge + b"\nend\n")
    (adir / "main-0.stderr").write_bytes(b"warn " * 300_000 + b"\n" + b"srun: error: x\n")
    entries, sizes = read_all(adir, slogs.LogCursor(LogQuery(tail_lines=3), ROLES))
    got = texts(entries)
    out = got["main-0.stdout"]
    assert len(out) == 3 and out[-1] == "end", [len(t) for t in out]
    assert all(len(t) <= MAX_LINE_CHARS for t in out)
    assert huge.decode().endswith(out[0] + out[1])  # the line's last bytes, in order
    assert sum(sizes) <= 3 * MAX_LINE_CHARS + slogs.SLURM_OWN_TAIL_EXTRA * 1024 \
        + 3 * MAX_LINE_CHARS + 64 * 1024, sizes
    err = got["main-0.stderr"]  # srun's line left out, the program's line's last pieces
    assert 1 <= len(err) <= 3 and all(set(t) <= set("warn ") for t in err), [t[:20] for t in err]
