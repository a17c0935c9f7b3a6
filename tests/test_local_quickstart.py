"""The README's quick start, as written: ``dlsched up`` from a shell whose PATH lacks the venv (its
``python3`` is another interpreter, without torch or mpi4py), then ``dlsched submit <example>
--follow`` for every example, unchanged. Local jobs get the directory of dlsched's own Python first
on PATH, so ``python3`` in the job files (and in every MPI rank) is the venv's."""

from __future__ import annotations

import os
import pathlib
import sys
from collections.abc import Iterator

import pytest

from tests.test_cli import Up
from tests.test_run_modes import needs, needs_mpirun

#: A ``python3`` / ``python`` the shell finds first: the wrong interpreter, loudly.
WRONG_PYTHON = "#!/bin/sh\necho \"not dlsched's python: $0\" >&2\nexit 99\n"

EXAMPLES = [
    pytest.param("hello.yaml", "hello: done", id="single_process"),
    pytest.param("multi_process.yaml", "rank 2: done", id="multi_process"),
    pytest.param("ps_worker/ps_worker.yaml", "steps, loss", id="ps_worker"),
    pytest.param("ddp/ddp.yaml", "all-reduce sum", id="master_worker", marks=needs("torch")),
    pytest.param("mpi/mpi.yaml", "rank 3/4: allreduce sum 10 ok", id="mpi",
                 marks=[needs("mpi4py"), needs_mpirun]),
]


@pytest.fixture(scope="module")
def up(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Up]:
    root = tmp_path_factory.mktemp("quickstart")
    shell_bin = root / "shell-bin"
    shell_bin.mkdir()
    for name in ("python3", "python"):
        (shell_bin / name).write_text(WRONG_PYTHON)
        (shell_bin / name).chmod(0o755)
    venv_bin = os.path.realpath(os.path.dirname(sys.executable))
    u = Up(root)
    path = [p for p in u.env.get("PATH", os.defpath).split(os.pathsep)
            if p and os.path.realpath(p) != venv_bin]
    u.env["PATH"] = os.pathsep.join([str(shell_bin), *path])
    u.env.pop("VIRTUAL_ENV", None)
    try:
        u.start()
        yield u
        u.stop()
    finally:
        u.kill()


@pytest.mark.parametrize(("example", "marker"), EXAMPLES)
def test_every_example_runs_as_the_readme_shows(up: Up, example: str, marker: str) -> None:
    path = pathlib.Path("examples") / example
    r = up.cli("submit", str(path), "--follow", timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert marker in r.stdout, r.stdout[-3000:]
    assert "not dlsched's python" not in r.stdout + r.stderr
