"""Parameter-server training without TensorFlow, wired by TF_CONFIG.

The model is linear regression ``y = w . x + b`` (8 weights and a bias).
Parameter ``i`` lives on parameter server ``i % len(ps)``. A ps serves
``GET /params`` (its shard as JSON) and ``POST /grad`` (a gradient for its
shard, applied at once with SGD: asynchronous training, as with
TensorFlow's ParameterServerStrategy). A worker pulls every shard, computes
the gradient on its own synthetic batch, pushes each shard's part back, and
after STEPS steps prints its loss. The ps never exits; dlsched stops it once
every worker has succeeded. With EXAMPLE_OUT set, each task writes
``$EXAMPLE_OUT/{type}-{index}.json`` (its TF_CONFIG, and a worker's loss).
"""

import json
import os
import random
import threading
import time
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

DIM = 8
STEPS = int(os.environ.get("PS_STEPS", "60"))
LR = 0.05
TRUE_W = [(i + 1) / DIM for i in range(DIM)]
TRUE_B = 0.5

tf_config = json.loads(os.environ["TF_CONFIG"])
cluster, task = tf_config["cluster"], tf_config["task"]
ps_hosts = cluster["ps"]
names = [f"w{i}" for i in range(DIM)] + ["b"]
shard_of = {n: i % len(ps_hosts) for i, n in enumerate(names)}


def record(extra: dict) -> None:
    if out := os.environ.get("EXAMPLE_OUT"):
        path = os.path.join(out, f"{task['type']}-{task['index']}.json")
        with open(path + ".tmp", "w") as f:
            json.dump({"tf_config": tf_config, **extra}, f)
        os.replace(path + ".tmp", path)


def serve_ps() -> None:
    mine = {n: 0.0 for n in names if shard_of[n] == task["index"]}
    lock = threading.Lock()
    updates = [0]

    class Handler(BaseHTTPRequestHandler):
        def _reply(self, body: dict) -> None:
            data = json.dumps(body).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:
            with lock:
                self._reply({"params": dict(mine), "updates": updates[0]})

        def do_POST(self) -> None:
            grad = json.loads(self.rfile.read(int(self.headers["Content-Length"])))["grad"]
            with lock:
                for n, g in grad.items():
                    mine[n] -= LR * g
                updates[0] += 1
            self._reply({"ok": True})

        def log_message(self, *args: object) -> None:
            pass

    host, port = ps_hosts[task["index"]].rsplit(":", 1)
    server = ThreadingHTTPServer((host, int(port)), Handler)
    record({"serving": ps_hosts[task["index"]], "shard": sorted(mine)})
    print(f"ps {task['index']} serving {sorted(mine)} on {host}:{port}", flush=True)
    server.serve_forever()  # until dlsched stops it


def call(addr: str, path: str, body: dict | None = None, wait: float = 60.0) -> dict:
    deadline = time.monotonic() + wait
    data = json.dumps(body).encode() if body is not None else None
    while True:
        try:
            req = urllib.request.Request(f"http://{addr}{path}", data=data,
                                         headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=10) as r:
                return json.loads(r.read())
        except (urllib.error.URLError, ConnectionError):
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)  # the ps may not be up yet


def run_worker() -> None:
    rng = random.Random(100 + task["index"])

    def batch(n: int = 16) -> list[tuple[list[float], float]]:
        out = []
        for _ in range(n):
            x = [rng.uniform(-1, 1) for _ in range(DIM)]
            out.append((x, sum(w * v for w, v in zip(TRUE_W, x, strict=True)) + TRUE_B))
        return out

    def pull() -> dict[str, float]:
        params: dict[str, float] = {}
        for addr in ps_hosts:
            params.update(call(addr, "/params")["params"])
        return params

    def loss_of(p: dict[str, float], data: list[tuple[list[float], float]]) -> float:
        w = [p[f"w{i}"] for i in range(DIM)]
        return sum((sum(a * b for a, b in zip(w, x, strict=True)) + p["b"] - y) ** 2 for x, y in data) / len(data)

    first = None
    for _ in range(STEPS):
        p = pull()
        data = batch()
        if first is None:
            first = loss_of(p, data)
        w = [p[f"w{i}"] for i in range(DIM)]
        grad = {n: 0.0 for n in names}
        for x, y in data:
            err = sum(a * b for a, b in zip(w, x, strict=True)) + p["b"] - y
            for i in range(DIM):
                grad[f"w{i}"] += 2 * err * x[i] / len(data)
            grad["b"] += 2 * err / len(data)
        for k, addr in enumerate(ps_hosts):
            call(addr, "/grad", {"grad": {n: g for n, g in grad.items() if shard_of[n] == k}})
    final = loss_of(pull(), batch(256))
    record({"first_loss": first, "final_loss": final, "steps": STEPS})
    print(f"worker {task['index']}: {STEPS} steps, loss {first:.4f} -> {final:.4f}", flush=True)
    if not final < first:
        raise SystemExit("the loss did not go down")


if task["type"] == "ps":
    serve_ps()
else:
    run_worker()
