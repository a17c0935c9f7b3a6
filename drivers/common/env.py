"""Compatibility name for ``drivers.common.planner`` (the run-mode planner)."""

from drivers.common.planner import (
    ALL_RUN_MODES,
    DEFAULT_MASTER_PORT,
    JobPlan,
    Placement,
    ProcessLaunch,
    SuccessRule,
    check_run_mode,
    plan_job,
    plan_processes,
)

__all__ = ["ALL_RUN_MODES", "DEFAULT_MASTER_PORT", "JobPlan", "Placement", "ProcessLaunch", "SuccessRule",
           "check_run_mode", "plan_job", "plan_processes"]
