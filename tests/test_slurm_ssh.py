"""The Slurm driver's SSH client against a real sshd (``MaxSessions 10``): a command that times
out is killed on the login node and holds its slot until its session has ended; hung commands
beyond the session limit never break the shared connection; a session sshd refuses is asked
for again without touching the commands in flight."""

from __future__ import annotations

import asyncio
import os
import time
import uuid
from collections.abc import Iterator

import pytest

from tests import slurm_cluster

asyncssh = pytest.importorskip("asyncssh")
if why := slurm_cluster.available():
    pytest.skip(why, allow_module_level=True)

from drivers.slurm.ssh import Congested, SshClient  # noqa: E402


@pytest.fixture(scope="module")
def cluster() -> Iterator[slurm_cluster.SlurmCluster]:
    c = slurm_cluster.SlurmCluster().start()
    yield c
    c.stop()


def client(c: slurm_cluster.SlurmCluster, channels: int) -> SshClient:
    return SshClient(c.address, c.user, c.user_key, [c.host_key_pub], max_channels=channels)


def processes(tag: str) -> list[int]:
    """Pids of the processes whose command line holds ``tag``."""
    out = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/cmdline", "rb") as f:
                    if tag.encode() in f.read().replace(b"\0", b" ") and int(name) != os.getpid():
                        out.append(int(name))
            except OSError:
                continue
    return out


async def until(ok, within: float = 60.0) -> None:
    deadline = time.monotonic() + within
    while not ok():
        assert time.monotonic() < deadline
        await asyncio.sleep(0.1)


async def test_a_timed_out_command_is_killed_and_holds_its_slot_until_its_session_ends(cluster):
    ssh = client(cluster, 1)
    tag = f"hung-{uuid.uuid4().hex[:8]}"
    try:
        # a shell that runs a child (not exec'd): the whole process group must go
        with pytest.raises(Congested):
            await ssh.run(f"bash -c 'sleep 300; : {tag}'; echo {tag}", time_limit=1.0)
        assert ssh.last_congestion is not None
        await until(lambda: not processes(tag))  # killed on the login node, child included
        await until(ssh.channel_free)  # and the slot freed once sshd ended the session
        r = await ssh.run("echo ok; echo err >&2", time_limit=30)
        assert (r.exit_status, r.stdout, r.stderr) == (0, "ok\n", "err\n")  # the pgid line is not shown
    finally:
        await ssh.close()


async def test_a_slot_stays_taken_while_the_timed_out_command_still_runs(cluster):
    """The reaper frees a slot only when sshd has ended the session: a command that survives
    its kill (its process group was left) keeps the slot, so the bound never overcounts."""
    ssh = client(cluster, 1)
    tag = f"escaped-{uuid.uuid4().hex[:8]}"
    try:
        # setsid: a new process group the kill does not reach, still holding the session's stdout
        with pytest.raises(Congested):
            await ssh.run(f"setsid bash -c 'sleep 15; : {tag}'", time_limit=1.0)
        await asyncio.sleep(2)
        assert processes(tag) and not ssh.channel_free()  # 15 s: still running on a busy host
        await until(lambda: not processes(tag), 90)
        await until(ssh.channel_free, 60)
    finally:
        await ssh.close()


async def test_hung_commands_beyond_max_sessions_never_break_the_connection(cluster):
    """30 hung commands (each timing out) and 30 quick ones at once on a bound of 8: every hung
    one is Congested, every quick one answers, the connection is the first one throughout,
    and no hung process is left."""
    ssh = client(cluster, 8)
    tag = f"flood-{uuid.uuid4().hex[:8]}"
    try:
        await ssh.run("true", time_limit=30)
        conn = ssh._conn

        async def hung(i: int) -> BaseException | None:
            try:
                await ssh.run(f"sleep 300; : {tag}-{i}", time_limit=1.0)
            except Congested as e:
                return e
            return None

        async def quick(i: int) -> str:
            deadline = time.monotonic() + 120
            while True:  # a quick command may find every slot taken by the hung ones: try again
                try:
                    return (await ssh.run(f"echo {i}", time_limit=5.0)).stdout.strip()
                except Congested:
                    assert time.monotonic() < deadline
                    await asyncio.sleep(0.2)

        results = await asyncio.gather(*(hung(i) for i in range(30)), *(quick(i) for i in range(30)))
        assert all(isinstance(r, Congested) for r in results[:30])
        assert results[30:] == [str(i) for i in range(30)]
        assert ssh._conn is conn and not conn.is_closed()
        await until(lambda: not processes(tag))
        await until(lambda: ssh._sem._value == 8)  # every slot back
    finally:
        await ssh.close()


async def test_a_session_sshd_refuses_is_retried_and_in_flight_commands_keep_running(cluster):
    """Sessions opened outside the bound (as a leaked one would be) leave sshd fewer than the
    bound: commands that get a refusal wait and retry; the commands already running finish."""
    ssh = client(cluster, 9)
    try:
        await ssh.run("true", time_limit=30)
        conn = ssh._conn
        assert conn is not None
        # 6 sessions outside the bound for 10 s (open still when the 9 start, on a busy host too):
        # 9 + 6 > MaxSessions 10
        outside = [await conn.create_process("sleep 10; echo done", encoding=None) for _ in range(6)]
        results = await asyncio.gather(*(ssh.run(f"sleep 0.5; echo {i}", time_limit=60) for i in range(9)))
        assert [r.stdout.strip() for r in results] == [str(i) for i in range(9)]
        assert ssh.sessions_refused > 0  # sshd did refuse some: they waited and ran
        for p in outside:
            r = await p.wait(timeout=30)
            assert r.exit_status == 0 and r.stdout == b"done\n"  # never torn down
        assert ssh._conn is conn and not conn.is_closed()
    finally:
        await ssh.close()
