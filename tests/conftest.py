"""Shared fixtures: one real etcd per test session, and a fresh key prefix per test."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest

from tests.harness import EtcdServer


@pytest.fixture(scope="session")
def etcd() -> Iterator[EtcdServer]:
    server = EtcdServer().start()
    yield server
    server.stop()


@pytest.fixture
def etcd_prefix() -> str:
    """A key prefix of its own for each test, so tests sharing etcd never collide."""
    return f"/dlsched-test-{uuid.uuid4().hex[:8]}/"
