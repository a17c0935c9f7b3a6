"""Another language, for real: the Node.js client in examples/node and the
protos' options for other languages.

- examples/node/submit_watch_tail.js (@grpc/grpc-js + @grpc/proto-loader,
  loading protos/ at run time) submits a job to the real stack, follows
  WatchJobs and tails StreamJobLogs to the end; its watch events for the job
  equal what the Python SDK sees for the same job, and the lines it tailed
  equal the job's output.
- proto-loader reads every service of protos/dlsched/v1 with the same RPCs
  as the Python stubs.
- The protos carry the file options other languages need and compile without
  a warning with plain protoc for every language protoc has built in.

node and npm come from the machine (scripts/test.sh installs Debian's); when
examples/node/node_modules is missing the test runs `npm ci` there from the
committed package-lock.json. protoc is Debian's protobuf-compiler. Without
node, npm or protoc these tests skip, except under CI (CI=true), where they
fail.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator, Iterator

import grpc_tools
import pytest

from dlsched.client import JobManagerClient
from dlsched.v1 import (
    access_pb2,
    access_service_pb2,
    cluster_manager_service_pb2,
    cluster_pb2,
    driver_service_pb2,
    job_manager_service_pb2,
    job_pb2,
)
from tests.harness import EtcdServer, Stack

ROOT = pathlib.Path(__file__).resolve().parent.parent
NODE_DIR = ROOT / "examples" / "node"
SCRIPT = NODE_DIR / "submit_watch_tail.js"
PROTOS = ROOT / "protos"
WKT_INCLUDE = pathlib.Path(grpc_tools.__file__).parent / "_proto"
IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")
TERMINAL = {job_pb2.JOB_STATE_SUCCEEDED, job_pb2.JOB_STATE_FAILED, job_pb2.JOB_STATE_STOPPED}
STUB_MODULES = (job_pb2, cluster_pb2, job_manager_service_pb2, cluster_manager_service_pb2,
                driver_service_pb2, access_pb2, access_service_pb2)


def _require(tool: str, hint: str) -> str:
    path = shutil.which(tool)
    if path is None:
        if IN_CI:
            pytest.fail(f"no {tool} under CI: {hint}")
        pytest.skip(f"no {tool} ({hint})")
    return path


# ---------------------------------------------------------------- fixtures

@pytest.fixture(scope="module")
def node() -> str:
    """The node binary, with examples/node's dependencies installed."""
    node = _require("node", "scripts/test.sh installs nodejs and npm from Debian")
    if not (NODE_DIR / "node_modules" / "@grpc" / "proto-loader").is_dir():
        npm = _require("npm", "scripts/test.sh installs nodejs and npm from Debian")
        r = subprocess.run([npm, "ci", "--no-audit", "--no-fund", "--loglevel=error"],
                           cwd=NODE_DIR, capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, f"npm ci in examples/node:\n{r.stdout}{r.stderr}"
    return node


@pytest.fixture(scope="module")
def stack(etcd: EtcdServer) -> Iterator[Stack]:
    with Stack(etcd, f"/dlsched-node-{uuid.uuid4().hex[:8]}/").running() as st:
        yield st


@pytest.fixture(scope="module")
async def server(stack: Stack) -> str:
    """The JobManager's address, with clusters/local registered and READY."""
    await stack.register_local()
    assert stack.jm is not None
    return stack.jm.address


@pytest.fixture
async def jm(server: str) -> AsyncIterator[JobManagerClient]:
    async with JobManagerClient(server) as client:
        yield client


# ---------------------------------------------------------------- the Node client

async def _python_watch(jm: JobManagerClient, flt: str, name: str,
                        snapshot_done: asyncio.Event) -> list[tuple[str, str, str]]:
    """(event type, job state, resume token) of every event for `name` until it ends."""
    seen: list[tuple[str, str, str]] = []
    async with contextlib.aclosing(jm.watch_jobs(filter=flt)) as events:
        async for ev in events:
            if ev.type == job_pb2.WATCH_EVENT_TYPE_SNAPSHOT_COMPLETE:
                snapshot_done.set()
                continue
            if ev.job.name != name:
                continue
            seen.append((job_pb2.WatchEventType.Name(ev.type),
                         job_pb2.JobState.Name(ev.job.state), ev.resume_token))
            if ev.job.state in TERMINAL:
                return seen
    raise AssertionError(f"WatchJobs ended before {name} did: {seen}")


async def test_node_client_submits_watches_and_tails_a_job_to_the_end(
        node: str, server: str, jm: JobManagerClient) -> None:
    tag = uuid.uuid4().hex[:10]
    job_id = f"node-{tag}"
    name = f"jobs/{job_id}"
    flt = f"labels.node-test={tag}"
    lines = [f"line {i} from {job_id}" for i in range(5)]
    code = (
        "import sys, time\n"
        f"for line in {lines!r}:\n"
        "    print(line, flush=True)\n"
        "    time.sleep(0.1)\n"
        "print('a warning', file=sys.stderr, flush=True)\n"
    )
    # The Python client watches from before the Node client starts, so both see
    # every event of the job from CREATED on.
    snapshot_done = asyncio.Event()
    py_watch = asyncio.create_task(_python_watch(jm, flt, name, snapshot_done))
    await asyncio.wait_for(snapshot_done.wait(), 10)

    proc = await asyncio.create_subprocess_exec(
        node, str(SCRIPT), "--server", server, "--job-id", job_id, "--request-id", f"req-{tag}",
        "--label", f"node-test={tag}", "--watch-filter", flt,
        "--", sys.executable, "-u", "-c", code,
        cwd=NODE_DIR, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    try:
        out, err = await asyncio.wait_for(proc.communicate(), 60)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    report = f"node exited {proc.returncode}\nstdout:\n{out.decode()}\nstderr:\n{err.decode()}"
    assert proc.returncode == 0, report
    events = [json.loads(line) for line in out.decode().splitlines()]
    kinds = [e["event"] for e in events]
    assert kinds[0] == "submitted" and kinds[-1] == "done", report
    assert kinds.count("logs_end") == 1, report

    # The job reached SUCCEEDED, as the Node client and the store both say.
    assert events[-1]["job"] == name and events[-1]["state"] == "JOB_STATE_SUCCEEDED", report
    job = await jm.get_job(name)
    assert job.state == job_pb2.JOB_STATE_SUCCEEDED
    assert dict(job.labels) == {"node-test": tag}

    # Its watch events for the job are exactly what the Python client saw.
    py_events = await asyncio.wait_for(py_watch, 30)
    node_events = [(e["type"], e["state"], e["resumeToken"])
                   for e in events if e["event"] == "watch"]
    assert node_events == py_events, report
    assert node_events[0][:2] == ("WATCH_EVENT_TYPE_CREATED", "JOB_STATE_PENDING")
    assert node_events[-1][1] == "JOB_STATE_SUCCEEDED"

    # The lines it tailed are the job's output, and what the Python client reads.
    tailed = [(e["role"], e["replicaIndex"], e["stream"], e["text"])
              for e in events if e["event"] == "log"]
    stdout = [t for _, _, s, t in tailed if s == "LOG_STREAM_STDOUT"]
    stderr = [t for _, _, s, t in tailed if s == "LOG_STREAM_STDERR"]
    assert stdout == lines, report
    assert stderr == ["a warning"], report
    assert {(r, i) for r, i, _, _ in tailed} == {("main", 0)}
    py_logs = [(e.role, e.replica_index, job_pb2.LogStream.Name(e.stream), e.text)
               async for e in jm.stream_job_logs(name)]
    assert sorted(tailed) == sorted(py_logs)


def test_node_client_reports_bad_input_and_exits_2(node: str, server: str) -> None:
    """A rejected submit is an error line with the gRPC code, and exit status 2."""
    r = subprocess.run([node, str(SCRIPT), "--server", server, "--job-id", "Not_A_Valid_Id",
                        "--", "true"], cwd=NODE_DIR, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2, r
    # Node may print its own warnings (e.g. TLS to an IP address) before ours.
    error = json.loads(next(x for x in r.stderr.splitlines() if x.startswith("{")))
    assert error["event"] == "error" and error["rpc"] == "SubmitJob", r.stderr
    assert error["code"] == "INVALID_ARGUMENT", r.stderr
    assert [json.loads(line)["event"] for line in r.stdout.splitlines()] == []


_LIST_SERVICES = """
const grpc = require('@grpc/grpc-js');
const protoLoader = require('@grpc/proto-loader');
const [root, ...files] = process.argv.slice(1);
const def = protoLoader.loadSync(files, {includeDirs: [root]});
const out = {};
for (const [name, value] of Object.entries(def)) {
  if (value.format) continue;  // a message or enum, not a service
  out[name] = Object.values(value).map(
      (m) => [m.path, m.requestStream, m.responseStream]).sort();
}
console.log(JSON.stringify(out));
void grpc;
"""


def test_node_reads_every_service_as_the_python_stubs_do(node: str) -> None:
    files = sorted(p.relative_to(PROTOS).as_posix() for p in PROTOS.glob("dlsched/v1/*.proto"))
    r = subprocess.run([node, "-e", _LIST_SERVICES, str(PROTOS), *files], cwd=NODE_DIR,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    expected: dict[str, list[list[object]]] = {}
    for module in STUB_MODULES:
        for svc in module.DESCRIPTOR.services_by_name.values():
            expected[svc.full_name] = sorted(
                [f"/{svc.full_name}/{m.name}", m.client_streaming, m.server_streaming]
                for m in svc.methods)
    assert json.loads(r.stdout) == expected
    assert set(expected) == {"dlsched.v1.JobManagerService", "dlsched.v1.ClusterManagerService",
                             "dlsched.v1.DriverService", "dlsched.v1.AccessService"}


# ---------------------------------------------------------------- protos for every language

def _pascal(stem: str) -> str:
    return "".join(part.capitalize() for part in stem.split("_"))


def test_protos_carry_the_options_other_languages_need() -> None:
    """The same package options in every file (buf's PACKAGE_SAME_* rules), and a
    java_outer_classname per file that no message can collide with."""
    for module in STUB_MODULES:
        fd = module.DESCRIPTOR
        opts = fd.GetOptions()
        stem = pathlib.PurePosixPath(fd.name).stem
        assert opts.go_package == "github.com/dlsched/dlsched/gen/go/dlsched/v1;dlschedv1", fd.name
        assert opts.java_package == "io.dlsched.v1", fd.name
        assert opts.java_multiple_files, fd.name
        assert opts.java_outer_classname == f"{_pascal(stem)}Proto", fd.name
        assert opts.csharp_namespace == "Dlsched.V1", fd.name
        assert opts.php_namespace == "Dlsched\\V1", fd.name
        assert opts.ruby_package == "Dlsched::V1", fd.name
        assert opts.objc_class_prefix == "DLS", fd.name
    files = {pathlib.PurePosixPath(m.DESCRIPTOR.name).name for m in STUB_MODULES}
    assert files == {p.name for p in PROTOS.glob("dlsched/v1/*.proto")}


def _protoc_args(out: pathlib.Path, langs: tuple[str, ...]) -> list[str]:
    args = [f"-I{PROTOS}", f"-I{WKT_INCLUDE}", "--fatal_warnings"]
    for lang in langs:
        (out / lang).mkdir(parents=True)
        args.append(f"--{lang}_out={out / lang}")
    return args + [str(p) for p in sorted(PROTOS.glob("dlsched/v1/*.proto"))]


def test_protos_compile_cleanly_with_grpc_tools_protoc(tmp_path: pathlib.Path) -> None:
    """grpcio-tools' protoc (the one genproto.py uses), warnings fatal."""
    args = _protoc_args(tmp_path, ("python", "pyi", "grpc_python"))
    r = subprocess.run([sys.executable, "-m", "grpc_tools.protoc", *args,
                        f"--descriptor_set_out={tmp_path / 'api.pb'}", "--include_imports"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and not r.stderr.strip(), r.stderr
    assert (tmp_path / "api.pb").stat().st_size > 0


def test_protos_compile_cleanly_with_plain_protoc_for_every_builtin_language(
        tmp_path: pathlib.Path) -> None:
    """The protoc binary (Debian's protobuf-compiler), warnings fatal, every
    generator it has built in."""
    protoc = _require("protoc", "apt-get install protobuf-compiler")
    version = subprocess.run([protoc, "--version"], capture_output=True, text=True).stdout
    langs = ("cpp", "csharp", "java", "kotlin", "objc", "php", "python", "pyi", "ruby")
    r = subprocess.run([protoc, *_protoc_args(tmp_path, langs)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and not r.stderr.strip(), f"{version}{r.stderr}"
    for lang in langs:
        assert any(p.is_file() for p in (tmp_path / lang).rglob("*")), f"{lang}: no output"
    # The options took effect where each language puts its code.
    assert (tmp_path / "java" / "io" / "dlsched" / "v1" / "JobSpec.java").is_file()
    assert (tmp_path / "php" / "Dlsched" / "V1" / "JobSpec.php").is_file()
    assert re.search(r"namespace Dlsched\.V1\b", (tmp_path / "csharp" / "Job.cs").read_text())
    assert "DLSJobSpec" in (tmp_path / "objc" / "dlsched" / "v1" / "Job.pbobjc.h").read_text()
    assert re.search(r"module Dlsched\s+module V1\b",
                     (tmp_path / "ruby" / "dlsched" / "v1" / "job_pb.rb").read_text())
