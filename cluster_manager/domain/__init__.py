"""ClusterManager's domain: models, validation, list filter and the matcher.

Plain typed Python; never imports grpc, the generated stubs or aetcd.
"""
