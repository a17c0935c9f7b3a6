"""Validation matches whole strings: no pattern in the code ends with ``$``.

Python's ``$`` also matches before a final newline, so ``^[a-z]+$`` accepts
``"main\\n"`` (a job id, role, env name or label key with a newline was
accepted and broke the sbatch header). Patterns end with ``\\Z`` or are used
with ``fullmatch``; this test reads every module's regular expressions and
fails on one that ends with ``$``. The services then refuse such values.
"""

from __future__ import annotations

import ast
import pathlib

import pytest

from dlsched.errors import InvalidArgument
from job_manager.domain.model import ClusterSelector, JobSpec, ReplicaGroup
from job_manager.domain.validation import validate_submit

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGES = ("dlsched", "job_manager", "cluster_manager", "gateway", "drivers")
RE_FUNCS = {"compile", "match", "search", "fullmatch", "sub", "split", "findall", "finditer"}


def _patterns() -> list[tuple[str, int, str]]:
    out = []
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            if path.name.endswith("_pb2.py") or "_pb2_" in path.name:
                continue
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                        and isinstance(node.func.value, ast.Name) and node.func.value.id == "re"
                        and node.func.attr in RE_FUNCS and node.args
                        and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
                    out.append((str(path.relative_to(ROOT)), node.lineno, node.args[0].value))
    return out


def test_no_pattern_ends_with_dollar() -> None:
    found = _patterns()
    assert len(found) > 20  # the scan sees the validators
    bad = [f"{p}:{n}: {pat!r}" for p, n, pat in found if pat.endswith("$") and not pat.endswith("\\$")]
    assert not bad, "end these with \\Z (or use fullmatch):\n" + "\n".join(bad)


@pytest.mark.parametrize("mutate, field", [
    (lambda s: setattr(s.replica_groups[0], "role", "main\n"), "role"),
    (lambda s: s.replica_groups[0].env.update({"NAME\n": "v"}), "env"),
    (lambda s: s.labels.update({"team\n": "ml"}), "labels"),
    (lambda s: s.labels.update({"team": "ml\n"}), "labels"),
])
def test_a_trailing_newline_is_refused(mutate, field: str) -> None:  # type: ignore[no-untyped-def]
    spec = JobSpec(run_mode=1, replica_groups=[ReplicaGroup(role="main", replicas=1, command=["true"], env={})],
                   labels={})
    mutate(spec)
    with pytest.raises(InvalidArgument) as ei:
        validate_submit("", spec, "", 100)
    assert any(field in v.field for v in ei.value.violations), ei.value.violations


def test_a_job_id_with_a_trailing_newline_is_refused() -> None:
    spec = JobSpec(run_mode=1, replica_groups=[ReplicaGroup(role="main", replicas=1, command=["true"])])
    with pytest.raises(InvalidArgument) as ei:
        validate_submit("job\n", spec, "", 100)
    assert any("job_id" in v.field for v in ei.value.violations)


@pytest.mark.parametrize("value", ["local\n", "  local\t", "clusters/local ", " clusters/local", "clusters/",
                                   "Local", "clusters/clusters/local", "local/x"])
def test_a_selected_cluster_is_a_whole_name_or_id(value: str) -> None:
    spec = JobSpec(run_mode=1, replica_groups=[ReplicaGroup(role="main", replicas=1, command=["true"])],
                   cluster_selector=ClusterSelector(cluster=value))
    with pytest.raises(InvalidArgument) as ei:
        validate_submit("", spec, "", 100)
    assert [v.field for v in ei.value.violations] == ["spec.cluster_selector.cluster"], ei.value.violations


@pytest.mark.parametrize("value", ["", "local", "clusters/local", "gpu-a100-2"])
def test_a_cluster_name_or_id_is_selected(value: str) -> None:
    validate_submit("", JobSpec(run_mode=1, replica_groups=[ReplicaGroup(role="main", replicas=1, command=["true"])],
                                cluster_selector=ClusterSelector(cluster=value)), "", 100)
