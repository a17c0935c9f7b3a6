"""``python -m drivers.slurm --listen HOST:PORT --port-file F [--poll-interval S] [--command-timeout S] [--max-channels N]``."""

from __future__ import annotations

import sys
from collections.abc import Sequence

from drivers.common.main import run_driver
from drivers.slurm.driver import SlurmConfig, SlurmDriver


def main(argv: Sequence[str] | None = None) -> int:
    return run_driver(SlurmDriver, argv, "slurm", SlurmConfig)


if __name__ == "__main__":
    sys.exit(main())
