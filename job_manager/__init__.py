"""JobManager: validates, stores, schedules and tracks deep-learning jobs.

Layers: ``servicer.py`` (transport, proto ⇄ domain through ``convert.py``) →
``scheduler.py`` (the application: submit, stop, delete, launcher, tracker) →
``domain/`` (plain Python: model, state machine, validation, filter) and the
adapters ``store.py`` (etcd), ``watch.py`` (the one etcd prefix watch and its
ring buffer), ``clients.py`` (ClusterManager and driver stubs).
"""
