"""Slurm driver benchmark against a real Slurm behind a real sshd, baselines in the same run.

    .venv/bin/python bench/bench_slurm.py [--poll-interval 1] [--submit-jobs 200] [--strict]

Starts a one-node Slurm (munged, slurmctld, slurmd) and an sshd in a temp dir the way the
tests do (tests.slurm_cluster: needs root and Debian's slurm packages), and the Slurm driver as
a process (tests.harness), then measures, in one run:

- Slurm commands per poll round for 10, 100 and 1,000 tracked jobs. The measured cluster's
  remote PATH puts logging wrappers in front of squeue and scontrol; the driver tracks N jobs
  launched through LaunchJob that stay pending (more CPUs than the node has), and over several
  rounds the bench counts what the login node ran, and slurmctld's own RPC counts (sdiag)
  (target: 1 squeue + <= 1 follow-up per round, whatever N);
- SubmitJob latency: LaunchJob over gRPC, one for one interleaved with a bare ``sbatch
  --parsable`` of the same script on a persistent asyncssh connection (target p50 ratio
  <= 1.2x), and the time for the same jobs against a loop of fresh ``ssh host sbatch`` calls
  (target >= 5x faster for 200 jobs);
- status freshness: each job writes ``time.time()`` just before it exits; the time from that to
  the terminal event on WatchJobObservations (target p99 <= poll interval + 200 ms);
- log follow: 4 followers of a job that prints its clock every 0.2 s for 8 s, on this driver
  (each follower streams on one channel; its remote loop looks every ``--log-stream-interval``,
  0.1 s), on a driver with the previous 0.2 s loop, and on a driver run with
  ``--max-log-streams 0`` (every follower reads by polls), same job: remote commands per
  follower (the drivers' /metrics ``tail`` calls) and line latency (the time the job printed in
  the line -> the line at the client) (target p50 <= 100 ms);
- slurmctld RPCs per second (sdiag) of a cluster with 10 tracked jobs, through the real stack
  (etcd, ClusterManager's health checks every 0.5 s, JobManager's observation stream, the driver)
  over ``--rpc-window`` seconds, next to the driver alone (its poll rounds at 10 tracked jobs)
  (target <= 1 RPC/s in total).

Every job is cancelled and every process stopped at the end; each phase has a deadline and the
whole run is bounded by 5 minutes.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import pathlib
import re
import shlex
import shutil
import sys
import tempfile
import time
import uuid
from collections.abc import Sequence

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import asyncssh  # noqa: E402
import grpc  # noqa: E402

from bench.stats import ms, pct  # noqa: E402
from dlsched.v1 import cluster_manager_service_pb2 as cm_pb  # noqa: E402
from dlsched.v1 import cluster_manager_service_pb2_grpc as cm_grpc  # noqa: E402
from dlsched.v1 import cluster_pb2, driver_service_pb2_grpc, job_pb2  # noqa: E402
from dlsched.v1 import driver_service_pb2 as dpb  # noqa: E402
from dlsched.v1 import job_manager_service_pb2 as jpb  # noqa: E402
from dlsched.v1 import job_manager_service_pb2_grpc as jm_grpc  # noqa: E402
from drivers.slurm.poller import MIN_INTERVAL  # noqa: E402
from tests import security, slurm_cluster  # noqa: E402
from tests.harness import EtcdServer, ServiceProcess, Stack, backend_calls  # noqa: E402

PY = sys.executable
PLAIN = "clusters/bench"
COUNTED = "clusters/bench-count"
TERMINAL = (job_pb2.JOB_STATE_SUCCEEDED, job_pb2.JOB_STATE_FAILED, job_pb2.JOB_STATE_STOPPED)
BOUND_S = 420
#: sdiag message types that are not a client's load: sdiag itself, slurmd's registrations, pings
NOT_LOAD = ("REQUEST_STATS_INFO", "MESSAGE_NODE_REGISTRATION_STATUS", "REQUEST_PING")


def spec(code: str, cpu: float = 1) -> job_pb2.JobSpec:
    return job_pb2.JobSpec(run_mode=job_pb2.RUN_MODE_SINGLE_PROCESS, replica_groups=[
        job_pb2.ReplicaGroup(role="main", replicas=1, command=[PY, "-c", code],
                             resources=job_pb2.Resources(cpu=cpu))])


def pending_spec() -> job_pb2.JobSpec:
    """A job Slurm accepts and never starts (PartitionConfig): tracked, and no load."""
    return spec("print(1)", cpu=64)


class Bench:
    def __init__(self, args: argparse.Namespace, cluster: slurm_cluster.SlurmCluster,
                 stub: driver_service_pb2_grpc.DriverServiceStub, tmp: str) -> None:
        self.args = args
        self.cluster = cluster
        self.stub = stub
        self.tmp = tmp
        self.interval = max(args.poll_interval, MIN_INTERVAL)
        self.run_id = uuid.uuid4().hex[:6]
        self._n = 0

    def new_id(self, kind: str) -> str:
        self._n += 1
        return f"bench-{kind}-{self.run_id}-{self._n}"

    def configure_request(self, name: str, extra: dict[str, str] | None = None) -> dpb.ConfigureClusterRequest:
        c = self.cluster
        return dpb.ConfigureClusterRequest(
            cluster=name, address=c.address, options={**c.options(), **(extra or {})},
            credentials=cluster_pb2.ClusterCredentials(ssh=cluster_pb2.SshCredentials(
                username=c.user, private_key=c.user_key, known_host_keys=[c.host_key_pub])))

    async def launch(self, cluster: str, job_id: str, s: job_pb2.JobSpec) -> dpb.LaunchJobResponse:
        return await self.stub.LaunchJob(dpb.LaunchJobRequest(cluster=cluster, job_id=job_id, spec=s,
                                                              attempt=1), timeout=120)

    async def observe(self, cluster: str, ids: Sequence[str]) -> list[dpb.JobObservation]:
        resp = await self.stub.BatchGetJobObservations(dpb.BatchGetJobObservationsRequest(
            cluster=cluster, jobs=[dpb.JobRef(job_id=j) for j in ids]), timeout=60)
        return list(resp.observations)

    async def wait_polled(self, cluster: str, ids: Sequence[str], within: float) -> None:
        """Until a poll round has answered for every job (its reason is Slurm's, not ours)."""
        deadline = time.monotonic() + within
        while any(o.reason == "Submitted" for o in await self.observe(cluster, ids)):
            if time.monotonic() > deadline:
                raise TimeoutError(f"the driver had not polled {len(ids)} jobs after {within:g}s")
            await asyncio.sleep(0.3)

    # ------------------------------------------------------------------ freshness

    async def freshness(self) -> tuple[list[float], int]:
        """Exit wall time (written by the job) -> terminal event on WatchJobObservations."""
        stamps = self.cluster.path("home", "stamps")
        os.makedirs(stamps, exist_ok=True)
        seen: dict[str, float] = {}
        events: dict[str, asyncio.Event] = {}
        ready = asyncio.Event()

        async def watcher() -> None:
            call = self.stub.WatchJobObservations(dpb.WatchJobObservationsRequest(cluster=PLAIN))
            async for ev in call:
                if ev.snapshot_complete:
                    ready.set()
                elif ev.observation.state in TERMINAL and ev.observation.job_id not in seen:
                    seen[ev.observation.job_id] = time.time()
                    events.setdefault(ev.observation.job_id, asyncio.Event()).set()

        task = asyncio.create_task(watcher())
        samples: list[float] = []
        missed = 0
        sem = asyncio.Semaphore(4)  # the node has 2 CPUs; Slurm shares them (OverSubscribe=FORCE)

        async def one() -> None:
            nonlocal missed
            async with sem:
                jid = self.new_id("fresh")
                stamp = os.path.join(stamps, jid)
                # End at a random point of the poll cycle, then stamp the time and exit.
                code = (f"import random, time\ntime.sleep(random.uniform(0.2, 0.2 + {self.interval}))\n"
                        f"f = open({stamp!r}, 'w')\nf.write(repr(time.time()))\nf.close()\n")
                ev = events.setdefault(jid, asyncio.Event())
                await self.launch(PLAIN, jid, spec(code))
                try:
                    await asyncio.wait_for(ev.wait(), 60)
                    samples.append(seen[jid] - _read_float(stamp))
                except (TimeoutError, OSError, ValueError):
                    missed += 1

        try:
            await asyncio.wait_for(ready.wait(), 30)
            await asyncio.wait_for(asyncio.gather(*(one() for _ in range(self.args.freshness_jobs))), 120)
        finally:
            task.cancel()
            try:
                await task
            except (asyncio.CancelledError, grpc.aio.AioRpcError):
                pass
        return samples, missed

    # ------------------------------------------------------------------ log follow

    async def follow(self, polling: driver_service_pb2_grpc.DriverServiceStub,
                     before: driver_service_pb2_grpc.DriverServiceStub) -> dict[str, tuple[list[float], int]]:
        """The same job followed by 4 streaming, 4 streaming at the previous loop interval and
        4 polling followers: line latencies (the caller reads each driver's ``tail`` count)."""
        jid = self.new_id("follow")
        code = "import time\nfor i in range(40):\n    print(repr(time.time()), flush=True)\n    time.sleep(0.2)"
        backend = (await self.launch(PLAIN, jid, spec(code))).backend_job_id
        for other in (polling, before):
            await other.ConfigureCluster(self.configure_request(PLAIN), timeout=30)

        async def one(stub: driver_service_pb2_grpc.DriverServiceStub) -> list[float]:
            lat: list[float] = []
            req = dpb.TailJobLogsRequest(cluster=PLAIN, job=dpb.JobRef(job_id=jid), follow=True)
            async for resp in stub.TailJobLogs(req, timeout=120):
                now = time.time()
                lat.extend(now - float(e.text) for e in resp.entries if e.text.replace(".", "", 1).isdigit())
            return lat

        for other in (polling, before):  # the other drivers adopt the job by its Slurm id
            await other.BatchGetJobObservations(dpb.BatchGetJobObservationsRequest(
                cluster=PLAIN, jobs=[dpb.JobRef(job_id=jid, backend_job_id=backend)]), timeout=60)
        got = await asyncio.wait_for(asyncio.gather(*(one(self.stub) for _ in range(4)),
                                                    *(one(polling) for _ in range(4)),
                                                    *(one(before) for _ in range(4))), 120)
        stream = [x for xs in got[:4] for x in xs]
        poll = [x for xs in got[4:8] for x in xs]
        old = [x for xs in got[8:] for x in xs]
        return {"stream": (stream, 4), "poll": (poll, 4), "before": (old, 4)}

    # ------------------------------------------------------------------ controller load through the stack

    async def through_stack(self, driver_address: str) -> dict[str, float]:
        """10 tracked jobs submitted through JobManager to the Slurm cluster registered in
        ClusterManager (health checks every 0.5 s): slurmctld's RPCs per second over the window."""
        etcd = EtcdServer().start()
        st = Stack(etcd, f"/bench-slurm-{self.run_id}/")
        try:
            await asyncio.to_thread(st.start)
            assert st.jm is not None
            c = self.cluster
            async with security.channel(st.cm.address) as cch, security.channel(st.jm.address) as jch:
                cm = cm_grpc.ClusterManagerServiceStub(cch)
                jm = jm_grpc.JobManagerServiceStub(jch)
                await cm.CreateCluster(cm_pb.CreateClusterRequest(cluster_id="slurm", cluster=cluster_pb2.Cluster(
                    type=job_pb2.CLUSTER_TYPE_SLURM, address=c.address, driver_address=driver_address,
                    options=c.options(), credentials=cluster_pb2.ClusterCredentials(ssh=cluster_pb2.SshCredentials(
                        username=c.user, private_key=c.user_key, known_host_keys=[c.host_key_pub])))), timeout=30)
                deadline = time.monotonic() + 60
                while (await cm.GetCluster(cm_pb.GetClusterRequest(name="clusters/slurm"), timeout=10)
                       ).cluster.state != cluster_pb2.CLUSTER_STATE_READY:
                    if time.monotonic() > deadline:
                        raise TimeoutError("the Slurm cluster was never READY in ClusterManager")
                    await asyncio.sleep(0.3)
                names = []
                for _ in range(10):  # long sleepers: 8 run (2 CPUs, OverSubscribe=FORCE:4), 2 wait
                    s = spec("import time; time.sleep(3600)", cpu=0.25)
                    s.cluster_selector.cluster = "slurm"
                    names.append((await jm.SubmitJob(jpb.SubmitJobRequest(job_id=self.new_id("stack"), spec=s),
                                                     timeout=60)).job.name)
                deadline = time.monotonic() + 90
                placed = (job_pb2.JOB_STATE_QUEUED, job_pb2.JOB_STATE_RUNNING)
                while [n for n in names
                       if (await jm.GetJob(jpb.GetJobRequest(name=n), timeout=10)).job.state not in placed]:
                    if time.monotonic() > deadline:
                        raise TimeoutError("the stack's jobs never all QUEUED or RUNNING")
                    await asyncio.sleep(0.5)
                await asyncio.sleep(3)  # the jobs' own start-up RPCs are over
                await asyncio.to_thread(self.cluster.run, "sdiag", "--reset")
                start = time.monotonic()
                await asyncio.sleep(self.args.rpc_window)
                sdiag = (await asyncio.to_thread(self.cluster.run, "sdiag")).stdout
                seconds = time.monotonic() - start
                for n in names:
                    await jm.StopJob(jpb.StopJobRequest(name=n), timeout=30)
                await cm.DeleteCluster(cm_pb.DeleteClusterRequest(name="clusters/slurm"), timeout=30)
        finally:
            await asyncio.to_thread(st.stop)
            await asyncio.to_thread(etcd.stop)
        counts = sdiag_counts(sdiag)
        load = {k: v for k, v in counts.items() if k not in NOT_LOAD}
        return {"rpcs": sum(load.values()), "seconds": seconds, "per_s": sum(load.values()) / seconds,
                **{k: float(v) for k, v in load.items()}}

    # ------------------------------------------------------------------ submit latency

    async def submit(self) -> tuple[list[float], list[float], list[float], list[float]]:
        """LaunchJob and a bare sbatch of the same script on one asyncssh connection, one for
        one interleaved (the host's load hits both alike), with a gRPC call that reaches no
        backend as the hop's own cost; then a loop of fresh ssh sbatch."""
        n = self.args.submit_jobs
        c = self.cluster
        env = f"export SLURM_CONF={shlex.quote(c.conf)}; "
        conn = await asyncssh.connect(
            "127.0.0.1", c.ssh_port, username=c.user, client_keys=[asyncssh.import_private_key(c.user_key)],
            known_hosts=([asyncssh.import_public_key(c.host_key_pub)], [], []), agent_path=None, config=[])
        try:
            warm = [self.new_id("warm") for _ in range(5)]
            for jid in warm:
                await self.launch(PLAIN, jid, pending_spec())
                await conn.run(env + "true", check=True)
            await self.wait_polled(PLAIN, warm, 30)  # the steady state: a round has listed the jobs
            scripts = []
            for _ in range(n):
                r = await self.stub.RenderJob(dpb.RenderJobRequest(
                    cluster=PLAIN, job_id=self.new_id("bare"), spec=pending_spec()), timeout=30)
                scripts.append(r.native_spec.content)
            ours: list[float] = []
            bare: list[float] = []
            hop: list[float] = []

            async def driver_one() -> None:
                s = time.perf_counter()
                await self.launch(PLAIN, self.new_id("submit"), pending_spec())
                ours.append(time.perf_counter() - s)

            async def bare_one(script: str) -> None:
                s = time.perf_counter()
                r = await conn.run(env + "sbatch --parsable", input=script, check=False)
                bare.append(time.perf_counter() - s)
                if r.exit_status != 0 or not str(r.stdout).strip().split(";")[0].isdigit():
                    raise RuntimeError(f"bare sbatch failed: {r.stderr!r}")

            for i in range(n):  # alternate which goes first, so neither pays for the other's tail
                if i % 2:
                    await bare_one(scripts[i])
                    await driver_one()
                else:
                    await driver_one()
                    await bare_one(scripts[i])
                s = time.perf_counter()
                await self.observe(PLAIN, ["no-such-job"])
                hop.append(time.perf_counter() - s)
        finally:
            conn.close()
            await conn.wait_closed()

        known = os.path.join(self.tmp, "known_hosts")
        _write(known, f"[127.0.0.1]:{c.ssh_port} {c.host_key_pub}\n")
        key = c.path("ssh", "user_ed25519")
        fresh: list[float] = []
        for i in range(n):
            argv = ["ssh", "-q", "-p", str(c.ssh_port), "-i", key, "-o", "BatchMode=yes",
                    "-o", "IdentitiesOnly=yes", "-o", f"UserKnownHostsFile={known}",
                    "-o", "StrictHostKeyChecking=yes", "-F", "/dev/null", f"{c.user}@127.0.0.1",
                    env + "sbatch --parsable"]
            s = time.perf_counter()
            p = await asyncio.create_subprocess_exec(*argv, stdin=asyncio.subprocess.PIPE,
                                                     stdout=asyncio.subprocess.PIPE,
                                                     stderr=asyncio.subprocess.PIPE)
            out, err = await p.communicate(scripts[i].encode())
            fresh.append(time.perf_counter() - s)
            if p.returncode != 0 or not out.decode().strip().split(";")[0].isdigit():
                raise RuntimeError(f"ssh sbatch failed ({p.returncode}): {err.decode()[:300]}")
        return ours, bare, fresh, hop

    # ------------------------------------------------------------------ commands per round

    async def rounds(self) -> tuple[list[tuple[int, dict[str, float]]], float]:
        """Commands per poll round at 10, 100 and 1,000 tracked jobs (pending, launched
        through the driver, 8 launches at a time); also the launch rate of that burst."""
        calls = os.path.join(self.tmp, "calls.log")
        path = slurm_cluster.command_log_path(os.path.join(self.tmp, "bin"), calls)
        await self.stub.ConfigureCluster(self.configure_request(COUNTED, {"PATH": path}), timeout=30)
        ids: list[str] = []
        results: list[tuple[int, dict[str, float]]] = []
        launch_rate = 0.0
        sem = asyncio.Semaphore(8)

        async def one(jid: str) -> None:
            async with sem:
                await self.launch(COUNTED, jid, pending_spec())

        for n in self.args.tracked:
            new = [self.new_id("track") for _ in range(n - len(ids))]
            t0 = time.perf_counter()
            await asyncio.wait_for(asyncio.gather(*(one(j) for j in new)), 150)
            if new:
                launch_rate = len(new) / (time.perf_counter() - t0)  # the last, largest burst
            ids += new
            await self.wait_polled(COUNTED, ids, 60)
            results.append((n, await self.count_rounds(calls)))
        return results, launch_rate

    async def count_rounds(self, calls: str) -> dict[str, float]:
        """Over ``--rounds`` intervals: every squeue/scontrol the login node ran, per round
        (a round starts with the poller's squeue of all the user's jobs), and slurmctld's
        RPCs from sdiag (reset first; its own calls left out)."""
        await asyncio.to_thread(self.cluster.run, "sdiag", "--reset")
        start = time.time()
        await asyncio.sleep(self.args.rounds * self.interval + 0.3)
        end = time.time()
        sdiag = (await asyncio.to_thread(self.cluster.run, "sdiag")).stdout
        log = [e for e in slurm_cluster.read_command_log(calls) if start <= e[0] <= end]
        starts = [t for t, name, args in log if name == "squeue" and "--name" not in args]
        per_round = [sum(1 for t, _, _ in log if a <= t < b)
                     for a, b in zip(starts, starts[1:] + [end], strict=False)]
        squeue = sum(1 for _, name, _ in log if name == "squeue")
        follow = sum(1 for _, name, args in log if name == "scontrol" and "show job" in args)
        rpcs = sum(v for k, v in sdiag_counts(sdiag).items() if k not in NOT_LOAD)
        r = max(1, len(starts))
        return {"rounds": len(starts), "squeue": squeue / r, "follow": follow / r,
                "other": (len(log) - squeue - follow) / r, "max": max(per_round, default=0),
                "rpcs": rpcs / r, "seconds": end - start, "rpc_s": rpcs / (end - start),
                "gap": (starts[-1] - starts[0]) / (len(starts) - 1) if len(starts) > 1 else float("nan")}


def _tails(svc: ServiceProcess) -> float:
    """Remote log-read commands the driver has issued (its /metrics)."""
    c = backend_calls(svc, "slurm")
    return c.get("tail/ok", 0) + c.get("tail/error", 0)


def _read_float(path: str) -> float:
    with open(path) as f:
        return float(f.read())


def _write(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)


def sdiag_counts(text: str) -> dict[str, int]:
    """``sdiag``'s RPC counts by message type."""
    section = text.partition("by message type")[2].partition("by user")[0]
    return {m.group(1): int(m.group(2)) for m in re.finditer(r"^\s*(\w+)\s+\(\s*\d+\)\s+count:(\d+)",
                                                             section, re.M)}


async def run(args: argparse.Namespace) -> int:
    if why := slurm_cluster.available():
        print(f"error: {why}", file=sys.stderr)
        return 2
    tmp = tempfile.mkdtemp(prefix="dlsched-bench-slurm-")
    cluster = slurm_cluster.SlurmCluster()
    driver: ServiceProcess | None = None
    poller: ServiceProcess | None = None
    before: ServiceProcess | None = None
    try:
        await asyncio.to_thread(cluster.start)
        metrics = ["--metrics-listen", "127.0.0.1:0"]
        driver = ServiceProcess("drivers.slurm", ["--poll-interval", str(args.poll_interval), *metrics],
                                name="slurm-driver").start()
        poller = ServiceProcess("drivers.slurm", ["--poll-interval", str(args.poll_interval),
                                                  "--max-log-streams", "0", *metrics],
                                name="slurm-driver-polling-logs").start()
        before = ServiceProcess("drivers.slurm", ["--poll-interval", str(args.poll_interval),
                                                  "--log-stream-interval", "0.2", *metrics],
                                name="slurm-driver-stream-0.2").start()
        async with security.channel(driver.address) as ch, \
                security.channel(poller.address) as pch, security.channel(before.address) as bch:
            stub = driver_service_pb2_grpc.DriverServiceStub(ch)
            b = Bench(args, cluster, stub, tmp)
            await stub.ConfigureCluster(b.configure_request(PLAIN), timeout=30)
            print(f"slurm up: ssh {cluster.address}, driver {driver.address}", file=sys.stderr)
            tails0 = [_tails(driver), _tails(poller), _tails(before)]
            follow = await b.follow(driver_service_pb2_grpc.DriverServiceStub(pch),
                                    driver_service_pb2_grpc.DriverServiceStub(bch))
            tails = {"stream": _tails(driver) - tails0[0], "poll": _tails(poller) - tails0[1],
                     "before": _tails(before) - tails0[2]}
            for other in (pch, bch):
                await driver_service_pb2_grpc.DriverServiceStub(other).RemoveCluster(
                    dpb.RemoveClusterRequest(cluster=PLAIN), timeout=30)
            print("log follow: done", file=sys.stderr)
            fresh, missed = await b.freshness()
            print(f"freshness: {len(fresh)} samples", file=sys.stderr)
            ours, bare, ssh, hop = await b.submit()
            print("submit latency: done", file=sys.stderr)
            await stub.RemoveCluster(dpb.RemoveClusterRequest(cluster=PLAIN), timeout=30)
            cluster.run("scancel", "--user", cluster.user)  # the submit phase's pending jobs
            counts, launch_rate = await b.rounds()
            await stub.RemoveCluster(dpb.RemoveClusterRequest(cluster=COUNTED), timeout=30)
            cluster.run("scancel", "--user", cluster.user)
            stack = await b.through_stack(driver.address)
            print("controller load through the stack: done", file=sys.stderr)
    finally:
        for svc in (driver, poller, before):
            if svc is not None:
                svc.stop()
                shutil.rmtree(svc.dir, ignore_errors=True)
        await asyncio.to_thread(cluster.stop)  # cancels every job, stops the daemons, removes the dir
        shutil.rmtree(tmp, ignore_errors=True)

    interval = b.interval
    n = args.submit_jobs
    print()
    print(f"dlsched Slurm driver benchmark (poll interval {interval:g} s, {os.cpu_count()} CPUs, "
          "one-node Slurm over sshd on loopback)")
    print()
    print("commands per poll round (login-node wrappers; slurmctld RPCs from sdiag)")
    print(f"{'tracked jobs':<14}{'rounds':>7}{'mean gap':>10}{'squeue':>8}{'follow-up':>11}{'other':>7}"
          f"{'max/round':>11}{'RPCs/round':>12}")
    for tracked, c in counts:
        print(f"{tracked:<14}{c['rounds']:7d}{c['gap']:8.2f} s{c['squeue']:8.2f}{c['follow']:11.2f}"
              f"{c['other']:7.2f}{c['max']:11d}{c['rpcs']:12.2f}")
    print(f"  (launch rate while tracking them, 8 at a time: {launch_rate:.1f} jobs/s)")
    print()
    print(f"{'submit latency, ' + str(n) + ' jobs':<40}{'p50':>11}  {'p99':>11}  {'total':>9}")
    for name, xs in (("bare sbatch, persistent asyncssh", bare), ("LaunchJob over gRPC (driver)", ours),
                     ("fresh `ssh host sbatch` loop", ssh)):
        print(f"{name:<40}{ms(pct(xs, 50))}  {ms(pct(xs, 99))}  {sum(xs):8.2f}s")
    print(f"  (a gRPC call to the driver that reaches no backend: p50 {ms(pct(hop, 50)).strip()};"
          " LaunchJob = that hop + the driver's sbatch)")
    print()
    print(f"{'log follow, 4 followers, 8 s job':<40}{'p50':>11}  {'p99':>11}  {'commands/follower':>18}")
    for name, key in (("streaming, remote loop every 0.1 s", "stream"),
                      ("streaming, every 0.2 s (before)", "before"),
                      ("polling (--max-log-streams 0)", "poll")):
        lat, k = follow[key]
        print(f"{name:<40}{ms(pct(lat, 50))}  {ms(pct(lat, 99))}  {tails[key] / k:18.1f}")
    print("  (latency: the driver's receipt of a line - the time the job printed in it)")
    print()
    driver_alone = next((c for n, c in counts if n == 10), counts[0][1])
    print(f"slurmctld RPCs per second, 10 tracked jobs (sdiag, less {', '.join(NOT_LOAD)})")
    print(f"  driver alone (its poll rounds)               {driver_alone['rpc_s']:6.2f} RPC/s")
    print(f"  through ClusterManager + JobManager + driver {stack['per_s']:6.2f} RPC/s "
          f"({stack['rpcs']:.0f} in {stack['seconds']:.0f} s: "
          + ", ".join(f"{k} {v:.0f}" for k, v in stack.items() if k.startswith(("REQUEST_", "MESSAGE_"))) + ")")
    print()
    ratio = pct(ours, 50) / pct(bare, 50)
    speedup = sum(ssh) / sum(ours)
    checks = [
        ("squeue per round (max over N)", max(c["squeue"] for _, c in counts), "<= 1",
         max(c["squeue"] for _, c in counts) <= 1.0),
        ("follow-ups per round (max over N)", max(c["follow"] for _, c in counts), "<= 1",
         max(c["follow"] for _, c in counts) <= 1.0),
        ("commands in one round (max)", float(max(c["max"] for _, c in counts)), "<= 2",
         max(c["max"] for _, c in counts) <= 2),
        ("seconds between rounds (min of means)", min(c["gap"] for _, c in counts),
         f">= {0.95 * interval:g}", min(c["gap"] for _, c in counts) >= 0.95 * interval),
        ("LaunchJob / bare sbatch, p50", ratio, "<= 1.2x", ratio <= 1.2),
        (f"fresh ssh loop / LaunchJob, {n} jobs", speedup, ">= 5x", speedup >= 5),
        ("status freshness p99 (s)", pct(fresh, 99), f"<= {interval + 0.2:g}",
         bool(fresh) and pct(fresh, 99) <= interval + 0.2),
        ("log follow p50, streaming (s)", pct(follow["stream"][0], 50), "<= 0.1",
         bool(follow["stream"][0]) and pct(follow["stream"][0], 50) <= 0.1),
        ("controller RPC/s, 10 jobs, whole stack", stack["per_s"], "<= 1", stack["per_s"] <= 1.0),
    ]
    print(f"{'target':<40}{'measured':>10}  {'target':>9}  result")
    ok = True
    for name, v, target, met in checks:
        ok = ok and met
        print(f"{name:<40}{v:10.3f}  {target:>9}  {'met' if met else 'MISSED'}")
    print(f"  freshness p50 {ms(pct(fresh, 50)).strip()}, max {ms(max(fresh, default=float('nan'))).strip()}"
          f" (n={len(fresh)}{f', {missed} missed' if missed else ''})")
    print()
    print("all targets met" if ok else "some targets MISSED")
    return 0 if ok or not args.strict else 1


def main() -> None:
    security.install()
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--poll-interval", type=float, default=MIN_INTERVAL,
                   help=f"the driver's --poll-interval (default the floor, {MIN_INTERVAL:g} s)")
    p.add_argument("--submit-jobs", type=int, default=200)
    p.add_argument("--freshness-jobs", type=int, default=30)
    p.add_argument("--tracked", type=int, nargs="+", default=[10, 100, 1000],
                   help="tracked-job counts, ascending (default 10 100 1000)")
    p.add_argument("--rounds", type=int, default=5, help="poll rounds observed per count")
    p.add_argument("--rpc-window", type=float, default=60.0,
                   help="seconds of sdiag counting through the stack (default 60: one capacity look-up)")
    p.add_argument("--strict", action="store_true", help="exit 1 when a target is missed")
    args = p.parse_args()
    try:
        sys.exit(asyncio.run(asyncio.wait_for(run(args), BOUND_S)))
    except TimeoutError:
        print(f"error: the benchmark ran past its {BOUND_S} s bound", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
