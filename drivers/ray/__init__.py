"""The Ray backend: jobs through the Ray Jobs REST API (the driver never imports ``ray``)."""
