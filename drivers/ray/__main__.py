"""``python -m drivers.ray --listen HOST:PORT --port-file F [--poll-interval S] [--log-poll-interval S] [--request-timeout S]``."""

from __future__ import annotations

import sys
from collections.abc import Sequence

from drivers.common.main import run_driver
from drivers.ray.driver import RayConfig, RayDriver


def main(argv: Sequence[str] | None = None) -> int:
    return run_driver(RayDriver, argv, "ray", RayConfig)


if __name__ == "__main__":
    sys.exit(main())
