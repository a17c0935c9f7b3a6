"""Cluster credentials envelope-encrypted at rest (dlsched/kit/envelope.py).

Unit tests of the envelope module, then the store over a real etcd, then
ClusterManager as a real process with in-test recording DriverService servers
(real grpc.aio on port 0): no plain text in an etcd dump, credentials never
sent to a driver a cluster moved to, ``rotate-key`` with and without a restart,
and no start-up without a key.
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import secrets
import stat
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import aetcd
import grpc
import pytest
from google.protobuf import field_mask_pb2

from cluster_manager.domain.models import Cluster, ClusterType, Credentials, CredentialsKind
from cluster_manager.store import ClusterStore
from dlsched.errors import DlschedError
from dlsched.kit import tls as tls_kit
from dlsched.kit.envelope import (
    MAGIC,
    DecryptError,
    KeyFileError,
    Keyring,
    add_key,
    generate_key_file,
)
from dlsched.v1 import cluster_manager_service_pb2 as pb
from dlsched.v1 import cluster_manager_service_pb2_grpc as pb_grpc
from dlsched.v1 import cluster_pb2, driver_service_pb2, driver_service_pb2_grpc, job_pb2
from tests import security
from tests.harness import ROOT, EtcdServer, ServiceProcess

WAIT = 15.0


def canary() -> str:
    return f"canary-{secrets.token_hex(12)}"


def ssh_key_text(marker: str) -> str:
    return ("-----BEGIN OPENSSH PRIVATE KEY-----\n"
            f"b3BlbnNzaC1rZXktdjEAAAAABG5vbmUAAAAEbm9uZQ{marker}AAAAAAAABAAAAMwAAAAtzc2gtZW\n"
            "-----END OPENSSH PRIVATE KEY-----\n")


def encodings(secret: str) -> list[bytes]:
    """``secret`` as etcd could hold it: raw, hex, and base64 (plain and url-safe)
    at each of the three alignments it can have inside a longer base64 text."""
    raw = secret.encode()
    out = [raw, raw.hex().encode()]
    for shift in range(3):
        for enc in (base64.b64encode, base64.urlsafe_b64encode):
            b = enc(b"\0" * shift + raw)
            out.append(b[4:-4])  # the middle, free of the padding and the shifted head
    return out


def assert_absent(dump: bytes, *secrets_: str) -> None:
    for s in secrets_:
        for form in encodings(s):
            assert form not in dump, f"a form of {s[:10]}... is in etcd"


async def etcd_dump(etcd: EtcdServer) -> bytes:
    """Every key and value in etcd, whatever its prefix."""
    client = aetcd.Client(host="127.0.0.1", port=etcd.client_port)
    try:
        res = await client.get_range(b"\0", b"\0")
        return b"\n".join(kv.key + b"=" + kv.value for kv in res)
    finally:
        await client.close()


async def raw_credentials(etcd: EtcdServer, prefix: str) -> dict[str, bytes]:
    client = aetcd.Client(host="127.0.0.1", port=etcd.client_port)
    try:
        p = f"{prefix}cluster-credentials/".encode()
        return {kv.key[len(p):].decode(): kv.value for kv in await client.get_prefix(p)}
    finally:
        await client.close()


# --- the envelope module ----------------------------------------------------


@pytest.fixture
def key_file(tmp_path: Path) -> Path:
    p = tmp_path / "key.json"
    generate_key_file(p)
    return p


def test_roundtrip_and_blob_format(key_file: Path) -> None:
    kr = Keyring.load(key_file)
    secret = canary().encode()
    a, b = kr.encrypt(secret, "c1"), kr.encrypt(secret, "c1")
    assert a != b  # a fresh data key and nonces per record
    for blob in (a, b):
        assert blob.startswith(MAGIC) and secret not in blob
        body = json.loads(blob[len(MAGIC):])
        assert body["kid"] == kr.active_key_id
        assert len(base64.b64decode(body["wk"])) == 32 + 16  # wrapped 256-bit key + tag
        assert Keyring.key_id_of(blob) == kr.active_key_id
        assert kr.decrypt(blob, "c1") == secret
        assert kr.decrypt(blob, b"c1") == secret
    assert Keyring.key_id_of(b"\x0a\x03abc") is None  # plain proto bytes


def test_wrong_aad_and_tampering_fail_with_decrypt_error(key_file: Path) -> None:
    kr = add_key(key_file)  # two keys, so a blob can be pointed at the other one
    blob = kr.encrypt(b"secret", "cluster-a")
    with pytest.raises(DecryptError) as ei:
        kr.decrypt(blob, "cluster-b")
    assert ei.value.reason == "DECRYPT_FAILED" and isinstance(ei.value, DlschedError)
    assert ei.value.__cause__ is None and ei.value.__suppress_context__

    body = json.loads(blob[len(MAGIC):])
    other = next(k for k in kr.key_ids if k != body["kid"])
    bad: list[bytes] = [
        b"", b"dlsenc", MAGIC, MAGIC + b"{}", MAGIC + b"not json", b"\x0a\x03abc",
        blob[:-3], blob.replace(MAGIC, b"dlsenc2", 1),
        MAGIC + json.dumps({**body, "kid": other}).encode(),
        MAGIC + json.dumps({**body, "kid": "k9-unknown"}).encode(),
        MAGIC + json.dumps({**body, "kid": 7}).encode(),
        MAGIC + json.dumps({**body, "ct": "!!!"}).encode(),
    ]
    for field in ("wn", "wk", "n", "ct"):  # flip one bit of each binary field
        raw = bytearray(base64.b64decode(body[field]))
        raw[len(raw) // 2] ^= 1
        bad.append(MAGIC + json.dumps({**body, field: base64.b64encode(bytes(raw)).decode()}).encode())
    for b in bad:
        with pytest.raises(DecryptError):
            kr.decrypt(b, "cluster-a")
    with pytest.raises(DecryptError) as ei:
        kr.decrypt(MAGIC + json.dumps({**body, "kid": "k9-unknown"}).encode(), "cluster-a")
    assert ei.value.metadata == {"key_id": "k9-unknown"}


def test_key_file_is_private_and_never_overwritten(tmp_path: Path) -> None:
    p = tmp_path / "keys" / "key.json"
    p.parent.mkdir()
    kr = generate_key_file(p)
    assert stat.S_IMODE(p.stat().st_mode) == 0o600
    doc = json.loads(p.read_text())
    assert doc["version"] == 1 and doc["active"] == kr.active_key_id
    assert list(doc["keys"]) == [kr.active_key_id]
    assert len(base64.b64decode(doc["keys"][kr.active_key_id])) == 32
    before = p.read_bytes()
    with pytest.raises(KeyFileError):
        generate_key_file(p)
    assert p.read_bytes() == before
    assert sorted(os.listdir(p.parent)) == ["key.json"]  # no temp file left behind


def test_add_key_keeps_old_keys_and_old_blobs_decrypt(key_file: Path) -> None:
    old = Keyring.load(key_file)
    blob = old.encrypt(b"old secret", "c")
    new = add_key(key_file)
    assert stat.S_IMODE(key_file.stat().st_mode) == 0o600
    assert new.active_key_id != old.active_key_id
    assert set(new.key_ids) == {old.active_key_id, new.active_key_id}
    assert Keyring.load(key_file).active_key_id == new.active_key_id
    assert new.decrypt(blob, "c") == b"old secret"
    assert Keyring.key_id_of(new.encrypt(b"x", "c")) == new.active_key_id
    # A keyring loaded before the rotation re-reads its file for the unknown key.
    assert old.decrypt(new.encrypt(b"new secret", "c"), "c") == b"new secret"
    assert old.active_key_id == new.active_key_id


def test_bad_key_files_are_refused_with_a_clear_error(tmp_path: Path) -> None:
    good = tmp_path / "good.json"
    kr = generate_key_file(good)
    doc = json.loads(good.read_text())
    key_b64 = doc["keys"][kr.active_key_id]

    def write(name: str, content: str, mode: int = 0o600) -> Path:
        p = tmp_path / name
        p.write_text(content)
        p.chmod(mode)
        return p

    cases = {
        "missing": tmp_path / "absent.json",
        "not json": write("a.json", "{"),
        "no keys": write("b.json", json.dumps({"active": "k1", "keys": {}})),
        "active not a key": write("c.json", json.dumps({**doc, "active": "k7"})),
        "short key": write("d.json", json.dumps({"active": "k1", "keys": {"k1": "AAAA"}})),
        "not base64": write("e.json", json.dumps({"active": "k1", "keys": {"k1": "@@@"}})),
        "world readable": write("f.json", good.read_text(), 0o644),
        "a directory": tmp_path,
    }
    for what, path in cases.items():
        with pytest.raises(KeyFileError) as ei:
            Keyring.load(path)
        assert str(path) in ei.value.message, what
        assert key_b64 not in ei.value.message, what
    assert key_b64 not in repr(Keyring.load(good))


# --- the store over real etcd -----------------------------------------------


@pytest.fixture
async def store(etcd: EtcdServer, etcd_prefix: str, key_file: Path) -> AsyncIterator[ClusterStore]:
    client = aetcd.Client(host="127.0.0.1", port=etcd.client_port)
    s = ClusterStore(client, Keyring.load(key_file), etcd_prefix)
    yield s
    await s.close()


def slurm(cid: str) -> Cluster:
    return Cluster(cluster_id=cid, type=ClusterType.SLURM, driver_address="127.0.0.1:1",
                   address="login:22", has_credentials=True)


async def test_store_encrypts_and_binds_each_record_to_its_cluster(
        store: ClusterStore, etcd: EtcdServer, etcd_prefix: str, key_file: Path) -> None:
    mark = canary()
    creds = Credentials(CredentialsKind.SSH, username="svc", private_key=ssh_key_text(mark))
    await store.create(slurm("a"), creds)
    await store.create(slurm("b"), Credentials(CredentialsKind.SSH, username="svc",
                                               private_key=ssh_key_text(canary())))
    assert (await store.get_credentials("a"))[0] == creds
    raw = await raw_credentials(etcd, etcd_prefix)
    assert raw["a"].startswith(MAGIC)
    assert_absent(raw["a"], mark)

    client = aetcd.Client(host="127.0.0.1", port=etcd.client_port)
    try:
        # a's blob copied under b: the aad (cluster id) no longer matches.
        await client.put(f"{etcd_prefix}cluster-credentials/b".encode(), raw["a"])
        with pytest.raises(DecryptError):
            await store.get_credentials("b")
        # One flipped byte of the ciphertext.
        body = json.loads(raw["a"][len(MAGIC):])
        ct = bytearray(base64.b64decode(body["ct"]))
        ct[0] ^= 0x80
        body["ct"] = base64.b64encode(bytes(ct)).decode()
        await client.put(f"{etcd_prefix}cluster-credentials/b".encode(),
                         MAGIC + json.dumps(body).encode())
        with pytest.raises(DecryptError):
            await store.get_credentials("b")
    finally:
        await client.close()
    # Another key file (the key is not in it) cannot read a's record either.
    other = ClusterStore(aetcd.Client(host="127.0.0.1", port=etcd.client_port),
                         generate_key_file(key_file.with_name("other.json")), etcd_prefix)
    try:
        with pytest.raises(DecryptError):
            await other.get_credentials("a")
    finally:
        await other.close()


async def test_reencrypt_all_rewrites_old_and_plain_records_once(
        store: ClusterStore, etcd: EtcdServer, etcd_prefix: str, key_file: Path) -> None:
    tok = canary()
    creds = Credentials(CredentialsKind.TOKEN, token=tok)
    ray = Cluster(cluster_id="r", type=ClusterType.RAY, driver_address="127.0.0.1:1",
                  address="http://ray:8265", has_credentials=True)
    await store.create(ray, creds)
    # A record from before encryption: plain ClusterCredentials bytes.
    legacy = cluster_pb2.ClusterCredentials(token=cluster_pb2.TokenCredentials(token=tok + "-old"))
    await store.create(Cluster(cluster_id="legacy", type=ClusterType.RAY,
                               driver_address="127.0.0.1:1", address="http://r:1"), None)
    client = aetcd.Client(host="127.0.0.1", port=etcd.client_port)
    try:
        await client.put(f"{etcd_prefix}cluster-credentials/legacy".encode(),
                         legacy.SerializeToString())
    finally:
        await client.close()
    with pytest.raises(DecryptError):  # never read as plain text
        await store.get_credentials("legacy")
    old_kid = Keyring.load(key_file).active_key_id

    assert await store.reencrypt_all() == 1  # only the plain record: "r" is under the active key
    new = add_key(key_file)
    rotated = ClusterStore(aetcd.Client(host="127.0.0.1", port=etcd.client_port), new, etcd_prefix)
    try:
        assert await rotated.reencrypt_all() == 2
        assert await rotated.reencrypt_all() == 0
        raw = await raw_credentials(etcd, etcd_prefix)
        assert {Keyring.key_id_of(v) for v in raw.values()} == {new.active_key_id}
        assert old_kid.encode() not in b"".join(raw.values())
        assert (await rotated.get_credentials("r"))[0] == creds
        got, _ = await rotated.get_credentials("legacy")
        assert got is not None and got.token == tok + "-old"
    finally:
        await rotated.close()


# --- ClusterManager as a process --------------------------------------------


class RecordingDriver(driver_service_pb2_grpc.DriverServiceServicer):
    """A DriverService that answers READY and keeps every ConfigureCluster."""

    def __init__(self) -> None:
        self.configures: list[driver_service_pb2.ConfigureClusterRequest] = []
        self.raw: list[bytes] = []
        self.server: grpc.aio.Server | None = None
        self.address = ""

    async def start(self) -> RecordingDriver:
        self.server = grpc.aio.server()
        driver_service_pb2_grpc.add_DriverServiceServicer_to_server(self, self.server)
        # A real TLS server the CA vouches for: even a driver that looks
        # legitimate must not receive credentials it was not given for.
        port = tls_kit.bind(self.server, "127.0.0.1:0", security.current().service_tls(),
                            require_client_cert=True, service="recording-driver")
        await self.server.start()
        self.address = f"127.0.0.1:{port}"
        return self

    async def stop(self) -> None:
        if self.server is not None:
            await self.server.stop(None)

    def _info(self) -> driver_service_pb2.ClusterInfo:
        return driver_service_pb2.ClusterInfo(state=cluster_pb2.CLUSTER_STATE_READY,
                                              supported_run_modes=[job_pb2.RUN_MODE_SINGLE_PROCESS])

    async def ConfigureCluster(self, request: driver_service_pb2.ConfigureClusterRequest,
                               context: object) -> driver_service_pb2.ConfigureClusterResponse:
        self.configures.append(request)
        self.raw.append(request.SerializeToString())
        return driver_service_pb2.ConfigureClusterResponse(info=self._info())

    async def GetClusterInfo(self, request: driver_service_pb2.GetClusterInfoRequest,
                             context: object) -> driver_service_pb2.GetClusterInfoResponse:
        return driver_service_pb2.GetClusterInfoResponse(info=self._info())

    async def RemoveCluster(self, request: driver_service_pb2.RemoveClusterRequest,
                            context: object) -> driver_service_pb2.RemoveClusterResponse:
        return driver_service_pb2.RemoveClusterResponse()

    def of(self, name: str) -> list[driver_service_pb2.ConfigureClusterRequest]:
        return [r for r in self.configures if r.cluster == name]

    async def wait_configured(self, name: str, after: int = 0,
                              within: float = WAIT) -> driver_service_pb2.ConfigureClusterRequest:
        """The first ConfigureCluster of ``name`` beyond the ``after`` seen already."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + within
        while len(self.of(name)) <= after:
            assert loop.time() < deadline, f"{name} was not configured on {self.address}"
            await asyncio.sleep(0.05)
        return self.of(name)[after]


@pytest.fixture
async def driver() -> AsyncIterator[RecordingDriver]:
    d = await RecordingDriver().start()
    yield d
    await d.stop()


def start_cm(etcd: EtcdServer, prefix: str, *extra: str) -> ServiceProcess:
    return ServiceProcess(
        "cluster_manager",
        ["--etcd", etcd.endpoint, "--prefix", prefix, "--monitor-interval", "0.2",
         "--log-level", "DEBUG", *extra],
        name="cluster-manager",
    ).start()


@pytest.fixture
def cm(etcd: EtcdServer, etcd_prefix: str) -> Iterator[ServiceProcess]:
    proc = start_cm(etcd, etcd_prefix)
    yield proc
    proc.stop()


async def create(address: str, cid: str, c: cluster_pb2.Cluster) -> cluster_pb2.Cluster:
    async with security.channel(address) as ch:
        return (await pb_grpc.ClusterManagerServiceStub(ch).CreateCluster(
            pb.CreateClusterRequest(cluster_id=cid, cluster=c))).cluster


async def update(address: str, c: cluster_pb2.Cluster, *paths: str) -> cluster_pb2.Cluster:
    async with security.channel(address) as ch:
        return (await pb_grpc.ClusterManagerServiceStub(ch).UpdateCluster(
            pb.UpdateClusterRequest(cluster=c, update_mask=field_mask_pb2.FieldMask(
                paths=list(paths))))).cluster


async def wait_ready(address: str, *names: str, within: float = WAIT) -> None:
    """Each cluster READY: the driver answered its ConfigureCluster."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within
    async with security.channel(address) as ch:
        stub = pb_grpc.ClusterManagerServiceStub(ch)
        for name in names:
            while (c := (await stub.GetCluster(pb.GetClusterRequest(name=name))).cluster).state \
                    != cluster_pb2.CLUSTER_STATE_READY:
                assert loop.time() < deadline, f"{name}: {c.state_message}"
                await asyncio.sleep(0.05)


def ssh_creds(marker: str) -> cluster_pb2.ClusterCredentials:
    return cluster_pb2.ClusterCredentials(
        ssh=cluster_pb2.SshCredentials(username="svc", private_key=ssh_key_text(marker),
                                       known_host_keys=["login ssh-ed25519 AAAAC3Nza"]))


def slurm_pb(driver_address: str, creds: cluster_pb2.ClusterCredentials) -> cluster_pb2.Cluster:
    return cluster_pb2.Cluster(type=job_pb2.CLUSTER_TYPE_SLURM, address="login.example.org:22",
                               driver_address=driver_address, credentials=creds)


async def test_etcd_dump_holds_no_plaintext_credential(
        etcd: EtcdServer, etcd_prefix: str, cm: ServiceProcess, driver: RecordingDriver) -> None:
    ssh_mark, tok, kube_tok, rot = canary(), canary(), canary(), canary()
    await create(cm.address, "slurm-a", slurm_pb(driver.address, ssh_creds(ssh_mark)))
    await create(cm.address, "ray-a", cluster_pb2.Cluster(
        type=job_pb2.CLUSTER_TYPE_RAY, address="http://ray:8265", driver_address=driver.address,
        credentials=cluster_pb2.ClusterCredentials(token=cluster_pb2.TokenCredentials(token=tok))))
    await create(cm.address, "k8s-a", cluster_pb2.Cluster(
        type=job_pb2.CLUSTER_TYPE_KUBERNETES, address="https://k8s:6443",
        driver_address=driver.address,
        credentials=cluster_pb2.ClusterCredentials(kubernetes=cluster_pb2.KubernetesCredentials(
            token=kube_tok, kubeconfig=f"users: [{{token: {kube_tok}}}]"))))
    await update(cm.address, cluster_pb2.Cluster(
        name="clusters/ray-a", credentials=cluster_pb2.ClusterCredentials(
            token=cluster_pb2.TokenCredentials(token=rot))), "credentials")
    # The monitor decrypts them for the driver (so they are really stored).
    got = await driver.wait_configured("clusters/slurm-a")
    assert got.credentials == ssh_creds(ssh_mark)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + WAIT
    while not any(r.credentials.token.token == rot for r in driver.of("clusters/ray-a")):
        assert loop.time() < deadline, "ray-a not configured with its rotated token"
        await asyncio.sleep(0.05)

    raw = await raw_credentials(etcd, etcd_prefix)
    assert sorted(raw) == ["k8s-a", "ray-a", "slurm-a"]
    assert all(v.startswith(MAGIC) for v in raw.values())
    dump = await etcd_dump(etcd)
    assert f"{etcd_prefix}cluster-credentials/slurm-a".encode() in dump
    assert_absent(dump, ssh_mark, tok, kube_tok, rot, "PRIVATE KEY")
    for secret in (ssh_mark, tok, kube_tok, rot):
        assert secret not in cm.log()


async def test_moving_a_cluster_drops_its_credentials(
        etcd: EtcdServer, etcd_prefix: str, cm: ServiceProcess, driver: RecordingDriver) -> None:
    mark = canary()
    creds = ssh_creds(mark)
    made = await create(cm.address, "mover", slurm_pb(driver.address, creds))
    assert made.has_credentials
    assert (await driver.wait_configured("clusters/mover")).credentials == creds
    await wait_ready(cm.address, "clusters/mover")
    assert len(driver.of("clusters/mover")) == 1

    # Same values in the mask change nothing: the credentials stay.
    kept = await update(cm.address, cluster_pb2.Cluster(
        name="clusters/mover", address=made.address, driver_address=driver.address),
        "address", "driver_address")
    assert kept.has_credentials
    assert "mover" in await raw_credentials(etcd, etcd_prefix)

    # A new driver address without credentials: deleted, never sent there.
    other = await RecordingDriver().start()
    third = await RecordingDriver().start()
    try:
        moved = await update(cm.address, cluster_pb2.Cluster(
            name="clusters/mover", driver_address=other.address), "driver_address")
        assert not moved.has_credentials
        assert "mover" not in await raw_credentials(etcd, etcd_prefix)
        got = await other.wait_configured("clusters/mover")
        await asyncio.sleep(1.0)  # several monitor intervals
        assert not got.HasField("credentials")
        for r in other.of("clusters/mover"):
            assert not r.HasField("credentials")
        assert_absent(b"".join(other.raw), mark)

        # Moving with new credentials in the same call keeps the new ones.
        mark2 = canary()
        moved = await update(cm.address, cluster_pb2.Cluster(
            name="clusters/mover", driver_address=third.address, credentials=ssh_creds(mark2)),
            "driver_address", "credentials")
        assert moved.has_credentials
        assert (await third.wait_configured("clusters/mover")).credentials == ssh_creds(mark2)

        # A new (access) address without credentials drops them as well.
        n = len(third.of("clusters/mover"))
        moved = await update(cm.address, cluster_pb2.Cluster(
            name="clusters/mover", address="login2.example.org:22"), "address")
        assert not moved.has_credentials
        got = await third.wait_configured("clusters/mover", after=n)
        assert got.address == "login2.example.org:22" and not got.HasField("credentials")
        await asyncio.sleep(0.6)
        assert not any(r.HasField("credentials") for r in third.of("clusters/mover")[n:])
        assert_absent(b"".join(third.raw[n:]), mark2)
    finally:
        await other.stop()
        await third.stop()


async def test_rotate_key_reencrypts_and_a_restarted_manager_still_configures(
        etcd: EtcdServer, etcd_prefix: str, driver: RecordingDriver, tmp_path: Path) -> None:
    key_file = tmp_path / "rotated.json"
    first = generate_key_file(key_file)
    flag = ("--encryption-key-file", str(key_file))
    ssh_mark, tok = canary(), canary()
    ray_creds = cluster_pb2.ClusterCredentials(token=cluster_pb2.TokenCredentials(token=tok))
    proc = start_cm(etcd, etcd_prefix, *flag)
    try:
        await create(proc.address, "slurm-r", slurm_pb(driver.address, ssh_creds(ssh_mark)))
        await create(proc.address, "ray-r", cluster_pb2.Cluster(
            type=job_pb2.CLUSTER_TYPE_RAY, address="http://ray:8265",
            driver_address=driver.address, credentials=ray_creds))
        await wait_ready(proc.address, "clusters/slurm-r", "clusters/ray-r")
        raw = await raw_credentials(etcd, etcd_prefix)
        assert {Keyring.key_id_of(v) for v in raw.values()} == {first.active_key_id}

        # Rotate while this manager runs.
        before = {n: len(driver.of(n)) for n in ("clusters/slurm-r", "clusters/ray-r")}
        # (not subprocess.run: the recording driver serves on this event loop)
        rot = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "cluster_manager", "rotate-key", "--etcd", etcd.endpoint,
            "--prefix", etcd_prefix, *flag, stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE, cwd=str(ROOT),
            env={**os.environ, "PYTHONPATH": str(ROOT)})
        stdout, stderr = await asyncio.wait_for(rot.communicate(), 60)
        assert rot.returncode == 0, stderr.decode()
        rotated = Keyring.load(key_file)
        assert rotated.active_key_id != first.active_key_id
        assert set(rotated.key_ids) == {first.active_key_id, rotated.active_key_id}
        assert "re-encrypted 2 " in stdout.decode() and rotated.active_key_id in stdout.decode()
        assert stat.S_IMODE(key_file.stat().st_mode) == 0o600

        raw = await raw_credentials(etcd, etcd_prefix)
        assert {Keyring.key_id_of(v) for v in raw.values()} == {rotated.active_key_id}
        dump = await etcd_dump(etcd)
        assert first.active_key_id.encode() not in dump
        assert_absent(dump, ssh_mark, tok)
        # The running manager re-read its file for the new key and configures again.
        got = await driver.wait_configured("clusters/slurm-r", after=before["clusters/slurm-r"])
        assert got.credentials == ssh_creds(ssh_mark)
        got = await driver.wait_configured("clusters/ray-r", after=before["clusters/ray-r"])
        assert got.credentials == ray_creds
    finally:
        proc.stop()

    # Restarted with the rotated file: the driver gets the original credentials.
    driver.configures.clear()
    proc = start_cm(etcd, etcd_prefix, *flag)
    try:
        assert (await driver.wait_configured("clusters/slurm-r")).credentials == \
            ssh_creds(ssh_mark)
        assert (await driver.wait_configured("clusters/ray-r")).credentials == ray_creds
    finally:
        proc.stop()
    assert tok not in proc.log() and ssh_mark not in proc.log()


def run_cm(etcd: EtcdServer, *extra: str, env_key: str | None = None,
           tmp: Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "DLSCHED_ENCRYPTION_KEY_FILE"}
    if env_key is not None:
        env["DLSCHED_ENCRYPTION_KEY_FILE"] = env_key
    port_file = tmp / f"port-{secrets.token_hex(4)}"
    out = subprocess.run(
        [sys.executable, "-m", "cluster_manager", "--etcd", etcd.endpoint,
         "--listen", "127.0.0.1:0", "--port-file", str(port_file), *extra],
        capture_output=True, text=True, cwd=str(ROOT), timeout=60,
        env={**env, "PYTHONPATH": str(ROOT)})
    assert not port_file.exists(), "it served"
    return out


def test_cluster_manager_without_a_key_refuses_to_start(
        etcd: EtcdServer, tmp_path: Path) -> None:
    loose = tmp_path / "loose.json"
    generate_key_file(loose)
    loose.chmod(0o644)
    broken = tmp_path / "broken.json"
    broken.write_text("{}")
    broken.chmod(0o600)
    unreadable = tmp_path / "unreadable.json"
    generate_key_file(unreadable)
    unreadable.chmod(0)
    runs = {
        "no flag, no env": run_cm(etcd, tmp=tmp_path),
        "empty env": run_cm(etcd, env_key="", tmp=tmp_path),
        "missing file": run_cm(etcd, "--encryption-key-file", str(tmp_path / "nope.json"),
                               tmp=tmp_path),
        "missing file (env)": run_cm(etcd, env_key=str(tmp_path / "nope.json"), tmp=tmp_path),
        "malformed": run_cm(etcd, "--encryption-key-file", str(broken), tmp=tmp_path),
        "mode 0644": run_cm(etcd, "--encryption-key-file", str(loose), tmp=tmp_path),
    }
    if os.geteuid() != 0:  # root reads a mode-0 file anyway
        runs["unreadable"] = run_cm(etcd, "--encryption-key-file", str(unreadable), tmp=tmp_path)
    for what, out in runs.items():
        assert out.returncode != 0, what
        assert "encryption key" in out.stderr, (what, out.stderr)


def test_generate_key_command(tmp_path: Path) -> None:
    p = tmp_path / "k.json"

    def gen() -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "cluster_manager", "generate-key", "--encryption-key-file",
             str(p)], capture_output=True, text=True, cwd=str(ROOT), timeout=60,
            env={**os.environ, "PYTHONPATH": str(ROOT)})

    out = gen()
    assert out.returncode == 0, out.stderr
    kr = Keyring.load(p)
    assert kr.active_key_id in out.stdout
    assert stat.S_IMODE(p.stat().st_mode) == 0o600
    again = gen()
    assert again.returncode != 0 and Keyring.load(p).key_ids == kr.key_ids
