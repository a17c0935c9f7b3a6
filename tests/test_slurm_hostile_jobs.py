"""What a hostile job writes in its attempt directories cannot take the Slurm driver down: the
remote scripts that read records and logs are run here with bash on a real directory (the
login node's side of the SSH command), and the answer the driver would hold is measured."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
from pathlib import Path

from drivers.common.base import JobRef, JobState
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
