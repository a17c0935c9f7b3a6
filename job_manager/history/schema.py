"""The history tables (SQLAlchemy Core), as the migrations in ``migrations/`` make them.

``job_history``: one row per archived job: its stored bytes (``data``, the
same encoded Job etcd held) and the etcd mod revision it was archived at,
plus the columns ListJobs filters and orders on. Times are integer
microseconds since the epoch: ``create_us`` orders a listing (newest first,
then ``id``: the watch cache's order, so one page token spans both),
``end_us`` (end time, else last update) is what retention counts from.
``project`` is stored resolved (``default`` for a job without one), as
access rules and filters read it. ``job_history_labels``: one row per label,
with the job's ``create_us`` so a ``labels.KEY=VALUE`` page walks that
label's index in listing order. ``job_requests`` and ``job_history_deleted``:
see below.

Every listing index is ``(column, create_us DESC, id)``: a keyset page is one
index range, never an OFFSET. Ids compare in byte order, as the watch cache
compares them (PostgreSQL: ``COLLATE "C"``, migration 0004; SQLite's BINARY).
"""

from __future__ import annotations

import sqlalchemy as sa

metadata = sa.MetaData()

jobs = sa.Table(
    "job_history", metadata,
    sa.Column("id", sa.String(128), primary_key=True),
    sa.Column("create_us", sa.BigInteger, nullable=False),
    sa.Column("end_us", sa.BigInteger, nullable=False),
    sa.Column("archived_us", sa.BigInteger, nullable=False),
    sa.Column("state", sa.SmallInteger, nullable=False),
    sa.Column("run_mode", sa.SmallInteger, nullable=False),
    sa.Column("cluster", sa.Text, nullable=False),
    sa.Column("project", sa.String(64), nullable=False),
    sa.Column("owner", sa.Text, nullable=False),
    sa.Column("revision", sa.BigInteger, nullable=False),
    sa.Column("data", sa.LargeBinary, nullable=False),
)

labels = sa.Table(
    "job_history_labels", metadata,
    sa.Column("job_id", sa.String(128), primary_key=True),
    sa.Column("key", sa.String(317), primary_key=True),
    sa.Column("value", sa.String(256), nullable=False),
    sa.Column("create_us", sa.BigInteger, nullable=False),
)

#: ``job_requests``: SubmitJob's request ids of archived jobs (request_id →
#: job id), recorded by the archiver before it deletes their etcd request keys,
#: so a SubmitJob retried after its job left etcd answers that job. Deleted
#: with their job (``delete``, pruning).
requests = sa.Table(
    "job_requests", metadata,
    sa.Column("request_id", sa.String(128), primary_key=True),
    sa.Column("job_id", sa.String(128), nullable=False),
)

#: ``job_history_deleted``: job ids deleted up to an etcd revision (DeleteJob, or a job
#: the archiver found gone from etcd). ``put`` stores no row of such an id at or below that
#: revision, so an archiver that resumes after a delete (frozen with its batch picked
#: before it) cannot bring the job back; a later job of the same id has a higher revision.
#: Rows older than ``DELETED_KEPT_SECONDS`` go with pruning.
deleted = sa.Table(
    "job_history_deleted", metadata,
    sa.Column("id", sa.String(128), primary_key=True),
    sa.Column("revision", sa.BigInteger, nullable=False),
    sa.Column("deleted_us", sa.BigInteger, nullable=False),
)

#: (name, table, columns): the migrations create exactly these
INDEXES: list[tuple[str, str, list[str]]] = [
    ("ix_job_history_order", "job_history", ["create_us DESC", "id"]),
    ("ix_job_history_state", "job_history", ["state", "create_us DESC", "id"]),
    ("ix_job_history_cluster", "job_history", ["cluster", "create_us DESC", "id"]),
    ("ix_job_history_project", "job_history", ["project", "create_us DESC", "id"]),
    ("ix_job_history_owner", "job_history", ["owner", "create_us DESC", "id"]),
    ("ix_job_history_end", "job_history", ["end_us", "id"]),
    ("ix_job_history_labels_kv", "job_history_labels", ["key", "value", "create_us DESC", "job_id"]),
    ("ix_job_requests_job", "job_requests", ["job_id"]),
    ("ix_job_history_deleted_at", "job_history_deleted", ["deleted_us"]),
]
