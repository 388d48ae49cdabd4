"""The REST service, database and dashboard (not built yet: see the open issues)."""
