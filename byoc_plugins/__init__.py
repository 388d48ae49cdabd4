"""BYOC plugins that generate INT8 code from profiles (``rangeprof.byoc``): the plugin interface
and registry (:mod:`.plugin`), the partition and lowering every target shares, and one
sub-package per target (``x86``, ``aarch64``, ``npu``; ``cpu`` holds the integer kernels of the
two CPU targets)."""
