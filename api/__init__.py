"""The REST service: database, API, worker and tokens (``rangeprof serve``); see the README's
"Service (REST API)" section. The dashboard is not built yet (see the open issues)."""
