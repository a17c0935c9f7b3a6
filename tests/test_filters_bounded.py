"""ListJobs/WatchJobs and ListClusters/WatchClusters filters: a request's parsing work is bounded.

A filter longer than ``MAX_FILTER_CHARS`` is refused (INVALID_ARGUMENT on ``filter``) before any
parsing; within the bound, long whitespace runs split in one scan (the AND split once cost time
quadratic in a run's length: 100,000 spaces held JobManager's event loop for 12 s) and still parse.
"""

from __future__ import annotations

import pytest

from cluster_manager.domain import filter as cfilter
from dlsched.errors import InvalidArgument
from job_manager.domain import filter as jfilter


@pytest.mark.parametrize("mod", [jfilter, cfilter], ids=["jobs", "clusters"])
def test_a_filter_past_the_bound_is_refused_before_parsing(mod) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(InvalidArgument) as ei:
        mod.parse_filter("labels.a=b" + " " * mod.MAX_FILTER_CHARS)
    assert [v.field for v in ei.value.violations] == ["filter"]


def test_long_whitespace_runs_within_the_bound_still_parse() -> None:
    gap = " " * 2000
    jobs = jfilter.parse_filter(f"state=RUNNING{gap}AND{gap}labels.team=ml")
    assert [(t.field, t.value) for t in jobs.terms] == [("state", 3), ("labels.team", "ml")]
    clusters = cfilter.parse_filter(f"type=SLURM{gap}and{gap}labels.zone={gap}'a'")
    assert [(t.field, t.value) for t in clusters.terms] == [("type", "SLURM"), ("labels.zone", "a")]
    with pytest.raises(InvalidArgument):
        jfilter.parse_filter(f"state=RUNNING{gap}x")


@pytest.mark.parametrize("when", ["٢٠٢٦-01-01T00:00:00Z", "２٠٩٩-01-01T00:00:00Z", "2026-01-01T00:00:00+٠٠:00"])
def test_a_time_with_other_than_ascii_digits_is_refused(when: str) -> None:
    """RFC 3339 times are ASCII digits (``\\d`` took Arabic-Indic and full-width ones)."""
    jfilter.parse_filter('create_time >= "2026-01-01T00:00:00Z"')  # ASCII: taken
    with pytest.raises(InvalidArgument) as ei:
        jfilter.parse_filter(f'create_time >= "{when}"')
    assert [v.field for v in ei.value.violations] == ["filter"]


@pytest.mark.parametrize("mod", [jfilter, cfilter], ids=["jobs", "clusters"])
def test_a_filter_with_a_nul_is_refused(mod) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(InvalidArgument) as ei:
        mod.parse_filter("labels.a=b\x00c")
    assert [v.field for v in ei.value.violations] == ["filter"]
