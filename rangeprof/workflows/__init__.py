"""The jobs, once for every front end: the CLI, the service's worker and the Python API build a
typed request (:mod:`.requests`, JSON in and out) and call the job's function —
:mod:`.profiling` (``inspect``, ``profile``, ``calibrate``, ``export``) and :mod:`.quantize`
(``build``, ``evaluate``)."""
