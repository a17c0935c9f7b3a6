"""Schema migrations at start: Alembic, run programmatically to head.

The scripts live in this package (``migrations/``), so they ship with it.
The whole upgrade is one transaction: a process killed mid-migration leaves
the schema as it was and holds nothing afterwards (the database rolls the
transaction back; no lock row or lock file outlives it). On PostgreSQL,
replicas starting together serialize on a transaction-scoped advisory lock
(``pg_advisory_xact_lock``: released at commit, rollback or disconnect).
"""

from __future__ import annotations

import pathlib

import sqlalchemy as sa
from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy.ext.asyncio import AsyncEngine

SCRIPTS = pathlib.Path(__file__).resolve().parent / "migrations"
#: any fixed 64-bit number: the advisory lock the replicas' upgrades share
_PG_LOCK = 0x646C7363686564  # "dlsched"


def _config() -> Config:
    cfg = Config()
    cfg.set_main_option("script_location", str(SCRIPTS))
    return cfg


def head() -> str | None:
    return ScriptDirectory.from_config(_config()).get_current_head()


def _upgrade(conn: sa.Connection) -> None:
    if conn.dialect.name == "postgresql":
        conn.execute(sa.text("SELECT pg_advisory_xact_lock(:k)"), {"k": _PG_LOCK})
    if MigrationContext.configure(conn).get_current_revision() == head():
        return
    cfg = _config()
    cfg.attributes["connection"] = conn
    command.upgrade(cfg, "head")


async def upgrade(engine: AsyncEngine) -> None:
    """Bring the schema to head (a no-op when it is there), in one transaction."""
    async with engine.begin() as conn:
        await conn.run_sync(_upgrade)


async def current(engine: AsyncEngine) -> str | None:
    async with engine.connect() as conn:
        return await conn.run_sync(lambda c: MigrationContext.configure(c).get_current_revision())
