"""JobManager's etcd adapter and watch hub against a real etcd."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator
from datetime import UTC, datetime

import pytest

from dlsched.errors import InvalidArgument, WatchTokenExpired
from dlsched.kit.etcd import connect
from job_manager.convert import job_to_bytes
from job_manager.domain.errors import JobAlreadyExists, JobNotFound
from job_manager.domain.model import Job, JobSpec, JobState, ReplicaGroup
from job_manager.store import JobStore
from job_manager.watch import EventType, WatchHub, decode_token, encode_token
from tests.harness import EtcdServer


@pytest.fixture
async def store(etcd: EtcdServer, etcd_prefix: str) -> AsyncIterator[JobStore]:
    client = await connect(etcd.endpoint)
    yield JobStore(client, etcd_prefix)
    await client.close()


def new_job(job_id: str) -> Job:
    return Job(id=job_id, uid=job_id, state=JobState.PENDING, cluster="clusters/local", attempt=1,
               create_time=datetime.now(UTC),
               spec=JobSpec(run_mode=1, replica_groups=[ReplicaGroup(role="m", replicas=1,
                                                                     command=["true"])]))


async def test_submit_dedup_is_one_transaction_under_concurrency(store: JobStore) -> None:
    results = await asyncio.gather(*(store.create(new_job(f"j{i}"), "req-1") for i in range(8)))
    created = [j for j, c in results if c]
    assert len(created) == 1
    assert {j.id for j, _ in results} == {created[0].id}
    jobs, _ = await store.list_all()
    assert [j.id for j in jobs] == [created[0].id]
    assert (await store.job_for_request("req-1")).id == created[0].id  # type: ignore[union-attr]


async def test_job_id_collision_is_already_exists(store: JobStore) -> None:
    await store.create(new_job("same"), "r1")
    with pytest.raises(JobAlreadyExists):
        await store.create(new_job("same"), "r2")
    with pytest.raises(JobAlreadyExists):
        await store.create(new_job("same"))
    assert await store.job_for_request("r2") is None


async def test_cas_update_reapplies_on_conflict(store: JobStore) -> None:
    job, _ = await store.create(new_job("cas"))
    assert job.etag

    def bump(j: Job) -> Job:
        return dataclasses.replace(j, attempt=j.attempt + 1)

    await asyncio.gather(*(store.update("cas", bump) for _ in range(15)))
    got = await store.get("cas")
    assert got.attempt == 16 and got.etag != job.etag
    same = await store.update("cas", lambda j: None)
    assert same.etag == got.etag
    with pytest.raises(JobNotFound):
        await store.update("missing", bump)


async def test_delete_returns_last_state_and_request_keys_go(store: JobStore) -> None:
    await store.create(new_job("del"), "rq")
    last = await store.delete("del")
    assert last is not None and last.id == "del"
    assert await store.delete("del") is None
    assert await store.request_job_id("rq") is None  # deleted with the job (``request_of_key``)
    assert await store.job_for_request("rq") is None
    assert (await store.create(new_job("del2"), "rq"))[1]  # the request id makes a new job at once
    await store.delete("del2")
    await store.create(new_job("old"), "rq-old")
    await store.client.delete(store.request_of_key("old"))  # as stored before that key was written
    await store.delete("old")
    assert await store.delete_request_keys("old") == 1  # found by reading the keys, a page at a time


async def test_a_deleted_jobs_request_keys_go_however_many_other_keys_there_are(store: JobStore) -> None:
    """40,000 request keys of 128-character ids (~7 MB): one range of them all passed gRPC's
    4 MiB, and DeleteJob failed after the job was deleted (its key left behind)."""
    await store.create(new_job("victim"), "victim-request")
    await store.client.delete(store.request_of_key("victim"))  # stored before that key was written
    await store.delete("victim")
    for start in range(0, 40_000, 100):
        await store._txn([], [store._put(store.request_key(f"{i:0128d}"), b"someone-else")
                              for i in range(start, start + 100)], [], jobs=False)
    assert await store.delete_request_keys("victim") == 1
    assert await store.request_job_id("victim-request") is None
    assert await store.request_job_id(f"{7:0128d}") == "someone-else"


def test_token_roundtrip() -> None:
    assert decode_token(encode_token(42)) == 42
    with pytest.raises(InvalidArgument):
        decode_token("garbage!")


async def _collect(sub, n: int) -> list:  # type: ignore[no-untyped-def]
    return [await asyncio.wait_for(sub.next(), 5) for _ in range(n)]


async def test_hub_resume_without_gap_or_duplicate(store: JobStore, etcd_prefix: str) -> None:
    hub = WatchHub(store.client, etcd_prefix, buffer_size=100)
    await hub.start()
    try:
        live = hub.subscribe(hub.horizon)
        await store.create(new_job("w1"))
        await store.update("w1", lambda j: dataclasses.replace(j, state=JobState.RUNNING))
        first = await _collect(live, 2)
        assert [e.type for e in first] == [EventType.CREATED, EventType.UPDATED]
        token = first[0].revision
        await store.update("w1", lambda j: dataclasses.replace(j, state=JobState.SUCCEEDED))
        await store.delete("w1")
        rest = await _collect(live, 2)
        assert rest[1].type == EventType.DELETED and rest[1].job.state == JobState.SUCCEEDED
        resumed = hub.subscribe(token)
        replay = await _collect(resumed, 3)
        assert [e.revision for e in replay] == [e.revision for e in first[1:] + rest]

        # A second hub (a restarted JobManager) honours the first one's tokens.
        hub2 = WatchHub(store.client, etcd_prefix, buffer_size=100)
        await hub2.start()
        try:
            again = await _collect(hub2.subscribe(token), 3)
            assert [e.revision for e in again] == [e.revision for e in replay]
        finally:
            await hub2.stop()
    finally:
        await hub.stop()


async def test_hub_token_older_than_buffer_expires(store: JobStore, etcd_prefix: str) -> None:
    hub = WatchHub(store.client, etcd_prefix, buffer_size=3)
    await hub.start()
    try:
        live = hub.subscribe(hub.horizon)
        await store.create(new_job("x"))
        old = (await _collect(live, 1))[0].revision
        for i in range(5):
            await store.update("x", lambda j, i=i: dataclasses.replace(j, attempt=10 + i))
        await _collect(live, 5)
        with pytest.raises(WatchTokenExpired):
            hub.subscribe(old)
        recent = hub.horizon
        assert len(await _collect(hub.subscribe(recent), 3)) == 3
    finally:
        await hub.stop()


async def test_slow_subscriber_is_ended_unavailable(store: JobStore, etcd_prefix: str) -> None:
    hub = WatchHub(store.client, etcd_prefix, buffer_size=2, subscriber_limit=2)
    await hub.start()
    try:
        slow = hub.subscribe(hub.horizon)
        await store.create(new_job("s"))
        for i in range(6):
            await store.update("s", lambda j, i=i: dataclasses.replace(j, attempt=20 + i))
        await asyncio.sleep(0.3)
        with pytest.raises(Exception) as ei:
            await _collect(slow, 7)
        assert getattr(ei.value, "reason", "") == "WATCH_SUBSCRIBER_LAGGING"
    finally:
        await hub.stop()


async def test_purge_marks_reach_watchers_as_deleted_and_bad_events_are_skipped(
        store: JobStore, etcd_prefix: str) -> None:
    """DeleteJob of an archived job writes the purge mark, which the hub sends as
    DELETED (the job as last stored, its etag's revision), but not while a live job
    has that id again. A mark or job key no JobManager wrote (a revision of 5,000
    digits, bytes that are no Job, a key that is no UTF-8) is skipped: the watch goes on
    (it used to meet the same event again on every reconnect)."""
    hub = WatchHub(store.client, etcd_prefix, buffer_size=100)
    await hub.start()
    try:
        sub = hub.subscribe(hub.horizon)
        gone = dataclasses.replace(new_job("gone"), state=JobState.SUCCEEDED)
        await store.create(new_job("live1"))
        assert not await store.mark_purged("live1", 5, job_to_bytes(new_job("live1")))
        assert await store.mark_purged("gone", 7, job_to_bytes(gone))
        await store.client.put(store.purged_mark_key, b"9" * 5000 + b" gone\n" + job_to_bytes(gone))
        await store.client.put(store.purged_mark_key, b"3 gone\n\xff\xff\xff")
        await store.client.put(store.jobs_prefix + b"\xff\xfe", b"junk")
        await store.create(new_job("after"))
        evs = [await asyncio.wait_for(sub.next(), 60) for _ in range(3)]
        assert [(e.type, e.job_id) for e in evs] == [
            (EventType.CREATED, "live1"), (EventType.DELETED, "gone"), (EventType.CREATED, "after")]
        assert evs[1].job.state == JobState.SUCCEEDED and evs[1].job.etag == "7"
    finally:
        await hub.stop()


async def test_an_unreachable_etcd_is_unavailable_without_its_internal_details() -> None:
    """The client learns etcd is unavailable, not gRPC's debug text with etcd's internal
    address (``ipv4:...``, ``debug_error_string``), which JobManager passed on."""
    from dlsched.errors import StoreUnavailable
    from tests.harness import free_port

    client = await connect(f"127.0.0.1:{free_port()}", rpc_timeout=2)  # nothing listens there
    try:
        with pytest.raises(StoreUnavailable) as ei:
            await JobStore(client, "/dead/").get("nope")
        assert ei.value.message in ("etcd is unavailable; retry later", "etcd did not answer in time; retry later")
    finally:
        await client.close()
