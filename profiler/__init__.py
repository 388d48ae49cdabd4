"""The profiler (``rangeprof.profiler``), one sub-package per step of the pipeline:

* :mod:`~rangeprof.profiler.ir`: load an ONNX file, import it into Relax, tag every node with
  its profileID, our Relax passes, and the lineage of IDs through every stage;
* :mod:`~rangeprof.profiler.compile`: Relax compiled to CPU code (FP32 schedules, prepacked
  weights; a target adds its own kernels as rules) and the compiled-program cache;
* :mod:`~rangeprof.profiler.profiling`: calibration data, the statistics records, the
  instrumented executor and its observer pass, the profiling run (local or on Ray), the
  versioned profile document and the drift between two runs;
* :mod:`~rangeprof.profiler.calibrate`: qparams from stored statistics, or imported from a QDQ
  model;
* :mod:`~rangeprof.profiler.export`: the profile in other tools' formats.

Each sub-package imports only those above it in this list (``tests/test_package.py``).
"""
