"""``python -m drivers.local --listen HOST:PORT --port-file F [--state-dir DIR] [--grace-seconds S]``."""

from __future__ import annotations

import sys
from collections.abc import Sequence

from drivers.common.main import run_driver
from drivers.local.driver import LocalConfig, LocalDriver


def main(argv: Sequence[str] | None = None) -> int:
    return run_driver(LocalDriver, argv, "local", LocalConfig)


if __name__ == "__main__":
    sys.exit(main())
