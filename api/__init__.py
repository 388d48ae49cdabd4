"""The REST service (``rangeprof.service``): database, API, worker, tokens and the web dashboard
(``rangeprof serve``); see ``docs/service.md``."""
