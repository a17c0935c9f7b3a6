"""Fault script: kill the services while work is in flight; count what was lost or done twice.

    .venv/bin/python bench/faults.py submit-kill [--jobs 1000] [--kills 10] [--runs 3]
    .venv/bin/python bench/faults.py driver-kill [--outage 120] [--runs 1]
    .venv/bin/python bench/faults.py etcd-outage [--outage 20] [--runs 2]
    .venv/bin/python bench/faults.py service-outage [--outage 20] [--runs 4]

Real processes on this machine (``tests.harness``: etcd, ClusterManager, the
local driver, JobManager; TLS and tokens as in the tests), one fresh etcd
prefix per run. Every job appends its own tag to one file when it runs, so
executions are counted from what really ran, not from the records.

``submit-kill``: ``--jobs`` clients submit at once, each with its own request
id, retrying the same request id (same spec) until it gets an answer; the
JobManager is SIGKILLed ``--kills`` times meanwhile (at random moments, started
again on the same port). Then every job runs to its end. Expected, every run:
exactly ``--jobs`` records, exactly ``--jobs`` executions, 0 lost, 0
duplicated, 0 FAILED.

``driver-kill``: jobs that outlive the outage (run through it), jobs that end
during it (exit 0, exit 3) and jobs with ``max_retries=1``; the local driver is
SIGKILLed, stays down ``--outage`` seconds, and is started again on the same
port and state directory. Expected: after the restart 0 jobs falsely FAILED,
0 ran twice, every record equals the truth (SUCCEEDED / FAILED with exit code
3) within 10 s; the long jobs keep running and then succeed.

``etcd-outage``: three running jobs (one runs through the outage, two end
during it, one of them exit 3); etcd is frozen with SIGSTOP (odd runs) or
SIGKILLed and started again on its data (even runs) for ``--outage`` s. During
it, once a second: GetJob of a running job, and a SubmitJob with a new request
id; after it every such submit is retried with its request id. Expected: every
job ran exactly once and ended as it should, every submit made one job, no
service died; the line reports how many GetJobs answered (from the replica's
cache) and the slowest.

``service-outage``: as ``etcd-outage``, but run N stops one service: the
JobManager, the ClusterManager, the local driver frozen with SIGSTOP (runs 1,
2, 3: connections stay open, nothing answers), the ClusterManager SIGKILLed
and started again on the same address (run 4), then round again. During it,
once a second, a SubmitJob with a new request id (given 2 s); after it every
such submit is retried with its request id. Expected: every job ran exactly
once and ended as it should, every submit made one job, no service died.

Prints one line per run and exits non-zero when any expectation failed.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import os
import pathlib
import random
import signal
import sys
import tempfile
import time
import uuid
from collections.abc import Iterable
from typing import Any

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import grpc  # noqa: E402

from dlsched.client import DlschedRpcError, JobManagerClient, is_terminal  # noqa: E402
from dlsched.v1 import job_pb2  # noqa: E402
from tests import security  # noqa: E402
from tests.harness import EtcdServer, ServiceProcess, Stack, free_port  # noqa: E402

RETRYABLE = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED,
             grpc.StatusCode.UNKNOWN}


def pin_port(svc: ServiceProcess) -> None:
    """Restart on the same address: the last ``--listen`` wins over the harness's ``:0``."""
    svc.args += ["--listen", f"127.0.0.1:{free_port()}"]


def marking(tag: str, marker: str, *, sleep: float = 0.0, code: int = 0) -> job_pb2.JobSpec:
    script = f'sleep {sleep}; printf "%s\\n" "$0" >> "$1"; exit {code}'
    return job_pb2.JobSpec(run_mode=job_pb2.RUN_MODE_SINGLE_PROCESS, replica_groups=[job_pb2.ReplicaGroup(
        role="main", replicas=1, command=["/bin/sh", "-c", script], args=[tag, marker])])


async def submit_until_answered(jm: JobManagerClient, spec: job_pb2.JobSpec, request_id: str) -> str:
    delay = 0.05
    while True:
        try:
            resp = await jm.submit_job(spec, request_id=request_id)
            return str(resp.job.name)
        except DlschedRpcError as e:
            if e.status_code not in RETRYABLE:
                raise
        await asyncio.sleep(delay * (0.5 + random.random()))
        delay = min(1.0, delay * 2)


async def all_jobs(jm: JobManagerClient) -> list[job_pb2.Job]:
    while True:
        try:
            return await jm.list_all_jobs(page_size=500)
        except DlschedRpcError as e:
            if e.status_code not in RETRYABLE:
                raise
            await asyncio.sleep(0.5)


async def wait_all_ended(jm: JobManagerClient, within: float) -> list[job_pb2.Job]:
    deadline = time.monotonic() + within
    while True:
        jobs = await all_jobs(jm)
        if all(is_terminal(j.state) for j in jobs) or time.monotonic() > deadline:
            return jobs
        await asyncio.sleep(1.0)



def print_wrong(wrong: list[str], final: dict[str, job_pb2.Job]) -> None:
    """The first few jobs that ended otherwise than planned, with why."""
    for t in wrong[:3]:
        print(f"  {t}: {job_pb2.JobState.Name(final[t].state)} {final[t].reason} {final[t].message[:200]}")


async def until_running(jm: JobManagerClient, names: Iterable[str], within: float = 60) -> bool:
    """Until every job is RUNNING (bounded); whether they all were."""
    names = list(names)
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if all([(await jm.get_job(n)).state == job_pb2.JOB_STATE_RUNNING for n in names]):
            return True
        await asyncio.sleep(0.5)
    return False

def executions(marker: str) -> collections.Counter[str]:
    try:
        return collections.Counter(pathlib.Path(marker).read_text().split())
    except FileNotFoundError:
        return collections.Counter()


async def submit_kill(etcd: EtcdServer, args: argparse.Namespace, run: int) -> bool:
    stack = Stack(etcd, f"/faults-{uuid.uuid4().hex[:8]}/")
    with stack.running():
        assert stack.jm is not None
        pin_port(stack.jm)
        stack.restart_jm()
        await stack.register_local()
        marker = tempfile.mktemp(prefix="dlsched-faults-", suffix=".runs")
        tags = [f"t{run}-{n:05d}" for n in range(args.jobs)]
        async with JobManagerClient(stack.jm.address) as jm:
            submitting = [asyncio.create_task(submit_until_answered(jm, marking(t, marker), f"req-{t}"))
                          for t in tags]

            async def killer() -> None:
                for _ in range(args.kills):
                    await asyncio.sleep(random.uniform(0.2, args.kill_every))
                    await asyncio.to_thread(stack.restart_jm)

            t0 = time.monotonic()
            kills = asyncio.create_task(killer())
            names = await asyncio.gather(*submitting)
            await kills
            submitted_s = time.monotonic() - t0
            jobs = await wait_all_ended(jm, args.within)
        ran = executions(marker)
        records = len(jobs)
        failed = sum(1 for j in jobs if j.state == job_pb2.JOB_STATE_FAILED)
        unfinished = sum(1 for j in jobs if not is_terminal(j.state))
        lost = sum(1 for t in tags if ran[t] == 0)
        twice = sum(1 for t in tags if ran[t] > 1)
        ok = (records == args.jobs and len(set(names)) == args.jobs and sum(ran.values()) == args.jobs
              and lost == 0 and twice == 0 and failed == 0 and unfinished == 0)
        print(f"submit-kill run {run}: {args.jobs} submits, {args.kills} JobManager kills in {submitted_s:.1f} s; "
              f"records {records} (distinct names {len(set(names))}), executions {sum(ran.values())}, "
              f"lost {lost}, duplicated {twice}, FAILED {failed}, not ended {unfinished}: {'OK' if ok else 'FAIL'}",
              flush=True)
        if not ok:
            for j in jobs:
                if j.state == job_pb2.JOB_STATE_FAILED:
                    print(f"  FAILED {j.name}: {j.reason} {j.message[:200]}")
                    break
        return ok


async def driver_kill(etcd: EtcdServer, args: argparse.Namespace, run: int) -> bool:
    stack = Stack(etcd, f"/faults-{uuid.uuid4().hex[:8]}/")
    pin_port(stack.driver)
    with stack.running():
        assert stack.jm is not None
        await stack.register_local()
        marker = tempfile.mktemp(prefix="dlsched-faults-", suffix=".runs")
        long_s, short_s = args.outage + 30, min(5.0, args.outage / 4)
        plan = ([(f"long-{n}", dict(sleep=long_s), job_pb2.JOB_STATE_SUCCEEDED, 0) for n in range(5)]
                + [(f"ok-{n}", dict(sleep=short_s), job_pb2.JOB_STATE_SUCCEEDED, 0) for n in range(10)]
                + [(f"bad-{n}", dict(sleep=short_s, code=3), job_pb2.JOB_STATE_FAILED, 0) for n in range(5)]
                + [(f"retry-{n}", dict(sleep=short_s), job_pb2.JOB_STATE_SUCCEEDED, 1) for n in range(5)])
        async with JobManagerClient(stack.jm.address) as jm:
            names: dict[str, str] = {}
            for tag, kw, _, retries in plan:
                spec = marking(tag, marker, **kw)
                spec.max_retries = retries
                names[tag] = await submit_until_answered(jm, spec, f"req-{tag}")
            await until_running(jm, names.values())
            stack.driver.kill()
            down = time.monotonic()
            await asyncio.sleep(args.outage)
            during = {t: (await jm.get_job(n)) for t, n in names.items()}
            await asyncio.to_thread(stack.driver.start)
            restarted = time.monotonic()
            truth_s = None
            while time.monotonic() - restarted < 60:
                jobs = {t: await jm.get_job(n) for t, n in names.items()}
                if all(jobs[t].state == want for t, _, want, _ in plan if not t.startswith("long")):
                    truth_s = time.monotonic() - restarted
                    break
                await asyncio.sleep(0.5)
            jobs = {t: await jm.get_job(n) for t, n in names.items()}
            long_running = sum(1 for t in jobs if t.startswith("long") and jobs[t].state == job_pb2.JOB_STATE_RUNNING)
            final = {t: j for t, j in zip(names, await asyncio.gather(*(
                jm.wait_for_job(n, timeout=long_s + 120) for n in names.values())), strict=True)}
        ran = executions(marker)
        falsely_failed = [t for t, _, want, _ in plan if want != job_pb2.JOB_STATE_FAILED
                          and final[t].state == job_pb2.JOB_STATE_FAILED]
        wrong = [t for t, _, want, _ in plan if final[t].state != want]
        twice = [t for t in names if ran[t] > 1]
        unreachable = sum(1 for j in during.values() if "unreachable" in (j.reason + j.message).lower())
        ok = not falsely_failed and not wrong and not twice and truth_s is not None and truth_s <= 10 \
            and long_running == 5
        print(f"driver-kill run {run}: driver down {restarted - down:.0f} s with {len(plan)} jobs; "
              f"records true {truth_s if truth_s is None else round(truth_s, 1)} s after the restart; "
              f"long jobs still running {long_running}/5; falsely FAILED {len(falsely_failed)}, wrong outcome "
              f"{len(wrong)}, ran twice {len(twice)}; records saying the driver is unreachable during the "
              f"outage {unreachable}/{len(plan)}: {'OK' if ok else 'FAIL'}", flush=True)
        print_wrong(wrong, final)
        return ok


def outage_plan(args: argparse.Namespace) -> list[tuple[str, dict[str, Any], int]]:
    """Jobs running when a service goes away: one runs through the outage, two end
    during it (one exit 3). (tag, ``marking`` options, the state it must end in)"""
    short_s = min(3.0, args.outage / 4)
    return [("through", dict(sleep=args.outage + 10), job_pb2.JOB_STATE_SUCCEEDED),
            ("ends-ok", dict(sleep=short_s), job_pb2.JOB_STATE_SUCCEEDED),
            ("ends-bad", dict(sleep=short_s, code=3), job_pb2.JOB_STATE_FAILED)]


async def start_plan(jm: JobManagerClient, marker: str,
                     plan: list[tuple[str, dict[str, Any], int]]) -> dict[str, str]:
    """Submit the plan's jobs and wait until they run; tag -> job name."""
    names = {t: await submit_until_answered(jm, marking(t, marker, **kw), f"req-{t}") for t, kw, _ in plan}
    assert await until_running(jm, names.values()), "the jobs did not start"
    return names


async def finish_plan(stack: Stack, jm: JobManagerClient, marker: str, args: argparse.Namespace,
                      plan: list[tuple[str, dict[str, Any], int]], names: dict[str, str],
                      tried: list[str]) -> tuple[bool, str]:
    """After the outage: every submit tried during it retried with its request id, every
    job waited for; whether all went as planned, and the figures for the run's line."""
    for tag in tried:  # every client retries its request id until answered
        names[tag] = await submit_until_answered(jm, marking(tag, marker), f"req-{tag}")
    ends = await asyncio.gather(*(jm.wait_for_job(n, timeout=args.outage + 180) for n in names.values()),
                                return_exceptions=True)
    final: dict[str, job_pb2.Job] = {}
    for t, end in zip(names, ends, strict=True):
        if isinstance(end, BaseException):  # not ended in time: as it is now
            final[t] = await jm.get_job(names[t])
            print(f"  {t} not ended ({type(end).__name__}): {job_pb2.JobState.Name(final[t].state)} "
                  f"{final[t].reason} {final[t].message[:200]}", flush=True)
            job_id = names[t].rpartition("/")[2]
            for svc in (stack.jm, stack.driver):  # what the services said of it
                if svc is not None:
                    said = [ln for ln in svc.log().splitlines() if job_id in ln or (
                        svc is stack.jm and any(w in ln for w in (" WARNING ", " ERROR ", "owns", "watch")))]
                    print(f"    {svc.name}: " + "\n    ".join(said[-60:]), flush=True)
        else:
            final[t] = end
    ran = executions(marker)
    dead = [p.name for p in (stack.jm, stack.cm, stack.driver) if p is not None and p.proc is not None
            and p.proc.poll() is not None]
    wrong = [t for t, _, want in plan if final[t].state != want]
    wrong += [t for t in tried if final[t].state != job_pb2.JOB_STATE_SUCCEEDED]
    twice = [t for t in names if ran[t] > 1]
    lost = [t for t in names if ran[t] == 0]
    ok = not wrong and not twice and not lost and not dead and len(set(names.values())) == len(names)
    print_wrong(wrong, final)
    return ok, (f"wrong outcome {len(wrong)}, ran twice {len(twice)}, never ran {len(lost)}, "
                f"services dead {dead or 0}: {'OK' if ok else 'FAIL'}")


async def etcd_outage(etcd: EtcdServer, args: argparse.Namespace, run: int) -> bool:
    """etcd frozen (SIGSTOP: connections stay open, nothing answers; odd runs) or killed and
    started again on its data (even runs) for ``--outage`` s, under running jobs."""
    stack = Stack(etcd, f"/faults-{uuid.uuid4().hex[:8]}/")
    frozen = run % 2 == 1
    with stack.running():
        assert stack.jm is not None and etcd.proc is not None
        await stack.register_local()
        marker = tempfile.mktemp(prefix="dlsched-faults-", suffix=".runs")
        plan = outage_plan(args)
        async with JobManagerClient(stack.jm.address, timeout=20) as jm:
            names = await start_plan(jm, marker, plan)
            if frozen:
                etcd.proc.send_signal(signal.SIGSTOP)
            else:
                etcd.proc.kill()
                etcd.proc.wait()
            down = time.monotonic()
            reads, read_ok, slowest, refused, slowest_submit = 0, 0, 0.0, 0, 0.0
            tried: list[str] = []
            while time.monotonic() - down < args.outage:
                t0 = time.monotonic()
                reads += 1
                try:
                    await jm.get_job(names["through"])
                    read_ok += 1
                except DlschedRpcError:
                    pass
                slowest = max(slowest, time.monotonic() - t0)
                tag = f"mid-{len(tried)}"
                tried.append(tag)
                t0 = time.monotonic()
                try:
                    names[tag] = str((await jm.submit_job(marking(tag, marker), request_id=f"req-{tag}")).job.name)
                except DlschedRpcError as e:
                    refused += e.status_code in RETRYABLE
                slowest_submit = max(slowest_submit, time.monotonic() - t0)
                await asyncio.sleep(1.0)
            if frozen:
                etcd.proc.send_signal(signal.SIGCONT)
            else:
                await asyncio.to_thread(etcd.start)
            back = time.monotonic()
            ok, verdict = await finish_plan(stack, jm, marker, args, plan, names, tried)
        print(f"etcd-outage run {run}: etcd {'frozen' if frozen else 'killed'} {back - down:.0f} s under "
              f"{len(plan)} running jobs; GetJob of a cached job answered {read_ok}/{reads} (slowest "
              f"{slowest:.1f} s); {len(tried)} submits during it, {refused} refused retryably (slowest answer "
              f"{slowest_submit:.1f} s), all retried after; {verdict}", flush=True)
        return ok


#: service-outage's runs, in turn: (the service, how it goes away)
OUTAGES = [("jm", "stop"), ("cm", "stop"), ("driver", "stop"), ("cm", "kill")]


async def service_outage(etcd: EtcdServer, args: argparse.Namespace, run: int) -> bool:
    """One service frozen (SIGSTOP) or killed and started again, under running jobs and submits."""
    which, how = OUTAGES[(run - 1) % len(OUTAGES)]
    stack = Stack(etcd, f"/faults-{uuid.uuid4().hex[:8]}/")
    pin_port(stack.cm)
    with stack.running():
        assert stack.jm is not None
        await stack.register_local()
        svc = {"jm": stack.jm, "cm": stack.cm, "driver": stack.driver}[which]
        assert svc.proc is not None
        marker = tempfile.mktemp(prefix="dlsched-faults-", suffix=".runs")
        plan = outage_plan(args)
        async with JobManagerClient(stack.jm.address, timeout=20) as jm:
            names = await start_plan(jm, marker, plan)
            if how == "stop":
                svc.proc.send_signal(signal.SIGSTOP)
            else:
                svc.kill()
            down = time.monotonic()
            tried: list[str] = []
            answers: collections.Counter[str] = collections.Counter()  # OK, a status code, or no answer in 2 s
            while time.monotonic() - down < args.outage:
                tag = f"mid-{len(tried)}"
                tried.append(tag)
                try:
                    names[tag] = str((await asyncio.wait_for(
                        jm.submit_job(marking(tag, marker), request_id=f"req-{tag}"), 2)).job.name)
                    answers["OK"] += 1
                except DlschedRpcError as e:
                    answers[f"{e.code} {e.reason}".strip()] += 1
                except TimeoutError:
                    answers["none in 2 s"] += 1
                await asyncio.sleep(1.0)
            if how == "stop":
                svc.proc.send_signal(signal.SIGCONT)
            else:
                await asyncio.to_thread(svc.start)
            back = time.monotonic()
            ok, verdict = await finish_plan(stack, jm, marker, args, plan, names, tried)
        print(f"service-outage run {run}: {which} {'frozen' if how == 'stop' else 'killed'} {back - down:.0f} s "
              f"under {len(plan)} running jobs; {len(tried)} submits during it ({dict(answers)}), all "
              f"retried after; {verdict}", flush=True)
        return ok


async def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("scenario", choices=("submit-kill", "driver-kill", "etcd-outage", "service-outage"))
    p.add_argument("--jobs", type=int, default=1000)
    p.add_argument("--kills", type=int, default=10)
    p.add_argument("--kill-every", type=float, default=2.0, help="at most this many seconds between kills")
    p.add_argument("--outage", type=float, default=120.0)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--within", type=float, default=600.0, help="seconds for every job to end")
    args = p.parse_args()
    security.install()
    etcd = EtcdServer().start()
    try:
        results = []
        for run in range(1, args.runs + 1):
            fn = {"submit-kill": submit_kill, "driver-kill": driver_kill,
                  "etcd-outage": etcd_outage, "service-outage": service_outage}[args.scenario]
            results.append(await fn(etcd, args, run))
    finally:
        etcd.stop()
    print(f"{sum(results)}/{len(results)} runs OK")
    return 0 if all(results) else 1


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(asyncio.run(main()))
