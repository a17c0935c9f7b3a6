"""Drivers: one ``dlsched.v1.DriverService`` per backend type.

``drivers.common`` holds the abstract ``Driver`` interface, the one servicer
that exposes any ``Driver`` over gRPC and the start-up helper; each backend is
a package of the same shape (``driver.py``, ``render.py``, ``states.py``).
"""
