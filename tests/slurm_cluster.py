"""A real one-node Slurm cluster behind a real sshd, all in a temp dir.

``SlurmCluster().start()`` runs munged (its own key and socket), slurmctld
and slurmd (config in the temp dir; free ports; ``SLURM_CONF`` and the munge
socket pointed there) and an sshd on 127.0.0.1 on a free port with a
generated host key and user key. The SSH user is the one running the tests
(root in CI); the driver finds the cluster's config through the cluster
option ``SLURM_CONF`` (``options()``), exported before every command. The
sshd sets ``SHLVL=1`` so bash does not source the user's ``~/.bashrc`` for
each command (it does for commands run by sshd): a developer's bashrc (pyenv
init, conda) costs hundreds of milliseconds a command, which is the machine,
not the driver, and would swamp what the tests and bench/bench_slurm.py time.

Needs Debian's ``slurmctld slurmd slurm-client munge openssh-server``
(``scripts/install-slurm.sh``) and root (slurmd runs jobs as their user);
``available()`` says whether this machine can run it, so tests skip cleanly.
"""

from __future__ import annotations

import contextlib
import getpass
import os
import shlex
import shutil
import signal
import socket
import subprocess
import tempfile
import time

from tests.harness import free_port

BINARIES = ("munged", "slurmctld", "slurmd", "sbatch", "squeue", "scontrol", "sinfo", "/usr/sbin/sshd",
            "ssh-keygen")


def available() -> str:
    """Empty when a cluster can start here, else why not."""
    if os.geteuid() != 0:
        return "the Slurm test cluster needs root (slurmd runs jobs as their user)"
    missing = [b for b in BINARIES if shutil.which(b) is None]
    if missing:
        return f"missing {', '.join(missing)} (bash scripts/install-slurm.sh)"
    return ""


class SlurmCluster:
    def __init__(self, cpus: int = 2) -> None:
        """``cpus``: the node's CPUs in slurm.conf; more than the machine has, slurmd takes the
        configured count (``SlurmdParameters=config_overrides``) so a job may run more tasks."""
        self.cpus = cpus
        self.dir = tempfile.mkdtemp(prefix="dlsched-slurm-")
        os.chmod(self.dir, 0o755)
        self.node = socket.gethostname().split(".")[0]
        self.user = getpass.getuser()
        self.ctld_port = free_port()
        self.slurmd_port = free_port()
        self.ssh_port = free_port()
        self.conf = os.path.join(self.dir, "slurm.conf")
        self.munge_socket = os.path.join(self.dir, "munge", "munge.socket")
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.host_key_pub = ""
        self.user_key = ""
        self.env = {**os.environ, "SLURM_CONF": self.conf}

    # ------------------------------------------------------------------ paths

    def path(self, *parts: str) -> str:
        return os.path.join(self.dir, *parts)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.ssh_port}"

    @property
    def home(self) -> str:
        return self.path("home")

    # ------------------------------------------------------------------ start / stop

    def start(self) -> SlurmCluster:
        try:
            self._munge()
            self._slurm_conf()
            self.start_slurmctld()
            self._start("slurmd", ["slurmd", "-D", "-N", self.node, "-f", self.conf])
            self._wait_node_idle()
            self._sshd()
        except BaseException:
            self.stop()
            raise
        return self

    def _log(self, name: str) -> str:
        try:
            with open(self.path(f"{name}.log"), errors="replace") as f:
                return f.read()[-4000:]
        except OSError:
            return ""

    def _start(self, name: str, argv: list[str]) -> None:
        with open(self.path(f"{name}.log"), "ab") as log:
            self.procs[name] = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=self.env,
                                                start_new_session=True, cwd=self.dir)

    def _munge(self) -> None:
        mdir = self.path("munge")
        os.makedirs(mdir, mode=0o700)
        key = os.path.join(mdir, "munge.key")
        with open(key, "wb") as f:
            f.write(os.urandom(1024))
        os.chmod(key, 0o600)
        self._start("munged", ["munged", "-F", "-f", f"--socket={self.munge_socket}", f"--key-file={key}",
                               f"--pid-file={mdir}/munged.pid", f"--log-file={mdir}/munged.log",
                               f"--seed-file={mdir}/munged.seed"])
        self._wait(lambda: os.path.exists(self.munge_socket), "munged", 15)

    def _slurm_conf(self) -> None:
        for d in ("state", "spool", "home", "ssh"):
            os.makedirs(self.path(d), exist_ok=True)
        os.chmod(self.path("home"), 0o755)
        conf = f"""ClusterName=dlsched-test
SlurmctldHost={self.node}(127.0.0.1)
SlurmctldPort={self.ctld_port}
SlurmdPort={self.slurmd_port}
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={self.munge_socket}
SlurmUser=root
SlurmdUser=root
StateSaveLocation={self.path("state")}
SlurmdSpoolDir={self.path("spool")}/%n
SlurmctldPidFile={self.path("slurmctld.pid")}
SlurmdPidFile={self.path("slurmd.pid")}
SlurmctldLogFile={self.path("slurmctld.daemon.log")}
SlurmdLogFile={self.path("slurmd.daemon.log")}
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/linux
JobAcctGatherFrequency=1
JobCompType=jobcomp/none
MpiDefault=none
ReturnToService=2
SchedulerType=sched/backfill
SlurmctldTimeout=30
SlurmdTimeout=30
InactiveLimit=0
KillWait=5
MinJobAge=600
MessageTimeout=10
{"SlurmdParameters=config_overrides" if self.cpus != 2 else ""}
NodeName={self.node} NodeAddr=127.0.0.1 CPUs={self.cpus} RealMemory=1000 State=UNKNOWN
PartitionName=debug Nodes={self.node} Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE
"""
        with open(self.conf, "w") as f:
            f.write(conf)
        os.chmod(self.conf, 0o644)

    def start_slurmctld(self) -> None:
        self._start("slurmctld", ["slurmctld", "-D", "-i", "-f", self.conf])
        self._wait(lambda: self.run("scontrol", "ping").returncode == 0
                   and "UP" in self.run("scontrol", "ping").stdout, "slurmctld", 30)

    def stop_slurmctld(self) -> None:
        """A controller shut down as an operator would (SIGTERM: it saves its state and exits),
        given a minute on a busy host: one killed mid-save restarts without its newest jobs,
        which is another fault than the outage the tests mean."""
        self._stop("slurmctld", grace=60)

    def _wait_node_idle(self) -> None:
        def idle() -> bool:
            out = self.run("sinfo", "--noheader", "-N", "-o", "%T").stdout
            return "idle" in out or "mixed" in out or "allocated" in out
        self._wait(idle, "slurmd", 30)

    def _sshd(self) -> None:
        sdir = self.path("ssh")
        hk = os.path.join(sdir, "host_ed25519")
        uk = os.path.join(sdir, "user_ed25519")
        for k in (hk, uk):
            subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", k], check=True)
        with open(hk + ".pub") as f:
            self.host_key_pub = f.read().strip()
        with open(uk) as f:
            self.user_key = f.read()
        with open(uk + ".pub") as f:
            user_pub = f.read().strip()
        auth = os.path.join(sdir, "authorized_keys")
        with open(auth, "w") as f:
            f.write(f"{user_pub}\n")
        os.chmod(auth, 0o600)
        cfg = os.path.join(sdir, "sshd_config")
        with open(cfg, "w") as f:
            f.write(f"""Port {self.ssh_port}
ListenAddress 127.0.0.1
HostKey {hk}
PidFile {sdir}/sshd.pid
AuthorizedKeysFile {auth}
PasswordAuthentication no
KbdInteractiveAuthentication no
PubkeyAuthentication yes
PermitRootLogin prohibit-password
StrictModes no
UsePAM no
MaxSessions 10
MaxStartups 100
LogLevel ERROR
SetEnv SHLVL=1
""")
        os.makedirs("/run/sshd", exist_ok=True)
        self._start("sshd", ["/usr/sbin/sshd", "-D", "-e", "-f", cfg])
        self._wait(lambda: _connects(self.ssh_port), "sshd", 15)

    def stop_sshd(self) -> None:
        """Kill sshd and every connection it serves (an SSH outage).

        Each connection's sshd is a child of the listener in a session of its
        own, so it is found by its parent pid and killed by its pid."""
        p = self.procs.get("sshd")
        children = _children(p.pid) if p is not None else []
        self._stop("sshd")
        for pid in children:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)

    def start_sshd(self) -> None:
        self._start("sshd", ["/usr/sbin/sshd", "-D", "-e", "-f", self.path("ssh", "sshd_config")])
        self._wait(lambda: _connects(self.ssh_port), "sshd", 15)

    def options(self) -> dict[str, str]:
        return {"SLURM_CONF": self.conf, "state_dir": self.path("home", "dlsched"), "max_nodes": "1"}

    def run(self, *argv: str, timeout: float = 20) -> subprocess.CompletedProcess[str]:
        try:
            return subprocess.run(list(argv), env=self.env, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            return subprocess.CompletedProcess(list(argv), 124, "", "timeout")

    def _wait(self, ok: object, name: str, within: float) -> None:
        deadline = time.monotonic() + within
        while time.monotonic() < deadline:
            p = self.procs.get(name)
            if p is not None and p.poll() is not None:
                raise RuntimeError(f"{name} exited {p.returncode}:\n{self._log(name)}")
            try:
                if ok():  # type: ignore[operator]
                    return
            except OSError:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"{name} did not come up in {within:g}s:\n{self._log(name)}")

    def _stop(self, name: str, grace: float = 10) -> None:
        p = self.procs.pop(name, None)
        if p is None or p.poll() is not None:
            return
        try:
            os.killpg(p.pid, signal.SIGTERM)
        except ProcessLookupError:
            return
        try:
            p.wait(grace)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait(5)

    def stop(self) -> None:
        if "slurmctld" in self.procs:
            self.run("scancel", "--user", self.user, "--full", timeout=5)
        for name in ("sshd", "slurmd", "slurmctld", "munged"):
            self._stop(name)
        if not os.environ.get("DLSCHED_KEEP_SLURM_DIR"):  # set it to read the daemons' logs after a failure
            shutil.rmtree(self.dir, ignore_errors=True)

    def diagnosis(self, slurm_job_id: str = "") -> str:
        """What Slurm says, for an assertion message: the job (when given) and the daemons' log tails."""
        job = self.run("scontrol", "show", "job", slurm_job_id, timeout=10).stdout if slurm_job_id else ""
        logs = "\n".join(f"--- {n}\n{self._log(n)}" for n in ("slurmctld.daemon", "slurmd.daemon"))
        return f"--- scontrol show job {slurm_job_id}\n{job}\n{logs}"


def command_log_path(bindir: str, logfile: str, commands: tuple[str, ...] = ("squeue", "scontrol")) -> str:
    """Writes wrappers of ``commands`` into ``bindir`` that append ``<unix time> <name> <args>``
    to ``logfile`` and exec the real command; returns a remote ``PATH`` (cluster option) that
    puts them first. Counts what a driver issues, as the login node sees it."""
    os.makedirs(bindir, exist_ok=True)
    for name in commands:
        real = shutil.which(name)
        if real is None:
            raise RuntimeError(f"{name} not found")
        path = os.path.join(bindir, name)
        with open(path, "w") as f:
            f.write(f"#!/bin/sh\nprintf '%s %s %s\\n' \"$(date +%s.%N)\" {name} \"$*\" >> {shlex.quote(logfile)}\n"
                    f"exec {shlex.quote(real)} \"$@\"\n")
        os.chmod(path, 0o755)
    return f"{bindir}:/usr/local/bin:/usr/bin:/bin"


def read_command_log(logfile: str) -> list[tuple[float, str, str]]:
    """``(time, command, args)`` per logged call, in order (missing file: none)."""
    try:
        with open(logfile) as f:
            lines = f.read().splitlines()
    except FileNotFoundError:
        return []
    out = []
    for line in lines:
        t, _, rest = line.partition(" ")
        name, _, args = rest.partition(" ")
        out.append((float(t), name, args))
    return out


def _children(ppid: int) -> list[int]:
    out = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == ppid:
            out.append(int(name))
    return out


def _connects(port: int) -> bool:
    with socket.create_connection(("127.0.0.1", port), timeout=0.5):
        return True
