"""The service's schema migrations (Alembic), installed as ``rangeprof.migrations``."""
