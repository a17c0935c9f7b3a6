"""The shared service kit: server bootstrap, error mapping, config, etcd access, logging."""
