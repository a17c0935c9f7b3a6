"""SubmitJob's request ids of archived jobs.

Revision ID: 0002
Revises: 0001
Create Date: 2026-12-03
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "job_requests",
        sa.Column("request_id", sa.String(128), primary_key=True),
        sa.Column("job_id", sa.String(128), nullable=False),
    )
    op.create_index("ix_job_requests_job", "job_requests", ["job_id"])


def downgrade() -> None:
    op.drop_table("job_requests")
