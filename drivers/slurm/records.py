"""Records of forgotten jobs on the login node (ForgetJobs, issue 18 item 4).

Once JobManager has recorded a job's end, the driver writes the job's end,
each replica's exit and its last usage samples to ``recorded.json`` in the
attempt directory (``write``: one remote command for a batch) and drops it
from memory; observations, logs, usage, terminate and cleanup of a job no
longer tracked read those records first (``read``: one command for all the
refs of a call), so a forgotten job is never tracked again, by this driver
or a restarted one.

What is dropped: the ``TrackedJob`` and its per-job entries (``to_release``,
``held_since``, ``unsure``; a ``late`` window runs out by itself). A ref
without a Slurm id is answered from a record for logs, usage and cleanup
(the newest recorded attempt), not for observations; usage of a recorded
job also asks sacct when the cluster has accounting.
"""

from __future__ import annotations

import json
import logging
import shlex
from collections.abc import Awaitable, Callable, Sequence

from dlsched.errors import DlschedError
from drivers.common.base import JobRef
from drivers.common.registry import BackendUnavailable
from drivers.slurm.jobs import RECORDED, TrackedJob

log = logging.getLogger("drivers.slurm")

Run = Callable[..., Awaitable[tuple[int, str, str]]]

#: the most of one record read: a record takes about 250 bytes per replica (up to 25 MB for the
#: largest job), and the job can write any size over it (its attempt directory is its own)
MAX_RECORD_BYTES = 32 << 20
#: the most read of all the records of one call, whatever the job wrote (attempt directories by
#: the thousand, each with a sparse record): the answer is cut there, a record cut is skipped
MAX_ANSWER_BYTES = 64 << 20
#: the most records read per ref: the newest recorded attempt (or the newest naming the ref's Slurm
#: id), and one more in case the job wrote over that one
MAX_RECORDS_PER_REF = 2
#: how far into a record its Slurm id is looked for (``record`` writes it fifth, after short fields)
_ID_PREFIX = 512

#: Each record goes to a temporary file first and is renamed into place.
_WRITE = ('while IFS= read -r p && IFS= read -r j; do mkdir -p -- "${p%/*}" && '
          'printf \'%s\\n\' "$j" > "$p.tmp" && mv -f -- "$p.tmp" "$p" || exit 1; done')


async def write(run: Run, batch: Sequence[TrackedJob]) -> str | None:
    """Write the records of ``batch``; None when written, else why not."""
    lines = []
    for job in batch:
        lines += [f"{job.dir}/{RECORDED}", json.dumps(job.record(), separators=(",", ":"))]
    try:
        rc, _, err = await run(_WRITE, input="\n".join(lines) + "\n")
    except DlschedError as e:
        return e.message
    return None if rc == 0 else err.strip()[:300]


async def read(run: Run, cluster: str, state_dir: str,
               refs: Sequence[JobRef]) -> dict[tuple[str, str], TrackedJob]:
    """The forgotten jobs among ``refs``, read from their records (one command for all):
    keyed by (job id, the ref's Slurm id); a ref without a Slurm id gets the newest
    recorded attempt."""
    if not refs:
        return {}
    loops = "".join(_read_loop(state_dir, job_id, bid)
                    for job_id, bid in sorted({(r.job_id, r.backend_job_id) for r in refs}))
    # Only a few regular files per ref, newest attempt first, each cut at MAX_RECORD_BYTES and the
    # whole answer at MAX_ANSWER_BYTES: the job can write to its attempt directories.
    rc, out, err = await run(f"{{ {loops}}} | head -c {MAX_ANSWER_BYTES}")
    if rc != 0:
        raise BackendUnavailable(f"cannot read the records of forgotten jobs: {err.strip()[:300]}")
    found: dict[str, list[TrackedJob]] = {}
    seen: set[str] = set()
    for line in out.splitlines():
        path, sep, text = line.partition(f"/{RECORDED}:")
        if not sep or path in seen:
            continue
        seen.add(path)
        try:
            job = TrackedJob.from_record(cluster, path, json.loads(text))
            if f"/{job.job_id}/attempt-{job.attempt}" != path[path.rfind("/", 0, path.rfind("/")):]:
                raise ValueError("it names another job or attempt than its directory")
        except Exception as e:  # noqa: BLE001 - any record a job wrote over: skipped, not the call
            log.warning("unreadable record %s/%s: %.200s", path, RECORDED, e)
            continue
        found.setdefault(job.job_id, []).append(job)
    out_jobs: dict[tuple[str, str], TrackedJob] = {}
    for ref in refs:
        jobs = [j for j in found.get(ref.job_id, ()) if ref.backend_job_id in ("", j.backend_job_id)]
        if jobs:
            out_jobs[(ref.job_id, ref.backend_job_id)] = max(jobs, key=lambda j: j.attempt)
    return out_jobs


def _read_loop(state_dir: str, job_id: str, backend_job_id: str) -> str:
    """The remote loop printing ``<path>:<first line>`` of the newest ``MAX_RECORDS_PER_REF``
    records of ``job_id`` (those naming ``backend_job_id`` when it is set)."""
    d = shlex.quote(f"{state_dir}/{job_id}")
    names = (f"$(ls -1 -- {d} 2>/dev/null | grep -E '^attempt-[0-9]{{1,9}}$' | "
             "LC_ALL=C sort -t- -k2,2nr)")
    pick = ""
    if backend_job_id:
        mark = shlex.quote(f'"backend_job_id":{json.dumps(backend_job_id)},')
        pick = f"head -c {_ID_PREFIX} -- \"$f\" | grep -qF -- {mark} || continue; "
    return (f"n=0; for a in {names}; do f={d}/$a/{RECORDED}; "
            '[ -f "$f" ] && [ ! -L "$f" ] || continue; ' + pick
            + f"printf '%s:' \"$f\"; head -c {MAX_RECORD_BYTES} -- \"$f\" | head -n 1 | tr -d '\\n'; "
            f"printf '\\n'; n=$((n + 1)); [ $n -lt {MAX_RECORDS_PER_REF} ] || break; done; ")
