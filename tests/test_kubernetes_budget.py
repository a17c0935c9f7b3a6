"""The Kubernetes driver's client-side request budget (QPS/burst token bucket), on a fake clock."""

from __future__ import annotations

import threading

import pytest

from drivers.kubernetes.informer import RequestBudget


class FakeTime:
    """A clock that moves only when the budget sleeps (or the test says so)."""

    def __init__(self) -> None:
        self.now = 1000.0
        self.slept = 0.0

    def clock(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        assert seconds > 0
        self.slept += seconds
        self.now += seconds


def times_of(budget: RequestBudget, t: FakeTime, n: int) -> list[float]:
    start, out = t.now, []
    for _ in range(n):
        budget.acquire()
        out.append(t.now - start)
    return out


def test_a_burst_goes_at_once_then_one_request_every_1_over_qps() -> None:
    t = FakeTime()
    budget = RequestBudget(qps=5, burst=5, clock=t.clock, sleep=t.sleep)
    got = times_of(budget, t, 15)
    assert got[:5] == [0.0] * 5  # the full bucket
    assert got[5:] == pytest.approx([0.2 * i for i in range(1, 11)])  # then paced at 5 a second


def test_idle_time_refills_the_bucket_up_to_burst_only() -> None:
    t = FakeTime()
    budget = RequestBudget(qps=10, burst=3, clock=t.clock, sleep=t.sleep)
    times_of(budget, t, 3)  # empty now
    t.now += 0.25  # 2.5 tokens back
    assert times_of(budget, t, 3) == pytest.approx([0.0, 0.0, 0.05])
    t.now += 3600  # a long idle saves up no more than burst
    assert times_of(budget, t, 4) == pytest.approx([0.0, 0.0, 0.0, 0.1])


def test_threads_share_one_budget() -> None:
    """Concurrent callers (the driver's worker threads) together get no more than the budget allows."""
    lock = threading.Lock()
    t = FakeTime()

    def sleep(seconds: float) -> None:
        with lock:
            t.sleep(seconds / 8)  # eight sleepers each move the shared clock a share of their wait

    budget = RequestBudget(qps=4, burst=2, clock=lambda: t.now, sleep=sleep)
    threads = [threading.Thread(target=lambda: [budget.acquire() for _ in range(5)]) for _ in range(8)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(10)
    assert not any(th.is_alive() for th in threads)
    assert t.now - 1000.0 >= (8 * 5 - 2) / 4 - 1e-6  # 40 tokens: 2 saved, 38 earned at 4 a second


async def test_a_cluster_waiting_for_its_budget_holds_no_thread_another_cluster_needs() -> None:
    """A cluster held to its QPS waits for tokens on the event loop: its calls used to sleep in
    the default thread pool (a handful of threads on a small machine) that every cluster's calls
    share, so one throttled cluster stalled the others' calls."""
    import asyncio

    pytest.importorskip("kmock")
    from drivers.common.base import ClusterConfig
    from drivers.kubernetes.api import KubeApi
    from tests.kube_emulator import NS, emulator

    async with emulator() as (_, url):
        slow = KubeApi(ClusterConfig(name="clusters/slow", address=url), qps=0.2, burst=1, request_timeout=5)
        fast = KubeApi(ClusterConfig(name="clusters/fast", address=url), qps=100, burst=100, request_timeout=5)
        backlog = [asyncio.ensure_future(slow.call(slow.core.list_namespaced_pod, NS)) for _ in range(60)]
        try:
            await asyncio.sleep(0.5)  # the slow cluster's calls are all waiting for tokens now
            await asyncio.wait_for(fast.call(fast.core.list_namespaced_pod, NS), 60)
            assert sum(not t.done() for t in backlog) >= 50  # (they take 5 s each)
        finally:
            for t in backlog:
                t.cancel()
            await asyncio.gather(*backlog, return_exceptions=True)
            await slow.close()
            await fast.close()


def test_an_error_body_of_any_json_maps_to_its_status_never_an_attribute_error() -> None:
    """A proxy may answer any JSON (a string, a list) where the API server answers a Status:
    the error is still mapped by status (``api_error`` raised AttributeError: INTERNAL)."""
    from kubernetes.client.exceptions import ApiException

    from drivers.kubernetes.api import api_error

    for body in ('"conflict"', "[1, 2]", "null", "[" * 100_000, '{"message": "pod x exists"}'):
        exc = ApiException(status=422, reason="Unprocessable")
        exc.body = body
        err = api_error(exc, "creating pod x")
        assert err.code == "INVALID_ARGUMENT" and "HTTP 422" in str(err), body
    assert "pod x exists" in str(err)
