"""Alembic's environment: upgrades run on the connection ``migrate.upgrade`` hands over.

That connection is already inside the one transaction the upgrade runs in,
so a process that dies mid-migration leaves nothing half-done and no lock
behind: the database rolls the transaction back (PostgreSQL's DDL is
transactional; SQLite rolls back its journal on the next open).
"""

from __future__ import annotations

from alembic import context

from job_manager.history.schema import metadata

connection = context.config.attributes["connection"]
context.configure(connection=connection, target_metadata=metadata,
                  render_as_batch=connection.dialect.name == "sqlite")
with context.begin_transaction():
    context.run_migrations()
