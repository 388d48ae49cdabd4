"""The profiler (``rangeprof.profiler``), one sub-package per step of the pipeline:

* :mod:`~rangeprof.profiler.ir`: load an ONNX file, import it into Relax, tag every node with
  its profileID, our Relax passes, and the lineage of IDs through every stage;
* :mod:`~rangeprof.profiler.build`: the CPU build path (schedules, prepacked weights), the
  compiled-program cache and the executor that runs it;
* :mod:`~rangeprof.profiler.profiling`: calibration data, the statistics records, the profiling
  run (local or on Ray) and the versioned profile document;
* :mod:`~rangeprof.profiler.calibrate`: qparams from stored statistics, or imported from a QDQ
  model;
* :mod:`~rangeprof.profiler.export`: the profile in other tools' formats.
"""
