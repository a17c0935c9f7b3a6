"""Job history: terminal jobs moved out of etcd into a SQL database.

``store.py`` the database (SQLite by default, PostgreSQL by DSN) behind one
batched writer, keyset listing, bulk pruning; ``migrate.py`` the Alembic
migrations (``migrations/``) run at start; ``archiver.py`` the leader-only
task that moves terminal jobs past the retention out of etcd, history first.
"""
