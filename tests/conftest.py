"""Shared fixtures: one real etcd per test session, and a fresh key prefix per test."""

from __future__ import annotations

import os
import tempfile
import uuid
from collections.abc import Iterator

import pytest

from dlsched.kit.envelope import generate_key_file
from tests import security
from tests.harness import EtcdServer

# TLS certificates and tokens for every service and client the tests start
# (tests/security.py): the whole suite runs with TLS and authentication on.
security.install()

# encryption key for every ClusterManager the tests start: the children inherit
# DLSCHED_ENCRYPTION_KEY_FILE (ClusterManager refuses to start without a key).
if not os.environ.get("DLSCHED_ENCRYPTION_KEY_FILE"):
    _KEY_FILE = os.path.join(tempfile.mkdtemp(prefix="dlsched-test-keys-"), "encryption-key.json")
    generate_key_file(_KEY_FILE)
    os.environ["DLSCHED_ENCRYPTION_KEY_FILE"] = _KEY_FILE


@pytest.fixture(scope="session")
def etcd() -> Iterator[EtcdServer]:
    server = EtcdServer().start()
    yield server
    server.stop()


@pytest.fixture
def etcd_prefix() -> str:
    """A key prefix of its own for each test, so tests sharing etcd never collide."""
    return f"/dlsched-test-{uuid.uuid4().hex[:8]}/"


# Under CI (CI=true) a skipped test is a failed test: CI installs every
# component the suite needs (etcd, Open MPI, torch, Slurm + munge + sshd, a Ray
# head, kmock), so a skip there means an install step went missing. Outside
# CI, missing optional components still skip with their reason.
_IN_CI = os.environ.get("CI", "").lower() == "true"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]):  # type: ignore[no-untyped-def]
    outcome = yield
    rep = outcome.get_result()
    if rep.failed:
        # The logs of the processes the test ran against (a Ray head, a service), so a
        # failure on a CI machine says why.
        for name, value in getattr(item, "funcargs", {}).items():
            logs = getattr(value, "failure_logs", None)
            if callable(logs):
                rep.sections.append((f"logs of fixture {name!r}", logs()[-20000:]))
    if _IN_CI and rep.skipped and not hasattr(rep, "wasxfail"):
        rep.outcome = "failed"
        rep.longrepr = f"skipped under CI, where nothing may be skipped: {rep.longrepr}"


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector: pytest.Collector):  # type: ignore[no-untyped-def]
    outcome = yield
    rep = outcome.get_result()
    if _IN_CI and rep.skipped:
        rep.outcome = "failed"
        rep.longrepr = f"module skipped under CI, where nothing may be skipped: {rep.longrepr}"
