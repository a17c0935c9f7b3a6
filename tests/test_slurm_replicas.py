# ruff: noqa: ASYNC109, ASYNC110, ASYNC230, ASYNC240  -- tests poll real backends, files and /proc
"""Per-replica truth on every backend, and whole MPI lines on Slurm (issue 16 items 2 and 8).

Through the services only (ClusterManager + JobManager over a real etcd), on the
local backend, a real Slurm (tests/slurm_cluster.py, 4 CPUs configured so a
three-process job fits) and a real Ray head: a Master-Worker job whose worker 1
exits 3 is FAILED, its message names ``worker-1`` and code 3, ``Job.replicas``
shows worker/1 FAILED with exit code 3 and the others STOPPED, and no process is
left; a PS-Worker job whose workers succeed SUCCEEDS with its parameter servers
STOPPED, not SUCCEEDED (docs/ENVIRONMENT.md). A backend that cannot run here
skips (Slurm: not root or not installed; Ray: not installed).

MPI on Slurm: ranks writing long lines in pieces, flushing between them, never
share a line in the launcher's log (``steps.mpi_launcher``, ``shell.MPI_MERGE``);
checked in bash with the real Open MPI (fast) and on the real Slurm.
"""

from __future__ import annotations

import asyncio
import os
import pathlib
import re
import shutil
import subprocess
import sys
import textwrap
import time
import uuid
from collections.abc import AsyncIterator, Iterator

import pytest

from dlsched.v1 import cluster_manager_service_pb2 as cm_pb
from dlsched.v1 import cluster_manager_service_pb2_grpc as cm_grpc
from dlsched.v1 import cluster_pb2, job_pb2
from dlsched.v1 import job_manager_service_pb2 as jpb
from dlsched.v1 import job_manager_service_pb2_grpc as jm_grpc
from drivers.common.base import JobSpec, ReplicaGroup, RunMode
from drivers.common.base import JobState as DJobState
from drivers.common.base import ReplicaState as DReplicaState
from drivers.slurm import exits, render, shell
from tests import security, slurm_cluster
from tests.harness import EtcdServer, ServiceProcess, Stack
from tests.through_services import Run, cleanup, wait_dead

S = job_pb2
C = cluster_pb2
PY = sys.executable
ROOT_OK = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}
JOB_TIMEOUT = 180.0
BACKENDS = ["local", "slurm", "ray"]


# --------------------------------------------------------------------------- the exits file, parsed and mapped


def test_exits_name_the_first_failure_and_stop_the_rest():
    ex = exits.parse("labels master-0 worker-0 worker-1\nend worker-1 3 exit\nend master-0 143 stop\n"
                     "end worker-0 143 stop\nend worker-0 9 stop\nend bad line\n")
    reps, failure = exits.replicas(ex, [("master", 0), ("worker", 0), ("worker", 1)], DJobState.FAILED, "n1")
    assert failure == exits.End("worker-1", 3, False)
    assert [(r.role, r.index, r.state, r.exit_code) for r in reps] == [
        ("master", 0, DReplicaState.STOPPED, 143), ("worker", 0, DReplicaState.STOPPED, 143),
        ("worker", 1, DReplicaState.FAILED, 3)]
    # Cancelled (STOPPED): a non-zero exit heard of before the decision is no failure of the job.
    reps, failure = exits.replicas(ex, [], DJobState.STOPPED, "n1")  # adopted: labels name the replicas
    assert failure is None and {r.state for r in reps} == {DReplicaState.STOPPED} and len(reps) == 3
    ok = exits.parse("labels ps-0 worker-0\nend worker-0 0 exit\nend ps-0 143 stop\n")
    reps, failure = exits.replicas(ok, [("ps", 0), ("worker", 0)], DJobState.SUCCEEDED, "")
    assert failure is None
    assert [(r.state, r.exit_code) for r in reps] == [(DReplicaState.STOPPED, 143), (DReplicaState.SUCCEEDED, 0)]
    assert exits.parse("") is None  # no file: the script never ran (or wrote none), not "all stopped"


def test_a_hostile_exits_file_is_read_bounded_and_only_its_well_formed_lines_count(tmp_path):
    """The job's processes can write to the exits file: non-ASCII digits (``str.isdigit`` takes
    '²', ``int`` refuses it), labels that are no label, repeats and any size are what a hostile
    job writes; the parse never raises, keeps each label once, and the read takes a bounded head."""
    ex = exits.parse("labels a-0 a-0 ../x b-1 $(id)-2 " + "c-9999999 " + "\n"
                     "hosts w-0 w-0 ;rm-1 W-2\n"
                     "end a-0 ² exit\nend a-0 1234 exit\nend ../x 1 exit\nend a-0 7 exit\nend a-0 0 stop\n")
    assert ex is not None and ex.labels == ("a-0", "b-1", "c-9999999") and ex.hosts == ("w-0",)
    assert ex.ends == (exits.End("a-0", 7, False),)
    big = tmp_path / "d"
    big.mkdir()
    (big / shell.EXITS).write_bytes(b"labels a-0\n" + b"x" * (exits.MAX_BYTES + 4096))
    out = subprocess.run(["sh", "-c", exits.read_command(str(big))], capture_output=True, timeout=60).stdout
    assert len(out) == exits.MAX_BYTES and exits.parse(out.decode()) is not None
    assert subprocess.run(["sh", "-c", exits.read_command(str(tmp_path / "none"))], capture_output=True,
                          timeout=60).stdout == b""  # no file: nothing, not an error


def test_tracked_job_holds_its_end_until_the_exits_are_read():
    from drivers.slurm.jobs import TrackedJob
    from drivers.slurm.poller import SlurmJob

    job = TrackedJob("c", "j", 1, "7", "d", None, roles=(("master", 0), ("worker", 0), ("worker", 1)))
    job.apply(SlurmJob("7", "RUNNING"))
    job.apply(SlurmJob("7", "FAILED", exit_status=3))
    assert job.needs_exits and job.state is DJobState.RUNNING  # the end is not reported yet
    assert job.exits_read(exits.parse("labels master-0 worker-0 worker-1\nend worker-1 3 exit\n"
                                      "end master-0 15 stop\nend worker-0 15 stop\n"))
    obs = job.observation(None)
    assert (obs.state, obs.reason, obs.exit_code) == (DJobState.FAILED, "NonZeroExit", 3)
    assert obs.message == "worker-1 exited with code 3"
    assert {(r.role, r.index): r.state for r in obs.replicas} == {
        ("master", 0): DReplicaState.STOPPED, ("worker", 0): DReplicaState.STOPPED,
        ("worker", 1): DReplicaState.FAILED}
    unread = TrackedJob("c", "k", 1, "8", "d", None, roles=(("main", 0),))
    unread.apply(SlurmJob("8", "COMPLETED", exit_status=0, nodes="n1"))
    assert not any(unread.exits_read(None) for _ in range(exits.MAX_READS - 1))
    assert unread.exits_read(None) and unread.state is DJobState.SUCCEEDED  # reported without the file
    assert [r.state for r in unread.observation(None).replicas] == [DReplicaState.SUCCEEDED]
    never = TrackedJob("c", "q", 1, "9", "d", None, roles=(("main", 0),))
    never.apply(SlurmJob("9", "CANCELLED", reason="None"))  # cancelled while queued: never ran, no file
    assert never.exits_read(None) and never.state is DJobState.STOPPED  # reported at the first read
    assert [r.state for r in never.observation(None).replicas] == [DReplicaState.STOPPED]


# --------------------------------------------------------------------------- the batch script, run by bash

FAKE_SRUN = """#!/bin/bash
while [ $# -gt 0 ]; do case "$1" in --) shift; break ;; esac; shift; done
exec "$@"
"""


def sandbox_run(tmp: pathlib.Path, out: render.SlurmScript, node: str = "node-a",
                srun: str = FAKE_SRUN) -> subprocess.CompletedProcess[str]:
    """The script under bash with ``srun`` running its program here and ``scontrol`` naming ``node``."""
    bindir = tmp / "bin"
    bindir.mkdir(exist_ok=True)
    for name, body in (("srun", srun), ("scontrol", f"#!/bin/sh\necho {node}\n")):
        (bindir / name).write_text(body)
        (bindir / name).chmod(0o755)
    env = {"PATH": f"{bindir}:{os.environ['PATH']}", "SLURM_JOB_NODELIST": node, "HOME": str(tmp),
           "SLURM_JOB_ID": "77"}
    return subprocess.run(["bash", "-s"], input=out.script, cwd=tmp, env=env, text=True, capture_output=True,
                          timeout=120)


def g(role: str, code: str, replicas: int = 1, ppr: int = 0, **env: str) -> ReplicaGroup:
    return ReplicaGroup(role=role, replicas=replicas, processes_per_replica=ppr, command=(PY, "-c", code),
                        env=env)


def test_the_script_records_the_deciding_failure_and_the_stopped(tmp_path):
    spec = JobSpec(RunMode.MASTER_WORKER, (
        g("master", "import time; time.sleep(60)"),
        g("worker", "import os, sys, time; time.sleep(0.5)\n"
                    "if os.environ['DLSCHED_REPLICA_INDEX'] == '1': sys.exit(3)\ntime.sleep(60)", replicas=2)))
    out = render.render_job("mw-1", spec, 1, {"max_nodes": "1"})
    res = sandbox_run(tmp_path, out)
    assert res.returncode == 3, res.stderr
    ex = exits.parse((tmp_path / out.dir / shell.EXITS).read_text())
    assert ex.labels == ("master-0", "worker-0", "worker-1")
    assert ex.ends[0] == exits.End("worker-1", 3, False) and ex.first_failure() == ex.ends[0]
    assert sorted(e.label for e in ex.ends[1:]) == ["master-0", "worker-0"] and all(e.stopped for e in ex.ends[1:])


def test_the_script_records_ps_tasks_stopped_after_the_workers_succeed(tmp_path):
    spec = JobSpec(RunMode.PS_WORKER, (g("ps", "import time; time.sleep(60)"),
                                       g("worker", "import time; time.sleep(0.3)", replicas=2)))
    out = render.render_job("ps-1", spec, 1, {"max_nodes": "1"})
    res = sandbox_run(tmp_path, out, srun=_MULTI_PROG_SRUN)
    assert res.returncode == 0, res.stderr
    ex = exits.parse((tmp_path / out.dir / shell.EXITS).read_text())
    by = {e.label: e for e in ex.ends}
    assert (by["worker-0"].status, by["worker-0"].stopped) == (0, False)
    assert (by["worker-1"].status, by["worker-1"].stopped) == (0, False)
    assert by["ps-0"].stopped and by["ps-0"].status != 0


# srun --multi-prog: this sandbox's conf is one line, '* <command with %t>'; task t runs it with %t = t.
_MULTI_PROG_SRUN = """#!/bin/bash
n=1 conf=""
while [ $# -gt 0 ]; do
  case "$1" in --ntasks=*) n=${1#--ntasks=} ;; --multi-prog) conf=$2; shift ;; --) shift; break ;; esac
  shift
done
[ -n "$conf" ] || exec "$@"
read -r -a words <"$conf"
args=("${words[@]:1}")
pids=()
# as slurmstepd signals every process of the step: each task a process group, each group signalled
trap 'for p in "${pids[@]}"; do kill -TERM -- "-$p" 2>/dev/null; done' TERM
for ((t = 0; t < n; t++)); do SLURM_PROCID=$t setsid "${args[@]//%t/$t}" & pids+=($!); done
rc=0
for p in "${pids[@]}"; do
  while :; do wait "$p"; s=$?; kill -0 "$p" 2>/dev/null || break; done
  [ "$s" = 0 ] || rc=$s
done
exit "$rc"
"""

#: Each MPI rank writes LINES lines of ``rank <r> line <i> <x * WIDTH>`` in four pieces, flushing after
#: each (and a piece of stderr between), so two ranks' pieces meet in any output they share.
LINES, WIDTH = 150, 3000
WRITER = textwrap.dedent(f"""
import os, sys, time
r = os.environ["OMPI_COMM_WORLD_RANK"]
for i in range({LINES}):
    for piece in (f"rank {{r}}", f" line {{i}} ", "x" * {WIDTH}, "\\n"):
        sys.stdout.write(piece)
        sys.stdout.flush()
        sys.stderr.write(f"e{{r}}-")
        sys.stderr.flush()
        time.sleep(0.001)
    sys.stderr.write("\\n")
sys.stdout.write(f"rank {{r}} last")  # no newline: the merger ends it
""")
LINE_RE = re.compile(rf"rank ([01]) line (\d+) x{{{WIDTH}}}")


def assert_whole_lines(lines: list[str]) -> None:
    """Every line one rank's whole line; every line of each rank once, in its order."""
    bad = [ln[:80] for ln in lines if not LINE_RE.fullmatch(ln) and ln not in ("rank 0 last", "rank 1 last")]
    assert not bad, f"{len(bad)} broken lines, e.g. {bad[:3]}"
    for r in "01":
        seen = [int(m.group(2)) for ln in lines if (m := LINE_RE.fullmatch(ln)) and m.group(1) == r]
        assert seen == list(range(LINES)), f"rank {r}: {len(seen)} lines"
    assert sorted(ln for ln in lines if ln.endswith("last")) == ["rank 0 last", "rank 1 last"]


@pytest.mark.skipif(shutil.which("mpirun") is None, reason="mpirun is not installed")
def test_mpi_ranks_lines_stay_whole_with_the_real_open_mpi(tmp_path):
    """With a working directory of its own, too: mpirun runs there, and the hostfile and the
    output directory are absolute paths (the default state dir is relative to the submit dir)."""
    wd = tmp_path / "work dir"
    wd.mkdir()
    launcher = ReplicaGroup(role="launcher", replicas=1, command=(PY, "-c", WRITER), env=ROOT_OK, working_dir=str(wd))
    spec = JobSpec(RunMode.MPI, (launcher, g("worker", "", ppr=2)))
    out = render.render_job("mpi-1", spec, 1, {"max_nodes": "1"})
    res = sandbox_run(tmp_path, out, node="localhost")
    assert res.returncode == 0, res.stderr + (tmp_path / out.dir / "launcher-0.stderr").read_text()[-2000:]
    assert_whole_lines((tmp_path / out.dir / "launcher-0.stdout").read_text().splitlines())
    err = (tmp_path / out.dir / "launcher-0.stderr").read_text().splitlines()
    assert sorted(set(err)) == ["e0-e0-e0-e0-", "e1-e1-e1-e1-"] and len(err) == 2 * LINES
    assert exits.parse((tmp_path / out.dir / shell.EXITS).read_text()).ends == (exits.End("launcher-0", 0, False),)


@pytest.mark.skipif(shutil.which("mpirun") is None, reason="mpirun is not installed")
def test_the_users_path_does_not_pick_the_mpirun_that_runs(tmp_path):
    """The launcher's mpirun is the one the cluster's PATH finds: a user's PATH that puts an
    ``mpirun`` of its own first reaches the ranks, not the launch (a hostile corpus's canary)."""
    fake = tmp_path / "fake"
    fake.mkdir()
    canary = tmp_path / "canary"
    (fake / "mpirun").write_text(f"#!/bin/sh\ntouch {canary}\nexit 0\n")
    (fake / "mpirun").chmod(0o755)
    code = "import os; print('rank', os.environ['OMPI_COMM_WORLD_RANK'], flush=True)"
    launcher = ReplicaGroup(role="launcher", replicas=1, command=(PY, "-c", code),
                            env={**ROOT_OK, "PATH": f"{fake}:{os.environ['PATH']}"})
    spec = JobSpec(RunMode.MPI, (launcher, g("worker", "", ppr=2)))
    out = render.render_job("mpi-2", spec, 1, {"max_nodes": "1"})
    res = sandbox_run(tmp_path, out, node="localhost")
    assert res.returncode == 0, res.stderr + (tmp_path / out.dir / "launcher-0.stderr").read_text()[-2000:]
    assert not canary.exists()
    assert sorted((tmp_path / out.dir / "launcher-0.stdout").read_text().split("\n")[:2]) == ["rank 0", "rank 1"]


@pytest.mark.skipif(shutil.which("mpirun") is None, reason="mpirun is not installed")
def test_the_ranks_get_the_users_library_path_and_path_as_given(tmp_path):
    """mpirun run by its absolute path means ``--prefix`` to Open MPI, which put its prefix's
    lib/ and bin/ before the user's LD_LIBRARY_PATH and PATH in every rank (a hostile corpus saw
    ``/usr/lib:`` prepended): ``--noprefix``, as the local driver runs it."""
    code = ("import os; print('rank', os.environ['OMPI_COMM_WORLD_RANK'], repr(os.environ.get('LD_LIBRARY_PATH')),"
            " repr(os.environ['PATH']), flush=True)")
    path = f"/opt/mine/bin:{os.environ['PATH']}"
    launcher = ReplicaGroup(role="launcher", replicas=1, command=(PY, "-c", code),
                            env={**ROOT_OK, "LD_LIBRARY_PATH": "/opt/mine/lib", "PATH": path})
    spec = JobSpec(RunMode.MPI, (launcher, g("worker", "", ppr=2)))
    out = render.render_job("mpi-3", spec, 1, {"max_nodes": "1"})
    res = sandbox_run(tmp_path, out, node="localhost")
    assert res.returncode == 0, res.stderr + (tmp_path / out.dir / "launcher-0.stderr").read_text()[-2000:]
    lines = sorted((tmp_path / out.dir / "launcher-0.stdout").read_text().splitlines())
    assert lines == [f"rank {r} '/opt/mine/lib' {path!r}" for r in "01"], lines


def test_an_mpi_job_adopted_without_its_record_reports_its_worker_replicas(tmp_path):
    """The MPI workers run no process of their own, so the exits file's ``labels`` miss them; its
    ``hosts`` line names them, and a job the driver adopts without its record (roles unknown)
    reports them with the job's end, as a tracked one does."""
    from drivers.slurm.jobs import TrackedJob
    from drivers.slurm.poller import SlurmJob

    launcher = ReplicaGroup(role="launcher", replicas=1, command=(PY, "-c", "print('ok')"), env=ROOT_OK)
    spec = JobSpec(RunMode.MPI, (launcher, g("worker", "", replicas=2, ppr=1)))
    out = render.render_job("mpi-2", spec, 1, {"max_nodes": "1"})
    if shutil.which("mpirun") is None:
        pytest.skip("mpirun is not installed")
    res = sandbox_run(tmp_path, out, node="localhost")
    assert res.returncode == 0, res.stderr
    ex = exits.parse((tmp_path / out.dir / shell.EXITS).read_text())
    assert ex is not None and ex.labels == ("launcher-0",) and ex.hosts == ("worker-0", "worker-1")
    tracked = TrackedJob("c", "mpi-2", 1, "7", "d", None, roles=(("launcher", 0),), hosts=out.hosts)
    adopted = TrackedJob("c", "mpi-2", 1, "7", "d", None)  # after a restart, found by its comment alone
    for job in (tracked, adopted):
        job.apply(SlurmJob("7", "RUNNING", nodes="n1"))
        job.apply(SlurmJob("7", "COMPLETED", exit_status=0, nodes="n1"))
        assert job.exits_read(ex)
        assert {(r.role, r.index): r.state for r in job.observation(None).replicas} == {
            ("launcher", 0): DReplicaState.SUCCEEDED, ("worker", 0): DReplicaState.SUCCEEDED,
            ("worker", 1): DReplicaState.SUCCEEDED}
        recalled = TrackedJob.from_record("c", "d", job.record())  # after one more restart, from the record
        assert recalled.observation(None).replicas == job.observation(None).replicas


def test_merge_keeps_partial_lines_until_their_newline(tmp_path):
    """``shell.MPI_MERGE`` alone: two writers appending pieces to their own files; one line per line."""
    d = tmp_path / "a"
    for r in (0, 1):
        (d / "mpi" / "1" / f"rank.{r}").mkdir(parents=True)
    writer = ('for i in $(seq 0 199); do for p in "rank $R" " line $i " "$X" $\'\\n\'; do '
              'printf %s "$p" >>"$F"; sleep 0.001; done; done')
    script = "\n".join([
        "set -u", f"DLSCHED_DIR={d}", shell.MPI_MERGE,
        "dlsched_merge stdout >out.txt &", "m=$!",
        *[f'R={r} X=$(printf "%0{WIDTH}d" 0 | tr 0 x) F={d}/mpi/1/rank.{r}/stdout bash -c {_q(writer)} &'
          for r in (0, 1)],
        "wait %2 %3", ': >"$DLSCHED_DIR/mpi.done"', 'wait "$m"'])
    subprocess.run(["bash", "-c", script], cwd=tmp_path, check=True, timeout=120)
    lines = (tmp_path / "out.txt").read_text().splitlines()
    assert len(lines) == 400 and all(LINE_RE.fullmatch(ln) for ln in lines), [ln[:40] for ln in lines[:4]]


@pytest.mark.parametrize("inherited", [0, 30])
def test_merge_loses_no_rank_when_there_are_more_ranks_than_descriptors(tmp_path, inherited):
    """``shell.MPI_MERGE`` with ``ulimit -n 64`` (soft and hard: it cannot raise it), 40 ranks
    writing at once, and ``inherited`` descriptors open when it starts (fds 3-9 among them): some
    files kept open, the rest read by offset each pass; every line of every rank once, whole, in
    its rank's order, and each rank's last line without a newline too."""
    d = tmp_path / "a"
    ranks = 40
    for r in range(ranks):
        (d / "mpi" / "1" / f"rank.{r}").mkdir(parents=True)
    writer = ('for i in $(seq 0 49); do for p in "rank $R" " line $i" $\'\\n\'; do '
              'printf %s "$p" >>"$F"; done; sleep 0.002; done; printf %s "rank $R end" >>"$F"')
    script = "\n".join([
        "set -u", f"DLSCHED_DIR={d}", shell.MPI_MERGE, "ulimit -n 64",
        *(["exec 3</dev/null 4</dev/null 5</dev/null 6</dev/null 7</dev/null 8</dev/null 9</dev/null",
            f"for i in $(seq 8 {inherited}); do exec {{x}}</dev/null; done"] if inherited else []),
        "dlsched_merge stdout >out.txt 2>err.txt &", "m=$!",
        *[f"R={r} F={d}/mpi/1/rank.{r}/stdout bash -c {_q(writer)} &" for r in range(ranks)],
        "for p in $(jobs -p); do [ \"$p\" = \"$m\" ] || wait \"$p\"; done",
        ': >"$DLSCHED_DIR/mpi.done"', 'wait "$m"'])
    subprocess.run(["bash", "-c", script], cwd=tmp_path, check=True, timeout=300)
    assert (tmp_path / "err.txt").read_text() == ""
    lines = (tmp_path / "out.txt").read_text().splitlines()
    per_rank: dict[int, list[str]] = {}
    for ln in lines:
        m = re.fullmatch(r"rank (\d+) (line \d+|end)", ln)
        assert m, ln[:80]
        per_rank.setdefault(int(m[1]), []).append(m[2])
    assert per_rank == {r: [*(f"line {i}" for i in range(50)), "end"] for r in range(ranks)}


def _q(s: str) -> str:
    return shell.sh_quote(s)


# --------------------------------------------------------------------------- the port range option


def test_port_range_option_is_validated_and_rendered():
    spec = JobSpec(RunMode.MASTER_WORKER, (g("master", ""), g("worker", "")))
    script = render.render_job("pr-1", spec, 1, {"port_range": "20000-29999"}).script
    assert "dlsched_port_next=$(( (${SLURM_JOB_ID:-0} * 8) % 10000 ))" in script
    assert "p=$(( 20000 + dlsched_port_next ))" in script and "no free port in 20000-29999" in script
    assert render.port_range_of({}) == (render.PORT_LO, render.PORT_LO + render.PORT_SPAN - 1)
    for bad in ("20000-29999\n", "1000-2000", "30000-20000", "60000-70000", "20000-20006", "a-b", " 1-2",
                "20000", "20000-29999-1"):
        with pytest.raises(render.InvalidArgument) as e:
            render.render_job("pr-1", spec, 1, {"port_range": bad})
        assert [v.field for v in e.value.violations] == ["cluster.options[port_range]"], bad


def test_a_cluster_with_bad_options_is_refused_at_configure():
    from drivers.common.base import ClusterConfig, SshCredentials
    from drivers.slurm.driver import SlurmDriver

    def config(port_range: str) -> ClusterConfig:
        return ClusterConfig("clusters/s", "login:22", {"port_range": port_range}, SshCredentials("u", "k"))

    SlurmDriver()._validate_config(config("20000-29999"))
    with pytest.raises(render.InvalidArgument) as e:
        SlurmDriver()._validate_config(config("20000-99999"))
    assert [v.field for v in e.value.violations] == ["cluster.options[port_range]"]
    # Every option a launch reads (the cluster was READY and every launch refused).
    for key, value in (("partition", "a\n#SBATCH --wrap=id"), ("partition", "gpu;x"), ("max_nodes", "0"),
                       ("max_nodes", "²"), ("state_dir", "../../etc")):
        cfg = ClusterConfig("clusters/s", "login:22", {key: value}, SshCredentials("u", "k"))
        with pytest.raises(render.InvalidArgument) as e:
            SlurmDriver()._validate_config(cfg)
        assert [v.field for v in e.value.violations] == [f"cluster.options[{key}]"], (key, value)
    SlurmDriver()._validate_config(ClusterConfig("clusters/s", "login:22", {"partition": "gpu,cpu", "max_nodes": "4"},
                                                 SshCredentials("u", "k")))


# --------------------------------------------------------------------------- through the services


@pytest.fixture(scope="module")
def stack(etcd: EtcdServer) -> Iterator[Stack]:
    st = Stack(etcd, f"/dlsched-replicas-{uuid.uuid4().hex[:8]}/", jm_args=["--stop-grace-seconds", "2"])
    with st.running():
        register(st, "local", C.Cluster(type=S.CLUSTER_TYPE_LOCAL, driver_address=st.driver.address))
        yield st


def register(st: Stack, cluster_id: str, cluster: C.Cluster) -> str:
    with security.sync_channel(st.cm.address) as ch:
        cm = cm_grpc.ClusterManagerServiceStub(ch)
        cm.CreateCluster(cm_pb.CreateClusterRequest(cluster_id=cluster_id, cluster=cluster,
                                                    request_id=f"register-{cluster_id}-{uuid.uuid4().hex[:8]}"),
                         timeout=30)
        deadline = time.monotonic() + 240  # a Ray head on a loaded 2-core machine is slow to answer
        while (c := cm.GetCluster(cm_pb.GetClusterRequest(name=f"clusters/{cluster_id}"),
                                  timeout=10).cluster).state != C.CLUSTER_STATE_READY:
            assert time.monotonic() < deadline, f"clusters/{cluster_id} never READY: {c}"
            time.sleep(0.3)
    return cluster_id


@pytest.fixture(scope="module")
def slurm(stack: Stack) -> Iterator[slurm_cluster.SlurmCluster]:
    if why := slurm_cluster.available():
        pytest.skip(why)
    pytest.importorskip("asyncssh")
    c = slurm_cluster.SlurmCluster(cpus=4).start()
    svc = ServiceProcess("drivers.slurm", ["--poll-interval", "0.3", "--command-timeout", "10"],
                         name="slurm-driver-replicas")
    try:
        svc.start()
        creds = C.ClusterCredentials(ssh=C.SshCredentials(username=c.user, private_key=c.user_key,
                                                          known_host_keys=[c.host_key_pub]))
        register(stack, "slurm", C.Cluster(type=S.CLUSTER_TYPE_SLURM, address=c.address, credentials=creds,
                                           driver_address=svc.address, options=c.options()))
        yield c
    finally:
        svc.stop()
        c.stop()


@pytest.fixture(scope="module")
def ray(stack: Stack) -> Iterator[str]:
    from tests.ray_head import started_driver, started_head

    pytest.importorskip("aiohttp")
    for head in started_head(os.environ.get("CI") == "true"):
        for svc in started_driver("ray-driver-replicas"):
            yield register(stack, "ray", C.Cluster(type=S.CLUSTER_TYPE_RAY, address=head.address,
                                                   driver_address=svc.address, options={"python": PY}))


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest) -> str:
    if request.param != "local":
        request.getfixturevalue(request.param)
    return str(request.param)


@pytest.fixture
async def jm(stack: Stack) -> AsyncIterator[jm_grpc.JobManagerServiceStub]:
    assert stack.jm is not None
    async with security.channel(stack.jm.address) as ch:
        yield jm_grpc.JobManagerServiceStub(ch)


@pytest.fixture
async def runs(jm: jm_grpc.JobManagerServiceStub) -> AsyncIterator[list[Run]]:
    made: list[Run] = []
    yield made
    await cleanup(jm, made)


async def run_on(jm: jm_grpc.JobManagerServiceStub, runs: list[Run], backend: str, mode: int,
                 *groups: S.ReplicaGroup) -> S.Job:
    spec = S.JobSpec(run_mode=mode, replica_groups=list(groups), cluster_selector=S.ClusterSelector(cluster=backend))
    r = Run(jm, spec, prefix="replicas", cluster=f"clusters/{backend}", job_timeout=JOB_TIMEOUT)
    runs.append(r)
    await r.submit()
    return await r.until()


#: Every process writes its pid to <out>/<role>-<index>.pid, waits until ``PIDS`` processes have, then
#: exits with ``EXIT_<ROLE>_<INDEX>`` if set, else runs until it is stopped. A SIGTERM is recorded in
#: <out>/<role>-<index>.term (then it exits 143, as the signal would have ended it, unless IGNORE_TERM).
PROCESS = """
import os, pathlib, signal, sys, time
out = pathlib.Path(sys.argv[1])
me = f"{os.environ['DLSCHED_ROLE']}-{os.environ['DLSCHED_REPLICA_INDEX']}"
def term(*_):
    (out / f"{me}.term").write_text("TERM")
    if not os.environ.get("IGNORE_TERM"):
        sys.exit(143)
signal.signal(signal.SIGTERM, term)
(out / f"{me}.pid").write_text(str(os.getpid()))
deadline = time.time() + 120
while len(list(out.glob("*.pid"))) < int(os.environ["PIDS"]) and time.time() < deadline:
    time.sleep(0.1)
code = os.environ.get(f"EXIT_{me.replace('-', '_').upper()}")
if code is not None:
    time.sleep(float(os.environ.get("EXIT_AFTER", "0")))
    sys.exit(int(code))
while True:
    time.sleep(1)
"""


def proc(role: str, out: pathlib.Path, replicas: int = 1, **env: str) -> S.ReplicaGroup:
    return S.ReplicaGroup(role=role, replicas=replicas, command=[PY, "-u", "-c", textwrap.dedent(PROCESS), str(out)],
                          env=env)


def by_replica(job: S.Job) -> dict[tuple[str, int], tuple[int, int | None]]:
    return {(r.role, r.index): (r.state, r.exit_code if r.HasField("exit_code") else None) for r in job.replicas}


def termed(out: pathlib.Path) -> set[str]:
    """The processes that got a SIGTERM."""
    return {p.name.removesuffix(".term") for p in out.glob("*.term")}


def pids(out: pathlib.Path) -> list[int]:
    return [int(p.read_text()) for p in out.glob("*.pid")]


@pytest.mark.timeout(600)
async def test_a_failing_worker_is_named_and_the_rest_are_stopped(jm, runs, backend, tmp_path):
    out = tmp_path / "pids"
    out.mkdir(mode=0o777)
    env = {"PIDS": "3", "EXIT_WORKER_1": "3"}
    job = await run_on(jm, runs, backend, S.RUN_MODE_MASTER_WORKER, proc("master", out, **env),
                       proc("worker", out, replicas=2, **env))
    assert (job.state, job.reason, job.exit_code) == (S.JOB_STATE_FAILED, "NonZeroExit", 3), job
    assert "worker-1 exited with code 3" in job.message, job.message
    st = by_replica(job)
    assert st.pop(("worker", 1)) == (S.REPLICA_STATE_FAILED, 3), job.replicas
    assert st.keys() == {("master", 0), ("worker", 0)}, job.replicas
    assert {s for s, _ in st.values()} == {S.REPLICA_STATE_STOPPED}, job.replicas
    assert len(pids(out)) == 3
    await wait_dead(pids(out), within=60)  # no process left
    # "the rest are stopped (SIGTERM, SIGKILL after the grace period)": srun SIGKILLed them. (On
    # Ray the cancel reaches a replica's task through Ray, and a busy CI saw the placement group's
    # removal, 10 s later, come first for one of them: not asserted there.)
    if backend != "ray":
        assert termed(out) == {"master-0", "worker-0"}


@pytest.mark.timeout(600)
async def test_parameter_servers_stopped_by_the_success_rule_show_stopped(jm, runs, backend, tmp_path):
    out = tmp_path / "pids"
    out.mkdir(mode=0o777)
    env = {"PIDS": "3", "EXIT_WORKER_0": "0", "EXIT_WORKER_1": "0", "EXIT_AFTER": "1"}
    job = await run_on(jm, runs, backend, S.RUN_MODE_PS_WORKER, proc("ps", out, **env),
                       proc("worker", out, replicas=2, **env))
    assert (job.state, job.exit_code) == (S.JOB_STATE_SUCCEEDED, 0), job
    st = by_replica(job)
    assert st[("ps", 0)][0] == S.REPLICA_STATE_STOPPED, job.replicas
    assert st[("worker", 0)] == st[("worker", 1)] == (S.REPLICA_STATE_SUCCEEDED, 0), job.replicas
    await wait_dead(pids(out), within=60)
    assert termed(out) == {"ps-0"}  # SIGTERM first, as ENVIRONMENT.md says


@pytest.mark.timeout(600)
async def test_a_parameter_server_that_ignores_sigterm_is_killed_after_the_grace(jm, runs, backend, tmp_path):
    """ENVIRONMENT.md: the parameter servers "are then stopped (SIGTERM, SIGKILL after the grace
    period)". On Slurm the task's wrapper died of the SIGTERM and the ps, orphaned, ran on."""
    out = tmp_path / "pids"
    out.mkdir(mode=0o777)
    env = {"PIDS": "3", "EXIT_WORKER_0": "0", "EXIT_WORKER_1": "0", "EXIT_AFTER": "1"}
    job = await run_on(jm, runs, backend, S.RUN_MODE_PS_WORKER, proc("ps", out, IGNORE_TERM="1", **env),
                       proc("worker", out, replicas=2, **env))
    assert job.state == S.JOB_STATE_SUCCEEDED, job
    assert by_replica(job)[("ps", 0)][0] == S.REPLICA_STATE_STOPPED, job.replicas
    await wait_dead(pids(out), within=90)
    assert termed(out) == {"ps-0"}


@pytest.mark.timeout(600)
async def test_a_stopped_master_worker_job_sigterms_every_process(jm, runs, backend, tmp_path):
    """StopJob: SIGTERM to every process first (a trainer saves its work), then every process
    is gone; a Master-Worker job on each backend."""
    out = tmp_path / "pids"
    out.mkdir(mode=0o777)
    env = {"PIDS": "3"}
    spec = S.JobSpec(run_mode=S.RUN_MODE_MASTER_WORKER, replica_groups=[
        proc("master", out, **env), proc("worker", out, replicas=2, **env)],
        cluster_selector=S.ClusterSelector(cluster=backend))
    r = Run(jm, spec, prefix="replicas", cluster=f"clusters/{backend}", job_timeout=JOB_TIMEOUT)
    runs.append(r)
    await r.submit()
    deadline = time.monotonic() + JOB_TIMEOUT
    while len(pids(out)) < 3:
        assert time.monotonic() < deadline, f"not every process started: {r.job}"
        await asyncio.sleep(0.2)
    await jm.StopJob(jpb.StopJobRequest(name=r.name), timeout=60)
    job = await r.until()
    assert job.state == S.JOB_STATE_STOPPED, job
    await wait_dead(pids(out), within=60)
    # On Ray a placement-group job's processes get the SIGTERM through Ray's ending of the
    # replicas' workers, which turns to SIGKILL within Ray's kill_worker_timeout (100 ms): best
    # effort, not asserted there (known; see the launcher).
    if backend != "ray":
        assert termed(out) == {"master-0", "worker-0", "worker-1"}


#: Attempt 1 prints "first" and fails; attempt 2 (a marker file says which) prints "second" and succeeds.
RETRIED = """
import os, pathlib, sys, time
marker = pathlib.Path(sys.argv[1])
n = len(marker.read_text()) if marker.exists() else 0
marker.write_text("x" * (n + 1))
print("first" if n == 0 else "second", flush=True)
time.sleep(2)
sys.exit(7 if n == 0 else 0)
"""


@pytest.mark.timeout(600)
async def test_a_follow_goes_on_to_a_retrys_attempt(jm, runs, backend, tmp_path):
    """job.proto: a follow goes on "following a retry's later attempts". On Ray it stayed on
    attempt 1's files until the whole job ended, and never showed attempt 2's lines."""
    out = tmp_path / "retry"
    out.mkdir(mode=0o777)
    spec = S.JobSpec(run_mode=S.RUN_MODE_SINGLE_PROCESS, max_retries=1, replica_groups=[
        S.ReplicaGroup(role="main", replicas=1, command=[PY, "-u", "-c", RETRIED, str(out / "marker")])],
        cluster_selector=S.ClusterSelector(cluster=backend))
    r = Run(jm, spec, prefix="retry", cluster=f"clusters/{backend}", job_timeout=JOB_TIMEOUT)
    runs.append(r)
    await r.submit()
    texts = [e.text for e in await r.logs(follow=True)]
    assert texts == ["first", "second"], texts
    job = await r.until()
    assert (job.state, job.attempt) == (S.JOB_STATE_SUCCEEDED, 2), job


@pytest.mark.timeout(600)
async def test_mpi_ranks_never_share_a_line_on_slurm(jm, runs, slurm, tmp_path):
    launcher = S.ReplicaGroup(role="launcher", replicas=1, command=[PY, "-u", "-c", WRITER], env=ROOT_OK)
    worker = S.ReplicaGroup(role="worker", replicas=1, processes_per_replica=2, command=["unused"])
    job = await run_on(jm, runs, "slurm", S.RUN_MODE_MPI, launcher, worker)
    assert job.state == S.JOB_STATE_SUCCEEDED, job
    entries = await runs[-1].logs()
    stdout = [e.text for e in entries if e.stream == S.LOG_STREAM_STDOUT]
    assert_whole_lines(stdout)
    assert {(e.role, e.replica_index) for e in entries} == {("launcher", 0)}


async def test_records_a_job_wrote_over_are_skipped_bounded_not_the_call(tmp_path):
    """A forgotten job's ``recorded.json`` lies in its attempt directory, where the job can write:
    a record read after it was replaced by a huge file, a nesting bomb, numbers past a float or
    one naming another job is skipped (logged); the others of the same call are read."""
    import asyncio
    import json

    from drivers.common.base import JobRef
    from drivers.slurm import records
    from drivers.slurm.jobs import RECORDED, TrackedJob
    from drivers.slurm.poller import SlurmJob

    async def run(command: str, **_: object) -> tuple[int, str, str]:
        p = await asyncio.create_subprocess_exec("bash", "-c", command, stdout=asyncio.subprocess.PIPE,
                                                 stderr=asyncio.subprocess.PIPE)
        out, err = await p.communicate()
        return p.returncode or 0, out.decode(), err.decode()

    def recorded(job_id: str) -> dict[str, object]:
        job = TrackedJob("c", job_id, 1, "77", str(tmp_path / job_id / "attempt-1"), None, roles=(("main", 0),))
        job.apply(SlurmJob("77", "COMPLETED", exit_status=0, nodes="n1"))
        job.exits_read(None), job.exits_read(None), job.exits_read(None)
        return job.record()

    def compact(record: dict[str, object]) -> bytes:  # as records.write puts it
        return json.dumps(record, separators=(",", ":")).encode()

    bad = {"huge": b"{" + b" " * (records.MAX_RECORD_BYTES + 10) + b"}",
           "bomb": b"[" * 100_000 + b"]" * 100_000,
           "inf": compact({**recorded("inf"), "exit_code": 1e400}).replace(b"Infinity", b"1e400"),
           "other": compact(recorded("someone-else"))}
    for job_id, body in {"good": compact(recorded("good")), **bad}.items():
        d = tmp_path / job_id / "attempt-1"
        d.mkdir(parents=True)
        (d / RECORDED).write_bytes(body + b"\n")
    got = await records.read(run, "c", str(tmp_path), [JobRef(j, "77") for j in ("good", *bad)])
    assert list(got) == [("good", "77")] and got[("good", "77")].state is DJobState.SUCCEEDED


def test_an_adopting_driver_releases_only_its_own_hold() -> None:
    """A restarted driver releases a job it finds held by its ``sbatch --hold`` (JobHeldUser,
    root's submissions too: checked against a real slurmctld), never an operator's
    ``scontrol hold`` (JobHeldAdmin), which it released before."""
    from drivers.slurm.adapter import held_by_dlsched
    from drivers.slurm.poller import SlurmJob
    assert held_by_dlsched(SlurmJob("1", "PENDING", reason="JobHeldUser"))
    assert not held_by_dlsched(SlurmJob("2", "PENDING", reason="JobHeldAdmin"))
    assert not held_by_dlsched(SlurmJob("3", "PENDING", reason="Resources"))
    assert not held_by_dlsched(SlurmJob("4", "RUNNING", reason="JobHeldUser"))


def test_a_job_slurm_purged_unseen_ends_as_its_exits_file_says() -> None:
    """A job that ended while the driver could not poll (the login node out of reach longer
    than Slurm's MinJobAge) is gone from squeue and the follow-up: its exits file decides its
    end, as for any end. It was FAILED "LeftSlurm" at once, and a job with retries ran again."""
    from drivers.slurm.jobs import TrackedJob
    from drivers.slurm.poller import SlurmJob

    def gone(roles: tuple[tuple[str, int], ...]) -> TrackedJob:
        job = TrackedJob("c", "j", 1, "7", "d", None, roles=roles)
        job.apply(SlurmJob("7", "RUNNING", nodes="n1"))
        job.round(None, None, complete=True)  # listed nowhere
        assert job.needs_exits and job.state is DJobState.RUNNING  # not reported before the read
        job.round(None, None, complete=True)  # another round before the read changes nothing
        return job

    ok = gone((("main", 0),))
    assert ok.exits_read(exits.parse("labels main-0\nend main-0 0 exit\n"))
    obs = ok.observation(None)
    assert (obs.state, obs.exit_code) == (DJobState.SUCCEEDED, 0), obs
    bad = gone((("main", 0), ("main", 1)))
    assert bad.exits_read(exits.parse("labels main-0 main-1\nend main-1 3 exit\nend main-0 15 stop\n"))
    obs = bad.observation(None)
    assert (obs.state, obs.exit_code) == (DJobState.FAILED, 3), obs
    unknown = gone((("main", 0),))  # no file (or a process with no recorded end): nobody knows
    assert not any(unknown.exits_read(None) for _ in range(exits.MAX_READS - 1))
    assert unknown.exits_read(None)
    assert (unknown.state, unknown.reason) == (DJobState.FAILED, "LeftSlurm")
    running = gone((("main", 0),))
    assert running.exits_read(exits.parse("labels main-0\n"))
    assert running.reason == "LeftSlurm"


def test_a_job_slurm_forgot_before_it_started_is_lost_before_start() -> None:
    """slurmctld SIGKILLed before it saved jobs it had just accepted: restarted, it knows them no
    more (and gives their ids to other jobs). One never seen on a node whose script wrote no
    exits file provably never ran: FAILED ``LostBeforeStart`` (JobManager launches it again), not
    ``LeftSlurm`` (4 of 10 jobs submitted around such a kill were lost for good, found by review).
    Seen running, or the file unreadable (the login node out of reach): ``LeftSlurm`` as before."""
    from drivers.slurm.jobs import TrackedJob
    from drivers.slurm.poller import SlurmJob

    def vanished(*, ran: bool) -> TrackedJob:
        job = TrackedJob("c", "j", 1, "84", "d", None, roles=(("main", 0),))
        job.apply(SlurmJob("84", "RUNNING" if ran else "PENDING", nodes="n1" if ran else ""))
        job.round(None, None, complete=True)  # listed nowhere
        assert job.needs_exits
        return job

    never = vanished(ran=False)
    assert never.exits_read(None, absent=True)
    assert (never.state, never.reason) == (DJobState.FAILED, "LostBeforeStart"), never.observation(None)
    unread = vanished(ran=False)  # the read failed: nobody knows whether it ran
    assert unread.exits_read(None, absent=False)
    assert (unread.state, unread.reason) == (DJobState.FAILED, "LeftSlurm")
    ran = vanished(ran=True)
    while not ran.exits_read(None, absent=True):
        pass
    assert (ran.state, ran.reason) == (DJobState.FAILED, "LeftSlurm")


def test_ends_after_dlscheds_stop_are_never_a_success() -> None:
    """Every process ending after dlsched's stop reached the job (``halt``): had they all exited 0,
    a driver that adopted the job and read only the file (Slurm lost the job) said SUCCEEDED."""
    ex = exits.parse("labels main-0 main-1\nend main-0 0 exit\nend main-1 0 halt\n")
    assert ex is not None and ex.ends[1] == exits.End("main-1", 0, True, True)
    assert ex.first_failure() is None and not ex.succeeded()
    done = exits.parse("labels main-0 ps-0\nend main-0 0 exit\nend ps-0 143 stop\n")
    assert done is not None and done.succeeded()
