#!/usr/bin/env bash
# System packages the run-mode examples and tests need, from Debian; run as root
# (CI does). Idempotent: installs only what is missing.
#   sudo bash scripts/install-system-deps.sh
#
#   openmpi-bin      mpirun, for RUN_MODE_MPI on the local backend
#   libopenmpi-dev   mpicc and headers, so `pip install mpi4py` can build
#   postgresql       initdb/pg_ctl/postgres (/usr/lib/postgresql/<ver>/bin): the tests run the
#                    job history on a real PostgreSQL started in a temp dir (tests/postgres.py)
set -euo pipefail

missing=()
command -v mpirun >/dev/null 2>&1 || missing+=(openmpi-bin)
command -v mpicc >/dev/null 2>&1 || missing+=(libopenmpi-dev)
compgen -G '/usr/lib/postgresql/*/bin/initdb' >/dev/null || missing+=(postgresql)
if [ ${#missing[@]} -eq 0 ]; then
  echo "system deps present: $(mpirun --version 2>/dev/null | head -1); $(ls -d /usr/lib/postgresql/*/bin/initdb | head -1)"
  exit 0
fi
if [ "$(id -u)" != 0 ]; then
  echo "missing: ${missing[*]} (run as root, or: sudo apt-get install -y ${missing[*]})" >&2
  exit 1
fi
if ! command -v apt-get >/dev/null 2>&1; then
  echo "missing: ${missing[*]}, and no apt-get here; install Open MPI and PostgreSQL yourself" >&2
  exit 1
fi
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
echo "installed: ${missing[*]} ($(mpirun --version | head -1); $(ls -d /usr/lib/postgresql/*/bin/initdb | head -1))"
