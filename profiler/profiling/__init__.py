"""Profiling: calibration data streamed batch by batch, statistics records with an exact merge,
the instrumented program (:mod:`.executor`, its statistics observer :mod:`.observe_statistics`),
the run (in process or on Ray), the versioned profile document and the drift of two runs'
histograms (:mod:`.drift`)."""
