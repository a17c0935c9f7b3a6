"""Deleted job ids: an archiver resumed after a delete must not bring the job back.

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-06
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "job_history_deleted",
        sa.Column("id", sa.String(128), primary_key=True),
        sa.Column("revision", sa.BigInteger, nullable=False),
        sa.Column("deleted_us", sa.BigInteger, nullable=False),
    )
    op.create_index("ix_job_history_deleted_at", "job_history_deleted", ["deleted_us"])


def downgrade() -> None:
    op.drop_table("job_history_deleted")
