# ruff: noqa: ASYNC109  -- tests bound their waits
"""Services reach etcd over TLS with a client certificate and log in with a
user and a password file (``dlsched.kit.etcd``): a real etcd with
``--client-cert-auth`` and authentication on, ClusterManager, the local
driver and JobManager as processes, a job through the SDK; clients without
the CA, the certificate or the right password are refused at once; an
expired etcd token is renewed for unary calls and watches alike."""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
import uuid
from collections.abc import Iterator

import aetcd.exceptions
import pytest

from dlsched.client import JobManagerClient
from dlsched.errors import InvalidArgument, StoreUnavailable, Unauthenticated
from dlsched.kit import etcd as etcd_kit
from dlsched.kit.etcd import EtcdOptions, add_etcd_flags, etcd_options_from_args
from dlsched.v1 import job_pb2
from tests.harness import EtcdServer, ServiceProcess, Stack

TOKEN_TTL = 2  # etcd's --auth-token-ttl: the services' tokens expire while they work


@pytest.fixture(scope="module")
def secure_etcd() -> Iterator[EtcdServer]:
    server = EtcdServer(tls=True, auth=True, auth_token_ttl=TOKEN_TTL).start()
    yield server
    server.stop()


def options(e: EtcdServer, **change: str | None) -> EtcdOptions:
    base = {"endpoint": e.endpoint, "ca_file": e.ca_file, "cert_file": e.client_cert_file,
            "key_file": e.client_key_file, "user": e.user, "password_file": e.password_file}
    return EtcdOptions(**{**base, **change})  # type: ignore[arg-type]


def password(e: EtcdServer) -> str:
    assert e.password_file
    with open(e.password_file) as f:
        return f.read().strip()


async def refused(opts: EtcdOptions) -> Exception:
    """The error ``connect`` fails with, well before any hang would show."""
    t0 = time.monotonic()
    with pytest.raises(Exception) as info:  # noqa: PT011 - the type is checked by the caller
        await asyncio.wait_for(etcd_kit.connect(opts, rpc_timeout=3), 15)
    assert time.monotonic() - t0 < 10
    return info.value


# ---------------------------------------------------------------- flags


def test_flags_default_from_env(monkeypatch: pytest.MonkeyPatch, tmp_path: object) -> None:
    monkeypatch.setenv("DLSCHED_ETCD_CA_FILE", __file__)
    monkeypatch.setenv("DLSCHED_ETCD_USER", "dlsched")
    monkeypatch.setenv("DLSCHED_ETCD_PASSWORD_FILE", __file__)
    p = argparse.ArgumentParser()
    add_etcd_flags(p)
    opts = etcd_options_from_args(p.parse_args(["--etcd", "etcd.example:2379"]), p)
    assert opts == EtcdOptions("etcd.example:2379", ca_file=__file__, user="dlsched",
                               password_file=__file__)
    assert opts.tls
    a = p.parse_args(["--etcd", "e:2379", "--etcd-user", "other", "--etcd-ca-file", ""])
    assert etcd_options_from_args(a, p) == EtcdOptions("e:2379", user="other", password_file=__file__)
    assert not etcd_options_from_args(a, p).tls
    assert EtcdOptions("https://e:2379").tls


def test_bad_flag_combinations_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("CA_FILE", "CERT_FILE", "KEY_FILE", "USER", "PASSWORD_FILE"):
        monkeypatch.delenv(f"DLSCHED_ETCD_{name}", raising=False)
    p = argparse.ArgumentParser()
    add_etcd_flags(p)
    for argv in (["--etcd-cert-file", __file__],                     # no key
                 ["--etcd-user", "dlsched"],                          # no password file
                 ["--etcd-password-file", __file__],                  # no user
                 ["--etcd-user", "u", "--etcd-password-file", "/nonexistent/pw"],
                 ["--etcd-ca-file", __file__, "--etcd", "http://e:2379"]):
        a = p.parse_args(["--etcd", "e:2379", *argv])
        with pytest.raises(ValueError):
            etcd_options_from_args(a)
    with pytest.raises(SystemExit):
        p.parse_args([])  # --etcd is required


async def test_connect_refuses_bad_options() -> None:
    with pytest.raises(InvalidArgument):
        await etcd_kit.connect(EtcdOptions("e:2379", cert_file=__file__))
    with pytest.raises(InvalidArgument):
        await etcd_kit.connect("no-port")


# ---------------------------------------------------------------- the stack


async def test_stack_runs_a_job_over_secured_etcd(secure_etcd: EtcdServer) -> None:
    """JobManager and ClusterManager start with the --etcd-* flags, and a job
    submitted through the SDK runs to SUCCEEDED on the local driver over an etcd
    whose tokens live 2 s. (Whether a service's token expires depends on how often
    it calls: JobManager's ownership lease keeps its token in use, so its renewal
    is shown by test_expired_token_is_renewed, not here.)"""
    args = secure_etcd.service_args()
    assert "--etcd-password-file" in args and password(secure_etcd) not in " ".join(args)
    prefix = f"/dlsched-etcdsec-{uuid.uuid4().hex[:8]}/"
    st = Stack(secure_etcd, prefix, jm_args=["--stop-grace-seconds", "1"])
    with st.running():
        cluster = await st.register_local()
        assert st.jm is not None
        async with JobManagerClient(st.jm.address) as jm:
            await asyncio.sleep(TOKEN_TTL + 1)  # every token the services hold is stale now
            spec = job_pb2.JobSpec(run_mode=job_pb2.RUN_MODE_SINGLE_PROCESS, replica_groups=[
                job_pb2.ReplicaGroup(role="main", replicas=1, command=[
                    sys.executable, "-c", f"import time; time.sleep({TOKEN_TTL + 1}); print('ok')"])])
            job = (await jm.submit_job(spec)).job
            done = await jm.wait_for_job(job.name, timeout=90)
            assert done.state == job_pb2.JOB_STATE_SUCCEEDED, done
            assert done.cluster == cluster and done.exit_code == 0
        # The job really lives in the secured etcd.
        client = await etcd_kit.connect(options(secure_etcd))
        try:
            stored = await client.get(f"{prefix}{done.name}".encode())
        finally:
            await client.close()
        assert stored is not None
    assert st.jm is not None
    for proc in (st.jm, st.cm):
        log = proc.log()
        assert password(secure_etcd) not in log
        serving = log.split("shutting down")[0]
        assert "Traceback" not in serving and " ERROR " not in serving, serving[-5000:]


# ---------------------------------------------------------------- refusals


async def test_client_without_the_ca_is_refused(secure_etcd: EtcdServer) -> None:
    err = await refused(options(secure_etcd, ca_file=None))
    assert isinstance(err, StoreUnavailable) and "CERTIFICATE_VERIFY_FAILED" in err.message, err


async def test_client_without_a_certificate_is_refused(secure_etcd: EtcdServer) -> None:
    err = await refused(options(secure_etcd, cert_file=None, key_file=None))
    assert isinstance(err, StoreUnavailable) and "handshake" in err.message.lower(), err


async def test_plaintext_client_is_refused(secure_etcd: EtcdServer) -> None:
    plain = secure_etcd.endpoint.removeprefix("https://")
    err = await refused(options(secure_etcd, endpoint=plain, ca_file=None, cert_file=None,
                                key_file=None))
    assert isinstance(err, StoreUnavailable), err


async def test_wrong_password_is_refused(secure_etcd: EtcdServer, tmp_path: object) -> None:
    import pathlib

    wrong = pathlib.Path(str(tmp_path)) / "wrong"
    wrong.write_text("not-the-password\n")
    err = await refused(options(secure_etcd, password_file=str(wrong)))
    assert isinstance(err, Unauthenticated) and "'dlsched'" in err.message, err
    assert "not-the-password" not in err.message


async def test_certificate_alone_may_not_read(secure_etcd: EtcdServer) -> None:
    """The client certificate (CN etcd-client, no etcd user) gets through TLS
    but, without logging in, may read nothing."""
    client = await etcd_kit.connect(options(secure_etcd, user=None, password_file=None))
    try:
        with pytest.raises(aetcd.exceptions.ClientError, match="permission denied"):
            await client.get(b"/dlsched/anything")
    finally:
        await client.close()


def test_service_with_wrong_password_exits_with_the_reason(secure_etcd: EtcdServer,
                                                           tmp_path: object) -> None:
    import pathlib

    wrong = pathlib.Path(str(tmp_path)) / "wrong"
    wrong.write_text("not-the-password\n")
    args = [*options_args(secure_etcd, password_file=str(wrong)), "--prefix", "/dlsched-refused/"]
    svc = ServiceProcess("cluster_manager", args, name="cm-wrong-password")
    with pytest.raises(RuntimeError, match="exited") as info:
        svc.start(timeout=30)
    svc.stop()
    assert "refused the login of user 'dlsched'" in str(info.value)
    assert "not-the-password" not in str(info.value)


def options_args(e: EtcdServer, **change: str) -> list[str]:
    o = options(e, **change)
    return ["--etcd", o.endpoint, "--etcd-ca-file", str(o.ca_file), "--etcd-cert-file", str(o.cert_file),
            "--etcd-key-file", str(o.key_file), "--etcd-user", str(o.user),
            "--etcd-password-file", str(o.password_file)]


# ---------------------------------------------------------------- token expiry


async def test_expired_token_is_renewed(secure_etcd: EtcdServer) -> None:
    """After the token expires, a read logs in again and succeeds, and a watch
    created on the stream opened with the old token still sees events (the
    stream is reopened; watches on it end with an error and resume)."""
    key = f"/dlsched-expiry-{uuid.uuid4().hex[:8]}/".encode()
    client = await etcd_kit.connect(options(secure_etcd))
    try:
        await client.put(key + b"a", b"1")
        old = await client.watch_prefix(key)
        await asyncio.sleep(TOKEN_TTL + 1.5)
        got = await client.get(key + b"a")
        assert got is not None and got.value == b"1"
        await asyncio.sleep(TOKEN_TTL + 1.5)  # the renewed token has expired too
        new = await client.watch_prefix(key)
        await client.put(key + b"b", b"2")
        ev = await asyncio.wait_for(new.__aiter__().__anext__(), 10)
        assert bytes(ev.kv.key) == key + b"b"
        with pytest.raises(aetcd.exceptions.ConnectionFailedError):
            async with asyncio.timeout(60):
                async for _ in old:
                    pass
        await new.cancel()
    finally:
        await client.close()
