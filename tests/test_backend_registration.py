"""A backend is one package plus one registration; every other place is derived from it or checked here.

The registration is the API's ``ClusterType`` value (``job.proto``) with its
row in ClusterManager's ``BACKENDS`` table. For every registered backend this
checks the places that cannot be derived at run time (a package, a manifest, an
extra, a contract peer), so a new backend missing one fails here by name
instead of at a user's first call. ARCHITECTURE.md, "Adding a backend".
"""

from __future__ import annotations

import importlib.util
import pathlib
import re
import tomllib

import pytest
import yaml

from cluster_manager.domain import models
from dlsched import cli
from dlsched.v1 import job_pb2
from tests.driver_contract import DRIVERS, PEERS

ROOT = pathlib.Path(__file__).resolve().parent.parent
BACKENDS = [n.removeprefix("CLUSTER_TYPE_").lower() for n, v in job_pb2.ClusterType.items()
            if v != job_pb2.CLUSTER_TYPE_UNSPECIFIED]


def test_the_backend_list_is_the_enum() -> None:
    assert BACKENDS == ["local", "slurm", "kubernetes", "ray"]  # today's; a new value adds a row below
    assert {t.name.lower() for t in models.BACKENDS} == set(BACKENDS)
    assert set(cli._CLUSTER_TYPES) == set(BACKENDS)  # CLI choices come from the enum


@pytest.mark.parametrize("name", BACKENDS)
def test_a_backend_is_a_package_on_the_kit(name: str) -> None:
    pkg = ROOT / "drivers" / name
    assert (pkg / "__main__.py").is_file() and (pkg / "driver.py").is_file()
    assert importlib.util.find_spec(f"drivers.{name}.driver") is not None
    source = (pkg / "driver.py").read_text()
    assert re.search(r"class \w+\(BackendDriver\[", source), "the driver class builds on the kit"
    for f in pkg.glob("*.py"):
        assert len(f.read_text().splitlines()) <= 600, f"{f.relative_to(ROOT)}: split it by concern"


@pytest.mark.parametrize("name", BACKENDS)
def test_a_backend_is_deployed_packaged_and_contract_tested(name: str) -> None:
    kustomization = yaml.safe_load((ROOT / "deploy/base/kustomization.yaml").read_text())
    assert f"driver-{name}.yaml" in kustomization["resources"]
    manifest = (ROOT / f"deploy/base/driver-{name}.yaml").read_text()
    assert f"drivers.{name}" in manifest
    assert f"drivers.{name}" in (ROOT / "deploy/Dockerfile").read_text()
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert name in pyproject["project"]["optional-dependencies"], "an extra with the backend's SDK"
    layers = [c for c in pyproject["tool"]["importlinter"]["contracts"] if c["type"] == "layers"]
    assert any(f"drivers.{name}" in layer for c in layers for layer in c["layers"]), "in the import contracts"
    assert name in DRIVERS and PEERS[name].name == name, "a peer in tests/driver_contract.py"
