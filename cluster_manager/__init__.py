"""ClusterManager: the registry of backend clusters, their health, watch and matching.

Layers: ``servicer.py`` (transport) -> ``domain/`` (plain Python) -> adapters
``store.py`` (etcd) and ``drivers.py`` (DriverService clients); ``hub.py``
fans the one etcd prefix watch out to WatchClusters streams and to
``monitor.py``, which keeps each cluster configured on its driver and its
observed state in etcd.
"""
