"""Writes a line to stderr and exits 3: a job that FAILS."""

import sys

print("about to fail", flush=True)
print("something went wrong", file=sys.stderr, flush=True)
sys.exit(3)
