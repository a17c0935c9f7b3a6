"""The Kubernetes backend: jobs as plain Pods and a headless Service, through the REST API."""
