"""Alembic migrations of the job history (run by ``HistoryStore.open``, not by hand)."""
