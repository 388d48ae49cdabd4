"""Profiling: calibration data streamed batch by batch, statistics records with an exact merge,
the instrumented run (in process or on Ray) and the versioned profile document."""
