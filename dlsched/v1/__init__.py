"""Generated protobuf and gRPC stubs of the dlsched.v1 API (see protos/dlsched/v1).

Regenerate with ``python scripts/genproto.py``; tests fail when these are stale.
"""
