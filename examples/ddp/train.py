"""DDP on CPU with gloo: a linear model on synthetic data, a few steps.

Every rank trains on its own batch; DDP all-reduces the gradients, so the
ranks' parameters stay identical. The program checks that the all-reduce
really happened (a sum over ranks, and identical parameters afterwards) and
prints the final loss. With EXAMPLE_OUT set, each rank also writes what it
saw to $EXAMPLE_OUT/rank-{RANK}.json.
"""

import json
import os
import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

STEPS = int(os.environ.get("DDP_STEPS", "5"))

dist.init_process_group("gloo", init_method="env://")
rank, world = dist.get_rank(), dist.get_world_size()
torch.manual_seed(0)  # the same initial model on every rank
model = DDP(torch.nn.Linear(8, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
gen = torch.Generator().manual_seed(1000 + rank)  # each rank its own data
true_w = torch.arange(8, dtype=torch.float32).unsqueeze(1) / 8

loss = torch.tensor(0.0)
for step in range(STEPS):
    x = torch.randn(32, 8, generator=gen)
    y = x @ true_w
    opt.zero_grad()
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()  # DDP all-reduces the gradients here
    opt.step()
    print(f"rank {rank} step {step} loss {loss.item():.4f}", flush=True)

# The all-reduce really happened: a sum over ranks, and identical parameters.
t = torch.tensor([float(rank + 1)])
dist.all_reduce(t)
expected = world * (world + 1) / 2
flat = torch.cat([p.detach().flatten() for p in model.parameters()])
gathered = [torch.zeros_like(flat) for _ in range(world)]
dist.all_gather(gathered, flat)
same = all(torch.equal(g, gathered[0]) for g in gathered)
if t.item() != expected or not same:
    raise SystemExit(f"rank {rank}: all-reduce sum {t.item()} (want {expected}), params identical: {same}")

if out := os.environ.get("EXAMPLE_OUT"):
    keys = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT",
            "DLSCHED_ROLE", "DLSCHED_REPLICA_INDEX")
    with open(os.path.join(out, f"rank-{rank}.json"), "w") as f:
        json.dump({"env": {k: os.environ.get(k) for k in keys}, "allreduce_sum": t.item(),
                   "params_identical": same, "final_loss": loss.item()}, f)
print(f"rank {rank}/{world} ({os.environ.get('DLSCHED_ROLE')}): all-reduce sum {t.item():g} ok; "
      f"final loss {loss.item():.4f}", flush=True)
# Leave together, and without tearing gloo down: a rank still finishing its
# last collective can lose its peers mid-teardown, and even after a barrier
# gloo's teardown (destroy_process_group, or the destructors at exit) aborts
# a rank whose peers have gone ("terminate called without an active
# exception", exit 134: seen about once in 15 runs on a loaded machine).
# Past the barrier every rank has what it needs; the OS closes the sockets.
dist.barrier()
sys.stdout.flush()
sys.stderr.flush()
os._exit(0)
