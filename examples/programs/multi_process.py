"""Prints the torch.distributed-style variables a MULTI_PROCESS job sees."""

import os
import time

keys = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "NODE_RANK",
        "MASTER_ADDR", "MASTER_PORT")
env = {k: os.environ.get(k, "?") for k in keys}
print(f"rank {env['RANK']} of {env['WORLD_SIZE']}: "
      + " ".join(f"{k}={v}" for k, v in env.items()), flush=True)
time.sleep(0.5)
print(f"rank {env['RANK']}: done", flush=True)
