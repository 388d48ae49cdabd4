"""The jobs, once for every front end: the CLI, the service's worker and the Python API build a
request (:mod:`.requests`) and call the job's function (:mod:`.quantize`: ``build``,
``evaluate``)."""
