"""MPI jobs' SSH: the files, volumes and key pair of an MPI attempt (``render`` emits the objects).

As MPI Operator v2 does it, with built-in objects only: the launcher
reaches the workers over SSH with a key made for the attempt.

- a Secret ``<base>-ssh`` (``kubernetes.io/ssh-auth``): ``ssh-privatekey``,
  ``ssh-publickey`` and ``known_hosts``. Rendering is pure, so the rendered
  Secret (and the dry run, and the native spec the driver reports) carries
  empty values; ``launch`` makes a fresh Ed25519 key pair and fills them in
  (``with_ssh_key``) just before creating it. The private key goes to the
  API server only. The same key is every worker's sshd host key, so
  ``known_hosts`` pins it for ``*.<base>.<namespace>.svc`` and the client
  checks host keys strictly.
- a ConfigMap ``<base>-mpi``: the planner's ``hostfile`` (worker DNS names,
  ``slots`` = processes per worker), the ssh client ``config`` and the
  ``sshd_config``.
- every MPI pod mounts them: the Secret's keys and the two ssh files at
  ``/root/.ssh`` (a projected volume; private key mode 0400), the
  hostfile at ``/etc/dlsched/mpi/hostfile`` (``DLSCHED_MPI_HOSTFILE``).
- worker pods run one container, ``sshd -De -f /root/.ssh/sshd_config``
  (the image's; the group's command is not run: workers are hosts for
  mpirun), with the whole replica's resources.
- the launcher pod runs the planner's ``mpirun -np <slots> --hostfile ...
  -x NAME ... /bin/sh -c <rank script>`` (the command reaches the ranks in
  ``DLSCHED_MPI_ARGV``, the contract and group env through ``-x``, since
  sshd gives the ranks a clean environment) after an init container, ``wait-for-workers``, that retries
  ``ssh <worker> true`` until every worker's name resolves and its sshd
  lets the job's key in. The init container's ``sh -c`` script is a
  constant; the worker names are its arguments, never part of the script.
- the job's state is the launcher's: the success rule's decisive role is
  ``launcher``; the workers are stopped once it ends.

The images must be able to run this: ``sshd`` (openssh-server, with
``/run/sshd`` present) and ``/bin/sh`` in the workers, ``ssh`` and ``sh`` in
the launcher, Open MPI on the default PATH of an ssh session, and root as the
user (sshd on port 22, keys under ``/root/.ssh``; Open MPI's refusal to run
as root is lifted with ``OMPI_ALLOW_RUN_AS_ROOT``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from drivers.common import planner
from drivers.common.planner import MpiNotAvailable

#: MPI: where the pods find the SSH files and the hostfile.
SSH_DIR = "/root/.ssh"
MPI_DIR = "/etc/dlsched/mpi"
HOSTFILE_PATH = f"{MPI_DIR}/{planner.HOSTFILE}"
SSH_KEY_FILE = "id_ed25519"
SSHD = "/usr/sbin/sshd"
#: The launcher's init container: retry ``ssh <host> true`` for every worker name given as an argument.
WAIT_SCRIPT = (
    'for h in "$@"; do\n'
    '  until ssh -F /root/.ssh/config -o ConnectTimeout=5 "$h" true; do\n'
    '    echo "dlsched: waiting for $h"; sleep 2\n'
    '  done\n'
    'done\n'
)
#: OpenMPI refuses to run as root without these; the MPI pods run as root (sshd, /root/.ssh).
MPI_LAUNCHER_ENV = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}
MPI_MOUNTS = [{"name": "dlsched-ssh", "mountPath": SSH_DIR, "readOnly": True},
              {"name": "dlsched-mpi", "mountPath": MPI_DIR, "readOnly": True}]


def with_ssh_key(secret: Mapping[str, Any], private_key: str, public_key: str) -> dict[str, Any]:
    """A copy of the rendered MPI Secret carrying the attempt's key pair (OpenSSH format).

    ``known_hosts`` pins the key (every worker's host key) for the names
    under the headless Service, the Secret's owner.
    """
    meta = secret["metadata"]
    service = meta["ownerReferences"][0]["name"]
    public = public_key.strip()
    data = {
        "ssh-privatekey": private_key if private_key.endswith("\n") else private_key + "\n",
        "ssh-publickey": public + "\n",
        "known_hosts": f"*.{service}.{meta['namespace']}.svc {public}\n",
    }
    return {**secret, "stringData": data}


def ssh_config(svc: str, ns: str) -> str:
    return (f"Host *.{svc}.{ns}.svc\n"
            f"  IdentityFile {SSH_DIR}/{SSH_KEY_FILE}\n"
            "  IdentitiesOnly yes\n"
            f"  UserKnownHostsFile {SSH_DIR}/known_hosts\n"
            "  StrictHostKeyChecking yes\n"
            "  CheckHostIP no\n"
            "  BatchMode yes\n"
            "  Port 22\n"
            "  LogLevel ERROR\n")


def sshd_config() -> str:
    return ("Port 22\n"
            f"HostKey {SSH_DIR}/{SSH_KEY_FILE}\n"
            f"AuthorizedKeysFile {SSH_DIR}/authorized_keys\n"
            "PermitRootLogin prohibit-password\n"
            "PubkeyAuthentication yes\n"
            "PasswordAuthentication no\n"
            "KbdInteractiveAuthentication no\n"
            "UsePAM no\n"
            "StrictModes no\n"  # the projected volume's directory is not the user's own ~/.ssh
            "PrintMotd no\n")


def volumes(secret: str, config_map: str) -> list[dict[str, Any]]:
    return [
        {"name": "dlsched-ssh", "projected": {"defaultMode": 0o444, "sources": [
            {"secret": {"name": secret, "items": [
                {"key": "ssh-privatekey", "path": SSH_KEY_FILE, "mode": 0o400},
                {"key": "ssh-publickey", "path": f"{SSH_KEY_FILE}.pub"},
                {"key": "ssh-publickey", "path": "authorized_keys"},
                {"key": "known_hosts", "path": "known_hosts"},
            ]}},
            {"configMap": {"name": config_map, "items": [
                {"key": "ssh_config", "path": "config"},
                {"key": "sshd_config", "path": "sshd_config"},
            ]}},
        ]}},
        {"name": "dlsched-mpi", "configMap": {"name": config_map, "defaultMode": 0o444, "items": [
            {"key": planner.HOSTFILE, "path": planner.HOSTFILE}]}},
    ]


def ssh_keypair() -> tuple[str, str]:
    """A fresh Ed25519 key pair for one MPI attempt: (OpenSSH private key, ``ssh-ed25519 ...`` line)."""
    try:
        from cryptography.hazmat.primitives import serialization
        from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
    except ImportError:
        raise MpiNotAvailable("the Kubernetes driver needs the 'cryptography' package to make "
                              "each MPI job's SSH key") from None
    key = Ed25519PrivateKey.generate()
    private = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.OpenSSH,
                                serialization.NoEncryption()).decode()
    public = key.public_key().public_bytes(serialization.Encoding.OpenSSH,
                                           serialization.PublicFormat.OpenSSH).decode()
    return private, f"{public} dlsched"
