"""``python -m drivers.kubernetes --listen HOST:PORT --port-file F [--qps N] [--burst N] ...``."""

from __future__ import annotations

import sys
from collections.abc import Sequence

from drivers.common.main import run_driver
from drivers.kubernetes.driver import KubernetesConfig, KubernetesDriver


def main(argv: Sequence[str] | None = None) -> int:
    return run_driver(KubernetesDriver, argv, "kubernetes", KubernetesConfig)


if __name__ == "__main__":
    sys.exit(main())
