"""The dlsched CLI end to end: a real stack, the CLI as a subprocess.

One stack (etcd, ClusterManager, local driver, JobManager as processes) serves
the module; cluster ``local`` is registered through the SDK. The last test
runs ``dlsched up`` itself and checks it leaves nothing running.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import pathlib
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from typing import NoReturn

import pytest
import yaml

from dlsched.client import ClusterManagerClient, JobFileError, JobManagerClient, load_job_file
from dlsched.v1 import cluster_pb2, job_pb2
from tests.harness import ROOT, EtcdServer, Stack

EXAMPLES = ROOT / "examples"


def _uid(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:6]}"


async def _register_local(cm_address: str, driver_address: str) -> None:
    async with ClusterManagerClient(cm_address) as cm:
        await cm.create_cluster("local", cluster_pb2.Cluster(
            type=job_pb2.CLUSTER_TYPE_LOCAL, driver_address=driver_address))
        await cm.wait_cluster_state("local", timeout=30)


@pytest.fixture(scope="module")
def stack(etcd: EtcdServer) -> Iterator[Stack]:
    s = Stack(etcd, f"/dlsched-cli-{uuid.uuid4().hex[:8]}/")
    try:
        s.start()
        assert s.jm is not None
        asyncio.run(_register_local(s.cm.address, s.driver.address))
        yield s
    finally:
        s.stop()


#: ``python -c`` that runs ``python -m dlsched ARGS`` with SIGINT as a terminal's foreground job
#: has it (a shell running the suite in the background hands its children SIGINT ignored, and
#: Python keeps it so). Not a ``preexec_fn``: that makes subprocess fork() instead of vfork(),
#: and fork() runs gRPC's fork handlers in the child, whose restarted poller then finds its epoll
#: descriptor closed before exec and aborts the child ("epoll_wait error: Bad file descriptor").
_INTERRUPTIBLE = ("import runpy, signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler); "
                  "sys.argv[0] = 'dlsched'; runpy.run_module('dlsched', run_name='__main__', alter_sys=True)")


def _env() -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}
    for k in ("DLSCHED_SERVER", "DLSCHED_CLUSTER_MANAGER", "DLSCHED_DEBUG"):
        env.pop(k, None)
    return env


def cli(stack: Stack, *args: str, timeout: float = 90, stdin: str | None = None,
        ) -> subprocess.CompletedProcess[str]:
    assert stack.jm is not None
    r = subprocess.run(
        [sys.executable, "-m", "dlsched", "--server", stack.jm.address,
         "--cluster-manager", stack.cm.address, *args],
        capture_output=True, text=True, timeout=timeout, cwd=ROOT, env=_env(), input=stdin)
    assert "Traceback" not in r.stderr, r.stderr
    return r


def wait_job(stack: Stack, job_id: str, states: set[int], timeout: float = 60) -> job_pb2.Job:
    async def go() -> job_pb2.Job:
        assert stack.jm is not None
        async with JobManagerClient(stack.jm.address) as jm:
            deadline = time.monotonic() + timeout
            while True:
                job = await jm.get_job(job_id)
                if job.state in states:
                    return job
                if time.monotonic() > deadline:
                    raise AssertionError(f"{job_id} is {job_pb2.JobState.Name(job.state)}")
                await asyncio.sleep(0.1)

    return asyncio.run(go())


def write_job(tmp_path: pathlib.Path, doc: dict[str, object]) -> str:
    p = tmp_path / f"{uuid.uuid4().hex[:6]}.yaml"
    p.write_text(yaml.safe_dump(doc))
    return str(p)


def single(command: list[str], **group: object) -> dict[str, object]:
    return {"runMode": "SINGLE_PROCESS", "clusterSelector": {"clusterType": "local"},
            "replicaGroups": [{"role": "main", "replicas": 1, "command": command,
                               "workingDir": str(EXAMPLES), **group}]}


HELLO_LINES = [f"line {i} of 5" for i in range(1, 6)]


# --------------------------------------------------------------------------- job files


def test_job_file_shorthands_parse_into_the_spec(tmp_path: pathlib.Path) -> None:
    p = tmp_path / "job.yaml"
    p.write_text(
        "jobId: train-1\n"
        "run_mode: multi_process\n"
        "timeLimit: 1h30m\n"
        "clusterSelector: {clusterType: local, labels: {zone: 1}}\n"
        "replicaGroups:\n"
        "  - role: worker\n"
        "    replicas: 2\n"
        "    command: python3 train.py --lr 0.1\n"
        "    workingDir: code\n"
        "    env: {SEED: 7, DEBUG: true}\n"
        "    resources: {cpu: 1.5, memory: 4Gi, gpus: 1}\n")
    job_id, spec = load_job_file(p)
    assert job_id == "train-1"
    assert spec.run_mode == job_pb2.RUN_MODE_MULTI_PROCESS
    assert spec.time_limit.seconds == 5400
    assert spec.cluster_selector.cluster_type == job_pb2.CLUSTER_TYPE_LOCAL
    assert dict(spec.cluster_selector.labels) == {"zone": "1"}
    g = spec.replica_groups[0]
    assert list(g.command) == ["python3", "train.py", "--lr", "0.1"]
    assert g.working_dir == str(tmp_path / "code")
    assert dict(g.env) == {"SEED": "7", "DEBUG": "true"}
    assert g.resources.memory_bytes == 4 * 2**30 and g.resources.gpus == 1

    # The proto JSON form itself (what `get -o yaml` prints) reads back the same.
    p.write_text(yaml.safe_dump({"name": "jobs/train-1", "spec": {
        "runMode": "RUN_MODE_MULTI_PROCESS", "timeLimit": "5400s",
        "replicaGroups": [{"role": "worker", "replicas": 2, "command": ["true"],
                           "resources": {"memoryBytes": "4294967296"}}]}}))
    job_id, again = load_job_file(p)
    assert job_id == "train-1"
    assert again.time_limit.seconds == 5400
    assert again.replica_groups[0].resources.memory_bytes == 4 * 2**30


@pytest.mark.parametrize(("text", "field"), [
    ("runMode: SOMETIMES\n", "runMode"),
    ("runMode: SINGLE_PROCESS\nreplicaGroups: [{role: main, memory: 1Gi}]\n",
     "replicaGroups[0].memory"),
    ("replicaGroups: [{resources: {memory: 4Xi}}]\n", "replicaGroups[0].resources.memory"),
    ("timeLimit: soon\n", "timeLimit"),
    ("replicaGroups: [{env: [A, B]}]\n", "replicaGroups[0].env"),
    ("replicaGroups: [{command: \"echo 'unbalanced\"}]\n", "replicaGroups[0].command"),  # was a ValueError
])
def test_job_file_errors_name_the_key(tmp_path: pathlib.Path, text: str, field: str) -> None:
    p = tmp_path / "bad.yaml"
    p.write_text(text)
    with pytest.raises(JobFileError) as info:
        load_job_file(p)
    assert info.value.field == field
    assert info.value.reason == "INVALID_JOB_FILE"


def test_a_job_file_that_is_not_utf8_or_names_a_key_twice_is_a_job_file_error(tmp_path: pathlib.Path) -> None:
    """Bytes that are not UTF-8: INVALID_JOB_FILE (it was INTERNAL CLIENT_ERROR). A key given
    twice: refused, naming it (YAML kept the last: SINGLE_PROCESS then MPI was an MPI job)."""
    binary = tmp_path / "binary.yaml"
    binary.write_bytes(b"runMode: \xff\xfe\n")
    with pytest.raises(JobFileError) as info:
        load_job_file(binary)
    assert info.value.reason == "INVALID_JOB_FILE" and "UTF-8" in info.value.message
    twice = tmp_path / "twice.yaml"
    twice.write_text("runMode: SINGLE_PROCESS\nreplicaGroups: [{role: main, command: [x]}]\nrunMode: MPI\n")
    with pytest.raises(JobFileError) as info:
        load_job_file(twice)
    assert "runMode" in info.value.message and "twice" in info.value.message
    # YAML merge keys still load (a key the mapping gives again overrides the merged one).
    merged = tmp_path / "merged.yaml"
    merged.write_text("runMode: SINGLE_PROCESS\nreplicaGroups:\n  - &base {role: main, command: [x], replicas: 2}\n"
                      "labels:\n  <<: {team: a, tier: b}\n  tier: c\n")
    _, spec = load_job_file(merged)
    assert dict(spec.labels) == {"team": "a", "tier": "c"}, spec.labels
    # A file that is no job file (a secret given by mistake): its text is not echoed as a key.
    secret = tmp_path / "shadow"
    secret.write_text("root:$y$j9T$hunter2hash: 19000\n")
    with pytest.raises(JobFileError) as info:
        load_job_file(secret)
    assert "hunter2" not in str(info.value) and info.value.field == "<key>", info.value
    r = subprocess.run([sys.executable, "-m", "dlsched", "--server", "127.0.0.1:1", "submit", str(binary)],
                       capture_output=True, text=True, timeout=30, cwd=ROOT, env=_env())
    assert r.returncode == 1 and r.stderr.startswith("error: INVALID_ARGUMENT INVALID_JOB_FILE:"), r.stderr


# --------------------------------------------------------------------------- jobs


def test_submit_follow_streams_logs_and_exits_0_on_success(stack: Stack) -> None:
    job_id = _uid("hello")
    r = cli(stack, "submit", "examples/hello.yaml", "--follow", "--id", job_id)
    assert r.returncode == 0, r.stdout + r.stderr
    for line in HELLO_LINES:
        assert line in r.stdout
    assert "hello: done" in r.stdout
    last = r.stdout.strip().splitlines()[-1]
    assert f"jobs/{job_id}" in last and "SUCCEEDED" in last
    # Logs stream as they are written: the lines come in order.
    positions = [r.stdout.index(line) for line in HELLO_LINES]
    assert positions == sorted(positions)


def test_submit_follow_of_a_failing_job_exits_non_zero(stack: Stack, tmp_path: pathlib.Path) -> None:
    job_id = _uid("fail")
    path = write_job(tmp_path, single(["python3", "programs/fail.py"]))
    r = cli(stack, "submit", path, "--follow", "--id", job_id)
    assert r.returncode != 0
    assert "about to fail" in r.stdout
    assert "something went wrong" in r.stderr
    assert "FAILED" in r.stdout.strip().splitlines()[-1]
    assert "exit_code=3" in r.stdout

    only_err = cli(stack, "logs", job_id, "--stream", "stderr")
    assert only_err.returncode == 0
    assert "something went wrong" in only_err.stderr
    assert "about to fail" not in only_err.stdout + only_err.stderr


def test_get_list_and_logs_tail(stack: Stack) -> None:
    job_id = _uid("hello")
    r = cli(stack, "submit", "examples/hello.yaml", "--id", job_id)
    assert r.returncode == 0, r.stderr
    assert f"jobs/{job_id}" in r.stdout
    wait_job(stack, job_id, {job_pb2.JOB_STATE_SUCCEEDED})

    got = cli(stack, "get", job_id)
    assert got.returncode == 0, got.stderr
    assert f"jobs/{job_id}" in got.stdout and "SUCCEEDED" in got.stdout

    got_json = json.loads(cli(stack, "get", f"jobs/{job_id}", "-o", "json").stdout)
    assert got_json["name"] == f"jobs/{job_id}"
    assert got_json["state"] == "JOB_STATE_SUCCEEDED"
    assert got_json["spec"]["runMode"] == "RUN_MODE_SINGLE_PROCESS"

    listed = cli(stack, "list", "-o", "json")
    assert listed.returncode == 0, listed.stderr
    names = [j["name"] for j in json.loads(listed.stdout)["jobs"]]
    assert f"jobs/{job_id}" in names

    table = cli(stack, "list", "--filter", "state=SUCCEEDED")
    assert table.returncode == 0, table.stderr
    assert table.stdout.startswith("NAME")
    assert f"jobs/{job_id}" in table.stdout

    as_yaml = yaml.safe_load(cli(stack, "list", "-o", "yaml").stdout)
    assert f"jobs/{job_id}" in [j["name"] for j in as_yaml["jobs"]]

    tail = cli(stack, "logs", job_id, "--tail", "2")
    assert tail.returncode == 0, tail.stderr
    assert tail.stdout.splitlines() == ["hello from jobs/" + job_id + ": line 5 of 5", "hello: done"]

    everything = cli(stack, "logs", job_id)
    assert [ln for ln in everything.stdout.splitlines() if "line" in ln] == [
        f"hello from jobs/{job_id}: {line}" for line in HELLO_LINES]

    future = cli(stack, "logs", job_id, "--since", "2999-01-01T00:00:00Z")
    assert future.returncode == 0 and future.stdout == ""
    recent = cli(stack, "logs", job_id, "--since", "10m")
    assert "hello: done" in recent.stdout


def _cli_on_a_terminal(stack: Stack, *args: str, timeout: float = 90) -> tuple[int, bytes]:
    """The CLI with its standard output and error on a pseudo-terminal: exit code, bytes shown."""
    import pty
    import select

    assert stack.jm is not None
    primary, secondary = pty.openpty()
    proc = subprocess.Popen([sys.executable, "-m", "dlsched", "--server", stack.jm.address,
                             "--cluster-manager", stack.cm.address, *args],
                            stdout=secondary, stderr=secondary, stdin=subprocess.DEVNULL,
                            cwd=ROOT, env=_env())
    os.close(secondary)
    out = b""
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([primary], [], [], 0.2)
            if ready:
                try:
                    chunk = os.read(primary, 65536)
                except OSError:  # the terminal closed: the CLI has exited
                    break
                if not chunk:
                    break
                out += chunk
            elif proc.poll() is not None:
                break
        return proc.wait(timeout=30), out
    finally:
        os.close(primary)
        if proc.poll() is None:
            proc.kill()


def test_a_jobs_control_characters_are_shown_not_acted_on_by_a_terminal(stack: Stack, tmp_path: pathlib.Path) -> None:
    """A hostile job's log line (ESC sequences retitling the window, a carriage return forging
    the line) reaches a terminal as visible escapes; a pipe gets the bytes as they are. Counts
    past int32 and durations past the calendar are refused by the command line, no traceback."""
    job_id = _uid("ansi")
    code = "print('\\x1b]0;pwned\\x07ok\\rforged\\x1b[2J', flush=True)"
    r = cli(stack, "submit", write_job(tmp_path, single(["python3", "-c", code])), "--id", job_id)
    assert r.returncode == 0, r.stderr
    wait_job(stack, job_id, {job_pb2.JOB_STATE_SUCCEEDED})
    rc, shown = _cli_on_a_terminal(stack, "logs", job_id)
    assert rc == 0, shown
    assert b"\x1b" not in shown and b"\x07" not in shown, shown
    assert b"\\x1b]0;pwned\\x07ok\\x0dforged\\x1b[2J" in shown, shown
    piped = subprocess.run([sys.executable, "-m", "dlsched", "--server", stack.jm.address, "logs", job_id],
                           capture_output=True, timeout=90, cwd=ROOT, env=_env())
    assert b"\x1b]0;pwned\x07ok\rforged\x1b[2J" in piped.stdout
    for bad in (("logs", job_id, "--tail", "3000000000"), ("logs", job_id, "--replica", "main/99999999999"),
                ("logs", job_id, "--since", "1000000000d")):
        r = cli(stack, *bad)
        assert r.returncode == 2 and "error" in r.stderr, (bad, r.stderr)


def test_usage_stop_and_delete(stack: Stack, tmp_path: pathlib.Path) -> None:
    job_id = _uid("sleeper")
    path = write_job(tmp_path, single(["python3", "-c", "import time; print('up', flush=True); time.sleep(120)"]))
    assert cli(stack, "submit", path, "--id", job_id).returncode == 0
    wait_job(stack, job_id, {job_pb2.JOB_STATE_RUNNING})

    usage = cli(stack, "usage", job_id)
    assert usage.returncode == 0, usage.stderr
    assert "main/0" in usage.stdout
    usage_json = json.loads(cli(stack, "usage", job_id, "-o", "json").stdout)
    assert usage_json["replicas"][0]["role"] == "main"

    stop = cli(stack, "stop", job_id)
    assert stop.returncode == 0, stop.stderr
    assert f"jobs/{job_id}" in stop.stdout
    job = wait_job(stack, job_id, {job_pb2.JOB_STATE_STOPPED}, timeout=30)
    assert job.state == job_pb2.JOB_STATE_STOPPED

    # Stopping an ended job returns it unchanged.
    again = cli(stack, "stop", job_id)
    assert again.returncode == 0 and "STOPPED" in again.stdout

    delete = cli(stack, "delete", job_id)
    assert delete.returncode == 0, delete.stderr
    gone = cli(stack, "get", job_id)
    assert gone.returncode == 1
    assert gone.stderr.startswith("error: NOT_FOUND JOB_NOT_FOUND:"), gone.stderr
    assert cli(stack, "delete", job_id, "--allow-missing").returncode == 0


def test_dry_run_shows_the_native_spec_and_stores_nothing(stack: Stack) -> None:
    job_id = _uid("dry")
    r = cli(stack, "submit", "examples/hello.yaml", "--dry-run", "--id", job_id)
    assert r.returncode == 0, r.stderr
    assert "clusters/local" in r.stdout
    assert "application/json" in r.stdout
    assert "programs/hello.py" in r.stdout  # the native argv
    as_json = json.loads(cli(stack, "submit", "examples/hello.yaml", "--dry-run", "--id", job_id,
                             "-o", "json").stdout)
    assert as_json["dryRun"]["cluster"] == "clusters/local"
    assert json.loads(as_json["dryRun"]["nativeSpec"]["content"])
    assert cli(stack, "get", job_id).returncode == 1


def test_invalid_spec_prints_invalid_argument_and_the_field(stack: Stack,
                                                            tmp_path: pathlib.Path) -> None:
    path = write_job(tmp_path, single([]))
    r = cli(stack, "submit", path)
    assert r.returncode == 1
    assert r.stderr.startswith("error: INVALID_ARGUMENT "), r.stderr
    assert "replica_groups[0].command" in r.stderr
    assert r.stdout == ""

    bad_mode = write_job(tmp_path, {**single(["true"]), "runMode": "SINGLE_PROCESS",
                                    "replicaGroups": [{"role": "main", "replicas": 2,
                                                       "command": ["true"]}]})
    r = cli(stack, "submit", bad_mode)
    assert r.returncode == 1
    assert r.stderr.startswith("error: INVALID_ARGUMENT "), r.stderr
    assert "replica_groups[0].replicas" in r.stderr


def test_a_malformed_job_file_is_rejected_before_any_call(tmp_path: pathlib.Path) -> None:
    p = tmp_path / "bad.yaml"
    p.write_text("runMode: SINGLE_PROCESS\nreplicaGroups:\n  - role: main\n    memory: 4Gi\n")
    r = subprocess.run([sys.executable, "-m", "dlsched", "--server", "127.0.0.1:1", "submit", str(p)],
                       capture_output=True, text=True, timeout=30, cwd=ROOT, env=_env())
    assert r.returncode == 1
    assert r.stderr.startswith("error: INVALID_ARGUMENT INVALID_JOB_FILE:"), r.stderr
    assert "replicaGroups[0].memory" in r.stderr
    assert "Traceback" not in r.stderr


@pytest.mark.parametrize("value", ["nan", "-5", "0", "inf", "soon"])
def test_a_wait_timeout_that_is_no_positive_number_is_a_usage_error(value: str) -> None:
    """``stop --wait --timeout nan`` sent the stop, then failed at once: refused before any call."""
    r = subprocess.run([sys.executable, "-m", "dlsched", "--server", "127.0.0.1:1", "stop", "x", "--wait",
                        "--timeout", value], capture_output=True, text=True, timeout=30, cwd=ROOT, env=_env())
    assert r.returncode == 2 and "--timeout" in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_a_token_no_server_could_take_is_named_not_a_grpc_internal(tmp_path: pathlib.Path) -> None:
    """A non-ASCII token (a file or DLSCHED_TOKEN): gRPC's C core logged "Illegal header
    value" and the CLI printed INTERNAL CLIENT_ERROR with its objects' reprs."""
    tok = tmp_path / "tok"
    tok.write_text("dls_abc\u00e9def\n")
    binary = tmp_path / "binary-tok"  # not UTF-8: was INTERNAL CLIENT_ERROR UnicodeDecodeError
    binary.write_bytes(b"dls_\xff\xfe\n")
    for extra, env in ((["--token-file", str(tok)], {}), (["--token-file", str(binary)], {}),
                       ([], {"DLSCHED_TOKEN": "abc\u00e9 d"})):
        r = subprocess.run([sys.executable, "-m", "dlsched", "--server", "127.0.0.1:1", *extra, "list"],
                           capture_output=True, text=True, timeout=30, cwd=ROOT, env={**_env(), **env})
        assert r.returncode == 1, r.stderr
        assert r.stderr.startswith("error: UNAUTHENTICATED MALFORMED_TOKEN:"), r.stderr
        assert "Illegal header" not in r.stderr and "cygrpc" not in r.stderr, r.stderr


def test_unreachable_server_is_an_error_not_a_traceback() -> None:
    r = subprocess.run([sys.executable, "-m", "dlsched", "--server", "127.0.0.1:1", "list"],
                       capture_output=True, text=True, timeout=30, cwd=ROOT, env=_env())
    assert r.returncode == 1
    assert r.stderr.startswith("error: UNAVAILABLE"), r.stderr
    assert "Traceback" not in r.stderr


def test_multi_process_logs_are_prefixed_by_replica(stack: Stack) -> None:
    r = cli(stack, "submit", "examples/multi_process.yaml", "--follow", "--id", _uid("mp"))
    assert r.returncode == 0, r.stdout + r.stderr
    for rank in range(3):
        assert f"rank {rank} of 3" in r.stdout
    prefixed = [ln for ln in r.stdout.splitlines() if ln.startswith("[worker/")]
    assert {ln.split("]")[0] for ln in prefixed} == {"[worker/0", "[worker/1", "[worker/2"}


def test_logs_follow_one_replica_until_the_job_ends(stack: Stack, tmp_path: pathlib.Path) -> None:
    """``logs -f --replica worker/1`` attached while the job runs prints that
    replica's lines as they come, unprefixed, and exits 0 when the job ends."""
    code = ("import os, time\n"
            "for i in range(4):\n"
            "    print(f\"r{os.environ['RANK']} tick {i}\", flush=True)\n"
            "    time.sleep(0.5)\n")
    job_id = _uid("follow")
    doc = {"runMode": "MULTI_PROCESS", "clusterSelector": {"clusterType": "local"},
           "replicaGroups": [{"role": "worker", "replicas": 3, "command": [sys.executable, "-c", code]}]}
    r = cli(stack, "submit", write_job(tmp_path, doc), "--id", job_id)
    assert r.returncode == 0, r.stderr
    wait_job(stack, job_id, {job_pb2.JOB_STATE_RUNNING, job_pb2.JOB_STATE_SUCCEEDED})
    follow = cli(stack, "logs", job_id, "-f", "--replica", "worker/1", timeout=60)
    assert follow.returncode == 0, follow.stderr
    assert follow.stdout.splitlines() == [f"r1 tick {i}" for i in range(4)]
    assert wait_job(stack, job_id, {job_pb2.JOB_STATE_SUCCEEDED}).state == job_pb2.JOB_STATE_SUCCEEDED
    role = cli(stack, "logs", job_id, "--replica", "worker")
    assert sorted(role.stdout.splitlines()) == sorted(f"[worker/{r}] r{r} tick {i}" for r in range(3)
                                                      for i in range(4))


class _Watching:
    """A ``dlsched ... watch`` process whose output lines are read with a deadline.
    A watch that ends says how (exit code, stderr); one that prints nothing in
    time is aborted with its Python stacks on stderr (faulthandler) in the error."""

    def __init__(self, *args: str) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _INTERRUPTIBLE, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            text=True, cwd=ROOT, env={**_env(), "PYTHONFAULTHANDLER": "1"})
        self.lines: queue.Queue[str] = queue.Queue()
        self.seen: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(line)
        self.lines.put("")  # the end

    def _fail(self, why: str, ended: bool = False) -> NoReturn:
        if ended:  # its output closed: give it the time to exit and say how
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=30)
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGABRT)  # faulthandler: every thread's stack to stderr
        _, err = self.proc.communicate(timeout=90)
        raise AssertionError(f"{why} (exit {self.proc.returncode}) after {self.seen}: {err[-5000:]}")

    def read_until(self, text: str, event: str = "", within: float = 120) -> list[str]:
        """Lines up to the first that starts with ``event`` and holds ``text``."""
        start = len(self.seen)
        deadline = time.monotonic() + within
        while True:
            try:
                line = self.lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                self._fail(f"no {event} {text!r} within {within} s")
            if not line:
                self._fail("the watch ended", ended=True)
            self.seen.append(line)
            if text in line and line.startswith(event):
                return self.seen[start:]

    def interrupt(self) -> tuple[int, str]:
        """Ctrl-C: the exit code and stderr."""
        self.proc.send_signal(signal.SIGINT)
        _, err = self.proc.communicate(timeout=90)
        return self.proc.returncode, err

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def test_cluster_watch_shows_adds_and_removes(stack: Stack) -> None:
    assert stack.jm is not None
    name = _uid("watched")
    watch = _Watching("--cluster-manager", stack.cm.address, "cluster", "watch")
    try:
        snapshot = watch.read_until("snapshot complete")
        assert any(ln.startswith("EXISTING") and "clusters/local" in ln for ln in snapshot), snapshot
        added = cli(stack, "cluster", "add", name, "--type", "local", "--driver", stack.driver.address)
        assert added.returncode == 0, added.stderr
        watch.read_until(f"clusters/{name}", "CREATED")
        assert cli(stack, "cluster", "remove", name).returncode == 0
        watch.read_until(f"clusters/{name}", "DELETED")
        code, err = watch.interrupt()
        assert code == 130 and "Traceback" not in err
    finally:
        watch.close()


def test_watch_shows_jobs_and_ctrl_c_exits_130(stack: Stack) -> None:
    assert stack.jm is not None
    job_id = f"watched-{uuid.uuid4().hex[:8]}"  # a job of its own: the snapshot lists it
    assert cli(stack, "submit", "examples/hello.yaml", "--id", job_id).returncode == 0
    watch = _Watching("--server", stack.jm.address, "watch")
    try:
        seen = watch.read_until("snapshot complete")  # the watch prints the snapshot at once
        assert any(ln.startswith("EXISTING") and f"jobs/{job_id}" in ln for ln in seen), seen
        code, err = watch.interrupt()
        assert code == 130
        assert "Traceback" not in err
    finally:
        watch.close()


# --------------------------------------------------------------------------- clusters


def test_cluster_list_and_get(stack: Stack) -> None:
    r = cli(stack, "cluster", "list")
    assert r.returncode == 0, r.stderr
    assert "clusters/local" in r.stdout and "READY" in r.stdout
    clusters = json.loads(cli(stack, "cluster", "list", "-o", "json").stdout)["clusters"]
    local = next(c for c in clusters if c["name"] == "clusters/local")
    assert local["type"] == "CLUSTER_TYPE_LOCAL"
    assert local["driverAddress"] == stack.driver.address
    got = yaml.safe_load(cli(stack, "cluster", "get", "local", "-o", "yaml").stdout)
    assert got["name"] == "clusters/local"
    assert "credentials" not in got
    table = cli(stack, "cluster", "get", "clusters/local")
    assert "Credentials: none" in table.stdout


def test_cluster_add_reads_secrets_from_files_and_never_prints_them(
        stack: Stack, tmp_path: pathlib.Path) -> None:
    secret = "SECRET-" + uuid.uuid4().hex
    key = tmp_path / "id_ed25519"
    key.write_text(f"-----BEGIN OPENSSH PRIVATE KEY-----\n{secret}\n-----END OPENSSH PRIVATE KEY-----\n")
    name = _uid("slurm")
    add = cli(stack, "cluster", "add", name, "--type", "slurm", "--driver", "127.0.0.1:9",
              "--address", "login.example:22", "--ssh-user", "alice", "--ssh-key-file", str(key),
              "--label", "site=test", "--option", "partition=debug")
    assert add.returncode == 0, add.stderr
    outputs = [add.stdout + add.stderr]
    for args in (("cluster", "get", name), ("cluster", "get", name, "-o", "json"),
                 ("cluster", "list", "-o", "yaml"), ("cluster", "list")):
        r = cli(stack, *args)
        assert r.returncode == 0, r.stderr
        outputs.append(r.stdout + r.stderr)
    for out in outputs:
        assert secret not in out
        assert "PRIVATE KEY" not in out
    got = json.loads(outputs[2])
    assert got["hasCredentials"] is True
    assert got["labels"] == {"site": "test"}
    assert got["options"] == {"partition": "debug"}

    upd = cli(stack, "cluster", "update", name, "--label", "site=other")
    assert upd.returncode == 0, upd.stderr
    assert json.loads(cli(stack, "cluster", "get", name, "-o", "json").stdout)["labels"] == {
        "site": "other"}

    rm = cli(stack, "cluster", "remove", name)
    assert rm.returncode == 0, rm.stderr
    missing = cli(stack, "cluster", "get", name)
    assert missing.returncode == 1
    assert missing.stderr.startswith("error: NOT_FOUND CLUSTER_NOT_FOUND:"), missing.stderr


# --------------------------------------------------------------------------- dlsched up


def _free_port_pair() -> int:
    for _ in range(100):
        with socket.socket() as a, socket.socket() as b:
            a.bind(("127.0.0.1", 0))
            port = int(a.getsockname()[1])
            try:
                b.bind(("127.0.0.1", port + 1))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port pair")


def _processes_mentioning(text: str) -> list[str]:
    found = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            raw = open(f"/proc/{pid}/cmdline", "rb").read()
        except OSError:
            continue
        cmd = raw.replace(b"\0", b" ").decode(errors="replace")
        if text in cmd:
            found.append(f"{pid}: {cmd}")
    return found


class Up:
    """One ``dlsched up`` in a temp data dir, run the way a user would: HOME,
    XDG_CONFIG_HOME and DLSCHED_CONFIG point into a temp dir and none of the
    test suite's DLSCHED_* TLS/token variables are set, for it or for the CLI."""

    def __init__(self, root: pathlib.Path) -> None:
        self.root = root
        self.data = root / "data"
        self.home = root / "home"
        self.home.mkdir()
        self.config = self.home / ".config" / "dlsched" / "config.yaml"
        self.port = _free_port_pair()
        self.out_path = root / "up.out"
        self.proc: subprocess.Popen[bytes] | None = None
        env = _env()
        for k in list(env):
            if k.startswith("DLSCHED_"):
                env.pop(k)
        env.update(HOME=str(self.home), XDG_CONFIG_HOME=str(self.home / ".config"))
        self.env = env

    def start(self) -> str:
        with open(self.out_path, "a") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "dlsched", "up", "--data-dir", str(self.data),
                 "--port", str(self.port)],
                stdout=out, stderr=subprocess.STDOUT, cwd=ROOT, env=self.env)
        start = len(self.out_path.read_text())
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            text = self.out_path.read_text()[start:]
            if "dlsched is up:" in text or self.proc.poll() is not None:
                break
            time.sleep(0.1)
        text = self.out_path.read_text()[start:]
        assert "dlsched is up:" in text, text
        return text

    def stop(self) -> None:
        assert self.proc is not None
        t0 = time.monotonic()
        self.proc.send_signal(signal.SIGINT)
        assert self.proc.wait(20) == 0, self.out_path.read_text()
        assert time.monotonic() - t0 < 15
        assert "Traceback" not in self.out_path.read_text()
        assert not (self.data / "ready.json").exists()
        assert _processes_mentioning(str(self.data)) == []

    def cli(self, *args: str, env: dict[str, str] | None = None, timeout: float = 90,
            ) -> subprocess.CompletedProcess[str]:
        """The CLI with no connection flags but ``args``: the context decides."""
        r = subprocess.run([sys.executable, "-m", "dlsched", *args], capture_output=True,
                           text=True, timeout=timeout, cwd=ROOT, env=env or self.env)
        assert "Traceback" not in r.stderr, r.stderr
        return r

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        for line in _processes_mentioning(str(self.data)):
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(line.split(":")[0]), signal.SIGKILL)


@pytest.fixture(scope="module")
def up(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Up]:
    u = Up(tmp_path_factory.mktemp("up"))
    try:
        u.start()
        yield u
    finally:
        u.kill()


def _mode(p: pathlib.Path) -> int:
    return p.stat().st_mode & 0o777


def test_dlsched_up_is_secure_by_default_and_the_cli_needs_no_flags(up: Up) -> None:
    text = up.out_path.read_text()
    assert f"server=127.0.0.1:{up.port}" in text
    assert f"cluster-manager=127.0.0.1:{up.port + 1}" in text
    assert (up.data / "ready.json").exists()
    assert len(_processes_mentioning(str(up.data))) >= 4  # etcd + three services

    # Secrets made once, owner-only; the context saved in the user's config and current.
    for f in ("admin.token", "control-plane.token", "encryption-key.json", "tls/ca.key",
              "tls/job-manager.key"):
        assert _mode(up.data / f) == 0o600, f
    for d in (up.data, up.data / "tls", up.data / "etcd"):
        assert _mode(d) == 0o700, d
    assert _mode(up.config) == 0o600
    doc = yaml.safe_load(up.config.read_text())
    assert doc["current-context"] == "local"
    assert doc["contexts"]["local"] == {
        "server": f"127.0.0.1:{up.port}", "cluster-manager": f"127.0.0.1:{up.port + 1}",
        "ca-file": str(up.data / "tls" / "ca.pem"), "token-file": str(up.data / "admin.token")}
    # Every service serves TLS and checks who calls.
    for svc in ("job-manager", "cluster-manager", "local-driver"):
        assert not any("--insecure" in p for p in _processes_mentioning(f"{up.data}/run/{svc}"))
    # etcd too takes only TLS clients with a certificate of the stack's CA:
    # another local user or a job cannot read or write the registry.
    import json as _json
    import socket
    import ssl
    host, port = _json.loads((up.data / "ready.json").read_text())["etcd"].rsplit(":", 1)
    ctx = ssl.create_default_context(cafile=str(up.data / "tls" / "ca.pem"))
    with socket.create_connection((host, int(port)), timeout=10) as raw, \
            pytest.raises((ssl.SSLError, ConnectionResetError, BrokenPipeError)):
        with ctx.wrap_socket(raw, server_hostname=host) as tls:  # no client certificate
            tls.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n")
            tls.recv(1)
    # ... while the stack's own certificate gets through (so the refusal above is
    # etcd asking for a certificate, not etcd speaking no TLS at all).
    ctx.load_cert_chain(str(up.data / "tls" / "job-manager.pem"),
                        str(up.data / "tls" / "job-manager.key"))
    ctx.set_alpn_protocols(["h2"])
    with socket.create_connection((host, int(port)), timeout=10) as raw, \
            ctx.wrap_socket(raw, server_hostname=host) as tls:
        assert tls.version() is not None

    r = up.cli("submit", "examples/hello.yaml", "--follow")
    assert r.returncode == 0, r.stdout + r.stderr + up.out_path.read_text()
    assert "hello: done" in r.stdout and "SUCCEEDED" in r.stdout

    me = up.cli("whoami")
    assert me.returncode == 0, me.stderr
    assert "Principal: admin" in me.stdout and "Admin:     yes" in me.stdout
    assert json.loads(up.cli("whoami", "-o", "json").stdout)["admin"] is True

    listed = up.cli("list")
    assert listed.returncode == 0, listed.stderr
    assert listed.stdout.split()[:3] == ["NAME", "PROJECT", "OWNER"]
    assert "default" in listed.stdout and "admin" in listed.stdout

    # Plaintext against the TLS server, or no token at all, does not get in.
    plain = up.cli("--insecure", "whoami")
    assert plain.returncode == 1 and plain.stderr.startswith("error: UNAVAILABLE"), plain.stderr
    anon = up.cli("whoami", env={**up.env, "DLSCHED_TOKEN": "not-a-valid-token-" + "x" * 20,
                                  "DLSCHED_CONTEXT": "local"})
    assert anon.returncode == 1
    assert anon.stderr.startswith("error: UNAUTHENTICATED"), anon.stderr
    assert "check your token" in anon.stderr


def test_api_token_and_role_binding_act_as_the_service_account(
        up: Up, tmp_path: pathlib.Path) -> None:
    sa = _uid("ci")
    created = up.cli("token", "create", sa, "--description", "CI", "--expires", "30d")
    assert created.returncode == 0, created.stderr
    secret = created.stdout
    assert secret.startswith("dls_") and secret.count("\n") == 1  # the secret and nothing else
    assert "shown only this once" in created.stderr
    token = tmp_path / "ci.token"
    token.write_text(secret)
    token.chmod(0o600)

    bound = up.cli("rolebinding", "add", f"sa:{sa}", "--project", "team-x", "--role", "member")
    assert bound.returncode == 0, bound.stderr
    rb_name = bound.stdout.split(":")[0]
    assert rb_name.startswith("roleBindings/")

    as_sa = ("--token-file", str(token))
    me = json.loads(up.cli(*as_sa, "whoami", "-o", "json").stdout)
    assert me == {"principal": f"sa:{sa}", "admin": False,
                  "roles": [{"project": "team-x", "role": "ROLE_MEMBER"}]}

    job_id = _uid("sa-hello")
    r = up.cli(*as_sa, "submit", "examples/hello.yaml", "--follow", "--id", job_id)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "project team-x" in r.stderr
    got = json.loads(up.cli(*as_sa, "get", job_id, "-o", "json").stdout)
    assert got["owner"] == f"sa:{sa}" and got["project"] == "team-x"
    elsewhere = up.cli(*as_sa, "submit", "examples/hello.yaml", "--project", "other")
    assert elsewhere.returncode == 1
    assert elsewhere.stderr.startswith("error: PERMISSION_DENIED"), elsewhere.stderr

    refused = up.cli(*as_sa, "cluster", "add", _uid("c"), "--type", "local", "--driver", "127.0.0.1:9")
    assert refused.returncode == 1
    assert refused.stderr.startswith("error: PERMISSION_DENIED PERMISSION_DENIED:"), refused.stderr
    assert "dlsched whoami" in refused.stderr
    assert up.cli(*as_sa, "token", "list").returncode == 1  # admins only

    tokens = json.loads(up.cli("token", "list", "--service-account", sa, "-o", "json").stdout)
    (tok,) = tokens["apiTokens"]
    assert tok["description"] == "CI" and "expireTime" in tok
    assert secret.strip() not in up.cli("token", "list").stdout
    bindings = up.cli("rolebinding", "list", "--principal", f"sa:{sa}")
    assert rb_name in bindings.stdout and "MEMBER" in bindings.stdout

    assert up.cli("token", "revoke", tok["name"]).returncode == 0
    revoked = up.cli(*as_sa, "whoami")
    assert revoked.returncode == 1
    assert revoked.stderr.startswith("error: UNAUTHENTICATED"), revoked.stderr
    assert up.cli("rolebinding", "remove", rb_name).returncode == 0
    assert rb_name not in up.cli("rolebinding", "list").stdout


def test_a_wrong_ca_file_is_a_clear_error(up: Up, tmp_path: pathlib.Path) -> None:
    from dlsched.kit import pki

    other = pki.make_ca(str(tmp_path / "other-ca"))
    r = up.cli("--ca-file", other.cert_file, "whoami")
    assert r.returncode == 1
    assert r.stderr.startswith("error: UNAVAILABLE"), r.stderr
    assert "TLS handshake failed" in r.stderr and "--ca-file" in r.stderr

    not_pem = tmp_path / "hostname"
    not_pem.write_text("vm\n")
    r = up.cli("--ca-file", str(not_pem), "whoami")
    assert r.returncode == 1 and r.stderr.startswith("error: INVALID_ARGUMENT INVALID_COMMAND_LINE:"), r.stderr
    assert "no PEM certificate" in r.stderr and "ssl_transport_security" not in r.stderr, r.stderr

    missing = up.cli("--ca-file", str(tmp_path / "nope.pem"), "whoami")
    assert missing.returncode == 1
    assert missing.stderr.startswith("error: INVALID_ARGUMENT INVALID_COMMAND_LINE:"), missing.stderr
    assert "nope.pem does not exist" in missing.stderr


def test_config_contexts(up: Up, tmp_path: pathlib.Path) -> None:
    config = tmp_path / "config.yaml"
    config.write_text(up.config.read_text())
    env = {**up.env, "DLSCHED_CONFIG": str(config)}

    listed = up.cli("config", "get-contexts", env=env)
    assert listed.returncode == 0, listed.stderr
    assert [ln.split()[:2] for ln in listed.stdout.splitlines()[1:]] == [["*", "local"]]

    r = up.cli("config", "set-context", "elsewhere", "--server", "127.0.0.1:1",
               "--cluster-manager", "127.0.0.1:2", "--ca-file", str(up.data / "tls" / "ca.pem"),
               "--token-command", "cat /dev/null", env=env)
    assert r.returncode == 0, r.stderr
    assert up.cli("config", "use-context", "elsewhere", env=env).returncode == 0
    away = up.cli("whoami", env=env)
    assert away.returncode == 1 and away.stderr.startswith("error: UNAVAILABLE"), away.stderr
    assert up.cli("--context", "local", "whoami", env=env).returncode == 0
    unknown = up.cli("--context", "nowhere", "whoami", env=env)
    assert unknown.returncode == 1 and "no context 'nowhere'" in unknown.stderr
    assert up.cli("config", "use-context", "nowhere", env=env).returncode == 1

    # set-context changes only what it is given; --token-file replaces --token-command.
    token = str(up.data / "admin.token")
    r = up.cli("config", "set-context", "elsewhere", "--server", f"127.0.0.1:{up.port}",
               "--cluster-manager", f"127.0.0.1:{up.port + 1}", "--token-file", token, env=env)
    assert r.returncode == 0, r.stderr
    ctx = yaml.safe_load(config.read_text())["contexts"]["elsewhere"]
    assert ctx == {"server": f"127.0.0.1:{up.port}", "cluster-manager": f"127.0.0.1:{up.port + 1}",
                   "ca-file": str(up.data / "tls" / "ca.pem"), "token-file": token}
    assert up.cli("whoami", env=env).returncode == 0
    assert _mode(config) == 0o600


def test_dlsched_up_restarts_with_its_secrets_and_stops_cleanly(up: Up) -> None:
    token = (up.data / "admin.token").read_text()
    ca = (up.data / "tls" / "ca.pem").read_text()
    up.stop()
    for log in ("etcd", "cluster-manager", "local-driver", "job-manager"):
        assert (up.data / "logs" / f"{log}.log").exists()

    up.start()
    assert (up.data / "admin.token").read_text() == token
    assert (up.data / "tls" / "ca.pem").read_text() == ca
    listed = up.cli("list", "-o", "json")  # the context still works; jobs survived
    assert listed.returncode == 0, listed.stderr
    assert json.loads(listed.stdout)["jobs"]
    up.stop()


def test_a_job_as_get_prints_it_submits_again(tmp_path: pathlib.Path) -> None:
    """``dlsched get JOB -o yaml > f; dlsched submit f`` (kubectl's get | apply): the fields the
    server set (uid, state, times, replicas, ...) are left out; it was refused ("uid: with a spec
    key, only jobId/name may stand beside it"). A key no job has is still refused, named."""
    from google.protobuf import json_format

    job = job_pb2.Job(
        name="jobs/again", uid="u-1", state=job_pb2.JOB_STATE_SUCCEEDED, reason="Completed", attempt=1,
        cluster="clusters/local", etag="42", owner="admin", exit_code=0, labels={"a": "b"},
        replicas=[job_pb2.ReplicaStatus(role="main", index=0, state=job_pb2.REPLICA_STATE_SUCCEEDED)],
        spec=job_pb2.JobSpec(run_mode=job_pb2.RUN_MODE_SINGLE_PROCESS, labels={"a": "b"}, replica_groups=[
            job_pb2.ReplicaGroup(role="main", replicas=1, command=["echo", "hi"])]))
    job.create_time.FromSeconds(1_700_000_000)
    printed = tmp_path / "job.yaml"
    printed.write_text(yaml.safe_dump(json_format.MessageToDict(job)))
    job_id, spec = load_job_file(printed)
    assert job_id == "again" and spec == job.spec
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump({**json_format.MessageToDict(job), "bogus": 1}))
    with pytest.raises(JobFileError) as info:
        load_job_file(bad)
    assert info.value.field == "bogus"
