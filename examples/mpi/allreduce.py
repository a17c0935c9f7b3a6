"""mpi4py allreduce: every rank contributes rank + 1; all must see the sum.

With EXAMPLE_OUT set, each rank writes $EXAMPLE_OUT/rank-{rank}.json.
"""

import json
import os
import socket

from mpi4py import MPI

comm = MPI.COMM_WORLD
rank, size = comm.Get_rank(), comm.Get_size()
total = comm.allreduce(rank + 1, op=MPI.SUM)
expected = size * (size + 1) // 2
if out := os.environ.get("EXAMPLE_OUT"):
    with open(os.path.join(out, f"rank-{rank}.json"), "w") as f:
        json.dump({"rank": rank, "size": size, "sum": total, "host": socket.gethostname(),
                   "hostfile": os.environ.get("DLSCHED_MPI_HOSTFILE")}, f)
if total != expected:
    raise SystemExit(f"rank {rank}: allreduce sum {total}, want {expected}")
print(f"rank {rank}/{size}: allreduce sum {total} ok", flush=True)
