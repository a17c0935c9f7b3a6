"""The driver kit: what every backend driver is built from.

- ``base``: the domain types (plain dataclasses and enums, no grpc) and the
  abstract ``Driver`` interface.
- ``servicer``: ``DriverServicer``, the one ``dlsched.v1.DriverService``
  implementation; it validates, converts (``convert``) and calls a ``Driver``.
- ``hub``: ``ObservationHub``, the in-process fan-out behind ``Driver.watch``.
- ``env``: the run-mode planner (per-process argv and environment).
- ``main``: ``run_driver``, the ``python -m drivers.<backend>`` entry point.
"""
