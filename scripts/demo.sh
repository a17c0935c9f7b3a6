#!/usr/bin/env bash
# The demo, from a fresh clone: set up .venv, start the local stack with
# `dlsched up` in the background (TLS and tokens on; it saves a context
# `local`, so the CLI below needs no flags), run the PyTorch DDP example
# (examples/ddp/ddp.yaml: 1 master + 2 workers, gloo on CPU) with its logs
# streamed, print its final state, stop the stack.
#
#   bash scripts/demo.sh
set -euo pipefail
cd "$(dirname "$0")/.."

if [ ! -x .venv/bin/python ]; then
  echo "== creating .venv"
  if ! python3 -m venv .venv 2>/dev/null; then
    rm -rf .venv
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
      DEBIAN_FRONTEND=noninteractive apt-get update -qq
      DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends python3-venv >/dev/null
    fi
    python3 -m venv .venv
  fi
fi
echo "== system packages (Open MPI, for mpi4py)"
bash scripts/install-system-deps.sh
echo "== pip install -e '.[dev]'"
if ! PIP_DISABLE_PIP_VERSION_CHECK=1 .venv/bin/python -m pip install -q -e '.[dev]' >.venv/pip-install.log 2>&1; then
  cat .venv/pip-install.log >&2; echo "error: pip install failed" >&2; exit 1
fi

# Jobs run `python3` from the driver's PATH: make it the venv's (torch is there).
export PATH="$PWD/.venv/bin:$PATH"
DLSCHED=.venv/bin/dlsched
DATA=$(mktemp -d /tmp/dlsched-demo.XXXXXX)
PORT=$(.venv/bin/python -c '
import socket
for _ in range(100):
    a, b = socket.socket(), socket.socket()
    try:
        a.bind(("127.0.0.1", 0)); p = a.getsockname()[1]; b.bind(("127.0.0.1", p + 1))
    except OSError:
        continue
    finally:
        a.close(); b.close()
    print(p); break')

# `dlsched up` saves its context (server, CA file, admin token file) in the client
# config; the demo keeps its own config, apart from yours, and nothing from the shell.
export DLSCHED_CONFIG="$DATA/config.yaml"
unset DLSCHED_CONTEXT DLSCHED_SERVER DLSCHED_CLUSTER_MANAGER DLSCHED_TOKEN DLSCHED_TOKEN_FILE \
  DLSCHED_CA_FILE DLSCHED_TLS_CA_FILE DLSCHED_INSECURE

echo "== dlsched up --data-dir $DATA --port $PORT (log: $DATA/up.log)"
$DLSCHED up --data-dir "$DATA" --port "$PORT" >"$DATA/up.log" 2>&1 &
UP_PID=$!
stop_stack() {
  if kill -0 "$UP_PID" 2>/dev/null; then
    echo "== stopping the stack"
    kill -INT "$UP_PID" 2>/dev/null || true
    wait "$UP_PID" 2>/dev/null || true
  fi
}
trap stop_stack EXIT

for _ in $(seq 1 900); do
  [ -f "$DATA/ready.json" ] && break
  if ! kill -0 "$UP_PID" 2>/dev/null; then
    echo "error: dlsched up exited:" >&2; cat "$DATA/up.log" >&2; exit 1
  fi
  sleep 0.1
done
[ -f "$DATA/ready.json" ] || { echo "error: dlsched up not ready:" >&2; cat "$DATA/up.log" >&2; exit 1; }
grep -m1 "dlsched is up" "$DATA/up.log" || true

echo "== dlsched config get-contexts"
$DLSCHED config get-contexts
echo "== dlsched whoami"
$DLSCHED whoami
echo "== dlsched cluster list"
$DLSCHED cluster list
echo "== dlsched submit examples/ddp/ddp.yaml --follow"
rc=0
$DLSCHED submit examples/ddp/ddp.yaml --follow || rc=$?
echo "== dlsched list"
$DLSCHED list || true
stop_stack
trap - EXIT
exit $rc
