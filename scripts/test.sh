#!/usr/bin/env bash
# Every check CI runs, from a fresh clone: buf lint and breaking (against the previous commit),
# import contracts, ruff, mypy strict, pytest.
#
#   bash scripts/test.sh            # all checks; exits non-zero if any fails
#   bash scripts/test.sh -k cli     # extra arguments go to pytest
#
# Installs what it needs: python3-venv, nodejs, npm and protobuf-compiler from
# Debian (when run as root and missing), .venv with `pip install -e '.[dev]'`,
# the buf CLI from npm into .ci/node and the Node client example's packages
# into examples/node (both ignored by git).
set -uo pipefail
cd "$(dirname "$0")/.."

log() { printf '\n== %s\n' "$*"; }

apt_install() {  # apt_install PACKAGE...: as root on Debian, when something is missing
  if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then
    echo "missing: $* (install them, or run as root on Debian)" >&2
    return 1
  fi
  if [ -z "${_APT_UPDATED:-}" ]; then
    DEBIAN_FRONTEND=noninteractive apt-get update -qq || return 1
    _APT_UPDATED=1
  fi
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "$@" >/dev/null
}

setup_python() {
  if [ ! -x .venv/bin/python ]; then
    log "creating .venv"
    if ! python3 -m venv .venv 2>/dev/null; then
      rm -rf .venv
      apt_install python3-venv python3-pip || return 1
      python3 -m venv .venv || return 1
    fi
  fi
  log "pip install -e '.[dev]'"
  if ! PIP_DISABLE_PIP_VERSION_CHECK=1 .venv/bin/python -m pip install -q -e '.[dev]' \
      >.venv/pip-install.log 2>&1; then
    cat .venv/pip-install.log >&2
    return 1
  fi
}

setup_buf() {
  BUF=.ci/node/node_modules/.bin/buf
  if [ -x "$BUF" ] && "$BUF" --version >/dev/null 2>&1; then return 0; fi
  log "npm install @bufbuild/buf into .ci/node"
  mkdir -p .ci/node
  npm install --no-save --no-audit --no-fund --loglevel=error --prefix .ci/node @bufbuild/buf \
    || return 1
  "$BUF" --version >/dev/null
}

log "system packages (Open MPI for the MPI run mode and mpi4py)"
bash scripts/install-system-deps.sh || { echo "error: system packages failed" >&2; exit 1; }
log "system packages (Slurm, munge and sshd for the Slurm driver's test cluster)"
bash scripts/install-slurm.sh || { echo "error: Slurm packages failed" >&2; exit 1; }
setup_node_tools() {  # node + npm (buf, the Node client example) and plain protoc (the protos compile test)
  local need=()
  command -v node >/dev/null || need+=(nodejs)
  command -v npm >/dev/null || need+=(npm)
  command -v protoc >/dev/null || need+=(protobuf-compiler)
  if [ ${#need[@]} -ne 0 ]; then
    log "system packages: ${need[*]}"
    apt_install "${need[@]}" || return 1
  fi
}

setup_node_example() {  # the Node.js client example's pinned dependencies (package-lock.json)
  if [ -d examples/node/node_modules/@grpc/grpc-js ]; then return 0; fi
  log "npm ci in examples/node"
  npm ci --no-audit --no-fund --loglevel=error --prefix examples/node
}

setup_python || { echo "error: python setup failed" >&2; exit 1; }
setup_node_tools || { echo "error: node/protoc setup failed" >&2; exit 1; }
setup_buf || { echo "error: buf setup failed" >&2; exit 1; }
setup_node_example || { echo "error: npm ci in examples/node failed" >&2; exit 1; }
export PATH="$PWD/.venv/bin:$PWD/.ci/node/node_modules/.bin:$PATH"

failed=()
run() {  # run NAME COMMAND...
  log "$1"
  local name=$1; shift
  if ! "$@"; then failed+=("$name"); fi
}

buf_breaking() {  # the API against the previous commit: no field renumbered, renamed or removed
  if git rev-parse -q --verify 'HEAD~1^{commit}' >/dev/null 2>&1; then
    buf breaking --against '.git#ref=HEAD~1'
  else
    echo "this clone has no previous commit (shallow): buf breaking has nothing to compare with"
  fi
}

run "buf lint" buf lint
run "buf breaking" buf_breaking
run "lint-imports" lint-imports
run "ruff check" ruff check .
run "mypy (strict)" mypy
run "pytest" python -m pytest -q "$@"

echo
if [ ${#failed[@]} -ne 0 ]; then
  echo "FAILED: ${failed[*]}"
  exit 1
fi
echo "all checks passed"
