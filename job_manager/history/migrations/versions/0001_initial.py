"""The job history: archived jobs and their labels.

Revision ID: 0001
Revises:
Create Date: 2026-12-03
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "job_history",
        sa.Column("id", sa.String(128), primary_key=True),
        sa.Column("create_us", sa.BigInteger, nullable=False),
        sa.Column("end_us", sa.BigInteger, nullable=False),
        sa.Column("archived_us", sa.BigInteger, nullable=False),
        sa.Column("state", sa.SmallInteger, nullable=False),
        sa.Column("run_mode", sa.SmallInteger, nullable=False),
        sa.Column("cluster", sa.String(256), nullable=False),
        sa.Column("project", sa.String(64), nullable=False),
        sa.Column("owner", sa.String(300), nullable=False),
        sa.Column("revision", sa.BigInteger, nullable=False),
        sa.Column("data", sa.LargeBinary, nullable=False),
    )
    op.create_table(
        "job_history_labels",
        sa.Column("job_id", sa.String(128), primary_key=True),
        sa.Column("key", sa.String(317), primary_key=True),
        sa.Column("value", sa.String(256), nullable=False),
        sa.Column("create_us", sa.BigInteger, nullable=False),
    )
    # Written out (not imported from schema.py): a migration stays what it was.
    for name, table, cols in [
        ("ix_job_history_order", "job_history", ["create_us DESC", "id"]),
        ("ix_job_history_state", "job_history", ["state", "create_us DESC", "id"]),
        ("ix_job_history_cluster", "job_history", ["cluster", "create_us DESC", "id"]),
        ("ix_job_history_project", "job_history", ["project", "create_us DESC", "id"]),
        ("ix_job_history_owner", "job_history", ["owner", "create_us DESC", "id"]),
        ("ix_job_history_end", "job_history", ["end_us", "id"]),
        ("ix_job_history_labels_kv", "job_history_labels", ["key", "value", "create_us DESC", "job_id"]),
    ]:
        op.create_index(name, table, [sa.text(c) if " " in c else c for c in cols])


def downgrade() -> None:
    op.drop_table("job_history_labels")
    op.drop_table("job_history")
