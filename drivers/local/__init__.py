"""The local driver: runs jobs as process groups on the driver's host."""
