#!/usr/bin/env bash
# Installs what the Slurm driver's tests need, idempotently: Debian's slurmctld,
# slurmd, slurm-client, munge and openssh-server (as root; nothing to do when
# they are there), and asyncssh into .venv (the `slurm` extra).
#
#   bash scripts/install-slurm.sh
#
# The test fixtures (tests/slurm_cluster.py) start their own munged, slurmctld,
# slurmd and sshd in a temp dir; nothing here starts or enables a service.
set -euo pipefail
cd "$(dirname "$0")/.."

need=()
for b in slurmctld slurmd sbatch munged /usr/sbin/sshd; do
  command -v "$b" >/dev/null 2>&1 || need+=("$b")
done
if [ ${#need[@]} -ne 0 ]; then
  if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then
    echo "missing: ${need[*]} (run as root on Debian: apt-get install slurmctld slurmd slurm-client munge openssh-server)" >&2
    exit 1
  fi
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends slurmctld slurmd slurm-client munge openssh-server >/dev/null
  # Debian starts the packaged daemons; the tests run their own, so stop these.
  for s in slurmctld slurmd munge ssh; do
    (command -v systemctl >/dev/null && systemctl disable --now "$s" >/dev/null 2>&1) || true
  done
fi
if [ -x .venv/bin/python ] && ! .venv/bin/python -c 'import asyncssh' 2>/dev/null; then
  PIP_DISABLE_PIP_VERSION_CHECK=1 .venv/bin/python -m pip install -q 'asyncssh>=2.14'
fi
echo "slurm test dependencies present"
