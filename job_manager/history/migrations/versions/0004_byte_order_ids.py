"""PostgreSQL: ids compare in byte order; owner and cluster unbounded.

ListJobs merges the history's page with the watch cache's, and both walk
``(create_us DESC, id)``: the cache compares ids as Python does (code point
order), so the database must too. A PostgreSQL cluster made in a locale
(en_US.UTF-8: ``-`` is ignored at the first level) ordered ``a-c`` after
``ab``, and pages skipped or repeated jobs that share a create time. ``"C"``
is byte order (UTF-8's byte order is code point order); changing a column's
collation rebuilds the indexes on it. ``owner`` (an OIDC subject has no
length bound) and ``cluster`` were VARCHAR(300)/(256): one longer value failed
every batch it was in, and the archiver retried that batch for ever.

SQLite compares text with BINARY (byte order) and enforces no length: nothing
to change there.

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-06
"""

from __future__ import annotations

from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None

#: (table, column, type) of every id a keyset page compares
_IDS = [
    ("job_history", "id", "VARCHAR(128)"),
    ("job_history_labels", "job_id", "VARCHAR(128)"),
    ("job_requests", "request_id", "VARCHAR(128)"),
    ("job_requests", "job_id", "VARCHAR(128)"),
    ("job_history_deleted", "id", "VARCHAR(128)"),
]


def upgrade() -> None:
    if op.get_bind().dialect.name != "postgresql":
        return
    for table, column, type_ in _IDS:
        op.execute(f'ALTER TABLE {table} ALTER COLUMN {column} TYPE {type_} COLLATE "C"')
    op.execute("ALTER TABLE job_history ALTER COLUMN owner TYPE TEXT")
    op.execute("ALTER TABLE job_history ALTER COLUMN cluster TYPE TEXT")


def downgrade() -> None:
    if op.get_bind().dialect.name != "postgresql":
        return
    for table, column, type_ in _IDS:
        op.execute(f'ALTER TABLE {table} ALTER COLUMN {column} TYPE {type_} COLLATE "default"')
