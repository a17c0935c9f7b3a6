"""The HTTP/JSON gateway end to end: real etcd, ClusterManager, the local driver and
JobManager as processes (``tests.harness.Stack``), the gateway as a process, and
plain HTTPS (urllib, and curl where it exists) as the client.

Like every service of the suite (``tests/security.py``) the gateway runs with
TLS and authentication on: it serves HTTPS with a certificate of its own (CN
``gateway``, from the tests' CA; not a control-plane identity), calls the
services over verified TLS and forwards each request's ``Authorization``
header. Requests carry the admin token unless a test says otherwise.

The routes, the OpenAPI document and the error bodies are checked against the
descriptors' ``google.api.http`` annotations and the gRPC services themselves,
so a drift between the two APIs fails here.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import os
import pathlib
import re
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import textwrap
import time
import urllib.error
import urllib.parse
import urllib.request
import uuid
from collections.abc import Iterator
from typing import Any

import grpc
import openapi_spec_validator
import pytest
import yaml
from google.api import annotations_pb2, http_pb2
from google.protobuf import (
    descriptor_pb2,
    descriptor_pool,
    duration_pb2,
    field_mask_pb2,
    json_format,
    timestamp_pb2,
)

from dlsched.client import AccessClient
from dlsched.kit import pki, tokens
from dlsched.kit.rpc_errors import error_info, field_violations
from dlsched.v1 import (
    access_service_pb2,
    cluster_manager_service_pb2,
    cluster_pb2,
    driver_service_pb2,
    job_manager_service_pb2,
    job_pb2,
)
from dlsched.v1 import cluster_manager_service_pb2_grpc as cm_grpc
from dlsched.v1 import driver_service_pb2_grpc as drv_grpc
from dlsched.v1 import job_manager_service_pb2_grpc as jm_grpc
from gateway import rules
from tests import security
from tests.harness import ROOT, EtcdServer, ServiceProcess, Stack

SERVICES = [job_manager_service_pb2.DESCRIPTOR.services_by_name["JobManagerService"],
            cluster_manager_service_pb2.DESCRIPTOR.services_by_name["ClusterManagerService"]]
ACCESS = access_service_pb2.DESCRIPTOR.services_by_name["AccessService"]
# What the gateway and Envoy's config (deploy/envoy) serve.
GATEWAY_SERVICES = [*SERVICES, ACCESS]
TERMINAL = {"JOB_STATE_SUCCEEDED", "JOB_STATE_FAILED", "JOB_STATE_STOPPED"}
SECRET = "s3cr3t-ray-token-" + uuid.uuid4().hex
ADMIN = "<admin>"  # ``token=ADMIN``: the tests' admin token; ``token=None``: no Authorization


def admin_token() -> str:
    return security.current().admin_token


def client_ssl(ca_file: str | None = None) -> ssl.SSLContext:
    """What an HTTPS client of the gateway uses: the tests' CA (or ``ca_file``)."""
    return ssl.create_default_context(cafile=ca_file or security.current().ca.cert_file)


def auth_headers(token: str | None) -> dict[str, str]:
    if token is None:
        return {}
    return {"Authorization": f"Bearer {admin_token() if token == ADMIN else token}"}


# ---------------------------------------------------------------- fixtures

@pytest.fixture(scope="module")
def stack(etcd: EtcdServer) -> Iterator[Stack]:
    with Stack(etcd, f"/dlsched-gw-{uuid.uuid4().hex[:8]}/", jm_args=["--stop-grace-seconds", "1"]).running() as st:
        yield st


def gateway_cert(directory: str) -> pki.Issued:
    """The gateway's own certificate: CN gateway, localhost and 127.0.0.1,
    from the tests' CA. Not a control-plane identity, so it grants nothing."""
    os.makedirs(directory, exist_ok=True)
    return pki.issue(security.current().ca, directory, "gateway")


def _gateway_process(stack: Stack, cert: pki.Issued | None = None) -> ServiceProcess:
    assert stack.jm is not None
    cert = cert or gateway_cert(tempfile.mkdtemp(prefix="dlsched-gw-cert-"))
    # The CA comes from DLSCHED_TLS_CA_FILE, like every service's.
    return ServiceProcess("gateway", ["--job-manager", stack.jm.address,
                                      "--cluster-manager", stack.cm.address,
                                      "--tls-cert-file", cert.cert_file,
                                      "--tls-key-file", cert.key_file,
                                      "--tls-reload-seconds", "0.2",
                                      "--grace", "2"], name="gateway")


@pytest.fixture(scope="module")
def gateway(stack: Stack) -> Iterator[ServiceProcess]:
    gw = _gateway_process(stack).start()
    yield gw
    code = gw.stop()
    log = gw.log()
    assert code == 0, f"gateway exited {code} on SIGTERM:\n{log[-3000:]}"
    assert "Traceback" not in log, log[-5000:]
    assert SECRET not in log, "a credential reached the gateway's log"
    assert admin_token() not in log, "a bearer token reached the gateway's log"
    assert "PLAINTEXT" not in log


@pytest.fixture(scope="module")
def base(gateway: ServiceProcess) -> str:
    return f"https://{gateway.address}"


@pytest.fixture(scope="module")
def local_cluster(stack: Stack, base: str) -> str:
    """clusters/local, registered through the gateway (CreateCluster over REST)."""
    code, body = call(base, "POST", "/v1/clusters?clusterId=local&requestId=gw-register-local",
                      {"type": "CLUSTER_TYPE_LOCAL", "driverAddress": stack.driver.address})
    assert code == 200, body
    assert body["cluster"]["name"] == "clusters/local"
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        code, body = call(base, "GET", "/v1/clusters/local")
        if code == 200 and body["cluster"].get("state") == "CLUSTER_STATE_READY":
            return "clusters/local"
        time.sleep(0.2)
    raise AssertionError(f"clusters/local never READY: {body}")


# ---------------------------------------------------------------- helpers

def call(base: str, method: str, path: str, body: Any = None, *, token: str | None = ADMIN,
         headers: dict[str, str] | None = None, raw: bytes | None = None,
         timeout: float = 30) -> tuple[int, Any]:
    code, body, _ = call_h(base, method, path, body, token=token, headers=headers, raw=raw,
                           timeout=timeout)
    return code, body


def call_h(base: str, method: str, path: str, body: Any = None, *, token: str | None = ADMIN,
           headers: dict[str, str] | None = None, raw: bytes | None = None,
           timeout: float = 30) -> tuple[int, Any, Any]:
    """``call``, also returning the response headers."""
    data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
    req = urllib.request.Request(base + path, data=data, method=method,
                                 headers={"Content-Type": "application/json",
                                          **auth_headers(token), **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=timeout, context=client_ssl()) as resp:
            return resp.status, json.loads(resp.read() or b"null"), resp.headers
    except urllib.error.HTTPError as e:
        text = e.read()
        assert e.headers.get_content_type() == "application/json", text
        return e.code, json.loads(text), e.headers


def reason(body: dict[str, Any]) -> str | None:
    for d in body.get("details", []):
        if d["@type"].endswith("/google.rpc.ErrorInfo"):
            return str(d["reason"])
    return None


def violations(body: dict[str, Any]) -> list[str]:
    out: list[str] = []
    for d in body.get("details", []):
        if d["@type"].endswith("/google.rpc.BadRequest"):
            out.extend(v["field"] for v in d.get("fieldViolations", []))
    return out


def program(code: str) -> list[str]:
    return [sys.executable, "-u", "-c", textwrap.dedent(code)]


def spec(code: str, label: str = "") -> dict[str, Any]:
    return {"runMode": "RUN_MODE_SINGLE_PROCESS",
            "replicaGroups": [{"role": "main", "replicas": 1, "command": program(code)}],
            "labels": {"test": label} if label else {}}


def uniq() -> str:
    return f"g{uuid.uuid4().hex[:10]}"


def wait_state(base: str, name: str, states: set[str], timeout: float = 30, *,
               token: str | None = ADMIN) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while True:
        code, body = call(base, "GET", f"/v1/{name}", token=token)
        assert code == 200, body
        if body["job"].get("state") in states:
            return dict(body["job"])
        if time.monotonic() > deadline:
            raise AssertionError(f"{name} never reached {states}: {body}")
        time.sleep(0.1)


def stream_lines(base: str, path: str, *, headers: dict[str, str] | None = None,
                 token: str | None = ADMIN, timeout: float = 60) -> Iterator[bytes]:
    """The raw lines of a streamed response, until the server ends it."""
    req = urllib.request.Request(base + path, headers={**auth_headers(token), **(headers or {})})
    with urllib.request.urlopen(req, timeout=timeout, context=client_ssl()) as resp:
        assert resp.status == 200
        yield resp.headers.get_content_type().encode()
        while line := resp.readline():
            yield line


def https_connection(address: str, timeout: float = 30) -> http.client.HTTPSConnection:
    host, port = address.rsplit(":", 1)
    return http.client.HTTPSConnection(host, int(port), timeout=timeout, context=client_ssl())


def watch_until_snapshot(address: str, path: str, token: str | None, *,
                         sse: bool = False) -> list[dict[str, Any]]:
    """The events of a watch up to SNAPSHOT_COMPLETE, then hang up."""
    conn = https_connection(address)
    try:
        conn.request("GET", path, headers={**auth_headers(token),
                                           **({"Accept": "text/event-stream"} if sse else {})})
        resp = conn.getresponse()
        assert resp.status == 200, resp.read()
        assert resp.getheader("Content-Type") == ("text/event-stream" if sse else "application/x-ndjson")
        events: list[dict[str, Any]] = []
        while True:
            line = resp.readline()
            assert line, f"watch ended early after {events}"
            if sse:
                if not line.startswith(b"data: "):
                    continue
                line = line[len(b"data: "):]
            ev = json.loads(line)
            assert "error" not in ev, ev
            events.append(ev)
            if ev["type"] == "WATCH_EVENT_TYPE_SNAPSHOT_COMPLETE":
                return events
    finally:
        conn.close()


def annotated() -> list[tuple[str, str, str, str]]:
    """(service, method, HTTP method, template) straight from the descriptors."""
    out = []
    for svc in GATEWAY_SERVICES:
        for m in svc.methods:
            rule = m.GetOptions().Extensions[annotations_pb2.http]
            kind = rule.WhichOneof("pattern")
            assert kind is not None, f"{m.full_name} has no google.api.http option"
            out.append((svc.name, m.name, kind, getattr(rule, kind)))
    return out


# ---------------------------------------------------------------- tests

def test_every_rpc_is_annotated_and_the_openapi_document_lists_it(base: str) -> None:
    code, doc = call(base, "GET", "/openapi.json")
    assert code == 200 and doc["openapi"].startswith("3.")
    openapi_spec_validator.validate(doc)
    ops = {(op["operationId"], verb): path
           for path, item in doc["paths"].items() for verb, op in item.items()}
    rules = annotated()
    assert len(ops) == len(rules)
    for svc, method, verb, template in rules:
        path = ops.get((f"{svc}_{method}", verb))
        assert path is not None, f"{verb.upper()} {template} ({method}) missing from OpenAPI"
        # The OpenAPI path is the template with its variables as parameters:
        # fill both with "x" and they must be the same URL.
        filled_template = re.sub(r"\{[\w.]+=([^}]*)\}",
                                 lambda m: m.group(1).replace("*", "x"), template)
        filled_template = re.sub(r"\{[\w.]+\}", "x", filled_template)
        assert re.sub(r"\{\w+\}", "x", path) == filled_template, (path, template)
    schemas = doc["components"]["schemas"]
    job = schemas["dlsched.v1.Job"]["properties"]
    assert job["state"] == {"$ref": "#/components/schemas/dlsched.v1.JobState"}
    assert "JOB_STATE_RUNNING" in schemas["dlsched.v1.JobState"]["enum"]
    assert job["createTime"]["format"] == "date-time"
    submit = doc["paths"]["/v1/jobs"]["post"]
    assert submit["requestBody"]["content"]["application/json"]["schema"] == {
        "$ref": "#/components/schemas/dlsched.v1.SubmitJobRequest"}
    logs = doc["paths"]["/v1/jobs/{jobsId}/logs"]["get"]
    assert {p["name"] for p in logs["parameters"]} >= {"jobsId", "follow", "tail_lines",
                                                      "since_time", "streams"}
    assert "application/x-ndjson" in logs["responses"]["200"]["content"]
    # Bearer tokens everywhere: the scheme, required globally, and 401/403 on every operation.
    assert doc["components"]["securitySchemes"]["bearerAuth"] == {
        **doc["components"]["securitySchemes"]["bearerAuth"], "type": "http", "scheme": "bearer"}
    assert doc["security"] == [{"bearerAuth": []}]
    status_ref = {"$ref": "#/components/schemas/google.rpc.Status"}
    for item in doc["paths"].values():
        for op in item.values():
            for status_code in ("401", "403"):
                assert op["responses"][status_code]["content"]["application/json"]["schema"] == status_ref
    assert doc["paths"]["/v1/caller"]["get"]["operationId"] == "AccessService_GetCaller"
    assert doc["paths"]["/v1/apiTokens"]["post"]["requestBody"]["content"]["application/json"][
        "schema"] == {"$ref": "#/components/schemas/dlsched.v1.ApiToken"}


def test_submit_get_list_stop_delete_over_rest(base: str, local_cluster: str) -> None:
    job_id, label = uniq(), uniq()
    code, body = call(base, "POST", "/v1/jobs", {
        "jobId": job_id, "requestId": f"req-{job_id}",
        "spec": spec("import time; print('up', flush=True); time.sleep(60)", label)})
    assert code == 200, body
    name = f"jobs/{job_id}"
    assert body["job"]["name"] == name and body["job"]["spec"]["labels"] == {"test": label}
    # A retry with the same request id returns the same job.
    code, again = call(base, "POST", "/v1/jobs", {
        "jobId": job_id, "requestId": f"req-{job_id}",
        "spec": spec("import time; time.sleep(60)", label)})
    assert code == 200 and again["job"]["uid"] == body["job"]["uid"]

    running = wait_state(base, name, {"JOB_STATE_RUNNING"})
    assert running["cluster"] == local_cluster
    code, usage = call(base, "GET", f"/v1/{name}:usage")
    assert code == 200 and usage["usage"]["replicas"][0]["role"] == "main", usage

    code, listed = call(base, "GET", f"/v1/jobs?filter=labels.test%3D{label}&pageSize=10")
    assert code == 200, listed
    assert [j["name"] for j in listed["jobs"]] == [name]

    code, stopped = call(base, "POST", f"/v1/{name}:stop")
    assert code == 200, stopped
    assert stopped["job"]["state"] in {"JOB_STATE_STOPPING", "JOB_STATE_STOPPED"}
    assert wait_state(base, name, TERMINAL)["state"] == "JOB_STATE_STOPPED"

    ended = wait_state(base, name, TERMINAL)
    code, body = call(base, "DELETE", f"/v1/{name}?etag={int(ended['etag']) - 1}")
    assert code == 409 and body["code"] == grpc.StatusCode.ABORTED.value[0], body  # a stale etag deletes nothing
    code, deleted = call(base, "DELETE", f"/v1/{name}?etag={ended['etag']}")
    assert code == 200 and deleted["job"]["name"] == name
    code, gone = call(base, "GET", f"/v1/{name}")
    assert code == 404 and reason(gone) == "JOB_NOT_FOUND"
    code, again = call(base, "DELETE", f"/v1/{name}?allowMissing=true")
    assert code == 200 and again == {}


def test_unknown_job_is_404_with_job_not_found(base: str) -> None:
    code, body = call(base, "GET", "/v1/jobs/no-such-job")
    assert code == 404
    assert body["code"] == grpc.StatusCode.NOT_FOUND.value[0]
    assert reason(body) == "JOB_NOT_FOUND"
    info = next(d for d in body["details"] if d["@type"].endswith("ErrorInfo"))
    assert info["domain"] == "dlsched.io"


def test_metrics_count_requests_by_rpc_and_status(base: str) -> None:
    def count() -> float:
        with urllib.request.urlopen(base + "/metrics", timeout=10, context=client_ssl()) as r:
            text = r.read().decode()
        want = 'dlsched_http_requests_total{code="404",method="GET",rpc="/dlsched.v1.JobManagerService/GetJob"}'
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(want))

    before = count()
    for _ in range(3):
        assert call(base, "GET", "/v1/jobs/not-there-either")[0] == 404
    assert count() == before + 3


async def test_bad_request_is_400_with_the_grpc_reason_and_field(
        base: str, stack: Stack, local_cluster: str) -> None:
    bad = {"runMode": "RUN_MODE_SINGLE_PROCESS",
           "replicaGroups": [{"role": "main", "replicas": 1, "command": []}]}
    code, body = call(base, "POST", "/v1/jobs", {"spec": bad})
    assert code == 400
    # Exactly what the gRPC service says for the same request.
    assert stack.jm is not None
    async with security.channel(stack.jm.address) as ch:
        request = job_manager_service_pb2.SubmitJobRequest()
        json_format.ParseDict({"spec": bad}, request)
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await jm_grpc.JobManagerServiceStub(ch).SubmitJob(request)
    assert body["code"] == e.value.code().value[0] == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    grpc_info = error_info(e.value)
    assert grpc_info is not None and reason(body) == grpc_info.reason
    assert violations(body) == [v.field for v in field_violations(e.value)]
    assert "spec.replica_groups[0].command" in violations(body)
    assert "Traceback" not in json.dumps(body)


def test_gateway_side_errors_are_status_json(base: str) -> None:
    code, body = call(base, "POST", "/v1/jobs", raw=b"{not json")
    assert code == 400 and body["code"] == 3 and reason(body) == "INVALID_ARGUMENT"
    code, body = call(base, "POST", "/v1/jobs", {"spec": {"noSuchField": 1}})
    assert code == 400 and violations(body) == ["spec.noSuchField"]
    # Fields named as the services name them: proto names, with indexes, the body's field once.
    code, body = call(base, "POST", "/v1/jobs", {"spec": {"maxRetries": "many"}})
    assert code == 400 and violations(body) == ["spec.max_retries"]
    code, body = call(base, "POST", "/v1/jobs", {"spec": {"replicaGroups": [{"resources": {"cpu": "x"}}]}})
    assert code == 400 and violations(body) == ["spec.replica_groups[0].resources.cpu"], body
    # with the list index wherever the value is (a map's or an int's was named without it)
    for group, field in (({"env": {"K": 5}}, "spec.replica_groups[1].env"),
                         ({"replicas": "x"}, "spec.replica_groups[1].replicas"),
                         ({"command": ["ok", {"no": 1}]}, "spec.replica_groups[1].command[1]"),
                         ({"command": "echo hi"}, "spec.replica_groups[1].command"),
                         ({"replicas": 2 ** 31}, "spec.replica_groups[1].replicas"),
                         ({"resources": {"memoryBytes": "1" * 23}}, "spec.replica_groups[1].resources.memory_bytes")):
        code, body = call(base, "POST", "/v1/jobs", {"spec": {"replicaGroups": [{"role": "a"}, group]}})
        assert code == 400 and violations(body) == [field], (group, body)
    code, body = call(base, "POST", "/v1/clusters?clusterId=c1", {"type": "CLUSTER_TYPE_FOO"})
    assert code == 400 and violations(body) == ["cluster.type"], body
    # A field under both its names is given twice (the last one won), at any depth.
    code, body = call(base, "POST", "/v1/jobs", {"jobId": "first", "job_id": "second", "spec": {}})
    assert code == 400 and violations(body) == ["job_id"], body
    code, body = call(base, "POST", "/v1/jobs", {"spec": {"replicaGroups": [
        {"role": "a"}, {"role": "b", "processes_per_replica": 1, "processesPerReplica": 2}]}})
    assert code == 400 and violations(body) == ["spec.replica_groups[1].processes_per_replica"], body
    # a query parameter's error names the field by its proto path, whichever name it was given by
    for query in ("pageSize=abc", "page_size=abc", "pageSize=-1", "pageSize=%EF%BC%91"):
        code, body = call(base, "GET", f"/v1/jobs?{query}")
        assert code == 400 and violations(body) == ["page_size"], (query, body)
        assert "int()" not in json.dumps(body), body
    code, body = call(base, "GET", "/v1/jobs?filter=%ff")
    assert code == 400 and violations(body) == ["query"], body
    # JSON that protobuf's parser took too loosely: true as 1, other scripts' digits, 10 fraction digits
    for spec, field in (({"replicaGroups": [{"resources": {"cpu": True}}]}, "spec.replica_groups[0].resources.cpu"),
                        ({"replicaGroups": [{"replicas": "\uff11"}]}, "spec.replica_groups[0].replicas"),
                        ({"maxRetries": "\u0661"}, "spec.max_retries"),
                        ({"maxRetries": False}, "spec.max_retries"),
                        ({"timeLimit": "1.0000000001s"}, "spec.time_limit")):
        code, body = call(base, "POST", "/v1/jobs", {"spec": spec})
        assert code == 400 and violations(body) == [field], (spec, body)
    code, body = call(base, "GET", "/v1/jobs?bogus=1")
    assert code == 400 and violations(body) == ["bogus"]
    # What is wrong with the body as a whole, or a nameless parameter, is named too.
    for raw in (b"[]", b"null", b'{"jobId": "x", "jobId": "y"}', b"{not json"):
        code, body = call(base, "POST", "/v1/jobs", raw=raw)
        assert code == 400 and violations(body) == ["body"], (raw, body)
    code, body = call(base, "GET", "/v1/jobs?=1")
    assert code == 400 and violations(body) == ["query"], body
    code, body = call(base, "GET", "/v1/nothing-here")
    assert code == 404 and reason(body) == "ROUTE_NOT_FOUND"
    code, body = call(base, "PUT", "/v1/jobs")
    assert code == 405 and reason(body) == "METHOD_NOT_ALLOWED"
    # A custom verb's path with the wrong method is that verb's 405, not a job named "x:stop".
    code, body = call(base, "GET", "/v1/jobs/x:stop")
    assert code == 405 and reason(body) == "METHOD_NOT_ALLOWED"


def test_a_decoded_newline_or_nul_in_a_path_is_status_json_and_forges_no_log_line(
        base: str, gateway: ServiceProcess) -> None:
    """A percent-encoded newline in the path got aiohttp's text/plain 404 (no route took it), was
    counted as a 500, and the access log line it was written into became two: a forged record."""
    forged = "2026-12-06 14:50:00,000 INFO gateway gateway: DELETE /v1/clusters/prod -> 200"
    path = "/v1/jobs/x%0a" + urllib.parse.quote(forged) + "%00"
    code, body = call(base, "GET", path, token=None)
    assert code in (400, 401, 404) and body["code"] in (3, 5, 16), body
    code, body = call(base, "GET", "/v1/nothing%0ahere")
    assert code == 404 and reason(body) == "ROUTE_NOT_FOUND"
    host, port = base.removeprefix("https://").rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=10) as raw, \
            client_ssl().wrap_socket(raw, server_hostname="localhost") as tls:
        tls.sendall(b"OPTIONS * HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        answer = b""
        while chunk := tls.recv(65536):
            answer += chunk
    head, _, payload = answer.partition(b"\r\n\r\n")
    assert b"application/json" in head and json.loads(payload)["code"] == 5, answer
    deadline = time.monotonic() + 10
    while "nothing\\nhere" not in gateway.log():
        assert time.monotonic() < deadline, gateway.log()[-2000:]
        time.sleep(0.1)
    assert not [line for line in gateway.log().splitlines() if line.startswith(forged[:23])]
    assert "\x00" not in gateway.log()


def test_what_the_http_parser_refuses_is_status_json_quoting_nothing(base: str) -> None:
    """A request line past 64 KiB, a folded Authorization header: aiohttp answered text/plain
    with the request's bytes in it (the bearer token, for the folded header)."""
    host, port = base.removeprefix("https://").rsplit(":", 1)
    secret = "dlsstatic_" + "s3cr3t" * 5
    for request in (b"GET /v1/jobs?filter=" + b"a" * 70_000 + b" HTTP/1.1\r\nHost: x\r\n\r\n",
                    b"GET /v1/jobs HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer\r\n " + secret.encode()
                    + b"\r\nConnection: close\r\n\r\n"):
        with socket.create_connection((host, int(port)), timeout=10) as raw, \
                client_ssl().wrap_socket(raw, server_hostname="localhost") as tls:
            tls.sendall(request)
            answer = b""
            while chunk := tls.recv(65536):
                answer += chunk
        head, _, payload = answer.partition(b"\r\n\r\n")
        assert re.match(rb"HTTP/1\.[01] 4\d\d ", head) and b"application/json" in head, answer[:300]
        doc = json.loads(payload)
        assert doc["code"] == 3 and reason(doc) == "MALFORMED_HTTP_REQUEST", doc
        assert secret.encode() not in answer and b"aaaa" not in payload


def test_a_long_filter_and_a_large_token_reach_the_service(base: str) -> None:
    """An 8,000-character filter of spaces and quotes (about 24 KB percent-encoded) and a
    9,000-byte bearer token (a large OIDC token): answered by the service as JSON, not refused
    by the HTTP parser (8,190 bytes a line) as plain text with the request's bytes in the log."""
    clause = 'labels.team = "a b c d"'
    text = " AND ".join([clause] * (8000 // (len(clause) + 5)))
    code, body = call(base, "GET", "/v1/jobs?" + urllib.parse.urlencode({"filter": text, "pageSize": 1}))
    assert code in (200, 400) and (code == 200 or reason(body) == "INVALID_ARGUMENT"), body
    code, body = call(base, "GET", "/v1/jobs", token="x" * 9000)
    assert code == 401 and reason(body) == "UNAUTHENTICATED", body


def test_two_authorization_headers_are_unauthenticated(gateway: ServiceProcess) -> None:
    """An admin's token and another: which one counts is ambiguous, so neither does (the first
    was forwarded)."""
    conn = https_connection(gateway.address)
    try:
        conn.putrequest("GET", "/v1/jobs")
        conn.putheader("Authorization", auth_headers(ADMIN)["Authorization"])
        conn.putheader("Authorization", "Bearer someone-else")
        conn.endheaders()
        resp = conn.getresponse()
        body = json.loads(resp.read())
    finally:
        conn.close()
    assert resp.status == 401 and reason(body) == "UNAUTHENTICATED", body


def test_queries_as_grpc_gateway_clients_send_them(base: str, local_cluster: str) -> None:
    """What strangers' REST clients send: a bad value is blamed on its own parameter (the first
    one was named); a field under both its names is given twice (last won); FieldMask paths by
    field name (``update_mask=labels,driver_address``, as grpc-gateway passes them); HEAD of a
    GET route (405 before); percent-escapes that are not UTF-8 are 400 (taken as U+FFFD)."""
    code, body = call(base, "GET", "/v1/jobs/nope/logs?role=x&tail_lines=abc")
    assert code == 400 and violations(body) == ["tail_lines"], body
    code, body = call(base, "GET", "/v1/jobs/nope/logs?tail_lines=1&tailLines=2")
    assert code == 400 and violations(body) == ["tail_lines"], body
    code, body = call(base, "GET", "/v1/clusters/local")
    current = body["cluster"]
    for mask in ("labels,driver_address", "labels,driverAddress"):
        code, body = call(base, "PATCH", f"/v1/clusters/local?update_mask={mask}",
                          {"labels": current.get("labels", {}), "driverAddress": current["driverAddress"]})
        assert code == 200, (mask, body)
    code, body, headers = call_h(base, "HEAD", "/v1/clusters/local")
    assert code == 200 and body is None and headers["Content-Type"].startswith("application/json")
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(urllib.request.Request(base + "/v1/jobs/x:stop", method="HEAD",
                                                      headers=auth_headers(ADMIN)),
                               timeout=30, context=client_ssl())
    assert refused.value.code == 405 and refused.value.headers["Allow"] == "POST"
    code, body = call(base, "GET", "/v1/jobs/%FF")
    assert code == 400 and violations(body) == ["name"], body
    code, body = call(base, "GET", "/v1/jobs?filter=%FF")
    assert code == 400 and reason(body) == "INVALID_ARGUMENT", body
    # A message body must be an object: [] was taken as an empty cluster.
    code, body = call(base, "PATCH", "/v1/clusters/local?update_mask=labels", [])
    assert code == 400 and violations(body) == ["cluster"], body


def test_json_the_gateway_cannot_take_is_status_json_never_a_500_or_text(base: str, local_cluster: str) -> None:
    # Nested past the interpreter's recursion limit: 400, not a RecursionError's 500.
    for deep in (b"[" * 100_000 + b"]" * 100_000, b'{"spec":' * 100_000 + b"1" + b"}" * 100_000):
        code, body = call(base, "POST", "/v1/jobs", raw=deep)
        assert code == 400 and body["code"] == 3 and reason(body) == "INVALID_ARGUMENT", body
    code, body = call(base, "POST", "/v1/jobs:wait", raw=b"[" * 100_000)  # no route: still JSON
    assert code == 404 and reason(body) == "ROUTE_NOT_FOUND", body
    # A key twice is refused, as protobuf's json_format.Parse refuses it, never last-wins;
    # once, the same request is fine.
    valid = json.dumps(spec("pass"))[1:]  # the spec's members, without its "{"
    code, body = call(base, "POST", "/v1/clusters:match", raw=b'{"spec": {' + valid.encode() + b"}")
    assert code == 200, body
    for dup in ('{"spec": {"runMode": "RUN_MODE_MPI", ' + valid + "}",
                '{"spec": {"labels": {"k": "a", "k": "b"}, ' + valid.replace(', "labels": {}', "") + "}",
                '{"spec": {}, "spec": {' + valid + "}"):
        code, body = call(base, "POST", "/v1/clusters:match", raw=dup.encode())
        assert code == 400 and body["code"] == 3 and reason(body) == "INVALID_ARGUMENT", (dup, body)
    # Over the 8 MiB limit: HTTP 413 still, as a google.rpc.Status like every other error
    # (``call`` asserts the JSON content type), not aiohttp's text/plain page.
    big = json.dumps({"spec": {"labels": {"x": "y" * (8 * 1024 * 1024 + 1)}}}).encode()
    code, body = call(base, "POST", "/v1/jobs", raw=big)
    assert code == 413 and body["code"] == 8 and reason(body) == "REQUEST_TOO_LARGE", body
    # Under the body limit but over the services' 1 MiB a request: the same 413 (the services'
    # RESOURCE_EXHAUSTED read as HTTP 429, "too many requests: retry", with no reason).
    mid = json.dumps({"jobId": "big", "spec": {"replicaGroups": [{"role": "main", "replicas": 1, "command": ["x"],
                                                                  "args": ["a" * (2 * 1024 * 1024)]}]}}).encode()
    code, body = call(base, "POST", "/v1/jobs", raw=mid)
    assert code == 413 and body["code"] == 8 and reason(body) == "REQUEST_TOO_LARGE", body
    code, _ = call(base, "GET", "/v1/jobs?pageSize=1")  # the gateway still serves
    assert code == 200
    # Past 4x the services' 1 MiB, anonymous or not: refused by its declared length, unread and
    # unparsed (an 8 MiB body was read and parsed first, seconds of the event loop each).
    five = json.dumps({"spec": {"labels": {"x": "y" * (5 * 1024 * 1024)}}}).encode()
    code, body = call(base, "POST", "/v1/jobs", raw=five, token=None)
    assert code == 413 and reason(body) == "REQUEST_TOO_LARGE", body
    info = next(d for d in body["details"] if d["@type"].endswith("/google.rpc.ErrorInfo"))
    assert info["metadata"]["limit_bytes"] == str(4 * 1024 * 1024), info
    # Under the byte limits but a million JSON values (anonymous): refused by their count before
    # any walk over them (the walk held the event loop 20 s, every other request waiting).
    many = b'{"spec":{"replicaGroups":[' + b",".join([b"{}"] * 1_000_000) + b"]}}"
    assert len(many) < 4 * 1024 * 1024
    code, body = call(base, "POST", "/v1/jobs", raw=many, token=None)
    assert code == 413 and reason(body) == "REQUEST_TOO_LARGE", body
    info = next(d for d in body["details"] if d["@type"].endswith("/google.rpc.ErrorInfo"))
    assert info["metadata"]["limit_values"] == "200000", info


async def _rejected(aw: Any) -> tuple[grpc.StatusCode, str | None, list[str]]:
    """(code, ErrorInfo reason, field violations) of a call that must fail."""
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await aw
    info = error_info(e.value)
    return e.value.code(), info.reason if info is not None else None, [v.field for v in field_violations(e.value)]


async def _stream_rejected(call: Any) -> tuple[grpc.StatusCode, str | None, list[str]]:
    """``_rejected`` for a server stream: its first message must not come."""
    with pytest.raises(grpc.aio.AioRpcError) as e:
        async for _ in call:
            raise AssertionError("the stream answered instead of refusing")
    info = error_info(e.value)
    return e.value.code(), info.reason if info is not None else None, [v.field for v in field_violations(e.value)]


INVALID = grpc.StatusCode.INVALID_ARGUMENT


async def test_invalid_times_and_unknown_enum_values_are_invalid_argument_naming_the_field(
        stack: Stack, local_cluster: str) -> None:
    """Timestamps and Durations outside their types' ranges, and enum values the
    API does not define, are INVALID_ARGUMENT naming the field on every service
    (never INTERNAL, never read as unset or "any"), and nothing is stored."""
    assert stack.jm is not None
    good = job_pb2.JobSpec(run_mode=job_pb2.RUN_MODE_SINGLE_PROCESS, replica_groups=[job_pb2.ReplicaGroup(
        role="main", replicas=1, command=[sys.executable, "-c", "print('hello', flush=True)"])])

    def spec_with(**kw: Any) -> job_pb2.JobSpec:
        s = job_pb2.JobSpec()
        s.CopyFrom(good)
        for k, v in kw.items():
            if k == "cluster_type":
                s.cluster_selector.cluster_type = v
            elif k == "time_limit":
                s.time_limit.CopyFrom(v)
            else:
                setattr(s, k, v)
        return s

    bad_specs = [
        (spec_with(cluster_type=99), "spec.cluster_selector.cluster_type"),
        (spec_with(run_mode=99), "spec.run_mode"),
        (spec_with(time_limit=duration_pb2.Duration(seconds=60, nanos=2_000_000_000)), "spec.time_limit"),
        (spec_with(time_limit=duration_pb2.Duration(seconds=60, nanos=-1)), "spec.time_limit"),
    ]
    bad_times = [timestamp_pb2.Timestamp(seconds=2**62), timestamp_pb2.Timestamp(seconds=-2**62),
                 timestamp_pb2.Timestamp(seconds=1, nanos=2**30), timestamp_pb2.Timestamp(seconds=1, nanos=-5)]
    async with security.channel(stack.jm.address) as jm_ch, security.channel(stack.cm.address) as cm_ch, \
            security.channel(stack.driver.address) as drv_ch:
        jm = jm_grpc.JobManagerServiceStub(jm_ch)
        cm = cm_grpc.ClusterManagerServiceStub(cm_ch)
        drv = drv_grpc.DriverServiceStub(drv_ch)
        for bad, field in bad_specs:
            job_id = uniq()
            got = await _rejected(jm.SubmitJob(job_manager_service_pb2.SubmitJobRequest(job_id=job_id, spec=bad)))
            assert got == (INVALID, "INVALID_ARGUMENT", [field]), (bad, got)
            assert (await _rejected(jm.GetJob(job_manager_service_pb2.GetJobRequest(name=f"jobs/{job_id}"))))[
                1] == "JOB_NOT_FOUND"
            got = await _rejected(cm.MatchClusters(cluster_manager_service_pb2.MatchClustersRequest(spec=bad)))
            assert got == (INVALID, "INVALID_ARGUMENT", [field]), (bad, got)
            # The driver checks again, as it assumes a hostile client.
            got = await _rejected(drv.RenderJob(driver_service_pb2.RenderJobRequest(
                cluster=local_cluster, job_id=job_id, spec=bad)))
            assert got == (INVALID, "INVALID_ARGUMENT", [field]), (bad, got)

        # A cluster of an unknown type: not "type required", and not registered.
        cid = uniq()
        got = await _rejected(cm.CreateCluster(cluster_manager_service_pb2.CreateClusterRequest(
            cluster_id=cid, cluster=cluster_pb2.Cluster(type=99, driver_address=stack.driver.address))))  # type: ignore[arg-type]
        assert got == (INVALID, "INVALID_ARGUMENT", ["cluster.type"]), got
        assert (await _rejected(cm.GetCluster(cluster_manager_service_pb2.GetClusterRequest(
            name=f"clusters/{cid}"))))[1] == "CLUSTER_NOT_FOUND"
        got = await _rejected(cm.UpdateCluster(cluster_manager_service_pb2.UpdateClusterRequest(
            cluster=cluster_pb2.Cluster(name=local_cluster, type=99, labels={"x": "y"}),  # type: ignore[arg-type]
            update_mask=field_mask_pb2.FieldMask(paths=["labels"]))))
        assert got == (INVALID, "INVALID_ARGUMENT", ["cluster.type"]), got

        # Logs of a launched job: since_time out of range, an unknown stream.
        job_id = uniq()
        await jm.SubmitJob(job_manager_service_pb2.SubmitJobRequest(job_id=job_id, spec=good))
        for _ in range(300):
            job = (await jm.GetJob(job_manager_service_pb2.GetJobRequest(name=f"jobs/{job_id}"))).job
            if job.backend_job_id:
                break
            await asyncio.sleep(0.1)
        assert job.backend_job_id, job
        for ts in bad_times:
            got = await _stream_rejected(jm.StreamJobLogs(job_manager_service_pb2.StreamJobLogsRequest(
                name=f"jobs/{job_id}", since_time=ts)))
            assert got == (INVALID, "INVALID_ARGUMENT", ["since_time"]), (ts, got)
            got = await _stream_rejected(drv.TailJobLogs(driver_service_pb2.TailJobLogsRequest(
                cluster=local_cluster, since_time=ts, job=driver_service_pb2.JobRef(
                    job_id=job_id, backend_job_id=job.backend_job_id))))
            assert got == (INVALID, "INVALID_ARGUMENT", ["since_time"]), (ts, got)
        got = await _stream_rejected(jm.StreamJobLogs(job_manager_service_pb2.StreamJobLogsRequest(
            name=f"jobs/{job_id}", streams=[job_pb2.LOG_STREAM_STDOUT, 99])))  # type: ignore[list-item]
        assert got == (INVALID, "INVALID_ARGUMENT", ["streams[1]"]), got
        # A valid since_time still streams the job's lines.
        lines = [e.text async for r in jm.StreamJobLogs(job_manager_service_pb2.StreamJobLogsRequest(
            name=f"jobs/{job_id}", follow=True, since_time=timestamp_pb2.Timestamp(seconds=1)))
            for e in r.entries]
        assert lines == ["hello"], lines
        for grace in (duration_pb2.Duration(seconds=1, nanos=-1), duration_pb2.Duration(nanos=10**9)):
            got = await _rejected(drv.TerminateJob(driver_service_pb2.TerminateJobRequest(
                cluster=local_cluster, grace_period=grace, job=driver_service_pb2.JobRef(
                    job_id=job_id, backend_job_id=job.backend_job_id))))
            assert got == (INVALID, "INVALID_ARGUMENT", ["grace_period"]), (grace, got)


async def test_forged_list_page_tokens_are_invalid_argument(stack: Stack, local_cluster: str) -> None:
    """A page token this server did not issue (a create time that is not a finite
    number within a Timestamp's range, a bad job id) is INVALID_ARGUMENT naming
    page_token, never an empty last page; the tokens it issues page as before."""
    assert stack.jm is not None
    label = uniq()
    async with security.channel(stack.jm.address) as ch:
        jm = jm_grpc.JobManagerServiceStub(ch)
        spec_ = job_pb2.JobSpec(run_mode=job_pb2.RUN_MODE_SINGLE_PROCESS, labels={"test": label},
                                replica_groups=[job_pb2.ReplicaGroup(role="main", replicas=1,
                                                                     command=[sys.executable, "-c", "pass"])])
        names = set()
        for _ in range(3):
            resp = await jm.SubmitJob(job_manager_service_pb2.SubmitJobRequest(spec=spec_))
            names.add(resp.job.name)
        seen: list[str] = []
        token = ""
        while True:
            page = await jm.ListJobs(job_manager_service_pb2.ListJobsRequest(
                filter=f"labels.test={label}", page_size=1, page_token=token))
            seen += [j.name for j in page.jobs]
            token = page.next_page_token
            if not token:
                break
        assert sorted(seen) == sorted(names)
        for text in ("p1:nan:x", "p1:-inf:", "p1:inf:a", "p1:-nan:a", "p1:1e400:a", "p1:-1e400:a",
                     "p1:1_700_000_000:a", "p1: 5:a", "p1:253402300800.0:a", "p1:-62135596801.0:a",
                     "p1:1700000000.0:Not-an-id", "p1:1700000000.0:"):
            forged = tokens.encode(text)
            got = await _rejected(jm.ListJobs(job_manager_service_pb2.ListJobsRequest(page_token=forged)))
            assert got == (INVALID, "INVALID_ARGUMENT", ["page_token"]), (text, got)


def test_logs_stream_ndjson_until_the_job_ends(base: str, local_cluster: str) -> None:
    job_id = uniq()
    code, body = call(base, "POST", "/v1/jobs", {"jobId": job_id, "spec": spec(
        "import time\nfor i in range(5):\n    print(f'line {i}', flush=True); time.sleep(0.2)")})
    assert code == 200, body
    lines = stream_lines(base, f"/v1/jobs/{job_id}/logs?follow=true&streams=LOG_STREAM_STDOUT")
    assert next(lines) == b"application/x-ndjson"
    texts = []
    for raw in lines:  # ends when the gRPC stream ends: the job is over
        msg = json.loads(raw)
        assert "error" not in msg, msg
        texts.extend(e["text"].rstrip("\n") for e in msg.get("entries", []))
    assert texts == [f"line {i}" for i in range(5)]
    assert wait_state(base, f"jobs/{job_id}", TERMINAL, 5)["state"] == "JOB_STATE_SUCCEEDED"

    # Server-sent events on request; without follow the stream ends at once.
    events = list(stream_lines(base, f"/v1/jobs/{job_id}/logs?tailLines=2",
                               headers={"Accept": "text/event-stream"}))
    assert events[0] == b"text/event-stream"
    data = [json.loads(e[len(b"data: "):]) for e in events[1:] if e.startswith(b"data: ")]
    assert [e["text"].rstrip("\n") for d in data for e in d["entries"]] == ["line 3", "line 4"]

    # A stream that fails before its first message gets the real HTTP status.
    code, body = call(base, "GET", "/v1/jobs/no-such-job/logs")
    assert code == 404 and reason(body) == "JOB_NOT_FOUND"


def test_watch_streams_the_job_to_its_end_and_a_disconnect_cancels_it(
        base: str, gateway: ServiceProcess, local_cluster: str) -> None:
    job_id, label = uniq(), uniq()
    code, body = call(base, "POST", "/v1/jobs", {"jobId": job_id, "spec": spec(
        "import time; time.sleep(1)", label)})
    assert code == 200, body
    conn = https_connection(gateway.address)
    conn.request("GET", f"/v1/jobs:watch?filter=labels.test%3D{label}", headers=auth_headers(ADMIN))
    resp = conn.getresponse()
    assert resp.status == 200 and resp.getheader("Content-Type") == "application/x-ndjson"
    events = []
    while True:
        line = resp.readline()
        assert line, f"watch ended early after {events}"
        ev = json.loads(line)
        events.append(ev["type"])
        assert ev["resumeToken"]
        if ev.get("job", {}).get("state") in TERMINAL:
            assert ev["job"]["state"] == "JOB_STATE_SUCCEEDED"
            break
    assert events[0] == "WATCH_EVENT_TYPE_EXISTING"
    assert "WATCH_EVENT_TYPE_SNAPSHOT_COMPLETE" in events
    # The client hangs up: the gateway cancels the gRPC watch.
    conn.close()
    deadline = time.monotonic() + 60
    while "client went away; cancelling /dlsched.v1.JobManagerService/WatchJobs" not in gateway.log():
        assert time.monotonic() < deadline, gateway.log()[-3000:]
        time.sleep(0.1)


def test_clusters_create_list_and_credentials_pass_through_unlogged(
        base: str, local_cluster: str) -> None:
    cid = uniq()
    cluster = {"type": "CLUSTER_TYPE_RAY", "address": "http://127.0.0.1:9",
               "driverAddress": "127.0.0.1:9", "labels": {"team": "gw"},
               "credentials": {"token": {"token": SECRET}}}
    code, body = call(base, "POST", f"/v1/clusters?clusterId={cid}", cluster)
    assert code == 200, body
    assert body["cluster"]["name"] == f"clusters/{cid}"
    assert body["cluster"]["hasCredentials"] is True
    assert SECRET not in json.dumps(body)
    code, dup = call(base, "POST", f"/v1/clusters?clusterId={cid}", cluster)
    assert code == 409 and reason(dup) == "CLUSTER_ALREADY_EXISTS"

    code, listed = call(base, "GET", "/v1/clusters")
    assert code == 200
    assert {"clusters/local", f"clusters/{cid}"} <= {c["name"] for c in listed["clusters"]}

    code, patched = call(base, "PATCH", f"/v1/clusters/{cid}?updateMask=labels",
                         {"labels": {"team": "gw2"}})
    assert code == 200 and patched["cluster"]["labels"] == {"team": "gw2"}

    code, matched = call(base, "POST", "/v1/clusters:match", {"spec": spec("pass")})
    assert code == 200 and any(c["cluster"] == "clusters/local" for c in matched["candidates"])

    code, body = call(base, "DELETE", f"/v1/clusters/{cid}")
    assert code == 200, body
    code, body = call(base, "GET", f"/v1/clusters/{cid}")
    assert code == 404 and reason(body) == "CLUSTER_NOT_FOUND"


def test_curl_gets_a_job(base: str, local_cluster: str) -> None:
    curl = shutil.which("curl")
    if curl is None:
        pytest.skip("no curl")
    job_id = uniq()
    tls = ["--cacert", security.current().ca.cert_file]
    auth = ["-H", f"Authorization: Bearer {admin_token()}"]
    r = subprocess.run([curl, "-sS", *tls, *auth, "-X", "POST",
                        "-H", "Content-Type: application/json",
                        "-d", json.dumps({"jobId": job_id, "spec": spec("pass")}),
                        "-w", "\n%{http_code}", f"{base}/v1/jobs"],
                       capture_output=True, text=True, timeout=30)
    text, _, status = r.stdout.rpartition("\n")
    assert status == "200", r.stdout + r.stderr
    assert json.loads(text)["job"]["name"] == f"jobs/{job_id}"
    r = subprocess.run([curl, "-sS", *tls, *auth, "-w", "\n%{http_code}",
                        f"{base}/v1/jobs/{job_id}"],
                       capture_output=True, text=True, timeout=30)
    text, _, status = r.stdout.rpartition("\n")
    assert status == "200" and json.loads(text)["job"]["name"] == f"jobs/{job_id}"
    # Without the token: 401 with the status JSON.
    r = subprocess.run([curl, "-sS", *tls, "-w", "\n%{http_code}", f"{base}/v1/jobs/{job_id}"],
                       capture_output=True, text=True, timeout=30)
    text, _, status = r.stdout.rpartition("\n")
    assert status == "401" and reason(json.loads(text)) == "UNAUTHENTICATED"
    # Without the CA: curl refuses the certificate.
    r = subprocess.run([curl, "-sS", f"{base}/healthz"], capture_output=True, text=True,
                       timeout=30, env={**os.environ, "CURL_CA_BUNDLE": os.devnull,
                                        "SSL_CERT_FILE": os.devnull})
    assert r.returncode != 0, r.stdout


def test_sigterm_ends_open_streams_with_unavailable_and_exits_0(stack: Stack,
                                                                local_cluster: str) -> None:
    gw = _gateway_process(stack).start()
    try:
        conn = https_connection(gw.address)
        conn.request("GET", "/v1/clusters:watch", headers=auth_headers(ADMIN))
        resp = conn.getresponse()
        assert resp.status == 200
        first = json.loads(resp.readline())
        assert first["type"] == "WATCH_EVENT_TYPE_EXISTING"
        assert gw.proc is not None
        gw.proc.send_signal(signal.SIGTERM)
        last = first
        while line := resp.readline():
            last = json.loads(line)
        assert last["error"]["code"] == grpc.StatusCode.UNAVAILABLE.value[0], last
        assert gw.proc.wait(15) == 0
        conn.close()
    finally:
        gw.stop()


# ---------------------------------------------------------------- identity and access

def test_without_a_token_every_route_is_401_and_nothing_happens(base: str,
                                                                local_cluster: str) -> None:
    job_id = uniq()
    # A call with the token first: nothing of it may stick to the next request.
    assert call(base, "GET", "/v1/caller")[0] == 200
    code, body, headers = call_h(base, "POST", "/v1/jobs",
                                 {"jobId": job_id, "spec": spec("print('never')")}, token=None)
    assert code == 401, body
    assert body["code"] == grpc.StatusCode.UNAUTHENTICATED.value[0]
    assert reason(body) == "UNAUTHENTICATED"
    assert headers["WWW-Authenticate"] == 'Bearer realm="dlsched"'
    # No job was made.
    code, body = call(base, "GET", f"/v1/jobs/{job_id}")
    assert code == 404 and reason(body) == "JOB_NOT_FOUND"

    # A token the services do not know; a header gRPC could not carry (the
    # gateway answers that one itself).
    for token in ("not-a-token", "dls_000000000000_" + "x" * 43, "caf\u00e9"):
        code, body, headers = call_h(base, "POST", "/v1/jobs",
                                     {"jobId": job_id, "spec": spec("pass")}, token=token)
        assert code == 401 and reason(body) == "UNAUTHENTICATED", (token, body)
        assert "invalid_token" in headers["WWW-Authenticate"]
    assert call(base, "GET", f"/v1/jobs/{job_id}")[0] == 404

    # Every service behind the gateway, streams included (they fail before
    # their first message, so they get the real HTTP status).
    for path in ("/v1/jobs", f"/v1/jobs/{job_id}", "/v1/jobs:watch", f"/v1/jobs/{job_id}/logs",
                 "/v1/clusters", "/v1/clusters:watch", "/v1/caller", "/v1/roleBindings"):
        code, body = call(base, "GET", path, token=None)
        assert code == 401 and reason(body) == "UNAUTHENTICATED", (path, body)
    # The gateway's own pages need none.
    for path in ("/healthz", "/openapi.json"):
        assert call(base, "GET", path, token=None)[0] == 200


def test_access_service_over_rest(base: str) -> None:
    code, me = call(base, "GET", "/v1/caller")
    assert code == 200 and me["principal"] == "admin" and me["admin"] is True, me

    sa = uniq()
    code, made = call(base, "POST", "/v1/apiTokens", {"serviceAccount": sa, "description": "gw"})
    assert code == 200, made
    secret, token_name = made["secret"], made["apiToken"]["name"]
    assert token_name.startswith("apiTokens/") and made["apiToken"]["serviceAccount"] == sa
    code, rb = call(base, "POST", "/v1/roleBindings",
                    {"principal": f"sa:{sa}", "project": "gw-p", "role": "ROLE_VIEWER"})
    assert code == 200 and rb["roleBinding"]["name"].startswith("roleBindings/"), rb
    code, listed = call(base, "GET", f"/v1/roleBindings?principal=sa:{sa}")
    assert code == 200 and [b["name"] for b in listed["roleBindings"]] == [rb["roleBinding"]["name"]]
    code, toks = call(base, "GET", f"/v1/apiTokens?serviceAccount={sa}")
    assert code == 200 and [t["name"] for t in toks["apiTokens"]] == [token_name]
    assert secret not in json.dumps(toks)

    # The new token, through the gateway: who it is; what it may not do (403).
    code, me = call(base, "GET", "/v1/caller", token=secret)
    assert code == 200 and me["principal"] == f"sa:{sa}" and not me.get("admin"), me
    assert me["roles"] == [{"project": "gw-p", "role": "ROLE_VIEWER"}]
    code, body = call(base, "GET", "/v1/roleBindings", token=secret)
    assert code == 403 and reason(body) == "PERMISSION_DENIED", body
    code, body = call(base, "POST", "/v1/jobs", {"spec": {**spec("pass"), "project": "gw-p"}},
                      token=secret)
    assert code == 403 and reason(body) == "PERMISSION_DENIED", body
    code, body = call(base, "DELETE", f"/v1/clusters/{uniq()}", token=secret)  # admins only
    assert code == 403 and reason(body) == "PERMISSION_DENIED", body

    assert call(base, "DELETE", f"/v1/{rb['roleBinding']['name']}")[0] == 200
    assert call(base, "DELETE", f"/v1/{token_name}")[0] == 200
    code, body = call(base, "GET", "/v1/caller", token=secret)
    assert code == 401 and reason(body) == "UNAUTHENTICATED", body


async def _service_account(jm: str, name: str, project: str) -> str:
    """An API token for ``sa:<name>`` and a member binding in ``project``,
    made by the admin over gRPC with the SDK."""
    async with AccessClient(jm) as admin:
        _, secret = await admin.create_api_token(name, description="test_gateway")
        await admin.create_role_binding(f"sa:{name}", project, "member")
    return secret


async def test_two_projects_see_only_their_own_jobs_through_rest(
        base: str, stack: Stack, gateway: ServiceProcess, local_cluster: str) -> None:
    assert stack.jm is not None
    alice = await _service_account(stack.jm.address, "alice", "pa")
    bob = await _service_account(stack.jm.address, "bob", "pb")
    label = uniq()
    watch = f"/v1/jobs:watch?filter=labels.test%3D{label}"

    # Bob watches the label before anything exists, and keeps watching.
    live = https_connection(gateway.address, timeout=60)
    live.request("GET", watch, headers=auth_headers(bob))
    live_resp = live.getresponse()
    assert live_resp.status == 200
    assert json.loads(live_resp.readline())["type"] == "WATCH_EVENT_TYPE_SNAPSHOT_COMPLETE"

    # Alice submits over REST; the project is her only one.
    a_id = uniq()
    code, body = call(base, "POST", "/v1/jobs", {"jobId": a_id, "spec": spec(
        "import time; print('alice', flush=True); time.sleep(60)", label)}, token=alice)
    assert code == 200, body
    a = f"jobs/{a_id}"
    assert body["job"]["project"] == "pa" and body["job"]["owner"] == "sa:alice", body
    assert wait_state(base, a, {"JOB_STATE_RUNNING"}, token=alice)["cluster"] == local_cluster
    code, _ = call(base, "GET", f"/v1/{a}:usage", token=alice)
    assert code == 200
    lines = list(stream_lines(base, f"/v1/{a}/logs?tailLines=10", token=alice))
    assert lines[0] == b"application/x-ndjson"

    # To Bob, Alice's job does not exist: reads, logs, usage, stop, delete.
    for method, path in (("GET", f"/v1/{a}"), ("GET", f"/v1/{a}/logs"),
                         ("GET", f"/v1/{a}/logs?follow=true"), ("GET", f"/v1/{a}:usage"),
                         ("POST", f"/v1/{a}:stop"), ("DELETE", f"/v1/{a}")):
        code, body = call(base, method, path, token=bob)
        assert code == 404 and reason(body) == "JOB_NOT_FOUND", (method, path, body)
    code, body = call(base, "DELETE", f"/v1/{a}?allowMissing=true", token=bob)
    assert code == 200 and body == {}
    assert call(base, "GET", f"/v1/{a}", token=alice)[0] == 200  # still there
    code, listed = call(base, "GET", "/v1/jobs?pageSize=1000", token=bob)
    assert code == 200 and a not in {j["name"] for j in listed.get("jobs", [])}
    code, listed = call(base, "GET", f"/v1/jobs?filter=labels.test%3D{label}", token=bob)
    assert code == 200 and listed.get("jobs", []) == []
    # Nor may he submit to her project.
    code, body = call(base, "POST", "/v1/jobs", {"spec": {**spec("pass", label), "project": "pa"}},
                      token=bob)
    assert code == 403 and reason(body) == "PERMISSION_DENIED", body

    # Bob's own job, in pb.
    b_id = uniq()
    code, body = call(base, "POST", "/v1/jobs", {"jobId": b_id, "spec": spec(
        "import time; time.sleep(60)", label)}, token=bob)
    assert code == 200 and body["job"]["project"] == "pb", body
    b = f"jobs/{b_id}"
    # Bob's live watch: events in revision order, so Alice's (earlier) would
    # have come before his first; there are none.
    seen: list[str] = []
    while b not in seen:
        line = live_resp.readline()
        assert line, f"watch ended early after {seen}"
        ev = json.loads(line)
        assert "error" not in ev, ev
        seen.append(ev["job"]["name"])
    assert a not in seen
    live.close()

    # Fresh snapshots, NDJSON and SSE: each sees exactly their own.
    for sse in (False, True):
        for token, mine in ((alice, a), (bob, b)):
            events = watch_until_snapshot(gateway.address, watch, token, sse=sse)
            assert [e["job"]["name"] for e in events
                    if e["type"] == "WATCH_EVENT_TYPE_EXISTING"] == [mine], (sse, events)
    # The admin sees both.
    code, listed = call(base, "GET", f"/v1/jobs?filter=labels.test%3D{label}")
    assert code == 200 and {j["name"] for j in listed["jobs"]} == {a, b}

    for token, name in ((alice, a), (bob, b)):
        code, body = call(base, "POST", f"/v1/{name}:stop", token=token)
        assert code == 200, body
        assert wait_state(base, name, TERMINAL, token=token)["state"] == "JOB_STATE_STOPPED"
        assert call(base, "DELETE", f"/v1/{name}", token=token)[0] == 200
    log = gateway.log()
    assert alice not in log and bob not in log, "a bearer token reached the gateway's log"


def test_https_only_with_the_right_ca(gateway: ServiceProcess, tmp_path: pathlib.Path) -> None:
    url = f"https://{gateway.address}/healthz"
    with urllib.request.urlopen(url, timeout=10, context=client_ssl()) as resp:
        assert resp.status == 200
    other = pki.make_ca(str(tmp_path / "other-ca"))
    with pytest.raises(urllib.error.URLError) as e:
        urllib.request.urlopen(url, timeout=10, context=client_ssl(other.cert_file))
    assert isinstance(e.value.reason, ssl.SSLCertVerificationError), e.value
    # Plain HTTP to the HTTPS port gets no HTTP answer.
    with pytest.raises((http.client.HTTPException, OSError)):
        urllib.request.urlopen(f"http://{gateway.address}/healthz", timeout=10)


def _served_certificate(address: str) -> bytes:
    host, port = address.rsplit(":", 1)
    ctx = client_ssl()
    with socket.create_connection((host, int(port)), timeout=10) as raw, \
            ctx.wrap_socket(raw, server_hostname=host) as tls:
        der = tls.getpeercert(binary_form=True)
    assert der is not None
    return der


def _der(cert_file: str) -> bytes:
    pem = pathlib.Path(cert_file).read_text()
    first = pem[:pem.index("-----END CERTIFICATE-----") + len("-----END CERTIFICATE-----")]
    return ssl.PEM_cert_to_DER_cert(first)


def _replace(src: str, dst: str) -> None:
    tmp = dst + ".new"
    shutil.copyfile(src, tmp)
    os.replace(tmp, dst)


def test_a_renewed_certificate_is_served_without_a_restart(
        stack: Stack, local_cluster: str, tmp_path: pathlib.Path) -> None:
    first = gateway_cert(str(tmp_path / "first"))
    gw = _gateway_process(stack, first).start()
    try:
        base = f"https://{gw.address}"
        assert _served_certificate(gw.address) == _der(first.cert_file)
        renewed = gateway_cert(str(tmp_path / "renewed"))
        # Half a renewal (new key, old certificate) does not load: the old
        # pair stays in service, and no handshake breaks.
        _replace(renewed.key_file, first.key_file)
        deadline = time.monotonic() + 60
        while "do not load" not in gw.log():
            assert time.monotonic() < deadline, gw.log()[-3000:]
            time.sleep(0.1)
        assert _served_certificate(gw.address) == _der(first.cert_file)
        assert call(base, "GET", "/v1/caller")[0] == 200
        # The rest of it: new handshakes get the new certificate.
        _replace(renewed.cert_file, first.cert_file)
        deadline = time.monotonic() + 60
        while _served_certificate(gw.address) != _der(renewed.cert_file):
            assert time.monotonic() < deadline, gw.log()[-3000:]
            time.sleep(0.1)
        assert "TLS certificate reloaded" in gw.log()
        # The upstream channels were rebuilt with it and still work.
        code, body = call(base, "GET", "/v1/clusters/local")
        assert code == 200, body
        assert gw.stop() == 0
        assert "Traceback" not in gw.log(), gw.log()[-5000:]
    finally:
        gw.stop()


def test_a_body_that_does_not_decode_or_arrive_is_a_clean_error(stack: Stack, base: str) -> None:
    """A body its Content-Encoding does not decode was a 500 with two tracebacks (gzip), or no
    answer at all (deflate, now and then), and an encoding aiohttp does not know was read as
    identity: the API takes JSON as it is, any Content-Encoding but identity is 415 naming
    ``body``, unread. A body that does not arrive (2 of 100 declared bytes) held its handler for
    good: 408 REQUEST_TIMEOUT after the gateway's --rpc-timeout."""
    import gzip

    for enc, raw in (("gzip", b"{}"), ("deflate", b"{}"), ("deflate", b"x" * 5000), ("x-unknown", b"{}"),
                     ("gzip", gzip.compress(b'{"spec": {}}'))):
        code, body = call(base, "POST", "/v1/jobs", raw=raw, headers={"Content-Encoding": enc})
        assert code == 415 and violations(body) == ["body"], (enc, body)
        assert reason(body) == "UNSUPPORTED_CONTENT_ENCODING", body
    code, body = call(base, "POST", "/v1/jobs", raw=b'{"spec": {}}', headers={"Content-Encoding": "identity"})
    assert code == 400 and reason(body) != "UNSUPPORTED_CONTENT_ENCODING", body
    assert stack.jm is not None
    gw = ServiceProcess("gateway", ["--job-manager", stack.jm.address, "--cluster-manager", stack.cm.address,
                                    "--insecure", "--rpc-timeout", "3"], name="gateway-slow-body").start()
    try:
        host, port = gw.address.rsplit(":", 1)
        conn = http.client.HTTPConnection(host, int(port), timeout=60)
        conn.putrequest("POST", "/v1/jobs")
        conn.putheader("Content-Type", "application/json")
        conn.putheader("Content-Length", "100")
        conn.endheaders(b"{}")
        resp = conn.getresponse()
        body = json.loads(resp.read())
        assert resp.status == 408 and reason(body) == "REQUEST_TIMEOUT", body
        conn.close()
        assert "Traceback" not in gw.log()
    finally:
        gw.stop()


def test_insecure_serves_plain_http_with_a_warning(stack: Stack) -> None:
    assert stack.jm is not None
    gw = ServiceProcess("gateway", ["--job-manager", stack.jm.address,
                                    "--cluster-manager", stack.cm.address, "--insecure"],
                        name="gateway-insecure").start()
    try:
        with urllib.request.urlopen(f"http://{gw.address}/healthz", timeout=10) as resp:
            assert resp.status == 200
        assert "PLAINTEXT" in gw.log()
    finally:
        gw.stop()


def test_without_tls_files_the_gateway_refuses_to_start(stack: Stack) -> None:
    assert stack.jm is not None
    env = {k: v for k, v in os.environ.items() if not k.startswith("DLSCHED_TLS_")}
    r = subprocess.run([sys.executable, "-m", "gateway", "--job-manager", stack.jm.address,
                        "--cluster-manager", stack.cm.address],
                       capture_output=True, text=True, timeout=30, env=env, cwd=str(ROOT))
    assert r.returncode == 2 and "--insecure" in r.stderr, r.stderr


# ---------------------------------------------------------------- Envoy (deploy/envoy)

def test_envoy_descriptor_set_and_config_match_the_annotations(tmp_path: pathlib.Path) -> None:
    """Envoy cannot run here; check what it would load: the descriptor set that
    build_descriptor.py makes (protoc --include_imports) and envoy.yaml."""
    out = tmp_path / "dlsched.pb"
    subprocess.run([sys.executable, str(ROOT / "deploy" / "envoy" / "build_descriptor.py"),
                    "--out", str(out)], check=True, capture_output=True, timeout=120)
    fds = descriptor_pb2.FileDescriptorSet.FromString(out.read_bytes())
    files = {f.name: f for f in fds.file}
    assert {"google/api/annotations.proto", "google/rpc/status.proto",
            "google/rpc/error_details.proto"} <= set(files)
    pool = descriptor_pool.DescriptorPool()
    for f in fds.file:  # --include_imports lists dependencies first
        pool.Add(f)
    assert pool.FindMessageTypeByName("google.rpc.ErrorInfo")
    assert pool.FindMessageTypeByName("google.rpc.BadRequest")
    for svc in GATEWAY_SERVICES:
        in_set = next(s for f in fds.file if f.package == "dlsched.v1" for s in f.service
                      if s.name == svc.name)
        assert [m.name for m in in_set.method] == [m.name for m in svc.methods]
        for m, stub in zip(in_set.method, svc.methods, strict=True):
            # Options of a file-set proto carry the extension as known bytes.
            got = m.options.Extensions[annotations_pb2.http]
            assert got == stub.GetOptions().Extensions[annotations_pb2.http], m.name

    config = yaml.safe_load((ROOT / "deploy" / "envoy" / "envoy.yaml").read_text())
    hcm = config["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]
    hcm_conf = hcm["typed_config"]
    filters = hcm_conf["http_filters"]
    transcoder = next(f["typed_config"] for f in filters
                      if f["name"] == "envoy.filters.http.grpc_json_transcoder")
    assert filters[-1]["name"] == "envoy.filters.http.router"
    assert transcoder["services"] == [s.full_name for s in GATEWAY_SERVICES]
    assert pathlib.PurePosixPath(transcoder["proto_descriptor"]).name == "dlsched.pb"
    assert transcoder["convert_grpc_status"] is True
    assert transcoder["print_options"]["stream_newline_delimited"] is True
    clusters = {c["name"]: c for c in config["static_resources"]["clusters"]}
    routes = hcm_conf["route_config"]["virtual_hosts"][0]["routes"]
    want = {"JobManagerService": "job-manager", "ClusterManagerService": "cluster-manager",
            "AccessService": "job-manager"}
    for svc in GATEWAY_SERVICES:
        for m in svc.methods:
            path = f"/{svc.full_name}/{m.name}"
            route = next(r["route"] for r in routes
                         if r["match"].get("path") == path
                         or path.startswith(r["match"].get("prefix", "\0")))
            assert route["cluster"] == want[svc.name], path
            assert (route["timeout"] == "0s") == m.server_streaming, path
            assert route["cluster"] in clusters
    for c in clusters.values():
        opts = c["typed_extension_protocol_options"][
            "envoy.extensions.upstreams.http.v3.HttpProtocolOptions"]
        assert "http2_protocol_options" in opts["explicit_http_config"], c["name"]


# ---------------------------------------------------------------- templates (no processes)

def test_upstream_calls_retry_reads_but_never_a_submit_that_may_lack_its_request_id() -> None:
    from gateway.app import service_config

    cfg = json.loads(service_config())
    assert cfg["loadBalancingConfig"] == [{"round_robin": {}}]
    retried = {n.get("method") for mc in cfg["methodConfig"] if "retryPolicy" in mc
               for n in mc["name"]}
    assert "GetJob" in retried and "ListJobs" in retried
    assert not retried & {"SubmitJob", "CreateCluster", "DeleteJob"}


def test_path_templates_match_decode_and_order() -> None:
    t = rules.parse_template("/v1/{name=jobs/*}:stop")
    assert t.match("/v1/jobs/a%20b:stop") == {"name": "jobs/a b"}
    assert t.match("/v1/jobs/a/b:stop") is None and t.match("/v1/jobs/a") is None
    # A multi-segment variable keeps %2F, so a decoded "/" never forges a segment.
    assert t.match("/v1/jobs/a%2Fb:stop") == {"name": "jobs/a%2Fb"}
    single = rules.parse_template("/v1/things/{id}")
    assert single.match("/v1/things/a%2Fb") == {"id": "a/b"}
    deep = rules.parse_template("/v1/{path=files/**}")
    assert deep.match("/v1/files/a/b/c") == {"path": "files/a/b/c"}
    for bad in ("v1/jobs", "/v1/{name=jobs/*", "/v1/{9x}", "/v1/**/x", "/v1/a:b:c"):
        with pytest.raises(rules.RuleError):
            rules.parse_template(bad)
    # A verb route is tried before a verb-less one whose variable could take it.
    order = [(r.http_method, r.template.text) for r in rules.routes_for(SERVICES)]
    assert order.index(("GET", "/v1/{name=jobs/*}:usage")) < order.index(("GET", "/v1/{name=jobs/*}"))


def _service_with_rule(rule: http_pb2.HttpRule) -> Any:
    fdp = descriptor_pb2.FileDescriptorProto(name=f"t{uuid.uuid4().hex}.proto", package="t",
                                             syntax="proto3")
    fdp.message_type.add(name="Req").field.add(
        name="name", number=1, type=descriptor_pb2.FieldDescriptorProto.TYPE_STRING,
        label=descriptor_pb2.FieldDescriptorProto.LABEL_OPTIONAL)
    fdp.message_type.add(name="Resp")
    m = fdp.service.add(name="Svc").method.add(name="Get", input_type=".t.Req",
                                                 output_type=".t.Resp")
    m.options.Extensions[annotations_pb2.http].CopyFrom(rule)
    pool = descriptor_pool.DescriptorPool()
    return pool.AddSerializedFile(fdp.SerializeToString()).services_by_name["Svc"]


def test_an_annotation_naming_a_missing_field_stops_start_up() -> None:
    ok = _service_with_rule(http_pb2.HttpRule(get="/v1/{name=things/*}"))
    assert [r.template.text for r in rules.routes_for([ok])] == ["/v1/{name=things/*}"]
    for bad in (http_pb2.HttpRule(get="/v1/{nope=things/*}"),
                http_pb2.HttpRule(post="/v1/things", body="nope"),
                http_pb2.HttpRule(get="/v1/things", response_body="nope")):
        with pytest.raises(rules.RuleError):
            rules.routes_for([_service_with_rule(bad)])


@pytest.mark.parametrize(("code", "reason_"), [(grpc.StatusCode.DEADLINE_EXCEEDED, "TIMED_OUT"),
                                               (grpc.StatusCode.UNAVAILABLE, "UPSTREAM_UNAVAILABLE")])
def test_a_status_grpc_made_itself_carries_an_error_info(code: grpc.StatusCode, reason_: str) -> None:
    """A deadline or a lost connection (no rich status from the service): the REST body still
    has an ErrorInfo reason to branch on, as every other error does."""
    from gateway import status

    err = grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details="Deadline Exceeded")
    body = status.to_json(status.from_rpc_error(err))
    assert body["code"] == code.value[0] and reason(body) == reason_, body
