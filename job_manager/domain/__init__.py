"""JobManager's domain: plain typed Python, no grpc, no stubs, no aetcd."""
