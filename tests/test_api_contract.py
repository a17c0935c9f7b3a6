"""The API's contract with its users: stubs, lint rules and layer boundaries.

- The committed stubs in dlsched/v1 are exactly what scripts/genproto.py makes.
- buf lint (STANDARD + COMMENTS, buf.yaml) passes, so every message, field,
  enum value, service and RPC carries a comment. Without a buf binary the test
  skips, except under CI (CI=true), where it fails.
- The import-linter contracts in pyproject.toml hold.
- Every RPC of the public services has a method in the SDK.
"""

from __future__ import annotations

import os
import pathlib
import re
import shutil
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")


def _tool(name: str) -> str | None:
    local = ROOT / ".ci" / "node" / "node_modules" / ".bin" / name
    if local.exists():
        return str(local)
    venv = pathlib.Path(sys.executable).parent / name
    if venv.exists():
        return str(venv)
    return shutil.which(name)


def test_generated_stubs_are_not_stale(tmp_path: pathlib.Path) -> None:
    subprocess.run([sys.executable, str(ROOT / "scripts" / "genproto.py"), "--out", str(tmp_path)],
                   check=True, cwd=ROOT, capture_output=True)
    generated = ("*_pb2*.py*", "service_config.json")
    fresh = sorted(p.name for g in generated for p in (tmp_path / "dlsched" / "v1").glob(g))
    committed = sorted(p.name for g in generated for p in (ROOT / "dlsched" / "v1").glob(g))
    assert fresh, "genproto made no files"
    assert fresh == committed, "stub files differ: run python scripts/genproto.py"
    stale = [n for n in fresh
             if _without_versions(tmp_path / "dlsched" / "v1" / n) != _without_versions(ROOT / "dlsched" / "v1" / n)]
    assert not stale, f"stale stubs {stale}: run python scripts/genproto.py and commit"


#: What a generator's own version writes into a stub (grpcio-tools' GRPC_GENERATED_VERSION,
#: protoc's "Protobuf Python Version" and runtime check): a newer release of grpcio-tools on the
#: package index changes these and nothing the protos say. The committed stubs keep the older
#: (lower) versions, which every newer runtime accepts.
_GENERATOR_VERSION = re.compile(
    rb"GRPC_GENERATED_VERSION = '[0-9.]+'|# Protobuf Python Version: [0-9.]+"
    rb"|ValidateProtobufRuntimeVersion\([^)]*\)")


def _without_versions(path: pathlib.Path) -> bytes:
    return _GENERATOR_VERSION.sub(b"", path.read_bytes())


def test_buf_lint_passes() -> None:
    buf = _tool("buf")
    if buf is None:
        if IN_CI:
            pytest.fail("no buf binary under CI: scripts/test.sh installs it with npm")
        pytest.skip("no buf binary (npm install --no-save --prefix .ci/node @bufbuild/buf)")
    r = subprocess.run([buf, "lint"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, f"buf lint:\n{r.stdout}{r.stderr}"


def test_buf_lint_requires_comments() -> None:
    """buf.yaml keeps COMMENTS on, so an uncommented element fails the lint."""
    text = (ROOT / "buf.yaml").read_text()
    assert re.search(r"^\s*-\s*COMMENTS\s*$", text, re.M), "buf.yaml must use COMMENTS"
    assert re.search(r"^\s*-\s*STANDARD\s*$", text, re.M), "buf.yaml must use STANDARD"


def test_every_proto_element_has_a_leading_comment() -> None:
    """A buf-independent check of the same rule, so it holds even where buf is absent."""
    missing: list[str] = []
    decl = re.compile(
        r"^\s*(?:(?:message|enum|service|oneof)\s+\w+\s*\{|rpc\s+\w+\s*\(|"
        r"(?:repeated\s+|optional\s+)?(?:map<[^>]+>|[\w.]+)\s+\w+\s*=\s*\d+|[A-Z][A-Z0-9_]*\s*=\s*\d+)")
    for path in sorted((ROOT / "protos").rglob("*.proto")):
        lines = path.read_text().splitlines()
        for i, line in enumerate(lines):
            if line.strip().startswith(("option ", "reserved ", "//", "import ", "syntax ",
                                        "package ")):
                continue
            if decl.match(line):
                prev = lines[i - 1].strip() if i else ""
                if not prev.startswith("//"):
                    missing.append(f"{path.relative_to(ROOT)}:{i + 1}: {line.strip()}")
    assert not missing, "elements without a leading comment:\n" + "\n".join(missing)


def test_import_contracts_hold() -> None:
    lint = _tool("lint-imports")
    assert lint is not None, "lint-imports not installed (pip install -e '.[dev]')"
    r = subprocess.run([lint], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, f"lint-imports:\n{r.stdout}{r.stderr}"


def test_sdk_mirrors_every_public_rpc() -> None:
    from dlsched import client
    from dlsched.v1 import cluster_manager_service_pb2, job_manager_service_pb2

    def snake(name: str) -> str:
        return re.sub(r"(?<!^)(?=[A-Z])", "_", name).lower()

    for module, cls in ((job_manager_service_pb2, client.JobManagerClient),
                        (cluster_manager_service_pb2, client.ClusterManagerClient)):
        for service in module.DESCRIPTOR.services_by_name.values():
            for method in service.methods:
                assert hasattr(cls, snake(method.name)), f"{cls.__name__} lacks {snake(method.name)}"
