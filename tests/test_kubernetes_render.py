"""Kubernetes manifests: golden files per run mode, names, validation, and the client's models."""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import re
import shlex
import shutil
import socket
import subprocess
import sys

import pytest
import yaml

from dlsched.errors import FailedPrecondition, InvalidArgument
from drivers.common import planner
from drivers.common.base import JobSpec, ReplicaGroup, Resources, RunMode
from drivers.kubernetes import mpi, naming, render

GOLDEN = pathlib.Path(__file__).parent / "golden" / "kubernetes"
UPDATE = os.environ.get("DLSCHED_UPDATE_GOLDEN") == "1"
OPTS = {"namespace": "ml", "default_image": "python:3.11-slim", "image_pull_secrets": "regcred, other"}


def g(role: str, replicas: int = 1, ppr: int = 0, *, command: tuple[str, ...] = ("python", "train.py"),
      args: tuple[str, ...] = (), env: dict[str, str] | None = None, image: str = "",
      **res: object) -> ReplicaGroup:
    return ReplicaGroup(role=role, replicas=replicas, processes_per_replica=ppr, command=command,
                        args=args, env=env or {}, image=image, resources=Resources(**res))  # type: ignore[arg-type]


SPECS: dict[str, JobSpec] = {
    "single_process": JobSpec(RunMode.SINGLE_PROCESS, (g("main", args=("--lr", "0.1"), env={"A": "1"},
                                                         cpu=0.5, memory_bytes=6 << 30),),
                              time_limit_seconds=90.5, labels={"team": "Vision.ML", "name": "Früh Lauf 1"}),
    "multi_process": JobSpec(RunMode.MULTI_PROCESS, (g("worker", 2, 2, cpu=8, memory_bytes=16 << 30,
                                                       gpus=2, gpu_type="NVIDIA-A100-SXM4-80GB",
                                                       image="pytorch/pytorch:2.4.0"),)),
    "master_worker": JobSpec(RunMode.MASTER_WORKER, (g("worker", 2), g("master"))),
    "ps_worker": JobSpec(RunMode.PS_WORKER, (g("chief"), g("ps", 2), g("worker", 2))),
    "mpi": JobSpec(RunMode.MPI, (g("worker", 2, 4, command=("unused",), cpu=4, memory_bytes=8 << 30),
                                 g("launcher", command=("python", "allreduce.py"), args=("--n", "10", ":", "-np", "1"),
                                   env={"OMP_NUM_THREADS": "1"}, cpu=1))),
}


@pytest.mark.parametrize("name", sorted(SPECS))
def test_golden(name: str) -> None:
    out = render.render_job("golden", SPECS[name], 3, OPTS)
    native = out.native_spec()
    path = GOLDEN / f"{name}.yaml"
    if UPDATE:
        path.write_text(native.content)
    assert native.content == path.read_text(), f"update with DLSCHED_UPDATE_GOLDEN=1 ({path})"
    assert native.media_type == "application/yaml"
    docs = list(yaml.safe_load_all(native.content))
    others = ["Secret", "ConfigMap"] if name == "mpi" else []
    assert [d["kind"] for d in docs] == ["Service", *others] + ["Pod"] * len(out.pods)
    svc = docs[0]
    assert svc["spec"]["clusterIP"] == "None" and svc["metadata"]["name"] == "golden-3"
    for obj in docs[1:]:
        assert obj["metadata"]["ownerReferences"][0]["name"] == "golden-3"
    for pod in docs[1 + len(others):]:
        labels = pod["metadata"]["labels"]
        assert labels[naming.LABEL_JOB] == "golden" and labels[naming.LABEL_ATTEMPT] == "3"
        assert pod["spec"]["subdomain"] == "golden-3" and pod["spec"]["restartPolicy"] == "Never"
        assert pod["metadata"]["ownerReferences"][0]["name"] == "golden-3"
        assert pod["spec"]["imagePullSecrets"] == [{"name": "regcred"}, {"name": "other"}]
        for c in pod["spec"]["containers"]:
            assert os.path.basename(c["command"][0]) not in ("sh", "bash")


def test_rendezvous_names_the_headless_service() -> None:
    out = render.render_job("golden", SPECS["master_worker"], 3, OPTS)
    pods = {p["metadata"]["name"]: p for p in out.manifests[1:]}
    env = {e["name"]: e["value"] for e in pods["golden-3-worker-1"]["spec"]["containers"][0]["env"]}
    assert env["MASTER_ADDR"] == "master-0.golden-3.ml.svc"
    assert env["WORLD_SIZE"] == "3" and env["RANK"] == "2"
    ps = render.render_job("golden", SPECS["ps_worker"], 3, OPTS)
    env = {e["name"]: e["value"] for e in ps.manifests[1]["spec"]["containers"][0]["env"]}
    tf = json.loads(env["TF_CONFIG"])
    assert tf["cluster"]["ps"] == ["ps-0.golden-3.ml.svc:2222", "ps-1.golden-3.ml.svc:2222"]
    assert ps.success.decisive_roles == {"chief"}


def test_a_pod_mounts_an_api_token_only_of_the_clusters_service_account() -> None:
    """Without the cluster option ``service_account`` a job's pods mount no API token (the
    namespace's default ServiceAccount's would reach the API server); with it, that one's."""
    for name in ("single_process", "mpi"):
        pods = [m for m in render.render_job("sa", SPECS[name], 1, OPTS).manifests if m["kind"] == "Pod"]
        assert pods and all(p["spec"]["automountServiceAccountToken"] is False for p in pods)
        assert not any("serviceAccountName" in p["spec"] for p in pods)
        pods = [m for m in render.render_job("sa", SPECS[name], 1, {**OPTS, "service_account": "trainer"}).manifests
                if m["kind"] == "Pod"]
        assert all(p["spec"]["serviceAccountName"] == "trainer" for p in pods)
        assert not any("automountServiceAccountToken" in p["spec"] for p in pods)


def test_gpus_split_over_the_containers_of_a_replica() -> None:
    out = render.render_job("golden", SPECS["multi_process"], 1, OPTS)
    pod = out.manifests[1]
    assert [c["name"] for c in pod["spec"]["containers"]] == ["proc-0", "proc-1"]
    lim = pod["spec"]["containers"][0]["resources"]["limits"]
    assert lim == {"cpu": "4", "memory": str(8 << 30), "nvidia.com/gpu": "1"}
    assert pod["spec"]["nodeSelector"] == {"nvidia.com/gpu.product": "NVIDIA-A100-SXM4-80GB"}


def test_a_memory_share_is_rounded_up_never_to_no_limit() -> None:
    """3 bytes over 4 processes: each container is limited to 1 byte, not given no limit (0)."""
    spec = JobSpec(RunMode.MULTI_PROCESS, (g("worker", 1, 4, cpu=1, memory_bytes=3),))
    pod = render.render_job("tiny", spec, 1, OPTS).manifests[1]
    assert [c["resources"]["limits"]["memory"] for c in pod["spec"]["containers"]] == ["1"] * 4


@pytest.mark.parametrize("text", [
    "My.Job.NAME-" + "é" * 30 + "x" * 200, "UPPER", "a..b", "-lead", "9starts-digit", "日本語", "",
    "a" * 63, "a" * 64,
])
def test_dns_labels_from_any_text(text: str) -> None:
    name = naming.dns_label(text)
    assert naming.is_dns_label(name) and name[0].isalpha(), name
    assert naming.dns_label(text) == name
    if naming.is_dns_label(text) and text[:1].isalpha():
        assert name == text


#: What the Kubernetes API accepts (apimachinery's validation), written out independently of render.
K8S_NAME = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
K8S_LABEL_NAME = re.compile(r"^[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$")
K8S_LABEL_VALUE = re.compile(r"^([A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?)?$")
MESSY = "My.Job.NAME: Überprüfung " + "日本語 " * 10 + "x" * 200


def assert_valid_metadata(m: dict) -> None:
    """Names, label keys and values of one object as the API server validates them."""
    meta = m["metadata"]
    assert len(meta["name"]) <= 63 and K8S_NAME.match(meta["name"]), meta["name"]
    for k, v in meta.get("labels", {}).items():
        prefix, _, name = k.rpartition("/")
        assert len(prefix) <= 253 and len(name) <= 63 and K8S_LABEL_NAME.match(name), k
        assert len(v) <= 63 and K8S_LABEL_VALUE.match(v), (k, v)
    if m["kind"] == "Pod":
        for f in ("hostname", "subdomain"):
            assert len(m["spec"][f]) <= 63 and K8S_NAME.match(m["spec"][f])


@pytest.mark.parametrize("mode", sorted(SPECS))
def test_a_messy_job_name_gives_valid_names_and_labels(mode: str) -> None:
    labels = {"name": MESSY, "Team.Name": "Vision.ML", "app.kubernetes.io/part-of": "A B",
              "not a key!": "kept in the annotation", "dlsched.io/job-id": "spoof"}
    job = "j" + "a-" * 31  # the longest, oddest id validation lets through
    out = render.render_job(job, dataclasses.replace(SPECS[mode], labels=labels), 12, OPTS)
    for m in out.manifests:
        assert_valid_metadata(m)
        got = m["metadata"]["labels"]
        assert got[naming.LABEL_JOB] == naming.job_label(job) and got["Team.Name"] == "Vision.ML"
        assert got["name"].startswith("My.Job.NAME-") and "not a key!" not in got
        assert json.loads(m["metadata"]["annotations"][naming.ANN_LABELS]) == labels
    assert out.manifests[0]["spec"]["selector"] == {naming.LABEL_JOB: naming.job_label(job),
                                                    naming.LABEL_ATTEMPT: "12"}
    assert len({(m["kind"], m["metadata"]["name"]) for m in out.manifests}) == len(out.manifests)


@pytest.mark.parametrize("text", [MESSY, "Vision.ML", "", "-x-", "日本語", "a" * 64, "_lead", "trail."])
def test_label_values_from_any_text(text: str) -> None:
    value = naming.label_value(text)
    assert len(value) <= 63 and K8S_LABEL_VALUE.match(value), value
    if len(text) <= 63 and K8S_LABEL_VALUE.match(text):
        assert value == text
    assert len({naming.label_value(t) for t in (MESSY, MESSY + "!", MESSY.upper())}) == 3


def test_distinct_texts_give_distinct_labels() -> None:
    texts = ["Job.A", "job-a", "job_a", "JOB-A", "x" * 200, "x" * 201]
    assert len({naming.dns_label(t) for t in texts}) == len(texts)


def test_long_job_ids_still_give_valid_names() -> None:
    job = "j" + "a-" * 31
    out = render.render_job(job, SPECS["ps_worker"], 12, OPTS)
    for m in out.manifests:
        assert naming.is_dns_label(m["metadata"]["name"])
        if m["kind"] == "Pod":
            assert naming.is_dns_label(m["spec"]["hostname"])
            assert naming.is_dns_label(m["spec"]["subdomain"])
    assert len({m["metadata"]["name"] for m in out.manifests}) == len(out.manifests)


def test_missing_image_and_bad_options_are_invalid_argument() -> None:
    with pytest.raises(InvalidArgument) as e:
        render.render_job("j", SPECS["single_process"], 1, {"image_pull_secrets": "Bad Name"})
    fields = {v.field for v in e.value.violations}
    assert fields == {"spec.replica_groups[0].image", "cluster.options[image_pull_secrets]"}
    with pytest.raises(InvalidArgument):
        render.render_job("j", SPECS["single_process"], 1, {**OPTS, "namespace": "Not_OK"})
    # What the API server refuses at the first pod (after the Service and MPI's Secret were made):
    # refused before any object, naming the field.
    for image in ("python:3.11 \n", " python:3.11", "python\t3.11", "py\x1bthon"):
        group = dataclasses.replace(SPECS["single_process"].replica_groups[0], image=image)
        bad = dataclasses.replace(SPECS["single_process"], replica_groups=(group,))
        with pytest.raises(InvalidArgument) as e:
            render.render_job("j", bad, 1, OPTS)
        assert [v.field for v in e.value.violations] == ["spec.replica_groups[0].image"], image


def test_a_relative_working_dir_is_invalid_argument() -> None:
    """A container runtime refuses a relative ``workingDir`` (the pod never starts): refused at
    render, naming the field; an absolute one is rendered as it is."""
    group = dataclasses.replace(SPECS["single_process"].replica_groups[0], working_dir="sub")
    bad = dataclasses.replace(SPECS["single_process"], replica_groups=(group,))
    with pytest.raises(InvalidArgument) as e:
        render.render_job("j", bad, 1, OPTS)
    assert [(v.field, v.description) for v in e.value.violations] == [
        ("spec.replica_groups[0].working_dir", "must be an absolute path on Kubernetes")]
    good = dataclasses.replace(SPECS["single_process"], replica_groups=(
        dataclasses.replace(group, working_dir="/work/sub"),))
    (pod,) = [m for m in render.render_job("j", good, 1, OPTS).manifests if m["kind"] == "Pod"]
    assert [c["workingDir"] for c in pod["spec"]["containers"]] == ["/work/sub"]


def test_mpi_launcher_reaches_worker_sshd_with_the_attempt_key() -> None:
    out = render.render_job("golden", SPECS["mpi"], 3, OPTS)
    objs = {(m["kind"], m["metadata"]["name"]): m for m in out.manifests}
    assert out.others == (("ConfigMap", "golden-3-mpi"), ("Secret", "golden-3-ssh"))
    assert out.success.decisive_roles == {"launcher"} and out.success.stopped_after_success == {"worker"}
    cm = objs["ConfigMap", "golden-3-mpi"]["data"]
    assert cm["hostfile"] == "worker-0.golden-3.ml.svc slots=4\nworker-1.golden-3.ml.svc slots=4\n"
    assert "Host *.golden-3.ml.svc" in cm["ssh_config"] and "StrictHostKeyChecking yes" in cm["ssh_config"]
    assert "PasswordAuthentication no" in cm["sshd_config"]
    secret = objs["Secret", "golden-3-ssh"]
    assert set(secret["stringData"].values()) == {""}  # rendering is pure: the key is made at launch
    launcher = objs["Pod", "golden-3-launcher-0"]["spec"]
    main = launcher["containers"][0]
    # mpirun sees no user token; ranks on the workers' sshd get the contract and the group's env by -x
    exported = ["DLSCHED_JOB_ID", "DLSCHED_JOB_NAME", "DLSCHED_ROLE", "DLSCHED_REPLICA_INDEX",
                "DLSCHED_NUM_REPLICAS", "DLSCHED_MPI_HOSTFILE", "DLSCHED_MPI_ARGV", "OMP_NUM_THREADS"]
    assert main["command"] == ["mpirun", "-np", "8", "--hostfile", "/etc/dlsched/mpi/hostfile",
                               *(t for k in exported for t in ("-x", k)), *planner.MPI_RANK_PROGRAM]
    assert "args" not in main
    env = {e["name"]: e["value"] for e in main["env"]}
    assert env["DLSCHED_MPI_HOSTFILE"] == "/etc/dlsched/mpi/hostfile" and env["OMPI_ALLOW_RUN_AS_ROOT"] == "1"
    assert env["DLSCHED_MPI_ARGV"] == "python allreduce.py --n 10 : -np 1" and env["OMP_NUM_THREADS"] == "1"
    (wait,) = launcher["initContainers"]
    assert wait["command"][:3] == ["sh", "-c", mpi.WAIT_SCRIPT]  # a constant script;
    assert wait["command"][4:] == ["worker-0.golden-3.ml.svc", "worker-1.golden-3.ml.svc"]  # names as args
    assert wait["resources"] == main["resources"]  # no larger pod request, same QoS
    for role in ("launcher", "worker"):
        spec = objs["Pod", f"golden-3-{role}-0"]["spec"]
        assert {v["name"] for v in spec["volumes"]} == {"dlsched-ssh", "dlsched-mpi"}
        assert all(c["volumeMounts"] == mpi.MPI_MOUNTS for c in spec["containers"])
    worker = objs["Pod", "golden-3-worker-1"]["spec"]
    (sshd,) = worker["containers"]  # one container whatever processes_per_replica: a host for 4 ranks
    assert sshd["command"] == ["/usr/sbin/sshd", "-De", "-f", "/root/.ssh/sshd_config"]
    assert sshd["resources"]["limits"] == {"cpu": "4", "memory": str(8 << 30)}
    assert [(p.role, p.containers) for p in out.pods] == [("launcher", ("main",)), ("worker", ("sshd",)),
                                                          ("worker", ("sshd",))]


def kubelet_expand(text: str, env: dict[str, str]) -> str:
    """What the kubelet makes of a command, args or env value (Kubernetes' ``expansion.Expand``):
    ``$$`` is ``$``, ``$(NAME)`` the value of a variable defined before it, anything else as it is."""
    out, i = [], 0
    while i < len(text):
        if text[i] == "$" and i + 1 < len(text):
            nxt = text[i + 1]
            if nxt == "$":
                out.append("$")
                i += 2
                continue
            if nxt == "(":
                end = text.find(")", i + 2)
                if end >= 0:
                    name = text[i + 2:end]
                    out.append(env.get(name, f"$({name})"))
                    i = end + 1
                    continue
        out.append(text[i])
        i += 1
    return "".join(out)


@pytest.mark.parametrize("mode", ["single_process", "mpi"])
def test_argv_and_env_reach_the_process_verbatim_through_the_kubelet(mode: str) -> None:
    """The kubelet expands ``$(NAME)`` and ``$$`` in command, args and env values; what it hands the
    process is still exactly the user's argv and env."""
    tricky = ("$(DLSCHED_JOB_ID)", "$$", "$(A)", "$HOME", "$(", "a$(B)c", "$")
    base = SPECS[mode]
    groups = tuple(dataclasses.replace(x, args=tricky, env={"A": "$(DLSCHED_ROLE)", "B": "$$x"})
                   if x.role in ("main", "launcher") else x for x in base.replica_groups)
    out = render.render_job("verbatim", dataclasses.replace(base, replica_groups=groups), 1, OPTS)
    pod = next(m for m in out.manifests if m["kind"] == "Pod")
    c = pod["spec"]["containers"][0]
    env: dict[str, str] = {}
    for e in c["env"]:  # each value expanded against those before it, as the kubelet does
        env[e["name"]] = kubelet_expand(e["value"], env)
    assert env["A"] == "$(DLSCHED_ROLE)" and env["B"] == "$$x"
    argv = [kubelet_expand(a, env) for a in [*c["command"], *c.get("args", [])]]
    if mode == "mpi":
        assert argv[-3:] == list(planner.MPI_RANK_PROGRAM)
        assert shlex.split(env["DLSCHED_MPI_ARGV"]) == ["python", "allreduce.py", *tricky]
    else:
        assert argv == ["python", "train.py", *tricky]


def test_with_ssh_key_pins_the_key_for_the_service_names() -> None:
    secret = render.render_job("golden", SPECS["mpi"], 3, OPTS).manifests[1]
    filled = mpi.with_ssh_key(secret, "-----BEGIN OPENSSH PRIVATE KEY-----\nx\n-----END OPENSSH PRIVATE KEY-----",
                                 "ssh-ed25519 AAAAC3 dlsched\n")
    assert filled["stringData"] == {
        "ssh-privatekey": "-----BEGIN OPENSSH PRIVATE KEY-----\nx\n-----END OPENSSH PRIVATE KEY-----\n",
        "ssh-publickey": "ssh-ed25519 AAAAC3 dlsched\n",
        "known_hosts": "*.golden-3.ml.svc ssh-ed25519 AAAAC3 dlsched\n",
    }
    assert set(secret["stringData"].values()) == {""}  # the rendered manifest is untouched


def test_the_driver_makes_a_fresh_openssh_key_pair(tmp_path: pathlib.Path) -> None:
    pytest.importorskip("cryptography")

    private, public = mpi.ssh_keypair()
    assert private.startswith("-----BEGIN OPENSSH PRIVATE KEY-----") and public.startswith("ssh-ed25519 ")
    assert mpi.ssh_keypair() != (private, public)
    keygen = shutil.which("ssh-keygen")
    if keygen:  # OpenSSH reads the private key and derives the same public key
        key = tmp_path / "id"
        key.write_text(private)
        key.chmod(0o600)
        derived = subprocess.run([keygen, "-y", "-f", str(key)], check=True, capture_output=True, text=True)
        assert derived.stdout.split()[:2] == public.split()[:2]


def test_the_rendered_ssh_files_let_the_launcher_into_a_worker(tmp_path: pathlib.Path) -> None:
    """A real sshd and ssh with exactly the files the MPI pods mount (paths and port moved, names aliased).

    The worker names resolve to 127.0.0.1 here (``HostName`` with ``HostKeyAlias``, so host keys are
    still checked under the worker's name); everything else is the rendered configuration.
    """
    sshd, ssh = shutil.which("sshd", path="/usr/sbin:/usr/bin"), shutil.which("ssh")
    if not (sshd and ssh and os.geteuid() == 0):
        pytest.skip("needs sshd, ssh and root")
    pytest.importorskip("cryptography")

    out = render.render_job("sshcheck", SPECS["mpi"], 1, OPTS)
    objs = {m["kind"]: m for m in out.manifests if m["kind"] != "Pod"}
    data = {"Secret": mpi.with_ssh_key(objs["Secret"], *mpi.ssh_keypair())["stringData"],
            "ConfigMap": objs["ConfigMap"]["data"]}
    launcher = next(m["spec"] for m in out.manifests if m["metadata"]["name"] == "sshcheck-1-launcher-0")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    d = tmp_path / "ssh"
    d.mkdir()

    def moved(text: str) -> str:
        return text.replace(mpi.SSH_DIR, str(d)).replace("Port 22\n", f"Port {port}\n")

    for src in launcher["volumes"][0]["projected"]["sources"]:  # the projection as rendered
        kind, ref = next(iter(src.items()))
        for item in ref["items"]:
            f = d / item["path"]
            f.write_text(moved(data["Secret" if kind == "secret" else "ConfigMap"][item["key"]]))
            f.chmod(item.get("mode", 0o444))
    workers = [f"worker-{i}.sshcheck-1.ml.svc" for i in range(2)]
    aliases = "".join(f"Host {h}\n  HostName 127.0.0.1\n  HostKeyAlias {h}\n  Port {port}\n"
                      for h in [*workers, "worker-0.other-1.ml.svc"])
    (d / "config").chmod(0o644)
    (d / "config").write_text(aliases + (d / "config").read_text())
    with open(d / "sshd_config", "a") as f:
        f.write(f"PidFile {d}/sshd.pid\nListenAddress 127.0.0.1\n")
    server = subprocess.Popen([sshd, "-De", "-f", str(d / "sshd_config")], stderr=subprocess.DEVNULL)
    try:
        wait = [moved(kubelet_expand(a, {})) for a in launcher["initContainers"][0]["command"]]
        assert wait[4:] == workers
        subprocess.run(wait, check=True, timeout=60, capture_output=True)  # the init container's wait ends
        other = subprocess.run([ssh, "-F", str(d / "config"), "worker-0.other-1.ml.svc", "true"],
                               timeout=30, capture_output=True, text=True)
        assert other.returncode == 255 and "Host key verification failed" in other.stderr  # pinned names
    finally:
        server.terminate()
        server.wait(10)


def test_without_cryptography_mpi_is_not_offered(monkeypatch: pytest.MonkeyPatch) -> None:
    from drivers.kubernetes import driver

    monkeypatch.setitem(sys.modules, "cryptography.hazmat.primitives.asymmetric.ed25519", None)
    with pytest.raises(FailedPrecondition) as e:
        mpi.ssh_keypair()
    assert e.value.reason == "MPI_NOT_AVAILABLE"
    monkeypatch.setattr(driver.importlib.util, "find_spec", lambda name: None)
    assert RunMode.MPI not in driver._run_modes() and RunMode.MASTER_WORKER in driver._run_modes()


@pytest.mark.parametrize("name", sorted(SPECS))
def test_manifests_round_trip_through_the_client_models(name: str) -> None:
    k8s = pytest.importorskip("kubernetes")
    client = k8s.client.ApiClient()

    for m in render.render_job("golden", SPECS[name], 1, OPTS).manifests:
        if m["kind"] == "Secret":
            m = mpi.with_ssh_key(m, "-----BEGIN OPENSSH PRIVATE KEY-----\n", "ssh-ed25519 AAAA")
        model = client.deserialize(json.dumps(m), f"V1{m['kind']}", "application/json")
        assert client.sanitize_for_serialization(model) == m
