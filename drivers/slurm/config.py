"""The Slurm driver's flags (``python -m drivers.slurm --help`` lists them)."""

from __future__ import annotations

from dataclasses import dataclass, field

from drivers.slurm import logs as slogs
from drivers.slurm import poller as poll


@dataclass(frozen=True)
class SlurmConfig:
    """The Slurm driver's flags."""

    poll_interval: float = field(default=2.0, metadata={
        "help": f"seconds between squeue rounds per cluster (at least {poll.MIN_INTERVAL:g})"})
    command_timeout: float = field(default=30.0, metadata={"help": "timeout of one remote command"})
    max_channels: int = field(default=8, metadata={"min": 1,
        "help": "concurrent SSH channels per cluster (keep below the server's MaxSessions, 10)"})
    max_log_streams: int = field(default=8, metadata={"min": 0,
        "help": "log followers streaming at once per cluster, each on one channel of a second SSH "
                "connection (at most 9; followers beyond it read by polls)"})
    log_stream_interval: float = field(default=slogs.STREAM_INTERVAL, metadata={
        "help": "seconds between a log stream's looks at its files on the login node (a line "
                "reaches the follower about half of it after it was written)"})
    capacity_interval: float = field(default=60.0, metadata={
        "help": "seconds between capacity look-ups (scontrol show nodes) while jobs are polled; "
                "health then comes from the poll rounds, and each look-up takes one round's slot"})
    idle_check_interval: float = field(default=10.0, metadata={
        "help": "seconds between health and capacity look-ups of a cluster with no polled job"})
    grace_seconds: float = field(default=10.0, metadata={"min": 0,
        "help": "seconds between a stop's SIGTERM to a running job's processes and its scancel when "
                "the stop names no grace (then Slurm's KillWait before SIGKILL)"})
    held_grace: float = field(default=600.0, metadata={
        "help": "seconds a held dlsched job that no driver adopted stays queued before a poll round "
                "cancels it (a launch whose answer JobManager never got, then gave up on); the oldest "
                "job of an attempt also waits until JobManager's watch of the cluster has been open "
                "--adopt-window seconds without claiming it; a held duplicate of an attempt not "
                "tracked here waits min(60, this)"})
    adopt_window: float = field(default=60.0, metadata={
        "help": "seconds a WatchJobObservations of a cluster (JobManager's) must have been open past "
                "its snapshot before a held job nobody claimed is taken for one JobManager does not "
                "know: right after the snapshot JobManager claims every launched job it lacked"})
