"""The Ray submission: golden files per run mode, quoting, MPI refusal and the state table."""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import shlex
import signal
import subprocess
import sys
import threading
import time

import pytest

from dlsched.errors import FailedPrecondition, InvalidArgument
from drivers.common import planner
from drivers.common.base import JobSpec, JobState, ReplicaGroup, Resources, RunMode
from drivers.ray import render, states

GOLDEN = pathlib.Path(__file__).parent / "golden" / "ray"
UPDATE = os.environ.get("DLSCHED_UPDATE_GOLDEN") == "1"
PY = sys.executable


def g(role: str, replicas: int = 1, ppr: int = 0, **res: object) -> ReplicaGroup:
    return ReplicaGroup(role=role, replicas=replicas, processes_per_replica=ppr,
                        command=("python3", "train.py"), args=("--epochs", "2"),
                        env={"USER_VAR": "x y"}, resources=Resources(**res))  # type: ignore[arg-type]


SPECS = {
    "single_process": JobSpec(RunMode.SINGLE_PROCESS, (ReplicaGroup(
        role="main", replicas=1, command=("python3", "train.py"), args=("--lr", "0.1"),
        env={"USER_VAR": "x y"}, working_dir="/data/project",
        resources=Resources(cpu=1.5, memory_bytes=1 << 30, gpus=1)),), time_limit_seconds=3600),
    "multi_process": JobSpec(RunMode.MULTI_PROCESS, (g("worker", replicas=2, ppr=2, cpu=1),)),
    "master_worker": JobSpec(RunMode.MASTER_WORKER, (g("master", cpu=1), g("worker", replicas=2, cpu=0.5))),
    "ps_worker": JobSpec(RunMode.PS_WORKER, (g("ps"), g("worker", replicas=2), g("chief"))),
}
OPTIONS = {"master_worker": {"placement_strategy": "SPREAD"}, "ps_worker": {"python": "/opt/py/bin/python"}}


@pytest.mark.parametrize("name", sorted(SPECS))
def test_golden(name):
    body = render.render_submission("golden-1", SPECS[name], 2, OPTIONS.get(name, {}))
    out = render.to_native_spec(body)
    path = GOLDEN / f"{name}.json"
    if UPDATE:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(out.content)
    assert out.media_type == "application/json"
    assert out.content == path.read_text(), f"update with DLSCHED_UPDATE_GOLDEN=1 ({path})"
    assert body["submission_id"] == "dlsched-golden-1-2"
    assert body["metadata"]["dlsched_job_id"] == "golden-1" and body["metadata"]["dlsched_attempt"] == "2"


def test_single_process_runs_under_the_launcher_with_its_resources():
    body = render.render_submission("j", SPECS["single_process"], 1)
    job = json.loads(body["runtime_env"]["env_vars"][render.JOB_ENV])
    assert job["mode"] == "local" and job["submission_id"] == "dlsched-j-1"
    assert render.spec_from_json(job["spec"]).replica_groups == SPECS["single_process"].replica_groups
    assert "working_dir" not in body["runtime_env"]  # a path on the nodes, not a URI
    assert shlex.split(body["entrypoint"]) == ["exec", "python", "-m", "drivers.ray.launcher"]  # no user value in it
    assert (body["entrypoint_num_cpus"], body["entrypoint_num_gpus"], body["entrypoint_memory"]) == (1.5, 1, 1 << 30)


def run_launcher(tmp_path: pathlib.Path, spec: JobSpec, sid: str = "dlsched-j-1",
                 env: dict[str, str] | None = None) -> tuple[int, pathlib.Path]:
    """The launcher run as Ray Jobs runs it: stdout to ``<logs>/job-driver-<sid>.log``; ``env``
    added to the environment it inherits (a Ray worker's)."""
    body = render.render_submission("j", spec, 1)
    logs = tmp_path / "logs"
    logs.mkdir(exist_ok=True)
    root = pathlib.Path(__file__).parent.parent
    with open(logs / f"job-driver-{sid}.log", "ab") as out:
        res = subprocess.run(["/bin/sh", "-c", body["entrypoint"].replace("python", shlex.quote(PY), 1)],
                             cwd=tmp_path, stdout=out, stderr=subprocess.STDOUT, timeout=60,
                             env={**os.environ, **(env or {}), **body["runtime_env"]["env_vars"],
                                  "PYTHONPATH": str(root)})
    return res.returncode, logs / "dlsched" / sid


def test_a_stop_that_reaches_the_entrypoints_shell_alone_ends_the_job(tmp_path):
    """Ray runs the entrypoint through /bin/sh; a stop that came as the job started signalled the
    shell alone (its children as of then: none yet), and the launcher the shell forked a moment
    later ran the whole job, untracked, after Ray and dlsched said STOPPED. The shell execs the
    launcher now: the entrypoint's pid is the launcher's, and its SIGTERM ends the job."""
    marker = tmp_path / "started"
    code = f"import pathlib, time\npathlib.Path({str(marker)!r}).write_text('x')\ntime.sleep(600)\n"
    spec = JobSpec(RunMode.SINGLE_PROCESS, (ReplicaGroup(role="main", replicas=1, command=(PY, "-c", code)),))
    body = render.render_submission("j", spec, 1)
    (tmp_path / "logs").mkdir()
    root = pathlib.Path(__file__).parent.parent
    with open(tmp_path / "logs" / "job-driver-dlsched-j-1.log", "ab") as out:
        sh = subprocess.Popen(["/bin/sh", "-c", body["entrypoint"].replace("python", shlex.quote(PY), 1)],
                              cwd=tmp_path, stdout=out, stderr=subprocess.STDOUT,
                              env={**os.environ, **body["runtime_env"]["env_vars"], "PYTHONPATH": str(root)})
    try:
        deadline = time.monotonic() + 120
        while not marker.exists():
            assert time.monotonic() < deadline and sh.poll() is None
            time.sleep(0.1)
        job_pids = [int(p) for p in os.listdir("/proc") if p.isdigit() and _mentions(int(p), str(marker))]
        assert job_pids
        sh.send_signal(signal.SIGTERM)  # the entrypoint's process alone, as Ray's racing stop
        sh.wait(60)
        deadline = time.monotonic() + 60
        while any(_mentions(p, str(marker)) for p in job_pids):
            assert time.monotonic() < deadline, "the job's process outlived the stop"
            time.sleep(0.1)
    finally:
        if sh.poll() is None:
            sh.kill()
        for p in [int(p) for p in os.listdir("/proc") if p.isdigit() and _mentions(int(p), str(marker))]:
            os.kill(p, signal.SIGKILL)


def _mentions(pid: int, text: str) -> bool:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return text.encode() in f.read()
    except OSError:
        return False


def lines(path: pathlib.Path) -> list[str]:
    """The texts of an output file (``<nanos> <text>`` lines), checking nanos increase and the ``eof`` end."""
    raw = path.read_text().split("\n")
    assert raw[-2:] == ["eof", ""], raw[-3:]
    stamps = [int(ln.split(" ", 1)[0]) for ln in raw[:-2]]
    assert stamps == sorted(set(stamps))
    return [ln.split(" ", 1)[1] for ln in raw[:-2]]


def test_launcher_keeps_stdout_and_stderr_apart_and_samples_usage(tmp_path):
    code = ("import os, sys, time\n"
            "print('out', os.environ['DLSCHED_JOB_ID'], os.environ['DLSCHED_ROLE'], os.environ['USER_VAR'])\n"
            "print('err line', file=sys.stderr)\n"
            # CPU time, not wall time: on a busy machine 1.5 s of wall clock gave 0.3 s of CPU
            "while time.process_time() < 1.5: pass\n"
            "sys.exit(3)\n")
    spec = JobSpec(RunMode.SINGLE_PROCESS, (ReplicaGroup(role="main", replicas=1, command=(PY, "-c", code),
                                                         env={"USER_VAR": "x y"}),))
    rc, out = run_launcher(tmp_path, spec)
    assert rc == 3
    assert lines(out / "main-0.out") == ["out j main x y"]
    assert lines(out / "main-0.err") == ["err line"]
    samples = [json.loads(ln) for ln in (out / "main-0.usage").read_text().splitlines()]
    assert samples[-1]["running"] is False and samples[-1]["cpu"] > 0.5
    assert any(s["running"] and s["rss"] > 0 for s in samples)
    manifest = [json.loads(ln) for ln in (out / "replicas.jsonl").read_text().splitlines()]
    assert manifest == [{"role": "main", "index": 0, "node_id": ""}, {"role": "main", "index": 0, "exit": 3}]
    driver_log = (tmp_path / "logs" / "job-driver-dlsched-j-1.log").read_text()
    assert "main-0 exited with code 3" in driver_log and "out j" not in driver_log


def test_a_long_line_of_multibyte_characters_is_cut_between_characters(tmp_path):
    """A line of 200,000 bytes of "é" without a newline is written in pieces: each piece valid
    UTF-8 (cut where a character starts), the pieces the line again (two halves of one "é" were
    two U+FFFD)."""
    code = "import sys; sys.stdout.write('x' + 'é' * 100000); sys.stdout.flush()"
    spec = JobSpec(RunMode.SINGLE_PROCESS, (ReplicaGroup(role="main", replicas=1, command=(PY, "-c", code)),))
    rc, out = run_launcher(tmp_path, spec)
    assert rc == 0
    raw = (out / "main-0.out").read_bytes().split(b"\n")
    texts = [ln.split(b" ", 1)[1] for ln in raw[:-2]]
    assert all(len(t) <= 64 * 1024 for t in texts) and len(texts) >= 3
    assert b"".join(t.decode("utf-8").encode() for t in texts) == ("x" + "é" * 100000).encode()


def test_what_a_process_leaves_in_its_group_ends_with_it_and_signals_start_unblocked(tmp_path):
    """A child left behind in the process's group (one that ignores SIGTERM) is killed when the
    process exits, as on local; and the process starts with no signal blocked (in a Ray task
    SIGINT came blocked)."""
    child = ("import signal, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
             f"open({str(tmp_path / 'child')!r}, 'w').write(str(__import__('os').getpid())); time.sleep(120)")
    script = (f"grep -E '^SigBlk' /proc/self/status; {shlex.quote(PY)} -c {shlex.quote(child)} >/dev/null 2>&1 & "
              f"while [ ! -s {tmp_path}/child ]; do sleep 0.1; done; exit 0")
    spec = JobSpec(RunMode.SINGLE_PROCESS, (ReplicaGroup(role="main", replicas=1, command=("/bin/sh", "-c", script)),))
    old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})  # as a Ray worker has it
    try:
        rc, out = run_launcher(tmp_path, spec)
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)
    assert rc == 0
    assert lines(out / "main-0.out") == ["SigBlk:\t0000000000000000"]
    pid = int((tmp_path / "child").read_text())
    deadline = time.monotonic() + 30
    while os.path.exists(f"/proc/{pid}") and open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] != "Z":
        assert time.monotonic() < deadline, "a child left in the process's group outlived it"
        time.sleep(0.1)


def test_a_job_sees_none_of_the_nodes_dlsched_names_only_its_own(tmp_path):
    """DLSCHED_* names are reserved (the planner's alone): what the Ray head was started with
    (its token and key files, here as the worker's environment has them) never reaches a job,
    whatever the case; the plan's do."""
    code = ("import os; print(' '.join(sorted(k for k in os.environ if k.upper().startswith('DLSCHED_'))));"
            " print(os.environ['HEAD_OTHER'])")
    spec = JobSpec(RunMode.SINGLE_PROCESS, (ReplicaGroup(role="main", replicas=1, command=(PY, "-c", code)),))
    rc, out = run_launcher(tmp_path, spec, env={"DLSCHED_ADMIN_TOKEN_FILE": "/head/admin-token",
                                                "DLSCHED_TLS_KEY_FILE": "/head/key.pem",
                                                "Dlsched_Mixed_Case": "x", "HEAD_OTHER": "kept"})
    assert rc == 0, (out / "main-0.err").read_text()
    assert lines(out / "main-0.out") == [
        "DLSCHED_JOB_ID DLSCHED_JOB_NAME DLSCHED_NUM_REPLICAS DLSCHED_REPLICA_INDEX DLSCHED_ROLE", "kept"]


def proc(index: int, code: str, *args: str, role: str = "main", **env: str) -> planner.ProcessLaunch:
    return planner.ProcessLaunch(role=role, replica_index=0, process_index=index, rank=index, slot_index=index,
                                 host="127.0.0.1", argv=(PY, "-c", code, *args), env=env, working_dir="")


@pytest.mark.parametrize("in_working_dir", [True, False])
def test_pwd_is_the_processs_working_directory(tmp_path, monkeypatch, in_working_dir):
    """PWD names where the process runs (its working_dir, else the launcher's), as a shell
    sets it on Slurm: not the PWD the Ray worker was started with."""
    from drivers.ray import launcher

    wd = tmp_path / "wd"
    wd.mkdir()
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PWD", "/stale/pwd/of/the/ray/worker")
    p = dataclasses.replace(proc(0, "import os; print(os.environ.get('PWD'), os.getcwd())"),
                            working_dir=str(wd) if in_working_dir else "")
    outputs = launcher.Outputs(str(tmp_path / "logs"), "sid")
    assert launcher.run_processes([p], lambda role: True, outputs) == (0, None)
    want = wd if in_working_dir else tmp_path
    assert lines(tmp_path / "logs" / "dlsched" / "sid" / "main-0.out") == [f"{want} {want}"]


def pumped(tmp_path: pathlib.Path, *writes: bytes) -> list[bytes]:
    """The texts ``launcher._pump`` writes for what a process wrote in ``writes``."""
    from drivers.ray import launcher

    r, w = os.pipe()
    path = tmp_path / "pumped.out"
    t = threading.Thread(target=launcher._pump, args=(r, str(path)))
    t.start()
    for data in writes:
        os.write(w, data)
    os.close(w)
    t.join(30)
    raw = path.read_bytes().split(b"\n")
    assert raw[-2:] == [b"eof", b""]
    return [ln.split(b" ", 1)[1] for ln in raw[:-2]]


def test_a_long_complete_line_is_cut_as_the_other_backends_cut_it(tmp_path):
    """A line of 64 KiB to 128 KiB with its newline in one read was one entry on Ray; local and
    Slurm cut it at the same bound (convert.pieces), between UTF-8 characters."""
    from drivers.common.convert import MAX_LINE_CHARS, pieces

    long_ascii, long_utf8 = b"z" * 100_000, ("é" * 40_000).encode()
    texts = pumped(tmp_path, b"head\n" + long_ascii + b"\n" + long_utf8 + b"\n")
    want = [b"head"]
    for line in (long_ascii, long_utf8):
        cuts, rest = pieces(line, MAX_LINE_CHARS)
        want += [*cuts, rest]
    assert texts == want
    assert [len(t) for t in texts] == [4, 65536, 34464, 65536, 14464]
    assert all(t.decode("utf-8") for t in texts)  # each piece whole characters


#: Counts its SIGTERMs in <dir>/terms-<name>; exits with $TERM_EXIT on one when set, else runs on.
#: <dir>/pid-<name> once it is up (its handler set).
TERM_PROBE = """
import os, signal, sys, time
d, name = sys.argv[1], sys.argv[2]
def term(*_):
    with open(os.path.join(d, 'terms-' + name), 'a') as f:
        f.write('T')
    if os.environ.get('TERM_EXIT'):
        os._exit(int(os.environ['TERM_EXIT']))
signal.signal(signal.SIGTERM, term)
with open(os.path.join(d, 'pid.tmp-' + name), 'w') as f:
    f.write(str(os.getpid()))
os.replace(os.path.join(d, 'pid.tmp-' + name), os.path.join(d, 'pid-' + name))
while True:
    time.sleep(0.1)
"""


def wait_for(path: pathlib.Path) -> str:
    deadline = time.monotonic() + 60
    while not (path.exists() and path.read_text()):
        assert time.monotonic() < deadline, f"{path} never came"
        time.sleep(0.05)
    return path.read_text()


class SupervisorStop(threading.Event):
    """A Ray stop as the launcher of a local-mode job sees it: its flag set (the launcher's own
    SIGTERM) with the SIGTERM Ray's job supervisor sends every descendant of the entrypoint, here
    sent to the process once it is up and handled (for one that exits on it: its exit waited for,
    not reaped) by the time the launcher sees the flag."""

    def __init__(self, d: pathlib.Path, exits: bool) -> None:
        super().__init__()
        self.d, self.exits = d, exits

    def is_set(self) -> bool:
        if not super().is_set() and (self.d / "pid-0").exists():
            pid = int((self.d / "pid-0").read_text())
            os.kill(pid, signal.SIGTERM)
            if self.exits:
                os.waitid(os.P_PID, pid, os.WEXITED | os.WNOWAIT)
            else:
                wait_for(self.d / "terms-0")
            self.set()
        return super().is_set()


def run_stopped(tmp_path: pathlib.Path, exits: bool) -> tuple[int, list[tuple[int, bool]]]:
    from drivers.ray import launcher

    ends: list[tuple[int, bool]] = []
    env = {"TERM_EXIT": "0"} if exits else {}
    rc, failed = launcher.run_processes(
        [proc(0, TERM_PROBE, str(tmp_path), "0", **env)], lambda role: True,
        launcher.Outputs(str(tmp_path / "logs"), "sid"), SupervisorStop(tmp_path, exits),
        lambda p, code, stopped: ends.append((code, stopped)), stop_signalled=True)
    assert failed is None
    return rc, ends


def test_a_stop_sends_the_processes_no_sigterm_beside_ray_s_own(tmp_path, monkeypatch):
    """Ray's job supervisor signals every descendant of the entrypoint: the launcher sent a
    second SIGTERM to each process (one on every other backend); it now only waits the grace
    and SIGKILLs what is left."""
    from drivers.ray import launcher

    monkeypatch.setattr(launcher, "STOP_GRACE_SECONDS", 3.0)
    rc, ends = run_stopped(tmp_path, exits=False)
    assert rc == 143
    assert (tmp_path / "terms-0").read_text() == "T"
    assert ends == [(128 + signal.SIGKILL, True)]


def test_no_process_is_started_once_the_stop_came(tmp_path):
    """A stop that came while the launcher was still starting processes: the rest are not
    started (Ray's supervisor signalled the processes there were; a later one would get no
    SIGTERM, only the SIGKILL after the grace)."""
    import threading

    from drivers.ray import launcher

    stop = threading.Event()
    stop.set()
    canary = tmp_path / "ran"
    rc, failed = launcher.run_processes(
        [proc(0, f"open({str(canary)!r}, 'w')")], lambda role: True,
        launcher.Outputs(str(tmp_path / "logs"), "sid"), stop, stop_signalled=True)
    assert not canary.exists() and failed is None


def test_a_process_that_exits_0_on_the_stops_sigterm_is_stopped_with_its_code(tmp_path):
    """A process whose end the launcher had not seen when the job was stopped is STOPPED with
    its exit code (as on local and Slurm), even when it exited 0 at once on the SIGTERM: it
    was recorded as having exited by itself (SUCCEEDED)."""
    rc, ends = run_stopped(tmp_path, exits=True)
    assert rc == 143
    assert ends == [(0, True)]


def test_a_replicas_task_returns_each_processs_own_end(tmp_path, monkeypatch):
    """Placement-group mode: a process of a replica failing stops its siblings, each recorded
    with its own code, stopped (the entrypoint had written exit 0, SUCCEEDED, for every process
    of the replica but the failed one)."""
    from drivers.ray import launcher

    monkeypatch.setattr(launcher, "ray_logs_dir", lambda: str(tmp_path / "logs"))
    fail = ("import sys, time; from pathlib import Path; p = Path(sys.argv[1]) / 'pid-0'\n"
            "while not p.exists(): time.sleep(0.05)\n"
            "sys.exit(3)")
    procs = [proc(0, TERM_PROBE, str(tmp_path), "0", role="master", TERM_EXIT="143"),
             proc(1, fail, str(tmp_path), role="master")]
    rc, role, index, ends = launcher.run_replica("sid", procs)
    assert (rc, role, index) == (3, "master", 1)
    assert sorted((p.role, p.slot_index, code, stopped) for p, code, stopped in ends) == [
        ("master", 0, 143, True), ("master", 1, 3, False)]


def test_a_cancelled_replicas_task_stops_its_processes_and_returns_their_ends(tmp_path, monkeypatch):
    """Ray's cancel of a replica's task (the job was decided by another replica) interrupts the
    task's main thread: its processes are stopped (SIGTERM, the grace) and the task returns
    their ends for the manifest (they had none: STOPPED without an exit code)."""
    import _thread

    from drivers.ray import launcher

    monkeypatch.setattr(launcher, "ray_logs_dir", lambda: str(tmp_path / "logs"))
    before = signal.getsignal(signal.SIGINT)  # (ignored when the tests run in a background job)

    def cancel() -> None:
        wait_for(tmp_path / "pid-0")
        _thread.interrupt_main()  # what ray.cancel does to a running task

    t = threading.Thread(target=cancel, daemon=True)
    t.start()
    try:
        rc, role, index, ends = launcher.run_replica("sid", [proc(0, TERM_PROBE, str(tmp_path), "0",
                                                                  role="worker", TERM_EXIT="143")])
    except KeyboardInterrupt:
        pytest.fail("the cancel went through the task as KeyboardInterrupt")
    t.join(30)
    assert (rc, role, index) == (143, "", -1)
    assert [(p.role, p.slot_index, code, stopped) for p, code, stopped in ends] == [("worker", 0, 143, True)]
    assert (tmp_path / "terms-0").read_text() == "T"
    assert signal.getsignal(signal.SIGINT) is before  # the worker's own again


def test_launcher_job_round_trips_the_spec():
    body = render.render_submission("j", SPECS["master_worker"], 1)
    job = json.loads(body["runtime_env"]["env_vars"][render.JOB_ENV])
    assert job["mode"] == "placement-group" and job["job_id"] == "j"
    assert render.spec_from_json(job["spec"]) == SPECS["master_worker"]
    assert "entrypoint_num_cpus" not in body  # the bundles hold the replicas' resources


def test_the_job_reaches_the_launcher_with_no_dollar_ray_would_expand():
    """Ray runs os.path.expandvars on env_vars values and deletes an unknown ${VAR}: the job's
    JSON there holds no '$', and reads back as sent."""
    args = ("$HOME", "${HOME}", "${NOPE_XYZ}", "price: $5", "x\\${HOME}", "$$", "\\$")
    spec = JobSpec(RunMode.SINGLE_PROCESS, (ReplicaGroup(
        role="main", replicas=1, command=("echo", *args), env={"E": "${HOME}/d $X"}),))
    value = render.render_submission("j", spec, 1)["runtime_env"]["env_vars"][render.JOB_ENV]
    assert "$" not in value
    assert render.spec_from_json(json.loads(value)["spec"]) == spec


def test_a_job_past_linuxs_limit_per_string_is_refused_naming_the_field():
    """Ray passes the runtime_env to each worker on its command line, one string of at most
    128 KiB: a job of 3 x 60,000 bytes of arguments kept Ray's workers from starting (FAILED
    after ~6 minutes). Past ``MAX_JOB_ENV_BYTES`` encoded ('$' and non-ASCII take 6 bytes) it is
    INVALID_ARGUMENT at once, naming the field; below, the job reads back as sent."""
    near = JobSpec(RunMode.SINGLE_PROCESS, (ReplicaGroup(
        role="main", replicas=1, command=("echo", "a" * 50_000, "$" * 8_000, "\u00e9" * 1_000)),))
    env = render.render_submission("j", near, 1)["runtime_env"]["env_vars"]
    assert list(env) == [render.JOB_ENV, render.STOP_WAIT_ENV] and 100_000 < len(env[render.JOB_ENV]) <= render.MAX_JOB_ENV_BYTES
    assert render.spec_from_json(render.job_from_env(env)["spec"]) == near
    for over in (("a" * 60_000,) * 3, ("a" * 60_000, "$" * 10_000), ("\u00e9" * 20_000,)):
        spec = JobSpec(RunMode.SINGLE_PROCESS, (ReplicaGroup(role="main", replicas=1, command=("echo", *over)),))
        with pytest.raises(InvalidArgument) as ei:
            render.render_submission("j", spec, 1)
        assert ei.value.violations[0].field == "spec.replica_groups", ei.value


def test_uri_working_dir_goes_to_runtime_env():
    spec = JobSpec(RunMode.SINGLE_PROCESS, (ReplicaGroup(role="main", replicas=1, command=("ls",),
                                                         working_dir="s3://bucket/code.zip"),))
    body = render.render_submission("j", spec, 1)
    assert body["runtime_env"]["working_dir"] == "s3://bucket/code.zip"


def test_mpi_is_refused_with_a_reason():
    spec = JobSpec(RunMode.MPI, (g("launcher"), g("worker", replicas=2)))
    with pytest.raises(FailedPrecondition) as e:
        render.render_submission("j", spec, 1)
    assert e.value.reason == "MPI_NOT_SUPPORTED" and "not supported" in e.value.message


@pytest.mark.parametrize(("options", "field"), [
    ({"placement_strategy": "ANYWHERE"}, "cluster.options[placement_strategy]"),
    ({"python": ""}, "cluster.options[python]"),
])
def test_bad_options_are_invalid_argument(options, field):
    with pytest.raises(InvalidArgument) as e:
        render.render_submission("j", SPECS["master_worker"], 1, options)
    assert [v.field for v in e.value.violations] == [field]


def test_a_group_naming_an_image_is_refused_naming_it():
    """A Ray job runs in the cluster's own environment: an image was silently not used."""
    import dataclasses
    spec = SPECS["master_worker"]
    spec = dataclasses.replace(spec, replica_groups=(
        spec.replica_groups[0], dataclasses.replace(spec.replica_groups[1], image="pytorch/pytorch:2")))
    with pytest.raises(InvalidArgument) as e:
        render.render_submission("j", spec, 1)
    assert [v.field for v in e.value.violations] == ["spec.replica_groups[1].image"]


def test_invalid_run_mode_structure_is_invalid_argument():
    with pytest.raises(InvalidArgument):
        render.render_submission("j", JobSpec(RunMode.MASTER_WORKER, (g("worker"),)), 1)


HOSTILE = ["$(touch CANARY)", "`touch CANARY`", "'; touch CANARY; '", '"; touch CANARY; "',
           "a\ntouch CANARY", "-rf", "--", "$HOME ${PATH}", "ünï©ødé ✓", "", "|| touch CANARY &",
           "> CANARY", "a' \"b", "back\\slash", "*", "~"]


def test_hostile_argv_and_working_dir_reach_the_program_byte_for_byte(tmp_path):
    wd = tmp_path / "dir 'q' $(touch CANARY)\nnl"
    wd.mkdir()
    code = "import json, os, sys; print(json.dumps({'argv': sys.argv[1:], 'cwd': os.getcwd()}))"
    spec = JobSpec(RunMode.SINGLE_PROCESS, (ReplicaGroup(role="main", replicas=1, command=(PY, "-c", code),
                                                         args=tuple(HOSTILE), working_dir=str(wd)),))
    body = render.render_submission("j", spec, 1)
    assert not any(h in body["entrypoint"] for h in HOSTILE if h)  # user values travel as JSON in the env
    rc, out = run_launcher(tmp_path, spec)
    assert rc == 0, (out / "main-0.err").read_text()
    assert json.loads(lines(out / "main-0.out")[0]) == {"argv": HOSTILE, "cwd": str(wd)}
    assert not list(tmp_path.rglob("CANARY"))


@pytest.mark.parametrize(("status", "error_type", "want"), [
    ("PENDING", None, (JobState.PENDING, "Pending")),
    ("RUNNING", None, (JobState.RUNNING, "Running")),
    ("STOPPED", None, (JobState.STOPPED, "Stopped")),
    ("SUCCEEDED", None, (JobState.SUCCEEDED, "Completed")),
    ("FAILED", "JOB_ENTRYPOINT_COMMAND_ERROR", (JobState.FAILED, "JobEntrypointCommandError")),
    ("FAILED", None, (JobState.FAILED, "Failed")),
    ("SOMETHING_NEW", None, (JobState.PENDING, "Unknown")),
    (None, None, (JobState.PENDING, "Unknown")),
])
def test_state_table(status, error_type, want):
    assert states.map_status(status, error_type) == want


# --------------------------------------------------------------------------- whose submission a listed one is

def _listed(sid: str, attempt: str, uid: str = "", start: int = 1000) -> dict:
    meta = {"dlsched_job_id": "victim", "dlsched_attempt": attempt, **({"dlsched_job_uid": uid} if uid else {})}
    return {"type": "SUBMISSION", "submission_id": sid, "status": "SUCCEEDED", "start_time": start, "metadata": meta}


def test_a_submission_under_an_id_its_metadata_does_not_derive_is_not_ours():
    """Anything in the cluster may POST to the dashboard with our metadata: only the id a
    driver gives a submission (with the uid, or the id made before ids named uids) is one."""
    assert render.parse_submission(_listed("anything", "1")) is None
    assert render.parse_submission(_listed("anything", "1", uid="u-1")) is None
    assert render.parse_submission(_listed("dlsched-victim-1_u1", "1")) is None  # the id names a uid it lacks
    assert render.parse_submission(_listed("dlsched-victim-1_u2", "1", uid="u1")) is None
    assert render.parse_submission(_listed("dlsched-victim-2_u1", "1", uid="u1")) is None
    assert render.parse_submission(_listed("dlsched-victim-1_u1", "1", uid="u-1")) == render.SubmissionMeta(
        "victim", 1, "dlsched-victim-1_u1", "u-1")
    assert render.parse_submission(_listed("dlsched-victim-1", "1", uid="u1")) is not None  # before ids named uids
    assert render.parse_submission(_listed("dlsched-victim-1", "1")) is not None


def test_a_tracked_job_with_a_uid_follows_only_its_own_submissions():
    """A uid-less submission of the tracked job's id and attempt, started later (a forged one,
    or another job's), is never followed as the job; nor one of its uid under another id than
    the driver's (``of_job``), except the one followed already (adopted from an earlier driver)."""
    from drivers.common.base import JobObservation, JobState
    from drivers.ray.parse import newest_submission, of_job

    mine = _listed("dlsched-victim-1_u1", "1", uid="u1")
    prev = JobObservation(job_id="victim", backend_job_id="dlsched-victim-1_u1", found=True,
                          state=JobState.RUNNING, attempt=1, uid="u1")
    for forged in (_listed("dlsched-victim-1", "1", start=2000), _listed("dlsched-victim-2", "2", start=2000)):
        subs = [(m, it) for it in (mine, forged) if (m := render.parse_submission(it)) is not None]
        assert len(subs) == 2
        meta, it = newest_submission(prev, subs)
        assert it is mine and meta.submission_id == "dlsched-victim-1_u1"
        assert not of_job(prev, subs[1][0])
    assert not of_job(prev, render.SubmissionMeta("victim", 1, "anything", "u1"))
    assert of_job(prev, render.SubmissionMeta("victim", 2, "dlsched-victim-2_u1", "u-1"))
    adopted = JobObservation(job_id="victim", backend_job_id="dlsched-victim-1", found=True,
                             state=JobState.RUNNING, attempt=1, uid="u1")
    assert of_job(adopted, render.SubmissionMeta("victim", 1, "dlsched-victim-1", "u1"))
    assert not of_job(adopted, render.SubmissionMeta("victim", 2, "dlsched-victim-2", "u1"))


def test_local_mode_replicas_get_their_own_share_of_the_entrypoints_gpus():
    """MULTI_PROCESS on Ray: the entrypoint holds every replica's GPUs (Ray lists them in its
    CUDA_VISIBLE_DEVICES); each replica gets its own share, as on the other backends (both
    replicas of 1 GPU each saw '0,1', so code using cuda:0 put them on one GPU)."""
    from drivers.ray import launcher

    spec = JobSpec(RunMode.MULTI_PROCESS, (dataclasses.replace(
        g("worker", replicas=2), resources=Resources(gpus=1)),))
    layout_ = [("worker", 0), ("worker", 1)]
    assert launcher.local_gpus(spec, layout_, "0,1") == [("0",), ("1",)]
    assert launcher.local_gpus(spec, layout_, "3,5,7") == [("3",), ("5",)]
    assert launcher.local_gpus(spec, layout_, "") == [(), ()]  # none listed: inherited as they are
    two = JobSpec(RunMode.MULTI_PROCESS, (dataclasses.replace(
        g("worker", replicas=2), resources=Resources(gpus=2)),))
    assert launcher.local_gpus(two, layout_, "0,1,2,3") == [("0", "1"), ("2", "3")]
    plan = planner.plan_job("j", spec, [planner.Placement(r, i, "127.0.0.1", 0, 1000 + i, gpus=share)
                                        for (r, i), share in zip(layout_, launcher.local_gpus(spec, layout_, "0,1"), strict=True)])
    assert [p.env["CUDA_VISIBLE_DEVICES"] for p in plan.processes] == ["0", "1"]


def test_a_traceback_in_rays_message_reaches_the_job_as_its_error_line():
    """Ray's message for a runtime_env that failed holds a Python traceback (frames of files on
    the Ray host): the job's message keeps what came before it and the error, no frames."""
    from drivers.ray import parse

    text = ("Failed to set up runtime environment.\nTraceback (most recent call last):\n"
            '  File "/work/main/.venv/lib/python3.11/site-packages/ray/_private/runtime_env/agent.py", '
            "line 1, in setup\n    raise ValueError(uri)\nValueError: Invalid protocol for runtime_env URI foo://bar\n")
    obs = parse.observation("j", 1, {"submission_id": "s", "status": "FAILED", "message": text,
                                     "error_type": "RUNTIME_ENV_SETUP_FAILED"})
    assert obs.message == ("Failed to set up runtime environment. "
                           "ValueError: Invalid protocol for runtime_env URI foo://bar")
    logs_after = parse.observation("j", 1, {"submission_id": "s", "status": "FAILED", "message": (
        "Job entrypoint command failed. Last available logs:\nTraceback (most recent call last):\n"
        '  File "/x.py", line 1, in <module>\nKeyError: \'a\'\nlast line of the job\n')})
    assert logs_after.message == "Job entrypoint command failed. Last available logs: KeyError: 'a'"
    plain = parse.observation("j", 1, {"submission_id": "s", "status": "FAILED", "message": "x" * 5000})
    assert len(plain.message) == parse.MESSAGE_LIMIT + len(" ...")


async def test_a_call_on_a_connection_replaced_meanwhile_is_unavailable_not_internal():
    """A cluster configured anew (ClusterManager resends its config while the Ray head is
    frozen) closes the old connection under calls still running on it: aiohttp's "Session is
    closed" reached the client as INTERNAL with a traceback in the log."""
    from dlsched.errors import Unavailable
    from drivers.common.base import ClusterConfig
    from drivers.ray.api import RayApi

    api = RayApi(ClusterConfig(name="clusters/r", address="http://127.0.0.1:9"), 5)
    await api.close()
    for call in (api.request("GET", "/api/jobs/x"), api.read_file("n", "f")):
        with pytest.raises(Unavailable) as e:
            await call
        assert e.value.reason == "BACKEND_UNAVAILABLE" and "replaced" in e.value.message


def test_a_job_ended_by_a_signal_reads_128_plus_n_as_on_every_backend():
    """Ray's driver_exit_code is -N for a signal N (seen -15 after a stop's SIGTERM): 128+N."""
    from drivers.ray import parse

    for ray_code, ours in ((-15, 143), (-9, 137), (0, 0), (3, 3)):
        it = {"submission_id": "dlsched-j-1", "status": "FAILED", "driver_exit_code": ray_code,
              "start_time": 1000, "end_time": 2000}
        assert parse.observation("j", 1, it).exit_code == ours, ray_code
