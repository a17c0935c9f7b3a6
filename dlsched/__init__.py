"""dlsched: one API for deep-learning jobs on local, Slurm, Kubernetes and Ray clusters.

This package holds only what every process and user shares: the generated
stubs (``dlsched.v1``), the client SDK (``dlsched.client``), the CLI
(``dlsched.cli``) and the service kit (``dlsched.kit``). No business logic.
"""

__version__ = "0.1.0"
