"""Prints a few lines over about two seconds, then exits 0."""

import os
import time

name = os.environ.get("DLSCHED_JOB_NAME", "(not under dlsched)")
for i in range(1, 6):
    print(f"hello from {name}: line {i} of 5", flush=True)
    time.sleep(0.4)
print("hello: done", flush=True)
