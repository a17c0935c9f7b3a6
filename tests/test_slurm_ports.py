"""Per-job rendezvous ports on Slurm: the batch script picks ``MASTER_PORT`` and PS-Worker's task
ports at run time (``shell.PORT_PICKER``), so jobs sharing a node never share a port.

The picker runs for real in bash against real listening sockets; two Master-Worker jobs run at once
on the one node of a real Slurm (``OverSubscribe=FORCE``), each master listening on its
``MASTER_PORT`` while the other's listens, each worker talking to its own job's master.
"""

from __future__ import annotations

import asyncio
import json
import os
import pathlib
import socket
import subprocess
import sys
from collections.abc import Iterator

import pytest

from dlsched.v1 import job_pb2
from drivers.common.base import LogStream
from drivers.slurm import render, shell

PY = sys.executable


def picker(job_id: int, nodes: list[str], calls: list[int]) -> list[int]:
    """Run the script's port picker in bash: ``dlsched_port n`` for each n of ``calls``."""
    script = "\n".join([
        "set -u",
        "DLSCHED_NODES=(" + " ".join(nodes) + ")",
        shell.PORT_PICKER.format(lo=render.PORT_LO, span=render.PORT_SPAN,
                                 hi=render.PORT_LO + render.PORT_SPAN - 1, stride=render.PORT_STRIDE),
        *[f"dlsched_port {n} || exit 1" for n in calls],
        'echo "${DLSCHED_PORTS[*]}"',
    ])
    env = {**os.environ, "SLURM_JOB_ID": str(job_id)}
    out = subprocess.run(["bash", "-c", script], env=env, capture_output=True, text=True, timeout=120, check=True)
    return [int(p) for p in out.stdout.split()]


def base(job_id: int) -> int:
    return render.PORT_LO + (job_id * render.PORT_STRIDE) % render.PORT_SPAN


@pytest.fixture
def busy_block() -> Iterator[tuple[int, socket.socket]]:
    """A Slurm job id whose block's first port this test holds with a listener (any free block)."""
    for job_id in range(4242, 4242 + 200):
        s = socket.socket()
        try:
            s.bind(("0.0.0.0", base(job_id)))
        except OSError:
            s.close()
            continue
        s.listen()
        try:
            yield job_id, s
        finally:
            s.close()
        return
    pytest.fail("no free port block")


def test_each_port_is_one_nothing_listens_on_and_none_is_given_twice(busy_block):
    job_id, _ = busy_block
    b = base(job_id)
    ports = picker(job_id, ["localhost"], [0, 0, 0])
    assert b not in ports
    assert len(set(ports)) == 3
    assert all(b < p < b + render.PORT_STRIDE + 3 for p in ports), ports


def test_a_port_on_another_node_is_probed_there(busy_block):
    """Node 1 is 127.0.0.1 here, named: the picker connects to it by that name."""
    job_id, _ = busy_block
    ports = picker(job_id, ["nowhere.invalid", "127.0.0.1"], [1])
    assert ports == [base(job_id) + 1]


def test_a_listener_too_busy_to_answer_counts_as_taken(busy_block):
    """A listener whose accept queue is full drops the probe's SYN: the probe times out, and the
    port is still skipped."""
    job_id, s = busy_block
    s.listen(0)
    clients = []
    for _ in range(4):  # fill the queue: nothing accepts them
        c = socket.socket()
        c.setblocking(False)
        c.connect_ex(("127.0.0.1", base(job_id)))
        clients.append(c)
    try:
        assert picker(job_id, ["localhost"], [0]) == [base(job_id) + 1]
    finally:
        for c in clients:
            c.close()


def test_concurrent_jobs_start_their_blocks_apart():
    assert len({base(j) for j in range(1000, 1000 + render.PORT_SPAN // render.PORT_STRIDE)}) == \
        render.PORT_SPAN // render.PORT_STRIDE
    assert all(render.PORT_LO <= base(j) <= render.PORT_LO + render.PORT_SPAN - render.PORT_STRIDE
               for j in range(0, 100000, 37))


# --------------------------------------------------------------------------- on a real Slurm

#: Every process writes its environment. A listener (the master: MASTER_PORT; a ps: its own TF_CONFIG
#: port) binds its port (EADDRINUSE if another job's process holds it), waits until both jobs' listeners
#: listen, then answers one peer with its job id; the worker connects to MASTER_ADDR:MASTER_PORT or to
#: TF_CONFIG's ps 0 and checks that it reached its own job's listener.
RENDEZVOUS = r"""
import json, os, pathlib, socket, sys, time
out = pathlib.Path(sys.argv[1])
role, jid = os.environ["DLSCHED_ROLE"], os.environ["DLSCHED_JOB_ID"]
(out / f"{jid}.{role}.env").write_text(json.dumps(dict(os.environ)))
if "TF_CONFIG" in os.environ:
    tf = json.loads(os.environ["TF_CONFIG"])
    host, _, port = tf["cluster"]["ps"][0].rpartition(":")
else:
    host, port = os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"]
deadline = time.time() + 90
if role in ("master", "ps"):
    s = socket.create_server(("", int(port)))
    (out / f"{jid}.listening").touch()
    while len(list(out.glob("*.listening"))) < 2:
        assert time.time() < deadline, "the other job's listener never listened"
        time.sleep(0.1)
    c, _ = s.accept()
    c.settimeout(60)
    peer = c.recv(100).decode()
    c.sendall(jid.encode())
    print(role, "heard", peer, flush=True)
    sys.exit(0 if peer == jid else 3)
while True:
    try:
        c = socket.create_connection((host, int(port)), timeout=5)
        break
    except OSError:
        assert time.time() < deadline, "no listener"
        time.sleep(0.2)
c.settimeout(90)
c.sendall(jid.encode())
peer = c.recv(100).decode()
print("worker reached", peer, flush=True)
sys.exit(0 if peer == jid else 3)
"""


async def run_two_at_once(stub, cluster, mode: int, roles: tuple[str, ...]) -> dict[str, dict[str, dict[str, str]]]:
    """Two jobs of ``mode`` launched at once on the one node; both must succeed. Their processes'
    environments, by job id and role."""
    from tests.slurm_peer import launch, new_id, wait_state

    out = pathlib.Path(cluster.path("home", f"ports-{os.getpid()}-{mode}"))
    await asyncio.to_thread(out.mkdir, 0o777, parents=True)
    jids = [new_id("port"), new_id("port")]
    spec = job_pb2.JobSpec(run_mode=mode, replica_groups=[  # type: ignore[arg-type]
        job_pb2.ReplicaGroup(role=r, replicas=1, command=[PY, "-u", "-c", RENDEZVOUS], args=[str(out)])
        for r in roles])
    for jid in jids:
        await launch(stub, jid, spec)
    obs = await asyncio.gather(*(wait_state(stub, jid, within=240) for jid in jids))
    assert [o.state for o in obs] == [job_pb2.JOB_STATE_SUCCEEDED] * 2, (obs, _evidence(cluster, jids, out))
    envs = {jid: {r: json.loads((out / f"{jid}.{r}.env").read_text()) for r in roles} for jid in jids}
    for jid, by_role in envs.items():
        assert {e["DLSCHED_JOB_ID"] for e in by_role.values()} == {jid}
    return envs


def in_range(port: str) -> bool:
    return render.PORT_LO <= int(port) < render.PORT_LO + render.PORT_SPAN


@pytest.mark.timeout(400)
async def test_two_master_worker_jobs_on_one_node_both_succeed_each_on_its_own_port(stub, cluster):
    envs = await run_two_at_once(stub, cluster, job_pb2.RUN_MODE_MASTER_WORKER, ("master", "worker"))
    ports = []
    for by_role in envs.values():
        assert by_role["master"]["MASTER_PORT"] == by_role["worker"]["MASTER_PORT"]
        assert in_range(by_role["master"]["MASTER_PORT"])
        ports.append(by_role["master"]["MASTER_PORT"])
    assert ports[0] != ports[1]


@pytest.mark.timeout(400)
async def test_two_ps_worker_jobs_on_one_node_both_succeed_each_with_its_own_ports(stub, cluster):
    envs = await run_two_at_once(stub, cluster, job_pb2.RUN_MODE_PS_WORKER, ("ps", "worker"))
    ports = []
    for by_role in envs.values():
        tf = {r: json.loads(e["TF_CONFIG"]) for r, e in by_role.items()}
        assert tf["ps"]["cluster"] == tf["worker"]["cluster"]
        addrs = [a.rpartition(":")[2] for tasks in tf["ps"]["cluster"].values() for a in tasks]
        assert len(set(addrs)) == 2 and all(in_range(p) for p in addrs)
        ports.append(set(addrs))
    assert not ports[0] & ports[1]


def _evidence(cluster, jids: list[str], out: pathlib.Path) -> dict[str, str]:
    """What a failure report shows: the rendezvous files and each batch script's stderr."""
    files = {f.name: f.read_text()[:300] for f in sorted(out.iterdir())}
    for jid in jids:
        p = pathlib.Path(render.batch_output(cluster.options(), jid, 1, LogStream.STDERR))
        files[p.name] = p.read_text() if p.exists() else "(none)"
    return files


def _slurm_fixtures() -> tuple[object, object, object]:
    """The real cluster where it can run (``slurm_peer``); elsewhere fixtures that skip, so the bash
    tests above still run."""
    try:
        from tests import slurm_peer
    except pytest.skip.Exception as e:
        why = str(e)

        @pytest.fixture
        def unavailable() -> None:
            pytest.skip(why)

        return unavailable, unavailable, unavailable
    return slurm_peer.driver_fixtures()


cluster, driver, stub = _slurm_fixtures()
