"""The sbatch script: golden files per run mode, validation, and hostile specs run for real.

The hostile tests run the rendered script with ``bash`` in a temp dir, with
``srun`` and ``scontrol`` replaced on PATH by tiny scripts (``srun`` drops
its options up to ``--``, honours ``--chdir`` and execs the program), so
what reaches the program is exactly what the script hands to ``srun``.
"""

from __future__ import annotations

import json
import os
import pathlib
import shlex
import signal
import subprocess
import sys
import time

import pytest

from dlsched.errors import InvalidArgument
from drivers.common import planner
from drivers.common.base import JobSpec, ReplicaGroup, Resources, RunMode, same_job
from drivers.slurm import render

GOLDEN = pathlib.Path(__file__).parent / "golden" / "slurm"
UPDATE = os.environ.get("DLSCHED_UPDATE_GOLDEN") == "1"
PY = sys.executable


def g(role: str, replicas: int = 1, ppr: int = 0, *, command: tuple[str, ...] = ("train",),
      args: tuple[str, ...] = (), env: dict[str, str] | None = None, **res: object) -> ReplicaGroup:
    return ReplicaGroup(role=role, replicas=replicas, processes_per_replica=ppr, command=command,
                        args=args, env=env or {}, resources=Resources(**res))  # type: ignore[arg-type]


SPECS: dict[str, tuple[JobSpec, dict[str, str]]] = {
    "single_process": (JobSpec(RunMode.SINGLE_PROCESS, (g("main", args=("--lr", "0.1"), env={"A": "1"},
                                                          cpu=4, memory_bytes=6 << 30),),
                               queue="debug", time_limit_seconds=90.5), {}),
    "multi_process": (JobSpec(RunMode.MULTI_PROCESS, (g("worker", 2, 2, cpu=8, memory_bytes=16 << 30,
                                                        gpus=2, gpu_type="a100"),),
                              time_limit_seconds=86400 * 2 + 3661), {"partition": "gpu"}),
    "master_worker": (JobSpec(RunMode.MASTER_WORKER, (g("worker", 2), g("master"))), {"max_nodes": "2"}),
    "ps_worker": (JobSpec(RunMode.PS_WORKER, (g("chief"), g("ps", 2), g("worker", 2))),
                  {"max_nodes": "1", "state_dir": "/shared/dlsched"}),
    "mpi": (JobSpec(RunMode.MPI, (g("launcher", command=("./hello",)), g("worker", 2, 2))), {}),
}


@pytest.mark.parametrize("name", sorted(SPECS))
def test_golden(name):
    spec, options = SPECS[name]
    out = render.render_job("golden-1", spec, 3, options)
    path = GOLDEN / f"{name}.sbatch"
    if UPDATE:
        path.write_text(out.script)
    assert out.script == path.read_text(), f"update with DLSCHED_UPDATE_GOLDEN=1 ({path})"
    assert out.native_spec().media_type == render.MEDIA_TYPE
    assert out.job_name == "dlsched-golden-1" and render.parse_comment(out.comment) == ("golden-1", 3, "")


def test_bash_accepts_every_golden_script():
    for name in SPECS:
        subprocess.run(["bash", "-n", str(GOLDEN / f"{name}.sbatch")], check=True)


@pytest.mark.parametrize(("spec", "options", "field"), [
    (JobSpec(RunMode.SINGLE_PROCESS, (g("main"),), queue="gpu\n#SBATCH --x"), {}, "spec.queue"),
    (JobSpec(RunMode.SINGLE_PROCESS, (g("main"),), queue="$(touch x)"), {}, "spec.queue"),
    (JobSpec(RunMode.SINGLE_PROCESS, (g("main"),)), {"partition": "a b"}, "cluster.options[partition]"),
    (JobSpec(RunMode.SINGLE_PROCESS, (g("main", gpus=1, gpu_type="a100;rm"),)), {},
     "spec.replica_groups[0].resources.gpu_type"),
    (JobSpec(RunMode.SINGLE_PROCESS, (g("main"),)), {"state_dir": "../etc"}, "cluster.options[state_dir]"),
    (JobSpec(RunMode.SINGLE_PROCESS, (g("main"),)), {"state_dir": "-x"}, "cluster.options[state_dir]"),
    (JobSpec(RunMode.SINGLE_PROCESS, (g("main"),)), {"max_nodes": "0"}, "cluster.options[max_nodes]"),
    (JobSpec(RunMode.SINGLE_PROCESS, (g("main", env={"A B": "1"}),)), {}, "spec.replica_groups[0].env['A B']"),
])
def test_values_in_sbatch_lines_are_validated(spec, options, field):
    with pytest.raises(InvalidArgument) as e:
        render.render_job("job-1", spec, 1, options)
    assert field in [v.field for v in e.value.violations]


HOSTILE = [
    "$(touch CANARY)", "`touch CANARY`", "'; touch CANARY; '", '"; touch CANARY; "', "; touch CANARY",
    "a\n#SBATCH --wrap='touch CANARY'\ntouch CANARY", "-rf", "--", "--help", "trailing newline\n",
    "tab\there", "cr\rhere", "back\\slash", "%j %x %u", "!!", "$HOME ${PATH} $1", "ünï©ødé ✓", "",
    "\x01\x7f\x1b[31m", "*", "~", "a' \"b", "|| touch CANARY &", "> CANARY",
    "x\nDLSCHED_TASK_0_END\ntouch CANARY\n", "EOF\ntouch CANARY",  # ending a wrapper's heredoc
]

PROBE = ("import json, os, sys; json.dump({'argv': sys.argv[1:], "
         "'env': {k: os.environ.get(k) for k in sorted(os.environ) if k.startswith('H_')}, "
         "'cwd': os.getcwd(), 'rank': os.environ.get('RANK'), 'master': os.environ.get('MASTER_ADDR')}, "
         "sys.stdout)")

FAKE_SRUN = """#!/bin/bash
n=1 conf=""
while [ $# -gt 0 ]; do
  case "$1" in
    --chdir=*) cd -- "${1#--chdir=}" || exit 126 ;;
    --ntasks=*) n=${1#--ntasks=} ;;
    --multi-prog) conf=$2; shift ;;
    --) shift; break ;;
  esac
  shift
done
[ -n "$conf" ] || exec "$@"
# --multi-prog: this sandbox's conf is one line, '* <command with %t>'; task t runs it with %t = t
read -r -a words <"$conf"
[ "${words[0]}" = "*" ] || exit 2
args=("${words[@]:1}")
pids=()
# as slurmstepd signals every process of the step: each task a process group, each group signalled
trap 'for p in "${pids[@]}"; do kill -TERM -- "-$p" 2>/dev/null; done' TERM
for ((t = 0; t < n; t++)); do
  SLURM_PROCID=$t setsid "${args[@]//%t/$t}" &
  pids+=($!)
done
rc=0
for p in "${pids[@]}"; do
  while :; do wait "$p"; s=$?; kill -0 "$p" 2>/dev/null || break; done
  [ "$s" = 0 ] || rc=$s
done
exit "$rc"
"""
FAKE_SCONTROL = """#!/bin/bash
[ "$1 $2" = "show hostnames" ] || exit 2
printf 'node-a\\nnode-b\\n'
"""


@pytest.fixture
def sandbox(tmp_path: pathlib.Path) -> pathlib.Path:
    bindir = tmp_path / "bin"
    bindir.mkdir()
    for name, body in (("srun", FAKE_SRUN), ("scontrol", FAKE_SCONTROL)):
        (bindir / name).write_text(body)
        (bindir / name).chmod(0o755)
    return tmp_path


def run_script(sandbox: pathlib.Path, out: render.SlurmScript, timeout: float = 30) -> subprocess.CompletedProcess[str]:
    (sandbox / out.dir).mkdir(parents=True, exist_ok=True)
    env = {"PATH": f"{sandbox / 'bin'}:{os.environ['PATH']}", "SLURM_JOB_NODELIST": "node-[a-b]",
           "HOME": str(sandbox)}
    return subprocess.run(["bash", "-s"], input=out.script, cwd=sandbox, env=env, text=True,
                          capture_output=True, timeout=timeout)


def test_hostile_values_never_run_and_arrive_byte_for_byte(sandbox):
    env = {f"H_{i}": v for i, v in enumerate(HOSTILE)}
    wd = "dir with 'quotes' $(touch CANARY) and\nnewline"
    (sandbox / wd).mkdir()
    spec = JobSpec(RunMode.SINGLE_PROCESS, (ReplicaGroup(
        role="main", replicas=1, command=(PY, "-c", PROBE), args=tuple(HOSTILE), env=env,
        working_dir=str(sandbox / wd)),))
    out = render.render_job("hostile-1", spec, 1, {})
    header = [ln for ln in out.script.splitlines() if ln.startswith("#SBATCH")]
    assert len(header) == out.script.count("\n#SBATCH")  # every #SBATCH line is ours
    assert "CANARY" not in "\n".join(header)
    res = run_script(sandbox, out)
    assert res.returncode == 0, res.stderr
    assert not list(sandbox.rglob("CANARY")), "a hostile value ran as shell code"
    got = json.loads((sandbox / out.dir / "main-0.stdout").read_text())
    assert got["argv"] == HOSTILE
    assert got["env"] == env
    assert got["cwd"] == str(sandbox / wd)
    assert (sandbox / out.dir / "main-0.exit").read_text() == "0\n"


def test_multi_process_gets_rendezvous_from_the_node_list(sandbox):
    spec = JobSpec(RunMode.MULTI_PROCESS, (g("worker", 2, command=(PY, "-c", PROBE)),))
    out = render.render_job("mp-1", spec, 1, {})
    res = run_script(sandbox, out)
    assert res.returncode == 0, res.stderr
    seen = [json.loads((sandbox / out.dir / f"worker-{i}.stdout").read_text()) for i in range(2)]
    assert [s["rank"] for s in seen] == ["0", "1"]
    assert {s["master"] for s in seen} == {"node-a"}  # the allocation's first node


ENV_PROBE = ("import json, os; print(json.dumps({k: os.environ.get(k) for k in "
             "('PATH', 'SLURM_JOB_ID', 'SRUN_CPUS_PER_TASK', 'LD_PRELOAD')}))")
#: Variables a user may well set that the script's own commands (srun, mv, the MPI mergers' tools)
#: must not run with: they reach the program only.
USER_ENV = {"PATH": "/opt/myapp/bin", "SLURM_JOB_ID": "999999", "SRUN_CPUS_PER_TASK": "64",
            "LD_PRELOAD": "/nonexistent/libhook.so"}


@pytest.mark.parametrize("mode", [RunMode.SINGLE_PROCESS, RunMode.MASTER_WORKER, RunMode.PS_WORKER])
def test_the_users_path_and_slurm_variables_reach_the_program_only(sandbox, mode):
    """A user's PATH made srun "not found" (127), a SLURM_*/SRUN_* variable became srun's own
    option (SLURM_JOB_ID: another job's allocation), and in PS-Worker's wrapper a PATH without
    coreutils left the task's exit file unwritten (the job ran on for ever)."""
    groups = {RunMode.SINGLE_PROCESS: ("main",), RunMode.MASTER_WORKER: ("master", "worker"),
              RunMode.PS_WORKER: ("ps", "worker")}[mode]
    spec = JobSpec(mode, tuple(g(role, command=(PY, "-c", ENV_PROBE), env=dict(USER_ENV)) for role in groups))
    out = render.render_job("env-1", spec, 1, {"max_nodes": "1"})
    (sandbox / "bin" / "srun").write_text(FAKE_SRUN.replace(
        "#!/bin/bash\n", '#!/bin/bash\n[ -z "${SLURM_JOB_ID:-}${SRUN_CPUS_PER_TASK:-}" ] || exit 99\n', 1))
    res = run_script(sandbox, out)
    assert res.returncode == 0, res.stderr
    for role in groups:
        assert json.loads((sandbox / out.dir / f"{role}-0.stdout").read_text()) == USER_ENV, role
        assert (sandbox / out.dir / f"{role}-0.exit").read_text() == "0\n", role


def test_first_failure_ends_the_job_with_its_code_and_stops_the_rest(sandbox):
    spec = JobSpec(RunMode.MASTER_WORKER, (
        g("master", command=(PY, "-c", "import time; time.sleep(60)")),
        g("worker", command=(PY, "-c", "import sys; sys.exit(3)"))))
    out = render.render_job("fail-1", spec, 1, {})
    res = run_script(sandbox, out)
    assert res.returncode == 3
    assert (sandbox / out.dir / "worker-0.exit").read_text() == "3\n"
    assert (sandbox / out.dir / "master-0.exit").read_text() != "0\n"


def test_ps_worker_succeeds_when_the_workers_do_and_stops_the_ps(sandbox):
    tf = "import json, os; print(json.loads(os.environ['TF_CONFIG'])['task'])"
    spec = JobSpec(RunMode.PS_WORKER, (
        g("ps", command=(PY, "-c", "import time; time.sleep(60)")),
        g("worker", 2, command=(PY, "-c", tf))))
    out = render.render_job("ps-1", spec, 1, {"max_nodes": "1"})
    res = run_script(sandbox, out)
    assert res.returncode == 0, res.stderr
    assert "'index': 1" in (sandbox / out.dir / "worker-1.stdout").read_text()
    assert (sandbox / out.dir / "ps-0.exit").read_text() != "0\n"  # stopped after success


def test_ps_worker_tasks_get_hostile_values_byte_for_byte_through_their_wrappers(sandbox):
    """PS-Worker runs every task from one --multi-prog step through a wrapper the script writes
    with a quoted heredoc: argv, env and working dir still arrive byte for byte, nothing runs."""
    env = {f"H_{i}": v for i, v in enumerate(HOSTILE)}
    wd = "dir with 'quotes' $(touch CANARY) and\nnewline"
    (sandbox / wd).mkdir()
    spec = JobSpec(RunMode.PS_WORKER, (
        ReplicaGroup(role="ps", replicas=1, command=(PY, "-c", PROBE), args=tuple(HOSTILE), env=env,
                     working_dir=str(sandbox / wd)),
        ReplicaGroup(role="worker", replicas=2, command=(PY, "-c", PROBE), args=tuple(HOSTILE), env=env)))
    out = render.render_job("ps-hostile-1", spec, 1, {"max_nodes": "2"})
    res = run_script(sandbox, out)
    assert res.returncode == 0, res.stderr
    assert not list(sandbox.rglob("CANARY")), "a hostile value ran as shell code"
    for label, cwd in (("ps-0", sandbox / wd), ("worker-0", sandbox), ("worker-1", sandbox)):
        got = json.loads((sandbox / out.dir / f"{label}.stdout").read_text())
        assert got["argv"] == HOSTILE and got["env"] == env and got["cwd"] == str(cwd), label
        assert (sandbox / out.dir / f"{label}.exit").read_text() == "0\n"
    hosts = (sandbox / out.dir / "tasks.hosts").read_text().split()
    assert hosts == ["node-a", "node-a", "node-b"]  # replica q of R on node q * nodes // R


@pytest.mark.parametrize("program", ["-a", "--", "-c", "-l"])
def test_ps_worker_a_program_named_like_an_exec_option_is_not_found(sandbox, program):
    """The wrapper's ``exec`` takes the program as a program, never as its own option (``exec -a x
    sh -c ...`` ran sh): not found, 127, as on every other backend."""
    canary = sandbox / "CANARY"
    cmd = (program, "x", "/bin/sh", "-c", f"touch {canary}")
    spec = JobSpec(RunMode.PS_WORKER, (g("ps", command=cmd), g("worker", command=cmd)))
    out = render.render_job("ps-option-1", spec, 1, {"max_nodes": "1"})
    res = run_script(sandbox, out)
    assert not canary.exists(), "a program name ran as exec's option"
    assert res.returncode == 127, res.stderr
    assert (sandbox / out.dir / "worker-0.exit").read_text() == "127\n"


def test_ps_worker_first_failure_ends_the_job_with_its_code_and_stops_the_rest(sandbox):
    spec = JobSpec(RunMode.PS_WORKER, (
        g("ps", command=(PY, "-c", "import time; time.sleep(60)")),
        g("worker", 2, command=(PY, "-c", "import os, sys, time; time.sleep(0.3); "
                                          "sys.exit(5 if os.environ['DLSCHED_REPLICA_INDEX'] == '1' else 0)"))))
    out = render.render_job("ps-fail-1", spec, 1, {"max_nodes": "1"})
    res = run_script(sandbox, out)
    assert res.returncode == 5, res.stderr
    assert "worker-1 exited with code 5" in res.stderr
    assert (sandbox / out.dir / "worker-1.exit").read_text() == "5\n"
    assert (sandbox / out.dir / "ps-0.exit").read_text() != "0\n"  # stopped, and said so


def test_ps_worker_a_task_ending_on_the_stop_signal_keeps_its_own_exit_status(sandbox):
    """A ps that exits 0 on the SIGTERM the success rule sends: its wrapper records 0. A trap cut
    the wrapper's wait short, and bash 5.2 gave the wait it then made again -1 for the child."""
    n = 8
    ps = ("import os, signal, time; signal.signal(signal.SIGTERM, lambda *a: os._exit(0)); "
          "open('ready-' + os.environ['DLSCHED_REPLICA_INDEX'], 'w').close(); time.sleep(60)")
    worker = f"import glob, time\nwhile len(glob.glob('ready-*')) < {n}: time.sleep(0.05)"
    spec = JobSpec(RunMode.PS_WORKER, (g("ps", n, command=(PY, "-c", ps)), g("worker", command=(PY, "-c", worker))))
    out = render.render_job("ps-term-1", spec, 1, {"max_nodes": "1"})
    res = run_script(sandbox, out, timeout=120)
    assert res.returncode == 0, res.stderr
    got = {i: (sandbox / out.dir / f"ps-{i}.exit").read_text() for i in range(n)}
    assert got == {i: "0\n" for i in range(n)}
    ends = (sandbox / out.dir / "exits").read_text().splitlines()
    assert sorted(e for e in ends if e.startswith("end ps-")) == sorted(f"end ps-{i} 0 stop" for i in range(n))


def test_ps_worker_a_step_that_never_launches_fails_the_job(sandbox):
    (sandbox / "bin" / "srun").write_text("#!/bin/sh\necho 'srun: error: Unable to create step' >&2\nexit 1\n")
    spec = JobSpec(RunMode.PS_WORKER, (g("ps"), g("worker")))
    out = render.render_job("ps-nolaunch-1", spec, 1, {})
    res = run_script(sandbox, out)
    assert res.returncode == 1
    assert "before the tasks decided" in res.stderr
    assert (sandbox / out.dir / "worker-0.exit").read_text() == "1\n"


FAKE_MPIRUN = f"""#!{PY}
import os, signal, time
signal.signal(signal.SIGTERM, lambda *a: os._exit(0))
with open("mpirun.pids.new", "w") as f:
    f.write(f"{{os.getpid()}} {{os.getppid()}}")
os.rename("mpirun.pids.new", "mpirun.pids")
time.sleep(60)
"""


def test_mpi_launcher_keeps_mpiruns_exit_status_when_signalled(sandbox):
    """Slurm's SIGTERM reaches both the launcher's subshell and mpirun (every process of the batch
    step); mpirun exits 0 on it: the launcher records 0. A trap cut the launcher's wait short, and
    bash 5.2 gave the wait it then made again -1 for mpirun."""
    (sandbox / "bin" / "mpirun").write_text(FAKE_MPIRUN)
    (sandbox / "bin" / "mpirun").chmod(0o755)
    (sandbox / "bin" / "scontrol").write_text(FAKE_SCONTROL.replace("node-b\\n", "node-b\\nnode-c\\n"))
    spec = JobSpec(RunMode.MPI, (g("launcher", command=("./hello",)), g("worker", 2, 2)))
    env = {"PATH": f"{sandbox / 'bin'}:{os.environ['PATH']}", "SLURM_JOB_NODELIST": "node-[a-b]",
           "HOME": str(sandbox)}
    for run in range(4):  # the lost status was a race: a few runs
        out = render.render_job(f"mpi-term-{run}", spec, 1, {})
        (sandbox / out.dir).mkdir(parents=True)
        pids = sandbox / "mpirun.pids"
        pids.unlink(missing_ok=True)
        with subprocess.Popen(["bash", "-s"], stdin=subprocess.PIPE, cwd=sandbox, env=env, text=True,
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE) as proc:
            assert proc.stdin is not None
            proc.stdin.write(out.script)
            proc.stdin.close()
            deadline = time.monotonic() + 60
            while not pids.exists():
                assert proc.poll() is None and time.monotonic() < deadline, "mpirun never started"
                time.sleep(0.02)
            mpirun, launcher = map(int, pids.read_text().split())
            os.kill(launcher, signal.SIGTERM)
            os.kill(mpirun, signal.SIGTERM)
            assert proc.wait(timeout=60) == 0, proc.stderr.read() if proc.stderr else ""
        assert (sandbox / out.dir / "launcher-0.exit").read_text() == "0\n"
        assert "end launcher-0 0 exit" in (sandbox / out.dir / "exits").read_text()


def test_a_filtered_tail_reads_only_the_files_it_wants_and_never_globs_a_hostile_role(tmp_path):
    """logs.log_globs: the remote globs of a tail's query, run by a real shell over real files."""
    from drivers.common.base import LogQuery, LogStream
    from drivers.slurm import logs

    for name in ("worker-0.stdout", "worker-0.stderr", "worker-1.stdout", "ps-0.stdout", "log.index"):
        (tmp_path / name).write_text("x\n")

    def matched(query: LogQuery | None) -> list[str]:
        out = subprocess.run(["sh", "-c", f"cd {tmp_path} && for f in {logs.log_globs(query)}; do "
                              "[ -f \"$f\" ] && echo \"$f\"; done"], capture_output=True, text=True, check=True)
        return sorted(out.stdout.split())

    assert matched(None) == ["log.index", "ps-0.stdout", "worker-0.stderr", "worker-0.stdout", "worker-1.stdout"]
    assert matched(LogQuery(role="worker")) == ["log.index", "worker-0.stderr", "worker-0.stdout", "worker-1.stdout"]
    assert matched(LogQuery(role="worker", replica_index=0, streams=frozenset({LogStream.STDERR}))) == [
        "log.index", "worker-0.stderr"]
    canary = tmp_path / "CANARY"
    hostile = LogQuery(role=f"$(touch {canary})*", replica_index=0)
    assert matched(hostile) == ["log.index", "ps-0.stdout", "worker-0.stderr", "worker-0.stdout"]
    assert not canary.exists()


SRUN_END = (b"srun: error: vm: task 0: Exited with exit code 7\n"
            b"slurmstepd-vm: error: *** STEP 5.0 ON vm CANCELLED AT 2026-12-07T04:00:00 ***\n")


def _first_read(adir: pathlib.Path, query: object) -> list[str]:
    from drivers.slurm import logs

    cursor = logs.LogCursor(query, (("main", 0),))  # type: ignore[arg-type]
    out = subprocess.run(["bash", "-c", cursor.read_script(str(adir))], capture_output=True, timeout=60, check=True)
    return [e.text for e in cursor.feed(logs.parse_frames(out.stdout), ended=True)]


def test_tail_lines_of_stderr_counts_the_programs_lines_not_sruns(tmp_path):
    """srun's own lines at the end of a step's stderr are left out after the read: the read
    takes more than the last N lines, so N of the program's come back (it was 1 of 2)."""
    from drivers.common.base import LogQuery, LogStream

    (tmp_path / "main-0.stderr").write_bytes(b"".join(b"err %d\n" % i for i in range(5)) + SRUN_END * 3)
    (tmp_path / "main-0.stdout").write_bytes(b"out 1\nout 2\nout 3\n")
    stderr = LogQuery(tail_lines=2, streams=frozenset({LogStream.STDERR}))
    assert _first_read(tmp_path, stderr) == ["err 3", "err 4"]
    assert sorted(_first_read(tmp_path, LogQuery(tail_lines=2))) == ["err 3", "err 4", "out 2", "out 3"]


def test_srun_message_glued_to_a_last_line_without_newline_is_split_off(tmp_path):
    """A program's last stderr line without a newline got srun's message glued on."""
    from drivers.common.base import LogQuery, LogStream

    (tmp_path / "main-0.stderr").write_bytes(b"err one\nerr two no newline" + SRUN_END)
    query = LogQuery(streams=frozenset({LogStream.STDERR}))
    assert _first_read(tmp_path, query) == ["err one", "err two no newline"]
    (tmp_path / "main-0.stderr").write_bytes(b"err one\nkilled" + b"srun: error: node[1-2]: tasks 0-1: Killed\n")
    assert _first_read(tmp_path, query) == ["err one", "killed"]
    (tmp_path / "main-0.stderr").write_bytes(b"it says srun: error: x: task 0: here\n")
    assert _first_read(tmp_path, query) == ["it says srun: error: x: task 0: here"]
    # a program line that ends like srun's message is the program's, but for its last one
    nested = b"INFO nested step failed: srun: error: gpu-7: tasks 0-3: Killed"
    (tmp_path / "main-0.stderr").write_bytes(nested + b"\nlast\n")
    assert _first_read(tmp_path, query) == [nested.decode(), "last"]


def test_mpi_launcher_argv_reaches_the_ranks_verbatim():
    """The launcher command travels in DLSCHED_MPI_ARGV (mpirun never parses it), exported as user data:
    no node-token substitution, any bytes; bash reads back exactly the planner's shlex.join."""
    args = ("@DLSCHED_NODE_1@", "$HOME", "`id`", "x\ny", "é", ":", "-np", "1", "it's")
    spec = JobSpec(RunMode.MPI, (g("launcher", command=("./hello",), args=args), g("worker", 2, 2)))
    script = render.render_job("argv-1", spec, 1, {}).script
    (line,) = [ln.strip() for ln in script.splitlines() if "export DLSCHED_MPI_ARGV=" in ln]
    got = subprocess.run(["bash", "-c", f'{line}; printf %s "$DLSCHED_MPI_ARGV"'], capture_output=True,
                         timeout=30, check=True).stdout.decode()
    assert shlex.split(got) == ["./hello", *args]
    (mpirun,) = [ln.strip() for ln in script.splitlines() if 'exec -- "$dlsched_mpirun_bin" ' in ln]
    assert mpirun.endswith(shlex.join(planner.MPI_RANK_PROGRAM) + " ) &") and "hello" not in mpirun


def test_the_comment_carries_the_job_uid_and_a_launch_never_adopts_a_comment_without_one():
    spec = JobSpec(RunMode.SINGLE_PROCESS, (g("main"),))
    uid = "0b6c7f3e-58d2-4c1a-9a55-3f0e9d7d2a11"
    out = render.render_job("job-1", spec, 2, {}, uid=uid)
    assert out.comment == "dlsched-job-1.2.0b6c7f3e58d24c1a9a553f0e9d7d2a11" and out.uid == uid.replace("-", "")
    assert f"#SBATCH --comment={out.comment}\n" in out.script
    assert render.parse_comment(out.comment) == ("job-1", 2, uid.replace("-", ""))
    assert render.parse_comment("dlsched-job-1.2") == ("job-1", 2, "")
    for bad in ("dlsched-job-1.2.a-b", "dlsched-job-1.2.x.y", "dlsched-job-1.x", "dlsched-Job.1", "other-job.1"):
        assert render.parse_comment(bad) is None, bad
    # another incarnation of the id (another uid) is not this attempt, nor is one without a uid
    assert out.marks(out.comment) and not out.marks("dlsched-job-1.2")
    assert not out.marks(render.job_comment("job-1", 2, "ffff")) and not out.marks("dlsched-job-1.1")
    other = render.job_comment("job-1", 2, "ffff")
    key = "dlsched-job-1.2"
    assert out.attempt_key == key
    assert out.in_listing({key: {other: "theirs"}}) is None and out.rivals({key: {other: "theirs"}}) == ["theirs"]
    assert out.in_listing({key: {key: "old"}}) is None and out.rivals({key: {key: "old"}}) == []
    assert out.in_listing({key: {out.comment: "mine", key: "old"}}) == "mine"
    bare = render.render_job("job-1", spec, 2, {})  # a launch without a uid has the bare key for its comment
    assert bare.comment == key and bare.marks(key) and bare.in_listing({key: {key: "old"}}) == "old"
    assert same_job(uid, uid.replace("-", "")) and same_job("", uid) and not same_job("a", "b")


@pytest.mark.parametrize("bad", ["a b", "x\n#SBATCH --uid=0", "u" * 65, "a.b", "$(id)"])
def test_a_job_uid_that_is_not_one_is_refused(bad):
    with pytest.raises(InvalidArgument) as e:
        render.render_job("job-1", JobSpec(RunMode.SINGLE_PROCESS, (g("main"),)), 1, {}, uid=bad)
    assert [v.field for v in e.value.violations] == ["job_uid"]


def test_a_forged_uidless_submission_is_never_adopted_as_the_victims_attempt():
    """Any job of the Slurm user can ``sbatch --hold --job-name=dlsched-victim
    --comment=dlsched-victim.2 evil.sh``: a launch with a uid neither adopts (and releases) it
    nor takes it for a rival."""
    victim = render.render_job("victim", JobSpec(RunMode.SINGLE_PROCESS, (g("main"),)), 2, {},
                               uid="0b6c7f3e-58d2-4c1a-9a55-3f0e9d7d2a11")
    forged = "dlsched-victim.2"
    assert render.parse_comment(forged) == ("victim", 2, "")
    assert not victim.marks(forged)
    assert victim.in_listing({victim.attempt_key: {forged: "evil"}}) is None
    assert victim.rivals({victim.attempt_key: {forged: "evil"}}) == []


def test_a_relative_working_dir_is_taken_once(sandbox):
    """The step's `cd` into a relative working dir, then srun's --chdir of the same relative
    path taken from there: slurmstepd fell back to /tmp (the job ran elsewhere, and succeeded)."""
    (sandbox / "code" / "run").mkdir(parents=True)
    spec = JobSpec(RunMode.SINGLE_PROCESS, (ReplicaGroup(
        role="main", replicas=1, command=(PY, "-c", "import os; print(os.getcwd())"), working_dir="code/run"),))
    out = render.render_job("relwd-1", spec, 1, {})
    res = run_script(sandbox, out)
    assert res.returncode == 0, res.stderr
    assert (sandbox / out.dir / "main-0.stdout").read_text().strip() == str((sandbox / "code" / "run").resolve())


def test_a_script_past_slurms_max_script_size_is_refused_naming_the_field():
    """Every process's argv is in the script: 25 processes x 180 KB of arguments made a script
    sbatch refused ("Pathname ... too long") after SubmitJob had taken the job. Refused at
    render, naming the field; a cluster whose Slurm takes more says so (``max_script_bytes``)."""
    big = ReplicaGroup(role="worker", replicas=1, processes_per_replica=25, command=("echo",),
                       args=("a" * 60_000,) * 3)
    spec = JobSpec(RunMode.MULTI_PROCESS, (big,))
    with pytest.raises(InvalidArgument) as ei:
        render.render_job("big", spec, 1)
    assert ei.value.violations[0].field == "spec.replica_groups" and "max_script_bytes" in str(ei.value)
    out = render.render_job("big", spec, 1, {"max_script_bytes": str(16 * 1024 * 1024)})
    assert len(out.script) > render.MAX_SCRIPT_BYTES
    small = JobSpec(RunMode.MULTI_PROCESS, (ReplicaGroup(role="worker", replicas=1, processes_per_replica=2,
                                                         command=("echo", "x")),))
    assert render.render_job("small", small, 1).script
    with pytest.raises(InvalidArgument) as ei:
        render.render_job("small", small, 1, {"max_script_bytes": "4MB"})
    assert ei.value.violations[0].field == "cluster.options[max_script_bytes]"
